"""A node made of a group of processes (``torchrun``, ``torch.distributed``): ``GroupSession``.

::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradientmail import DiLoCo
    from gradientmail.integrations.torchrun import GroupSession

    dist.init_process_group("gloo")          # or "nccl"; torchrun sets the environment
    model = DDP(build_model())
    with GroupSession(model.module, algorithm=DiLoCo(inner_steps=100), mailbox=url) as session:
        for batch in loader:
            loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
            session.step(samples=len(batch))  # this rank's samples; the group's are summed

Data parallelism inside the group, DiLoCo between groups. Every rank of the group holds the same
parameters (DDP keeps them so), so one rank, the group's first, holds the ``Session``: one lease
and one node identity for the whole group, one snapshot per round. Each ``step`` sums the
group's samples (one all-reduce of one number) and tells the group whether the leader merged a
commit (one broadcast of one number); after a merge the leader broadcasts the parameters, so
every rank continues from the same merged model at the same step. A rank that dies makes its
group's next collective fail on every other rank: the group leaves the run (the leader's
lease says so, or expires), and the run goes on without it.

Sharded models (FSDP2's ``fully_shard``) are not supported yet: a sharded rank holds no whole
parameter to snapshot (docs/integrations.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradientmail._session import Session
from gradientmail.core.algorithm import DiLoCo
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.mailboxes._urls import mailbox_from_url

__all__ = ["GroupSession"]


class GroupSession:
    """One node of a run made of the processes of a ``torch.distributed`` group.

    Args:
        model: this rank's model (the module inside ``DistributedDataParallel``): the same
            parameters on every rank.
        algorithm: the run's ``DiLoCo``.
        mailbox: a ``Mailbox`` or a URL for ``mailbox_from_url``; only the leader opens it.
        group: the process group of this node (the default group when None).
        **session_options: passed to the leader's ``Session`` (``learner_id`` names the
            group's node).

    Must be created, stepped and closed by every rank of the group in the same order
    (collectives); ``step`` and ``close`` raise on every rank when any rank failed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algorithm: DiLoCo,
        mailbox: Mailbox | str,
        group: dist.ProcessGroup | None = None,
        **session_options: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "GroupSession needs torch.distributed initialized (dist.init_process_group) "
                "on every rank of the group; a node of one process uses Session"
            )
        if not isinstance(algorithm, DiLoCo):
            raise TypeError(f"algorithm must be a DiLoCo, got {type(algorithm).__name__}")
        self._group = group
        self._rank = dist.get_rank(group)
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        self._params = [p for p in model.parameters()]
        self._session: Session | None = None
        self._closed = False
        failure: BaseException | None = None
        if self.is_leader:
            try:
                opened = mailbox_from_url(mailbox) if isinstance(mailbox, str) else mailbox
                self._session = Session(
                    model, algorithm=algorithm, mailbox=opened, **session_options
                )
            except BaseException as exc:  # every rank must hear of it before raising
                failure = exc
        self._agree(failure, "joining the run")
        self._broadcast_params()
        self._rounds = self._session.rounds_seen if self._session is not None else -1

    @property
    def is_leader(self) -> bool:
        """Whether this rank holds the group's ``Session``."""
        return self._rank == 0

    @property
    def session(self) -> Session | None:
        """The leader's ``Session``; None on the other ranks."""
        return self._session

    @property
    def rounds_seen(self) -> int:
        """The newest round whose commit the group's model holds (the same on every rank)."""
        return self._rounds

    def wait_for_nodes(self, count: int, *, timeout: float = 600.0) -> None:
        """A start barrier for the group: the leader's ``Session.wait_for_nodes`` (``count``
        nodes of the run, each a group or a process), then every rank goes on together."""
        failure: BaseException | None = None
        if self._session is not None:
            try:
                self._session.wait_for_nodes(count, timeout=timeout)
            except BaseException as exc:
                failure = exc
        self._agree(failure, "waiting for the run's nodes")

    def step(self, *, samples: int) -> None:
        """Account for one optimizer step of the group: ``samples`` is this rank's (tokens or
        sequences), summed over the group. Every rank continues from the same parameters."""
        if self._closed:
            raise RuntimeError("step() after close()")
        total = self._sum(samples)
        failure: BaseException | None = None
        rounds = self._rounds
        if self._session is not None:
            try:
                self._session.step(samples=total)
                rounds = self._session.rounds_seen
            except BaseException as exc:
                failure = exc
        rounds = self._agree(failure, "stepping", value=rounds)
        if rounds != self._rounds:
            self._broadcast_params()
            self._rounds = rounds

    def close(self) -> None:
        """Leave the run (the leader's ``Session.close``: last rounds published, committed and
        merged), then every rank holds the leader's final parameters."""
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        if self._session is not None:
            try:
                self._session.close()
                self._rounds = self._session.rounds_seen
            except BaseException as exc:
                failure = exc
        self._rounds = self._agree(failure, "closing", value=self._rounds)
        self._broadcast_params()

    def __enter__(self) -> GroupSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._session is not None:
            # This rank failed (or a collective did): leave without waiting for the others.
            self._closed = True
            self._session.close()

    # -- collectives ----------------------------------------------------------------------

    def _sum(self, samples: int) -> int:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be a non-negative integer, got {samples!r}")
        count = torch.tensor([samples], dtype=torch.int64)
        dist.all_reduce(count, group=self._group)
        return int(count.item())

    def _agree(self, failure: BaseException | None, doing: str, value: int = 0) -> int:
        """Broadcast the leader's outcome (ok and ``value``, or failed); raise on every rank
        when the leader failed, ``failure`` itself on the leader."""
        flag = torch.tensor([0 if failure is not None else 1, value], dtype=torch.int64)
        dist.broadcast(flag, src=self._leader, group=self._group)
        if failure is not None:
            raise failure
        if int(flag[0]) == 0:
            raise RuntimeError(f"the group's leader (rank 0) failed while {doing}; see its log")
        return int(flag[1])

    def _broadcast_params(self) -> None:
        broadcast(self._params, src=self._leader, group=self._group)


def broadcast(tensors: Sequence[torch.Tensor], *, src: int, group: Any) -> None:
    """``src``'s values of ``tensors`` into every rank's, in place, all in flight at once."""
    with torch.no_grad():
        handles = [dist.broadcast(t.data, src=src, group=group, async_op=True) for t in tensors]
        for handle in handles:
            if handle is not None:
                handle.wait()
