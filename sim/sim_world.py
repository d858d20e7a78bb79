"""One simulated run: N nodes, each a process of the same ``Node`` (learner and syncer) the
library runs, over one in-memory store, on virtual time, with the faults a ``SimConfig`` asks.

The run has two phases. In the *safety* phase faults are on: transient errors, lost responses,
409s and stale listings from the store; latency; crashes at random times and just before or
after writes (between a claim and its commit, between a commit's payloads and its record);
stops of a whole process past ``lease_timeout``; restarts under the same id with a new process
nonce; late joins and early leaves. At ``heal`` the faults stop, pauses end, and crashed nodes
restart until a majority is alive; in the *liveness* phase every round a surviving node
published to must commit within ``bound`` seconds, and every node must finish its close.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from typing import Any

import attrs

from gradientmail._events import Committed, Event, Joined, LeaseExpired, Merged, Rebased
from gradientmail._node import Node
from gradientmail.core import keys
from gradientmail.core.envelope import unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Lease, read_record
from gradientmail.mailboxes._memory import Faults, MemoryMailbox
from gradientmail.mailboxes._protocol import ObjectInfo, TransientMailboxError
from gradientmail.testing._virtual import Crashed, NodeClock, Scheduler, VirtualClock
from sim.sim_backend import backend_for, model_for, train_step
from sim.sim_checks import Checker, Incarnation, Violation
from sim.sim_config import SimConfig
from sim.sim_end import finish
from sim.sim_mailbox import Latency, SimMailbox, run_now
from specs.bugs import rules_for

__all__ = ["Outcome", "World", "simulate"]

_WEIGHTY = ("claim", "commit", "params", "state")


@attrs.frozen(kw_only=True)
class Outcome:
    """What one run did and found. ``requests`` counts every request the nodes sent, by kind
    (``get``, ``list``, ...; ``bytes_out``) and by kind and purpose (``"get lease"``,
    ``"list snapshot"``, ...)."""

    config: SimConfig
    violations: tuple[Violation, ...]
    digest: str
    committed: int
    node_rounds: int
    requests: dict[str, int]
    events: int
    steps: int
    virtual: float
    wall: float
    cpu: float
    trace: tuple[tuple[float, str, str], ...]
    notes: dict[str, int]
    faults: tuple[str, ...] = ()
    """The faults that fired, in order, by their ids (``SimConfig.faults_kept``)."""
    delays: tuple[str, ...] = ()
    """The request latencies waited, in order, by their ids (``SimConfig.latency_kept``); kept
    only in a traced run (``keep_trace``) or one with ``latency_kept`` set."""


@attrs.define(eq=False)
class Slot:
    """A learner id and its workload, across its incarnations."""

    node: str
    rng: random.Random
    target: float
    factor: float
    batch: int
    join_at: float
    leave_after: int | None
    steps_left: int
    steps_done: int = 0
    restart_pending: bool = False
    incarnations: list[Incarnation] = attrs.Factory(list)

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None


def simulate(config: SimConfig, *, keep_trace: bool = True) -> Outcome:
    """Run ``config`` once and return its outcome (violations included, never raised)."""
    return World(config, keep_trace=keep_trace).run()


class World:
    def __init__(self, config: SimConfig, *, keep_trace: bool = True) -> None:
        self.config = c = config
        self.algorithm = c.algorithm()
        self.clock = VirtualClock()
        self.rules = rules_for(frozenset({c.plant}) if c.plant else None)
        self.scheduler = Scheduler(self.clock, seed=c.seed)
        self.rng = random.Random(f"world:{c.seed}")
        self.store = MemoryMailbox(f"memory://sim-{c.seed}", clock=self.clock)
        self.oracle = self.store.handle(clock=self.clock)
        self.backend = backend_for(c.model)
        self.takeover = c.takeover if c.takeover is not None else c.lease_timeout
        self._lease_versions: dict[tuple[str, str], str] = {}
        self.checker = Checker(
            algorithm=self.algorithm,
            backend=self.backend,
            oracle=self.oracle,
            clock=self.clock,
            lease_timeout=c.lease_timeout,
            takeover=self.takeover,
        )
        self.keep_trace = keep_trace
        self.trace: list[tuple[float, str, Any]] = []
        self.events = 0
        self.notes: dict[str, int] = {}
        self.healed = False
        self.heal_at = c.safety * c.planned
        self._fault_seen: dict[str, int] = {}
        self.faults_fired: list[str] = []
        self._delay_seen: dict[str, int] = {}
        self.delays_waited: list[str] = []
        self.bound = self._bound()
        self.world = self.scheduler.process("world")
        self.slots = [self._slot(i) for i in range(c.nodes)]

    # -- set-up -------------------------------------------------------------------------

    def _slot(self, i: int) -> Slot:
        c, rng = self.config, self.rng
        late = i > 0 and rng.random() < c.late_joiners
        leave = rng.random() < c.leavers
        return Slot(
            node=f"n{i:03d}",
            rng=random.Random(f"node:{c.seed}:{i}"),
            target=1.0 + 0.25 * (i % 5),
            factor=math.exp(rng.gauss(0.0, c.speed_spread)) if c.speed_spread > 0 else 1.0,
            batch=rng.choice((8, 16, 32)),
            join_at=rng.uniform(0.0, 0.5 * self.heal_at) if late else 0.01 * i,
            leave_after=rng.randrange(1, c.steps) if leave and c.steps > 1 else None,
            steps_left=c.steps,
        )

    def _bound(self) -> float:
        """Seconds within which a round must commit once faults are healed: enough to expire
        every dead closer in turn, take over twice, wait out grace and the slowest slot, for a
        reporter to wait ``takeover`` before it reads a round it left to the closer it predicts
        (Decision 8: when that closer and the next are gone), and for the other reporters to
        publish at all: a round is timed from its first snapshot, and the others may be held
        at the overlap bound until the rounds before it commit (``_requests``)."""
        c = self.config
        slot_time = c.slot_steps * c.step_time * math.exp(3 * c.speed_spread) * 1.25
        lease = c.lease_timeout + c.lease_every + 2 * c.poll_interval
        return 4 * lease + 4 * self.takeover + c.grace + 4 * slot_time + self._requests() + 10

    def _requests(self) -> float:
        """The bound's allowance for request latency. A round waits on a chain of requests
        (the previous commit's GETs, a payload and a snapshot create, the closer's LIST, claim,
        snapshot GETs eight at a time, payload and commit creates): a dozen steps, each as slow
        as the slowest of the nodes a quorum of all of them waits on, for the rounds of every
        fragment before it and its own. The slowest of n draws grows with n: for the pareto
        latency (shape 1.5, scale mean / 3) about ``mean / 3 * n ** (2/3)``, up to the cap of
        100 means; for the exponential ``mean * ln n``. At least 200 means, the allowance for
        two closes measured at 8 nodes (a close under pareto latency took 35 s at a 0.3 s
        mean); at 64 nodes with a 0.3 s pareto mean a round waited 40 s on its predecessor
        (seed 69)."""
        c = self.config
        floor = 2 * 100 * c.latency_mean
        draws = 8 * c.nodes  # requests per node and round, of every node
        if c.latency == "pareto":
            slowest = min(100 * c.latency_mean, c.latency_mean / 3 * draws ** (2 / 3))
        elif c.latency == "exponential":
            slowest = c.latency_mean * math.log(draws)
        else:
            return floor
        return max(floor, 12 * (c.fragments + 1) * slowest)

    def _start(self, slot: Slot) -> None:
        c = self.config
        number = len(slot.incarnations)
        drift = self.rng.uniform(-c.clock_drift, c.clock_drift)
        process = self.scheduler.process(f"{slot.node}#{number}")
        clock = NodeClock(self.clock, offset=self.rng.uniform(0, 1e6), rate=1.0 + drift)
        inc = Incarnation(node=slot.node, number=number, process=process, clock=clock)
        faults = Faults(
            seed=self.rng.getrandbits(32),
            fail_before=c.fail_before,
            fail_after=c.fail_after,
            conflict=c.conflict,
            stale_list=c.stale_list,
            stale_window=max(c.poll_interval, 1.0),
            decide=lambda fault, op, key, drawn: self._decide(inc, f"{fault} {op} {key}", drawn),
        )
        inc.mailbox = SimMailbox(
            owner=inc,
            faulty=self.store.handle(faults=faults, clock=self.clock),
            clean=self.store.handle(clock=self.clock),
            oracle=self.oracle,
            clock=self.clock,
            latency=Latency(c.latency, c.latency_mean, random.Random(self.rng.getrandbits(32))),
            observer=self,
            naive=c.naive,
        )
        if self.healed:
            inc.mailbox.heal()
        inc.model = model_for(c.model, c.fragments)
        slot.incarnations.append(inc)
        self._note(inc.label, "start")
        self.scheduler.spawn("life", self._life(slot, inc), process=process)

    # -- the run ------------------------------------------------------------------------

    def run(self) -> Outcome:
        c = self.config
        started, cpu = time.perf_counter(), time.process_time()
        self._schedule()
        limit = self._limit()
        self.scheduler.run(until=limit, stop=lambda: bool(self.checker.violations))
        if not self.checker.violations:
            finish(self, limit)
        self.scheduler.close()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        requests: dict[str, int] = {}
        for slot in self.slots:
            for inc in slot.incarnations:
                counts = {**inc.mailbox.stats.snapshot(), **inc.mailbox.purposes}
                for kind, n in counts.items():
                    requests[kind] = requests.get(kind, 0) + n
        return Outcome(
            config=c,
            violations=tuple(self.checker.violations),
            digest=self.scheduler.digest,
            committed=len(self.checker.commits),
            node_rounds=self.checker.node_rounds,
            requests=requests,
            events=self.events,
            steps=self.scheduler.steps,
            virtual=self.clock.time,
            wall=wall,
            cpu=cpu,
            trace=tuple((t, who, str(what)) for t, who, what in self.trace),
            notes=dict(self.notes),
            faults=tuple(self.faults_fired),
            delays=tuple(self.delays_waited),
        )

    def _limit(self) -> float:
        c = self.config
        slowest = max(s.join_at + c.planned * s.factor * 1.25 for s in self.slots)
        return 3 * slowest + c.nodes * c.downtime + 10 * self.bound + 60

    def _schedule(self) -> None:
        c, world = self.config, self.world
        for slot in self.slots:
            self.scheduler.spawn(
                f"join-{slot.node}", self._at(slot.join_at, self._join, slot), process=world
            )
            for when in self._times(c.crash_rate):
                self.scheduler.spawn("crash", self._at(when, self._crash_slot, slot), process=world)
            for when in self._times(c.pause_rate):
                self.scheduler.spawn("pause", self._at(when, self._pause_slot, slot), process=world)
        self.scheduler.spawn("heal", self._at(self.heal_at, self._heal), process=world)
        if c.replay_leases:
            self.scheduler.spawn("replay-leases", self._replay_leases(), process=world)

    async def _replay_leases(self) -> None:
        """A writer without the secret: every ``lease_every / 2`` seconds it puts back each
        lease as it was at its previous look (genuine bytes), for as long as any node may still
        run: a dead node's last lease again and again, a live node's older renewals between its
        own. Written to the store directly (no node's requests)."""
        c = self.config
        before: dict[str, bytes] = {}
        while not self.healed or any(
            (s.current is not None and s.current.alive) or s.restart_pending for s in self.slots
        ):
            await self.clock.sleep(c.lease_every / 2)
            now: dict[str, bytes] = {}
            for info in await self.oracle.list(keys.LEASES):
                data = await self.oracle.get(info.key)
                if data is not None:
                    now[info.key] = data
            for key, data in before.items():
                await self.oracle.put(key, data)
                self.notes["lease replayed"] = self.notes.get("lease replayed", 0) + 1
            before = now

    def _times(self, rate: float) -> list[float]:
        """Event times in the safety phase for a Poisson process of ``rate`` per 1000 s."""
        times: list[float] = []
        if rate <= 0:
            return times
        t = self.rng.expovariate(rate / 1000)
        while t < self.heal_at:
            times.append(t)
            t += self.rng.expovariate(rate / 1000)
        return times

    async def _at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        await self.clock.sleep(when - self.clock.time)
        action(*args)

    def _join(self, slot: Slot) -> None:
        if not slot.incarnations:
            self._start(slot)

    # -- a node's life ------------------------------------------------------------------

    async def _life(self, slot: Slot, inc: Incarnation) -> None:
        try:
            await self._train(slot, inc)
        except (GeneratorExit, Crashed):
            raise
        except BaseException as exc:
            self._failed(inc, "training", exc)

    async def _train(self, slot: Slot, inc: Incarnation) -> None:
        """The node's process: the library's own ``Node`` (join, its two loops, ``step`` and
        ``close``, exactly as ``Session`` runs them), with the simulator's clock, mailbox,
        nonces and (for a planted bug) rules."""
        c = self.config
        nonces = random.Random(f"nonces:{c.seed}:{inc.label}")
        node = Node(
            inc.model,
            algorithm=self.algorithm,
            mailbox=inc.mailbox,
            clock=inc.clock,
            learner_id=slot.node,
            backend=self.backend,
            poll_interval=c.poll_interval,
            lease_every=c.lease_every,
            lease_timeout=c.lease_timeout,
            takeover=c.takeover,
            on_event=lambda event: self._event(inc, event),
            keep_rounds=c.keep_rounds,
            gc_horizon=c.gc_horizon,
            nonces=lambda: f"{nonces.getrandbits(64):016x}",
            rules=self.rules,
        )
        inc.session = node
        await node.join()
        for name, loop in node.loops():
            self.scheduler.spawn(name, loop, process=inc.process)
        inc.status = "training"
        while slot.steps_left > 0 and (
            slot.leave_after is None or slot.steps_done < slot.leave_after
        ):
            await inc.clock.sleep(c.step_time * slot.factor * slot.rng.uniform(0.8, 1.2))
            train_step(inc.model, slot.target, slot.rng)
            inc.trained += slot.batch
            await node.step(slot.batch)
            slot.steps_left -= 1
            slot.steps_done += 1
        inc.status = "closing"
        self._note(inc.label, "closing")
        await node.close()
        slot.steps_left = 0
        inc.status = "closed"
        self._note(inc.label, "closed")

    def _failed(self, inc: Incarnation, where: str, exc: BaseException) -> None:
        """The node's process ends with ``exc``: expected when injected transient errors
        outlasted the retries, a finding otherwise."""
        inc.status = "failed"
        self._note(inc.label, f"failed in {where}: {exc!r}")
        self.scheduler.crash(inc.process)
        if isinstance(exc, TransientMailboxError) and not self.healed:
            self.notes["gave-up"] = self.notes.get("gave-up", 0) + 1
            self._maybe_restart(self.slot_of(inc))
            return
        self.checker.fail(
            "node-failed", f"{inc.label} failed in {where}: {exc!r}", nodes=(inc.node,)
        )

    # -- faults -------------------------------------------------------------------------

    def _crash(self, inc: Incarnation, why: str) -> None:
        if not inc.alive:
            return
        running = (
            self.scheduler.current is not None and self.scheduler.current.process is inc.process
        )
        inc.status = "crashed"
        self._note(inc.label, f"crash {why}")
        self.scheduler.crash(inc.process)
        self._maybe_restart(self.slot_of(inc))
        if running:
            raise Crashed(why)

    def _maybe_restart(self, slot: Slot) -> None:
        c = self.config
        if slot.steps_left <= 0 or slot.restart_pending:
            return
        if self.rng.random() >= c.restart and not self.healed:
            return
        slot.restart_pending = True
        delay = self.rng.expovariate(1 / c.downtime) if c.downtime > 0 else 0.0
        self.scheduler.spawn(
            "restart", self._at(self.clock.time + delay, self._restart, slot), process=self.world
        )

    def _restart(self, slot: Slot) -> None:
        slot.restart_pending = False
        current = slot.current
        if slot.steps_left > 0 and (current is None or not current.alive):
            self._start(slot)

    def _crash_slot(self, slot: Slot) -> None:
        inc = slot.current
        alive = not self.healed and inc is not None and inc.alive
        if alive and self._decide(inc, f"crash at {self.clock.time!r}", True):
            self._crash(inc, "at a random time")

    def _pause_slot(self, slot: Slot) -> None:
        inc = slot.current
        alive = not self.healed and inc is not None and inc.alive
        if alive and self._decide(inc, f"pause at {self.clock.time!r}", True):
            self._pause(inc, "at a random time")

    def _decide(self, inc: Incarnation, what: str, drawn: bool) -> bool:
        """Whether the fault ``what`` (its kind and place: ``"crash before put <key>"``) takes
        effect at this, its n-th chance in ``inc``: as drawn, or with ``faults_kept`` set, if
        its id is kept. The id is a hash of the incarnation, ``what`` and n, so it names the
        same fault in a rerun that fires other faults."""
        text = f"{inc.label} {what}"
        n = self._fault_seen.get(text, 0)
        self._fault_seen[text] = n + 1
        kept = self.config.faults_kept
        if kept is None and not drawn:
            return False
        text = f"{text} {n}"
        fid = hashlib.blake2s(text.encode(), digest_size=4).hexdigest()
        if kept is not None and fid not in kept:
            return False
        self.faults_fired.append(fid)
        if self.keep_trace:
            self.trace.append((self.clock.time, inc.label, f"fault {fid}: {what} ({n})"))
        return True

    def delay(self, mailbox: SimMailbox, leg: str, kind: str, key: str, drawn: float) -> float:
        """The latency waited: as drawn, or with ``latency_kept`` set, only if its id is kept
        (else none). The id is a hash of the incarnation, the leg and key, and how many legs
        like it the incarnation drew before, as a fault's is (``_decide``). Ids are kept only
        in a traced run or one with ``latency_kept`` (a swarm's runs spend nothing on them)."""
        kept = self.config.latency_kept
        if kept is None and not self.keep_trace:
            return drawn
        text = f"{mailbox.owner.label} {leg} {kind} {key}"
        n = self._delay_seen.get(text, 0)
        self._delay_seen[text] = n + 1
        did = hashlib.blake2s(f"{text} {n}".encode(), digest_size=4).hexdigest()
        if kept is not None and did not in kept:
            return 0.0
        self.delays_waited.append(did)
        if kept is not None and self.keep_trace:  # the few a shrunk run keeps, named
            self.trace.append((self.clock.time, mailbox.owner.label, f"delay {did}: {text}"))
        return drawn

    def _pause(self, inc: Incarnation, why: str) -> None:
        c = self.config
        length = c.pause_length * c.lease_timeout * self.rng.uniform(0.5, 1.5)
        self._note(inc.label, f"pause {length:.2f}s {why}")
        self.scheduler.pause(inc.process, self.clock.time + length)

    def _heal(self) -> None:
        self.healed = True
        self._note("world", "heal")
        for slot in self.slots:
            for inc in slot.incarnations:
                inc.mailbox.heal()
                inc.process.paused_until = min(inc.process.paused_until, self.clock.time)
        alive = sum(1 for s in self.slots if s.current is not None and s.current.alive)
        for slot in self.slots:
            if alive >= (self.config.nodes + 1) // 2:
                break
            current = slot.current
            dead = current is not None and not current.alive
            if dead and slot.steps_left > 0 and not slot.restart_pending:
                self._start(slot)
                alive += 1

    # -- the mailbox's observer (WriteObserver) -------------------------------------------

    def issued(self, mailbox: SimMailbox, kind: str, key: str, data: bytes) -> None:
        if kind == "put" and key.startswith("leases/"):
            self.checker.lease_issued(mailbox.owner, key, data)

    def before_write(self, mailbox: SimMailbox, kind: str, key: str, started: float) -> bool:
        inc: Incarnation = mailbox.owner
        if "/claims/" in key:
            inc.claim_started.setdefault(key, started)
        elif key.endswith(f"/snapshots/{inc.node}"):
            inc.publishing.setdefault(keys.parse(key).round or 0, started)
        if self.healed:
            return False
        c = self.config
        weight = 10.0 if any(f"/{w}" in key for w in _WEIGHTY) else 1.0
        if c.crash_on_write > 0:
            crash_before, crash_after = self._around(
                inc, "crash", c.crash_on_write * weight, kind, key
            )
            if crash_before:
                self._crash(inc, f"before {kind} {key}")
            if crash_before or crash_after:
                inc.crash_after_write = True
        if c.pause_on_write > 0:
            pause_before, pause_after = self._around(
                inc, "pause", c.pause_on_write * weight, kind, key
            )
            if pause_before:
                self._pause(inc, f"before {kind} {key}")
                return True
            if pause_after:
                inc.pause_after_write = True  # a stall right after a write: after a won claim
        return False

    def _around(
        self, inc: Incarnation, fault: str, rate: float, kind: str, key: str
    ) -> tuple[bool, bool]:
        """Whether ``fault`` (a crash or a pause) strikes just before this write, or just
        after it: drawn with probability ``rate``, half each (``_decide`` numbers both)."""
        drawn = self.rng.random() < rate
        before = drawn and self.rng.random() < 0.5
        return (
            self._decide(inc, f"{fault} before {kind} {key}", before),
            self._decide(inc, f"{fault} after {kind} {key}", drawn and not before),
        )

    def after_write(
        self,
        mailbox: SimMailbox,
        kind: str,
        key: str,
        data: bytes,
        before: bytes | None,
        landed: bool,
    ) -> None:
        inc: Incarnation = mailbox.owner
        if landed:
            if not key.startswith("leases/"):
                self._record(inc, f"{kind} {key}")
            self.checker.landed(inc, key, data, before)
        elif "/claims/" in key:
            inc.claim_started.pop(key, None)
        if inc.crash_after_write:
            inc.crash_after_write = False
            self._crash(inc, f"after {kind} {key} ({'landed' if landed else 'not landed'})")
        if inc.pause_after_write:
            inc.pause_after_write = False
            self._pause(inc, f"after {kind} {key}")  # holds at the request's return trip

    def read(self, mailbox: SimMailbox, key: str) -> None:
        inc: Incarnation = mailbox.owner
        if key.startswith(keys.LEASES):
            # A lease read after a listing shows the record as it is now: an observation too
            # (the keeper judges the record it reads, which may be newer than the one listed).
            info = ObjectInfo(key=key, size=0, version="")
            self.checker.leases_listed(
                inc, {key[len(keys.LEASES) :]: _record_version(mailbox, info)}
            )
        if inc.status == "starting" and key.startswith("heads/"):
            # A joining node's chain walk of a fragment begins: it must find at least the
            # newest commit there is now.
            k = int(key[len("heads/") :])
            inc.join_floor[k] = self.checker.newest_rounds()[k]

    def listed(self, mailbox: SimMailbox, prefix: str, infos: list[ObjectInfo]) -> None:
        if prefix == keys.LEASES:
            # A lease changes when its record does (core.leases judges the record): a retry
            # rewriting the same renewal, or a replay, is no renewal.
            versions = {i.key[len(keys.LEASES) :]: self._listed_version(mailbox, i) for i in infos}
            self.checker.leases_listed(mailbox.owner, versions)

    def _listed_version(self, mailbox: SimMailbox, info: ObjectInfo) -> str:
        """``_record_version`` of a listed lease, kept by key and store version: the object a
        version names never changes (every write takes a new one), and every node lists the
        same leases again and again."""
        known = self._lease_versions.get((info.key, info.version))
        if known is None:
            known = self._lease_versions[(info.key, info.version)] = _record_version(mailbox, info)
        return known

    # -- events and the trace -------------------------------------------------------------

    def _event(self, inc: Incarnation, event: Event) -> None:
        self.events += 1
        if isinstance(event, Committed):
            event = attrs.evolve(event, seconds=0.0)  # wall time: not part of a replay
        self._record(inc, event)
        if isinstance(event, Merged):
            self.checker.merged(inc, event.round, event.fragment)
        elif isinstance(event, Rebased):
            self.checker.rebased(inc, event.missed, event.samples)
        elif isinstance(event, Joined):
            inc.merged = dict(enumerate(event.rounds))
            self.checker.joined(inc, event.rounds)
        elif isinstance(event, LeaseExpired) and event.observer == inc.node:
            self.checker.lease_expired(inc, event.node)

    def _record(self, inc: Incarnation, what: Any) -> None:
        text = repr(what)
        self.scheduler.record(f"{self.clock.time!r} {inc.label} {text}\n".encode())
        if self.keep_trace:
            self.trace.append((self.clock.time, inc.label, what))

    def _note(self, who: str, what: str) -> None:
        self.scheduler.record(f"{self.clock.time!r} {who} {what}\n".encode())
        if self.keep_trace:
            self.trace.append((self.clock.time, who, what))

    def slot_of(self, inc: Incarnation) -> Slot:
        return self.slots[int(inc.node[1:])]


def _record_version(mailbox: SimMailbox, info: ObjectInfo) -> str:
    """The listed lease as its record says it (process nonce and counter), read from the store
    as the listing ran; the listing's own version for an object that is no lease record."""
    data = run_now(mailbox.oracle.get(info.key))
    try:
        lease = read_record(unseal(data).record, Lease, key=info.key)
    except (FormatError, TypeError, ValueError):
        return info.version
    return f"{lease.nonce}.{lease.counter}.{lease.left}"
