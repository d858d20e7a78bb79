"""Hypothesis stateful tests of the protocol over the world model of specs/.

The machines drive ``specs.world`` at its finest grain (``grain="call"``): every call of a
node's loop rule is its own step, and so are training, merging, leaving, crashes, restarts,
pauses, faulty creates and the clock. Every decision is a core rule's (the world runs the
node's own machines); every invariant of the design brief is an ``@invariant``. Bounded by the
loaded Hypothesis profile (tests/conftest.py); every planted bug (specs/bugs.py) must make the
loop machine fail on the property it breaks.
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

from specs.bugs import BROKEN
from specs.config import Config
from specs.invariants import INVARIANTS
from specs.liveness import settle
from specs.state import LOOPS, Event, NodeState, World
from specs.world import apply, initial, of_kind, runnable, try_apply

STEPS = settings(
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
NODES = st.integers(0, 1)


class WorldMachine(RuleBasedStateMachine):
    """The world, the invariants, and helpers; subclasses bring the rules."""

    CONFIG = Config(grain="call")

    def __init__(self) -> None:
        super().__init__()
        self.world: World = initial(self.CONFIG)
        self.log: list[str] = []
        self.plan: dict[int, str] = {}  # injected outcome of a node's next create
        self.slow: dict[int, int] = {}  # ticks a node's syncer still stalls
        self.stall: dict[int, int] = {}  # a stall to begin once the node's syncer claims
        self.doomed: set[int] = set()  # nodes to crash once their syncer claims

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

    def _loop_step(self, i: int, loop: str) -> bool:
        """One step of a loop; the planned fault goes to the first one that creates."""
        outcome = self.plan.get(i)
        if outcome is not None and self._try(Event("step", i, loop=loop, outcome=outcome)):
            del self.plan[i]
            return True
        return self._try(Event("step", i, loop=loop))

    def _train(self, i: int) -> None:
        """Node ``i``'s training thread in one poll interval: a step, or a merge if blocked."""
        if self.world.node(i).active:
            self._try(Event("train", i)) or self._try(Event("merge", i))

    def _turn(self, i: int) -> bool:
        """One step of each loop of node ``i`` that is due (its threads run side by side);
        whether any moved."""
        node = self.world.node(i)
        if not node.active:
            return False
        moved = False
        for loop in LOOPS:
            if not runnable(self.world.node(i), loop):
                continue
            if loop == "syncer" and self.slow.get(i, 0) > 0:
                continue  # in the middle of a close: its syncer stands still
            moved = self._loop_step(i, loop) or moved
            if i in self.stall and _closing(self.world.node(i)):
                self.slow[i] = self.stall.pop(i)  # a stall is a pause of that thread
                self.world = self.world._replace(pauses=self.world.pauses + 1)
            if i in self.doomed and _closing(self.world.node(i)):
                self.doomed.discard(i)
                return self._try(Event("crash", i))
        return self._try(Event("finish", i)) or moved

    def _run(self, order: list[int], ticks: int) -> None:
        """``ticks`` poll intervals of the fair schedule: each node trains a step, then the
        nodes' due loop steps interleave, in ``order``, until none is due; then the clock
        ticks."""
        for _ in range(ticks):
            for i in order:
                self._train(i % self.CONFIG.nodes)
            for _ in range(100):
                if not any([self._turn(i % self.CONFIG.nodes) for i in order]):
                    break
            self.world = apply(self.world, Event("tick"))
            self.slow = {i: n - 1 for i, n in self.slow.items() if n > 1}
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

    @invariant()
    def joins_load_the_newest(self) -> None:
        self._holds("join-newest")

    @invariant()
    def left_after_uploads(self) -> None:
        self._holds("left-after-uploads")

    @invariant()
    def loops_never_fail(self) -> None:
        self._holds("loops-live")


def _closing(node: NodeState) -> bool:
    """Whether the node's syncer is in the middle of a close (claimed, not yet committed)."""
    return node.syncer is not None and node.syncer.state.closing is not None


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
        grain="call",
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

    @precondition(_some(lambda n: not n.alive))
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        """A first join, or a restart of a crashed node under a new nonce."""
        self._pick(data, frozenset({"join"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def train(self, data: st.DataObject) -> None:
        """One training step (merging delivered commits first), or a merge while blocked."""
        self._pick(data, frozenset({"train", "merge"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def loop_step(self, data: st.DataObject) -> None:
        """One call of one loop of one node (join, learner or syncer), and its effects."""
        self._pick(data, frozenset({"step"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data(), outcome=st.sampled_from(["lost", "ambiguous"]))
    def faulty_create(self, data: st.DataObject, outcome: str) -> None:
        """A loop step whose create is lost in transit (the retry goes on) or lands with its
        answer lost (the exchange reads it back)."""
        self._pick(data, frozenset({"step"}), outcome=outcome)

    @precondition(_some(lambda n: n.alive))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"crash"}))

    @precondition(_some(lambda n: n.active))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """``Session.close``, or the end of it once the learner is done."""
        self._pick(data, frozenset({"leave", "finish"}))

    @precondition(_some(lambda n: n.alive))
    @rule(data=st.data())
    def pause_or_resume(self, data: st.DataObject) -> None:
        self._pick(data, frozenset({"pause", "resume"}))

    @rule(ticks=st.integers(1, 3))
    def advance(self, ticks: int) -> None:
        """Time passes (whether or not the loops kept up: a node that did not is slow)."""
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
        """``node`` stands still beyond lease_timeout while the others keep their pace."""
        others = [i for i in range(self.CONFIG.nodes) if i != node]
        self._run(others, self.CONFIG.lease_timeout + 1)
        self._note(f"n{node} stood still for {self.CONFIG.lease_timeout + 1} ticks")


ProtocolMachine.TestCase.settings = STEPS
TestProtocol = ProtocolMachine.TestCase


class LoopMachine(WorldMachine):
    """A fair schedule with injected faults: each ``tick`` every node takes its turn (in a
    drawn order) as its threads would in one poll interval: one training step, then every loop
    step that is due; then the clock ticks. Rules inject what breaks that rhythm: a faulty next
    create, a closer that stalls, a pause, a crash, a restart, a leave, and a check that from
    here, with faults healed, every published round commits (liveness). A race is then a
    handful of rules away, so planted bugs are found within the CI budget."""

    CONFIG = Config(
        nodes=2, fragments=1, rounds=3, crashes=1, faults=2, pauses=2, keep=1, grain="call"
    )

    def __init__(self) -> None:
        super().__init__()
        for i in range(self.CONFIG.nodes):
            self._try(Event("join", i))

    @rule(order=st.permutations(range(2)), ticks=st.integers(1, 4))
    def run(self, order: list[int], ticks: int) -> None:
        self._run(order, ticks)

    @rule(
        node=NODES,
        outcome=st.sampled_from(["lost", "ambiguous"]),
        kind=st.sampled_from(["snapshot", "claim", "commit"]),
    )
    def fault_next_create(self, node: int, outcome: str, kind: str) -> None:
        """The node's next create of a ``kind`` record is lost in transit (retried) or lands
        with its answer lost (read back)."""
        self.plan[node % self.CONFIG.nodes] = f"{outcome}@{kind}"

    @rule(node=NODES)
    def slow_closer(self, node: int) -> None:
        """Once the node next claims a round, its syncer stalls beyond the takeover timeout
        between the claim and the commit: the others must take its round over."""
        self.stall[node % self.CONFIG.nodes] = 2 * self.CONFIG.takeover + 2

    @rule(node=NODES)
    def doomed_closer(self, node: int) -> None:
        """Once the node next claims a round, it crashes between its claim and its commit."""
        self.doomed.add(node % self.CONFIG.nodes)

    @rule(node=NODES, what=st.sampled_from(["pause", "crash", "leave"]))
    def disrupt(self, node: int, what: str) -> None:
        """A pause (or the resume that ends it), a crash (or the restart after it), a leave."""
        if what == "pause":
            self._try(Event("pause", node)) or self._try(Event("resume", node))
        elif what == "crash":
            self._try(Event("crash", node)) or self._try(Event("join", node))
        else:
            self._try(Event("leave", node))

    @rule()
    def eventually(self) -> None:
        """Liveness from here: faults heal, every node closes, and every round commits."""
        settled = settle(self.world)
        assert settled.ok, f"eventually-committed: {settled.reason}"

    @invariant()
    def one_claim_in_a_healthy_run(self) -> None:
        """Loops that keep their pace (no crash, pause or stall) never take a round over.
        (The protocol machine lets time pass without them, so it does not check this.)"""
        self._holds("single-claim")


LoopMachine.TestCase.settings = STEPS
TestLoops = LoopMachine.TestCase

# Planted bugs (Decision 12): every one in the registry, and the property it breaks. A chain
# walk that skips a commit may also hand a joining node a commit whose payloads are already
# collected (keep=1 here), again and again: its join then fails outright.
# no-readback: a closer whose claim landed but was reported failed takes its own claim for
# another's and stands down, so attempt 1 is claimed in a healthy run (single-claim); the search
# finds that before a deleted payload (included-exist) since only the closer it predicts lists
# a round (Decision 8).
PLANTED = {
    **BROKEN,
    "chain-skips": "join-newest|loops-live",
    "no-readback": "included-exist|single-claim",
    # found at once, or inside the healed schedule of ``eventually`` (which names the flag's
    # message, not its name)
    "leave-early": "left-after-uploads|lease says left before its snapshot",
}
# Derandomized and without the example database: the same search on every run, so whether a
# planted bug is found depends neither on luck nor on what an earlier run left in .hypothesis/.
FIND = settings(
    STEPS,
    phases=[Phase.explicit, Phase.generate],
    derandomize=True,
    database=None,
    max_examples=1500,
)


# Collection that ignores ``keep`` is only wrong where the run keeps more than one round.
SETTINGS = {"gc-too-early": {"keep": 2}}
# skip-forgets needs a reader several commits behind whose parameters were collected: since only
# the predicted closer reads a round (Decision 8) fewer schedules reach it, and 1,500 examples
# found it or not depending on what ran before in the process; 4,000 find it either way.
EXAMPLES = {"skip-forgets": 4000}


def planted(bug: str) -> type[LoopMachine]:
    config = attrs.evolve(LoopMachine.CONFIG, bugs=frozenset({bug}), **SETTINGS.get(bug, {}))
    return type(f"Planted_{bug.replace('-', '_')}", (LoopMachine,), {"CONFIG": config})


# skip-forgets takes 6 to 95 s here, by what ran before it in the process (EXAMPLES above):
# CI finds it with the explorer's random walk and the simulator, and this with --runslow.
SLOW_TO_FIND = {"skip-forgets"}


@pytest.mark.parametrize(
    "bug",
    [pytest.param(b, marks=pytest.mark.slow) if b in SLOW_TO_FIND else b for b in sorted(PLANTED)],
)
def test_planted_bug_is_caught(bug: str) -> None:
    """Decision 12: swapping one rule for its broken variant makes the machine fail, on the
    property that bug breaks (found without shrinking: shrinking is the slow test below)."""
    with pytest.raises(AssertionError, match=PLANTED[bug]):
        search = settings(FIND, max_examples=EXAMPLES.get(bug, FIND.max_examples))
        run_state_machine_as_test(planted(bug), settings=search)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_shrinks_to_a_short_trace(bug: str) -> None:
    """The shrunk counterexample (Hypothesis prints it in the exception's notes) is short."""
    with pytest.raises(AssertionError, match=PLANTED[bug]) as failure:
        run_state_machine_as_test(planted(bug), settings=settings(STEPS, database=None))
    notes = getattr(failure.value, "__notes__", [])
    steps = [
        n
        for n in notes
        if re.match(r"state\.(run|slow_closer|doomed|fault|disrupt|eventually)", n.strip())
    ]
    print("\n".join(notes))
    assert 1 <= len(steps) <= 8, notes
