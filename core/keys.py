"""The key layout of a run, in one place: every key the protocol reads or writes is built and
parsed here.

Round numbers are zero-padded to 20 digits so lexicographic order (how stores list) is numeric
order. Node ids are ``[a-z0-9-]{1,64}``; nonces are 16 lowercase hex digits.

::

    manifest                                  create-only: the run (and its initial commit)
    manifest-<slot:04>                        the same, when every earlier manifest key holds an
                                              object that does not verify (core.slots)
    init/<fragment:04>-<nonce>                initial parameters of a fragment
    leases/<node>                             overwritten by its owner only
    heads/<fragment:04>                       advisory hint: a recent commit round of a fragment
    rounds/<round:020>/snapshots/<node>       create-only: one node's delta for the round
    rounds/<round:020>/snapshots/<node>.<slot:04>
                                              the same, behind squatted keys (core.slots)
    rounds/<round:020>/claims/<attempt:04>    create-only: who closes the round, attempt a
    rounds/<round:020>/params-<nonce>         the fragment's parameters after the round
    rounds/<round:020>/state-<nonce>          F32 master parameters and outer momentum
    rounds/<round:020>/commit                 create-only round record, written last
    rounds/<round:020>/commit-<slot:04>       the same, when every earlier commit key of the round
                                              holds an object that does not verify (core.slots)
"""

from __future__ import annotations

import functools
import re
from typing import Literal

import attrs

from gradientmail.core.errors import FormatError

MANIFEST = "manifest"
LEASES = "leases/"
ROUNDS = "rounds/"
NODE_PATTERN = re.compile(r"[a-z0-9-]{1,64}")
NONCE_PATTERN = re.compile(r"[0-9a-f]{16}")
MAX_ROUND = 10**20 - 1
MAX_ATTEMPT = 9999
MAX_FRAGMENT = 9999
MAX_SLOT = 9999

Kind = Literal[
    "manifest", "init", "lease", "head", "snapshot", "claim", "params", "state", "commit"
]


def check_node(node: str) -> str:
    """Return ``node`` if it is a valid node id, else raise ``ValueError`` saying the rule."""
    if not isinstance(node, str) or not NODE_PATTERN.fullmatch(node):
        raise ValueError(f"node id {node!r} must match [a-z0-9-]{{1,64}}")
    return node


def check_nonce(nonce: str) -> str:
    if not isinstance(nonce, str) or not NONCE_PATTERN.fullmatch(nonce):
        raise ValueError(f"nonce {nonce!r} must be 16 lowercase hex digits")
    return nonce


def _round(r: int) -> str:
    if not 0 <= r <= MAX_ROUND:
        raise ValueError(f"round {r} outside 0..{MAX_ROUND}")
    return f"{r:020d}"


def _fragment(fragment: int) -> str:
    if not isinstance(fragment, int) or not 0 <= fragment <= MAX_FRAGMENT:
        raise ValueError(f"fragment {fragment!r} outside 0..{MAX_FRAGMENT}")
    return f"{fragment:04d}"


def init(fragment: int, nonce: str) -> str:
    return f"init/{_fragment(fragment)}-{check_nonce(nonce)}"


def lease(node: str) -> str:
    return LEASES + check_node(node)


def head(fragment: int) -> str:
    return f"heads/{_fragment(fragment)}"


def round_prefix(r: int) -> str:
    return f"{ROUNDS}{_round(r)}/"


def snapshots(r: int) -> str:
    """The prefix under which round ``r``'s snapshots are listed."""
    return round_prefix(r) + "snapshots/"


def snapshot(r: int, node: str, slot: int = 0) -> str:
    """Node ``node``'s snapshot key number ``slot`` of round ``r``: ``<node>`` for the first,
    ``<node>.0001`` on (``core.slots``: its snapshot is the first of them that verifies; ``.``
    is outside the node id's characters, so no slot key is another node's)."""
    name = snapshots(r) + check_node(node)
    return name if _slot(slot) == 0 else f"{name}.{slot:04d}"


def manifest(slot: int = 0) -> str:
    """The run's manifest key number ``slot``: ``manifest``, then ``manifest-0001`` on
    (``core.slots``: the run's manifest is the first of them that verifies)."""
    return MANIFEST if _slot(slot) == 0 else f"{MANIFEST}-{slot:04d}"


def _slot(slot: int) -> int:
    if not isinstance(slot, int) or not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot {slot!r} outside 0..{MAX_SLOT}")
    return slot


def claims(r: int) -> str:
    return round_prefix(r) + "claims/"


def claim(r: int, attempt: int) -> str:
    if not 0 <= attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt {attempt} outside 0..{MAX_ATTEMPT}")
    return f"{claims(r)}{attempt:04d}"


def params(r: int, nonce: str) -> str:
    return f"{round_prefix(r)}params-{check_nonce(nonce)}"


def state(r: int, nonce: str) -> str:
    return f"{round_prefix(r)}state-{check_nonce(nonce)}"


def commit(r: int, slot: int = 0) -> str:
    """Round ``r``'s commit key number ``slot``: ``commit`` for the first, ``commit-0001`` on
    (``core.slots``: the round's commit is the first of them that verifies)."""
    return round_prefix(r) + ("commit" if _slot(slot) == 0 else f"commit-{slot:04d}")


@attrs.frozen(kw_only=True)
class ParsedKey:
    """A key of ours taken apart; fields that do not apply to its kind are None."""

    kind: Kind
    round: int | None = None
    node: str | None = None
    attempt: int | None = None
    fragment: int | None = None
    nonce: str | None = None
    slot: int | None = None


_PATTERNS: tuple[tuple[Kind, re.Pattern[str]], ...] = (
    ("manifest", re.compile(r"manifest(?:-(?P<slot>(?!0000)[0-9]{4}))?")),
    ("init", re.compile(r"init/(?P<fragment>[0-9]{4})-(?P<nonce>[0-9a-f]{16})")),
    ("lease", re.compile(r"leases/(?P<node>[a-z0-9-]{1,64})")),
    ("head", re.compile(r"heads/(?P<fragment>[0-9]{4})")),
    (
        "snapshot",
        re.compile(
            r"rounds/(?P<round>[0-9]{20})/snapshots/(?P<node>[a-z0-9-]{1,64})"
            r"(?:\.(?P<slot>(?!0000)[0-9]{4}))?"
        ),
    ),
    ("claim", re.compile(r"rounds/(?P<round>[0-9]{20})/claims/(?P<attempt>[0-9]{4})")),
    ("params", re.compile(r"rounds/(?P<round>[0-9]{20})/params-(?P<nonce>[0-9a-f]{16})")),
    ("state", re.compile(r"rounds/(?P<round>[0-9]{20})/state-(?P<nonce>[0-9a-f]{16})")),
    ("commit", re.compile(r"rounds/(?P<round>[0-9]{20})/commit(?:-(?P<slot>(?!0000)[0-9]{4}))?")),
)


_SLOTTED = ("manifest", "snapshot", "commit")


@functools.lru_cache(maxsize=8192)
def parse(key: str) -> ParsedKey:
    """Take a key of ours apart; ``FormatError`` naming the key when it is not one of ours.
    Memoized (a failure is not): a node parses the same few keys at every LIST."""
    for kind, pattern in _PATTERNS:
        match = pattern.fullmatch(key)
        if match:
            groups = match.groupdict()
            return ParsedKey(
                kind=kind,
                round=int(groups["round"]) if "round" in groups else None,
                node=groups.get("node"),
                attempt=int(groups["attempt"]) if "attempt" in groups else None,
                fragment=int(groups["fragment"]) if "fragment" in groups else None,
                nonce=groups.get("nonce"),
                slot=int(groups["slot"] or 0) if kind in _SLOTTED else None,
            )
    raise FormatError("not a key of a gradientmail run", key=key)
