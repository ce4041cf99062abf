"""W7 on-policy distillation: a step (generate, score, train) with the teacher served vs in process.

    .venv/bin/python -m benchmarks.onpolicy [--reps 7] [--steps 16] [--quick] [--tiny] [--teacher DIR]
                                            [--shape qwen2.5-1.5b] [--device cuda --compute-dtype BF16]

The student samples continuations of prompts with its current weights, the teacher scores the
tokens it chose (``token_logprobs``: ``log p(x[t+1] | x[<=t])``, 4 bytes a position in fp32), the
student trains on the sampled-token loss (`benchmarks.onpolicy_parts` says how). Per repetition,
interleaved, both variants run the same --steps over the same prompts from the same initial
student weights and sampler seed:

  * mesh: the teacher in a `teacher-server` process (``--model hf:DIR``, one instance, the same
    device, dtype and torch threads), reached through ``DistillReader(None).submit``, pipelined with
    staleness 1 (step n is scored while step n+1 is generated): what a user of the mesh writes;
  * inprocess: the same teacher in the training process, scored synchronously each step
    (staleness 0), with torch.inference_mode in the same dtype on the same device.

Headline: mesh / inprocess steps per second, the median of the per-repetition ratios. Also: the
phases of a step (generation, scoring or waiting for the teacher, training); the teacher's scoring
rate (positions per second of the server's compute time, from its metrics) beside W6's teacher
tokens/s (--w6-results, by default the committed benchmarks/results/llm_serving.json; a W6 run on
the same device and dtype makes the comparison like for like) and the in-process scoring rate; bytes per scored
token on the wire: the tensors sent and received per step, and the KServe v2 protobuf messages of
one step's request measured whole. Before measuring, one batch's token log-probs through the mesh
must equal the in-process teacher's (allclose; fp32 refuses a difference over 1e-3).

Each process runs one torch thread by default (--threads): on CPU the in-process variant computes on
one core and the mesh's teacher on a second one while the student generates on the first, the
point of serving it elsewhere. (Two threads per process on a shared 2-core machine made the
student's generation 15-40x slower, 1.3-3.4 s against 0.08 s for 8 x 32 tokens: threads that
spin-wait for cores other jobs hold.) On CUDA both processes share the GPU, the student runs in
autocast and the in-process teacher's weights are in --compute-dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks.common import (
    REPO_ROOT,
    format_table,
    interleave,
    machine_info,
    median,
    paired_ratios,
    ratio,
    run_and_report,
)
from benchmarks.device import DeviceChoice, add_device_args
from benchmarks.llm_parts import MAX_MESSAGE, MODEL_NAME
from benchmarks.onpolicy_parts import SHAPES, TOKENS_OUT, Loop, Models, StepTimes, models, parameters, score_inprocess
from teacher_server.launch import TeacherProcess

W6_RESULTS = "benchmarks/results/llm_serving.json"  # relative to the repository unless it exists from here
VARIANTS = ("mesh", "inprocess")


@dataclass(frozen=True)
class Settings:
    """One run's knobs; recorded verbatim in the JSON."""

    reps: int = 7
    steps: int = 16
    batch: int = 8
    prompt_len: int = 16
    new_tokens: int = 32
    lr: float = 1e-4
    seed: int = 0
    threads: int = 1  # torch threads in each process; 0: one per core
    teacher: str = ""
    tiny: bool = False
    shape: str = ""
    quick: bool = False
    out: str = "onpolicy"
    w6_results: str = W6_RESULTS  # W6's result file the teacher's scoring rate is compared with
    device: str = "cpu"
    compute_dtype: str = "FP32"

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)

    @property
    def torch_threads(self) -> int:
        return self.threads or (os.cpu_count() or 1)


def server_args(s: Settings, m: Models) -> list[str]:
    """The teacher as a user starts it: the hf: directory, the device and dtype, one instance."""
    return ["--model", f"hf:{m.directory}", "--name", MODEL_NAME, *s.choice.server_args(), "--instances", "1",
            "--threads", str(s.torch_threads), "--metrics-port", "0", "--log-level", "WARNING"]


def reader_options(endpoint: str, s: Settings) -> dict[str, Any]:
    return {"teachers": endpoint, "model": MODEL_NAME, "inputs": {"INPUT_IDS": "input_ids",
                                                                 "ATTENTION_MASK": "attention_mask"},
            "outputs": ["LOGITS"], "token_logprobs": True, "temperature": 1.0, "timeout": 60.0, "prefetch": 2,
            "hedge_after": None,  # one teacher: nothing to race a late answer on
            "device": s.device if s.choice.cuda else None}


def check_agreement(loop: Loop, reader: Any, s: Settings) -> dict[str, Any]:
    """One batch's token log-probs through the mesh vs in process (all positions)."""
    loop.reset()
    batch = loop.generate(0)
    mesh = reader.score(batch)[TOKENS_OUT].float().cpu()
    local = score_inprocess(loop.m.teacher, batch["input_ids"]).cpu()
    diff = float((mesh - local).abs().max())
    atol = 1e-3 if s.compute_dtype == "FP32" else 0.25
    ok = bool(torch.allclose(mesh, local, atol=atol, rtol=0.0))
    if not ok and s.compute_dtype == "FP32":
        raise AssertionError(f"the mesh's token log-probs differ from the in-process teacher's by up to {diff}")
    if not ok:
        print(f"WARNING: mesh and in-process token log-probs differ by up to {diff} ({s.compute_dtype})", flush=True)
    return {"max_abs_diff": diff, "atol": atol, "allclose": ok, "shape": list(mesh.shape),
            "mean_token_logprob": round(float(local[:, :-1].mean()), 4)}


def protobuf_sizes(endpoint: str, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """One step's request as KServe v2 protobuf and its answer, measured whole (sizes in bytes)."""
    ids = batch["input_ids"].cpu().numpy().astype(np.int64)
    req = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    for name, arr in (("INPUT_IDS", ids), ("ATTENTION_MASK", np.ones_like(ids))):
        req.inputs.add(name=name, datatype="INT64", shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())
    req.parameters["token_logprobs"].bool_param = True
    with grpc.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", MAX_MESSAGE)]) as chan:
        resp = service_pb2_grpc.GRPCInferenceServiceStub(chan).ModelInfer(req, timeout=60)
    names = [o.name for o in resp.outputs]
    if names != [TOKENS_OUT]:
        raise AssertionError(f"a token_logprobs request was answered with {names}, not [{TOKENS_OUT}] alone")
    return {"request": req.ByteSize(), "response": resp.ByteSize(), "positions": int(ids.size)}


def run(s: Settings) -> dict[str, Any]:
    choice = s.choice
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(models(shape=s.shape, teacher=s.teacher, tiny=s.tiny, prompts=s.steps * s.batch,
                                       prompt_len=s.prompt_len, seed=s.seed, threads=s.torch_threads, choice=choice))
        if s.prompt_len + s.new_tokens > m.context:
            raise SystemExit(f"--prompt-len + --new-tokens = {s.prompt_len + s.new_tokens} exceeds the teacher's "
                             f"context {m.context}")
        from distill import DistillReader

        server = stack.enter_context(TeacherProcess(server_args(s, m), label="teacher", cwd=REPO_ROOT,
                                                    stop_grace=20.0))
        port = int(server.ready["metrics_port"])
        reader = stack.enter_context(DistillReader(None, **reader_options(server.endpoint, s)))
        loop = Loop(m, steps=s.steps, batch=s.batch, new_tokens=s.new_tokens, lr=s.lr, seed=s.seed, choice=choice)
        check = check_agreement(loop, reader, s)
        print(f"mesh token log-probs match the in-process teacher's (max |diff| {check['max_abs_diff']:.1e})",
              flush=True)
        sizes = protobuf_sizes(server.endpoint, loop.generate(0))
        pids = [server.pid]
        warm = Loop(m, steps=min(2, s.steps), batch=s.batch, new_tokens=s.new_tokens, lr=s.lr, seed=s.seed,
                    choice=choice)
        warm.inprocess(pids)
        warm.mesh(reader, port, pids)
        variants: dict[str, Callable[[], StepTimes]] = {"mesh": lambda: loop.mesh(reader, port, pids),
                                                        "inprocess": lambda: loop.inprocess(pids)}
        per_rep = interleave(s.reps, variants, print_rep)
        reader.close()
        exit_code = server.stop()
        doc = summarise(s, per_rep, check, sizes)
        doc["teacher"] = {"source": m.source, "directory": str(m.directory), "vocab_size": m.vocab,
                          "context": m.context, "parameters": parameters(m.teacher)}
        doc["student"] = {"parameters": parameters(m.student)}
    doc["server_exit_code"] = exit_code
    return doc


def print_rep(rep: int, name: str, t: StepTimes) -> None:
    per = 1000 / t.steps
    line = (f"  rep {rep + 1} {name:<10} {t.steps_per_s:7.2f} steps/s  per step: generate {t.generate_s * per:6.1f} ms"
            f"  {'wait' if name == 'mesh' else 'score'} {t.score_s * per:6.1f} ms  train {t.train_s * per:6.1f} ms")
    if t.cpu:
        line += f"  foreign cores {t.cpu.foreign_cores:.2f}"
    print(line, flush=True)


def w6_reference(path: str, device: str, compute_dtype: str) -> dict[str, Any] | None:
    """W6's teacher tokens/s (server, length buckets) from its result file, and what it measured
    them on; `same_setup` says whether that was this run's device and dtype."""
    try:
        w6 = json.loads((Path(path) if Path(path).exists() else REPO_ROOT / path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    where = (w6["machine"].get("device", "cpu"), w6["machine"].get("compute_dtype", "FP32"))
    return {"server_tokens_per_s": w6["medians_tokens_per_s"]["server_buckets"],
            "inprocess_tokens_per_s": w6["medians_tokens_per_s"]["inprocess"],
            "device": w6["machine"].get("device", "cpu"), "compute_dtype": w6["machine"].get("compute_dtype", "FP32"),
            "teacher_parameters": w6.get("teacher", {}).get("parameters"),
            "teacher_vocab_size": w6.get("teacher", {}).get("vocab_size"), "file": path,
            "same_setup": where == (device, compute_dtype)}


def summarise(s: Settings, per_rep: dict[str, list[StepTimes]], check: dict[str, Any],
              sizes: dict[str, int]) -> dict[str, Any]:
    mesh, local = per_rep["mesh"], per_rep["inprocess"]
    paired = paired_ratios([t.steps_per_s for t in mesh], [t.steps_per_s for t in local])
    scored = mesh[0].scored_tokens
    if any(t.teacher_counted_tokens != t.teacher_positions for t in mesh):
        raise AssertionError(f"the server counted {[t.teacher_counted_tokens for t in mesh]} positions, the "
                             f"student sent {mesh[0].teacher_positions} a loop")
    teacher_rate = median([t.teacher_positions / t.teacher_compute_s for t in mesh if t.teacher_compute_s])
    local_rate = median([t.teacher_positions / t.score_s for t in local])
    w6 = w6_reference(s.w6_results, s.device, s.compute_dtype)
    step_scored = s.batch * s.new_tokens

    def phases(ts: list[StepTimes]) -> dict[str, float]:
        return {k: round(1000 * median([getattr(t, k) / t.steps for t in ts]), 2)
                for k in ("generate_s", "score_s", "train_s")}

    return {
        "benchmark": "onpolicy (W7)",
        "machine": machine_info(s.torch_threads) | s.choice.info() | {
            "server_instances": 1, "server_torch_threads": s.torch_threads},
        "settings": asdict(s),
        "steps_per_s": {k: round(median([t.steps_per_s for t in v]), 4) for k, v in per_rep.items()},
        "scored_tokens_per_s": {k: round(median([t.scored_tokens / t.seconds for t in v]), 1)
                                for k, v in per_rep.items()},
        "ratio_mesh_over_inprocess": {"headline": round(median(paired), 4), "per_rep": [round(r, 4) for r in paired],
                                      "pairs": len(paired)},
        "ms_per_step": {k: phases(v) for k, v in per_rep.items()},
        "scored_tokens": {"per_step": step_scored, "per_loop": scored,
                          "teacher_positions_per_step": s.batch * (s.prompt_len + s.new_tokens)},
        "teacher_scoring": {
            "mesh_positions_per_compute_s": round(teacher_rate, 1),
            "mesh_scored_tokens_per_compute_s": round(teacher_rate * s.new_tokens / (s.prompt_len + s.new_tokens), 1),
            "inprocess_positions_per_s": round(local_rate, 1),
            "mesh_over_inprocess": round(ratio(teacher_rate, local_rate), 4),
            "w6": w6,
            "mesh_over_w6_server": round(ratio(teacher_rate, w6["server_tokens_per_s"]), 4) if w6 else None,
        },
        "wire_bytes_per_scored_token": {
            "response_tensors": round(median([t.response_bytes / t.scored_tokens for t in mesh]), 3),
            "request_tensors": round(median([t.request_bytes / t.scored_tokens for t in mesh]), 3),
            "response_protobuf": round(sizes["response"] / step_scored, 3),
            "request_protobuf": round(sizes["request"] / step_scored, 3),
            "request_and_response_protobuf": round((sizes["request"] + sizes["response"]) / step_scored, 3),
            "protobuf_bytes_one_step": sizes},
        "check": check,
        "per_rep": {k: [t.as_dict() for t in v] for k, v in per_rep.items()},
    }


def report(doc: dict[str, Any]) -> str:
    sp, ms = doc["steps_per_s"], doc["ms_per_step"]
    labels = {"mesh": "teacher-server via DistillReader.submit, staleness 1",
              "inprocess": "teacher in process, synchronous (staleness 0)"}
    rows = [[label, sp[k], doc["scored_tokens_per_s"][k], ms[k]["generate_s"], ms[k]["score_s"], ms[k]["train_s"],
             ", ".join(f"{t['steps_per_s']:.2f}" for t in doc["per_rep"][k])] for k, label in labels.items()]
    out = [format_table(["variant", "steps/s", "scored tok/s", "gen ms", "score/wait ms", "train ms",
                         "per repetition"], rows), ""]
    r = doc["ratio_mesh_over_inprocess"]
    out.append(f"mesh / in-process steps per second: {r['headline']:.3f} (median of {r['pairs']} paired repetitions: "
               f"{', '.join(f'{x:.3f}' for x in r['per_rep'])})")
    t = doc["teacher_scoring"]
    line = (f"teacher scoring: {t['mesh_positions_per_compute_s']:,.0f} positions per second of the server's compute "
            f"({t['mesh_scored_tokens_per_compute_s']:,.0f} scored tokens), in process "
            f"{t['inprocess_positions_per_s']:,.0f}")
    if t["w6"]:
        line += (f"; W6's server {t['w6']['server_tokens_per_s']:,.0f} tokens/s on {t['w6']['device']} "
                 f"{t['w6']['compute_dtype']} ({t['mesh_over_w6_server']:.3g}x"
                 f"{'' if t['w6']['same_setup'] else ', another device or dtype'})")
    out.append(line)
    w = doc["wire_bytes_per_scored_token"]
    out.append(f"wire bytes per scored token: response {w['response_tensors']:.2f} (tensors), "
               f"{w['response_protobuf']:.2f} (protobuf); request + response {w['request_and_response_protobuf']:.2f} "
               f"(protobuf)")
    m = doc["machine"]
    out.append(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs, device {m['device']} {m['compute_dtype']}"
               f"{' (' + m['gpu'] + ')' if m.get('gpu') else ''}; torch threads {m['torch_threads']} in each process")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.onpolicy", description=__doc__.split("\n\n")[0])
    d = Settings()
    p.add_argument("--reps", type=int, default=None, help=f"repetitions (default {d.reps}; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None, help=f"on-policy steps per loop (default {d.steps}; 3 quick)")
    p.add_argument("--batch", type=int, default=None, help=f"prompts per step (default {d.batch}; 4 quick)")
    p.add_argument("--prompt-len", type=int, default=None, help=f"prompt tokens (default {d.prompt_len}; 8 quick)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens the student samples per prompt (default {d.new_tokens}; 16 quick)")
    p.add_argument("--quick", action="store_true", help="few, small steps: a smoke test")
    p.add_argument("--tiny", action="store_true", help="the smoke teacher (trained here if missing) and corpus")
    p.add_argument("--teacher", default="", help="a save_pretrained causal LM directory (default: the cache's)")
    p.add_argument("--shape", default="", choices=["", *SHAPES],
                   help="instead: a teacher of this shape with random weights, and random prompts")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads in each process (default %(default)s; 0: one per core)")
    add_device_args(p)
    p.add_argument("--w6-results", default=d.w6_results,
                   help="W6's result file to compare the teacher's scoring rate with (default: the committed one)")
    p.add_argument("--out", default=d.out, help="results file benchmarks/results/<OUT>.json (default %(default)s)")
    a = p.parse_args(argv)

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if a.quick else full)

    s = Settings(reps=pick(a.reps, d.reps, 2), steps=pick(a.steps, d.steps, 3), batch=pick(a.batch, d.batch, 4),
                 prompt_len=pick(a.prompt_len, d.prompt_len, 8), new_tokens=pick(a.new_tokens, d.new_tokens, 16),
                 lr=a.lr, seed=a.seed, threads=a.threads, teacher=a.teacher, tiny=a.tiny, shape=a.shape,
                 quick=a.quick, out=a.out, w6_results=a.w6_results, device=a.device, compute_dtype=a.compute_dtype)
    if min(s.reps, s.steps, s.batch, s.new_tokens) < 1 or s.prompt_len < 2:
        p.error("--reps, --steps, --batch, --new-tokens must be >= 1 and --prompt-len >= 2")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: run(s), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
