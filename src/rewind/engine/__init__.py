"""Runs machines: QEMU processes, their monitor, guest agent, network filter and checkpoints.
At the top, machines and their history (engine, machine, timeline); below, by part: process/,
memory/, disk/, network/, changes/ (docs/design.md draws them).

The defaults and limits live here, apart from `machine.py`, so a face can show them without importing QEMU's
side (the CLI's `--help` would pay 50 ms for it).
"""

DEFAULT_MEMORY_MIB = 512
DEFAULT_CPUS = 2
MIN_MEMORY_MIB = 192  # below this the guest's kernel and agent do not fit
MAX_CPUS = 64
MAX_DISK_MIB = 16 << 20  # 16 TiB
