"""W4's output: the text report, the plot, and the JSON's columnar timeline."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.autoscale.settings import GOAL_REACH_S, GOAL_THROUGHPUT, Settings
from benchmarks.common import format_table


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    m = doc["machine"]
    st = Settings.from_dict(s)
    lines = [
        f"machine: {m['cpu_model']}, {m['cpu_count']} cores, python {m['python']}, torch {m['torch_version']},"
        f" grpc {m['grpc_version']}; load average at start {m['load_average_at_start'][0]:.2f}",
        f"W4: students {' -> '.join(map(str, st.students))} for {' / '.join(f'{d:g}' for d in st.phases_s)} s;"
        f" teacher {st.teacher_ms:g} ms per batch of {st.batch} ({st.teacher_capacity:,.0f} samples/s),"
        f" student step {st.student_ms:g} ms ({st.student_rate:,.0f} samples/s)",
        f"oracle: ceil(n x {st.student_rate:,.0f} / {st.teacher_capacity:,.0f}) = "
        f"{' -> '.join(map(str, st.oracle))} teachers, {doc['summaries'][0]['oracle_teacher_seconds']:g} teacher-s;"
        f" fixed pool: {st.pool_size}",
        f"autoscaler: distill-autoscaler --backend local --target-utilisation {st.target_utilisation:g}"
        f" --busy-threshold {st.busy_threshold:g} --up-window {st.up_window_s:g} --down-window {st.down_window_s:g}"
        f" --period {st.period_s:g} --min {st.min_teachers} --max {st.max_teachers}",
        "",
    ]
    rows = []
    for x in doc["summaries"]:
        if x["mode"] != "autoscaled":
            continue
        for step in x["steps"]:
            label = f"r{x['rep']} phase {step['phase'] + 1}: {step['students']} student(s)"
            reach = step["reached_after_s"]
            goal = f"<= {GOAL_REACH_S:g} s"
            if step["direction"] == "down":
                goal = f"window {st.down_window_s:g} s + <= {GOAL_REACH_S:g}"
            rows.append([label, step["needed"], step["direction"], _num(step["decided_after_s"]), _num(reach),
                         goal, step["actions_to_reach"], step["overshoot"], step["flaps"],
                         step["ready_changes_when_steady"]])
    lines.append(format_table(["autoscaled step", "needed", "dir", "decided s", "reached s", "goal", "actions",
                               "overshoot", "flaps", "ready chg"], rows))
    lines.append("")
    rows = []
    for x in doc["summaries"]:
        rows.append([f"r{x['rep']} {x['mode']}", x["teacher_seconds"], x["teacher_seconds_vs_oracle"],
                     x["samples"], " / ".join(f"{v:,}" for v in x["samples_per_phase"]),
                     " / ".join(f"{v:.2f}" for v in x["stall_per_phase"]), x["measured_teacher_capacity"],
                     str(x["policy_sizing_with_measured_capacity"]), f"{x['cores_others_median']}"])
    lines.append(format_table(["run", "teacher-s", "vs oracle", "samples", "per phase", "stall per phase",
                               "capacity", "policy sizing", "others' cores"], rows))
    c = doc["comparison"]
    h, met = c["headline"], c["met"]

    def ok(key: str) -> str:
        return "met" if met[key] else "MISSED"

    startup = [v for x in doc["summaries"] if x["mode"] == "autoscaled" for v in x["teacher_startup_s"]]
    lines += [
        "",
        f"time to the needed count after the step up: {h['max_reach_up_s']:.1f} s (goal <= {GOAL_REACH_S:g} s:"
        f" {ok('reach_up_le_10s')}); teacher start-up (spawn -> registered): "
        + (", ".join(f"{v:.1f}" for v in startup) or "n/a") + " s",
        f"overshoot: {h['overshoot']} (goal 0: {ok('overshoot_0')});"
        f" flaps in steady phases: {h['flaps']} (goal 0: {ok('flaps_0')})",
        f"teacher-seconds: {h['teacher_seconds_vs_oracle']:.2f}x the oracle,"
        f" {h['teacher_seconds_vs_fixed']:.2f}x the fixed pool of {st.pool_size}",
        f"student samples vs the fixed pool: {h['throughput_vs_fixed']:.3f} (goal >= {GOAL_THROUGHPUT}:"
        f" {ok('throughput_ge_0.95')}); per phase "
        + " / ".join(f"{v:.3f}" for v in h["per_phase_vs_fixed"])
        + (f"; per rep {[p['throughput_vs_fixed'] for p in c['pairs']]}" if len(c["pairs"]) > 1 else ""),
    ]
    failures = {f"r{x['rep']} {x['mode']}": x["reader_failures"] for x in doc["summaries"]}
    lines.append(f"student reader failures seen by the training loops (must be 0): {failures}")
    errors = [e for x in doc["summaries"] for e in x["errors"]]
    if errors:
        lines.append("ERRORS: " + "; ".join(errors[:6]) + (f" (+{len(errors) - 6} more)" if len(errors) > 6 else ""))
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """Teachers (oracle, desired, registered, processes) and student throughput over time.

    The first repetition's autoscaled run, with the fixed pool's throughput for reference.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot"
    runs = doc["runs"]
    auto = next(r for r in runs if r["mode"] == "autoscaled")
    fixed = next((r for r in runs if r["mode"] == "fixed" and r["rep"] == auto["rep"]), None)
    st = doc["settings"]
    bounds = [0.0]
    for d in st["phases_s"]:
        bounds.append(bounds[-1] + d)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 2]})
    t = [row["t"] for row in auto["samples"]]
    needed_t = [bounds[0]]
    needed_v = [auto["samples"][0]["needed"] if auto["samples"] else 1]
    for k, b in enumerate(bounds[1:-1], start=1):
        needed_t.append(b)
        needed_v.append(_needed(st, k))
    needed_t.append(bounds[-1])
    needed_v.append(needed_v[-1])
    ax1.step(needed_t, needed_v, where="post", color="0.4", ls="--", lw=2, label="oracle (needed)")
    dt = [-5.0] + [d["t"] for d in auto["decisions"] if d["kind"] == "decision"] + [bounds[-1]]
    dv = [st["min_teachers"]]
    for d in auto["decisions"]:
        if d["kind"] == "decision":
            dv.append(d["desired"])
    dv.append(dv[-1])
    ax1.step(dt, dv, where="post", color="tab:orange", lw=2, label="desired (autoscaler)")
    ax1.step(t, [row["ready"] for row in auto["samples"]], where="post", color="tab:blue", lw=2,
             label="registered, ready")
    ax1.step(t, [row["processes"] for row in auto["samples"]], where="post", color="tab:blue", lw=1, ls=":",
             label="teacher processes (starting, draining)")
    if fixed is not None:
        ax1.step([row["t"] for row in fixed["samples"]], [row["ready"] for row in fixed["samples"]], where="post",
                 color="tab:green", lw=1, alpha=0.6, label="fixed pool")
    ax1.set_ylabel("teachers")
    ax1.set_ylim(0, max([*dv, *(row["processes"] for row in auto["samples"]), 3]) + 1)
    ax1.legend(loc="upper right", fontsize=8)
    ideal = [_students_at(st, x) * st["batch"] * 1000 / st["student_ms"] for x in t]
    ax2.plot(t, ideal, color="0.4", ls="--", lw=1.5, label="demand at full speed")
    if fixed is not None:
        ax2.plot([row["t"] for row in fixed["samples"]], [row["throughput"] for row in fixed["samples"]],
                 color="tab:green", lw=1.2, alpha=0.8, label="fixed pool")
    ax2.plot(t, [row["throughput"] for row in auto["samples"]], color="tab:blue", lw=1.5, label="autoscaled")
    ax2.set_ylabel("student samples/s (all students)")
    ax2.legend(loc="upper right", fontsize=8)
    stall = [_mean_stall(row) for row in auto["samples"]]
    ax3.plot(t, stall, color="tab:red", lw=1.2, label="students' stall fraction (autoscaled)")
    if fixed is not None:
        ax3.plot([row["t"] for row in fixed["samples"]], [_mean_stall(row) for row in fixed["samples"]],
                 color="tab:green", lw=1, alpha=0.7, label="stall (fixed pool)")
    ax3.plot(t, [row.get("as_teacher_busy_fraction", float("nan")) for row in auto["samples"]], color="tab:purple",
             lw=1, label="teacher busy (autoscaler's view)")
    ax3.set_ylim(0, 1.05)
    ax3.set_xlabel("seconds since the profile started")
    ax3.legend(loc="upper right", fontsize=8)
    for ax in (ax1, ax2, ax3):
        for b in bounds[1:-1]:
            ax.axvline(b, color="0.7", lw=1)
        ax.grid(alpha=0.3)
    h = doc["comparison"]["headline"]
    fig.suptitle(
        f"W4 autoscaling: students {' -> '.join(map(str, st['students']))}; to need {h['max_reach_up_s']:.1f} s,"
        f" overshoot {h['overshoot']}, flaps {h['flaps']}, teacher-s {h['teacher_seconds_vs_oracle']:.2f}x oracle,"
        f" throughput {h['throughput_vs_fixed']:.3f}x fixed pool", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _needed(st: dict[str, Any], k: int) -> int:
    s = Settings.from_dict(st)
    return s.needed(s.students[k])


def _students_at(st: dict[str, Any], t: float) -> int:
    acc = 0.0
    for n, d in zip(st["students"], st["phases_s"], strict=True):
        acc += d
        if t < acc:
            return int(n)
    return int(st["students"][-1])


def _mean_stall(row: dict[str, Any]) -> float:
    act = [p["stall"] for p in row["student"] if p["active"]]
    return statistics.fmean(act) if act else float("nan")


def columnar(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with each run's 0.5 s samples as columns (``timeline``) instead of rows.

    Rows repeat every key in every sample and the JSON is indented, which made the file ~0.7 MB;
    columns keep every number and are what a plotting script wants anyway.
    """
    out = dict(doc)
    runs = []
    for r in doc["runs"]:
        rows = r["samples"]
        keys = list(dict.fromkeys(k for row in rows for k in row if k != "student"))
        timeline: dict[str, Any] = {k: [row.get(k) for row in rows] for k in keys}
        n = max((len(row["student"]) for row in rows), default=0)
        timeline["student_samples_per_s"] = [[row["student"][i]["samples_per_s"] for row in rows] for i in range(n)]
        timeline["student_stall"] = [[row["student"][i]["stall"] for row in rows] for i in range(n)]
        timeline["student_active"] = [[int(row["student"][i]["active"]) for row in rows] for i in range(n)]
        runs.append({k: v for k, v in r.items() if k != "samples"} | {"timeline": timeline})
    out["runs"] = runs
    return out
