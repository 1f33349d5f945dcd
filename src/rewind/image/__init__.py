"""The guest image: Debian's kernel, a small initramfs and an ext4 root disk in qcow2."""

from rewind.image.build import RECIPE, Image, build_image, find_image, recipe_id

__all__ = ["RECIPE", "Image", "build_image", "find_image", "recipe_id"]
