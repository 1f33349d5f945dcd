#!/bin/busybox sh
# The initramfs: load the modules the guest needs (the root image may have none), mount the
# root and runtime disks, hand over to the runtime disk's busybox init with its inittab.
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /newroot
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
while read -r module; do
    insmod "/$module" 2>/dev/null
done < /modules.load
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
if ! mount -t ext4 -o rw,noatime /dev/vda /newroot; then
    echo "rewind-initramfs: cannot mount the root disk /dev/vda" >&2
    poweroff -f
fi
# The runtime disk (the agent and its own Python, see build.py), read-only as QEMU attaches it.
mkdir -p /newroot/usr/lib/rewind /newroot/etc
i=0
while [ ! -b /dev/vdb ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
if ! mount -t ext4 -o ro /dev/vdb /newroot/usr/lib/rewind; then
    echo "rewind-initramfs: cannot mount the runtime disk /dev/vdb" >&2
    poweroff -f
fi
# rewind's inittab, over the image's own if it has one (the disk keeps that file).
[ -e /newroot/etc/inittab ] || : > /newroot/etc/inittab
mount --bind /newroot/usr/lib/rewind/inittab /newroot/etc/inittab
umount /proc
mkdir -p /newroot/dev
mount --move /dev /newroot/dev
exec switch_root /newroot /usr/lib/rewind/bin/busybox init
