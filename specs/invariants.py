"""The design brief's invariants as functions over a world: each returns None when it holds,
else a message saying what broke. ``audit`` (Decision 12) checks the same properties on a real
mailbox's records, with the same core rules (``chain.links``, ``gc.kept``); these also check
what only a model can see (what a node merged, rebased and joined with).

Liveness lives in ``specs.liveness``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from gradientmail.core import chain, closing, gc, keys
from gradientmail.core.records import Claim
from specs.mailbox import SnapObj, commit_at, snapshot_at
from specs.state import World

__all__ = ["INVARIANTS", "check", "violations"]


def commit_once(world: World) -> str | None:
    """A round commits at most once."""
    for r, count in world.commit_writes:
        if count > 1:
            return f"round {r} was committed {count} times"
    return None


def included_exist(world: World) -> str | None:
    """Every committed round's payloads, and the snapshots it includes (with those nonces),
    exist while the collection rule keeps the round (``gc.kept``, Decision 7)."""
    config = world.config
    commits = list(world.mailbox.commits())
    newest: dict[int, int] = {}
    for c in commits:
        k = c.round % config.fragments
        newest[k] = max(newest.get(k, -1), c.round)
    for c in commits:
        if not gc.kept(
            config.algorithm, newest[c.round % config.fragments], c.round, keep=config.keep
        ):
            continue
        for ref in (c.params, c.state):
            if ref.key not in world.mailbox:
                return f"commit of round {c.round} names payload {ref.key}, which is gone"
        for inc in c.included:
            _, snap = snapshot_at(world.mailbox, c.round, inc.node)
            if not isinstance(snap, SnapObj) or snap.record.nonce != inc.nonce:
                return (
                    f"commit of round {c.round} includes {inc.node}'s snapshot, not in the mailbox"
                )
    return None


def chain_unbroken(world: World) -> str | None:
    """A commit's base is the fragment's previous commit: committed rounds form the chain
    ``k, k+K, k+2K, ...`` (``chain.links``)."""
    commits = {c.round: c for c in world.mailbox.commits()}
    problems = chain.links(world.config.algorithm, list(commits.values()), commits.__contains__)
    return problems[0] if problems else None


def samples_once(world: World) -> str | None:
    """Each published sample of a node (per incarnation, per fragment) is counted in at most
    one commit."""
    K = world.config.fragments
    spans = dict(world.spans)
    counted: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
    for c in world.mailbox.commits():
        for inc in c.included:
            node, epoch, lo, hi = spans[inc.nonce]
            counted.setdefault((node, epoch, c.round % K), []).append((lo, hi, c.round))
    for (node, epoch, k), found in sorted(counted.items()):
        found.sort()
        for (_, hi, r1), (lo, _, r2) in pairwise(found):
            if lo < hi:
                return (
                    f"{node} (epoch {epoch}) samples {lo}..{hi - 1} of fragment {k} are counted "
                    f"in rounds {r1} and {r2}"
                )
    return None


def _flagged(name: str) -> Callable[[World], str | None]:
    def invariant(world: World) -> str | None:
        return next((message for flag, message in world.flags if flag == name), None)

    return invariant


def merges_forward(world: World) -> str | None:
    """A node never merges a commit older than one it holds, and every merge or rebase agrees
    with whether the store's commit counted its snapshot (checked as each happens)."""
    return _flagged("merges-forward")(world)


def merged_committed(world: World) -> str | None:
    """What a node merged was committed: the model holds nothing that is not a commit."""
    for i, node in enumerate(world.nodes):
        if node.trainer is None:
            continue
        for f in node.trainer.fragments:
            if f.merged >= 0 and commit_at(world.mailbox, f.merged)[1] is None:
                return f"n{i} merged round {f.merged}, which has no commit"
    return None


def watches_end(world: World) -> str | None:
    """A syncer stops watching a round once its node has read that round's commit (Decision 8:
    LISTs are spent only on open rounds): a round its learner loop has polled past is one its
    syncer knows committed, or is told so (``Seen``) at its next step."""
    K = world.config.fragments
    for i, node in enumerate(world.nodes):
        if node.learner is None or node.syncer is None or node.syncer.done:
            continue
        polled = node.learner.state.next
        told = [m.commit.round for m in node.syncer.inbox if hasattr(m, "commit")]
        for s in node.syncer.state.rounds:
            r = s.round
            known = s.committed or any(t >= r and t % K == r % K for t in told)
            if r < polled[r % K] and not known and s.closing is None:
                return f"n{i} watches round {r} forever: its learner read a later commit"
    return None


def single_claim(world: World) -> str | None:
    """Without crashes or pauses, nobody takes a round over: every live closer commits within
    its takeover timeout, so a later attempt is wasted work (Decision 2's timeout exists for
    dead and slow closers)."""
    if world.crashes or world.pauses:
        return None
    for _, obj in world.mailbox.list(keys.ROUNDS):
        if isinstance(obj, Claim) and obj.attempt > 0:
            return f"{obj.node} claimed attempt {obj.attempt} of round {obj.round} in a healthy run"
    return None


def first_rounds_expect_all(world: World, *, always: bool = False) -> str | None:
    """In a world whose nodes wait to see every node before they train (``Config.gather``,
    ``Session.wait_for_nodes``), and had no crash or pause so far, a closer of a fragment's
    first round expects every running node that is not leaving (``closing.expected``, from its
    lease view) (issue #21: first rounds closed early on a view older than the others' joins).
    ``always`` checks it in any world (a test shows it fails without the wait)."""
    config = world.config
    if not always and (not config.gather or world.crashes or world.pauses):
        return None
    running = {config.names[i] for i, n in enumerate(world.nodes) if n.running and not n.leaving}
    for i, node in enumerate(world.nodes):
        if not node.running or node.syncer is None:
            continue
        state = node.syncer.state
        for s in state.rounds:
            if s.closing is None or closing.previous_round(config.algorithm, s.round) >= 0:
                continue
            waited = closing.expected(
                None,
                sorted(state.peers),
                state.keeper.view,
                now=node.clock,
                lease_timeout=config.lease_timeout,
            )
            missing = sorted(running - waited)
            if missing:
                return (
                    f"n{i} closes round {s.round}, a first round, expecting "
                    f"{sorted(waited)}: {missing} running and not expected"
                )
    return None


def _on_mailbox(invariant: Callable[[World], str | None]) -> Callable[[World], str | None]:
    """Memoize an invariant that reads only the mailbox, the ghost spans and the configuration,
    by their identities: most steps leave them as they were."""
    memo: dict[tuple[int, int, int], tuple[object, object, object, str | None]] = {}

    def checked(world: World) -> str | None:
        key = (id(world.mailbox), id(world.spans), id(world.config))
        hit = memo.get(key)
        same = hit is not None and hit[0] is world.mailbox and hit[1] is world.spans
        if hit is not None and same and hit[2] is world.config:
            return hit[3]
        if len(memo) > 100_000:
            memo.clear()
        result = invariant(world)
        memo[key] = (world.mailbox, world.spans, world.config, result)
        return result

    checked.__doc__ = invariant.__doc__
    return checked


INVARIANTS: dict[str, Callable[[World], str | None]] = {
    "commit-once": commit_once,
    "included-exist": _on_mailbox(included_exist),
    "chain": _on_mailbox(chain_unbroken),
    "samples-once": _on_mailbox(samples_once),
    "merges-forward": merges_forward,
    "merged-committed": merged_committed,
    "watches-end": watches_end,
    "single-claim": _on_mailbox(single_claim),
    "first-rounds-expect-all": first_rounds_expect_all,
    "join-newest": _flagged("join-newest"),
    "left-after-uploads": _flagged("left-after-uploads"),
    "loops-live": _flagged("failed"),
}


def violations(world: World) -> list[tuple[str, str]]:
    """Every invariant that fails, as (name, message)."""
    found = []
    for name, invariant in INVARIANTS.items():
        message = invariant(world)
        if message is not None:
            found.append((name, message))
    return found


def check(world: World) -> tuple[str, str] | None:
    """The first invariant that fails, or None."""
    for name, invariant in INVARIANTS.items():
        message = invariant(world)
        if message is not None:
            return name, message
    return None
