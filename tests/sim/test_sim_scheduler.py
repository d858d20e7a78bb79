"""The simulator's scheduler: virtual time, seeded ties, processes that pause and crash."""

from __future__ import annotations

import pytest

from gradientmail.testing import NodeClock, Scheduler
from gradientmail.testing import VirtualClock as SimClock


def make(seed: int = 0) -> tuple[SimClock, Scheduler, list[tuple[float, str]]]:
    clock = SimClock()
    return clock, Scheduler(clock, seed=seed), []


async def ticker(
    clock: SimClock | NodeClock, log: list[tuple[float, str]], name: str, every: float, times: int
) -> None:
    for _ in range(times):
        await clock.sleep(every)
        log.append((round(clock.now(), 9), name))


def test_time_jumps_to_the_next_wake_up_and_ties_follow_the_seed() -> None:
    orders = set()
    for seed in range(8):
        clock, scheduler, log = make(seed)
        for name in "abc":
            scheduler.spawn(
                name, process=scheduler.process(name), coroutine=ticker(clock, log, name, 1.0, 2)
            )
        scheduler.run(until=100)
        assert [t for t, _ in log] == [1.0] * 3 + [2.0] * 3
        assert clock.time == 2.0  # no idle time advanced past the last task
        orders.add(tuple(n for _, n in log))
    assert len(orders) > 1, "the seed decides the order of tasks that wake together"


def test_the_same_seed_replays_the_same_digest() -> None:
    digests = []
    for seed in (3, 3, 4):
        clock, scheduler, log = make(seed)
        for name in "abcd":
            scheduler.spawn(
                name, process=scheduler.process(name), coroutine=ticker(clock, log, name, 0.5, 3)
            )
        scheduler.run(until=100)
        digests.append(scheduler.digest)
    assert digests[0] == digests[1] != digests[2]


def test_a_pause_holds_every_task_of_the_process_and_only_those() -> None:
    clock, scheduler, log = make()
    paused, other = scheduler.process("p"), scheduler.process("q")
    scheduler.spawn("p1", process=paused, coroutine=ticker(clock, log, "p1", 1.0, 3))
    scheduler.spawn("p2", process=paused, coroutine=ticker(clock, log, "p2", 1.5, 2))
    scheduler.spawn("q", process=other, coroutine=ticker(clock, log, "q", 1.0, 3))
    scheduler.run(until=1.2)
    scheduler.pause(paused, 10.0)
    scheduler.run(until=100)
    assert [t for t, n in log if n == "q"] == [1.0, 2.0, 3.0]
    assert [t for t, n in log if n.startswith("p")] == [1.0, 10.0, 10.0, 11.0, 11.5]


def test_a_crash_drops_every_task_where_it_stands() -> None:
    clock, scheduler, log = make()
    victim = scheduler.process("v")
    task = scheduler.spawn("v", process=victim, coroutine=ticker(clock, log, "v", 1.0, 5))
    scheduler.spawn("w", process=scheduler.process("w"), coroutine=ticker(clock, log, "w", 1.0, 5))
    scheduler.run(until=2.5)
    scheduler.crash(victim)
    scheduler.run(until=100)
    assert [t for t, n in log if n == "v"] == [1.0, 2.0]
    assert len([n for _, n in log if n == "w"]) == 5
    assert task.done and task.error is None and scheduler.errors == []
    late = scheduler.spawn("late", process=victim, coroutine=ticker(clock, log, "late", 1.0, 1))
    assert late.done, "a crashed process starts nothing new"


def test_after_wakes_a_task_right_after_another_runs() -> None:
    clock, scheduler, log = make()
    process = scheduler.process("p")
    loop = scheduler.spawn("loop", process=process, coroutine=ticker(clock, log, "loop", 2.0, 3))

    async def waiter() -> None:
        for _ in range(3):
            await scheduler.after(loop)
            log.append((clock.now(), "waiter"))
        await scheduler.after(loop)  # the loop is done by then: returns at once
        log.append((clock.now(), "end"))

    scheduler.spawn("waiter", process=process, coroutine=waiter())
    scheduler.run(until=100)
    woken = [t for t, n in log if n == "waiter"]
    # Each wake-up is at one of the loop's steps (0: its start, which ties with the waiter's
    # own start), one per step, never in between.
    assert woken in ([0.0, 2.0, 4.0], [2.0, 4.0, 6.0])
    assert log[-1] == (6.0, "end")


def test_node_clocks_drift_and_only_sleeps_may_be_awaited() -> None:
    clock, scheduler, log = make()
    fast = NodeClock(clock, offset=100.0, rate=1.01)
    scheduler.spawn("n", process=scheduler.process("n"), coroutine=ticker(fast, log, "n", 1.01, 1))
    scheduler.run(until=100)
    assert log == [(101.01, "n")] and clock.time == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rate"):
        NodeClock(clock, rate=0.0)

    class Foreign:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield "not a sleep"

    async def bad() -> None:
        await Foreign()

    scheduler.spawn("b", process=scheduler.process("b"), coroutine=bad())
    with pytest.raises(TypeError, match="only clock sleeps"):
        scheduler.run(until=200)


def test_a_gather_runs_its_coroutines_at_once_and_returns_their_results_in_order() -> None:
    clock, scheduler, log = make()
    node = NodeClock(clock, rate=1.0)
    got: list[object] = []

    async def after(seconds: float, value: str) -> str:
        await node.sleep(seconds)
        log.append((clock.now(), value))
        return value

    async def parent() -> None:
        got.append(await node.gather(after(3.0, "slow"), after(1.0, "fast"), after(2.0, "mid")))
        got.append(clock.now())
        got.append(await node.gather())

    task = scheduler.spawn("p", process=scheduler.process("p"), coroutine=parent())
    scheduler.run(until=100)
    assert got == [["slow", "fast", "mid"], 3.0, []], "in order, together: 3 s, not 6"
    assert [v for _, v in log] == ["fast", "mid", "slow"]
    assert task.done and task.error is None


def test_a_gather_waits_for_all_then_raises_the_first_error_and_a_crash_drops_it_all() -> None:
    clock, scheduler, log = make()

    async def fail(seconds: float, message: str) -> None:
        await clock.sleep(seconds)
        raise ValueError(message)

    async def parent() -> None:
        try:
            await clock.gather(
                fail(2.0, "second"), fail(1.0, "first"), ticker(clock, log, "t", 1, 3)
            )
        except ValueError as exc:
            log.append((clock.now(), str(exc)))

    scheduler.spawn("p", process=scheduler.process("p"), coroutine=parent())
    scheduler.run(until=100)
    # Every coroutine ran to its end (the ticker's three ticks) before the error was raised:
    # the first in order, not the first in time.
    assert log == [(1.0, "t"), (2.0, "t"), (3.0, "t"), (3.0, "second")]

    victim = scheduler.process("v")
    log.clear()

    async def doomed() -> None:
        await clock.gather(ticker(clock, log, "a", 1.0, 5), ticker(clock, log, "b", 1.0, 5))
        log.append((clock.now(), "after"))

    scheduler.spawn("v", process=victim, coroutine=doomed())
    scheduler.run(until=clock.time + 2.5)
    scheduler.crash(victim)
    scheduler.run(until=200)
    assert sorted(n for _, n in log) == ["a", "a", "b", "b"], "no child and no parent ran on"
    assert scheduler.errors == []
