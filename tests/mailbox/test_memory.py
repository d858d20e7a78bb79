"""MemoryMailbox: seeded fault injection that replays, and named stores shared in-process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import attrs
import pytest

from gradientmail.mailboxes._memory import Faults, MemoryMailbox
from gradientmail.mailboxes._protocol import MailboxError, TransientMailboxError
from gradientmail.mailboxes._urls import mailbox_from_url


class ManualClock:
    """Virtual time: sleeping advances it at once, and the sleeps are recorded."""

    def __init__(self) -> None:
        self.time = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.time += seconds


def _request(mailbox: MemoryMailbox, i: int) -> Awaitable[object]:
    """The i-th request of a fixed mixed sequence over seven keys."""
    key = f"k/{i % 7}"
    if i % 5 == 0:
        return mailbox.create(key, b"c%d" % i)
    if i % 5 == 1:
        return mailbox.put(key, b"p%d" % i)
    if i % 5 == 2:
        return mailbox.get(key)
    if i % 5 == 3:
        return mailbox.list("k/")
    return mailbox.delete(key)


async def _outcomes(mailbox: MemoryMailbox, requests: int = 60) -> list[str]:
    """What each request of the fixed sequence returned or raised."""
    outcomes = []
    for i in range(requests):
        try:
            result = await _request(mailbox, i)
        except TransientMailboxError as error:
            outcomes.append(f"{error.operation}: {error}")
        else:
            outcomes.append(repr(result))
    return outcomes


FLAKY = Faults(seed=11, fail_before=0.2, fail_after=0.2, conflict=0.3, stale_list=0.5)


def test_same_seed_replays_the_same_faults() -> None:
    first = asyncio.run(
        _outcomes(MemoryMailbox("memory://replay", faults=FLAKY, clock=ManualClock()))
    )
    second = asyncio.run(
        _outcomes(MemoryMailbox("memory://replay", faults=FLAKY, clock=ManualClock()))
    )
    assert first == second
    assert sum("(injected)" in outcome for outcome in first) >= 10, first


def test_another_seed_gives_other_faults() -> None:
    reseeded = Faults(seed=12, fail_before=0.2, fail_after=0.2, conflict=0.3, stale_list=0.5)
    first = asyncio.run(
        _outcomes(MemoryMailbox("memory://replay", faults=FLAKY, clock=ManualClock()))
    )
    other = asyncio.run(
        _outcomes(MemoryMailbox("memory://replay", faults=reseeded, clock=ManualClock()))
    )
    assert first != other


def _decided(decide: Callable[[str, str, str, bool], bool]) -> list[str]:
    faults = attrs.evolve(FLAKY, decide=decide)
    mailbox = MemoryMailbox("memory://decide", faults=faults, clock=ManualClock())
    return asyncio.run(_outcomes(mailbox))


def test_decide_sees_every_possible_fault_and_can_keep_drop_or_force_each() -> None:
    drawn_run = asyncio.run(
        _outcomes(MemoryMailbox("memory://decide", faults=FLAKY, clock=ManualClock()))
    )
    calls: list[tuple[str, str, str, bool]] = []

    def as_drawn(fault: str, operation: str, key: str, drawn: bool) -> bool:
        calls.append((fault, operation, key, drawn))
        return drawn

    # Deciding as drawn is the run without a hook, and the hook was offered every fault kind.
    assert _decided(as_drawn) == drawn_run
    assert {c[0] for c in calls} == {"fail_before", "conflict", "fail_after", "stale_list"}
    assert any(c[3] for c in calls) and not all(c[3] for c in calls)
    # Dropping every fault: the same requests, none injected, every list complete.
    quiet = _decided(lambda fault, operation, key, drawn: False)
    assert not any("(injected)" in outcome for outcome in quiet)
    # Forcing one fault that was not drawn (the first create of k/0 fails before it lands),
    # none other: exactly that request fails.
    first_create = next(
        i for i, c in enumerate(calls) if c[:3] == ("fail_before", "create", "k/0") and not c[3]
    )
    seen = 0

    def only_one(fault: str, operation: str, key: str, drawn: bool) -> bool:
        nonlocal seen
        seen += 1
        return seen - 1 == first_create

    forced = _decided(only_one)
    failed = [i for i, outcome in enumerate(forced) if "(injected)" in outcome]
    assert failed == [0] and "failed before taking effect" in forced[0], forced


def test_fail_after_lands_the_write_and_still_raises() -> None:
    async def main() -> None:
        store = MemoryMailbox()
        flaky = store.handle(faults=Faults(fail_after=1.0))
        with pytest.raises(TransientMailboxError, match="landed"):
            await flaky.put("lease", b"1")
        with pytest.raises(TransientMailboxError, match="landed"):
            await flaky.create("claim", b"mine")
        assert await store.get("lease") == b"1"
        assert await store.get("claim") == b"mine"
        assert await flaky.get("claim") == b"mine", "reads are not writes: they succeed"
        with pytest.raises(TransientMailboxError):
            await flaky.delete("lease")
        assert await store.get("lease") is None

    asyncio.run(main())


def test_fail_before_and_conflict_have_no_effect() -> None:
    async def main() -> None:
        store = MemoryMailbox()
        failing = store.handle(faults=Faults(fail_before=1.0))
        conflicted = store.handle(faults=Faults(conflict=1.0))
        for request in (failing.put("a", b"x"), failing.create("b", b"x"), failing.get("a")):
            with pytest.raises(TransientMailboxError, match="before"):
                await request
        with pytest.raises(TransientMailboxError, match="409"):
            await conflicted.create("c", b"x")
        await conflicted.put("d", b"puts do not conflict")
        assert [info.key for info in await store.list("")] == ["d"]
        assert conflicted.stats.snapshot()["create"] == 1, "a failed request still counts"

    asyncio.run(main())


def test_stale_list_hides_recent_keys_until_the_window_passes() -> None:
    async def main() -> None:
        clock = ManualClock()
        store = MemoryMailbox(clock=clock)
        stale = store.handle(faults=Faults(stale_list=1.0, stale_window=5.0), clock=clock)
        await store.put("old", b"1")
        clock.time = 10.0
        await store.put("new", b"2")
        clock.time = 12.0
        assert [info.key for info in await stale.list("")] == ["old"]
        assert await stale.get("new") == b"2", "a get sees the new key at once"
        clock.time = 15.5
        assert [info.key for info in await stale.list("")] == ["new", "old"]

    asyncio.run(main())


def test_stale_list_can_show_a_newer_key_before_an_older_one() -> None:
    async def main() -> None:
        clock = ManualClock()
        store = MemoryMailbox(clock=clock)
        stale = store.handle(faults=Faults(seed=3, stale_list=0.5, stale_window=60.0), clock=clock)
        for i in range(40):
            await store.put(f"k/{i:02d}", b"x")
            clock.time += 1.0
        listed = [int(info.key[2:]) for info in await stale.list("k/")]
        missing = sorted(set(range(40)) - set(listed))
        assert missing and any(later in listed for later in range(missing[0] + 1, 40))

    asyncio.run(main())


def test_delays_are_drawn_in_range_and_slept_on_the_clock() -> None:
    async def main() -> None:
        clock = ManualClock()
        mailbox = MemoryMailbox(faults=Faults(seed=5, delay=(0.5, 2.0)), clock=clock)
        await mailbox.put("a", b"1")
        await mailbox.get("a")
        await mailbox.list("")
        assert len(clock.slept) == 3 and all(0.5 <= s <= 2.0 for s in clock.slept), clock.slept
        assert clock.time == pytest.approx(sum(clock.slept))

    asyncio.run(main())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fail_before": 1.5}, "fail_before"),
        ({"conflict": -0.1}, "conflict"),
        ({"delay": (2.0, 1.0)}, "delay"),
        ({"delay": (-1.0, 1.0)}, "delay"),
        ({"stale_window": -1.0}, "stale_window"),
    ],
)
def test_bad_fault_settings_are_rejected(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Faults(**settings)  # type: ignore[arg-type]


def test_named_stores_are_shared_by_name_only() -> None:
    async def main() -> None:
        first = MemoryMailbox.named("test-memory-shared")
        second = mailbox_from_url("memory://test-memory-shared")
        other = MemoryMailbox.named("test-memory-other")
        assert await first.create("manifest", b"run") is True
        assert await second.get("manifest") == b"run"
        assert await other.get("manifest") is None
        assert await MemoryMailbox().get("manifest") is None, "a new instance is private"
        assert first.stats.snapshot()["create"] == 1 and second.stats.snapshot()["create"] == 0

    asyncio.run(main())


def test_errors_name_store_key_and_operation() -> None:
    mailbox = MemoryMailbox("memory://errors", faults=Faults(fail_before=1.0))
    with pytest.raises(MailboxError) as caught:
        asyncio.run(mailbox.get("rounds/00000000000000000003/commit"))
    error = caught.value
    assert (error.store, error.key, error.operation) == (
        "memory://errors",
        "rounds/00000000000000000003/commit",
        "get",
    )
    assert all(part in str(error) for part in (error.store, error.key, "get"))


def test_a_memory_url_must_say_memory() -> None:
    with pytest.raises(ValueError, match="memory://"):
        MemoryMailbox("s3://bucket")
