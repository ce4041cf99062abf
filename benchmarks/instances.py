"""How many model instances a teacher should run on one device: the figures behind the GPU default.

    .venv/bin/python -m benchmarks.instances --device cuda --compute-dtype FP16 \
        --model benchmarks.cv_teacher:resnet50 [--counts 1,2,3] [--batch 32] [--clients 64]
    .venv/bin/python -m benchmarks.instances --quick       # RefTeacher on the CPU: a smoke run

One `teacher-server` per instance count (`--instances N`: N threads, a CUDA stream each on a
GPU), all started once; per repetition, interleaved, each is kept busy by --clients concurrent
clients sending batch---batch requests (raw gRPC, one request built once, responses not decoded)
for a fixed window after a warm-up. The reference is the best plain PyTorch in this process at
batch --inproc-batch (`benchmarks.device.InProcessModel`: on CUDA, inputs on the device,
cudnn.benchmark, channels_last for images, autocast). Headlines: samples/s per count, over the
in-process rate and over one instance. The server's GPU default (`default_instances`) is chosen
from these figures (`benchmarks/results/instances_gpu_resnet50.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks import serving_measure
from benchmarks.common import REF_MODEL_REF, REPO_ROOT, format_table, interleave, machine_info, median, ratio
from benchmarks.device import DeviceChoice, InProcessModel, add_device_args
from benchmarks.serving_measure import open_channel
from protos.kserve import datatype
from teacher_server.launch import TeacherProcess
from teacher_server.model import import_factory
from teacher_server.spec import ModelIO

MODEL_NAME = "teacher"


@dataclass(frozen=True)
class Settings:
    model: str = REF_MODEL_REF
    counts: tuple[int, ...] = (1, 2, 3)
    batch: int = 32
    clients: int = 64
    inproc_batch: int = 256
    max_batch: int = 256
    reps: int = 3
    warmup_s: float = 1.0
    duration_s: float = 3.0
    device: str = "cpu"
    compute_dtype: str = "FP32"

    @property
    def choice(self) -> DeviceChoice:
        return DeviceChoice(self.device, self.compute_dtype)


def sample_input(io: ModelIO, batch: int, seed: int = 0) -> tuple[str, str, np.ndarray]:
    """The first input's name, datatype and a random batch of it (pixels for uint8 inputs)."""
    spec = io.inputs[0]
    rng = np.random.default_rng(seed)
    shape = (batch, *spec.shape)
    if spec.datatype == "UINT8":
        return spec.name, spec.datatype, rng.integers(0, 256, size=shape, dtype=np.uint8)
    x = rng.standard_normal(shape, dtype=np.float32).astype(datatype(spec.datatype).numpy_dtype)
    return spec.name, spec.datatype, x


def build_request(io: ModelIO, batch: int) -> service_pb2.ModelInferRequest:
    name, datatype, x = sample_input(io, batch)
    req = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    req.inputs.add(name=name, datatype=datatype, shape=list(x.shape))
    req.outputs.add(name=io.outputs[0].name)
    req.raw_input_contents.append(x.tobytes())
    return req


async def measure_server(proc: TeacherProcess, request: service_pb2.ModelInferRequest, s: Settings) -> float:
    """Samples/s completed inside the window while --clients requests are kept in flight."""
    async with open_channel(proc.endpoint) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        m = await serving_measure.measure_server([stub], request, batch=s.batch, concurrency=s.clients,
                                                 warmup_s=s.warmup_s, duration_s=s.duration_s,
                                                 server_pids=[proc.pid])
    return m.samples_per_s


def server_args(s: Settings, instances: int) -> list[str]:
    return ["--model", s.model, "--name", MODEL_NAME, *s.choice.server_args(), "--port", "0",
            "--instances", str(instances), "--max-batch-size", str(s.max_batch), "--log-level", "WARNING"]


def run(s: Settings) -> dict[str, Any]:
    s.choice.check()
    module = import_factory(s.model)()
    io: ModelIO = module.io_spec
    local = InProcessModel(module, s.choice, images=len(io.inputs[0].shape) == 3)
    x = torch.from_numpy(sample_input(io, s.inproc_batch)[2])
    request = build_request(io, s.batch)
    with contextlib.ExitStack() as stack:
        servers = {n: stack.enter_context(TeacherProcess(server_args(s, n), label=f"instances-{n}", cwd=REPO_ROOT,
                                                         ready_timeout=300.0, stop_grace=20.0))
                   for n in s.counts}
        variants = {"in_process": lambda: serving_measure.measure_inprocess(
            local, s.inproc_batch, s.warmup_s, s.duration_s, sample=x).samples_per_s}
        for n, proc in servers.items():
            variants[f"instances_{n}"] = lambda p=proc: asyncio.run(measure_server(p, request, s))
        rates = interleave(s.reps, variants,
                           on_result=lambda rep, name, v: print(f"  rep {rep + 1} {name:<12} {v:10,.0f} samples/s",
                                                                flush=True))
    base = median(rates["in_process"])
    one = median(rates[f"instances_{s.counts[0]}"])
    return {
        "benchmark": "instances",
        "settings": {k: getattr(s, k) for k in s.__dataclass_fields__} | s.choice.info(),
        "machine": machine_info(),
        "samples_per_s": rates,
        "median_samples_per_s": {k: median(v) for k, v in rates.items()},
        "over_in_process": {k: ratio(median(v), base) for k, v in rates.items() if k != "in_process"},
        "over_first_count": {k: ratio(median(v), one) for k, v in rates.items() if k != "in_process"},
        "best_count": max(s.counts, key=lambda n: median(rates[f"instances_{n}"])),
    }


def report(doc: dict[str, Any]) -> str:
    rows = [[name, f"{rate:,.0f}", f"{doc['over_in_process'].get(name, 1.0):.2f}",
             f"{doc['over_first_count'].get(name, float('nan')):.2f}"]
            for name, rate in doc["median_samples_per_s"].items()]
    return format_table(["variant", "samples/s", "/ in-process", "/ first count"], rows) + \
        f"\nbest instance count: {doc['best_count']}"


def _counts(text: str) -> tuple[int, ...]:
    """argparse type: instance counts, comma-separated, each >= 1."""
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give instance counts >= 1, comma-separated, e.g. 1,2,3")
    return counts


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import run_and_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=REF_MODEL_REF, help="module:factory (default: RefTeacher)")
    p.add_argument("--counts", type=_counts, default=(1, 2, 3), help="instance counts to compare (default 1,2,3)")
    p.add_argument("--batch", type=int, default=32, help="samples per request (default 32)")
    p.add_argument("--clients", type=int, default=64, help="requests kept in flight (default 64)")
    p.add_argument("--inproc-batch", type=int, default=256, help="the in-process batch (default 256)")
    p.add_argument("--max-batch-size", type=int, default=256, help="the servers' batch cap (default 256)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 2 with --quick)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--out", default="instances", help="results file: benchmarks/results/<OUT>.json")
    add_device_args(p)
    a = p.parse_args(argv)
    s = Settings(model=a.model, counts=a.counts, batch=a.batch,
                 clients=a.clients, inproc_batch=a.inproc_batch, max_batch=a.max_batch_size,
                 reps=a.reps or (2 if a.quick else 3), duration_s=a.duration or (1.0 if a.quick else 3.0),
                 warmup_s=0.5 if a.quick else 1.0, device=a.device, compute_dtype=a.compute_dtype)
    return run_and_report(lambda: run(s), a.out, report)


if __name__ == "__main__":
    sys.exit(main())
