"""`make demo`: serve RefTeacher, call it with NVIDIA's tritonclient, report what came back.

Starts `teacher-server` as a real subprocess on a free loopback port, checks its metadata,
runs one batch and compares it with the same model in-process, measures samples/s with a few
requests in flight, and stops the server with SIGTERM (drain) — also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as tg

from examples.refteacher import build

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def teacher_server(args: list[str], timeout: float = 120.0) -> Iterator[dict[str, object]]:
    """A teacher-server subprocess; yields its ready info and always stops it."""
    with tempfile.TemporaryDirectory(prefix="distill-demo-") as tmp:
        ready = Path(tmp) / "ready.json"
        proc = subprocess.Popen([sys.executable, "-m", "teacher_server", "--port", "0", "--ready-file", str(ready),
                                 "--log-level", "WARNING", *args], cwd=REPO)
        try:
            deadline = time.monotonic() + timeout
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"teacher-server exited with code {proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"teacher-server did not become ready in {timeout:.0f}s")
                time.sleep(0.05)
            yield json.loads(ready.read_text())
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def measure(url: str, batch: int, seconds: float, concurrency: int = 3) -> float:
    """Samples/s with `concurrency` requests in flight, using the async API of tritonclient."""
    x = np.random.default_rng(1).standard_normal((batch, 3, 32, 32), dtype=np.float32)
    inp = tg.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    done = 0
    with tg.InferenceServerClient(url) as client:
        import queue

        answers: queue.Queue[object] = queue.Queue()
        end = time.monotonic() + seconds
        start = time.monotonic()
        for _ in range(concurrency):
            client.async_infer("ref_teacher", [inp], callback=lambda result, error: answers.put(error or result))
        in_flight = concurrency
        while in_flight:
            r = answers.get(timeout=60)
            if isinstance(r, Exception):
                raise r
            in_flight -= 1
            done += batch
            if time.monotonic() < end:
                client.async_infer("ref_teacher", [inp], callback=lambda result, error: answers.put(error or result))
                in_flight += 1
        return done / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distill-demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=5.0, help="how long to measure throughput")
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args(argv)
    threads = str(os.cpu_count() or 1)
    print(f"starting teacher-server with RefTeacher (MLP 3072-2048-2048-100) on cpu, {threads} thread(s)...")
    with teacher_server(["--model", "examples.refteacher:build", "--name", "ref_teacher", "--device", "cpu",
                         "--max-batch-size", str(args.batch)]) as info:
        url = str(info["endpoint"])
        with tg.InferenceServerClient(url) as client:
            meta = client.get_model_metadata("ref_teacher", as_json=True)
            print(f"serving at {url}: inputs {meta['inputs']}, outputs {meta['outputs']}")
            x = np.random.default_rng(0).standard_normal((4, 3, 32, 32), dtype=np.float32)
            inp = tg.InferInput("INPUT", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            logits = client.infer("ref_teacher", [inp]).as_numpy("LOGITS")
        with torch.inference_mode():
            local = build()(torch.from_numpy(x)).numpy()
        print(f"answer for 4 images: logits {logits.shape}, top classes {logits.argmax(1).tolist()}, "
              f"max |server - in-process| = {np.abs(logits - local).max():.2e}")
        rate = measure(url, args.batch, args.seconds)
        print(f"throughput at batch {args.batch}: {rate:,.0f} samples/s ({args.seconds:.0f} s, 3 requests in flight)")
    print("teacher-server stopped (SIGTERM, drained).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
