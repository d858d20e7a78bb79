"""Executable models of the gradientmail protocol, explored exhaustively.

``specs.world`` is the environment every driver shares (the Hypothesis state machine in
tests/core/test_stateful.py, the explorer and the random walk in ``specs.explore``): nodes'
rule states, a mailbox of immutable objects with create-only semantics, integer virtual time
and faults. Every protocol decision calls the real ``gradientmail.core`` rules, so a model
cannot drift from the code. ``python -m specs explore --help`` runs the explorer.
"""
