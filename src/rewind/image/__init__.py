"""Guest images: Debian's kernel, a small initramfs and an ext4 root disk in qcow2."""

from rewind.image.build import (
    RECIPE,
    Image,
    build_image,
    find_image,
    import_image,
    list_images,
    recipe_id,
)

__all__ = ["RECIPE", "Image", "build_image", "find_image", "import_image", "list_images", "recipe_id"]
