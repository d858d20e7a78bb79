"""What one simulated run is: a ``SimConfig``, and swarm testing's expansion of a seed into one.

Swarm testing (Groce et al. 2012; TigerBeetle's VOPR does the same): instead of every fault at
a fixed rate in every run, each seed switches a random subset of fault kinds on, at rates and
with workload options drawn from short menus, so different seeds stress different mixes and a
fault that masks another (say, crashes that end a run before pauses matter) is often absent.
``SimConfig.describe`` prints the expansion; ``with_overrides`` applies ``--set key=value``
changes, so any run (including a shrunk one) replays from its seed and a few overrides.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from gradientmail.core.algorithm import DiLoCo
from specs.bugs import BUGS

__all__ = ["FAULT_RATES", "LatencyKind", "ModelKind", "Plant", "SimConfig", "setting_text", "swarm"]

LatencyKind = Literal["none", "uniform", "exponential", "pareto"]
ModelKind = Literal["float", "torch"]
Plant = str
PLANTS: tuple[Plant, ...] = tuple(sorted(BUGS))
"""The planted bugs (specs/bugs.py: the registry the explorer and the machines share)."""


FAULT_RATES = (
    "fail_before",
    "fail_after",
    "conflict",
    "stale_list",
    "crash_rate",
    "crash_on_write",
    "pause_rate",
    "pause_on_write",
)
"""The fields that inject a fault: a run with all of them 0 has none."""


@attrs.frozen(kw_only=True)
class SimConfig:
    """One run. Times are seconds of virtual time; rates are probabilities unless named
    ``*_rate`` (events per node per 1000 s of virtual time).

    Workload: ``nodes`` learners train ``rounds * H / K`` inner steps each (one round every
    ``H/K`` steps), each step ``step_time`` seconds times a per-node factor
    ``exp(N(0, speed_spread))``; ``late_joiners`` of them join at a uniform time in the first
    half of the safety phase, ``leavers`` close early. Faults are on during the safety phase
    (the first ``safety`` fraction of the planned duration) and healed for the liveness phase.

    Process faults: ``crash_rate`` and ``pause_rate`` at random times; ``crash_on_write`` and
    ``pause_on_write`` per write, just before or just after it (half each; ten times as likely
    for claims, commits and their payloads), so a crash or a stall falls between a claim and
    its commit, or between a commit's payloads and its record. A pause lasts
    ``pause_length * lease_timeout`` (times 0.5 to 1.5); a crashed node restarts with
    probability ``restart`` after an exponential ``downtime`` (mean, seconds).
    """

    seed: int
    nodes: int = 8
    rounds: int = 40
    model: ModelKind = "float"
    naive: bool = False
    plant: Plant | None = None
    # The algorithm.
    inner_steps: int = 8
    fragments: int = 1
    overlap_steps: int | None = 0
    alpha: float | None = None
    quorum_size: int = 1
    grace: float = 1.0
    # Node settings.
    poll_interval: float = 1.0
    lease_every: float = 2.0
    lease_timeout: float = 6.0
    takeover: float | None = None
    keep_rounds: int | None = 2
    gc_horizon: float = 0.0
    # Speeds and clocks.
    step_time: float = 0.2
    speed_spread: float = 0.0
    clock_drift: float = 0.0
    # The mailbox.
    latency: LatencyKind = "uniform"
    latency_mean: float = 0.02
    fail_before: float = 0.0
    fail_after: float = 0.0
    conflict: float = 0.0
    stale_list: float = 0.0
    # Processes.
    crash_rate: float = 0.0
    crash_on_write: float = 0.0
    restart: float = 1.0
    downtime: float = 5.0
    pause_rate: float = 0.0
    pause_on_write: float = 0.0
    pause_length: float = 2.0
    late_joiners: float = 0.0
    leavers: float = 0.0
    safety: float = 0.6
    # A writer without the secret that puts back every lease as it was one look earlier.
    replay_leases: bool = False
    # Delta debugging (``sim.simulate.shrink``): only the faults with these ids fire, whatever
    # was drawn (``Outcome.faults`` lists the ids that fired: a hash of the incarnation, the
    # fault and its place, and its count there); None: every fault drawn fires.
    faults_kept: tuple[str, ...] | None = None
    # The same for request latency: only the delays with these ids are waited (``Outcome.
    # delays``: a hash of the incarnation, the request's leg, kind and key, and its count
    # there); every other request takes none. None: every delay drawn is waited.
    latency_kept: tuple[str, ...] | None = None

    def __attrs_post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise ValueError(f"nodes and rounds must be >= 1, got {self.nodes}, {self.rounds}")
        if self.plant is not None and self.plant not in PLANTS:
            raise ValueError(f"plant must be one of {PLANTS}, got {self.plant!r}")
        if not 0 < self.safety <= 1:
            raise ValueError(f"safety is the fraction of the run with faults, got {self.safety}")
        self.algorithm()  # DiLoCo validates its own fields, naming the one at fault
        floor = 2 * self.lease_every + self.poll_interval
        if self.lease_timeout < floor:
            raise ValueError(
                f"lease_timeout ({self.lease_timeout}) must be at least 2 * lease_every + "
                f"poll_interval ({floor})"
            )
        if self.takeover is not None and self.takeover < self.lease_timeout:
            raise ValueError(
                f"takeover ({self.takeover}) must be None or at least lease_timeout "
                f"({self.lease_timeout})"
            )

    def algorithm(self) -> DiLoCo:
        return DiLoCo(
            inner_steps=self.inner_steps,
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            alpha=self.alpha,
            quorum_size=self.quorum_size,
            grace=self.grace,
        )

    @property
    def slot_steps(self) -> int:
        return self.inner_steps // self.fragments

    @property
    def steps(self) -> int:
        """Inner steps each node trains in all."""
        return self.rounds * self.slot_steps

    @property
    def planned(self) -> float:
        """Seconds the training would take at the mean speed without waiting."""
        return self.steps * self.step_time

    @property
    def faulty(self) -> bool:
        return any(getattr(self, name) > 0 for name in FAULT_RATES)

    def describe(self) -> str:
        """Every field that differs from the defaults, as ``key=value`` (what a seed chose)."""
        default = SimConfig(seed=self.seed)
        parts = [f"seed={self.seed}", f"nodes={self.nodes}", f"rounds={self.rounds}"]
        for field in attrs.fields(SimConfig):
            if field.name in ("seed", "nodes", "rounds"):
                continue
            value = getattr(self, field.name)
            if value != getattr(default, field.name) or field.name in ("inner_steps",):
                parts.append(f"{field.name}={setting_text(value)}")
        return " ".join(parts)

    def with_overrides(self, overrides: Mapping[str, str]) -> SimConfig:
        """This config with ``key=value`` strings parsed by each field's type."""
        changes: dict[str, Any] = {}
        fields = {f.name: f for f in attrs.fields(SimConfig)}
        for name, text in overrides.items():
            if name not in fields or name == "seed":
                raise ValueError(f"--set {name}: not a setting; choose from {sorted(fields)}")
            changes[name] = _parse(name, text, getattr(self, name))
        return attrs.evolve(self, **changes)


def setting_text(value: object) -> str:
    """A setting as ``--set`` parses it back: a tuple of fault ids comma-separated."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _parse(name: str, text: str, current: object) -> object:
    if text in ("None", "none") and name not in ("latency",):
        return None
    if name in ("faults_kept", "latency_kept"):
        ids = sorted({part.strip() for part in text.split(",") if part.strip()})
        bad = [i for i in ids if len(i) != 8 or any(ch not in "0123456789abcdef" for ch in i)]
        if bad:
            raise ValueError(f"--set {name}: expected comma-separated 8-digit hex ids, got {bad}")
        return tuple(ids)
    if isinstance(current, bool) or name == "naive":
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--set {name}: expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if name in (
        "nodes",
        "rounds",
        "inner_steps",
        "fragments",
        "overlap_steps",
        "quorum_size",
        "keep_rounds",
    ):
        return int(text)
    if isinstance(current, str) or name in ("latency", "model", "plant"):
        return text
    return float(text)


def _pick(rng: random.Random, menu: tuple[Any, ...]) -> Any:
    return menu[rng.randrange(len(menu))]


def swarm(seed: int, *, nodes: int, rounds: int, **fixed: Any) -> SimConfig:
    """The configuration seed ``seed`` stands for: a random mix of workload options and fault
    kinds (each fault kind on for about half the seeds). ``fixed`` settings are not drawn."""
    rng = random.Random(f"swarm:{seed}")
    H = _pick(rng, (4, 6, 8, 12))
    K = _pick(rng, (1, 1, 2, 3))
    slot = H // K
    lease_every = _pick(rng, (1.0, 2.0))
    poll = _pick(rng, (0.5, 1.0))
    lease_timeout = 2 * lease_every + poll + _pick(rng, (0.0, 2.0, 6.0))

    def maybe(menu: tuple[float, ...]) -> float:
        return _pick(rng, menu) if rng.random() < 0.5 else 0.0

    drawn: dict[str, Any] = {
        "inner_steps": H,
        "fragments": K,
        "overlap_steps": _pick(rng, (0, None, 1 if slot > 1 else 0)),
        "alpha": _pick(rng, (None, None, 0.5)),
        "quorum_size": _pick(rng, (1, max(1, nodes // 2), nodes)),
        "grace": _pick(rng, (0.0, 1.0, 5.0)),
        "poll_interval": poll,
        "lease_every": lease_every,
        "lease_timeout": lease_timeout,
        "takeover": _pick(rng, (None, 2 * lease_timeout)),
        "keep_rounds": _pick(rng, (None, 2, 3)),
        "step_time": _pick(rng, (0.05, 0.2, 0.5)),
        "speed_spread": _pick(rng, (0.0, 0.3, 1.0)),
        "clock_drift": _pick(rng, (0.0, 1e-4, 1e-2)),
        "latency": _pick(rng, ("none", "uniform", "exponential", "pareto")),
        "latency_mean": _pick(rng, (0.005, 0.05, 0.3)),
        "fail_before": maybe((0.01, 0.05, 0.15)),
        "fail_after": maybe((0.01, 0.05, 0.15)),
        "conflict": maybe((0.01, 0.05, 0.15)),
        "stale_list": maybe((0.05, 0.3)),
        "crash_rate": maybe((2.0, 10.0)),
        "crash_on_write": maybe((0.002, 0.01)),
        "restart": _pick(rng, (0.5, 1.0)),
        "downtime": _pick(rng, (1.0, 10.0, 60.0)),
        "pause_rate": maybe((2.0, 10.0)),
        "pause_on_write": maybe((0.002, 0.01)),
        "pause_length": _pick(rng, (0.5, 1.5, 4.0)),
        "late_joiners": _pick(rng, (0.0, 0.25, 0.5)),
        "leavers": _pick(rng, (0.0, 0.1, 0.25)),
    }
    if rng.random() < 0.1:  # now and then a run with no fault at all, as a baseline
        for name in FAULT_RATES:
            drawn[name] = 0.0
    # Drawn last, so every earlier draw of a seed is what it always was.
    drawn["gc_horizon"] = _pick(rng, (0.0, 0.0, lease_timeout))
    drawn.update(fixed)
    return SimConfig(seed=seed, nodes=nodes, rounds=rounds, **drawn)
