"""How fast discovery propagates: registration -> watcher snapshot, and teacher death -> removal.

Runs a real etcd (LocalEtcd) on loopback and measures, with one EtcdRegistry watching:

(a) join:  from entering ``register()`` (lease grant + put) until a watcher's snapshot holds the
           teacher; ``repetitions`` times (default 20). Also from a bare etcd put, and the leave
           after a clean exit (lease revoked). Changes are spaced 100 ms apart, so each is seen
           alone; a burst is coalesced into snapshots at most every 50 ms.
(b) crash: from SIGKILL of a teacher *process* registered with ``--ttl`` seconds until the watcher's
           snapshot drops it (bounded by the lease TTL: etcd expires it TTL after the last
           keepalive, which the teacher sent up to TTL/3 before it died).

Prints a table, writes ``benchmarks/results/discovery_propagation.json`` (``$DISTILL_BENCH_RESULTS``
points it elsewhere, as for every benchmark) and states the machine.

    python -m benchmarks.discovery_propagation [--repetitions 20] [--crash-repetitions 5] [--ttl 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR
from discovery import EtcdRegistry, TeacherSet, keys
from discovery.local_etcd import LocalEtcd, find_etcd
from protos import registry_pb2

RESULTS = RESULTS_DIR / "discovery_propagation.json"
REPO = Path(__file__).resolve().parent.parent


class Seen:
    """Records when each instance id first appeared in / disappeared from the watcher's snapshots."""

    def __init__(self) -> None:
        self.current: set[str] = set()
        self.appeared: dict[str, float] = {}
        self.vanished: dict[str, float] = {}
        self.changed = asyncio.Event()

    def update(self, snap: TeacherSet) -> None:
        now = time.perf_counter()
        ids = set(snap)
        for iid in ids - self.current:
            self.appeared[iid] = now
        for iid in self.current - ids:
            self.vanished[iid] = now
        self.current = ids
        self.changed.set()

    async def wait(self, cond: Any, timeout: float) -> None:
        async def loop() -> None:
            while not cond():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(values) * 1000,
        "max_ms": max(values) * 1000,
        "min_ms": min(values) * 1000,
        "n": len(values),
    }


async def _measure(etcd: LocalEtcd, repetitions: int, crash_repetitions: int, ttl: float) -> dict[str, Any]:
    service = f"bench-{os.getpid()}"
    seen = Seen()
    async with EtcdRegistry(etcd.endpoint) as student, EtcdRegistry(etcd.endpoint) as teacher:
        watch = student.watch(service)

        async def consume() -> None:
            async for snap in watch:
                seen.update(snap)

        consumer = asyncio.create_task(consume())
        await seen.wait(lambda: True, 10)

        join: list[float] = []
        join_put: list[float] = []
        raw = teacher.client()
        leave: list[float] = []
        for i in range(repetitions):
            iid = f"join-{i}"
            rec = registry_pb2.TeacherRecord(instance_id=iid, endpoint=f"127.0.0.1:{20000 + i}")
            reg = teacher.register(service, rec, ttl=10)
            start = time.perf_counter()
            await reg.__aenter__()
            await seen.wait(lambda iid=iid: iid in seen.current, 10)
            join.append(seen.appeared[iid] - start)
            await asyncio.sleep(0.1)  # an isolated change, outside the 50 ms coalescing window
            start = time.perf_counter()
            await reg.deregister()
            await seen.wait(lambda iid=iid: iid not in seen.current, 10)
            leave.append(seen.vanished[iid] - start)
            await asyncio.sleep(0.1)

            # The bare etcd put (no lease grant), as a floor for the join time.
            key = keys.teacher_key(service, f"put-{i}").encode()
            rec.instance_id = f"put-{i}"
            start = time.perf_counter()
            await raw.put(key, rec.SerializeToString())
            await seen.wait(lambda i=i: f"put-{i}" in seen.current, 10)
            join_put.append(seen.appeared[f"put-{i}"] - start)
            await raw.delete(key)
            await seen.wait(lambda i=i: f"put-{i}" not in seen.current, 10)
            await asyncio.sleep(0.1)

        crash: list[float] = []
        for i in range(crash_repetitions):
            iid = f"crash-{i}"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "discovery", "register", "--registry", etcd.address,
                "--service", service, "--instance-id", iid, "--endpoint", f"127.0.0.1:{21000 + i}",
                "--ttl", str(ttl),
                cwd=REPO,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                await seen.wait(lambda iid=iid: iid in seen.current, 60)
                await asyncio.sleep(ttl * (0.5 + 0.1 * i))  # vary the phase of the keepalive cycle
                proc.send_signal(signal.SIGKILL)
                killed = time.perf_counter()
                await seen.wait(lambda iid=iid: iid not in seen.current, ttl + 10)
                crash.append(seen.vanished[iid] - killed)
            finally:
                if proc.returncode is None:
                    proc.kill()
                await asyncio.wait_for(proc.wait(), 10)

        consumer.cancel()
        await asyncio.wait([consumer])
        await watch.aclose()

    return {
        "join": _stats(join),
        "join_raw_put": _stats(join_put),
        "leave_on_exit": _stats(leave),
        "crash": {**_stats(crash), "ttl_s": ttl},
        "raw_s": {"join": join, "join_raw_put": join_put, "leave_on_exit": leave, "crash": crash},
    }


def _machine() -> dict[str, Any]:
    version = subprocess.run([find_etcd(), "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "etcd": version.splitlines()[0] if version else "unknown",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--crash-repetitions", type=int, default=5)
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL of the crashing teacher")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    machine = _machine()
    print(f"machine: {machine['platform']}, {machine['cpu_count']} CPUs, Python {machine['python']}, {machine['etcd']}")
    with LocalEtcd() as etcd:
        results = asyncio.run(_measure(etcd, args.repetitions, args.crash_repetitions, args.ttl))

    rows = [
        ("join: register() entered -> in watcher snapshot", results["join"]),
        ("join: bare etcd put -> in watcher snapshot", results["join_raw_put"]),
        ("leave: clean exit (lease revoked) -> gone", results["leave_on_exit"]),
        (f"crash: SIGKILL (ttl {args.ttl:g} s) -> gone", results["crash"]),
    ]
    print(f"\n{'measurement':<50} {'n':>3} {'median ms':>10} {'max ms':>9} {'min ms':>9}")
    for name, st in rows:
        print(f"{name:<50} {st['n']:>3} {st['median_ms']:>10.1f} {st['max_ms']:>9.1f} {st['min_ms']:>9.1f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "discovery_propagation", "machine": machine, "time": time.time(), **results}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
