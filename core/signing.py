"""Run secrets and record signatures: HMAC-SHA256 over a record's canonical JSON.

A signed run gives every node the same secret (never stored in the mailbox). A writer adds a
``signature`` field to each record it writes: the HMAC-SHA256, under the secret, of the
canonical JSON of every other field of the record (``records.to_bytes``). The record carries
its round, its node and the SHA-256 of every payload it references, so the signature covers
all of them: a forged, altered or replayed record (an old snapshot under a new round's key) is
told apart from a genuine one by the reader (``records.read_record``).

Rotation. A ``Keyring`` holds one or two secrets: it signs with the first and accepts a
signature by either, so a run can move to a new secret without stopping (docs/security.md
gives the procedure).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

import attrs

__all__ = ["MAX_SECRETS", "MIN_SECRET_BYTES", "SIGNATURE_FIELD", "Keyring"]

MIN_SECRET_BYTES = 16
"""The shortest secret accepted, in bytes: HMAC-SHA256 is only as strong as its key."""

MAX_SECRETS = 2
"""Secrets a keyring may hold: the one it signs with and, during a rotation, one other."""

SIGNATURE_FIELD = "signature"
"""The record field that holds the signature (64 lowercase hex digits)."""

_SEPARATORS = re.compile(r"[,\n]")
_HINT = "generate one with: python -c 'import secrets; print(secrets.token_hex(32))'"


def _secrets(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    if not isinstance(value, tuple) or not 1 <= len(value) <= MAX_SECRETS:
        raise ValueError(f"a keyring holds 1 to {MAX_SECRETS} secrets")
    for secret in value:
        if not isinstance(secret, bytes):
            raise TypeError(f"a secret is bytes, got {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"a run secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}; "
                + _HINT
            )


@attrs.frozen(kw_only=True)
class Keyring:
    """The run secrets a node holds: it signs with ``secrets[0]`` and accepts a signature made
    with any of them. Never printed: the repr shows only how many secrets it holds."""

    secrets: tuple[bytes, ...] = attrs.field(validator=_secrets, repr=False)

    def __repr__(self) -> str:
        return f"Keyring(<{len(self.secrets)} secret(s)>)"

    @classmethod
    def of(cls, *secrets: bytes | str) -> Keyring:
        """A keyring of ``secrets`` (text is taken as UTF-8), the signing one first."""
        return cls(secrets=tuple(s.encode() if isinstance(s, str) else s for s in secrets))

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """The secrets written in ``text`` (an environment variable or a file): one, or two
        separated by a comma or a newline, the signing one first; surrounding whitespace is
        ignored. Raises ``ValueError`` when there are none, more than two, or one is short."""
        found = [part.strip() for part in _SEPARATORS.split(text)]
        return cls.of(*(part for part in found if part))

    def sign(self, body: bytes) -> str:
        """The signature of ``body``: HMAC-SHA256 under the first secret, as 64 hex digits."""
        return hmac.new(self.secrets[0], body, hashlib.sha256).hexdigest()

    def verify(self, body: bytes, signature: object) -> bool:
        """Whether ``signature`` is ``body``'s signature under any of the secrets (compared in
        constant time)."""
        if not isinstance(signature, str) or not signature.isascii():
            return False  # compare_digest raises TypeError on non-ASCII text
        expected: Iterable[str] = (
            hmac.new(secret, body, hashlib.sha256).hexdigest() for secret in self.secrets
        )
        return any(hmac.compare_digest(e, signature) for e in expected)
