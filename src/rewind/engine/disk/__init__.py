"""A machine's disk: its chain of qcow2 layers, read on the host (qcow2, ext4) and merged
for starts.
"""
