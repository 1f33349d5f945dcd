"""A machine's network: its rules, the filter process that enforces them, forwarded
ports and the host's certificates and proxies.
"""
