"""A node's learner side as the shell runs it (shell/learner.py, shell/session.py), every
decision taken by ``gradientmail.core.learner``: join, train a step, merge a ready commit,
upload a captured snapshot, poll the next commits, leave and stop.

Each function takes a world and a node index and returns the next world; ``enabled`` in
``specs.world`` says when each applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from gradientmail.core import keys
from gradientmail.core import learner as rules
from gradientmail.core.leases import observe
from specs import bugs
from specs.mailbox import CommitObj, LeaseObj, ManifestObj, SnapObj, nonce
from specs.state import DOWN, GONE, RUNNING, Job, NodeState, World

__all__ = [
    "crash",
    "join",
    "leave",
    "merge",
    "newest",
    "observe_leases",
    "poll",
    "renew",
    "stop",
    "train",
    "upload",
]


def newest(world: World, k: int) -> int:
    """The newest commit round of fragment ``k`` (-1: the manifest), found as the shell does:
    forward GETs along the fragment's chain."""
    K = world.config.fragments
    r, found = k, -1
    while world.mailbox.get(keys.commit(r)) is not None:
        found, r = r, r + K
    return found


def join(world: World, i: int) -> World:
    """Create or join the run, load the newest commits, start the lease (a restart is a join
    under a new epoch, i.e. a new nonce)."""
    config, node = world.config, world.node(i)
    me = config.names[i]
    epoch = node.epoch + 1
    mailbox, _ = world.mailbox.create(keys.MANIFEST, ManifestObj(creator=me, epoch=epoch))
    world = world._replace(mailbox=mailbox)
    merged = tuple(newest(world, k) for k in range(config.fragments))
    known = []
    for r in merged:
        commit = mailbox.get(keys.commit(r)) if r >= 0 else None
        if isinstance(commit, CommitObj):
            known.append((r, tuple(inc.node for inc in commit.included)))
    node = NodeState(
        status=RUNNING,
        epoch=epoch,
        clock=node.clock,
        learner=rules.join(config.algorithm, merged),
        next_poll=tuple(rules.next_round(config.algorithm, k, r) for k, r in enumerate(merged)),
        known=tuple(sorted(known)),
    )
    world = world.with_node(i, node)
    # Node.join ends with one syncer tick: renew the lease, then observe every lease.
    world = observe_leases(renew(world, i), i)
    return world.with_node(i, world.node(i)._replace(synced=True))


def crash(world: World, i: int) -> World:
    """The process dies: everything volatile is lost; its lease stops changing."""
    node = world.node(i)
    down = NodeState(status=DOWN, epoch=node.epoch, clock=node.clock)
    return world.with_node(i, down)._replace(crashes=world.crashes + 1)


def renew(world: World, i: int) -> World:
    node = world.node(i)
    lease = LeaseObj(
        node=world.config.names[i], epoch=node.epoch, counter=node.counter + 1, left=node.leaving
    )
    mailbox = world.mailbox.put(keys.lease(lease.node), lease)
    return world.with_node(i, node._replace(counter=lease.counter))._replace(mailbox=mailbox)


def observe_leases(world: World, i: int) -> World:
    """One LIST of ``leases/`` folded into the node's view (``core.leases.observe``)."""
    node = world.node(i)
    listing = {}
    for _, obj in world.mailbox.list(keys.LEASES):
        assert isinstance(obj, LeaseObj)
        listing[obj.node] = (obj.version, obj.left, nonce(int(obj.node[1:]), obj.epoch))
    leases = observe(node.leases, listing, now=node.clock)
    return world.with_node(i, node._replace(leases=leases))


def train(world: World, i: int, samples: int) -> World:
    """``Learner.advance``: apply every ready commit, then one inner step of ``samples``
    samples (``rules.step``); publishes become jobs."""
    world = merge_all(world, i)
    node = world.node(i)
    assert node.learner is not None
    learner, effects = rules.step(node.learner, world.config.algorithm, samples)
    node = node._replace(learner=learner, produced=node.produced + samples)
    return _execute(world, i, node, effects)


def merge_all(world: World, i: int) -> World:
    """Apply every ready commit (the shell's ``_apply_ready`` at a step boundary)."""
    while world.node(i).ready:
        world = merge(world, i)
    return world


def merge(world: World, i: int) -> World:
    """Apply the first ready commit (``rules.on_commit``)."""
    node = world.node(i)
    assert node.learner is not None and node.ready
    commit, ready = node.ready[0], node.ready[1:]
    me = world.config.names[i]
    ours = commit.round in node.captured
    included = ours and commit.includes(me, node.epoch)
    captured = tuple(r for r in node.captured if r != commit.round)
    k = commit.round % world.config.fragments
    before = node.learner.fragments[k].merged
    counted = _counted(world, i, commit)
    learner, effects = bugs.on_commit(
        world.config, node.learner, round=commit.round, included=included, counted=counted
    )
    node = node._replace(learner=learner, ready=ready, captured=captured)
    for effect in effects:
        if isinstance(effect, rules.Merge):
            if effect.round <= before:
                world = world.flag(f"{me} merged round {effect.round} after round {before}")
            if (effect.since == "snapshot") != counted:
                world = world.flag(
                    f"{me} merged round {effect.round} since its {effect.since} though the "
                    f"commit {'counts' if counted else 'does not count'} its snapshot"
                )
        if isinstance(effect, rules.Rebased) and counted:
            world = world.flag(
                f"{me} rebased its snapshot of round {effect.missed}, which the commit includes"
            )
    return _execute(world, i, node, [e for e in effects if isinstance(e, rules.Publish)])


def _counted(world: World, i: int, commit: CommitObj) -> bool:
    """Whether the node's snapshot in flight for the commit's fragment was counted, by this
    commit or, when the node skipped commits whose parameters were collected, by the commit of
    its round (commit records are never collected)."""
    node = world.node(i)
    assert node.learner is not None
    outstanding = node.learner.fragments[commit.round % world.config.fragments].outstanding
    if outstanding is None or outstanding > commit.round:
        return False
    me = world.config.names[i]
    if outstanding == commit.round:
        return commit.includes(me, node.epoch)
    earlier = world.mailbox.get(keys.commit(outstanding))
    return isinstance(earlier, CommitObj) and earlier.includes(me, node.epoch)


def _execute(world: World, i: int, node: NodeState, effects: Sequence[rules.Effect]) -> World:
    jobs, captured = list(node.jobs), list(node.captured)
    for effect in effects:
        if isinstance(effect, rules.Publish):
            hi = node.produced
            jobs.append(
                Job(
                    round=effect.round,
                    base=effect.base_round,
                    lo=hi - effect.samples,
                    hi=hi,
                    steps=effect.steps,
                )
            )
            captured.append(effect.round)
    node = node._replace(jobs=tuple(jobs), captured=tuple(sorted(captured)))
    return world.with_node(i, node)


def upload(world: World, i: int, outcome: str) -> World:
    """Create the first job's snapshot. "lost" and "ambiguous" are transient failures the
    exchange retries; a retry that finds the key taken reads it back (Decision 9)."""
    node = world.node(i)
    job, me = node.jobs[0], world.config.names[i]
    key = keys.snapshot(job.round, me)
    obj = SnapObj(me, node.epoch, job.round, job.base, job.lo, job.hi, job.steps)
    if outcome != "ok":
        mailbox = world.mailbox
        if outcome == "ambiguous":
            mailbox, _ = mailbox.create(key, obj)
        node = node._replace(jobs=(job._replace(retried=True), *node.jobs[1:]))
        return world.with_node(i, node)._replace(mailbox=mailbox, faults=world.faults + 1)
    mailbox, created = world.mailbox.create(key, obj)
    if not created and job.retried and not bugs.skips_readback(world.config):
        existing = mailbox.get(key)
        created = isinstance(existing, SnapObj) and existing.epoch == node.epoch
    # Either way the syncer now watches the round (shell: Ledger.published before the check):
    # a snapshot that lost its key to another incarnation has missed the round.
    watched = node.watched
    if node.known_commit(job.round) is None and job.round not in watched:
        watched = tuple(sorted((*watched, job.round)))
    node = node._replace(jobs=node.jobs[1:], watched=watched)
    return world.with_node(i, node)._replace(mailbox=mailbox)


def poll(world: World, i: int) -> World:
    """GET the next commit of every fragment, as many as exist; they become ready to merge.

    As ``Learner._poll_fragment`` does, a commit whose parameters were already collected is
    skipped for the fragment's newest commit (Decision 7: the reader re-aligns); the skipped
    rounds are committed, so the syncer stops watching them."""
    node = world.node(i)
    K = world.config.fragments
    next_poll, ready = list(node.next_poll), list(node.ready)
    known, watched = dict(node.known), set(node.watched)
    for k in range(K):
        while True:
            commit = world.mailbox.get(keys.commit(next_poll[k]))
            if commit is None:
                break
            assert isinstance(commit, CommitObj)
            if commit.params_key not in world.mailbox:
                jump = newest(world, k)
                assert jump > next_poll[k], "collected params with no newer commit"
                if not bugs.forgets_skipped(world.config):
                    watched -= {r for r in watched if r % K == k and r < jump}
                next_poll[k] = jump
                continue
            ready.append(commit)
            known[next_poll[k]] = tuple(inc.node for inc in commit.included)
            watched.discard(next_poll[k])
            next_poll[k] += K
    node = node._replace(
        next_poll=tuple(next_poll),
        ready=tuple(ready),
        known=tuple(sorted(known.items())),
        watched=tuple(sorted(watched)),
    )
    return world.with_node(i, node)


def pollable(world: World, i: int) -> bool:
    node = world.node(i)
    return any(world.mailbox.get(_commit_key(r)) is not None for r in node.next_poll)


_commit_key = lru_cache(maxsize=4096)(keys.commit)


def leave(world: World, i: int) -> World:
    """``Session.close``: apply ready commits, publish what is left (``rules.close``) and
    release the lease at the next renewal."""
    world = merge_all(world, i)
    node = world.node(i)
    assert node.learner is not None
    learner, effects = rules.close(node.learner, world.config.algorithm)
    node = node._replace(learner=learner, leaving=True)
    return _execute(world, i, node, effects)


def stop(world: World, i: int) -> World:
    """The learner is done: the loops stop and the lease says ``left`` one last time."""
    node = world.node(i)
    world = renew(world, i)
    node = world.node(i)
    gone = NodeState(status=GONE, epoch=node.epoch, clock=node.clock, counter=node.counter)
    return world.with_node(i, gone)
