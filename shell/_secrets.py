"""Where a node finds its run secret: an argument, a file, or the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gradientmail.core.join import SECRET_ENV, SECRET_FILE_ENV
from gradientmail.core.signing import Keyring

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "Secret", "keyring_from"]

Secret = bytes | str | Keyring | Sequence[bytes | str]


def keyring_from(
    secret: Secret | None = None,
    secret_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Keyring | None:
    """The node's run secrets: ``secret`` (one, or a sequence of two: the signing one first),
    else the file ``secret_file``, else ``$GRADIENTMAIL_SECRET``, else the file named by
    ``$GRADIENTMAIL_SECRET_FILE``; None when there is none (an unsigned run). Text secrets are
    UTF-8; a file or variable holds one secret, or two separated by a comma or a newline.
    Raises ``ValueError`` for both arguments at once, or a secret under 16 bytes."""
    if secret is not None and secret_file is not None:
        raise ValueError("pass secret= or secret_file=, not both")
    if isinstance(secret, Keyring):
        return secret
    if isinstance(secret, bytes | str):
        return Keyring.of(secret)
    if secret is not None:
        return Keyring.of(*secret)
    environ = os.environ if environ is None else environ
    if secret_file is None and environ.get(SECRET_ENV):
        return Keyring.parse(environ[SECRET_ENV])
    path = secret_file if secret_file is not None else environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        return Keyring.parse(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"secret file {os.fspath(path)!r}: {exc}") from None
