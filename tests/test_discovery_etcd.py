"""EtcdRegistry against a real etcd process: registration, leases, watches, demand, failures.

Timings are asserted only as generous bounds (a loaded 2-core CI machine must pass too)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from discovery import EtcdRegistry, RegistryUnavailableError, TeacherSet, keys, open_registry
from discovery.local_etcd import LocalEtcd, free_port
from protos import registry_pb2
from tests.etcd_fixtures import (
    REPO,
    TcpProxy,
    arun,
    eventually,
    ids,
    next_matching,
    raw_client,
    reap,
    record,
    spawn_teacher,
    unique_service,
)

pytestmark = pytest.mark.timeout(90)


async def _true(value: bool) -> bool:
    """``value`` as an awaitable check for :func:`eventually`."""
    return value


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def test_register_is_seen_and_exit_removes_at_once(etcd: LocalEtcd) -> None:
    svc = unique_service()

    async def main() -> None:
        async with open_registry(etcd.address) as teacher_side, open_registry(etcd.address) as student_side:
            watch = student_side.watch(svc)
            assert len(await watch.__anext__()) == 0
            rec = record("t1", 9001, max_batch_size=256, device="cpu")
            async with teacher_side.register(svc, rec, ttl=5) as reg:
                assert reg.registered and reg.lease_id
                assert reg.key == keys.teacher_key(svc, "t1")
                async with raw_client(etcd) as raw:
                    got = await raw.get(reg.key.encode())
                    assert got is not None and got.lease == reg.lease_id
                    assert registry_pb2.TeacherRecord.FromString(got.value) == rec
                snap = await next_matching(watch, ids("t1"))
                assert snap["t1"].record == rec
                assert snap.revision > 0
            # Leaving the context revokes the lease: gone without waiting for the TTL.
            start = time.monotonic()
            await next_matching(watch, ids(), timeout=3.0)
            assert time.monotonic() - start < 3.0
            async with raw_client(etcd) as raw:
                assert await raw.get(keys.teacher_key(svc, "t1").encode()) is None
                assert await raw.get(keys.load_key(svc, "t1").encode()) is None

    arun(main())


def test_load_is_published_and_reaches_the_snapshot(etcd: LocalEtcd) -> None:
    svc = unique_service()
    depth = [0]

    def load() -> registry_pb2.TeacherLoad:
        depth[0] += 1
        return registry_pb2.TeacherLoad(queue_depth=depth[0], capacity_samples_per_s=1000.0)

    async def main() -> None:
        async with open_registry(etcd.address) as reg:
            watch = reg.watch(svc)
            async with reg.register(svc, record("t1"), ttl=5, load=load, load_interval=0.2):
                snap = await next_matching(
                    watch, lambda s: "t1" in s and s["t1"].load is not None and s["t1"].load.queue_depth >= 3
                )
                load_msg = snap["t1"].load
                assert load_msg is not None
                assert load_msg.instance_id == "t1" and load_msg.updated_at > 0
                loads = await reg.loads(svc)
                assert set(loads) == {"t1"} and loads["t1"].queue_depth >= 3
                one_shot = await reg.teachers(svc)
                assert set(one_shot) == {"t1"} and one_shot["t1"].load is not None

    arun(main())


def test_membership_only_watch_sees_joins_and_leaves_but_no_loads(etcd: LocalEtcd) -> None:
    svc = unique_service()
    samples = [0]

    def load() -> registry_pb2.TeacherLoad:
        samples[0] += 1  # a queue that forms and clears: every sample is news and is written
        return registry_pb2.TeacherLoad(queue_depth=10 * (samples[0] % 2))

    def newer_than(updated_at: float) -> Callable[[TeacherSet], bool]:
        def check(snap: TeacherSet) -> bool:
            entry = snap.get("t1")
            return entry is not None and entry.load is not None and entry.load.updated_at > updated_at

        return check

    async def main() -> None:
        async with open_registry(etcd.address) as reg:
            watch = reg.watch(svc, loads=False)
            full = reg.watch(svc)
            seen: list[TeacherSet] = []  # every snapshot the membership-only watch publishes

            async def record_all() -> None:
                async for snap in watch:
                    seen.append(snap)

            async def membership_becomes(*names: str) -> None:
                await eventually(
                    lambda: _true(bool(seen) and set(seen[-1]) == set(names)), 10.0, f"membership {names}"
                )

            recorder = asyncio.get_running_loop().create_task(record_all())
            try:
                async with reg.register(svc, record("t1"), ttl=5, load=load, load_interval=0.1):
                    await membership_becomes("t1")
                    # Three load snapshots, one after another, reach the full watch...
                    updated_at = 0.0
                    for _ in range(3):
                        snap = await next_matching(full, newer_than(updated_at))
                        entry = snap["t1"].load
                        assert entry is not None
                        updated_at = entry.updated_at
                    # ...then a membership change, which the membership-only watch publishes.
                    async with reg.register(svc, record("t2", 9002), ttl=5):
                        await membership_becomes("t1", "t2")
                await membership_becomes()  # the leaves arrive
            finally:
                recorder.cancel()
                await asyncio.gather(recorder, return_exceptions=True)
            # Every snapshot it published is a membership change (one published for a load report
            # would repeat the previous membership), and none carries a load.
            memberships = [sorted(s) for s in seen]
            if memberships and memberships[0] == []:
                memberships = memberships[1:]  # the empty start, unless the join was already there
            assert memberships[:2] == [["t1"], ["t1", "t2"]] and memberships[-1] == [], memberships
            assert all(a != b for a, b in itertools.pairwise(memberships)), memberships
            assert len(memberships) <= 4, memberships  # the two leaves: one snapshot each, or one for both
            assert all(e.load is None for s in seen for e in s.values())

    arun(main())


def test_a_steady_load_is_written_once_and_a_change_at_once(etcd: LocalEtcd) -> None:
    """Sampled ten times a second, a steady load is written once (then only when stale); a queue
    forming reaches a watcher within a sampling interval or two."""
    svc = unique_service()
    steady = registry_pb2.TeacherLoad(in_flight=5, samples_per_s=1000.0, busy_fraction=0.6)
    current = [steady]
    samples = [0]

    def load() -> registry_pb2.TeacherLoad:
        samples[0] += 1
        return current[0]

    async def main() -> None:
        async with open_registry(etcd.address) as reg, raw_client(etcd) as raw:
            watch = reg.watch(svc)
            async with reg.register(svc, record("t1"), ttl=5, load=load, load_interval=0.1, max_report_age=30.0):
                await next_matching(watch, lambda s: "t1" in s and s["t1"].load is not None)
                first = await raw.get(keys.load_key(svc, "t1").encode())
                assert first is not None
                # 15 more samples of the same load (each is written, if at all, before the next is
                # taken): the load key was not written again.
                taken = samples[0]
                await eventually(lambda: _true(samples[0] >= taken + 16), 10.0, "15 more samples")
                again = await raw.get(keys.load_key(svc, "t1").encode())
                assert again is not None and again.mod_revision == first.mod_revision
                current[0] = registry_pb2.TeacherLoad(queue_depth=4, in_flight=5, samples_per_s=1000.0,
                                                      busy_fraction=0.9)
                snap = await asyncio.wait_for(watch.__anext__(), 2.0)
                assert snap["t1"].load is not None and snap["t1"].load.queue_depth == 4

    arun(main())


def test_a_failing_load_function_does_not_stop_the_registration(
    etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    svc = unique_service()
    caplog.set_level(logging.WARNING, logger="discovery")

    calls = [0]

    def load() -> registry_pb2.TeacherLoad:
        calls[0] += 1
        raise RuntimeError("metrics broke")

    async def main() -> None:
        reg = open_registry(etcd.address)
        async with reg, reg.register(svc, record("t1"), ttl=5, load=load, load_interval=0.1) as r:
            await eventually(lambda: _true(calls[0] >= 5), 10.0, "five failing load samples")
            assert r.registered
            assert set(await reg.teachers(svc)) == {"t1"}

    arun(main())
    assert sum("metrics broke" in r.getMessage() for r in caplog.records) == 1


def test_teacher_subprocess_killed_disappears_within_ttl(etcd: LocalEtcd) -> None:
    svc = unique_service()
    ttl = 2.0

    async def main() -> float:
        async with open_registry(etcd.address) as reg:
            watch = reg.watch(svc)
            proc = spawn_teacher(etcd.address, svc, "victim", ttl=ttl)
            try:
                await next_matching(watch, ids("victim"), timeout=30.0)
                proc.send_signal(signal.SIGKILL)
                start = time.monotonic()
                await next_matching(watch, ids(), timeout=ttl + 5.0)
                return time.monotonic() - start
            finally:
                reap(proc)

    gone_after = arun(main(), timeout=60)
    # etcd expires a lease between TTL and TTL + its check interval (500 ms) after the last
    # keepalive, which the teacher sent up to TTL/3 before dying.
    assert 0.3 < gone_after < ttl + 3.0, gone_after


def test_lease_lost_leads_to_reregistration(etcd: LocalEtcd, caplog: pytest.LogCaptureFixture) -> None:
    svc = unique_service()
    caplog.set_level(logging.INFO, logger="discovery")

    async def main() -> None:
        async with open_registry(etcd.address) as reg:
            watch = reg.watch(svc)
            async with reg.register(svc, record("t1"), ttl=3) as r:
                await next_matching(watch, ids("t1"))
                old = r.lease_id
                assert old is not None
                async with raw_client(etcd) as raw:
                    await raw.revoke_lease(old)  # an operator, or an expiry during a long GC pause
                    await next_matching(watch, ids(), timeout=3.0)

                    async def back() -> bool:
                        got = await raw.get(r.key.encode())
                        return got is not None and got.lease != old

                    await eventually(back, timeout=5.0, what="re-registered with a new lease")
                assert r.registered and r.lease_id not in (None, old)
                await next_matching(watch, ids("t1"), timeout=3.0)

    arun(main())
    assert any("re-registered" in rec.getMessage() for rec in caplog.records)


def test_malformed_values_are_skipped_with_one_warning(etcd: LocalEtcd, caplog: pytest.LogCaptureFixture) -> None:
    svc = unique_service()
    caplog.set_level(logging.WARNING, logger="discovery")

    async def main() -> None:
        async with raw_client(etcd) as raw:
            await raw.put(keys.teacher_key(svc, "garbage").encode(), b"\xff\xff not a protobuf")
            await raw.put(
                keys.teacher_key(svc, "noendpoint").encode(),
                registry_pb2.TeacherRecord(instance_id="x").SerializeToString(),
            )
            await raw.put(keys.load_key(svc, "t1").encode(), b"\xff\xff")
            await raw.put(keys.teacher_key(svc, "t1").encode(), record("t1").SerializeToString())
            async with open_registry(etcd.address) as reg:
                watch = reg.watch(svc)
                snap = await next_matching(watch, ids("t1"))
                assert snap["t1"].load is None
                # More garbage at the same key, then a valid teacher: still one warning per key.
                await raw.put(keys.teacher_key(svc, "garbage").encode(), b"\xff\xfe still not")
                await raw.put(keys.teacher_key(svc, "t2").encode(), record("t2").SerializeToString())
                await next_matching(watch, ids("t1", "t2"))
                # A value that becomes valid is picked up.
                await raw.put(keys.teacher_key(svc, "garbage").encode(), record("garbage").SerializeToString())
                await next_matching(watch, ids("t1", "t2", "garbage"))
            await raw.delete_prefix(keys.service_prefix(svc).encode())

    arun(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("/teachers/garbage" in m for m in warnings) == 1, warnings
    assert sum("/teachers/noendpoint" in m and "without an endpoint" in m for m in warnings) == 1
    assert sum("/load/t1" in m for m in warnings) == 1


def test_many_watchers_converge_to_the_same_snapshot(etcd: LocalEtcd) -> None:
    svc = unique_service()

    async def main() -> None:
        async with open_registry(etcd.address) as teachers, open_registry(etcd.address) as students:
            others = [open_registry(etcd.address) for _ in range(4)]
            watches = [students.watch(svc) for _ in range(46)] + [o.watch(svc) for o in others]
            assert len(watches) == 50
            try:
                async with teachers.register(svc, record("a", 1), ttl=5), teachers.register(svc, record("b", 2), ttl=5):
                    c = teachers.register(svc, record("c", 3), ttl=5)
                    async with c:
                        snaps = await asyncio.gather(*(next_matching(w, ids("a", "b", "c"), 15.0) for w in watches))
                        assert all(s == snaps[0] for s in snaps)
                    snaps = await asyncio.gather(*(next_matching(w, ids("a", "b"), 15.0) for w in watches))
                    assert all(s == snaps[0] for s in snaps)
                    assert {s.endpoints()["a"] for s in snaps} == {"127.0.0.1:1"}
            finally:
                for o in others:
                    await o.close()

    arun(main(), timeout=60)


def test_publish_demand_and_demand_round_trip(etcd: LocalEtcd) -> None:
    svc = unique_service()
    rate = [100.0]

    def demand() -> registry_pb2.StudentDemand:
        rate[0] *= 1.2  # each sample a material change: every one is published
        return registry_pb2.StudentDemand(student_id="s1", samples_per_s=rate[0], wait_fraction=0.25)

    async def main() -> None:
        async with open_registry(etcd.address) as reg:
            assert await reg.demand(svc) == []
            async with (
                reg.publish_demand(svc, demand, ttl=5, interval=0.1) as pub,
                reg.publish_demand(svc, lambda: registry_pb2.StudentDemand(samples_per_s=5), student_id="s2", ttl=5),
            ):
                assert pub.key == keys.student_key(svc, "s1") and pub.registered

                async def updated() -> bool:
                    got = await reg.demand(svc)
                    return [d.student_id for d in got] == ["s1", "s2"] and got[0].samples_per_s > 103

                await eventually(updated, timeout=5.0, what="demand updates published")
                got = await reg.demand(svc)
                assert got[0].wait_fraction == 0.25 and got[0].updated_at > 0
                assert got[1].student_id == "s2" and got[1].samples_per_s == 5
                # Students' demand is not part of the teacher snapshot.
                assert len(await reg.teachers(svc)) == 0
            assert await reg.demand(svc) == []

    arun(main())


def test_view_reads_every_service_at_one_revision(etcd: LocalEtcd) -> None:
    """``Registry.view()`` (what ``distill top`` shows): teachers joined with their loads, students,
    the autoscaler's records and the leader an election publishes, for all services or the named ones."""
    svc, other = unique_service(), unique_service()

    def load() -> registry_pb2.TeacherLoad:
        return registry_pb2.TeacherLoad(samples_per_s=300.0, capacity_samples_per_s=900.0)

    async def main() -> None:
        async with open_registry(etcd.address) as reg:
            demand = registry_pb2.StudentDemand(student_id="s1", samples_per_s=250.0)
            election = reg.election(svc, identity="ctl-view", ttl=2)
            async with (
                reg.register(svc, record("t1"), ttl=5, load=load, load_interval=0.1),
                reg.register(other, record("t2", port=9001), ttl=5),
                reg.publish_demand(svc, lambda: demand, ttl=5),
            ):
                try:
                    await asyncio.wait_for(election.campaign(), 10)
                    assert await election.publish("decision", b'{"action": "hold"}')

                    async def loaded() -> bool:
                        [view] = (await reg.view([svc])).services
                        return bool(view.teachers) and view.teachers[0].load is not None

                    await eventually(loaded, 10.0, "the teacher's load in the view")
                    both = await reg.view()
                    assert both.registry == etcd.address and both.revision > 0
                    views = {v.name: v for v in both.services}
                    assert {svc, other} <= set(views)
                    mine = views[svc]
                    [teacher] = mine.teachers
                    assert teacher.instance_id == "t1" and teacher.load is not None
                    assert teacher.load.capacity_samples_per_s == 900.0
                    assert [d.student_id for d in mine.students] == ["s1"] and mine.unparsable == 0
                    records = {a.name: a.value for a in mine.autoscaler}
                    assert records == {"decision": b'{"action": "hold"}', "leader": b"ctl-view"}
                    assert await reg.autoscaler_decision(svc) == {"action": "hold"}
                    assert [t.instance_id for t in views[other].teachers] == ["t2"]
                    assert [v.name for v in (await reg.view([other])).services] == [other]
                finally:
                    await election.close()
        dead = open_registry(f"etcd://127.0.0.1:{free_port()}", timeout=1.0)
        try:
            with pytest.raises(RegistryUnavailableError, match=r"cannot read the registry at etcd://127\.0\.0\.1:"):
                await dead.view()
        finally:
            await dead.close()

    arun(main(), timeout=60)


def test_watch_raises_when_etcd_is_unreachable() -> None:
    port = free_port()

    async def main() -> None:
        async with EtcdRegistry(f"127.0.0.1:{port}", connect_timeout=1.0, timeout=1.0) as reg:
            start = time.monotonic()
            with pytest.raises(RegistryUnavailableError) as info:
                async for _ in reg.watch("svc"):
                    pass
            assert time.monotonic() - start < 5.0
            assert f"127.0.0.1:{port}" in str(info.value) and "Check the registry address" in str(info.value)
            with pytest.raises(RegistryUnavailableError):
                await reg.demand("svc")

    arun(main())


def test_register_before_etcd_is_up_registers_once_it_is(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    caplog.set_level(logging.INFO, logger="discovery")
    svc = unique_service()

    async def main() -> None:
        async with EtcdRegistry(f"127.0.0.1:{port}", timeout=1.0, retry_max_backoff=1.0) as reg:
            start = time.monotonic()
            async with reg.register(svc, record("early"), ttl=3) as r:  # must not raise
                assert time.monotonic() - start < 3.0
                assert not r.registered
                await eventually(
                    lambda: _true(any("etcd unreachable" in m.getMessage() for m in caplog.records)),
                    10.0,
                    "the first attempt fails",
                )
                etcd = LocalEtcd(client_port=port)
                try:
                    await asyncio.to_thread(etcd.start)
                    assert await r.wait_registered(timeout=10.0)
                    async with raw_client(etcd) as raw:
                        assert await raw.get(r.key.encode()) is not None
                finally:
                    await r.deregister()
                    await asyncio.to_thread(etcd.close)

    arun(main())
    unreachable = [m for m in (r.getMessage() for r in caplog.records) if "etcd unreachable" in m]
    assert len(unreachable) == 1, unreachable  # logged once, not once per retry


def test_failover_to_the_next_endpoint(etcd: LocalEtcd) -> None:
    svc = unique_service()
    dead = free_port()

    async def main() -> None:
        async with EtcdRegistry([f"127.0.0.1:{dead}", etcd.endpoint], timeout=1.0, connect_timeout=10.0) as reg:
            watch = reg.watch(svc)
            async with reg.register(svc, record("t1"), ttl=5) as r:
                assert await r.wait_registered(10.0)
                await next_matching(watch, ids("t1"))
            assert len(await reg.teachers(svc)) == 0

    arun(main())


def test_watch_resumes_after_a_partition_without_losing_changes(
    etcd: LocalEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    svc = unique_service()
    caplog.set_level(logging.INFO, logger="discovery")

    async def main() -> None:
        proxy = await TcpProxy(etcd.client_port).start()
        try:
            async with open_registry(etcd.address) as direct, EtcdRegistry(proxy.endpoint, timeout=1.0) as via_proxy:
                watch = via_proxy.watch(svc)
                a = direct.register(svc, record("a"), ttl=10)
                await a.__aenter__()
                await next_matching(watch, ids("a"))
                await proxy.cut()
                async with direct.register(svc, record("b"), ttl=10):
                    await a.deregister()  # both changes happen while the watcher is cut off
                    await eventually(
                        lambda: _true(any("interrupted" in m.getMessage() for m in caplog.records)),
                        10.0,
                        "the watcher notices the cut",
                    )
                    assert set(watch.current or {}) == {"a"}  # it keeps its last snapshot meanwhile
                    await proxy.resume()
                    await next_matching(watch, ids("b"), timeout=10.0)
        finally:
            await proxy.close()

    arun(main())
    messages = [r.getMessage() for r in caplog.records]
    assert any("interrupted" in m for m in messages)
    assert not any("reading everything again" in m for m in messages)  # resumed, no reload


def test_watch_reloads_after_compaction(etcd: LocalEtcd, caplog: pytest.LogCaptureFixture) -> None:
    svc = unique_service()
    caplog.set_level(logging.INFO, logger="discovery")

    async def main() -> None:
        proxy = await TcpProxy(etcd.client_port).start()
        try:
            async with open_registry(etcd.address) as direct, EtcdRegistry(proxy.endpoint, timeout=1.0) as via_proxy:
                watch = via_proxy.watch(svc)
                a = direct.register(svc, record("a"), ttl=10)
                await a.__aenter__()
                await next_matching(watch, ids("a"))
                await proxy.cut()
                async with direct.register(svc, record("b"), ttl=10):
                    await a.deregister()
                    async with raw_client(etcd) as raw:
                        for i in range(5):
                            await raw.put(f"/unrelated/{svc}/{i}".encode(), b"x")
                        put = await raw.put(f"/unrelated/{svc}/last".encode(), b"x")
                        await raw.compact(put.header.revision, physical=True)
                        await proxy.resume()
                        await next_matching(watch, ids("b"), timeout=10.0)
                        await raw.delete_prefix(f"/unrelated/{svc}/".encode())
        finally:
            await proxy.close()

    arun(main())
    assert any("compacted" in r.getMessage() for r in caplog.records)


def test_periodic_resync_repairs_state(etcd: LocalEtcd) -> None:
    svc = unique_service()

    async def main() -> None:
        async with open_registry(etcd.address) as reg, raw_client(etcd) as raw:
            watch = reg.watch(svc, resync_interval=0.3)
            await next_matching(watch, ids())
            await raw.put(keys.teacher_key(svc, "t1").encode(), record("t1").SerializeToString())
            await next_matching(watch, ids("t1"))
            # Several re-syncs later nothing is lost or duplicated, and changes still arrive.
            await asyncio.sleep(1.0)
            assert set(watch.current or {}) == {"t1"}
            await raw.delete(keys.teacher_key(svc, "t1").encode())
            await next_matching(watch, ids())

    arun(main())


def test_close_stops_watches_and_deregisters(etcd: LocalEtcd) -> None:
    svc = unique_service()

    async def main() -> None:
        reg = open_registry(etcd.address)
        watch = reg.watch(svc)
        await watch.__anext__()
        r = reg.register(svc, record("t1"), ttl=30)
        await r.__aenter__()
        tasks_before = len(asyncio.all_tasks())
        assert tasks_before > 1
        await reg.close()
        with pytest.raises(StopAsyncIteration):
            await watch.__anext__()
        assert not r.registered
        await asyncio.sleep(0.1)
        # Nothing of discovery's (or of the aetcd client it owned) is left running.
        left = []
        for task in asyncio.all_tasks():
            code = getattr(task.get_coro(), "cr_code", None)
            filename = code.co_filename if code is not None else ""
            if "/discovery/" in filename or "/aetcd/" in filename:
                left.append(task)
        assert left == []
        async with raw_client(etcd) as raw:
            assert await raw.get(keys.teacher_key(svc, "t1").encode()) is None

    arun(main())


# Runs `python -m discovery` the way a script's background job would: with SIGINT ignored.
_REGISTER_WITH_SIGINT_IGNORED = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "sys.argv = ['discovery', *sys.argv[1:]]; runpy.run_module('discovery', run_name='__main__')"
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_register_command_withdraws_and_exits_0_at_a_stop_signal(etcd: LocalEtcd, sig: signal.Signals) -> None:
    """``python -m discovery register`` ends at SIGINT or SIGTERM with exit 0 and withdraws its record
    at once (not after its 30 s lease), also when it started with SIGINT ignored."""
    svc = unique_service()

    async def main() -> int:
        async with open_registry(etcd.address) as reg:
            watch = reg.watch(svc)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _REGISTER_WITH_SIGINT_IGNORED, "register", "--registry", etcd.address,
                "--service", svc, "--instance-id", "held", "--endpoint", "127.0.0.1:9000", "--ttl", "30",
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                await next_matching(watch, ids("held"), timeout=30.0)
                proc.send_signal(sig)
                await next_matching(watch, ids(), timeout=10.0)
                return await asyncio.wait_for(proc.wait(), 20)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await asyncio.wait_for(proc.wait(), 10)

    assert arun(main(), timeout=60) == 0
