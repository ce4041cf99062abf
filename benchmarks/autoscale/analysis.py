"""W4's numbers: one run's reaction, overshoot, flaps, teacher-seconds and throughput
(`summarise`), and the autoscaled pool against the fixed one (`compare`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.autoscale.profile import Run
from benchmarks.autoscale.settings import (
    _CEIL_SLACK,
    GOAL_FLAPS,
    GOAL_OVERSHOOT,
    GOAL_REACH_S,
    GOAL_THROUGHPUT,
    Settings,
)
from benchmarks.common import median, ratio


def phase_bounds(s: Settings) -> list[tuple[float, float]]:
    out, t = [], 0.0
    for d in s.phases_s:
        out.append((t, t + d))
        t += d
    return out


def ready_timeline(run: Run) -> list[tuple[float, int]]:
    """(t, ready count) after every registry event, from the exact event times."""
    ready: set[str] = set()
    gone: set[str] = set()
    out: list[tuple[float, int]] = []
    for ev in run.registry_events:
        iid = ev["instance_id"]
        if ev["event"] == "registered" and iid not in gone:
            ready.add(iid)
        else:
            ready.discard(iid)
            gone.add(iid)
        out.append((ev["t"], len(ready)))
    return out


def count_at(timeline: Sequence[tuple[float, int]], t: float) -> int:
    value = 0
    for when, n in timeline:
        if when > t:
            break
        value = n
    return value


def desired_timeline(run: Run, s: Settings) -> list[tuple[float, int]]:
    """(t, desired) from the logged decisions (every change is logged), starting at --min."""
    out = [(-math.inf, s.min_teachers)]
    for d in run.decisions:
        if d["kind"] == "decision" and d["desired"] != out[-1][1]:
            out.append((d["t"], d["desired"]))
    return out


def summarise(run: Run, s: Settings) -> dict[str, Any]:
    """The headline numbers of one run: reaction, overshoot, flaps, teacher-seconds, throughput."""
    bounds = phase_bounds(s)
    end = bounds[-1][1]
    ready = ready_timeline(run)
    desired = desired_timeline(run, s) if run.mode == "autoscaled" else [(-math.inf, s.pool_size)]
    steps: list[dict[str, Any]] = []
    for k, (a, b) in enumerate(bounds if run.mode == "autoscaled" else []):  # a fixed pool has no steps
        need = s.needed(s.students[k])
        before = s.needed(s.students[k - 1]) if k else count_at(ready, a)
        up = need >= before
        # time to the needed count of registered (ready) teachers, from exact registry events
        reach: float | None = None
        if (count_at(ready, a) >= need) if up else (count_at(ready, a) <= need):
            reach = 0.0
        else:
            for t, n in ready:
                if a <= t < b and ((n >= need) if up else (n <= need)):
                    reach = t - a
                    break
        decided: float | None = None
        if (count_at(desired, a) >= need) if up else (count_at(desired, a) <= need):
            decided = 0.0
        else:
            for t, n in desired:
                if a <= t < b and ((n >= need) if up else (n <= need)):
                    decided = t - a
                    break
        settle = a + (reach if reach is not None else b - a)
        changes = [(t, n) for t, n in desired if a <= t < b]
        flaps = sum(1 for t, _ in changes if t > settle)
        ready_changes = sum(1 for t, _ in ready if settle < t < b)
        justified = max(need, s.needed(s.students[k - 1]) if k else need)
        peak_desired = max([count_at(desired, a)] + [n for _, n in changes])
        peak_ready = max([count_at(ready, a)] + [n for t, n in ready if a <= t < b])
        steps.append({
            "phase": k, "students": s.students[k], "needed": need, "direction": "up" if need > before else
            ("down" if need < before else "same"),
            "decided_after_s": None if decided is None else round(decided, 2),
            "reached_after_s": None if reach is None else round(reach, 2),
            "beyond_down_window_s": None if reach is None or need >= before else round(reach - s.down_window_s, 2),
            "actions_to_reach": sum(1 for t, _ in changes if t <= settle),
            "flaps": flaps, "ready_changes_when_steady": ready_changes,
            "overshoot": max(0, peak_desired - justified, peak_ready - justified),
        })  # fmt: skip
    # teacher-seconds: every second a teacher process lived inside the profile window
    spent = 0.0
    startup = []
    for tl in run.teachers:
        a = max(0.0, tl["spawned"])
        b = min(end, tl["exited"] if tl["exited"] is not None else end)
        spent += max(0.0, b - a)
        if tl["registered"] is not None and tl["spawned"] > -30:
            startup.append(tl["registered"] - tl["spawned"])
    oracle = sum(s.needed(n) * d for n, d in zip(s.students, s.phases_s, strict=True))
    phase_samples = [sum(st["phases"][k] for st in run.student_totals) for k in range(len(bounds))]
    waited = [sum(st["waited_s"][k] for st in run.student_totals) for k in range(len(bounds))]
    student_time = [n * (b - a) for n, (a, b) in zip(s.students, bounds, strict=True)]
    caps = [c for row in run.samples for c in row["teacher_capacity"] if c > 0]
    cap = median(caps) if caps else float("nan")
    policy_sizing = [math.ceil(n * s.student_rate / (cap * s.target_utilisation) - _CEIL_SLACK) if caps else None
                     for n in s.students]
    others = [row["cores_others"] for row in run.samples]
    reach_up = [float(st["reached_after_s"]) for st in steps
                if st["direction"] == "up" and st["reached_after_s"] is not None]
    return {
        "mode": run.mode, "rep": run.rep, "warmup_s": run.warmup_s,
        "steps": steps,
        "max_reach_up_s": max(reach_up or [float("nan")]),
        "overshoot": max((st["overshoot"] for st in steps), default=0),
        "flaps": sum(st["flaps"] for st in steps),
        "reader_failures": sum(1 for e in run.errors if "students did not stop" not in e),
        "teacher_seconds": round(spent, 1), "oracle_teacher_seconds": round(oracle, 1),
        "teacher_seconds_vs_oracle": round(ratio(spent, oracle), 3),
        "teacher_startup_s": [round(x, 2) for x in startup],
        "samples": round(sum(phase_samples)), "samples_per_phase": [round(x) for x in phase_samples],
        "samples_per_s": round(sum(phase_samples) / end, 1),
        "ideal_samples": round(sum(n * s.student_rate * d for n, d in zip(s.students, s.phases_s, strict=True))),
        "stall_per_phase": [round(ratio(w, st), 4) for w, st in zip(waited, student_time, strict=True)],
        "measured_teacher_capacity": round(cap, 1),
        "policy_sizing_with_measured_capacity": policy_sizing,
        "policy_agrees_with_oracle": policy_sizing == s.oracle if caps else None,
        "cores_others_median": round(median(others), 2) if others else None,
        "cores_others_max": round(max(others), 2) if others else None,
        "errors": run.errors,
    }


def compare(summaries: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Autoscaled vs fixed, per repetition (paired), and the medians the headline uses."""
    reps = sorted({x["rep"] for x in summaries})
    pairs = []
    for r in reps:
        auto = next(x for x in summaries if x["rep"] == r and x["mode"] == "autoscaled")
        fixed = next(x for x in summaries if x["rep"] == r and x["mode"] == "fixed")
        pairs.append({
            "rep": r, "throughput_vs_fixed": round(ratio(auto["samples"], fixed["samples"]), 4),
            "per_phase_vs_fixed": [round(ratio(a, b), 4) for a, b in
                                   zip(auto["samples_per_phase"], fixed["samples_per_phase"], strict=True)],
            "teacher_seconds_vs_fixed": round(ratio(auto["teacher_seconds"], fixed["teacher_seconds"]), 4),
        })  # fmt: skip
    autos = [x for x in summaries if x["mode"] == "autoscaled"]
    ups = [x["max_reach_up_s"] for x in autos]
    headline = {
        "throughput_vs_fixed": round(median([p["throughput_vs_fixed"] for p in pairs]), 4),
        "per_phase_vs_fixed": [round(median([p["per_phase_vs_fixed"][k] for p in pairs]), 4)
                               for k in range(len(s.phases_s))],
        "max_reach_up_s": round(median(ups), 2),
        "overshoot": max(x["overshoot"] for x in autos),
        "flaps": max(x["flaps"] for x in autos),
        "teacher_seconds_vs_oracle": round(median([x["teacher_seconds_vs_oracle"] for x in autos]), 3),
        "teacher_seconds_vs_fixed": round(median([p["teacher_seconds_vs_fixed"] for p in pairs]), 3),
    }
    met = {
        "reach_up_le_10s": headline["max_reach_up_s"] <= GOAL_REACH_S,
        "overshoot_0": headline["overshoot"] <= GOAL_OVERSHOOT,
        "flaps_0": headline["flaps"] <= GOAL_FLAPS,
        "throughput_ge_0.95": headline["throughput_vs_fixed"] >= GOAL_THROUGHPUT,
    }
    return {"pairs": pairs, "headline": headline, "met": met}
