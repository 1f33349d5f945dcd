#!/usr/lib/rewind/bin/busybox sh
# First thing init runs in the guest: mount the kernel file systems and bring the network up
# (QEMU user-mode network). Only the runtime disk's own busybox is used: the root may be any
# image, without a shell, busybox or iproute2 of its own. The drivers were loaded by the
# initramfs, for the same reason (an image has no kernel modules).
bb=/usr/lib/rewind/bin/busybox
$bb mkdir -p /proc /sys /dev/pts /dev/shm /run /tmp
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
$bb mount -t devpts -o gid=5,mode=620 devpts /dev/pts
$bb mount -t tmpfs -o mode=1777 tmpfs /dev/shm
$bb mount -t tmpfs -o mode=755 tmpfs /run
[ -s /etc/hostname ] && $bb hostname -F /etc/hostname
$bb ip link set lo up
if $bb ip link set eth0 up 2>/dev/null; then
    $bb ip addr add 10.0.2.15/24 dev eth0
    $bb ip route add default via 10.0.2.2
fi
