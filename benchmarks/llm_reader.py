"""W6, the reader path: `python -m benchmarks.llm_serving --mode reader` (docs/design/workloads.md, W6).

A student's training loop pads its batches: `DistillReader` sends each batch of --student-batch
sequences (default --batch, which also sets the server's --max-batch-size and token budget),
in loader order, as one `[batch, L_max]` request with its attention mask. The teacher cuts the
rows back to their masks and batches them with everything else queued (`teacher_server.rows`), so
it should do the same work as when fed the same sequences one per request. Per repetition,
interleaved, each variant processes the same sequences once, against one teacher-server process:

  * reader: `DistillReader` over the student's padded batches in loader order, --clients / --batch
    batches read ahead and as many requests allowed in flight to the teacher (`RouterConfig`
    initial_limit), so the teacher holds the same sequences as from the one-per-request clients;
    top-k log-probs in fp16 with the tail, hedging off (a hedged chunk would be computed twice);
  * reader, defaults: the same with every reader default (no `prefetch`, no router settings): the
    teacher says it batches by length, so the reader keeps `RouterConfig.by_length_rows` rows (512)
    in flight to it and reads that far ahead: what a student gets without tuning;
  * one per request: the same sequences, one `[1, L]` request each, from --clients concurrent
    clients over raw gRPC (the W6 server variant);
  * in-process: the model on the loader's padded batches in loader order (for scale).

Headlines: reader / one-per-request tokens per second (goal >= 0.95), for the matched reader (the
same rows in flight as the clients) and for every reader default (what a student gets), and the
teacher's padding efficiency on the matched reader's traffic (useful / computed positions from its
metrics; goal >= 0.85).
Before measuring, the reader's answer to a padded batch is checked against one request per row
(equal at every real position, zeros at padding).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2_grpc

from benchmarks.common import (
    REPO_ROOT,
    ainterleave,
    format_table,
    machine_info,
    median,
    paired_ratios,
    redo_when_loaded,
)
from benchmarks.cpu import CpuMeter, QuietGate
from benchmarks.llm_parts import (
    MAX_MESSAGE,
    MIN_QUIET_PAIRS,
    MODEL_NAME,
    PADDING_GOAL,
    Measurement,
    Settings,
    make_request,
    measure_inprocess,
    measure_server,
    on_device,
    padded_batches,
    prepare,
    print_rep,
    server_args,
    server_counters,
    server_side,
)
from teacher_server.launch import TeacherProcess

READER_GOAL = 0.95
VARIANTS = ("reader", "reader_defaults", "one_per_request", "inprocess")


class Loader:
    """The student's padded batches, in loader order; `batches` may be swapped between passes."""

    def __init__(self, batches: Sequence[dict[str, torch.Tensor]]) -> None:
        self.batches = list(batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)


def pinned_router(ahead: int, rows: int = 1) -> Any:
    """A router that keeps `ahead` requests of `rows` rows in flight to each teacher from the first:
    `min_limit` so that the latency gradient cannot shrink them (on a GPU the gradient took the
    reader from 34 forward passes a pass to 168 over two repetitions of one run), and, for a teacher
    that batches by length, whose limit counts rows and starts at a quarter of `by_length_rows`,
    four times those rows (the read-ahead, `prefetch=ahead`, holds them to `ahead` requests)."""
    from distill.router import RouterConfig

    return RouterConfig(initial_limit=float(ahead), min_limit=float(ahead), max_limit=max(ahead, 16),
                        by_length_rows=max(RouterConfig.by_length_rows, 4 * ahead * rows))


def reader_options(endpoint: str, s: Settings, matched: bool = True) -> dict[str, Any]:
    """`matched`: --clients rows read ahead and kept in flight (`pinned_router`), else every
    reader default (the read-ahead and the router's limits its own)."""
    tuned = ({"router": pinned_router(s.reader_ahead, s.reader_batch), "prefetch": s.reader_ahead}
             if matched else {})
    return {**tuned, "teachers": endpoint, "model": MODEL_NAME, "inputs": {"INPUT_IDS": "input_ids",
                                                                   "ATTENTION_MASK": "attention_mask"},
            "outputs": ["LOGITS"], "top_k": s.top_k, "logprobs": True, "output_dtype": "FP16", "topk_tail": True,
            "timeout": 60.0, "hedge_after": None}


async def measure_reader(reader: Any, useful: int, *, metrics_port: int, stub: Any,
                         server_pids: Sequence[int]) -> Measurement:
    """One pass of the reader over the loader; tokens/s from the first batch asked to the last."""
    before = await server_counters(stub, metrics_port)
    meter = CpuMeter(server_pids)
    meter.start()
    t0 = time.perf_counter()
    batches = sum(1 for _ in reader)  # blocks the event loop on purpose, like the in-process baseline
    elapsed = time.perf_counter() - t0
    cpu = meter.stop()
    after = await server_counters(stub, metrics_port)
    counted = after.tokens[0] - before.tokens[0]
    if counted != useful or not batches:
        raise AssertionError(f"the server counted {counted} useful tokens over {batches} batches, "
                             f"the loader holds {useful}")
    return Measurement(useful / elapsed, useful, elapsed, cpu, **server_side(before, after))


async def check_rows(stub: Any, reader: Any, seqs: Sequence[list[int]], k: int, *, half: bool = False) -> float:
    """The reader's answer to the first padded batch equals one request per row at every real
    position, with zeros at padding; returns the max |diff|. In fp32 the two agree to 2e-2; a
    model computing in bf16/fp16 gives a row a few ulps of its log-probs apart in batches of other
    shapes (kernels pick other tilings), so there 0.15 is allowed (the H200 run: 0.094 in bf16)."""
    _, out = next(iter(reader))
    values = out["LOGITS_TOPK_VALUES"].float().numpy()
    worst = 0.0
    for r, seq in enumerate(seqs):
        resp = await stub.ModelInfer(make_request(seq, top_k=k), timeout=60)
        got = {o.name: raw for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
        alone = np.frombuffer(got["LOGITS_TOPK_VALUES"], dtype=np.float16).reshape(len(seq), k).astype(np.float32)
        worst = max(worst, float(np.abs(values[r, : len(seq)] - alone).max()))
        if values[r, len(seq) :].any():
            raise AssertionError(f"row {r}: the reader got non-zero values at padding")
    if worst > (1.5e-1 if half else 2e-2):
        raise AssertionError(f"padded batch rows differ from one request per row by up to {worst}")
    return worst


async def run(s: Settings) -> dict[str, Any]:
    from distill import DistillReader

    w = prepare(s)
    directory, max_len, vocab, seqs, pad_id, model = w.directory, w.max_len, w.vocab, w.seqs, w.pad_id, w.model
    lengths = w.lengths
    batches = on_device(padded_batches(seqs, s.reader_batch, pad_id), s.choice)
    student = [{"input_ids": ids, "attention_mask": mask}
               for ids, mask, _ in padded_batches(seqs, s.reader_batch, pad_id)]
    requests = [make_request(q, top_k=s.top_k) for q in seqs]
    useful = sum(lengths)

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TeacherProcess(server_args(s, directory, pad_id, vocab, True), label="server",
                                                    cwd=REPO_ROOT, stop_grace=20.0))
        pids = [server.pid]
        port = int(server.ready["metrics_port"])
        chan = grpc.aio.insecure_channel(server.endpoint, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.use_local_subchannel_pool", 1)])
        loader = Loader(student[:4])
        reader = stack.enter_context(DistillReader(loader, **reader_options(server.endpoint, s)))
        plain = stack.enter_context(DistillReader(loader, **reader_options(server.endpoint, s, matched=False)))
        try:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(chan)
            diff = await check_rows(stub, reader, seqs[: s.reader_batch], s.top_k, half=s.compute_dtype != "FP32")
            print(f"reader: padded rows match one request per row (max |diff| {diff:.1e}), zeros at padding",
                  flush=True)
            # Warm-up, so no variant pays first-call costs inside a repetition.
            warm = min(len(seqs), 4 * s.batch)  # four of the server's batches, and four of the student's
            measure_inprocess(model, batches[:4], s.top_k, s.server_instances, pids)
            await measure_server(stub, requests[:warm], lengths[:warm], clients=s.concurrency, metrics_port=port,
                                 server_pids=pids)
            for r in (reader, plain):
                await measure_reader(r, int(sum(b["attention_mask"].sum().item() for b in loader.batches)),
                                     metrics_port=port, stub=stub, server_pids=pids)
            loader.batches = student

            async def inprocess() -> Measurement:
                return measure_inprocess(model, batches, s.top_k, s.server_instances, pids)

            variants: dict[str, Callable[[], Awaitable[Measurement]]] = {
                "reader": lambda: measure_reader(reader, useful, metrics_port=port, stub=stub, server_pids=pids),
                "reader_defaults": lambda: measure_reader(plain, useful, metrics_port=port, stub=stub,
                                                          server_pids=pids),
                "one_per_request": lambda: measure_server(stub, requests, lengths, clients=s.concurrency,
                                                          metrics_port=port, server_pids=pids),
                "inprocess": inprocess}
            gate = QuietGate(pids, max_foreign_cores=s.max_foreign_cores, budget_s=s.gate_budget_s)
            discarded: dict[str, list[Measurement]] = {}
            per_rep = await ainterleave(s.reps, variants, print_rep,
                                        before=gate.wait if s.max_foreign_cores > 0 else None,
                                        redo_if=(redo_when_loaded(s.max_foreign_cores, s.max_redos)
                                                 if s.max_foreign_cores > 0 else None),
                                        discarded=discarded)
        finally:
            await chan.close()
        reader.close()
        plain.close()
        exit_code = server.stop()

    doc = summarise(s, per_rep)
    doc["server_exit_code"] = exit_code
    doc["check"] = {"max_abs_diff_rows_vs_one_per_request": diff}
    doc["teacher"] = {"directory": str(directory), "vocab_size": vocab, "context": max_len}
    doc["sequences"] = {"count": len(seqs), "tokens": useful, "min_len": min(lengths), "max_len": max(lengths),
                        "mean_len": round(useful / len(lengths), 2), "student_batch": s.reader_batch}
    doc["quiet_gate"] = gate.as_dict()
    doc["discarded"] = {k: [m.as_dict() for m in v] for k, v in discarded.items()}
    return doc


def summarise(s: Settings, per_rep: dict[str, list[Measurement]]) -> dict[str, Any]:
    limit = s.max_foreign_cores if s.max_foreign_cores > 0 else float("inf")

    def quiet(m: Measurement) -> bool:
        return m.cpu is None or m.cpu.foreign_cores <= limit

    def ratio_of(num: str, den: str, goal: float) -> dict[str, Any]:
        paired = paired_ratios([m.tokens_per_s for m in per_rep[num]], [m.tokens_per_s for m in per_rep[den]])
        clean = [r for r, a, b in zip(paired, per_rep[num], per_rep[den], strict=True) if quiet(a) and quiet(b)]
        trusted = len(clean) >= MIN_QUIET_PAIRS or s.max_foreign_cores <= 0
        headline = median(clean) if len(clean) >= MIN_QUIET_PAIRS else median(paired)
        verdict = ("PASS" if headline >= goal else "below goal") if goal and trusted else ""
        return {"headline": headline, "quiet_pairs": len(clean), "pairs": len(paired), "trusted": trusted,
                "per_rep": [round(r, 4) for r in paired], "goal": goal, "verdict": verdict}

    def padding(k: str) -> float:
        return median([m.padding_efficiency for m in per_rep[k] if m.padding_efficiency is not None])

    def per_core(k: str) -> list[float]:
        """Tokens per CPU-second the server used: what the teacher did with the CPU it got, which
        other people's jobs on a shared machine disturb far less than tokens per second."""
        return [m.tokens_per_s / m.cpu.server_cores for m in per_rep[k] if m.cpu and m.cpu.server_cores > 0]

    pad_reader = padding("reader")
    served = [k for k in VARIANTS if k != "inprocess"]
    per_core_ratios = {
        f"{k}_over_one_per_request": round(median(paired_ratios(per_core(k), per_core("one_per_request"))), 4)
        for k in served if k != "one_per_request" and per_core(k) and per_core("one_per_request")}
    return {
        "benchmark": "llm_serving --mode reader (W6, the reader path)",
        "machine": machine_info(s.server_threads) | s.choice.info() | {"server_instances": s.server_instances,
                                                     "server_torch_threads": s.server_threads},
        "settings": {**{k: v for k, v in vars(s).items()}, "clients": s.concurrency,
                     "reader_prefetch": max(1, s.concurrency // s.reader_batch)},
        "medians_tokens_per_s": {k: round(median([m.tokens_per_s for m in v]), 1) for k, v in per_rep.items()},
        "ratios": {"reader_over_one_per_request": ratio_of("reader", "one_per_request", READER_GOAL),
                   "reader_defaults_over_one_per_request": ratio_of("reader_defaults", "one_per_request", READER_GOAL),
                   "one_per_request_over_inprocess": ratio_of("one_per_request", "inprocess", 0.0),
                   "reader_over_inprocess": ratio_of("reader", "inprocess", 0.0)},
        "tokens_per_server_core_s": {k: round(median(per_core(k)), 1) for k in served if per_core(k)}
        | {"ratios": per_core_ratios},
        "padding_efficiency": {k: padding(k) for k in VARIANTS} | {
            "goal": PADDING_GOAL, "verdict": "PASS" if pad_reader >= PADDING_GOAL else "below goal"},
        "per_rep": {k: [m.as_dict() | {"quiet": quiet(m)} for m in v] for k, v in per_rep.items()},
    }


def report(doc: dict[str, Any]) -> str:
    med, pad = doc["medians_tokens_per_s"], doc["padding_efficiency"]
    labels = {"reader": "DistillReader, padded batches in loader order",
              "reader_defaults": "the same, every reader default (512 rows in flight)",
              "one_per_request": "server, one per request",
              "inprocess": "in-process, padded batches in loader order"}
    rows = [[label, med[k], pad[k], ", ".join(f"{m['tokens_per_s']:,.0f}{'' if m['quiet'] else '*'}"
                                               for m in doc["per_rep"][k])] for k, label in labels.items()]
    out = [format_table(["variant", "tokens/s", "padding eff.", "per repetition (* = disturbed)"], rows), ""]
    out.append(format_table(["ratio", "median", "goal", "quiet pairs", "verdict"],
                            [[k, v["headline"], v["goal"] or "", f"{v['quiet_pairs']}/{v['pairs']}", v["verdict"]]
                             for k, v in doc["ratios"].items()]))
    pc = doc["tokens_per_server_core_s"]
    out += ["", "tokens per server CPU-second: " + ", ".join(f"{k} {v:,.0f}" for k, v in pc.items() if k != "ratios")
            + "; " + ", ".join(f"{k} {v:.3f}" for k, v in pc["ratios"].items())]
    m = doc["machine"]
    out += ["", f"teacher padding efficiency on the reader's traffic {pad['reader']:.3f} (goal {PADDING_GOAL}): "
            f"{pad['verdict']}",
            f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, load average at start "
            f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}; server {m['server_instances']} "
            f"instance(s) x {m['server_torch_threads']} thread(s)"]
    return "\n".join(out)
