"""The node runtime (private): executors of the core rules over a mailbox, a clock and a
model. ``Session`` and the simulator use ``Node``."""

from gradientmail._node.node import Node

__all__ = ["Node"]
