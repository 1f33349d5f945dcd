#!/bin/sh
# First thing busybox init runs in the guest: mount the kernel file systems,
# load the drivers rewind uses, bring the network up (QEMU user-mode network).
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
modprobe -a virtio_console virtio_net virtio_rng 2>/dev/null
hostname -F /etc/hostname
ip link set lo up
if ip link set eth0 up 2>/dev/null; then
    ip addr add 10.0.2.15/24 dev eth0
    ip route add default via 10.0.2.2
fi
