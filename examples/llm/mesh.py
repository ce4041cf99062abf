"""The LLM example's teacher on the mesh: serving the saved teacher, the reader's options, and a
teacher-output store recorded once for offline students.

* ``serve_teacher``: ``python -m teacher_server --model hf:DIR`` on a free local port (the
  directory ``train_teacher`` wrote), with top-k log-probabilities, the tail mass and float16
  outputs as its defaults. The reader states the same settings on every request anyway, so a
  server started with other defaults gives this student the same numbers.
* ``reader_options``: ``DistillReader`` keywords for the teacher's top-k: from the servers
  (``teachers=``), or from a store alone (``cache=``, ``cache_mode="read"``, no teachers).
* ``record``: the samples the students will see, through the teachers into a store, once; a
  second call with the same store asks the teachers for nothing (``read_write`` skips stored samples).

The store's namespace names the teacher by a digest of its weights (the model version), so a
store recorded from another teacher is refused rather than used.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from examples.llm.student import OUTPUT

MODEL_NAME = "llm-teacher"
INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask"}
KEY = "index"
"""The batch field holding each sequence's position in the training split: the store's sample key."""


def teacher_version(teacher_dir: Path) -> str:
    """A digest of the teacher's weights: the served model version and the store's namespace."""
    h = hashlib.sha256()
    for weights in sorted(teacher_dir.glob("*.safetensors")) or sorted(teacher_dir.glob("*.bin")):
        with weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


@contextlib.contextmanager
def serve_teacher(teacher_dir: Path, *, k: int, temperature: float, max_batch_size: int, threads: int,
                  log: Path | None = None) -> Iterator[str]:
    """One teacher server for ``teacher_dir`` on 127.0.0.1; yields its ``host:port``; stopped on exit.

    ``max_batch_size`` is the student's batch size, so each request is one batch and the server
    computes exactly what the in-process teacher computes for it.
    """
    from teacher_server.launch import TeacherProcess

    args = ["--model", f"hf:{teacher_dir}", "--name", MODEL_NAME, "--version", teacher_version(teacher_dir),
            "--device", "cpu", "--threads", str(threads), "--max-batch-size", str(max_batch_size),
            "--max-queue-delay-us", "0", "--top-k", str(k), "--logprobs", "--topk-tail",
            "--temperature", str(temperature), "--output-dtype", "FP16", "--host", "127.0.0.1"]
    with TeacherProcess(args, label="llm-teacher", log=log, ready_timeout=180.0, stop_grace=10.0) as server:
        yield server.endpoint


def _wire(k: int, temperature: float) -> dict[str, Any]:
    return {"inputs": INPUTS, "outputs": [OUTPUT], "top_k": k, "logprobs": True, "temperature": temperature,
            "topk_tail": True, "output_dtype": "FP16"}


def reader_options(*, k: int, temperature: float, teachers: str | None = None, store: Path | None = None,
                   version: str = "", timeout: float = 60.0) -> dict[str, Any]:
    """``DistillReader`` keywords: top-k log-probabilities with the tail, float16, at ``temperature``.

    ``teachers`` ("host:port,..."): from the servers. ``store`` without ``teachers``: offline from
    the store (``version`` must be the teacher's, see ``teacher_version``).
    """
    if (teachers is None) == (store is None):
        raise ValueError("pass teachers='host:port' (the mesh) or store=PATH (offline), one of them")
    options = {**_wire(k, temperature), "timeout": timeout}
    if teachers is not None:  # the reader reads ahead what the teachers want (they batch by length)
        return {**options, "teachers": teachers, "model": MODEL_NAME}
    return {**options, "prefetch": 8, "cache": str(store), "cache_mode": "read", "key": KEY, "model_version": version}


def record(loader: Iterable[Any], store: Path, *, teachers: str, k: int, temperature: float,
           timeout: float = 60.0) -> tuple[int, float]:
    """Every batch of ``loader`` through the teachers into ``store`` (what ``distill record`` does,
    with the example's output settings); stored samples are not asked again. Returns (batches, seconds)."""
    from distill import DistillReader

    started = time.perf_counter()
    batches = 0
    with DistillReader(loader, teachers=teachers, model=MODEL_NAME, cache=str(store), cache_mode="read_write",
                       key=KEY, timeout=timeout, **_wire(k, temperature)) as reader:
        for _ in reader:
            batches += 1
    return batches, time.perf_counter() - started
