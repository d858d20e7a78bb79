"""What users of the library test with: the mailbox conformance suite every store must pass
(``check_mailbox``), the audit of a run's invariants from its records (``audit``), and virtual
time (``VirtualClock``, ``NodeClock``, ``Scheduler``) to run nodes in one thread.

Importing ``gradientmail.testing`` pulls in no framework.
"""

from gradientmail.testing._audit import AuditError, AuditReport, audit, audit_async
from gradientmail.testing._conformance import check_mailbox
from gradientmail.testing._virtual import Crashed, NodeClock, Scheduler, VirtualClock

__all__ = [
    "AuditError",
    "AuditReport",
    "Crashed",
    "NodeClock",
    "Scheduler",
    "VirtualClock",
    "audit",
    "audit_async",
    "check_mailbox",
]
