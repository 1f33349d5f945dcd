"""What changed between points and machines: files, from the disk layers that differ,
and packages.
"""
