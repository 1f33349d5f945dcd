"""Runs machines: QEMU processes, their monitor, guest agent, network filter and checkpoints.

The defaults live here, apart from `machine.py`, so a face can show them without importing QEMU's
side (the CLI's `--help` would pay 50 ms for it).
"""

DEFAULT_MEMORY_MIB = 512
DEFAULT_CPUS = 2
