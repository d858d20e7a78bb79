"""What a node's learner and syncer share: the rounds it published to and the commits it has
read. Lock-guarded, since the two loops run on different threads in a real process."""

from __future__ import annotations

import threading

from gradientmail.core.records import Commit

__all__ = ["Ledger"]


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: set[int] = set()
        self._commits: dict[int, Commit] = {}
        self._peers: set[str] = set()

    def published(self, r: int) -> None:
        """This node has a snapshot in round ``r``: its syncer watches the round."""
        with self._lock:
            if r not in self._commits:
                self._watched.add(r)

    def committed(self, commit: Commit) -> None:
        with self._lock:
            self._commits[commit.round] = commit
            self._peers.update(i.node for i in commit.included)
            self._watched.discard(commit.round)
            # Only the previous round of each fragment is consulted; keep a bounded window.
            for old in [r for r in self._commits if r < commit.round - 64]:
                del self._commits[old]

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
