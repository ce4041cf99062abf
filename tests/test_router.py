"""The router's choices on its own: outcomes go in, picks come out (no RPC is ever sent; the
clients' channels are created lazily and closed unused)."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from distill.router import Router, RouterConfig
from distill.teacher_client import TeacherClient, TeacherMetadata
from distill.teacher_state import TeacherState

META = TeacherMetadata("affine", "1", 8, {}, {})
PICKS = 400


def _router(config: RouterConfig, n: int) -> tuple[Router, list[TeacherState]]:
    router = Router("svc", config)
    teachers = [router.add(f"k{i}", f"127.0.0.1:{i + 1}", TeacherClient(f"127.0.0.1:{i + 1}"), META)
                for i in range(n)]
    return router, teachers


def _serve(router: Router, t: TeacherState, latency_s: float) -> None:
    router.started(t)
    router.succeeded(t, latency_s, samples=8)


def _share(router: Router, picks: int = PICKS) -> collections.Counter[str]:
    """Which teacher each of `picks` idle picks would go to (nothing completes in between)."""
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(picks):
        t = router.pick()
        assert t is not None
        counts[t.key] += 1
    return counts


async def _close(teachers: list[TeacherState]) -> None:
    await asyncio.gather(*(t.client.close() for t in teachers))


def test_a_teacher_back_from_ejection_starts_with_a_fresh_estimate() -> None:
    """Its pre-failure latency says nothing about the process now on that port."""

    async def main() -> None:
        router, (a, b) = _router(RouterConfig(stale_after_s=3600.0), 2)
        _serve(router, a, 0.010)
        _serve(router, b, 0.500)  # b was slow (a cold start), then it failed
        router.started(b)
        router.failed(b, grpc.StatusCode.UNAVAILABLE, "connection reset")
        assert router.pick(exclude=frozenset({"k0"})) is None, "an ejected teacher got work before its probe"
        router.probed(b, ok=True)
        assert b.ewma_s == 0.0
        share = _share(router)
        assert share["k1"] > PICKS // 4, f"the readmitted teacher was starved: {dict(share)}"
        await _close([a, b])

    asyncio.run(main())


def test_an_idle_teachers_stale_estimate_stops_counting_against_it() -> None:
    """Two equal teachers under light load: one got a slow answer once; while it sits idle the
    other takes everything, but once its estimate is stale it is tried again."""

    async def main() -> None:
        router, (a, b) = _router(RouterConfig(stale_after_s=0.05), 2)
        _serve(router, a, 0.010)
        _serve(router, b, 0.080)
        fresh = _share(router)
        assert fresh["k1"] == 0, f"a fresh, slower estimate should lose every idle tie: {dict(fresh)}"
        await asyncio.sleep(0.1)
        a.last_result = b.last_result + 1e9  # a keeps answering; only b's estimate is stale
        stale = _share(router)
        assert stale["k1"] > PICKS // 4, f"the idle teacher was never tried again: {dict(stale)}"
        await _close([a, b])

    asyncio.run(main())


def test_a_busy_teacher_loses_to_an_idle_one_of_equal_speed() -> None:
    async def main() -> None:
        router, (a, b) = _router(RouterConfig(stale_after_s=3600.0), 2)
        _serve(router, a, 0.010)
        _serve(router, b, 0.010)
        router.started(a)
        share = _share(router)
        assert share["k1"] == PICKS, f"the busy teacher still got idle-time work: {dict(share)}"
        await _close([a, b])

    asyncio.run(main())


def test_overload_halves_the_limit_and_failures_eject_with_backoff() -> None:
    async def main() -> None:
        router, (a,) = _router(RouterConfig(initial_limit=8.0, backoff_base_s=10.0, overload_backoff_base_s=0.05), 1)
        for code, limit in ((grpc.StatusCode.RESOURCE_EXHAUSTED, 4.0), (grpc.StatusCode.CANCELLED, 2.0)):
            router.started(a)
            router.failed(a, code, "shed")
            # Overload is not a failure: never ejected, never a "no teacher" moment, only a short pause.
            assert a.limit == limit and not a.needs_probe and a.incompatible is None, code
            assert router.no_teacher_for() == 0.0 and router.pick() is None, "it takes nothing while it cools"
            for _ in range(50):  # bounded: the cool-down is 0.05 s, then 0.1 s (+-20 %)
                if router.pick() is a:
                    break
                await router.wait_change(1.0)
            assert router.pick() is a, "after its cool-down the overloaded teacher takes work again"
        assert a.overloads == 2 and a.errors == 0
        router.started(a)
        router.failed(a, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")
        assert a.limit == 1.0 and a.needs_probe and router.pick() is None
        router.probed(a, ok=False, detail="still down")
        assert a.streak == 2 and a.last_error == "still down" and router.pick() is None
        router.started(a)  # a request that was in flight before the ejection
        router.failed(a, grpc.StatusCode.INVALID_ARGUMENT, "wrong shape")
        assert a.incompatible is not None and "wrong shape" in a.incompatible
        await _close([a])

    asyncio.run(main())


def test_a_cancelled_wait_for_a_change_is_never_swallowed() -> None:
    """The engine's dispatch loop waits here; cancelled at close in the same loop turn as a change
    arrives, the wait must still end in CancelledError, or the dispatch loop waits forever."""

    async def once(turns: int) -> bool:
        router = Router("svc")
        task = asyncio.create_task(router.wait_change(30.0))
        await asyncio.sleep(0)
        router._changed.set()
        for _ in range(turns):
            await asyncio.sleep(0)
        if not task.cancel():  # already returned: nothing was cancelled
            return False
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.CancelledError:
            return True
        raise AssertionError(f"a wait cancelled {turns} loop turn(s) after the change returned normally")

    cancelled = [asyncio.run(once(turns)) for turns in range(4)]
    assert any(cancelled), "no case cancelled a pending wait: the test checks nothing"


def test_a_saturated_teacher_keeps_min_limit_requests_queued() -> None:
    """A teacher that answers later the more requests it holds (each waits for those before it):
    the gradient settles the default limit where latency is a few times the idle teacher's, and
    min_limit keeps the requests a length-bucketing teacher needs queued."""

    async def main() -> None:
        plain, (a,) = _router(RouterConfig(initial_limit=2.0, max_limit=16), 1)
        floored, (b,) = _router(RouterConfig(initial_limit=2.0, min_limit=12.0, max_limit=16), 1)
        for router, t in ((plain, a), (floored, b)):
            for _ in range(400):
                while t.in_flight < int(t.limit):
                    router.started(t)
                router.succeeded(t, 0.010 * t.in_flight, samples=8)
        assert 2.0 <= a.limit <= 8.0, a.limit
        assert b.limit >= 12.0, b.limit
        await _close([a, b])

    asyncio.run(main())


def test_a_slowdown_shrinks_the_limit_but_never_below_min_limit() -> None:
    """Answers far slower than the best seen shrink the default limit; with min_limit the limit
    stays at its floor, and an overload answer still halves it below."""

    async def main() -> None:
        plain, (a,) = _router(RouterConfig(initial_limit=8.0), 1)
        floored, (b,) = _router(RouterConfig(initial_limit=8.0, min_limit=8.0), 1)
        for router, t in ((plain, a), (floored, b)):
            for _ in range(20):
                _serve(router, t, 0.010)  # the idle teacher's latency
            for _ in range(20):
                _serve(router, t, 0.100)  # then ten times that: the requests queue
        assert a.limit == 1.0, a.limit
        assert b.limit == 8.0, b.limit
        floored.started(b)
        floored.overloaded(b, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        assert b.limit == 4.0, b.limit
        await _close([a, b])

    asyncio.run(main())


def _answer_full(router: Router, t: TeacherState, latency_s: float) -> None:
    """Fill `t` up to its limit, then account one answer of `latency_s` (the limit grows only when reached)."""
    while t.in_flight < int(t.limit):
        router.started(t)
    router.succeeded(t, latency_s, samples=8)


def test_the_students_own_delays_do_not_shrink_the_limit_but_a_slowdown_does() -> None:
    """A teacher whose batcher absorbs every call answers in about the same time however many it
    holds, but some answers reach the router late (the student's event loop busy with another
    service's answers): single answers 3-4x the best. The gradient reads the smoothed latency, so
    the limit grows past such noise; a teacher that really slows down still loses its calls."""
    jitter = (0.010, 0.030, 0.012, 0.035, 0.011, 0.040, 0.013, 0.010)

    async def main() -> None:
        router, (a,) = _router(RouterConfig(initial_limit=4.0), 1)
        for i in range(200):
            _answer_full(router, a, jitter[i % len(jitter)])
        assert a.limit >= 8.0, f"noise on single answers held the limit at {a.limit}"
        for _ in range(20):
            _answer_full(router, a, 0.100)  # ten times the usual latency, answer after answer: a queue
        assert a.limit <= 2.0, f"a teacher that slowed down tenfold kept a limit of {a.limit}"
        await _close([a])

    asyncio.run(main())


def test_a_teacher_starts_at_min_limit_when_it_is_above_the_initial_limit() -> None:
    async def main() -> None:
        _, (a,) = _router(RouterConfig(initial_limit=2.0, min_limit=6.0), 1)
        assert a.limit == 6.0
        await _close([a])

    asyncio.run(main())


def test_router_config_refuses_limits_out_of_order() -> None:
    for kwargs in ({"min_limit": 0.5}, {"min_limit": 20.0}, {"initial_limit": 0.0}, {"initial_limit": 17.0}):
        with pytest.raises(ValueError, match="max_limit"):
            RouterConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="by_length_rows"):
        RouterConfig(by_length_rows=0)


BY_LENGTH = TeacherMetadata("llm", "1", 8, {}, {}, batches_by_length=True)


def test_a_declaration_that_arrives_with_later_metadata_counts_the_limit_in_rows() -> None:
    """A static teacher's metadata comes after it joins (ModelConfig is asked then): from then its
    limit counts rows and grows by the rows answered; re-described as a plain teacher, it counts
    calls again, within max_limit."""

    async def main() -> None:
        router = Router("svc", RouterConfig(initial_limit=2.0, max_limit=6, by_length_rows=40))
        t = router.add("k", "127.0.0.1:1", TeacherClient("127.0.0.1:1"), None)
        assert t.limit == 2.0
        router.set_metadata(t, BY_LENGTH)
        assert t.limit == 10.0  # a quarter of its 40 rows
        router.started(t, rows=12)
        assert not t.has_slot()  # 12 rows against 10
        router.succeeded(t, 0.010, samples=12)
        router.ended(t, 12)
        assert t.limit == 22.0
        router.set_metadata(t, META)
        assert t.limit == 6.0
        await _close([t])

    asyncio.run(main())


def test_a_teacher_that_batches_by_length_holds_by_length_rows_in_flight() -> None:
    """Its limit counts rows, however they are cut into calls. From a quarter of `by_length_rows` (40)
    each answer in time adds its rows, up to all of them, whatever the latency within the deadline; then
    40 rows take two calls of 16 and a third that goes past them, and nothing until one ends. An
    overload answer halves it, and answers bring it back by their rows. A plain teacher beside it
    counts calls, whatever their rows, and follows the gradient down."""

    async def main() -> None:
        router = Router("svc", RouterConfig(initial_limit=2.0, max_limit=12, by_length_rows=40), deadline_s=10.0)
        plain = router.add("plain", "127.0.0.1:98", TeacherClient("127.0.0.1:98"), META)
        llm = router.add("llm", "127.0.0.1:99", TeacherClient("127.0.0.1:99"), BY_LENGTH)
        assert (llm.limit, plain.limit) == (10.0, 2.0)  # a quarter of its rows to start
        grown = []
        for _ in range(3):
            router.started(llm, rows=16)
            router.succeeded(llm, 4.0, samples=16)  # slow, but within half the deadline
            router.ended(llm, 16)
            grown.append(llm.limit)
        assert grown == [26.0, 40.0, 40.0]
        slots = []
        for _ in range(3):
            router.started(llm, rows=16)
            slots.append(llm.has_slot())
        assert slots == [True, True, False]  # 16, 32 (< 40), 48
        router.succeeded(llm, 0.010, samples=16)
        assert not llm.has_slot(), "the rows are its slots: they come back when the call ends"
        router.ended(llm, 16)
        assert llm.has_slot()
        router.overloaded(llm, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        router.ended(llm, 16)
        llm.cool_until = 0.0
        assert (llm.limit, llm.rows_in_flight, llm.has_slot()) == (20.0, 16, True)
        router.succeeded(llm, 0.010, samples=16)
        router.ended(llm, 16)
        assert llm.limit == 36.0
        router.started(plain, rows=100)
        assert plain.has_slot(), "a plain teacher counts calls: one of two"
        router.succeeded(plain, 0.010, samples=100)
        router.ended(plain, 100)
        for _ in range(4):  # the answers its latency gradient takes its baseline from
            _serve(router, plain, 0.010)
        for _ in range(20):
            _serve(router, plain, 0.100)
        assert plain.limit == 1.0
        await _close([plain, llm])

    asyncio.run(main())


def test_a_teacher_that_batches_by_length_holds_fewer_rows_when_answers_near_the_deadline() -> None:
    """A slow device (or several students) makes its queue deeper than the reader's deadline allows:
    each answer slower than half the deadline takes a tenth off its rows; answers within it bring
    the rows back by their own. Without a deadline (a router on its own) latency never moves it."""

    async def main() -> None:
        router = Router("svc", RouterConfig(initial_limit=16.0, max_limit=16, by_length_rows=40), deadline_s=1.0)
        llm = router.add("llm", "127.0.0.1:99", TeacherClient("127.0.0.1:99"), BY_LENGTH)
        limits = []
        for latency_s in (0.2, 0.2, 0.2, 0.6, 0.6, 0.6, 0.2, 0.2):
            router.started(llm, rows=8)
            router.succeeded(llm, latency_s, samples=8)
            router.ended(llm, 8)
            limits.append(round(llm.limit, 2))
        assert limits == [24.0, 32.0, 40.0, 36.0, 32.4, 29.16, 37.16, 40.0]
        free = Router("svc", RouterConfig(by_length_rows=40))
        other = free.add("llm", "127.0.0.1:98", TeacherClient("127.0.0.1:98"), BY_LENGTH)
        for _ in range(8):
            free.started(other, rows=8)
            free.succeeded(other, 5.0, samples=8)
            free.ended(other, 8)
        assert other.limit == 40.0
        await _close([llm, other])

    asyncio.run(main())


def test_the_engine_hears_when_teachers_that_batch_by_length_come_and_go() -> None:
    """Joining, leaving, turning incompatible and re-described: each change of the members that
    batch by length is told once (the reader's read-ahead follows it); other teachers never."""

    async def main() -> None:
        router, (plain,) = _router(RouterConfig(by_length_rows=1), 1)  # rows wanted = teachers counted
        told: list[int] = []
        router.on_by_length = lambda: told.append(router.by_length_rows())
        a = router.add("a", "127.0.0.1:98", TeacherClient("127.0.0.1:98"), BY_LENGTH)
        b = router.add("b", "127.0.0.1:99", TeacherClient("127.0.0.1:99"), None)
        router.set_metadata(b, BY_LENGTH)
        router.mark_incompatible(a, "wrong model")
        router.mark_incompatible(a, "still the wrong model")
        router.set_metadata(b, META)  # b no longer batches by length
        router.remove("b")
        router.remove(plain.key)
        router.set_metadata(a, TeacherMetadata("llm", "2", 8, {}, {}, batches_by_length=True))  # a is back
        router.remove("a")
        assert told == [1, 2, 1, 0, 1, 0]
        await _close([plain, a, b])

    asyncio.run(main())


def test_a_lucky_first_answer_or_noisy_answers_do_not_pin_the_limit() -> None:
    """A teacher with headroom answers in about the same time however many calls it holds, but the
    answers vary (the student's own delays, calls of several sizes) and the first one came alone:
    the gradient's baseline is not that first answer nor the lucky tail of the noise, so the limit
    grows; a teacher that then slows down tenfold still loses its calls."""
    noisy = (0.020, 0.060, 0.025, 0.080, 0.030, 0.015, 0.070, 0.040)

    async def main() -> None:
        router, (a,) = _router(RouterConfig(initial_limit=2.0), 1)
        _answer_full(router, a, 0.008)  # alone at an idle teacher
        low = 2.0
        for i in range(150):
            _answer_full(router, a, noisy[i % len(noisy)])
            low = min(low, a.limit)
        assert low >= 2.0, f"the first answer or the noise shrank the limit to {low}"
        assert a.limit >= 6.0, f"noise around a steady latency held the limit at {a.limit}"
        for _ in range(30):
            _answer_full(router, a, 0.400)
        assert a.limit <= 2.0, f"a teacher that slowed down tenfold kept a limit of {a.limit}"
        await _close([a])

    asyncio.run(main())
