"""etcd crashes and restarts (SIGKILL, same data dir), and LocalEtcd's own process hygiene."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from discovery import EtcdRegistry, keys
from discovery.local_etcd import LocalEtcd, find_etcd
from tests.etcd_fixtures import arun, eventually, ids, next_matching, raw_client, record, unique_service

pytestmark = pytest.mark.timeout(90)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists"; it is gone for our purposes once reaped by its parent (us).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_teacher_and_watcher_survive_an_etcd_crash(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="discovery")
    svc = unique_service()
    etcd = LocalEtcd(tmp_path / "etcd").start()

    async def main() -> None:
        opts = {"timeout": 1.0, "retry_max_backoff": 1.0}
        async with (
            EtcdRegistry(etcd.endpoint, **opts) as teacher_side,
            EtcdRegistry(etcd.endpoint, **opts) as student_side,
        ):
            watch = student_side.watch(svc)
            async with teacher_side.register(svc, record("t1"), ttl=2) as reg:
                await next_matching(watch, ids("t1"))
                await asyncio.to_thread(etcd.kill)
                # An outage longer than the TTL: the teacher notices and keeps retrying quietly.
                start = time.monotonic()

                async def unregistered() -> bool:
                    return not reg.registered

                await eventually(unregistered, timeout=5.0, what="the teacher notices the outage")
                await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - start)))
                assert set(watch.current or {}) == {"t1"}  # students keep the last snapshot meanwhile
                await asyncio.to_thread(etcd.restart)
                assert await reg.wait_registered(timeout=15.0)
                async with raw_client(etcd) as raw:
                    got = await raw.get(keys.teacher_key(svc, "t1").encode())
                    assert got is not None and got.lease == reg.lease_id
                # The old watcher is live again: a teacher registering after the restart shows up.
                async with teacher_side.register(svc, record("t2", 9002), ttl=2):
                    await next_matching(watch, ids("t1", "t2"), timeout=15.0)
                await next_matching(watch, ids("t1"), timeout=5.0)
            await next_matching(watch, ids(), timeout=5.0)

    try:
        arun(main(), timeout=60)
    finally:
        etcd.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("etcd unreachable" in m and "teacher 't1'" in m for m in messages) == 1
    assert any("reachable again" in m or "re-registered" in m for m in messages)


def test_local_etcd_stop_kill_restart_leave_no_process(tmp_path: Path) -> None:
    etcd = LocalEtcd(tmp_path / "data")
    assert not etcd.running
    with etcd:
        pid = etcd.pid
        assert pid is not None and _alive(pid)
        assert etcd.address == f"etcd://127.0.0.1:{etcd.client_port}"
        assert etcd.log_path.is_file() and etcd.log_path.parent == tmp_path / "data"
        port = etcd.client_port
        etcd.kill()
        assert not etcd.running and not _alive(pid)
        etcd.restart()
        assert etcd.running and etcd.client_port == port and etcd.pid != pid
        pid = etcd.pid
        assert pid is not None
    assert not etcd.running and not _alive(pid)
    assert (tmp_path / "data" / "member").is_dir()  # a given data dir is kept


def test_local_etcd_keeps_data_across_restart(tmp_path: Path) -> None:
    async def put(etcd: LocalEtcd) -> None:
        async with raw_client(etcd) as raw:
            await raw.put(b"/k", b"v")

    async def get(etcd: LocalEtcd) -> bytes | None:
        async with raw_client(etcd) as raw:
            got = await raw.get(b"/k")
            return None if got is None else bytes(got.value)

    with LocalEtcd(tmp_path / "d") as etcd:
        arun(put(etcd))
        etcd.restart(kill=True)
        assert arun(get(etcd)) == b"v"


def test_local_etcd_temp_dir_is_removed_and_del_kills() -> None:
    etcd = LocalEtcd().start()
    data_dir, pid = etcd.data_dir, etcd.pid
    assert pid is not None
    etcd.close()
    assert not data_dir.exists() and not _alive(pid)

    forgotten = LocalEtcd().start()
    pid = forgotten.pid
    assert pid is not None
    forgotten.__del__()  # what garbage collection does for an owner that forgot to stop it
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    forgotten.close()


def test_local_etcd_reports_a_startup_failure(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="etcd exited"):
        LocalEtcd(tmp_path / "x", extra_args=["--no-such-flag"]).start()


def test_find_etcd_finds_a_binary() -> None:
    assert os.access(find_etcd(), os.X_OK)
