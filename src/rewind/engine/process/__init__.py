"""A machine's QEMU process: which QEMU and board, its command line and monitor, the
accelerator probe, the booted template, and the home's spawner that forks helpers.
"""
