"""The end of a simulated run: liveness, what closed nodes hold, and the audit.

- Liveness (the second phase): every incarnation still alive has finished its close before
  the time limit, and every round a surviving incarnation published to committed within
  ``World.bound`` seconds of ``max(its publish, the heal)``.
- A node that closed cleanly had every sample it trained counted exactly once in each
  fragment, and (without alpha mixing) holds exactly the params of the last commit it merged
  of each fragment (Decision 11).
- ``audit`` of the whole mailbox, recomputing every commit whose inputs are still there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradientmail._node.payloads import read_fragment
from gradientmail.core.errors import FormatError
from gradientmail.testing._audit import AuditError, audit
from sim.sim_checks import Incarnation
from sim.sim_mailbox import run_now

if TYPE_CHECKING:
    from sim.sim_world import World

__all__ = ["finish"]


def finish(world: World, limit: float) -> None:
    """Liveness and end-of-run checks; the audit of the whole mailbox."""
    end = world.clock.time
    for task, error in world.scheduler.errors:
        world.checker.fail("node-failed", f"{task.process.name} {task.name} died: {error!r}")
    for slot in world.slots:
        for inc in slot.incarnations:
            _check_finished(world, inc, limit)
    _check_rounds(world, end)
    try:
        audit(world.oracle, backend=world.backend, keep=world.config.keep_rounds)
    except AuditError as exc:
        for problem in exc.violations:
            world.checker.fail("audit", problem)


def _check_finished(world: World, inc: Incarnation, limit: float) -> None:
    if inc.alive and inc.status != "closed":
        world.checker.fail(
            "liveness",
            f"{inc.label} still {inc.status} at the time limit ({limit:.0f}s)",
            nodes=(inc.node,),
        )
        return
    if inc.status != "closed":
        return
    for k in range(world.algorithm.fragments):
        counted = inc.included.get(k, 0)
        if counted != inc.trained:
            world.checker.fail(
                "samples",
                f"{inc.label} closed with {counted} of its {inc.trained} samples counted in "
                f"fragment {k}",
                nodes=(inc.node,),
            )
    if world.config.alpha is None:
        _check_final_model(world, inc)


def _check_final_model(world: World, inc: Incarnation) -> None:
    """Decision 11: after close the model holds the final commits it merged."""
    manifest = world.checker.manifest_record()
    for k, r in inc.merged.items():
        schema = manifest.fragment_schema(k)
        ref = world.checker.commits[r].params if r >= 0 else manifest.init[k]
        try:
            params = run_now(read_fragment(world.checker.exchange, ref, schema))
        except FormatError:
            params = None
        if params is None:
            continue  # collected since
        model = inc.session.adapter.read(list(schema.names))
        if any(model[n].data != params[n].data for n in schema.names):
            world.checker.fail(
                "final-model",
                f"{inc.label} closed holding fragment {k} unlike round {r}'s commit, the "
                "last it merged",
                round=r,
                nodes=(inc.node,),
            )


def _check_rounds(world: World, end: float) -> None:
    """Every round a surviving incarnation published to commits within ``bound``."""
    for slot in world.slots:
        for inc in slot.incarnations:
            if inc.status not in ("closed", "training", "closing"):
                continue
            for r, at in sorted(inc.publishing.items()):
                due = max(at, world.heal_at) + world.bound
                done = world.checker.commit_times.get(r)
                late = (done is None and end > due) or (done is not None and done > due)
                if late:
                    when = "never" if done is None else f"at {done:.2f}s"
                    world.checker.fail(
                        "liveness",
                        f"round {r} ({inc.label} published at {at:.2f}s) committed {when}, "
                        f"bound {world.bound:.1f}s after max(publish, heal {world.heal_at:.1f}s)",
                        round=r,
                        nodes=(inc.node,),
                    )
