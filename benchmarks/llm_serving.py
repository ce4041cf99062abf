"""W6 LLM teacher serving (docs/design/workloads.md, "W6: LLM teacher serving").

    .venv/bin/python -m benchmarks.llm_serving [--reps 5] [--quick] [--tiny] [--teacher DIR] [--mode reader]
                                               [--device cuda:0 --compute-dtype BF16]
                                               [--server-arg=--no-async-outputs]

`--mode reader` measures the reader path instead: `DistillReader` with the student's padded
batches in loader order against the same server fed one sequence per request
(benchmarks/llm_reader.py).

The teacher is the LLM example's causal LM (examples/llm; the trained one in the cache, else the
smoke one, trained here in seconds; or `--teacher DIR`), served with `--model hf:DIR`. The
sequences are drawn from the corpus's held-out split with a fixed seed: a random held-out piece,
cut to a length drawn uniformly from [--min-len, the model's context], so lengths are mixed.

Per repetition, interleaved, each variant processes the same sequences once:
  * in-process: `model(input_ids=..., attention_mask=...)` over batches of --batch sequences in
    the drawn order, padded per batch, plus the server's output work on the result (log-softmax,
    top-k values in fp16 and int32 ids, the tail mass): what a user running the teacher does;
  * server, length buckets on / off: one sequence per request from --clients concurrent clients
    over raw gRPC, top-k log-probs in fp16 with the tail asked for by request parameters; the
    batcher forms the batches (--max-batch-size = --batch);
  * with --alt-server-arg FLAG, a third server with FLAG added: an A/B of a server setting in one run.
Headlines: server / in-process useful tokens per second (goal >= 0.90), padding efficiency
(useful / computed positions, from the server's `teacher_useful_tokens_total` and
`teacher_padded_tokens_total` metrics) with buckets (goal >= 0.85) and without, and bytes per token
on the wire from the responses' raw output contents (goal <= 130), beside the full-vocabulary fp32
figure measured from one request that asks for the raw logits.

On CUDA (`--device`, benchmarks/device.py) the in-process baseline is the best plain PyTorch
instead: the same sequences sorted by length, in batches filling the server's token budget
(--batch x 64 positions, the server's default), weights in --compute-dtype, inputs on the GPU.

The same CPU budget on both sides: the server runs --instances instances x --threads torch threads
(teacher-server's CPU default: one instance per core, one thread each) and the in-process baseline
runs the same number of model loops on their own threads with the same torch thread count, pulling
batches from one shared list. The quiet gate, redo and "quiet pairs" rules are those of
benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2_grpc

from benchmarks.common import (
    BATCHING_QUEUE_DELAY_US,
    REPO_ROOT,
    ainterleave,
    format_table,
    machine_info,
    median,
    paired_ratios,
    redo_when_loaded,
    run_and_report,
)
from benchmarks.cpu import QuietGate
from benchmarks.device import add_device_args
from benchmarks.llm_parts import (
    BYTES_GOAL,
    MAX_MESSAGE,
    MIN_QUIET_PAIRS,
    PADDING_GOAL,
    RATIO_GOAL,
    Measurement,
    Settings,
    make_request,
    measure_inprocess,
    measure_server,
    on_device,
    output_work,
    padded_batches,
    prepare,
    print_rep,
    server_args,
    sorted_batches,
)
from teacher_server.launch import TeacherProcess


async def check_outputs(stub: Any, model: torch.nn.Module, seq: list[int], k: int) -> float:
    """The server's top-k log-probs must be the in-process model's; returns the max |diff|."""
    resp = await stub.ModelInfer(make_request(seq, top_k=k), timeout=60)
    got = {o.name: raw for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
    values = np.frombuffer(got["LOGITS_TOPK_VALUES"], dtype=np.float16).reshape(len(seq), k)
    with torch.inference_mode():
        ids = torch.tensor([seq], device=next(model.parameters()).device)
        want, _, _ = output_work(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, k)
    diff = float(np.abs(values.astype(np.float32) - want[0].float().cpu().numpy()).max())
    if diff > (2e-2 if next(model.parameters()).dtype == torch.float32 else 1e-1):
        raise AssertionError(f"server top-{k} log-probs differ from the in-process model by up to {diff}")
    return diff


async def full_vocab_bytes(stub: Any, seq: list[int], vocab: int) -> float:
    """Bytes per token of the raw fp32 logits (no transform), measured from one response: of `seq`
    cut to what fits a 64 MiB message (a 1,024-token answer at a 152k vocabulary is 600 MiB)."""
    seq = seq[: max(1, (64 << 20) // (4 * vocab))]
    resp = await stub.ModelInfer(make_request(seq, top_k=0, logprobs=False, dtype="FP32", tail=False), timeout=60)
    return sum(len(c) for c in resp.raw_output_contents) / len(seq)


# ---- the run ---------------------------------------------------------------------------------
async def run(s: Settings) -> dict[str, Any]:
    w = prepare(s)
    directory, max_len, vocab, seqs, pad_id, model = w.directory, w.max_len, w.vocab, w.seqs, w.pad_id, w.model
    lengths = w.lengths
    baseline = sorted_batches(seqs, s.token_budget, pad_id) if s.choice.cuda else padded_batches(seqs, s.batch, pad_id)
    batches = on_device(baseline, s.choice)
    requests = [make_request(q, top_k=s.top_k) for q in seqs]

    with contextlib.ExitStack() as stack:
        kinds: list[tuple[str, bool, Sequence[str]]] = [("server_buckets", True, ())]
        if s.buckets_off:
            kinds.append(("server_no_buckets", False, ()))
        if s.alt_server_args:
            kinds.append(("server_alt", True, s.alt_server_args))
        servers = {
            name: stack.enter_context(TeacherProcess(server_args(s, directory, pad_id, vocab, buckets, extra=extra),
                                                     label=name, cwd=REPO_ROOT, stop_grace=20.0))
            for name, buckets, extra in kinds
        }
        pids = [p.pid for p in servers.values()]
        chans = {k: grpc.aio.insecure_channel(p.endpoint, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.use_local_subchannel_pool", 1)]) for k, p in servers.items()}
        try:
            stubs = {k: service_pb2_grpc.GRPCInferenceServiceStub(c) for k, c in chans.items()}
            longest = max(seqs, key=len)
            for k in servers:
                diff = await check_outputs(stubs[k], model, longest, s.top_k)
                print(f"{k}: top-{s.top_k} log-probs match the in-process model (max |diff| {diff:.1e})", flush=True)
            full_bytes = await full_vocab_bytes(stubs["server_buckets"], longest, vocab)
            # Warm-up: a few batches each, so no variant pays first-call costs inside a repetition.
            warm = min(len(seqs), 4 * s.batch)
            measure_inprocess(model, batches[: max(1, warm // s.batch)], s.top_k, s.server_instances, pids)
            for k, p in servers.items():
                await measure_server(stubs[k], requests[:warm], lengths[:warm], clients=s.concurrency,
                                     metrics_port=int(p.ready["metrics_port"]), server_pids=pids)

            async def inprocess() -> Measurement:
                # Blocks the event loop on purpose: nothing else may run while the baseline does.
                return measure_inprocess(model, batches, s.top_k, s.server_instances, pids)

            def served(k: str) -> Callable[[], Awaitable[Measurement]]:
                port = int(servers[k].ready["metrics_port"])
                return lambda: measure_server(stubs[k], requests, lengths, clients=s.concurrency, metrics_port=port,
                                              server_pids=pids, server_pid=servers[k].pid)

            variants: dict[str, Callable[[], Awaitable[Measurement]]] = {
                "inprocess": inprocess} | {k: served(k) for k in servers}
            gate = QuietGate(pids, max_foreign_cores=s.max_foreign_cores, budget_s=s.gate_budget_s)
            contaminated = redo_when_loaded(s.max_foreign_cores, s.max_redos)

            discarded: dict[str, list[Measurement]] = {}
            per_rep = await ainterleave(s.reps, variants, print_rep,
                                        before=gate.wait if s.max_foreign_cores > 0 else None,
                                        redo_if=contaminated, discarded=discarded)
        finally:
            for c in chans.values():
                await c.close()
        exit_codes = {k: p.stop() for k, p in servers.items()}

    doc = summarise(s, per_rep, exit_codes, full_bytes)
    doc["teacher"] = {"directory": str(directory), "vocab_size": vocab, "context": max_len,
                      "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
    doc["sequences"] = {"count": len(seqs), "tokens": sum(lengths), "min_len": min(lengths),
                        "max_len": max(lengths), "mean_len": round(sum(lengths) / len(lengths), 2)}
    doc["quiet_gate"] = gate.as_dict()
    doc["discarded"] = {k: [m.as_dict() for m in v] for k, v in discarded.items()}
    return doc


def summarise(s: Settings, per_rep: dict[str, list[Measurement]], exit_codes: dict[str, int | None],
              full_bytes: float) -> dict[str, Any]:
    """Medians, paired ratios (quiet pairs when there are enough), padding and wire figures."""
    limit = s.max_foreign_cores if s.max_foreign_cores > 0 else float("inf")

    def quiet(m: Measurement) -> bool:
        return m.cpu is None or m.cpu.foreign_cores <= limit

    def med(k: str) -> float:
        q = [m.tokens_per_s for m in per_rep[k] if quiet(m)]
        return median(q) if len(q) >= MIN_QUIET_PAIRS else median([m.tokens_per_s for m in per_rep[k]])

    def ratio_of(num: str, den: str, goal: float) -> dict[str, Any]:
        paired = paired_ratios([m.tokens_per_s for m in per_rep[num]], [m.tokens_per_s for m in per_rep[den]])
        clean = [r for r, a, b in zip(paired, per_rep[num], per_rep[den], strict=True) if quiet(a) and quiet(b)]
        trusted = len(clean) >= MIN_QUIET_PAIRS
        headline = median(clean) if trusted else median(paired)
        return {"headline": headline, "quiet_pairs": len(clean), "pairs": len(paired), "trusted": trusted,
                "per_rep": [round(r, 4) for r in paired], "goal": goal,
                "verdict": ("PASS" if headline >= goal else "below goal") if trusted else (
                    "smoke test only" if s.quick else f"noisy: fewer than {MIN_QUIET_PAIRS} quiet pairs")}

    def padding(k: str) -> float:
        return median([m.padding_efficiency for m in per_rep[k] if m.padding_efficiency is not None])

    useful = per_rep["server_buckets"][0].useful_tokens
    wire = median([m.wire_bytes / m.useful_tokens for m in per_rep["server_buckets"] if m.wire_bytes])
    pad_buckets = padding("server_buckets")
    off = "server_no_buckets" in per_rep
    return {
        "benchmark": "llm_serving (W6)",
        "machine": machine_info(s.server_threads) | s.choice.info() | {
            "inprocess_baseline": (f"length-sorted batches of at most {s.token_budget} positions" if s.choice.cuda
                                   else f"padded batches of {s.batch} in drawn order"),
            "inprocess_loops": s.server_instances, "server_instances": s.server_instances,
            "server_torch_threads": s.server_threads},
        "settings": asdict(s) | {"clients": s.concurrency},
        "medians_tokens_per_s": {k: round(med(k), 1) for k in per_rep},
        "ratios": {"server_buckets_over_inprocess": ratio_of("server_buckets", "inprocess", RATIO_GOAL)} | ({
            "server_no_buckets_over_inprocess": ratio_of("server_no_buckets", "inprocess", 0.0),
            "buckets_over_no_buckets": ratio_of("server_buckets", "server_no_buckets", 0.0),
        } if off else {}) | ({
            "server_over_server_alt": ratio_of("server_buckets", "server_alt", 0.0),
            "server_alt_over_inprocess": ratio_of("server_alt", "inprocess", 0.0),
        } if "server_alt" in per_rep else {}),
        "padding_efficiency": {
            "inprocess": padding("inprocess"), "server_buckets": pad_buckets}
        | ({"server_no_buckets": padding("server_no_buckets")} if off else {})
        | ({"server_alt": padding("server_alt")} if "server_alt" in per_rep else {}) | {"goal": PADDING_GOAL,
            "verdict": "PASS" if pad_buckets >= PADDING_GOAL else "below goal"},
        "wire_bytes_per_token": {
            f"top{s.top_k}_fp16_tail": round(wire, 2), "full_vocab_fp32": round(full_bytes, 2), "goal": BYTES_GOAL,
            "verdict": "PASS" if wire <= BYTES_GOAL else "above goal", "useful_tokens_per_pass": useful},
        "quiet_reps": {k: sum(quiet(m) for m in v) for k, v in per_rep.items()},
        "per_rep": {k: [m.as_dict() | {"quiet": quiet(m)} for m in v] for k, v in per_rep.items()},
        "server_exit_codes": exit_codes,
    }


def report(doc: dict[str, Any]) -> str:
    med, pad, r = doc["medians_tokens_per_s"], doc["padding_efficiency"], doc["ratios"]
    alt = " ".join(doc["settings"].get("alt_server_args") or ())
    labels = {"inprocess": "in-process model(**batch) + top-k", "server_buckets": "server, length buckets on",
              "server_no_buckets": "server, length buckets off", "server_alt": f"server with {alt}"}
    rows = [[label, med[k], pad[k], ", ".join(f"{m['tokens_per_s']:,.0f}{'' if m['quiet'] else '*'}"
                                               for m in doc["per_rep"][k])] for k, label in labels.items() if k in med]
    out = [format_table(["variant", "tokens/s", "padding eff.", "per repetition (* = disturbed)"], rows), ""]
    rrows = [[k, v["headline"], v["goal"] or "", f"{v['quiet_pairs']}/{v['pairs']}", v["verdict"] if v["goal"] else ""]
             for k, v in r.items()]
    out.append(format_table(["ratio", "median", "goal", "quiet pairs", "verdict"], rrows))
    w = doc["wire_bytes_per_token"]
    k = doc["settings"]["top_k"]
    out += ["", f"padding efficiency with buckets {pad['server_buckets']:.3f} (goal {PADDING_GOAL}): {pad['verdict']}",
            f"wire bytes per token: top-{k} fp16 + tail {w[f'top{k}_fp16_tail']:.1f} (goal <= {BYTES_GOAL:.0f}: "
            f"{w['verdict']}); full vocabulary fp32 {w['full_vocab_fp32']:,.0f}"]
    m = doc["machine"]
    out.append(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs; layout: server {m['server_instances']} instance(s) "
               f"x {m['server_torch_threads']} thread(s), in-process {m['inprocess_loops']} loop(s) x the same threads")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="few sequences and repetitions: a smoke test")
    p.add_argument("--tiny", action="store_true", help="the smoke teacher (trained here if missing) and corpus")
    p.add_argument("--teacher", default="", help="a save_pretrained causal LM directory (default: the cache's)")
    p.add_argument("--sequences", type=int, default=None, help="sequences per pass (default 1024; 96 with --quick)")
    p.add_argument("--batch", type=int, default=16, help="in-process batch and server --max-batch-size (default 16)")
    p.add_argument("--min-len", type=int, default=8, help="shortest sequence drawn (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--clients", type=int, default=0, help="concurrent requests (default: 8 x --batch)")
    p.add_argument("--delay-us", type=int, default=BATCHING_QUEUE_DELAY_US,
                   help="server --max-queue-delay-us (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (default: cores / instances)")
    p.add_argument("--instances", type=int, default=0, help="server instances = in-process loops (default: cores)")
    p.add_argument("--max-foreign-cores", type=float, default=Settings.max_foreign_cores,
                   help="wait for, and re-measure past, this much CPU used by other processes (0: off)")
    p.add_argument("--gate-budget", type=float, default=None, help="seconds the run may wait for quiet (60; 5 quick)")
    add_device_args(p)
    p.add_argument("--mode", choices=("server", "reader"), default="server",
                   help="server: in-process vs the server fed one sequence per request (default); reader: "
                   "DistillReader with padded batches in loader order vs one sequence per request")
    p.add_argument("--skip-buckets-off", action="store_true",
                   help="leave out the server with length buckets off (the baseline that shows what they save)")
    p.add_argument("--student-batch", type=int, default=0,
                   help="--mode reader: sequences per student batch (default: --batch); on a GPU keep it small, "
                   "the in-process baseline computes the loader's padded batches' whole logits")
    p.add_argument("--reader-rows", type=int, default=0,
                   help="--mode reader: rows the matched reader keeps in flight, in student batches (default: "
                   "--clients, what the one-per-request clients keep)")
    p.add_argument("--alt-server-arg", action="append", default=[],
                   help="also measure a server with this extra flag (repeatable), e.g. "
                   "--alt-server-arg=--no-async-outputs: an A/B within one run")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra teacher-server flag for every server (repeatable), e.g. --server-arg=--no-async-outputs")
    p.add_argument("--out", default=None,
                   help="results file benchmarks/results/<OUT>.json "
                   "(default llm_serving, or llm_reader with --mode reader)")
    a = p.parse_args(argv)
    reps = a.reps if a.reps is not None else (2 if a.quick else Settings.reps)
    sequences = a.sequences if a.sequences is not None else (96 if a.quick else Settings.sequences)
    if reps < 1 or sequences < 1 or a.batch < 1 or a.min_len < 2 or a.top_k < 1 or a.student_batch < 0 \
            or a.reader_rows < 0:
        p.error("--reps, --sequences, --batch, --top-k must be >= 1, --min-len >= 2, "
                "--student-batch and --reader-rows >= 0")
    return Settings(
        reps=reps, sequences=sequences, batch=a.batch, min_len=a.min_len, seed=a.seed, top_k=a.top_k,
        clients=a.clients, delay_us=a.delay_us, threads=a.threads, instances=a.instances, teacher=a.teacher,
        tiny=a.tiny, quick=a.quick, max_foreign_cores=a.max_foreign_cores,
        gate_budget_s=a.gate_budget if a.gate_budget is not None else (5.0 if a.quick else Settings.gate_budget_s),
        max_redos=0 if a.quick else Settings.max_redos,
        out=a.out or ("llm_reader" if a.mode == "reader" else "llm_serving"), mode=a.mode,
        device=a.device, compute_dtype=a.compute_dtype, extra_server_args=tuple(a.server_arg),
        buckets_off=not a.skip_buckets_off, alt_server_args=tuple(a.alt_server_arg), student_batch=a.student_batch,
        reader_rows=a.reader_rows,
    )


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    if s.mode == "reader":
        from benchmarks import llm_reader

        return run_and_report(lambda: asyncio.run(llm_reader.run(s)), s.out, llm_reader.report)
    return run_and_report(lambda: asyncio.run(run(s)), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
