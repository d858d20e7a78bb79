"""Test helpers that ship with the library: the mailbox conformance suite, the run audit,
virtual time and the simulator.

``check_mailbox`` and ``audit`` are importable from here; the rest lives in submodules so that
importing ``gradientmail.testing`` pulls in no framework.
"""

from gradientmail.testing.audit import AuditError, AuditReport, audit
from gradientmail.testing.mailbox import check_mailbox

__all__ = ["AuditError", "AuditReport", "audit", "check_mailbox"]
