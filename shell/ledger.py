"""What a node's learner and syncer share: the rounds it published to and the commits it has
read. Lock-guarded, since the two loops run on different threads in a real process."""

from __future__ import annotations

import threading

import attrs

from gradientmail.adapters.base import Tensors
from gradientmail.core.records import Commit

__all__ = ["Ledger", "OwnSnapshot"]


@attrs.frozen(kw_only=True, eq=False)
class OwnSnapshot:
    """This node's snapshot of a round as its learner published it: the record's ``nonce``
    and payload ``digest``, and the F32 ``delta`` that decoding the payload gives back (an
    unquantized payload holds exactly its bytes)."""

    nonce: str
    digest: str
    delta: Tensors


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: set[int] = set()
        self._commits: dict[int, Commit] = {}
        self._peers: set[str] = set()
        self._own: dict[int, OwnSnapshot] = {}
        self._params: dict[int, tuple[str, Tensors]] = {}  # round -> (commit nonce, params)

    def published(self, r: int, own: OwnSnapshot | None = None) -> None:
        """This node has a snapshot in round ``r``: its syncer watches the round. ``own``, kept
        until the round is committed or unwatched, spares its closer decoding the payload."""
        with self._lock:
            if r not in self._commits:
                self._watched.add(r)
                if own is not None:
                    self._own[r] = own

    def own(self, r: int) -> OwnSnapshot | None:
        """What this node published in round ``r`` while the round is watched (see above)."""
        with self._lock:
            return self._own.get(r)

    def committed(self, commit: Commit, params: Tensors | None = None) -> None:
        """Round ``commit.round`` is committed. ``params``, from the node that wrote the
        commit, are its parameters as the backend's tensors: what loading its ``params``
        payload would give, handed once to the learner (``take_params``)."""
        with self._lock:
            self._commits[commit.round] = commit
            if params is not None:
                self._params[commit.round] = (commit.nonce, params)
            self._peers.update(i.node for i in commit.included)
            self._watched.discard(commit.round)
            self._own.pop(commit.round, None)
            # Only the previous round of each fragment is consulted; keep a bounded window.
            for old in [r for r in self._commits if r < commit.round - 64]:
                del self._commits[old]
                self._params.pop(old, None)

    def take_params(self, commit: Commit) -> Tensors | None:
        """The parameters this node's syncer handed over with ``commit`` (same round and
        nonce), once; None when it handed none."""
        with self._lock:
            held = self._params.get(commit.round)
            if held is None or held[0] != commit.nonce:
                return None
            del self._params[commit.round]
            return held[1]

    def commit(self, r: int) -> Commit | None:
        with self._lock:
            return self._commits.get(r)

    def peers(self) -> frozenset[str]:
        """Every node a commit read since joining included: known to have trained in the run."""
        with self._lock:
            return frozenset(self._peers)

    def watched(self) -> list[int]:
        with self._lock:
            return sorted(self._watched)

    def unwatch(self, r: int) -> None:
        with self._lock:
            self._watched.discard(r)
            self._own.pop(r, None)
