"""Teacher-output cache (`distill.cache`): what training from a recorded store costs, what a store weighs,
and how fast `distill record` fills one.

    .venv/bin/python -m benchmarks.cache [--reps 5] [--quick] [--teachers 2]

Three questions, each answered with real teacher-server processes on loopback:

  loop     W1's setting (benchmarks/mesh.py: batch 256, emulated teacher 20 ms/batch on 2 teachers,
           student step 25 ms, examples/emulated.py). The same training loop runs, interleaved per
           repetition, as
             pure   loader + student step, no teacher (the ceiling);
             store  a DistillReader reading a fully recorded store (cache_mode="read", no teachers);
             live   a DistillReader over the 2 live teachers (W1's "service" mode).
           Headlines: store / pure (goal >= 0.98: the cache costs the loop nothing) and store / live.
  bytes    Store bytes per sample for the CV example's teacher (examples/cv: 10 classes, full logits
           in fp16) and per token for an LLM teacher (examples/llm's Llama, served as hf:DIR, top-20
           values fp16 + ids int32), both recorded through `distill.cache.record` from a served teacher.
           The bytes do not depend on the weights, so both teachers are freshly initialised.
  record   `distill.cache.record` samples/s against the same teachers' serving throughput: a reader
           without a store drained as fast as it goes (no student step), interleaved per repetition,
           a fresh store per recording (goal >= 0.9).
  integrity  What the store's checksums cost, in-process, no servers: a store of top-32 bf16 values
           and uint16 ids (1 to 63 tokens per sample) written in appends of 256 samples (MB/s, each
           append hashed), then read in order through lookups of 256 keys on a fresh instance, each
           lookup's outputs copied as a consumer would (the first pass verifies each record it
           touches and faults the mapped pages in; the second reads verified records), and
           `store.verify()` over the whole store. `--integrity-only` runs just this section, so the
           same code can time a tree without checksums.

Every ratio is the median of per-repetition paired ratios; a quiet gate waits (boundedly) for
other processes to leave the cores alone before each measurement, as in benchmarks/mesh.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    REPO_ROOT,
    format_table,
    interleave,
    machine_info,
    median,
    paired_ratios,
    run_and_report,
)
from benchmarks.cpu import QuietGate
from benchmarks.mesh import Rep, count_mismatches, pure_batches, server_args, server_env, service_batches, timed_loop
from benchmarks.mesh import Settings as MeshSettings
from distill import DistillReader
from distill.cache import TeacherOutputStore, record
from examples.emulated import BATCH, W1Loader, build
from teacher_server.launch import TeacherProcess, start_all

GOAL_STORE_VS_PURE = 0.98
GOAL_RECORD_VS_SERVING = 0.9
REDO_FOREIGN_CORES = 0.5


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON."""

    reps: int = 5
    warmup: int = 10
    steps: int = 60
    batch: int = BATCH
    teacher_ms: float = 20.0
    student_ms: float = 25.0
    teachers: int = 2
    prefetch: int = 4
    record_batches: int = 120  # batches per recording / serving measurement
    llm_sequences: int = 256
    llm_batch: int = 8
    llm_lengths: tuple[int, ...] = (32, 64, 96, 128)  # each batch one length (a length-grouped sampler)
    llm_vocab: int = 4096
    llm_top_k: int = 20
    integrity_samples: int = 20_000
    quiet_budget_s: float = 30.0
    quick: bool = False
    integrity_only: bool = False


class KeyedW1Loader:
    """W1's loader with a per-sample key field: batch i holds samples i*B .. i*B+B-1."""

    def __init__(self, loader: W1Loader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        b = self.loader.batch_size
        for batch in self.loader:
            i = batch["index"]
            yield {**batch, "key": torch.arange(i * b, (i + 1) * b)}


def _mesh_settings(s: Settings) -> MeshSettings:
    return MeshSettings(reps=s.reps, warmup=s.warmup, steps=s.steps, batch=s.batch, teacher_ms=s.teacher_ms,
                        student_ms=s.student_ms, teachers=s.teachers, prefetch=s.prefetch)


# ---- the training loop: pure / from the store / live teachers --------------------------------------------------
def run_loop(s: Settings, stack: contextlib.ExitStack, gate: QuietGate, *, pids: list[int], endpoints: list[str],
             work: Path) -> dict[str, Any]:
    ms = _mesh_settings(s)
    base = W1Loader(s.warmup + s.steps, batch_size=s.batch)
    loader = KeyedW1Loader(base)
    reference = build(step_ms=0)
    with torch.inference_mode():
        pool_logits = [reference.logits(base.inputs(i)) for i in range(4)]

    store_path = work / "w1-store"
    recorded = record(loader, cache=store_path, teachers=",".join(endpoints), inputs=["INPUT"], outputs=["LOGITS"],
                      key="key", prefetch=s.prefetch, progress=False)
    print(f"  recorded the W1 epoch: {recorded.summary(str(store_path))}", flush=True)

    store_reader = stack.enter_context(DistillReader(
        loader, inputs=["INPUT"], outputs=["LOGITS"], cache=str(store_path), cache_mode="read", key="key",
        prefetch=s.prefetch))
    live_reader = stack.enter_context(DistillReader(
        loader, teachers=",".join(endpoints), inputs=["INPUT"], outputs=["LOGITS"], prefetch=s.prefetch))
    wrong = {"store": 0, "live": 0}
    checked = {"store": 0, "live": 0}

    def through(name: str, reader: DistillReader) -> Rep:
        rep, seen = timed_loop(name, ms, service_batches(reader), pids)
        bad = count_mismatches(seen, lambda index: pool_logits[index % 4])
        wrong[name] += bad
        checked[name] += len(seen)
        stats = reader.stats()
        rep.extra = {"wrong_outputs": bad, "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses}
        return rep

    def show(rep: int, name: str, r: Rep) -> None:
        print(f"  rep {rep + 1}/{s.reps} {name:6s} {r.samples_per_s:9,.0f} samples/s  fetch {r.fetch_ms_mean:6.2f} ms"
              f"  cores: ours {r.cpu.client_cores:.2f} servers {r.cpu.server_cores:.2f}"
              f" others {r.cpu.foreign_cores:.2f}", flush=True)

    discarded: dict[str, list[Rep]] = {}
    reps = interleave(
        s.reps, {"pure": lambda: timed_loop("pure", ms, pure_batches(base), pids)[0],
                 "store": lambda: through("store", store_reader), "live": lambda: through("live", live_reader)},
        # A smoke run's figures are not compared with anything: no redo of a disturbed measurement.
        show, before=gate.wait_blocking,
        redo_if=None if s.quick else lambda r: r.cpu.foreign_cores > REDO_FOREIGN_CORES,
        discarded=discarded)
    rates = {m: [r.samples_per_s for r in rs] for m, rs in reps.items()}
    store_vs_pure = paired_ratios(rates["store"], rates["pure"])
    store_vs_live = paired_ratios(rates["store"], rates["live"])
    live_vs_pure = paired_ratios(rates["live"], rates["pure"])
    return {
        "medians_samples_per_s": {m: round(median(v), 1) for m, v in rates.items()},
        "ideal_samples_per_s": round(s.batch * 1000 / s.student_ms, 1),
        "ratios": {"store_vs_pure": round(median(store_vs_pure), 4), "store_vs_live": round(median(store_vs_live), 4),
                   "live_vs_pure": round(median(live_vs_pure), 4)},
        "per_rep_ratios": {"store_vs_pure": [round(x, 4) for x in store_vs_pure],
                           "store_vs_live": [round(x, 4) for x in store_vs_live]},
        "goal_store_vs_pure": GOAL_STORE_VS_PURE, "met": median(store_vs_pure) >= GOAL_STORE_VS_PURE,
        "wrong_outputs": wrong, "outputs_checked": checked,
        "store": TeacherOutputStore.open(store_path).info().to_dict() | {"shards": "omitted"},
        "per_rep": {m: [r.as_dict() for r in rs] for m, rs in reps.items()},
        "discarded": {m: [r.as_dict() for r in rs] for m, rs in discarded.items()},
    }


# ---- record throughput vs serving throughput --------------------------------------------------------------------
def run_record(s: Settings, gate: QuietGate, endpoints: list[str], work: Path) -> dict[str, Any]:
    loader = KeyedW1Loader(W1Loader(s.record_batches, batch_size=s.batch))
    samples = s.record_batches * s.batch
    counter = iter(range(1_000_000))

    def serving() -> float:
        reader = DistillReader(loader, teachers=",".join(endpoints), inputs=["INPUT"], outputs=["LOGITS"],
                               prefetch=s.prefetch)
        started = time.perf_counter()
        n = 0
        with reader:
            for batch, _ in reader:
                n += len(batch["key"])
        elapsed = time.perf_counter() - started
        assert n == samples, f"served {n} of {samples} samples"
        return n / elapsed

    def recording() -> float:
        path = work / f"record-{next(counter)}"
        result = record(loader, cache=path, teachers=",".join(endpoints), inputs=["INPUT"], outputs=["LOGITS"],
                        key="key", prefetch=s.prefetch, progress=False)
        assert result.new_samples == samples, result
        shutil.rmtree(path)
        return result.samples_per_s

    def show(rep: int, name: str, rate: float) -> None:
        print(f"  rep {rep + 1}/{s.reps} {name:9s} {rate:9,.0f} samples/s", flush=True)

    reps = interleave(s.reps, {"serving": serving, "recording": recording}, show, before=gate.wait_blocking)
    ratios = paired_ratios(reps["recording"], reps["serving"])
    return {
        "batches": s.record_batches, "samples": samples,
        "medians_samples_per_s": {m: round(median(v), 1) for m, v in reps.items()},
        "per_rep_samples_per_s": {m: [round(x, 1) for x in v] for m, v in reps.items()},
        "record_vs_serving": round(median(ratios), 4), "per_rep_ratios": [round(x, 4) for x in ratios],
        "goal": GOAL_RECORD_VS_SERVING, "met": median(ratios) >= GOAL_RECORD_VS_SERVING,
    }


# ---- store bytes: the CV example (full logits fp16), an LLM (top-20) -------------------------------------------
def _info(path: Path) -> dict[str, Any]:
    with TeacherOutputStore.open(path) as store:
        info = store.info()
    return {"samples": info.samples, "bytes": info.bytes, "tokens": info.tokens,
            "bytes_per_sample": round(info.bytes_per_sample or 0.0, 2),
            "bytes_per_token": round(info.bytes_per_token, 2) if info.bytes_per_token else None,
            "outputs": {o.name: o.describe() for o in info.outputs}}


def run_cv_bytes(stack: contextlib.ExitStack, work: Path) -> dict[str, Any]:
    from examples.cv.data import load

    digits = load()
    x = digits.train_x
    batches = [{"INPUT": x[i:i + 64], "index": torch.arange(i, min(i + 64, len(x)))} for i in range(0, len(x), 64)]
    [server] = start_all(stack, [TeacherProcess(
        ["--model", "examples.cv.models:TeacherCNN", "--name", "cv_teacher", "--device", "cpu", "--port", "0",
         "--instances", "1", "--threads", "1", "--log-level", "WARNING"], label="cv-teacher", cwd=REPO_ROOT)])
    path = work / "cv-store"
    result = record(batches, cache=path, teachers=server.endpoint, inputs=["INPUT"], outputs=["LOGITS"],
                    key="index", output_dtype="FP16", progress=False)
    return {"teacher": "examples/cv TeacherCNN (10 classes), full logits, output_dtype FP16",
            "recorded_samples_per_s": round(result.samples_per_s, 1)} | _info(path)


def run_llm_bytes(s: Settings, stack: contextlib.ExitStack, work: Path) -> dict[str, Any]:
    from examples.llm.models import build as build_llm

    model_dir = work / "llm-teacher"
    torch.manual_seed(0)
    build_llm("teacher-smoke", s.llm_vocab, pad_token_id=0).eval().save_pretrained(str(model_dir))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for b in range(s.llm_sequences // s.llm_batch):
        length = s.llm_lengths[b % len(s.llm_lengths)]
        ids = torch.randint(1, s.llm_vocab, (s.llm_batch, length), generator=gen)
        batches.append({"INPUT_IDS": ids, "ATTENTION_MASK": torch.ones_like(ids),
                        "index": torch.arange(b * s.llm_batch, (b + 1) * s.llm_batch)})
    [server] = start_all(stack, [TeacherProcess(
        ["--model", f"hf:{model_dir}", "--name", "llm", "--device", "cpu", "--port", "0", "--instances", "1",
         "--log-level", "WARNING"], label="llm-teacher", cwd=REPO_ROOT)])
    path = work / "llm-store"
    result = record(batches, cache=path, teachers=server.endpoint, inputs=["INPUT_IDS", "ATTENTION_MASK"],
                    outputs=["LOGITS"], key="index", top_k=s.llm_top_k, output_dtype="FP16", progress=False)
    tokens = sum(b["INPUT_IDS"].numel() for b in batches)
    return {"teacher": f"examples/llm Llama (teacher-smoke, vocab {s.llm_vocab}) as hf:DIR, top-{s.llm_top_k}, "
                       "values FP16, ids as the teacher sends them (int32)",
            "sequence_lengths": list(s.llm_lengths), "tokens_sent": tokens,
            "recorded_samples_per_s": round(result.samples_per_s, 1)} | _info(path)


# ---- checksums: write, first (verifying) and second read pass, verify() ----------------------------------------
def run_integrity(s: Settings, gate: QuietGate, work: Path) -> dict[str, Any]:
    from distill.cache import Namespace, Ragged

    ns = Namespace("bench", model_version="1", outputs=("VALUES", "IDS"), dtype="bfloat16", top_k=32)
    gen = torch.Generator().manual_seed(0)
    batch = 256
    appends = []
    for start in range(0, s.integrity_samples, batch):
        keys = torch.arange(start, min(start + batch, s.integrity_samples))
        lengths = torch.randint(1, 64, (len(keys),), generator=gen)
        tokens = int(lengths.sum())
        appends.append((keys, {"VALUES": Ragged(torch.randn(tokens, 32, generator=gen).to(torch.bfloat16), lengths),
                               "IDS": Ragged(torch.randint(0, 50_000, (tokens, 32), generator=gen)
                                             .to(torch.uint16), lengths)}))
    per_rep: dict[str, list[float]] = {"write": [], "first_pass": [], "second_pass": [], "verify": []}
    nbytes = 0
    for rep in range(s.reps):
        path = work / f"integrity-{rep}"
        gate.wait_blocking()
        started = time.perf_counter()
        with TeacherOutputStore.open(path, ns, mode="a") as store, store.writer() as w:
            for keys, outputs in appends:
                w.append(keys, outputs)
        per_rep["write"].append(time.perf_counter() - started)
        with TeacherOutputStore.open(path) as store:
            nbytes = store.info().bytes
            for name in ("first_pass", "second_pass"):
                started = time.perf_counter()
                for keys, _ in appends:
                    found = store.lookup(keys)
                    assert found.all_hit
                    for output in ("VALUES", "IDS"):  # a consumer's copy: reads every page the lookup mapped
                        found.ragged(output).values.clone()
                per_rep[name].append(time.perf_counter() - started)
        if hasattr(TeacherOutputStore, "verify"):  # only a store with checksums has verify()
            with TeacherOutputStore.open(path) as store:
                started = time.perf_counter()
                assert store.verify().ok
                per_rep["verify"].append(time.perf_counter() - started)
        shutil.rmtree(path)
        print(f"  rep {rep + 1}/{s.reps} " + "  ".join(f"{k} {v[-1] * 1e3:7.1f} ms" for k, v in per_rep.items() if v),
              flush=True)
    mb = nbytes / 1e6
    return {
        "samples": s.integrity_samples, "appends": len(appends), "store_bytes": nbytes,
        "median_s": {k: round(median(v), 4) for k, v in per_rep.items() if v},
        "median_mb_per_s": {k: round(mb / median(v), 1) for k, v in per_rep.items() if v},
        "per_rep_s": {k: [round(x, 4) for x in v] for k, v in per_rep.items()},
    }


# ---- the run ----------------------------------------------------------------------------------------------------
def run_serving_parts(s: Settings, gate: QuietGate, work: Path, doc: dict[str, Any]) -> None:
    """The loop, record and bytes sections, each with the teachers it needs; results into `doc`."""
    with contextlib.ExitStack() as stack:
        ms = _mesh_settings(s)
        servers = start_all(stack, [TeacherProcess(server_args(ms), label=f"w1-teacher-{i}", env=server_env(ms),
                                                  cwd=REPO_ROOT, stop_grace=20.0) for i in range(s.teachers)])
        endpoints = [p.endpoint for p in servers]
        pids = [p.pid for p in servers]
        gate.own_pids = [os.getpid(), *pids]
        print("loop: pure / from the store / live teachers (W1 setting)", flush=True)
        doc["loop"] = run_loop(s, stack, gate, pids=pids, endpoints=endpoints, work=work)
        print("record vs serving throughput", flush=True)
        doc["record"] = run_record(s, gate, endpoints, work)
    with contextlib.ExitStack() as stack:
        print("store bytes: CV example", flush=True)
        doc["cv_bytes"] = run_cv_bytes(stack, work)
    with contextlib.ExitStack() as stack:
        print("store bytes: LLM top-k", flush=True)
        doc["llm_bytes"] = run_llm_bytes(s, stack, work)


def run(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(1)
    gate = QuietGate(max_foreign_cores=0.25, budget_s=s.quiet_budget_s)
    doc: dict[str, Any] = {"benchmark": "cache (teacher-output store: loop, bytes, record, integrity)",
                           "machine": machine_info(1), "settings": asdict(s)}
    work = Path(tempfile.mkdtemp(prefix="distill-cache-bench-"))
    try:
        if not s.integrity_only:
            run_serving_parts(s, gate, work, doc)
        print("checksums: write, read passes, verify()", flush=True)
        doc["integrity"] = run_integrity(s, gate, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["quiet_gate"] = gate.as_dict()
    return doc


def _integrity_report(doc: dict[str, Any]) -> str:
    i = doc["integrity"]
    rates = i["median_mb_per_s"]
    return (f"integrity ({i['samples']:,} samples in {i['appends']} appends, {i['store_bytes'] / 1e6:.1f} MB): "
            + ", ".join(f"{k.replace('_', ' ')} {i['median_s'][k] * 1e3:.1f} ms ({rates[k]:,.0f} MB/s)"
                        for k in i["median_s"]))


def report(doc: dict[str, Any]) -> str:
    if "loop" not in doc:  # --integrity-only
        return _integrity_report(doc)
    s, loop, rec = doc["settings"], doc["loop"], doc["record"]
    cv, llm = doc["cv_bytes"], doc["llm_bytes"]
    lines = [f"W1 setting: batch {s['batch']}, teacher {s['teacher_ms']:g} ms, student {s['student_ms']:g} ms, "
             f"{s['teachers']} teachers, {s['reps']} reps x {s['steps']} steps" + (" (QUICK)" if s["quick"] else "")]
    med = loop["medians_samples_per_s"]
    lines.append(format_table(["mode", "samples/s (median)"], [[m, med[m]] for m in ("pure", "store", "live")]))
    r = loop["ratios"]
    lines.append(f"store / pure {r['store_vs_pure']:.3f} (goal >= {GOAL_STORE_VS_PURE}), store / live "
                 f"{r['store_vs_live']:.3f}, live / pure {r['live_vs_pure']:.3f}; "
                 f"wrong outputs {loop['wrong_outputs']}")
    lines.append(f"record {rec['medians_samples_per_s']['recording']:,.0f} samples/s vs serving "
                 f"{rec['medians_samples_per_s']['serving']:,.0f}: {rec['record_vs_serving']:.3f} "
                 f"(goal >= {GOAL_RECORD_VS_SERVING})")
    lines.append(f"CV store: {cv['bytes_per_sample']:.1f} B/sample ({cv['samples']} samples, {cv['outputs']})")
    lines.append(f"LLM store: {llm['bytes_per_token']:.1f} B/token ({llm['tokens']} tokens, {llm['outputs']})")
    lines.append(_integrity_report(doc))
    return "\n".join(lines)


def ok(doc: dict[str, Any]) -> bool:
    """Correctness, not speed: the store and the live teachers gave the in-process model's outputs."""
    return "loop" not in doc or not any(doc["loop"]["wrong_outputs"].values())


def parse_args(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per loop repetition (default 60)")
    p.add_argument("--teachers", type=int, default=None, help="live teacher servers of the loop and record "
                   "sections (default 2, W1's)")
    p.add_argument("--quick", action="store_true", help="a smoke run (2 reps, short epochs, small stores)")
    p.add_argument("--integrity-only", action="store_true", help="only the checksums' cost (no servers)")
    a = p.parse_args(argv)
    s = Settings(integrity_only=a.integrity_only)
    if a.quick:
        # llm_sequences: one batch of each length; quiet_budget_s 0: one probe per measurement, no waiting
        s = replace(s, reps=2, warmup=5, steps=20, record_batches=30, llm_sequences=32, integrity_samples=5_000,
                    quiet_budget_s=0.0, quick=True)
    if a.reps is not None:
        s = replace(s, reps=a.reps)
    if a.steps is not None:
        s = replace(s, steps=a.steps)
    if a.teachers is not None:
        s = replace(s, teachers=a.teachers)
    if s.reps < 1 or s.steps < 1 or s.teachers < 1:
        p.error("--reps, --steps and --teachers must be >= 1")
    return s


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    name = ("cache_integrity" if s.integrity_only else "cache") + ("_quick" if s.quick else "")
    return run_and_report(lambda: run(s), name, report, ok)


if __name__ == "__main__":
    sys.exit(main())
