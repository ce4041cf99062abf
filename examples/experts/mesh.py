"""The teachers on the mesh: one ``teacher-server`` process per trained teacher, and the student's
per-sample routing (each row to its own task's expert).

* ``serve``: the trained teachers' files behind ``python -m teacher_server`` on free loopback
  ports, started together; yields ``{teacher: host:port}``; all stopped on exit.
* ``offpolicy_options`` / ``onpolicy_options``: what the reader asks for. Off-policy: the top-k
  log-probabilities with the tail mass on the reference sequences. On-policy: the log-probability
  of each sampled token, at the student's top-k ids (``SCORE_IDS``) and the teacher's own top-k.
* ``routed_pairs`` (a loader's batches) and ``routed_scorer`` (on-policy batches): each row to its
  task's expert. The reader does the routing: one ``DistillReader`` over ``teachers={task:
  endpoint}`` with ``route_by="task"`` and ``route_map`` from the task's index to its name; the
  outputs come back as one dict in row order, and the ``task`` field is never sent.
* ``single_pairs``: every row to one teacher (the generalist).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from distill import DistillReader
from examples.experts.tasks import TASKS
from teacher_server.launch import TeacherProcess

MODEL_NAME = "experts-teacher"
OUTPUT = "LOGITS"
INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask"}
ROUTE_BY = "task"
ROUTE_MAP = dict(enumerate(TASKS))
"""The ``task`` field holds an index into ``TASKS``; the experts are served under the task's name."""


@contextlib.contextmanager
def serve(files: Mapping[str, Path], *, max_batch_size: int, threads: int = 1) -> Iterator[dict[str, str]]:
    """Each ``{teacher: weights file}`` behind its own teacher server on 127.0.0.1, started in
    parallel; yields ``{teacher: host:port}``. Every server is stopped (drained) on exit."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, TeacherProcess] = {}
        for name, file in files.items():
            args = ["--model", "examples.experts.models:load", "--model-arg", f"path={file}", "--name", MODEL_NAME,
                    "--device", "cpu", "--threads", str(threads), "--instances", "1",
                    "--max-batch-size", str(max_batch_size), "--max-queue-delay-us", "0", "--host", "127.0.0.1",
                    "--log-level", "WARNING"]
            server = TeacherProcess(args, label=f"experts-{name}", ready_timeout=120.0, stop_grace=10.0)
            stack.callback(server.cleanup)
            server.launch()
            servers[name] = server
        for server in servers.values():
            server.wait_ready()
        yield {name: server.endpoint for name, server in servers.items()}


def offpolicy_options(k: int) -> dict[str, Any]:
    """Reader keywords for off-policy KD: top-``k`` log-probabilities and the tail mass, float32."""
    return {"inputs": INPUTS, "outputs": [OUTPUT], "model": MODEL_NAME, "top_k": k, "logprobs": True,
            "topk_tail": True, "temperature": 1.0, "output_dtype": "FP32", "timeout": 60.0}


def onpolicy_options(k: int) -> dict[str, Any]:
    """Reader keywords for on-policy scoring: the sampled tokens' log-probabilities, those at the
    student's top-k (``SCORE_IDS``) and the teacher's top-``k``, float32."""
    return {"inputs": {**INPUTS, "SCORE_IDS": "score_ids"}, "outputs": [OUTPUT], "model": MODEL_NAME,
            "token_logprobs": True, "top_k": k, "logprobs": True, "topk_tail": False, "temperature": 1.0,
            "output_dtype": "FP32", "timeout": 60.0, "prefetch": 2}


def routed_pairs(batches: Iterable[dict[str, Tensor]], experts: Mapping[str, str],
                 options: Mapping[str, Any]) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """``(batch, outputs)`` for each batch, every row's outputs from its task's expert, in row order:
    one reader over the experts (``teachers={task: endpoint}``) with ``route_by``."""
    with DistillReader(batches, teachers=dict(experts), route_by=ROUTE_BY, route_map=ROUTE_MAP, **options) as reader:
        yield from reader


def single_pairs(batches: Iterable[dict[str, Tensor]], endpoint: str,
                 options: Mapping[str, Any]) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """``(batch, outputs)`` for each batch, all rows from the one teacher at ``endpoint``."""
    with DistillReader(batches, teachers=endpoint, **options) as reader:
        yield from reader


def routed_scorer(experts: Mapping[str, str], options: Mapping[str, Any]) -> DistillReader:
    """On-policy scoring, each row by its task's expert: a loader-less reader with ``route_by``
    (``score(batch)``), started; close it when done."""
    return DistillReader(None, teachers=dict(experts), route_by=ROUTE_BY, route_map=ROUTE_MAP, **options).start()
