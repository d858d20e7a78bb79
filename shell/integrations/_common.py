"""What the framework callbacks share: opening a Session on the framework's model."""

from __future__ import annotations

from typing import Any

from gradientmail._session import Session
from gradientmail.core.algorithm import DiLoCo
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.mailboxes._urls import mailbox_from_url


class SessionHolder:
    """Opens one ``Session`` when training begins and closes it when it ends."""

    def __init__(
        self,
        algorithm: DiLoCo,
        mailbox: Mailbox | str,
        session_options: Any,
        *,
        wait_for_nodes: int = 0,
    ) -> None:
        if not isinstance(algorithm, DiLoCo):
            raise TypeError(f"algorithm must be a DiLoCo, got {type(algorithm).__name__}")
        if isinstance(wait_for_nodes, bool) or not isinstance(wait_for_nodes, int):
            raise TypeError(f"wait_for_nodes must be an integer, got {wait_for_nodes!r}")
        self.algorithm = algorithm
        self.mailbox = mailbox
        self.options = dict(session_options)
        self.wait_for_nodes = wait_for_nodes
        self.session: Session | None = None

    def open(self, model: object) -> Session:
        if self.session is not None:
            raise RuntimeError("this callback already holds a Session: one training run each")
        mailbox = mailbox_from_url(self.mailbox) if isinstance(self.mailbox, str) else self.mailbox
        session = Session(model, algorithm=self.algorithm, mailbox=mailbox, **self.options)
        if self.wait_for_nodes > 1:
            try:
                session.wait_for_nodes(self.wait_for_nodes)
            except BaseException:
                session.close()
                raise
        self.session = session
        return session

    def step(self, samples: int) -> None:
        if self.session is None:
            raise RuntimeError("training stepped before it began: no Session is open")
        self.session.step(samples=max(1, samples))

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()
