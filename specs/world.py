"""The world: ``initial(config)``, ``successors(world)`` and ``apply(world, event)``.

A node is the library's own machines (``gradientmail.core``: ``join.step``, ``polling.step``,
``syncer.step``, the ``learner`` rules), driven as ``gradientmail._node.drive`` drives them:
call the rule with the loop's view and the node's clock, carry out the effects
(``specs.execute``), feed the results to the next call, and wait until the rule's deadline or a
message. This module only says which atomic steps exist and when they may happen; every
protocol decision is a rule's.

Events, per node ``i`` (``Event.kind``):

====================  =======================================================================
join                  start a process (a restart when the node is down: a new nonce)
step <loop>           run loop ``join``, ``learner`` or ``syncer`` one step (``Config.grain``);
                      ``outcome`` faults its first create: lost in transit, or ambiguous
train                 apply delivered commits, then one inner step (``learner.step``); a
                      publish captures a job for the learner loop (``Node.step``)
merge                 apply the first delivered commit while ``step`` is blocked or closing
leave / finish        ``Node.close``: ``learner.close`` and the syncer told to leave / once
                      the learner is done, both loops told to stop
crash                 the process dies, losing everything volatile
pause / resume        the whole process freezes / goes on (a long GC, a suspended VM)
tick / fast / slow    virtual time advances (all clocks, one clock ahead, one clock behind)
====================  =======================================================================

``tick`` waits until no running, unpaused node has a loop due (a message or result to take in,
or its deadline reached): a node whose loops fall behind is a paused one (budgeted). Training
is the user's loop and has no timing.

State constraints (``Config``): training publishes below ``rounds``, anything below
``rounds + fragments``; ``steps`` per incarnation; ``attempts`` per round; crash, fault and pause
budgets; clock drift within ``drift``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from gradientmail.core import effects as fx
from gradientmail.core import join, learner, leases, polling, syncer
from gradientmail.core.records import Manifest
from specs.bugs import rules_for
from specs.config import Config
from specs.execute import CREATES, WRITES, execute, run_schema
from specs.mailbox import Forged, Mailbox, commit_at, manifest_at, nonce, snapshot_at
from specs.state import (
    ABSENT,
    DOWN,
    GONE,
    JOINING,
    LOOPS,
    RUNNING,
    Event,
    Job,
    Loop,
    NodeState,
    World,
)

__all__ = [
    "OutOfBounds",
    "apply",
    "enabled",
    "initial",
    "newest",
    "of_kind",
    "progress_possible",
    "runnable",
    "successors",
    "try_apply",
]

FAULTS = ("lost", "ambiguous")


class OutOfBounds(Exception):
    """The step would leave the explored bounds (a state constraint, not an error)."""


def initial(config: Config) -> World:
    """No run yet: every node is absent and the mailbox is empty."""
    return World(
        config=config,
        time=0,
        nodes=tuple(NodeState() for _ in range(config.nodes)),
        mailbox=Mailbox(),
    )


# -- settings ------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _settings(config: Config, i: int, epoch: int, loop: str, manifest: Manifest | None) -> Any:
    rules = rules_for(config.bugs)
    me, process = config.names[i], nonce(i, epoch)
    if loop == "join":
        return join.Settings(
            node=me,
            process=process,
            schema=run_schema(config.fragments),
            algorithm=config.algorithm,
            mapping={f"p{k}": k for k in range(config.fragments)},
            lease_every=float(config.lease_every),
            rules=rules,
        )
    assert manifest is not None
    if loop == "learner":
        return polling.Settings(
            node=me,
            manifest=manifest,
            poll_interval=float(config.poll_interval),
            rules=rules,
            idle_polls=config.idle_polls,
        )
    return syncer.Settings(
        node=me,
        process=process,
        manifest=manifest,
        poll_interval=float(config.poll_interval),
        lease_every=float(config.lease_every),
        lease_timeout=float(config.lease_timeout),
        takeover=float(config.takeover),
        keep=config.keep,
        horizon=float(config.horizon),
        outlier_factor=None,
        rules=rules,
        lease_idle=config.lease_every / 2 if config.quick_leases else None,
        renewals_ahead=config.renewals_ahead,
    )


_RULES: dict[str, Callable[..., tuple[Any, list[fx.Effect], str]]] = {
    "join": join.step,
    "learner": polling.step,
    "syncer": syncer.step,
}


# -- a loop's step -----------------------------------------------------------------------


def runnable(node: NodeState, loop: str) -> bool:
    """Whether ``loop`` of ``node`` is due: something to take in, or its deadline reached."""
    found = node.loop(loop)
    return (
        node.active and found is not None and not found.done
        and (bool(found.inbox) or node.clock >= found.wake)
    )  # fmt: skip


def _step(world: World, i: int, loop: str, outcome: str) -> World:
    """Run ``loop`` of node ``i`` as the driver does, one call (grain "call") or calls until
    one writes or the loop waits (grain "write"); ``outcome`` faults the first create."""
    config = world.config
    manifest = manifest_at(world.mailbox)[1] if loop != "join" else None
    assert manifest is None or isinstance(manifest, Manifest)
    rule, settings = _RULES[loop], _settings(config, i, world.node(i).epoch, loop, manifest)
    fault = outcome
    while True:
        node = world.node(i)
        current = node.loop(loop)
        assert current is not None
        view = current.inbox
        state, effects, _ = rule(view, current.state, now=float(node.clock), settings=settings)
        taken = Loop(state, (), current.wake, current.done)
        world = world.with_node(i, node.with_loop(loop, taken))
        results: list[fx.Result] = []
        until, wrote, done = math.inf, False, False
        for effect in effects:
            if isinstance(effect, fx.Wait):
                until = math.inf if effect.until is None else effect.until
            elif isinstance(effect, fx.Done):
                done = True
            elif isinstance(effect, fx.Fail):
                world = world.flag("failed", f"n{i}'s {loop} loop failed: {effect.error}")
                done = True
            else:
                if isinstance(effect, fx.CreateClaim) and effect.claim.attempt >= config.attempts:
                    raise OutOfBounds(f"attempt {effect.claim.attempt} of {effect.claim.round}")
                this = _fault(fault, effect)
                if this != "ok":
                    fault = "ok"
                world, result = execute(world, i, effect, this)
                if result is not None:
                    results.append(result)
                wrote = wrote or isinstance(effect, WRITES)
        node = world.node(i)
        current = node.loop(loop)
        assert current is not None
        inbox = (*current.inbox, *results)
        wake = -math.inf if results else until
        waiting = Loop(current.state, inbox, wake, current.done)
        world = world.with_node(i, node.with_loop(loop, waiting))
        if done:
            return _finished(world, i, loop)
        if config.grain == "call" or wrote or not results:
            return world


def _fault(outcome: str, effect: fx.Effect) -> str:
    """The outcome for ``effect``: ``outcome`` ("lost", "ambiguous", or either "@" a kind of
    record: "ambiguous@commit") if ``effect`` is a create it applies to, else "ok"."""
    kind = CREATES.get(type(effect))
    mode, _, wanted = outcome.partition("@")
    if kind is None or mode == "ok" or (wanted and wanted != kind):
        return "ok"
    return mode


def _finished(world: World, i: int, loop: str) -> World:
    node = world.node(i)
    current = node.loop(loop)
    assert current is not None
    if loop == "join":
        return _started(world, i, current.state)
    node = node.with_loop(loop, Loop(current.state, (), math.inf, True))
    if (
        node.learner is not None
        and node.syncer is not None
        and node.learner.done
        and node.syncer.done
    ):
        node = NodeState(status=GONE, epoch=node.epoch, clock=node.clock)
    return world.with_node(i, node)


def _started(world: World, i: int, state: join.JoinState) -> World:
    """The join is done: the node runs (``join.started``), holding the newest commits."""
    node = world.node(i)
    if not state.done:  # the join failed (a flag says why): the process ends
        return world.with_node(i, NodeState(status=DOWN, epoch=node.epoch, clock=node.clock))
    trainer, polled, synced = join.started(state, process=nonce(i, node.epoch))
    merged = tuple(f.merged for f in trainer.fragments)
    for k, (got, floor) in enumerate(zip(merged, node.floor, strict=True)):
        if got < floor:
            world = world.flag(
                "join-newest",
                f"n{i} joined holding round {got} of fragment {k}, though round {floor} was "
                "committed before its join began",
            )
    # With gather, the node waits to see every node before it trains (Session.wait_for_nodes).
    inbox: tuple[fx.Result, ...] = (
        (fx.Gather(count=world.config.nodes),) if world.config.gather else ()
    )
    node = node._replace(
        status=RUNNING,
        join=None,
        trainer=trainer,
        learner=Loop(polled),
        syncer=Loop(synced, inbox=inbox),
    )
    return world.with_node(i, node)


def gathered(node: NodeState, config: Config) -> bool:
    """Whether a node of a ``gather`` world may train: it has, or its lease view holds every
    node of the world active (``Session.wait_for_nodes``)."""
    if not config.gather or node.produced > 0:
        return True
    assert node.syncer is not None
    view = node.syncer.state.keeper.view
    active = leases.gathered(
        view, now=node.clock, lease_timeout=config.lease_timeout, count=config.nodes
    )
    return active is not None


# -- the training side -------------------------------------------------------------------


def _train(world: World, i: int, samples: int) -> World:
    """``Node.step``: apply every delivered commit, then one inner step."""
    world = _merge_all(world, i)
    node = world.node(i)
    assert node.trainer is not None
    trainer, effects = learner.step(node.trainer, world.config.algorithm, samples)
    node = node._replace(trainer=trainer, produced=node.produced + samples)
    return _hurry(_publish(world.with_node(i, node), i, effects), i)


def _hurry(world: World, i: int, rounds: Sequence[int] | None = None) -> World:
    """What ``Node.step`` (held at the overlap bound) and ``Node.close`` tell both loops:
    the commits the training side waits for (``Hurry``; by default the one ``step`` is held
    on, if any)."""
    node = world.node(i)
    assert node.trainer is not None and node.learner is not None
    if rounds is None:
        waiting = learner.waiting_on(node.trainer, world.config.algorithm)
        rounds = () if waiting is None else (waiting.round,)
    if not rounds:
        return world
    messages = tuple(fx.Hurry(round=r) for r in rounds)
    assert node.syncer is not None
    learner_loop = node.learner._replace(inbox=(*node.learner.inbox, *messages))
    syncer_loop = node.syncer._replace(inbox=(*node.syncer.inbox, *messages))
    return world.with_node(i, node._replace(learner=learner_loop, syncer=syncer_loop))


def _merge_all(world: World, i: int) -> World:
    while world.node(i).ready:
        world = _merge(world, i)
    return world


def _merge(world: World, i: int) -> World:
    """Apply the first delivered commit (``learner.counted``, then ``rules.on_commit``), and
    check that the merge agrees with whether the store's commit counted the snapshot."""
    config, node = world.config, world.node(i)
    assert node.trainer is not None and node.ready
    ready, rest = node.ready[0], node.ready[1:]
    r, me = ready.commit.round, config.names[i]
    before = node.trainer.fragments[r % config.fragments]
    truth = _counted(world, before, me)
    included = learner.counted(
        node.trainer, config.algorithm, round=r, me=me, counted=ready.counted
    )
    trainer, effects = rules_for(config.bugs).on_commit(
        node.trainer, config.algorithm, round=r, included=included
    )
    for effect in effects:
        if isinstance(effect, fx.Merge) and effect.round <= before.merged:
            world = world.flag(
                "merges-forward", f"n{i} merged round {r} after round {before.merged}"
            )
        if isinstance(effect, fx.Merge) and (effect.since == "snapshot") != truth:
            world = world.flag(
                "merges-forward",
                f"n{i} merged round {r} since its {effect.since} though the commit "
                f"{'counts' if truth else 'does not count'} its snapshot",
            )
        if isinstance(effect, fx.Rebased) and truth:
            world = world.flag(
                "merges-forward",
                f"n{i} rebased its snapshot of round {effect.missed}, which a commit counted",
            )
    held = learner.waiting_on(node.trainer, config.algorithm)
    node = node._replace(trainer=trainer, ready=rest)
    world = _publish(world.with_node(i, node), i, effects)
    waiting = learner.waiting_on(trainer, config.algorithm)
    if held is not None and waiting is not None and waiting.round != held.round:
        return _hurry(world, i)  # still held, on another round
    return world


def _counted(world: World, fragment: Any, me: str) -> bool:
    """Ground truth: whether the commit of the node's outstanding round counts its snapshot
    (commit records are never collected)."""
    if fragment.outstanding is None or fragment.nonce is None:
        return False
    _, commit = commit_at(world.mailbox, fragment.outstanding)
    return commit is not None and commit.includes(me, fragment.nonce)


def _publish(world: World, i: int, effects: list[learner.Effect]) -> World:
    """The training side's ``Publish`` effects: capture a job, tell the learner loop; its
    ``Leave``: tell the syncer."""
    node = world.node(i)
    assert node.trainer is not None
    jobs = list(node.jobs)
    for effect in effects:
        if isinstance(effect, fx.Leave):
            assert node.syncer is not None
            node = node._replace(syncer=node.syncer._replace(inbox=(*node.syncer.inbox, effect)))
        if isinstance(effect, fx.Publish):
            f = node.trainer.fragments[effect.fragment]
            assert f.nonce is not None
            hi = node.produced
            jobs.append(
                Job(
                    round=effect.round,
                    nonce=f.nonce,
                    base=effect.base_round,
                    lo=hi - effect.samples,
                    hi=hi,
                    steps=effect.steps,
                )
            )
            assert node.learner is not None
            message = fx.Captured(round=effect.round, nonce=f.nonce)
            node = node._replace(
                learner=node.learner._replace(inbox=(*node.learner.inbox, message))
            )
    return world.with_node(i, node._replace(jobs=tuple(jobs)))


def _leave(world: World, i: int) -> World:
    """``Node.close`` begins: publish what is left (``learner.close``); its ``Leave`` tells the
    syncer to release the lease once those snapshots are uploaded."""
    world = _merge_all(world, i)
    node = world.node(i)
    assert node.trainer is not None
    trainer, effects = learner.close(node.trainer, world.config.algorithm)
    node = node._replace(trainer=trainer, leaving=True)
    world = _publish(world.with_node(i, node), i, effects)
    outstanding = [f.outstanding for f in trainer.fragments if f.outstanding is not None]
    return _hurry(world, i, outstanding)


def _finish(world: World, i: int) -> World:
    """``Node.close`` ends once the learner is done: both loops are told to stop."""
    node = world.node(i)
    assert node.learner is not None and node.syncer is not None
    learner_loop = node.learner._replace(inbox=(*node.learner.inbox, fx.Stop()))
    syncer_loop = node.syncer._replace(inbox=(*node.syncer.inbox, fx.Stop()))
    return world.with_node(
        i, node._replace(finished=True, learner=learner_loop, syncer=syncer_loop)
    )


# -- events ------------------------------------------------------------------------------


def newest(world: World, k: int) -> int:
    """Ground truth: fragment ``k``'s newest commit round (-1: none)."""
    found = -1
    for commit in world.mailbox.commits():
        if commit.round % world.config.fragments == k:
            found = max(found, commit.round)
    return found


def apply(world: World, event: Event) -> World:
    """The world after ``event`` (which must be enabled)."""
    i, kind = event.node, event.kind
    if kind == "step":
        return _step(world, i, event.loop, event.outcome)
    if kind == "join":
        node = world.node(i)
        floor = tuple(newest(world, k) for k in range(world.config.fragments))
        joining = NodeState(
            status=JOINING, epoch=node.epoch + 1, clock=node.clock, join=Loop(join.JoinState()),
            floor=floor,
        )  # fmt: skip
        return world.with_node(i, joining)
    if kind == "train":
        return _train(world, i, event.samples)
    if kind == "merge":
        return _merge(world, i)
    if kind == "leave":
        return _leave(world, i)
    if kind == "finish":
        return _finish(world, i)
    if kind == "crash":
        node = world.node(i)
        down = NodeState(status=DOWN, epoch=node.epoch, clock=node.clock)
        return world.with_node(i, down)._replace(crashes=world.crashes + 1)
    if kind == "pause":
        world = world._replace(pauses=world.pauses + 1)
        return world.with_node(i, world.node(i)._replace(paused=True))
    if kind == "resume":
        return world.with_node(i, world.node(i)._replace(paused=False))
    if kind == "forge":
        return _forge(world, event)
    if kind == "tick":
        nodes = tuple(n._replace(clock=n.clock + 1) for n in world.nodes)
        return world._replace(time=world.time + 1, nodes=nodes)
    if kind == "fast":
        return world.with_node(i, world.node(i)._replace(clock=world.node(i).clock + 1))
    if kind == "slow":
        nodes = tuple(n._replace(clock=n.clock + (j != i)) for j, n in enumerate(world.nodes))
        return world._replace(time=world.time + 1, nodes=nodes)
    raise ValueError(f"unknown event kind {kind!r}")


def _forge(world: World, event: Event) -> World:
    """A writer without the secret creates an object that does not verify at the first free
    key of a slot sequence (``core.slots``), before that sequence holds what verifies:
    ``node`` -1 and ``samples`` r: round r's commit keys; ``node`` i: node i's snapshot keys of
    round r; ``samples`` -1: the manifest keys."""
    if event.samples < 0:
        key, found = manifest_at(world.mailbox)
    elif event.node >= 0:
        key, found = snapshot_at(world.mailbox, event.samples, world.config.names[event.node])
    else:
        key, found = commit_at(world.mailbox, event.samples)
    if found is not None or key in world.mailbox:
        return world
    mailbox, _ = world.mailbox.create(key, Forged(key))
    return world._replace(mailbox=mailbox, forgeries=world.forgeries + 1)


def _forgeries(world: World) -> list[tuple[Event, World]]:
    """The forger's moves while its budget lasts: squat the next key of each sequence of the
    kinds ``Config.squats`` names that holds nothing verified yet."""
    config = world.config
    if world.forgeries >= config.forgeries:
        return []
    events = []
    if "manifest" in config.squats:
        events.append(Event("forge", samples=-1))
    for r in range(config.round_bound):
        if "commit" in config.squats:
            events.append(Event("forge", samples=r))
        if "snapshot" in config.squats:
            events += [Event("forge", node=i, samples=r) for i in range(config.nodes)]
    found = []
    for event in events:
        after = _forge(world, event)
        if after is not world:
            found.append((event, after))
    return found


def successors(
    world: World, *, samples: tuple[int, ...] = (1,), cut: list[Event] | None = None
) -> list[tuple[Event, World]]:
    """Every enabled event with the world it leads to, in a fixed order (nodes by index).
    Events that would leave the bounds, or that change nothing, are not enabled; ``cut``
    collects the fault-free ones that would leave the bounds."""
    found: list[tuple[Event, World]] = []
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, samples):
            after = _attempt(world, event, cut)
            if after is not None:
                found.append((event, after))
    if cut is not None:
        cut += _trained_out(world)
    found += _forgeries(world)
    if may_tick(world):
        found.append((Event("tick"), apply(world, Event("tick"))))
    if world.config.drift:
        for i, node in enumerate(world.nodes):
            skew = node.clock - world.time
            if node.alive and skew < world.config.drift:
                found.append((Event("fast", i), apply(world, Event("fast", i))))
            if node.alive and skew > -world.config.drift:
                found.append((Event("slow", i), apply(world, Event("slow", i))))
    return found


def _trained_out(world: World) -> list[Event]:
    """``train`` events the step bound leaves out: a running node that would train on (not
    leaving, not held at the overlap bound) has made its last explored step."""
    config = world.config
    return [
        Event("train", i)
        for i, node in enumerate(world.nodes)
        if node.running
        and node.trainer is not None
        and not node.paused
        and not node.leaving
        and node.trainer.step >= config.step_bound
        and not blocked(node, config)
        and gathered(node, config)
    ]


def _attempt(world: World, event: Event, cut: list[Event] | None = None) -> World | None:
    try:
        after = apply(world, event)
    except OutOfBounds:
        if cut is not None and event.outcome == "ok":
            cut.append(event)
        return None
    if after == world:
        return None
    if not _within(world, after, event):
        if cut is not None and event.outcome == "ok":
            cut.append(event)
        return None
    if event.outcome != "ok" and after.faults == world.faults:
        return None  # no create to fault in this step: the same as "ok"
    return after


def enabled(world: World, *, samples: tuple[int, ...] = (1,)) -> list[Event]:
    return [event for event, _ in successors(world, samples=samples)]


def try_apply(world: World, event: Event) -> World | None:
    """The world after ``event`` when it is enabled (and changes something), else None."""
    if event.kind in ("tick", "fast", "slow", "forge"):
        return dict(successors(world)).get(event)
    if not 0 <= event.node < len(world.nodes):
        return None
    node = world.node(event.node)
    plain = event._replace(outcome=event.outcome.partition("@")[0])
    if plain not in _candidates(world, event.node, node, (event.samples,)):
        return None
    return _attempt(world, event)


def of_kind(
    world: World, kinds: frozenset[str], *, samples: tuple[int, ...] = (1,)
) -> list[tuple[Event, World]]:
    """The enabled events of ``kinds`` only (cheaper than ``successors`` when a driver picks
    a kind of step first, as the Hypothesis machine does)."""
    if kinds & {"tick", "fast", "slow", "forge"}:
        return [(e, w) for e, w in successors(world, samples=samples) if e.kind in kinds]
    found = []
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, samples):
            if event.kind in kinds:
                after = _attempt(world, event)
                if after is not None:
                    found.append((event, after))
    return found


def progress_possible(world: World, kinds: frozenset[str]) -> bool:
    """Whether an event of one of ``kinds`` would change the world, bounds ignored."""
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, (1,), bounded=False):
            if event.kind not in kinds or event.outcome != "ok":
                continue
            try:
                if apply(world, event) != world:
                    return True
            except OutOfBounds:
                return True
    return False


def may_tick(world: World) -> bool:
    """Time moves only when no running, unpaused node has a loop due."""
    return not any(runnable(node, loop) for node in world.nodes for loop in LOOPS)


def blocked(node: NodeState, config: Config) -> bool:
    return (
        node.trainer is not None and learner.waiting_on(node.trainer, config.algorithm) is not None
    )


def _candidates(
    world: World, i: int, node: NodeState, samples: tuple[int, ...], *, bounded: bool = True
) -> list[Event]:
    config = world.config
    if node.status in (ABSENT, DOWN):
        return [Event("join", i)]
    if not node.alive:
        return []
    crash = [Event("crash", i)] if world.crashes < config.crashes else []
    if node.paused:
        return [Event("resume", i), *crash]
    events = []
    outcomes = ("ok", *FAULTS) if world.faults < config.faults else ("ok",)
    for loop in LOOPS:
        if runnable(node, loop):
            events += [Event("step", i, loop=loop, outcome=o) for o in outcomes]
    if node.running:
        assert node.trainer is not None
        is_blocked = blocked(node, config)
        more = node.trainer.step < config.step_bound or not bounded
        if not node.leaving and not is_blocked and more and gathered(node, config):
            events += [Event("train", i, samples=s) for s in samples]
        if node.ready and (is_blocked or node.leaving):
            events.append(Event("merge", i))
        if config.leave and not node.leaving:
            events.append(Event("leave", i))
        if node.leaving and not node.finished and learner.done(node.trainer) and not node.ready:
            events.append(Event("finish", i))
    events += crash
    if world.pauses < config.pauses:
        events.append(Event("pause", i))
    return events


def _within(before: World, after: World, event: Event) -> bool:
    if event.kind not in ("train", "merge", "leave"):
        return True
    config = before.config
    bound = config.rounds if event.kind == "train" else config.round_bound
    new = after.node(event.node).jobs[len(before.node(event.node).jobs) :]
    return all(job.round < bound for job in new)
