"""Is one batch of an `hf:` causal LM teacher bound by the host or by the device? For batches of the
W6 shape at a few row counts and lengths: the time the host takes to issue the forward pass (with
its mask, and without it as the server runs a right-padded batch), the server's output transforms
at each chunk size and the in-process baseline's whole-batch top-k; the time the device takes to
run them (CUDA events); and the calls that make the host wait for the device.

    .venv/bin/python -m benchmarks.host_bound --teacher DIR [--device cuda] [--compute-dtype BF16]

A served LLM teacher issues one batch after another from one thread; if issuing a batch takes about
as long as running it, the device idles whenever that thread is held up (the event loop, another
instance, a synchronising call) and smaller batches cost more than their positions. A synchronising
call in the middle of a batch (a data-dependent shape, `.item()`, a host copy) makes the host wait
for everything queued before it, so the device's queue runs dry while the rest of the batch is
issued. On CUDA the synchronising calls are counted with `torch.cuda.set_sync_debug_mode("warn")`,
by the frame that called them; on the CPU host and device time are one and the counts are empty.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import format_table, machine_info, median, run_and_report
from benchmarks.device import DeviceChoice, add_device_args
from benchmarks.llm_parts import output_work
from teacher_server.hf_model import load_hf_teacher
from teacher_server.outputs import CHUNK_BYTES, OutputContext, OutputTransform, transform_output
from teacher_server.spec import TensorSpec

TOP_K = 20
W6_WANT = OutputTransform("LOGITS", "FP16", TOP_K, True, 1.0, True)  # top-20 log-probs in fp16 + the tail


def _sync_site(w: warnings.WarningMessage) -> str:
    """The Python line that made the synchronising call (torch attributes its warning there)."""
    return f"{'/'.join(w.filename.rsplit('/', 2)[-2:])}:{w.lineno}"


class Probe:
    """Times one stage of a batch on the host and on the device, and names its synchronising calls."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.syncs: collections.Counter[str] = collections.Counter()

    def stage(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """(result, host ms to issue, device ms to run); the device is idle before and after."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        host_ms = 1000 * (time.perf_counter() - t0)
        for w in caught:
            if "synchroniz" in str(w.message):
                self.syncs[_sync_site(w)] += 1
        if not self.cuda:
            return out, host_ms, host_ms
        end.record()
        end.synchronize()
        return out, host_ms, float(start.elapsed_time(end))


def _forward(teacher: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = teacher.hidden(ids, mask)[0]
    return out


def _transforms(hidden: torch.Tensor, *, spec: TensorSpec, want: OutputTransform, context: OutputContext) -> Any:
    return transform_output(hidden, spec, want, context)


def _baseline(hidden: torch.Tensor, *, head: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return output_work(head(hidden), TOP_K)


def measure_shape(teacher: Any, probe: Probe, shape: tuple[int, int], *, reps: int,
                  chunks_mib: list[int]) -> dict[str, Any]:
    """Medians over `reps` of one batch of rows x length positions (the last row half padding):
    the forward pass, the server's transforms at each chunk size, and the in-process baseline's
    projection and top-k of the whole batch at once (`llm_parts.output_work`)."""
    rows, length = shape
    vocab = int(teacher.width)
    device = next(teacher.parameters()).device
    ids = torch.randint(1, vocab, (rows, length), device=device)
    mask = torch.ones_like(ids)
    mask[-1, length // 2:] = 0
    spec = TensorSpec("LOGITS", "FP32", (-1, vocab), per_position=True)
    stages: dict[str, Callable[[torch.Tensor], Any]] = {
        f"transforms_{mib}": functools.partial(_transforms, spec=spec, want=W6_WANT,
                                               context=OutputContext(None, teacher.head, vocab, mib << 20))
        for mib in chunks_mib}
    stages["baseline"] = functools.partial(_baseline, head=teacher.head)
    times: dict[str, list[float]] = collections.defaultdict(list)
    unmasked_syncs: list[int] = []
    warm_syncs = 0
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first is a warm-up
            hidden, host, dev = probe.stage(functools.partial(_forward, teacher, ids, mask))
            times["forward_host_ms"].append(host)
            times["forward_device_ms"].append(dev)
            syncs = sum(probe.syncs.values())
            # What the server runs for a right-padded batch (teacher_server.instance.unmasked):
            # no mask, so no host reads of it; its syncs are counted apart.
            _, host, dev = probe.stage(functools.partial(_forward, teacher, ids, None))
            times["forward_unmasked_host_ms"].append(host)
            times["forward_unmasked_device_ms"].append(dev)
            unmasked_syncs.append(sum(probe.syncs.values()) - syncs)
            for name, fn in stages.items():
                _, host, dev = probe.stage(functools.partial(fn, hidden))
                times[f"{name}_host_ms"].append(host)
                times[f"{name}_device_ms"].append(dev)
            if rep == 0:
                warm_syncs = sum(probe.syncs.values())
                probe.syncs.clear()
                times.clear()
                unmasked_syncs.clear()
    med = {k: round(median(v), 2) for k, v in times.items()}
    default = f"transforms_{chunks_mib[0]}"
    host = med["forward_host_ms"] + med[f"{default}_host_ms"]
    dev = med["forward_device_ms"] + med[f"{default}_device_ms"]
    return {"rows": rows, "length": length, "positions": rows * length, **med,
            "host_over_device": round(host / dev, 3) if dev else None,
            "syncs_per_batch": round((sum(probe.syncs.values()) - sum(unmasked_syncs)) / reps, 2),
            "unmasked_forward_syncs_per_batch": round(sum(unmasked_syncs) / reps, 2), "syncs_in_warmup": warm_syncs,
            "sync_sites": dict(probe.syncs.most_common(6)), "device_positions_per_s": round(rows * length / dev * 1e3)}


def run(teacher_dir: str, choice: DeviceChoice, shapes: list[tuple[int, int]], reps: int,
        chunks_mib: list[int]) -> dict[str, Any]:
    choice.check()
    teacher = load_hf_teacher(f"hf:{teacher_dir}", choice.torch_device, choice.dtype)
    results = []
    for shape in shapes:
        results.append(measure_shape(teacher, Probe(choice.torch_device), shape, reps=reps, chunks_mib=chunks_mib))
        print(f"  {shape[0]} x {shape[1]}: {results[-1]}", flush=True)
    return {"teacher": teacher_dir, "vocab": int(teacher.width), **choice.info(), "chunks_mib": chunks_mib,
            "top_k": TOP_K, "reps": reps, "shapes": results, "torch": torch.__version__, "machine": machine_info()}


def report(doc: dict[str, Any]) -> str:
    chunks = doc["chunks_mib"]
    headers = ["batch", "forward host ms", "forward device ms", "unmasked forward host/device ms",
               *[f"transforms {m} MiB host/device ms" for m in chunks], "whole-batch top-k host/device ms",
               "host / device", "syncs a batch (unmasked forward)", "positions/s on device"]
    rows = []
    for r in doc["shapes"]:
        rows.append([f"{r['rows']} x {r['length']}", r["forward_host_ms"], r["forward_device_ms"],
                     f"{r['forward_unmasked_host_ms']} / {r['forward_unmasked_device_ms']}",
                     *[f"{r[f'transforms_{m}_host_ms']} / {r[f'transforms_{m}_device_ms']}" for m in chunks],
                     f"{r['baseline_host_ms']} / {r['baseline_device_ms']}", r["host_over_device"],
                     f"{r['syncs_per_batch']} ({r['unmasked_forward_syncs_per_batch']})",
                     f"{r['device_positions_per_s']:,}"])
    sites: collections.Counter[str] = collections.Counter()
    for r in doc["shapes"]:
        sites.update(r["sync_sites"])
    text = (f"{doc['gpu'] or doc['device']}, {doc['compute_dtype']}, vocabulary {doc['vocab']:,}, "
            f"top-{doc['top_k']} log-probs + tail; host / device and positions/s with {chunks[0]} MiB chunks; "
            f"medians of {doc['reps']}\n" + format_table(headers, rows))
    if sites:
        text += "\nsynchronising calls by site: " + "; ".join(f"{k} x{v}" for k, v in sites.most_common(8))
    return text


def _shape(text: str) -> tuple[int, int]:
    rows, _, length = text.partition("x")
    return int(rows), int(length)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, help="a save_pretrained causal LM directory")
    add_device_args(p)
    p.add_argument("--shapes", default="16x1024,32x512,16x512,64x128,32x64",
                   help="batches as ROWSxLENGTH, comma-separated (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", default=f"{CHUNK_BYTES >> 20},64,1024",
                   help="output transforms' chunks to time, MiB of fp32, the first the headline (default: %(default)s)")
    p.add_argument("--out", default="host_bound", help="results file: benchmarks/results/<OUT>.json")
    a = p.parse_args(argv)
    try:
        shapes = [_shape(s) for s in a.shapes.split(",") if s.strip()]
        chunks = [int(c) for c in a.chunks.split(",") if c.strip()]
    except ValueError:
        p.error("--shapes: ROWSxLENGTH pairs, e.g. 16x1024,64x128; --chunks: integers")
    if not shapes or min(min(s) for s in shapes) < 2 or a.reps < 1 or not chunks or min(chunks) < 1:
        p.error("every shape needs at least 2 rows and 2 positions; --reps and every --chunks size at least 1")
    return run_and_report(lambda: run(a.teacher, DeviceChoice.from_args(a), shapes, a.reps, chunks), a.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
