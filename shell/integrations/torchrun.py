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
group's samples (one all-reduce of two numbers) and tells the group whether the leader merged a
commit (one broadcast of three numbers); after a merge the leader broadcasts the parameters, so
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

from gradientmail._events import Event, Merged, log_events
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
    (collectives). ``step``, ``wait_for_nodes`` and ``close`` raise on every rank when the
    leader failed or a rank passed a bad sample count; a rank that died fails the others'
    next collective (the backend's timeout or connection error).
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
        self._params = list(model.parameters())
        # NCCL moves only CUDA tensors: the group's small control messages go where it can.
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self._session: Session | None = None
        self._closed = False
        self._merges = 0  # the leader's merges, counted from its Session's Merged events
        failure: BaseException | None = None
        if self.is_leader:
            callbacks = (*session_options.pop("callbacks", (log_events,)), self._count_merge)
            try:
                opened = mailbox_from_url(mailbox) if isinstance(mailbox, str) else mailbox
                self._session = Session(
                    model,
                    algorithm=algorithm,
                    mailbox=opened,
                    callbacks=callbacks,
                    **session_options,
                )
            except BaseException as exc:  # every rank must hear of it before raising
                failure = exc
        try:
            rounds = self._session.rounds_seen if self._session is not None else -1
            self._rounds, self._merged = self._agree(failure, "joining the run", rounds, 0)
            self._broadcast_params()
        except BaseException:
            if self._session is not None:
                self._session.close()
            raise

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
        self._agree(failure, "waiting for the run's nodes", self._rounds, self._merged)

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
        self._rounds, merged = self._agree(failure, "stepping", rounds, self._merges)
        if merged != self._merged:
            # Any merge, of any fragment, in any order: the leader's count moved.
            self._broadcast_params()
            self._merged = merged

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
        self._rounds, self._merged = self._agree(failure, "closing", self._rounds, self._merges)
        self._broadcast_params()

    def __enter__(self) -> GroupSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._session is not None and not self._closed:
            # A collective failed (a rank died) or this rank raised: no collective can be
            # trusted, so the leader leaves the run on its own (Session.close publishes its
            # last progress and waits for those rounds, up to its close_timeout).
            self._closed = True
            self._session.close()

    # -- collectives ----------------------------------------------------------------------

    def _count_merge(self, event: Event) -> None:
        if isinstance(event, Merged):
            self._merges += 1

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self._device)

    def _sum(self, samples: int) -> int:
        """The group's samples; every rank raises when any rank passed a bad count (checked
        after the collective, so no rank is left waiting in it)."""
        bad = isinstance(samples, bool) or not isinstance(samples, int) or samples < 0
        count = self._tensor([0 if bad else samples, 1 if bad else 0])
        dist.all_reduce(count, group=self._group)
        total, invalid = (int(v) for v in count.tolist())
        if invalid:
            raise ValueError(
                f"samples must be a non-negative integer on every rank; {invalid} rank(s) of the "
                f"group passed another (this rank: {samples!r})"
            )
        return total

    def _agree(
        self, failure: BaseException | None, doing: str, rounds: int, merges: int
    ) -> tuple[int, int]:
        """Broadcast the leader's outcome (ok, its ``rounds_seen`` and merge count, or
        failed); raise on every rank when the leader failed, ``failure`` itself on the
        leader."""
        flag = self._tensor([0 if failure is not None else 1, rounds, merges])
        dist.broadcast(flag, src=self._leader, group=self._group)
        if failure is not None:
            raise failure
        ok, rounds, merges = (int(v) for v in flag.tolist())
        if not ok:
            raise RuntimeError(f"the group's leader (rank 0) failed while {doing}; see its log")
        return rounds, merges

    def _broadcast_params(self) -> None:
        broadcast(self._params, src=self._leader, group=self._group)


def broadcast(tensors: Sequence[torch.Tensor], *, src: int, group: Any) -> None:
    """``src``'s values of ``tensors`` into every rank's, in place, all in flight at once."""
    with torch.no_grad():
        handles = [dist.broadcast(t.data, src=src, group=group, async_op=True) for t in tensors]
        for handle in handles:
            if handle is not None:
                handle.wait()
