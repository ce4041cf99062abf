"""W1/W5 output: the text report of a mesh benchmark document, and whether it is correct."""

from __future__ import annotations

from typing import Any

from benchmarks.common import format_table, median


def ok(doc: dict[str, Any]) -> bool:
    """Correctness, not speed: no wrong outputs in W1; nothing lost, duplicated or reordered in W5."""
    w1, w5 = doc.get("w1", {}), doc.get("w5", {})
    return not w1.get("wrong_outputs") and not any(w5.get(k) for k in ("lost", "duplicated", "out_of_order",
                                                                        "wrong_outputs"))


def report(doc: dict[str, Any], redo_foreign_cores: float) -> str:
    s, m = doc["settings"], doc["machine"]
    lines = [f"machine: {m['cpu_model']}, {m['cpu_count']} cores, python {m['python']}, torch {m['torch_version']},"
             f" grpc {m['grpc_version']}"]
    if m.get("device"):  # results written before --device existed have none
        lines.append(f"device: {m['device']}{' (' + m['gpu'] + ')' if m.get('gpu') else ''}, "
                     f"compute dtype {m['compute_dtype']}")
    if "w1" in doc:
        lines += report_w1(s, doc["w1"], "w5" in doc, redo_foreign_cores)
    if "w5" in doc:
        lines += report_w5(s, doc["w5"])
    return "\n".join(lines)


def report_w1(s: dict[str, Any], w1: dict[str, Any], more: bool, redo_foreign_cores: float) -> list[str]:
    lines = [f"W1: batch {s['batch']}, teacher {s['teacher_ms']:g} ms/batch, student {s['student_ms']:g} ms/step,"
             f" {s['teachers']} teachers, {s['reps']} reps x {s['steps']} steps (+{s['warmup']} warm-up)", ""]
    rows = []
    for mode in ("pure", "inline", "service"):
        reps = w1["per_rep"][mode]
        rows.append([
            mode, w1["medians_samples_per_s"][mode], w1["ideal_samples_per_s"][mode],
            " ".join(f"{r['samples_per_s']:,.0f}" for r in reps),
            median([r["fetch_ms_mean"] for r in reps]), w1["median_cpu_cores"][mode]["client_cores"],
            w1["median_cpu_cores"][mode]["server_cores"], w1["median_cpu_cores"][mode]["foreign_cores"],
        ])
    lines.append(format_table(
        ["mode", "samples/s", "ideal", "per rep", "fetch ms/step", "our cores", "server cores", "other cores"], rows))
    r, g = w1["ratios"], w1["goals"]
    lines += [
        "",
        f"service / pure   = {r['service_vs_pure']:.3f}  (goal >= {g['service_vs_pure']}:"
        f" {'met' if w1['met']['service_vs_pure'] else 'MISSED'}; per rep {w1['per_rep_ratios']['service_vs_pure']})",
        f"service / inline = {r['service_vs_inline']:.3f}  (goal >= {g['service_vs_inline']}:"
        f" {'met' if w1['met']['service_vs_inline'] else 'MISSED'}; per rep "
        f"{w1['per_rep_ratios']['service_vs_inline']})",
        f"teacher outputs checked against the in-process model: {w1['outputs_checked']}, wrong: {w1['wrong_outputs']}",
        f"measurements redone because other processes took > {redo_foreign_cores} cores: "
        f"{sum(len(v) for v in w1['discarded'].values())} (kept in the JSON under 'discarded')",
    ]
    return [*lines, ""] if more else lines


def report_w5(s: dict[str, Any], w5: dict[str, Any]) -> list[str]:
    lines = [
        f"W5: {w5['teachers']} teachers, {w5['batches']} batches, {w5['signal']} to the teacher with work in flight"
        f" after batch {w5['kill_after_batch']} ({w5['victim_in_flight_at_kill']} chunk(s) there)",
    ]
    lines.append(format_table(["metric", "value", "goal"], [
        ["delivered", w5["delivered"], w5["batches"]],
        ["lost", w5["lost"], 0],
        ["duplicated", w5["duplicated"], 0],
        ["out of order", w5["out_of_order"], 0],
        ["wrong outputs", w5["wrong_outputs"], 0],
        ["longest gap ms", w5["longest_gap_ms"], f"<= {1000 * w5['stall_goal_s']:.0f}"],
        ["  before batch", w5["longest_gap_before_batch"], ""],
        ["longest gap after kill ms", w5["longest_gap_after_kill_ms"], ""],
        ["kill -> next batch ms", w5["kill_to_next_batch_ms"], ""],
        ["median gap ms", w5["median_gap_ms"], f"~{s['student_ms']:g}"],
        ["longest wait in next() ms", w5["longest_wait_in_next_ms"], ""],
        ["gaps > 4x median", len(w5["long_gaps"]), ""],
        ["retries", w5["reader"]["retries"], ""],
        ["victim exit code", w5["victim_exit_code"], -9],
    ]))
    lines.append(f"W5 {'met' if w5['met'] else 'MISSED'} (timeout {s['timeout_s']:g} s, hedge_after "
                 f"{s['hedge_after_s'] if s['hedge_after_s'] is not None else 'off'})")
    return lines
