"""The simulator: many nodes of the library's own code (``gradientmail._node.Node``) in one
thread, on virtual time, over an in-memory store with faults; checked as it runs and audited
at the end. It lives beside ``specs/``, outside the installed package: ``python -m sim --help``.
"""
