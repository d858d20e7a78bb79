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

A model sharded by FSDP2 (``fully_shard`` over the group) is detected from its parameters
(``DTensor``s): then no rank holds a whole parameter, and none gathers one. Rank ``i`` of every
group holds the ``i``-th shard of every parameter, so the run is split the same way: rank ``i``
of each group takes part, under the group's node id, in the run of shard ``i``, kept at
``shard_url(url, i, ranks)`` (a prefix under ``url``). DiLoCo's outer step is elementwise, so a
shard's run is exactly DiLoCo on those coordinates; each rank snapshots, closes and merges only
its own shard (its base and outer momentum are its shard's), every rank steps its ``Session``
with the group's summed samples, and every collective of the group says whether any rank failed.
All groups of a run must have the same number of ranks and shard the same way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch
import torch.distributed as dist

from gradientmail._events import Event, Merged, log_events
from gradientmail._session import Session, default_learner_id
from gradientmail.core.algorithm import DiLoCo
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.mailboxes._urls import mailbox_from_url

__all__ = ["GroupSession", "shard_module", "shard_url"]

_NONE = 2**62  # a rank that holds no shard of any parameter: no rounds of its own to count


class GroupSession:
    """One node of a run made of the processes of a ``torch.distributed`` group.

    Args:
        model: this rank's model: the module inside ``DistributedDataParallel`` (the same
            parameters on every rank), or a module sharded by FSDP2's ``fully_shard`` over the
            group (every trainable parameter a ``DTensor`` sharded on a 1-D mesh of the group's
            ranks).
        algorithm: the run's ``DiLoCo``.
        mailbox: a ``Mailbox`` or a URL for ``mailbox_from_url``; with DDP only the leader
            opens it. A sharded model needs a URL: rank ``i`` opens ``shard_url(mailbox, i, n)``.
        group: the process group of this node (the default group when None).
        **session_options: passed to each ``Session`` (``learner_id`` names the group's node;
            by default the leader's host name and process id, the same on every rank).

    Must be created, stepped and closed by every rank of the group in the same order
    (collectives). ``step``, ``wait_for_nodes`` and ``close`` raise on every rank when a rank
    holding a ``Session`` failed or a rank passed a bad sample count; a rank that died fails
    the others' next collective (the backend's timeout or connection error).
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
        self._ranks = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        # NCCL moves only CUDA tensors: the group's small control messages go where it can.
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        shards = _local_shards(model, self._ranks)
        self._sharded = shards is not None
        self._params = [] if shards is not None else list(model.parameters())
        self._session: Session | None = None
        self._closed = False
        self._merges = 0  # this rank's Session's merges, counted from its Merged events
        if shards is not None:
            if not isinstance(mailbox, str | os.PathLike):
                raise TypeError(
                    "mailbox: a model sharded by fully_shard needs the run's URL (each rank "
                    f"opens its shard's run under it), not a {type(mailbox).__name__}"
                )
            url = os.fspath(mailbox)
            mailbox = shard_url(url, self._rank, self._ranks)
            agreed: list[str | None] = [None, None]
            checking: BaseException | None = None
            if self.is_leader:
                agreed[0] = session_options.get("learner_id") or default_learner_id()
                try:
                    agreed[1] = _other_group_sizes(url, self._ranks)
                except BaseException as exc:  # every rank must hear of it before raising
                    checking = exc
                    agreed[1] = f"the group's leader failed reading {url}: {exc}"
            dist.broadcast_object_list(agreed, src=self._leader, group=group)
            if checking is not None:
                raise checking
            if agreed[1] is not None:
                raise ValueError(agreed[1])
            session_options["learner_id"] = agreed[0]
        failure: BaseException | None = None
        if self._holds_session(shards):
            callbacks = (*session_options.pop("callbacks", (log_events,)), self._count_merge)
            try:
                opened = mailbox_from_url(mailbox) if isinstance(mailbox, str) else mailbox
                self._session = Session(
                    shard_module(shards) if shards is not None else model,
                    algorithm=algorithm,
                    mailbox=opened,
                    callbacks=callbacks,
                    **session_options,
                )
            except BaseException as exc:  # every rank must hear of it before raising
                failure = exc
        try:
            self._rounds, self._merged = self._agree(failure, "joining the run", self._mine(), 0)
            self._broadcast_params()
        except BaseException:
            if self._session is not None:
                self._session.close()
            raise

    def _holds_session(self, shards: dict[str, torch.Tensor] | None) -> bool:
        return bool(shards) if shards is not None else self.is_leader

    @property
    def is_leader(self) -> bool:
        """Whether this rank is the group's first (with DDP, the one holding the ``Session``)."""
        return self._rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (FSDP2): every rank then holds its shard's ``Session``."""
        return self._sharded

    @property
    def session(self) -> Session | None:
        """This rank's ``Session``: with DDP the leader's (None on the other ranks); with a
        sharded model its shard's (None on a rank whose shard of every parameter is empty)."""
        return self._session

    @property
    def rounds_seen(self) -> int:
        """The newest round whose commit the group's model holds (the same on every rank; for
        a sharded model, the oldest over the shards' runs)."""
        return self._rounds

    def wait_for_nodes(self, count: int, *, timeout: float = 600.0) -> None:
        """A start barrier for the group: each ``Session.wait_for_nodes`` (``count`` nodes of
        the run, each a group or a process), then every rank goes on together."""
        failure: BaseException | None = None
        if self._session is not None:
            try:
                self._session.wait_for_nodes(count, timeout=timeout)
            except BaseException as exc:
                failure = exc
        self._agree(failure, "waiting for the run's nodes", self._mine(), self._merges)

    def step(self, *, samples: int) -> None:
        """Account for one optimizer step of the group: ``samples`` is this rank's (tokens or
        sequences), summed over the group. Every rank continues from the same parameters."""
        if self._closed:
            raise RuntimeError("step() after close()")
        total = self._sum(samples)
        failure: BaseException | None = None
        if self._session is not None:
            try:
                self._session.step(samples=total)
            except BaseException as exc:
                failure = exc
        self._rounds, merged = self._agree(failure, "stepping", self._mine(), self._merges)
        if merged != self._merged:
            # Any merge, of any fragment, in any order: the leader's count moved.
            self._broadcast_params()
            self._merged = merged

    def close(self) -> None:
        """Leave the run (each ``Session.close``: last rounds published, committed and
        merged), then every rank holds the group's final parameters."""
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        if self._session is not None:
            try:
                self._session.close()
            except BaseException as exc:
                failure = exc
        self._rounds, self._merged = self._agree(failure, "closing", self._mine(), self._merges)
        self._broadcast_params()

    def __enter__(self) -> GroupSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._session is not None and not self._closed:
            # A collective failed (a rank died) or this rank raised: no collective can be
            # trusted, so each Session leaves the run on its own (Session.close publishes its
            # last progress and waits for those rounds, up to its close_timeout).
            self._closed = True
            self._session.close()

    # -- collectives ----------------------------------------------------------------------

    def _count_merge(self, event: Event) -> None:
        if isinstance(event, Merged):
            self._merges += 1

    def _mine(self) -> int:
        """This rank's newest merged round (what the group agrees on)."""
        if self._session is not None:
            return self._session.rounds_seen
        return _NONE if self._sharded else -1

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
        """The group's outcome: with DDP the leader's (ok, its ``rounds_seen`` and merge
        count), broadcast; with a sharded model every rank's, reduced (any failure, the oldest
        round). Raises on every rank when a rank failed, ``failure`` itself on that rank."""
        if self._sharded:
            flag = self._tensor([0 if failure is None else 1, -rounds])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            if failure is not None:
                raise failure
            failed, oldest = (int(v) for v in flag.tolist())
            if failed:
                raise RuntimeError(f"a rank of the group failed while {doing}; see its log")
            return (-oldest if -oldest != _NONE else -1), merges
        flag = self._tensor([0 if failure is not None else 1, rounds, merges])
        dist.broadcast(flag, src=self._leader, group=self._group)
        if failure is not None:
            raise failure
        ok, rounds, merges = (int(v) for v in flag.tolist())
        if not ok:
            raise RuntimeError(f"the group's leader (rank 0) failed while {doing}; see its log")
        return rounds, merges

    def _broadcast_params(self) -> None:
        if not self._sharded:
            broadcast(self._params, src=self._leader, group=self._group)


def shard_url(url: str, rank: int, ranks: int) -> str:
    """Where the run of shard ``rank`` of ``ranks`` lives: ``shard-<rank>-of-<ranks>`` under
    ``url`` (a path, or a mailbox URL whose query is kept). For ``align``, ``audit`` and
    ``gradientmail status`` on one shard of a run of FSDP2 groups."""
    if not 0 <= rank < ranks:
        raise ValueError(f"shard_url: rank {rank} is not one of {ranks} ranks")
    leaf = f"shard-{rank}-of-{ranks}"
    if "://" not in url:
        return os.path.join(url, leaf)
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + leaf))


def shard_module(tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``tensors`` themselves (same storage), under their dotted
    names: what a rank's ``Session`` wraps when its model is sharded, and what ``align``
    loads one shard of a run into."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=True))
    return root


def _other_group_sizes(url: str, ranks: int) -> str | None:
    """Why ``url`` cannot take a group of ``ranks`` sharded ranks (its shard runs were made by
    groups of another size, which would train apart from this one), or None. One LIST of the
    first shard's runs, at join."""
    prefix = "shard-0-of-"
    listed = asyncio.run(_list(mailbox_from_url(url), prefix))
    sizes = {key[len(prefix) :].split("/", 1)[0] for key in listed}
    others = sorted(size for size in sizes if size != str(ranks))
    if not others:
        return None
    return (
        f"{url} holds the runs of groups of {' and '.join(others)} sharded rank(s) "
        f"({prefix}{others[0]}/...); this group has {ranks}: every group of a run must have "
        "as many ranks and shard its model the same way"
    )


async def _list(mailbox: Mailbox, prefix: str) -> list[str]:
    try:
        return [info.key for info in await mailbox.list(prefix)]
    finally:
        await mailbox.close()


def _local_shards(model: torch.nn.Module, ranks: int) -> dict[str, torch.Tensor] | None:
    """This rank's non-empty shards of ``model``'s trainable parameters, sharing their storage;
    None when no parameter is a ``DTensor`` (DDP). Raises naming a parameter that is not
    sharded over a 1-D mesh of the group's ranks."""
    from torch.distributed.tensor import DTensor, Shard

    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not any(isinstance(p, DTensor) for _, p in trainable):
        return None
    shards: dict[str, torch.Tensor] = {}
    for name, p in trainable:
        if not isinstance(p, DTensor):
            raise ValueError(
                f"parameter {name!r} is not sharded while others are: shard every trainable "
                "parameter with fully_shard (or none, for DDP)"
            )
        mesh = p.device_mesh
        if (
            mesh.ndim != 1
            or mesh.size() != ranks
            or not all(isinstance(placement, Shard) for placement in p.placements)
        ):
            raise ValueError(
                f"parameter {name!r} is placed {tuple(p.placements)} on a mesh of shape "
                f"{tuple(mesh.shape)}; GroupSession takes parameters sharded (fully_shard) over "
                f"a 1-D mesh of the group's {ranks} ranks"
            )
        local = p.to_local().detach()
        if local.numel():
            shards[name] = local
    return shards


def broadcast(tensors: Sequence[torch.Tensor], *, src: int, group: Any) -> None:
    """``src``'s values of ``tensors`` into every rank's, in place, all in flight at once."""
    with torch.no_grad():
        handles = [dist.broadcast(t.data, src=src, group=group, async_op=True) for t in tensors]
        for handle in handles:
            if handle is not None:
                handle.wait()
