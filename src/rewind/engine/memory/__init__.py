"""A machine's memory at a checkpoint: the background snapshot, capture by the pages
written, QEMU's migration stream split into files, memory images on tmpfs.
"""
