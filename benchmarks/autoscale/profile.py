"""One W4 run: warm the pool up, step the students through the profile, sample everything."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.autoscale.pools import AutoscaledPool, DecisionFollower, FixedPool, Watcher
from benchmarks.autoscale.settings import Settings
from benchmarks.cpu import machine_busy_seconds, process_cpu_seconds, self_cpu_seconds
from benchmarks.students import StudentProc


@dataclass
class Run:
    """What one run (autoscaled or fixed) recorded; `summarise` turns it into the headline numbers."""

    mode: str
    rep: int
    service: str
    t0: float = 0.0  # monotonic time of the profile's start
    warmup_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    registry_events: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # when each phase really began
    teachers: list[dict[str, Any]] = field(default_factory=list)
    student_totals: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def run_profile(mode: str, rep: int, s: Settings, *, registry_address: str, students: list[StudentProc],
                      pool: AutoscaledPool | FixedPool) -> Run:
    """Warm up (the pool registered, students idle), then drive the profile and sample it."""
    from discovery import open_registry

    run = Run(mode=mode, rep=rep, service=pool.service)
    registry = open_registry(registry_address, timeout=3.0)
    watcher = Watcher(registry, pool.service)
    decisions = DecisionFollower(registry, pool.service)
    tasks: list[asyncio.Task[Any]] = []
    try:
        tasks.append(asyncio.get_running_loop().create_task(watcher.follow(), name="w4-watch"))
        if isinstance(pool, AutoscaledPool):
            tasks.append(asyncio.get_running_loop().create_task(decisions.follow(), name="w4-decisions"))

        async def track() -> None:
            while True:
                pool.poll()
                await asyncio.sleep(0.1)

        tasks.append(asyncio.get_running_loop().create_task(track(), name="w4-procs"))
        warm_start = time.monotonic()
        want = s.min_teachers if mode == "autoscaled" else s.pool_size
        while watcher.ready() < want or any(e.load is None for e in watcher.current.values()):
            pool.check()
            if time.monotonic() - warm_start > s.warmup_timeout_s:
                raise RuntimeError(f"{mode}: {want} teacher(s) not registered after {s.warmup_timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        run.warmup_s = round(time.monotonic() - warm_start, 2)
        await asyncio.sleep(0.5)  # let the controller see the settled pool
        await sample_profile(run, s, students=students, pool=pool, watcher=watcher, registry=registry)
        if isinstance(pool, AutoscaledPool):
            await asyncio.sleep(2 * decisions.poll_s)  # the last period's record, if any
            run.decisions = decisions.decisions(run.t0)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await registry.close()
    # Registration times into the teacher lives, then everything on the profile's clock.
    for t, iid, what in watcher.events:
        run.registry_events.append({"t": round(t - run.t0, 3), "instance_id": iid, "event": what})
        life = pool.life_of(iid)
        if life is None:
            continue
        if what == "registered" and life.registered is None:
            life.registered = t
        elif what in ("draining", "deregistered") and life.deregistered is None:
            life.deregistered = t
    for life in sorted(pool.lives.values(), key=lambda lf: lf.spawned):
        run.teachers.append({
            "instance_id": life.instance_id, "pid": life.pid,
            **{k: None if v is None else round(v - run.t0, 3)
               for k, v in (("spawned", life.spawned), ("registered", life.registered),
                            ("deregistered", life.deregistered), ("exited", life.exited))},
        })  # fmt: skip
    return run


def session_name(run: Run) -> str:
    return f"{run.mode}-r{run.rep}"


async def sample_profile(run: Run, s: Settings, *, students: list[StudentProc], pool: AutoscaledPool | FixedPool,
                         watcher: Watcher, registry: Any) -> None:
    """Step the students through the profile and sample everything every `sample_s` seconds."""
    session = session_name(run)
    bounds = [0.0]
    for d in s.phases_s:
        bounds.append(bounds[-1] + d)
    active: set[int] = set()
    pids_cpu: dict[int, float] = {}
    busy0 = machine_busy_seconds()
    self0 = self_cpu_seconds()
    last = time.monotonic()

    def set_students(n: int, phase: int) -> None:
        for i, st in enumerate(students):
            if i < n and i not in active:
                st.go(run.service, session)
                active.add(i)
            elif i >= n and i in active:
                st.stop_session()
                active.discard(i)
        run.steps.append({"phase": phase, "t": round(time.monotonic() - run.t0, 3), "students": n,
                          "needed": s.needed(n)})

    run.t0 = time.monotonic()
    set_students(s.students[0], 0)
    phase = 0
    tick = 0
    while True:
        tick += 1
        next_at = run.t0 + tick * s.sample_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        now = time.monotonic()
        t = now - run.t0
        if t >= bounds[-1] - 1e-9:
            break
        while phase + 1 < len(s.phases_s) and t >= bounds[phase + 1]:
            phase += 1
            set_students(s.students[phase], phase)
        pool.check()
        figures = await asyncio.to_thread(pool.scrape)
        try:
            demand = await asyncio.wait_for(registry.demand(run.service), 0.4)
        except Exception:
            demand = []
        # CPU split: ours (benchmark, students, teachers, autoscaler, etcd) vs the rest of the machine.
        own = [os.getpid(), *(st.pid for st in students), *pool.own_pids()]
        if isinstance(pool, AutoscaledPool) and pool.proc is not None:
            own.append(pool.proc.pid)
        if isinstance(pool, FixedPool):
            own += [p.pid for p in pool.servers if p.proc is not None]
        cpu_now = {pid: process_cpu_seconds(pid) for pid in set(own) - {os.getpid()}}
        busy1, self1 = machine_busy_seconds(), self_cpu_seconds()
        dt = max(now - last, 1e-6)
        ours = (self1 - self0 + sum(max(0.0, v - pids_cpu.get(pid, v)) for pid, v in cpu_now.items())) / dt
        machine = (busy1 - busy0) / dt
        pids_cpu.update(cpu_now)
        busy0, self0, last = busy1, self1, now
        per_student = []
        for i, st in enumerate(students):
            # End the window at the student's latest report while it reports (every 0.25 s): a
            # window reaching past the last report would undercount by up to a quarter. A student
            # whose reports stopped (its session ended) counts up to now, i.e. down to 0.
            latest = st.last_report(session)
            b = latest["t"] if latest is not None and now - 0.75 < latest["t"] <= now else now
            a = b - s.rate_window_s
            ds = st.value_at("s", b, session) - st.value_at("s", a, session)
            dw = st.value_at("w", b, session) - st.value_at("w", a, session)
            per_student.append({"active": i in active, "samples_per_s": round(ds / s.rate_window_s, 1),
                                "stall": round(min(1.0, dw / s.rate_window_s), 3)})
        loads = [e.load for e in watcher.current.values() if e.load is not None]
        row: dict[str, Any] = {
            "t": round(t, 3), "phase": phase, "students": s.students[phase], "needed": s.needed(s.students[phase]),
            "processes": pool.alive(), "registered": len(watcher.current), "ready": watcher.ready(),
            "throughput": round(sum(p["samples_per_s"] for p in per_student), 1),
            "student": per_student,
            "teacher_busy": [round(float(ld.busy_fraction), 3) for ld in loads],
            "teacher_queue": [int(ld.queue_depth) for ld in loads],
            "teacher_capacity": [round(float(ld.capacity_samples_per_s), 1) for ld in loads],
            "demand_published": [{"id": d.student_id, "samples_per_s": round(float(d.samples_per_s), 1),
                                  "wait": round(float(d.wait_fraction), 3)} for d in demand],
            "cores_ours": round(ours, 2), "cores_others": round(max(0.0, machine - ours), 2),
        }  # fmt: skip
        for key in ("desired_teachers", "current_teachers", "ready_teachers", "starting_teachers",
                    "demand_samples_per_second", "served_samples_per_second", "teacher_capacity_samples_per_second",
                    "student_wait_fraction", "teacher_busy_fraction"):
            if key in figures:
                row[f"as_{key}"] = round(figures[key], 3)
        run.samples.append(row)
    end = time.monotonic()
    # Stop the last students (their demand goes away with them), and wait until they have.
    set_students(0, len(s.phases_s))
    run.steps.pop()  # not a phase of the profile
    deadline = time.monotonic() + 20
    while any(not st.stopped(session) for st in students if st.last_report(session) is not None):
        if time.monotonic() > deadline:
            run.errors.append("students did not stop within 20 s of the profile's end")
            break
        await asyncio.sleep(0.1)
    for st in students:
        for err in st.errors:
            if err.get("session") == session:
                run.errors.append(f"{st.name} at t={err.get('t', run.t0) - run.t0:.1f} s: {err.get('msg')}")
    for i, st in enumerate(students):
        def delta(key: str, a: float, b: float, st: StudentProc = st) -> float:
            return st.value_at(key, run.t0 + b, session) - st.value_at(key, run.t0 + a, session)

        run.student_totals.append({
            "student": i,
            "samples": round(st.value_at("s", end, session)) if st.last_report(session) is not None else 0,
            "phases": [round(delta("s", a, b), 1) for a, b in itertools.pairwise(bounds)],
            "waited_s": [round(delta("w", a, b), 3) for a, b in itertools.pairwise(bounds)],
        })
