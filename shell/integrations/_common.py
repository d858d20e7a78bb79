"""What the framework callbacks share: opening a Session on the framework's model."""

from __future__ import annotations

from typing import Any

from gradientmail._session import Session
from gradientmail.core.algorithm import DiLoCo
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.mailboxes._urls import mailbox_from_url


class SessionHolder:
    """Opens one ``Session`` when training begins and closes it when it ends."""

    def __init__(self, algorithm: DiLoCo, mailbox: Mailbox | str, session_options: Any) -> None:
        if not isinstance(algorithm, DiLoCo):
            raise TypeError(f"algorithm must be a DiLoCo, got {type(algorithm).__name__}")
        self.algorithm = algorithm
        self.mailbox = mailbox
        self.options = dict(session_options)
        self.session: Session | None = None

    def open(self, model: object) -> Session:
        if self.session is not None:
            raise RuntimeError("this callback already holds a Session: one training run each")
        mailbox = mailbox_from_url(self.mailbox) if isinstance(self.mailbox, str) else self.mailbox
        self.session = Session(model, algorithm=self.algorithm, mailbox=mailbox, **self.options)
        return self.session

    def step(self, samples: int) -> None:
        if self.session is None:
            raise RuntimeError("training stepped before it began: no Session is open")
        self.session.step(samples=max(1, samples))

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()
