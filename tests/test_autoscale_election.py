"""One active autoscaler per service: leader election on a real etcd, takeover after the leader
is closed or SIGKILLed, and what a controller does while the registry is down (hold, never shrink).

The controllers here drive a recording backend, so what is under test is the election and the
controller loop, not processes; ``test_autoscale_local.py`` runs real teachers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill.autoscale import (
    Backend,
    BackendState,
    Controller,
    ControllerConfig,
    LeaderElection,
    PolicyConfig,
    leader_key,
)
from distill.autoscale.errors import ElectionError
from tests.etcd_fixtures import REPO, arun, raw_client, unique_service


class RecordingBackend(Backend):
    """A pool that exists only as a number; records what the controller asked of it."""

    name = "recording"

    def __init__(self) -> None:
        self.target = 0
        self.scaled: list[int] = []
        self.stand_downs = 0
        self.closed = False

    async def start(self) -> None:
        pass

    async def observe(self, teachers: Mapping[str, object]) -> BackendState:
        return BackendState(current=self.target, managed=frozenset())

    async def scale(self, desired: int, teachers: Mapping[str, object]) -> None:
        self.scaled.append(desired)
        self.target = desired

    async def stand_down(self) -> None:
        self.stand_downs += 1

    async def close(self) -> None:
        self.closed = True


async def until(what: str, check: Callable[[], object], timeout: float) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def controller(address: str, service: str, identity: str, backend: Backend, **policy: int) -> Controller:
    registry = open_registry(address, timeout=1.0)
    config = ControllerConfig(service, period=0.2, identity=identity, election_ttl=2, election_poll=0.1,
                              registry_timeout=1.0)  # fmt: skip
    return Controller(registry, backend, PolicyConfig(**policy), config)


async def key_value(etcd: LocalEtcd, service: str) -> str | None:
    async with raw_client(etcd) as client:
        got = await client.get(leader_key(service).encode())
    return None if got is None else got.value.decode()


async def key_lease(etcd: LocalEtcd, service: str) -> int | None:
    async with raw_client(etcd) as client:
        got = await client.get(leader_key(service).encode())
    return None if got is None else int(got.lease)


def test_second_controller_waits_then_takes_over_when_the_first_closes() -> None:
    service = unique_service("elect")
    with LocalEtcd() as etcd:

        async def go() -> None:
            a_backend, b_backend = RecordingBackend(), RecordingBackend()
            a = controller(etcd.address, service, "ctl-a", a_backend, min_teachers=2)
            b = controller(etcd.address, service, "ctl-b", b_backend, min_teachers=2)
            try:
                await a.start()
                await until("a leads", lambda: a.is_leader and a_backend.scaled, 10)
                await b.start()
                await until("b sees a lead", lambda: b_backend.stand_downs == 1, 10)
                # Several more looks at the key later, b still waits and has touched nothing.
                polls = b.election.polls
                await until("b polls on", lambda: b.election.polls >= polls + 3, 10)
                assert not b.is_leader and b_backend.scaled == []
                assert b_backend.stand_downs == 1  # it saw another leader once, so it holds no pool
                assert await key_value(etcd, service) == "ctl-a" == await b.election.leader()
                assert a_backend.scaled == [2]

                await a.close()  # resigns: the lease is revoked, so the key goes at once...
                assert await key_value(etcd, service) in (None, "ctl-b")  # ...not after a's 2 s TTL
                await until("b takes over", lambda: b.is_leader, 10)
                await until("b sizes its pool", lambda: b_backend.scaled == [2], 10)
                assert a_backend.closed and await key_value(etcd, service) == "ctl-b"
                assert b.election.terms == 1 and a.election.terms == 1
            finally:
                for c in (a, b):
                    await c.close()
                    await c.registry.close()
            assert await key_value(etcd, service) is None

        arun(go(), timeout=40)


def test_a_killed_leader_is_replaced_after_its_lease_expires(tmp_path: Path) -> None:
    """The first controller is a real `python -m distill.autoscale` process, SIGKILLed."""
    service = unique_service("kill")
    with LocalEtcd() as etcd:
        cmd = [sys.executable, "-m", "distill.autoscale", "--registry", etcd.address, "--service", service,
               "--min", "0", "--max", "2", "--election-ttl", "2", "--identity", "ctl-proc", "--period", "0.5",
               "--", "teacher-server", "--model", "tests.models:affine"]  # fmt: skip
        log = tmp_path / "autoscaler.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:

            async def go() -> None:
                deadline = time.monotonic() + 60
                while await key_value(etcd, service) != "ctl-proc":
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    await asyncio.sleep(0.1)
                backend = RecordingBackend()
                b = controller(etcd.address, service, "ctl-b", backend, min_teachers=0)
                try:
                    await b.start()
                    await until("b sees ctl-proc lead", lambda: backend.stand_downs == 1, 10)
                    polls = b.election.polls
                    await until("b polls on", lambda: b.election.polls >= polls + 3, 10)
                    assert not b.is_leader  # several looks at a live leader's key: b waits
                    old_lease = await key_lease(etcd, service)
                    assert old_lease is not None
                    os.kill(proc.pid, signal.SIGKILL)
                    # Nobody resigns: the takeover waits for the dead leader's lease to expire.
                    await until("b takes over", lambda: b.is_leader, 15)
                    assert await key_value(etcd, service) == "ctl-b"
                    assert await key_lease(etcd, service) == b.election.lease_id != old_lease
                    async with raw_client(etcd) as client:
                        assert (await client.get_lease_info(old_lease)).TTL == -1  # the dead leader's lease is gone
                finally:
                    await b.close()
                    await b.registry.close()

            arun(go(), timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        assert "leading as ctl-proc" in log.read_text()


def test_sigterm_stops_the_cli_cleanly_and_resigns(tmp_path: Path) -> None:
    service = unique_service("term")
    with LocalEtcd() as etcd:
        cmd = [sys.executable, "-m", "distill.autoscale", "--registry", etcd.address, "--service", service,
               "--min", "0", "--identity", "ctl-term",
               "--", "teacher-server", "--model", "tests.models:affine"]  # fmt: skip
        log = tmp_path / "autoscaler.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:

            async def leader_appears() -> None:
                deadline = time.monotonic() + 60
                while await key_value(etcd, service) != "ctl-term":
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    await asyncio.sleep(0.1)

            arun(leader_appears(), timeout=70)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert arun(key_value(etcd, service), timeout=10) is None  # resigned: no waiting for the TTL
        assert "resigned" in log.read_text()


def test_registry_down_holds_the_count_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    service = unique_service("down")
    caplog.set_level(logging.INFO, logger="distill.autoscale")
    with LocalEtcd() as etcd:

        async def go() -> None:
            backend = RecordingBackend()
            backend.target = 3  # a pool of 3 and no students: only after the 30 s down window may it shrink
            c = controller(etcd.address, service, "ctl-a", backend, min_teachers=0, down_window=30)
            try:
                await c.start()
                await until("leads", lambda: c.is_leader and len(c.decisions) > 0, 10)
                assert c.decisions[0].cause == "stabilising", c.decisions[0].reason

                await asyncio.to_thread(etcd.stop)
                # It decides on missing data while its lease may still be alive, then steps down
                # once no refresh has succeeded for the 2 s leader lease.
                await until("a no-data decision", lambda: any(d.cause == "no-data" for d in c.decisions), 15)
                await until("steps down", lambda: not c.is_leader, 15)
                outage = list(c.decisions)
                assert backend.scaled == [] and backend.target == 3  # held: never shrinks on missing data
                assert backend.stand_downs == 0  # no other leader was seen: the pool is kept
                assert not c.is_leader  # ...but it stopped deciding once its lease could have expired
                assert any(d.cause == "no-data" for d in outage), [d.reason for d in outage]

                await asyncio.to_thread(etcd.start)
                await until("leads again", lambda: c.is_leader, 15)
                seen = len(c.decisions)
                await until("decides on data again",
                            lambda: len(c.decisions) > seen and c.decisions[-1].cause != "no-data", 15)
                assert backend.target == 3 and backend.stand_downs == 0 and backend.scaled == []
            finally:
                await c.close()
                await c.registry.close()

        arun(go(), timeout=60)
    downs = [r for r in caplog.records if "registry unreachable" in r.getMessage()]
    assert len(downs) == 1, [r.getMessage() for r in downs]
    assert any("registry reachable" in r.getMessage() for r in caplog.records)
    # etcd keeps leases across a restart (and extends them when it starts): the leader resumes its own.
    assert any("ctl-a resumed its lease" in r.getMessage() for r in caplog.records)


def test_election_refuses_a_static_registry_and_short_ttls() -> None:
    registry = open_registry("static://127.0.0.1:9000")
    with pytest.raises(ElectionError, match="etcd registry"):
        LeaderElection(registry, "svc", identity="a")
    etcd_registry = open_registry("etcd://127.0.0.1:1")
    with pytest.raises(ElectionError, match="at least 2 seconds"):
        LeaderElection(etcd_registry, "svc", identity="a", ttl=1)
    with pytest.raises(ValueError, match="must not contain '/'"):
        LeaderElection(etcd_registry, "svc", identity="a/b")


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_teachers_drain_when_their_autoscaler_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the autoscaler no chance to clean up; the kernel SIGTERMs its teachers, which
    deregister at once (far sooner than their 30 s lease) and exit."""
    service = unique_service("orphan")
    with LocalEtcd() as etcd:
        cmd = [sys.executable, "-m", "distill.autoscale", "--registry", etcd.address, "--service", service,
               "--min", "1", "--max", "1", "--election-ttl", "2",
               "--", "teacher-server", "--model", "tests.models:affine", "--ttl", "30", "--threads", "1"]  # fmt: skip
        log = tmp_path / "autoscaler.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        teacher_pid = None
        try:

            async def registered() -> bool:
                async with raw_client(etcd) as client:
                    return any(True for _ in await client.get_prefix(f"/distill/v1/{service}/teachers/".encode()))

            async def go() -> None:
                nonlocal teacher_pid
                deadline = time.monotonic() + 60
                while not await registered():
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    await asyncio.sleep(0.2)
                children = _children(proc.pid)
                assert len(children) == 1, children
                teacher_pid = int(children[0])
                proc.kill()
                killed = time.monotonic()
                while await registered():
                    assert time.monotonic() - killed < 10, "the teacher did not deregister"
                    await asyncio.sleep(0.1)
                while _alive(teacher_pid):
                    assert time.monotonic() - killed < 20, "the teacher outlived its autoscaler"
                    await asyncio.sleep(0.1)

            arun(go(), timeout=90)
        finally:
            proc.kill()
            proc.wait(10)
            if teacher_pid is not None and _alive(teacher_pid):
                os.kill(teacher_pid, signal.SIGKILL)
