"""The scale simulation's worker: ``python -m benchmarks.scale_sim _worker ...``, its own process,
and the model its figures are checked against (`nominal`, `event_model`, `events_check`).

Many simulated teachers and students on one event loop, each using the real discovery code
(registration with lease and load reports, watches, demand), driven by the benchmark over
stdin/stdout JSON lines; see `benchmarks.scale_sim` for what is measured and why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

SERVICE = "scale"  # the constants below are the code's defaults the plan in docs/scale.md uses
FULL_STUDENTS = 1000
FULL_TEACHERS = 200
TTL_S = 10.0  # teacher-server --ttl default and publish_demand's default
LOAD_INTERVAL_S = 1.0  # register(load_interval=...) default; teacher-server does not change it
DEMAND_INTERVAL_S = 1.0  # publish_demand(interval=...) default; the engine does not change it
RESYNC_S = 30.0  # EtcdRegistry(resync_interval=...) default: a full read per watch this often
AUTOSCALER_PERIOD_S = 1.0  # distill.autoscale ControllerConfig.period default


def nominal(students: int, teachers: int, probe_every: float = 1.0) -> dict[str, Any]:
    """What the code's constants predict per second (see docs/scale.md for the derivation).

    Watch events are load puts x load watchers + membership changes x membership watchers:
    students watch membership only (``teachers/``); the one autoscaler watches both prefixes; no
    one watches ``students/``, so demand puts cost no events. The membership changes here are the
    latency probe's (one teacher in and one out every ``probe_every`` seconds), each reaching
    every student; load puts are the worst case (every 1 Hz sample written)."""
    leases = students + teachers
    load_puts = teachers / LOAD_INTERVAL_S
    changes = 2.0 / probe_every if probe_every > 0 else 0.0
    return {
        "keepalives_per_s": leases / (TTL_S / 3.0),
        "load_puts_per_s": load_puts,
        "demand_puts_per_s": students / DEMAND_INTERVAL_S,
        "writes_per_s": teachers / LOAD_INTERVAL_S + students / DEMAND_INTERVAL_S,
        "membership_changes_per_s": changes,
        "watch_events_per_s": load_puts * LOAD_WATCHERS + changes * (students + LOAD_WATCHERS),
        **event_model(students, load_puts, changes),
        "resync_ranges_per_s": (students + 1) / RESYNC_S,
        "autoscaler_ranges_per_s": 1.0 / AUTOSCALER_PERIOD_S,
    }


LOAD_WATCHERS = 1  # the autoscaler-like reader; `distill top` would be another


def event_model(students: int, load_puts: float, changes: float) -> dict[str, dict[str, float]]:
    """Watch events per second, by source and by watcher kind, for given source rates."""
    return {
        "events_by_source": {"load": load_puts * LOAD_WATCHERS, "membership": changes * (students + LOAD_WATCHERS),
                             "demand": 0.0},
        "events_by_watcher": {"student": changes * students, "autoscaler": changes + load_puts},
    }


def events_check(rows: list[dict[str, Any]], n_s: int, window: float, etcd_events: float) -> dict[str, Any]:
    """Events measured at the watchers and by etcd against the model fed the source rates the
    workers counted (reports written, probe teachers in and out, teacher re-registrations)."""
    seconds = max((r.get("seconds", 0.0) for r in rows), default=0.0) or window

    def total(field: str, key: str) -> float:
        return sum(r.get(field, {}).get(key, 0) for r in rows) / seconds

    changes = sum(r.get("joins", 0) + r.get("leaves", 0) + 2 * r.get("teacher_reregistrations", 0)
                  for r in rows) / seconds
    sources = {"load_puts_per_s": total("reports", "load"), "demand_puts_per_s": total("reports", "demand"),
               "membership_changes_per_s": changes}
    model = event_model(n_s, sources["load_puts_per_s"], changes)
    by_watcher = {"student": total("events", "student/teachers"),
                  "autoscaler": total("events", "autoscaler/teachers") + total("events", "autoscaler/load")}
    by_source = {"load": total("events", "autoscaler/load"),
                 "membership": total("events", "student/teachers") + total("events", "autoscaler/teachers"),
                 "demand": 0.0}
    model_total = sum(model["events_by_source"].values())
    ratio = {k: round(v / model["events_by_watcher"][k], 3) if model["events_by_watcher"][k] else None
             for k, v in by_watcher.items()}
    return {"sources_per_s": {k: round(v, 2) for k, v in sources.items()},
            "model": {"total": round(model_total, 1),
                      **{k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in model.items()}},
            "measured": {"etcd_total": round(etcd_events, 1),
                         "events_by_watcher": {k: round(v, 1) for k, v in by_watcher.items()},
                         "events_by_source": {k: round(v, 1) for k, v in by_source.items()}},
            "ratio_by_watcher": ratio,
            "ratio_etcd_total": round(etcd_events / model_total, 3) if model_total else None}


# Which simulated watcher a watch belongs to: set around `reg.watch(...)`, inherited by the watch's
# producer task (a task copies the context it is created in), read where events are applied.
_WATCHER = contextvars.ContextVar("scale_sim_watcher", default="other")
WATCHER_KINDS = ("student", "autoscaler")


class Counts:
    """What the simulator counts besides etcd: watch events received, by watcher kind and prefix
    ("student/teachers", "autoscaler/load", ...), and reports written, by source ("load",
    "demand"). Counted by wrapping the real code's `WatchState.apply` (every event a watch
    receives) and `ReportGate.due` (True: the sample is written); neither changes what they do."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.reports: dict[str, int] = {}

    def reset(self) -> None:
        self.events.clear()
        self.reports.clear()

    def install(self) -> None:
        from discovery.etcd.watch import WatchState
        from discovery.reports import ReportGate
        from protos import registry_pb2

        events, reports = self.events, self.reports
        apply, due = WatchState.apply, ReportGate.due

        def counting_apply(state: Any, kind: str, event: Any) -> None:
            key = f"{_WATCHER.get()}/{kind}"
            events[key] = events.get(key, 0) + 1
            apply(state, kind, event)

        def counting_due(gate: Any, report: Any, now: float, force: bool = False) -> bool:
            written = due(gate, report, now, force)
            if written:
                source = "load" if isinstance(report, registry_pb2.TeacherLoad) else "demand"
                reports[source] = reports.get(source, 0) + 1
            return written

        WatchState.apply = counting_apply  # type: ignore[method-assign,assignment]
        ReportGate.due = counting_due  # type: ignore[method-assign,assignment]


def worker_main(argv: Sequence[str]) -> int:
    """``python -m benchmarks.scale_sim _worker ...``: many teachers and students on one event loop.

    stdout: ``{"ev": "ready"}`` once all are registered and watching; then, on ``measure S`` on
    stdin, a ``{"ev": "result"}`` after S seconds; ``quit`` or EOF tears down and exits.
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_sim _worker")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--teachers", type=int, required=True)
    p.add_argument("--students", type=int, required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--sampled", type=int, default=10)
    p.add_argument("--probe-every", type=float, default=0.0)
    p.add_argument("--autoscaler", action="store_true")
    p.add_argument("--ramp", type=float, default=8.0)
    p.add_argument("--reports", choices=("steady", "moving"), default="steady")
    a = p.parse_args(list(argv))
    try:
        import uvloop

        uvloop.run(_worker(a))
    except ImportError:  # pragma: no cover
        asyncio.run(_worker(a))
    return 0


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def _worker(a: argparse.Namespace) -> None:
    import logging

    from discovery import EtcdRegistry, Registration
    from protos import registry_pb2

    logging.basicConfig(level=logging.ERROR)  # 1,000 "registered" lines would drown the output
    loop = asyncio.get_running_loop()
    regs = [EtcdRegistry(a.endpoint, timeout=10.0, connect_timeout=60.0,
                         grpc_options={"grpc.use_local_subchannel_pool": 1})  # one TCP connection each
            for _ in range(max(1, a.clients))]
    held: list[Registration] = []
    teachers_held: list[Registration] = []  # their re-registrations are membership changes too
    tasks: list[asyncio.Task[None]] = []
    stats = {"snapshots": 0, "autoscaler_reads": 0, "autoscaler_read_errors": 0}
    counts = Counts()
    counts.install()
    latencies: list[float] = []
    lags: list[float] = []
    rng = random.Random(a.index)

    def teacher_record(iid: str, started_at: float) -> Any:
        rec = registry_pb2.TeacherRecord(instance_id=iid, endpoint=f"127.0.0.1:{10000 + rng.randrange(50000)}",
                                         model_name="sim", model_version="1", max_batch_size=256, device="cpu",
                                         started_at=started_at, instances=1)
        rec.inputs.add(name="INPUT", datatype="FP32", shape=[3, 32, 32])
        rec.outputs.add(name="LOGITS", datatype="FP32", shape=[100])
        return rec

    def moving_load() -> Any:
        return registry_pb2.TeacherLoad(queue_depth=rng.randrange(4), in_flight=rng.randrange(8),
                                        samples_per_s=rng.uniform(9000, 12000), busy_fraction=rng.random(),
                                        capacity_samples_per_s=12000.0)

    def moving_demand() -> Any:
        return registry_pb2.StudentDemand(samples_per_s=rng.uniform(9000, 10240), wait_fraction=rng.random() * 0.1,
                                          in_flight=rng.randrange(8), teachers_in_use=4)

    def jitter(x: float, rel: float = 0.03) -> float:
        return x * rng.uniform(1 - rel, 1 + rel)

    def steady_load() -> Any:
        """One teacher at its own operating point; each sample within a few percent of it."""
        rate, busy = rng.uniform(9000, 12000), rng.uniform(0.6, 0.9)
        return lambda: registry_pb2.TeacherLoad(
            queue_depth=0, in_flight=rng.randrange(4, 8), samples_per_s=jitter(rate),
            busy_fraction=min(1.0, busy + rng.uniform(-0.02, 0.02)), capacity_samples_per_s=jitter(12000.0, 0.01))

    def steady_demand() -> Any:
        rate, wait = rng.uniform(9000, 10240), rng.uniform(0.0, 0.1)
        return lambda: registry_pb2.StudentDemand(
            samples_per_s=jitter(rate), wait_fraction=max(0.0, wait + rng.uniform(-0.02, 0.02)),
            in_flight=rng.randrange(4, 8), teachers_in_use=4)

    def load_fn() -> Any:
        return steady_load() if a.reports == "steady" else moving_load

    def demand_fn() -> Any:
        return steady_demand() if a.reports == "steady" else moving_demand

    async def consume(reg: EtcdRegistry, sampled: bool, loads: bool = False, kind: str = "student") -> None:
        seen: set[str] = set()
        _WATCHER.set(kind)  # this task's context, copied by the watch's producer task
        async with reg.watch(SERVICE, loads=loads) as watch:
            async for snap in watch:
                stats["snapshots"] += 1
                if sampled:
                    now = time.time()
                    for iid in snap:
                        if iid.startswith("probe-") and iid not in seen:
                            seen.add(iid)
                            latencies.append(now - snap[iid].record.started_at)

    async def lag_monitor() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.1)
            lags.append(loop.time() - t - 0.1)

    async def autoscaler(reg: EtcdRegistry) -> None:
        while True:
            try:
                await reg.demand(SERVICE)
                stats["autoscaler_reads"] += 1
            except Exception:
                stats["autoscaler_read_errors"] += 1
            await asyncio.sleep(AUTOSCALER_PERIOD_S)

    async def stagger(n: int, span: float, start_one: Any) -> None:
        batch = 25
        for lo in range(0, n, batch):
            await asyncio.gather(*(start_one(i) for i in range(lo, min(n, lo + batch))))
            await asyncio.sleep(span * batch / max(n, 1))

    async def start_teacher(i: int) -> None:
        iid = f"w{a.index}-t{i}"
        reg = regs[i % len(regs)].register(SERVICE, teacher_record(iid, time.time()), ttl=TTL_S, load=load_fn(),
                                           load_interval=LOAD_INTERVAL_S)
        await reg.__aenter__()
        held.append(reg)
        teachers_held.append(reg)

    async def start_student(i: int) -> None:
        r = regs[i % len(regs)]
        tasks.append(loop.create_task(consume(r, i < a.sampled)))
        d = r.publish_demand(SERVICE, demand_fn(), ttl=TTL_S, interval=DEMAND_INTERVAL_S,
                             student_id=f"w{a.index}-s{i}")
        await d.__aenter__()
        held.append(d)

    try:
        tasks.append(loop.create_task(lag_monitor()))
        await stagger(a.teachers, a.ramp / 3, start_teacher)
        await stagger(a.students, a.ramp * 2 / 3, start_student)
        if a.autoscaler:
            tasks.append(loop.create_task(autoscaler(regs[0])))
            tasks.append(loop.create_task(consume(regs[0], False, loads=True, kind="autoscaler")))
        registered = sum(1 for h in held if h.registered)
        _emit(ev="ready", registered=registered, expected=a.teachers + a.students)
        cmd = await _next_cmd()
        if cmd and cmd[0] == "measure":
            seconds = float(cmd[1])
            stats.update(snapshots=0, autoscaler_reads=0, autoscaler_read_errors=0)
            latencies.clear()
            lags.clear()
            counts.reset()
            regs_before = sum(getattr(h, "registrations", 1) for h in teachers_held)
            joins = leaves = 0  # membership changes this worker makes: probe teachers in and out
            probes: list[tuple[Registration, float]] = []
            t_end = loop.time() + seconds
            n = 0
            while loop.time() < t_end and n < 10_000:  # bounded in count and time
                if a.probe_every > 0:
                    started = time.time()
                    reg = regs[n % len(regs)].register(SERVICE, teacher_record(f"probe-{a.index}-{n}", started),
                                                       ttl=TTL_S)
                    await reg.__aenter__()
                    joins += 1
                    probes.append((reg, time.time() - started))
                    if len(probes) > 3:  # keep the teacher count steady: retire the oldest probe
                        await probes[-4][0].deregister()
                        leaves += 1
                    n += 1
                    await asyncio.sleep(max(0.0, min(a.probe_every, t_end - loop.time())))
                else:
                    await asyncio.sleep(max(0.0, t_end - loop.time()))
            _emit(ev="result", seconds=seconds, snapshots=stats["snapshots"],
                  autoscaler_reads=stats["autoscaler_reads"], autoscaler_read_errors=stats["autoscaler_read_errors"],
                  latencies=latencies, register_s=[d for _, d in probes], lag=_quantiles(lags),
                  registered=sum(1 for h in held if h.registered), expected=a.teachers + a.students,
                  reregistrations=sum(max(0, getattr(h, "registrations", 1) - 1) for h in held),
                  teacher_reregistrations=sum(getattr(h, "registrations", 1) for h in teachers_held) - regs_before,
                  joins=joins, leaves=leaves, events=dict(counts.events), reports=dict(counts.reports))
            await _next_cmd()  # quit or EOF: the benchmark has read etcd's counters by now
            for reg, _ in probes:  # not before: their leaving would land in etcd's window, not the model's
                await reg.deregister()
    finally:
        for t in tasks:
            t.cancel()
        # Revoking 1,000 leases one by one takes long; the benchmark restarts etcd per fraction,
        # so a bounded close is enough (leftover leases die with that etcd).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(r.close() for r in regs), return_exceptions=True), 10.0)


async def _next_cmd() -> list[str]:
    """The next command line from stdin, read in a thread so the event loop keeps running."""
    line = await asyncio.to_thread(sys.stdin.readline)
    return line.split() if line else []


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "max": math.nan}
    v = sorted(values)
    return {"n": len(v), "p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(len(v) * 0.99))], "max": v[-1]}
