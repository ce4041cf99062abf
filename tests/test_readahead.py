"""The reader's hand-overs between threads, on their own: the loader thread reading ahead by
read-ahead slots (`distill.readahead`), the one-timer timeline of late and hedge checks
(`distill.timeline`), and the outbox that hands a turn's finished batches to the training loop
as one item (`distill.reader.Outbox`). Real threads and a real event loop; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from distill.readahead import END_OF_LOADER, SLOW_TAKE_S, Failed, Feed, LoaderThread, ReadAhead, pump
from distill.reader import BATCH, END, Outbox
from distill.timeline import Timeline

LIMIT_S = 10.0


def _wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def test_loader_reads_ahead_by_slots_and_wakes_once_a_quarter_is_free() -> None:
    slots = ReadAhead(1, 8, gap=0.0)  # an earlier pass found the training loop fast
    taken: list[int] = []
    done = threading.Event()

    def loader() -> None:
        while (n := slots.take()) > 0:
            taken.append(n)
        done.set()

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    _wait_until(lambda: taken == [8], "the first take of every slot")
    slots.give_back()  # 1 free: below a quarter of 8, the loader sleeps on
    time.sleep(0.05)
    assert taken == [8]
    slots.give_back()  # 2 free: a quarter, the loader takes both
    _wait_until(lambda: taken == [8, 2], "the loader to take the two free slots")
    slots.close()
    assert done.wait(LIMIT_S), "close() must wake a loader waiting for a slot"
    thread.join(LIMIT_S)
    assert slots.take() == 0


def test_a_training_loop_slower_than_slow_take_s_or_not_yet_timed_wakes_the_loader_for_every_slot() -> None:
    """A slot left free waits for the next batch taken; when batches are taken far apart (an LLM
    teacher's, tens of milliseconds each), or before two takes have timed the loop, the loader is
    woken for each one, not once a quarter is free."""
    slots = ReadAhead(1, 16)  # a quarter: 4; no earlier pass timed the loop
    taken, thread = _loader(slots)
    _wait_until(lambda: taken == [16], "the first take of every slot")
    slots.give_back()  # the first take: not yet timed, so slow: the loader takes the one free slot
    _wait_until(lambda: taken == [16, 1], "the loader to take the slot given back first")
    time.sleep(SLOW_TAKE_S)
    slots.give_back()  # the first gap, at least SLOW_TAKE_S: slow
    _wait_until(lambda: taken == [16, 1, 1], "the loader to take the one slot given back")
    time.sleep(2 * SLOW_TAKE_S)
    slots.give_back()
    _wait_until(lambda: taken == [16, 1, 1, 1], "the loader to take the one slot given back")
    assert slots.gap is not None and slots.gap >= SLOW_TAKE_S
    slots.close()
    thread.join(LIMIT_S)
    assert not thread.is_alive()


def _loader(slots: ReadAhead) -> tuple[list[int], threading.Thread]:
    """A loader thread that takes slots until closed; the list of what each take returned."""
    taken: list[int] = []

    def loader() -> None:
        while (n := slots.take()) > 0:
            taken.append(n)

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    return taken, thread


def test_resizing_frees_new_slots_at_once_and_takes_slots_back_as_batches_return() -> None:
    """Grown, a waiting loader takes the new slots at once; shrunk, it reads again only once fewer
    than the new size are out (the batches already read stay)."""
    slots = ReadAhead(1, 4)
    taken, thread = _loader(slots)
    _wait_until(lambda: taken == [4], "the first take of every slot")
    slots.resize(8)
    _wait_until(lambda: taken == [4, 4], "the loader to take the four new slots")
    slots.resize(2)  # 8 out, 2 wanted: six must come back before one more is read
    for _ in range(6):
        slots.give_back()
    time.sleep(0.05)
    assert taken == [4, 4]
    slots.give_back()
    _wait_until(lambda: taken == [4, 4, 1], "the loader to read one batch: 1 free of 2")
    slots.close()
    thread.join(LIMIT_S)
    assert not thread.is_alive()


def test_answered_batches_waiting_for_an_earlier_one_lend_their_slots_up_to_the_size() -> None:
    """Ordered delivery: each answered batch that waits for an earlier one lends its slot to the
    loader at once, at most `size` of them; once delivered, the lent slots are owed again and the
    loader reads on only as the training loop returns batches."""
    slots = ReadAhead(1, 4)
    taken, thread = _loader(slots)
    _wait_until(lambda: taken == [4], "the first take of every slot")
    slots.waiting(3)  # batches 1..3 answered, batch 0 not: their three slots are lent
    _wait_until(lambda: taken == [4, 3], "the loader to take the three lent slots")
    slots.waiting(9)  # more wait than the size: only one more slot (four lent in all)
    _wait_until(lambda: taken == [4, 3, 1], "the loader to take the fourth lent slot")
    time.sleep(0.05)
    assert taken == [4, 3, 1], "at most `size` slots are lent"
    slots.waiting(0)  # batch 0 answered: all delivered; the four lent slots are owed again
    for _ in range(4):
        slots.give_back()  # the training loop takes four batches: still none free
    time.sleep(0.05)
    assert taken == [4, 3, 1]
    slots.give_back()
    _wait_until(lambda: taken == [4, 3, 1, 1], "the loader to read one batch per slot returned")
    slots.close()
    thread.join(LIMIT_S)
    assert not thread.is_alive()


def test_delivered_batches_lend_their_slots_until_taken_up_to_a_quarter_while_the_loop_is_slow() -> None:
    """A batch handed to a slow training loop lends its slot until the loop takes it, for up to a
    quarter of the slots: the next batch is read when an answer is delivered, not when the loop
    gets round to taking it. Taken, the slot is owed again: the loader reads no more for it."""
    slots = ReadAhead(1, 8, gap=1.0)  # a quarter: 2; an earlier pass found the loop slow
    taken, thread = _loader(slots)
    _wait_until(lambda: taken == [8], "the first take of every slot")
    slots.waiting(0, delivered=1)  # one lent, and the loop is slow: the loader reads one more
    _wait_until(lambda: taken == [8, 1], "the loader to take the lent slot")
    slots.waiting(0, delivered=2)  # three delivered, but at most two lent: one more
    _wait_until(lambda: taken == [8, 1, 1], "the loader to take the second lent slot")
    time.sleep(0.05)
    assert taken == [8, 1, 1], "at most a quarter of the slots are lent"
    slots.give_back()  # one taken: two still delivered and lent, one slot back: one more read
    _wait_until(lambda: taken == [8, 1, 1, 1], "the loader to take the slot given back")
    slots.give_back()
    slots.give_back()  # the other two taken: their lent slots are owed again, none free
    time.sleep(0.05)
    assert taken == [8, 1, 1, 1], "a taken batch's lent slot is owed again"
    slots.give_back()
    _wait_until(lambda: taken == [8, 1, 1, 1, 1], "the loader to take the free slot")
    slots.close()
    thread.join(LIMIT_S)
    assert not thread.is_alive()


def test_a_fast_loops_delivered_batches_lend_nothing() -> None:
    """A fast training loop takes its batches before a lent slot would matter; lending there would
    only break up the bunches the loader reads together (they share calls)."""
    slots = ReadAhead(1, 8, gap=0.0)
    taken, thread = _loader(slots)
    _wait_until(lambda: taken == [8], "the first take of every slot")
    slots.waiting(0, delivered=4)
    time.sleep(0.05)
    assert taken == [8]
    slots.give_back()
    slots.give_back()  # a quarter free: the loader takes both
    _wait_until(lambda: taken == [8, 2], "the loader to take the two free slots")
    slots.close()
    thread.join(LIMIT_S)
    assert not thread.is_alive()


def test_pump_pushes_each_batch_then_the_end_and_stops() -> None:
    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        slots, feed, loader = ReadAhead(1, 4), Feed(loop), LoaderThread()
        source = iter(range(6))

        def next_batch() -> object:
            return next(source, END_OF_LOADER)

        loader.run(lambda: pump(slots, next_batch, feed))
        got: list[Any] = []
        try:
            while END_OF_LOADER not in got:
                items = await asyncio.wait_for(feed.get(), LIMIT_S)
                assert items, "get() returns at least one item"
                got += items
                for item in items:
                    if item is not END_OF_LOADER:
                        slots.give_back()  # the training loop took it
        finally:
            slots.close()
            loader.close()
        return got

    got = asyncio.run(scenario())
    assert got == [0, 1, 2, 3, 4, 5, END_OF_LOADER]


def test_pump_hands_over_the_loaders_error_in_its_place_and_stops() -> None:
    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        slots, feed, loader = ReadAhead(1, 8), Feed(loop), LoaderThread()
        calls = 0

        def next_batch() -> object:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise ValueError("the loader broke")
            return calls

        loader.run(lambda: pump(slots, next_batch, feed))
        got: list[Any] = []
        try:
            while not any(isinstance(i, Failed) for i in got):
                got += await asyncio.wait_for(feed.get(), LIMIT_S)
            await asyncio.sleep(0.05)  # nothing more comes after the error
            assert calls == 3
        finally:
            slots.close()
            loader.close()
        return got

    got = asyncio.run(scenario())
    assert got[:2] == [1, 2] and len(got) == 3
    assert isinstance(got[2], Failed) and str(got[2].error) == "the loader broke"


def test_closed_pass_stops_the_pump_without_another_batch() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        slots, feed, loader = ReadAhead(1, 2), Feed(loop), LoaderThread()
        reads = 0

        def next_batch() -> object:
            nonlocal reads
            reads += 1
            return reads

        finished = threading.Event()

        def job() -> None:
            pump(slots, next_batch, feed)
            finished.set()

        loader.run(job)
        assert await asyncio.wait_for(feed.get(), LIMIT_S)
        await asyncio.sleep(0.05)
        slots.close()  # the pump waits for a slot (both taken): it returns at once
        assert await asyncio.to_thread(finished.wait, LIMIT_S)
        loader.close()
        return reads

    assert asyncio.run(scenario()) == 2


class Fired:
    """What a timeline's callbacks recorded; `all_in` is set once `expected` of them ran."""

    def __init__(self, expected: int) -> None:
        self.names: list[str] = []
        self.expected = expected
        self.all_in = asyncio.Event()

    def __call__(self, name: str) -> None:
        self.names.append(name)
        if len(self.names) >= self.expected:
            self.all_in.set()


def test_timeline_runs_callbacks_in_time_order_on_one_timer() -> None:
    async def scenario() -> list[str]:
        timeline = Timeline()
        fired = Fired(4)
        timeline.call_later(0.06, fired, "late")
        timeline.call_later(0.02, fired, "early")
        timeline.call_later(0.02, fired, "early, scheduled second")
        timeline.call_later(0.0, fired, "now")
        assert len(timeline) == 4
        await asyncio.wait_for(fired.all_in.wait(), LIMIT_S)
        assert len(timeline) == 0
        timeline.call_later(0.01, fired, "dropped")
        timeline.close()
        await asyncio.sleep(0.05)
        return fired.names

    assert asyncio.run(scenario()) == ["now", "early", "early, scheduled second", "late"]


def test_timeline_goes_on_after_a_callback_raises(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> list[str]:
        timeline = Timeline()
        fired = Fired(2)

        def broken() -> None:
            raise RuntimeError("a broken check")

        timeline.call_later(0.01, broken)
        timeline.call_later(0.01, fired, "after")
        timeline.call_later(0.03, fired, "later")
        await asyncio.wait_for(fired.all_in.wait(), LIMIT_S)
        return fired.names

    assert asyncio.run(scenario()) == ["after", "later"]
    assert "a scheduled reader check failed" in caplog.text


def test_outbox_hands_over_one_turns_batches_as_one_item_in_order() -> None:
    out = Outbox()

    async def engine() -> None:
        out.batch(1, "a", {"Y": 1}, 8)
        out.batch(1, "b", {"Y": 2}, 8)  # same turn: one item with "a"
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        out.batch(1, "c", {"Y": 3}, 8)
        out.end(1)  # goes after "c", which it flushes first

    asyncio.run(engine())
    raw = [out._queue.get_nowait() for _ in range(3)]
    assert [(epoch, kind, len(payload) if isinstance(payload, list) else payload) for epoch, kind, payload in raw] == [
        (1, "batches", 2), (1, "batches", 1), (1, END, None)]
    for item in raw:
        out._queue.put(item)
    items = out.items(1, alive=lambda: True, poll_s=LIMIT_S)
    got = [next(items) for _ in range(4)]
    assert got == [(BATCH, ("a", {"Y": 1}, 8)), (BATCH, ("b", {"Y": 2}, 8)), (BATCH, ("c", {"Y": 3}, 8)),
                   (END, None)]
