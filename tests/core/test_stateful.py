"""Hypothesis stateful tests of the protocol rules over the world model of specs/.

The machine drives ``specs.world`` at its finest grain (``timers=False``): every syncer step
(renew, observe, look at a round) is its own rule, the clock is a rule (advance, jitter, a long
pause beyond ``lease_timeout``), and so are step, upload, poll, claim, commit, crash, restart,
join, leave, lost writes, 409s and ambiguous creates. Every decision is the real core rule's;
every invariant of the design brief is an ``@invariant``. Bounded by the loaded Hypothesis
profile (tests/conftest.py); planted bugs (design Decision 12) must make it fail.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # specs/ lives at the repo root

import attrs
import pytest
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from specs.config import Config
from specs.invariants import INVARIANTS
from specs.state import Event, NodeState, World
from specs.world import apply, initial, of_kind, try_apply

STEPS = settings(
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
NODES = st.integers(0, 1)
WRITES = st.sampled_from(["upload", "commit"])


class WorldMachine(RuleBasedStateMachine):
    """The world, the invariants, and helpers; subclasses bring the rules."""

    CONFIG = Config(timers=False)

    def __init__(self) -> None:
        super().__init__()
        self.world: World = initial(self.CONFIG)
        self.log: list[str] = []
        self.plan: dict[tuple[int, str], str] = {}  # injected outcomes of next writes
        self.slow: dict[int, int] = {}  # turns a node's commit still stalls

    def _try(self, event: Event) -> bool:
        """Apply ``event`` if it is enabled; node arguments wrap around the world's nodes."""
        if event.node >= 0:
            event = event._replace(node=event.node % self.CONFIG.nodes)
        after = try_apply(self.world, event)
        if after is None:
            return False
        self._note(str(event))
        self.world = after
        return True

    def _note(self, text: str) -> None:
        self.log.append(text)
        with suppress(InvalidArgument):  # replayed outside Hypothesis (regression tests)
            note(text)

    def _write(self, i: int, kind: str) -> bool:
        outcome = self.plan.pop((i, kind), "ok")
        return self._try(Event(kind, i, outcome=outcome)) or self._try(Event(kind, i))

    def _turn(self, i: int) -> None:
        node = self.world.node(i)
        if not node.active:
            self._try(Event("stop", i))
            return
        self._try(Event("train", i)) or self._try(Event("merge", i))
        for _ in range(len(self.world.node(i).jobs) + 1):
            if not self._write(i, "upload"):
                break
        self._try(Event("poll", i))
        if self.world.node(i).work is not None and self.slow.get(i, 0) > 0:
            self.slow[i] -= 1  # still writing its payloads: no commit, no syncer pass
        elif self.world.node(i).work is not None:
            self._write(i, "commit")
        else:
            self._try(Event("sync", i))
        self._try(Event("stop", i))

    def _run(self, order: list[int], ticks: int) -> None:
        """``ticks`` poll intervals of the fair schedule, nodes taking turns in ``order``: each
        as its loops would in one interval (one training step, its uploads and polls, then
        its commit or its syncer pass)."""
        for _ in range(ticks):
            for i in order:
                self._turn(i % self.CONFIG.nodes)
            self.world = apply(self.world, Event("tick"))
            self._note("tick")

    def _holds(self, name: str) -> None:
        message = INVARIANTS[name](self.world)
        assert message is None, f"{name}: {message}"

    def check_all(self) -> None:
        for name in INVARIANTS:
            if name != "single-claim":
                self._holds(name)

    @invariant()
    def commit_once(self) -> None:
        self._holds("commit-once")

    @invariant()
    def included_exist(self) -> None:
        self._holds("included-exist")

    @invariant()
    def unbroken_chain(self) -> None:
        self._holds("chain")

    @invariant()
    def samples_counted_once(self) -> None:
        self._holds("samples-once")

    @invariant()
    def merges_forward(self) -> None:
        self._holds("merges-forward")

    @invariant()
    def merged_committed(self) -> None:
        self._holds("merged-committed")

    @invariant()
    def watches_end(self) -> None:
        self._holds("watches-end")


def _some(test: Callable[[NodeState], object]) -> Callable[[ProtocolMachine], bool]:
    return lambda machine: any(test(node) for node in machine.world.nodes)


class ProtocolMachine(WorldMachine):
    """Three nodes, two fragments, quorum 2 with grace, and every fault, one step a rule. Each
    rule draws among the enabled events of its kind, so no rule is a no-op."""

    CONFIG = Config(
        nodes=3,
        fragments=2,
        rounds=6,
        quorum=2,
        grace=1,
        attempts=4,
        crashes=2,
        faults=4,
        pauses=2,
        drift=1,
        timers=False,
    )

    def __init__(self) -> None:
        super().__init__()
        self._try(Event("join", 0))

    def _pick(self, data: st.DataObject, kinds: frozenset[str], outcome: str = "ok") -> None:
        found = dict(
            (event, after)
            for event, after in of_kind(self.world, kinds, samples=(1, 2))
            if event.outcome == outcome
        )
        if found:
            event = data.draw(st.sampled_from(sorted(found)), label="event")
            self._note(str(event))
            self.world = found[event]

    @precondition(_some(lambda n: not n.running))
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        """A first join, or a restart of a crashed node under a new nonce."""
        self._pick(data, frozenset({"join"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One training step (merging ready commits first), or a merge while blocked."""
        self._pick(data, frozenset({"train", "merge"}))

    @precondition(_some(lambda n: n.active and n.jobs))
    @rule(data=st.data())
    def upload(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"upload"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"poll"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"renew"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def observe_leases(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"observe"}))

    @precondition(_some(lambda n: n.active and n.watched and n.work is None))
    @rule(data=st.data())
    def decide(self, data: st.DataObject) -> None:
        """``rules.decide`` on a watched round; a claim and its read when it says so."""
        self._pick(data, frozenset({"claim"}))

    @precondition(_some(lambda n: n.active and n.work is None))
    @rule(data=st.data())
    def syncer_pass(self, data: st.DataObject) -> None:
        """A whole pass of the syncer loop: renew, observe, look at every watched round."""
        self._pick(data, frozenset({"sync"}))

    @precondition(_some(lambda n: n.active and n.work is not None))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"commit"}))

    @precondition(_some(lambda n: n.active and (n.jobs or n.work is not None)))
    @rule(data=st.data())
    def lost_write(self, data: st.DataObject) -> None:
        """A create that did not land, the writer told it failed (S3's 409
        ConditionalRequestConflict has the same outcome): the exchange retries it."""
        self._pick(data, frozenset({"upload", "commit"}), outcome="lost")

    @precondition(_some(lambda n: n.active and (n.jobs or n.work is not None)))
    @rule(data=st.data())
    def ambiguous_create(self, data: st.DataObject) -> None:
        """A create that landed, the writer told it failed: it must read it back."""
        self._pick(data, frozenset({"upload", "commit"}), outcome="ambiguous")

    @precondition(_some(lambda n: n.running))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"crash"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """``Session.close``, or the stop that follows once the learner is done."""
        self._pick(data, frozenset({"leave", "stop"}))

    @precondition(_some(lambda n: n.running))
    @rule(data=st.data())
    def pause_or_resume(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"pause", "resume"}))

    @rule(ticks=st.integers(1, 3))
    def advance(self, ticks: int) -> None:
        for _ in range(ticks):
            self.world = apply(self.world, Event("tick"))
        self._note(f"tick x{ticks}")

    @rule(order=st.permutations(range(3)), ticks=st.integers(1, 3))
    def run(self, order: list[int], ticks: int) -> None:
        """A few poll intervals of the fair schedule between the finer steps."""
        self._run(order, ticks)

    @rule(data=st.data())
    def jitter(self, data: st.DataObject) -> None:
        """One node's clock runs ahead of or behind virtual time, within the drift bound."""
        self._pick(data, frozenset({"fast", "slow"}))

    @precondition(_some(lambda n: n.active))
    @rule(node=st.integers(0, 2))
    def long_pause(self, node: int) -> None:
        """``node`` is frozen beyond lease_timeout while the others make a syncer pass every
        tick."""
        for _ in range(self.CONFIG.lease_timeout + 1):
            for i in range(self.CONFIG.nodes):
                if i != node:
                    self._try(Event("sync", i))
            self.world = apply(self.world, Event("tick"))
        self._note(f"n{node} frozen for {self.CONFIG.lease_timeout + 1} ticks")


ProtocolMachine.TestCase.settings = STEPS
TestProtocol = ProtocolMachine.TestCase


class LoopMachine(WorldMachine):
    """A fair schedule with injected faults: each ``tick`` every node takes its turn (in a
    drawn order) as its loops would in one poll interval: one training step, its uploads and
    polls, then its commit or its syncer pass; then the clock ticks. Rules inject what breaks
    that rhythm: a lost or ambiguous next write, a pause, a crash, a restart, a leave. A race
    is then a handful of rules away, so planted bugs are found within the CI budget."""

    CONFIG = Config(nodes=2, fragments=1, rounds=3, crashes=1, faults=2, pauses=2, timers=False)

    def __init__(self) -> None:
        super().__init__()
        for i in range(self.CONFIG.nodes):
            self._try(Event("join", i))

    @rule(order=st.permutations(range(2)), ticks=st.integers(1, 4))
    def run(self, order: list[int], ticks: int) -> None:
        self._run(order, ticks)

    @rule(node=NODES, write=WRITES, outcome=st.sampled_from(["lost", "ambiguous"]))
    def fault_next_write(self, node: int, write: str, outcome: str) -> None:
        self.plan[(node % self.CONFIG.nodes, write)] = outcome

    @rule(node=NODES)
    def slow_closer(self, node: int) -> None:
        """The node's next commit stalls beyond the takeover timeout (its syncer waits on it,
        renewing nothing): the others must take the round over."""
        self.slow[node % self.CONFIG.nodes] = 2 * self.CONFIG.takeover + 2

    @rule(node=NODES, what=st.sampled_from(["pause", "crash", "leave"]))
    def disrupt(self, node: int, what: str) -> None:
        """A pause (or the resume that ends it), a crash (or the restart after it), a leave."""
        if what == "pause":
            self._try(Event("pause", node)) or self._try(Event("resume", node))
        elif what == "crash":
            self._try(Event("crash", node)) or self._try(Event("join", node))
        else:
            self._try(Event("leave", node))


LoopMachine.TestCase.settings = STEPS
TestLoops = LoopMachine.TestCase

# Planted bugs (Decision 12) and the invariant each one breaks.
PLANTED = {
    "commit-not-create-only": "commit-once",
    "rebase-included": "merges-forward",
    "no-readback": "included-exist",
}
# Derandomized and without the example database: the same search on every run, so whether a
# planted bug is found depends neither on luck nor on what an earlier run left in .hypothesis/.
FIND = settings(STEPS, phases=[Phase.explicit, Phase.generate], derandomize=True, database=None)


def planted(bug: str) -> type[LoopMachine]:
    config = attrs.evolve(LoopMachine.CONFIG, bugs=frozenset({bug}))
    return type(f"Planted_{bug.replace('-', '_')}", (LoopMachine,), {"CONFIG": config})


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_is_caught(bug: str) -> None:
    """Decision 12: swapping one rule for its broken variant makes the machine fail, on the
    invariant that bug breaks (found without shrinking: shrinking is the slow test below)."""
    with pytest.raises(AssertionError, match=PLANTED[bug]):
        run_state_machine_as_test(planted(bug), settings=FIND)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_shrinks_to_a_short_trace(bug: str) -> None:
    """The shrunk counterexample (Hypothesis prints it in the exception's notes) is short."""
    with pytest.raises(AssertionError, match=PLANTED[bug]) as failure:
        run_state_machine_as_test(planted(bug), settings=settings(STEPS, database=None))
    notes = getattr(failure.value, "__notes__", [])
    steps = [n for n in notes if re.match(r"state\.(run|slow_closer|fault|disrupt)", n.strip())]
    print("\n".join(notes))
    assert 1 <= len(steps) <= 6, notes


def _replay(bug: str | None, calls: list[tuple[str, tuple[object, ...]]]) -> LoopMachine:
    machine = planted(bug)() if bug else LoopMachine()
    for name, args in calls:
        getattr(machine, name)(*args)
    return machine


# The shrunk counterexamples, as regressions: each fails with its bug and holds without it.
REGRESSIONS: dict[str, list[tuple[str, tuple[object, ...]]]] = {
    "commit-not-create-only": [
        ("slow_closer", (0,)),
        *[("run", ([0, 1], ticks)) for ticks in (1, 1, 1, 3, 4)],
    ],
    "rebase-included": [("run", ([0, 1], 1)), ("run", ([0, 1], 3))],
    "no-readback": [("fault_next_write", (0, "commit", "ambiguous")), ("run", ([0, 1], 3))],
}


@pytest.mark.parametrize("bug", sorted(REGRESSIONS))
def test_regression(bug: str) -> None:
    with pytest.raises(AssertionError, match=PLANTED[bug]):
        _replay(bug, REGRESSIONS[bug]).check_all()
    _replay(None, REGRESSIONS[bug]).check_all()
