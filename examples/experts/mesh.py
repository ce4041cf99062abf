"""The teachers on the mesh: one ``teacher-server`` process per trained teacher, and the student's
per-sample routing (each row to its own task's expert).

* ``serve``: the trained teachers' files behind ``python -m teacher_server`` on free loopback
  ports, started together; yields ``{teacher: host:port}``; all stopped on exit.
* ``offpolicy_options`` / ``onpolicy_options``: what the reader asks for. Off-policy: the top-k
  log-probabilities with the tail mass on the reference sequences. On-policy: the log-probability
  of each sampled token, at the student's top-k ids (``SCORE_IDS``) and the teacher's own top-k.
* ``routed_pairs`` (a loader's batches, each row to its task's expert) and ``RoutedScorer``
  (on-policy batches the same way): the routing lives behind these two. With ``route_by`` the
  reader does it: one ``DistillReader`` over ``teachers={task: endpoint}`` with ``route_by="task"``
  and ``route_map`` from task index to task, the outputs coming back as one dict in row order.
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


def _rows(batch: Mapping[str, Tensor], task: int) -> dict[str, Tensor]:
    picked = batch[ROUTE_BY] == task
    return {k: v[picked] for k, v in batch.items()}


def _merge(batch: Mapping[str, Tensor], parts: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The experts' outputs for their rows, put back in the batch's row order."""
    merged: dict[str, Tensor] = {}
    for task, part in enumerate(parts):
        picked = (batch[ROUTE_BY] == task).nonzero().squeeze(1)
        for name, value in part.items():
            if name not in merged:
                merged[name] = value.new_zeros((batch[ROUTE_BY].shape[0], *value.shape[1:]))
            merged[name][picked] = value
    return merged


def routed_pairs(batches: list[dict[str, Tensor]], experts: Mapping[str, str],
                 options: Mapping[str, Any]) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """``(batch, outputs)`` for each batch, every row's outputs from its task's expert.

    One reader per expert, fed that expert's rows of every batch (each batch holds rows of every
    task), read in step; the outputs are merged back in row order."""
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(DistillReader([_rows(b, i) for b in batches], teachers=experts[task],
                                                     **options))
                   for i, task in enumerate(TASKS)]
        for batch, answered in zip(batches, zip(*readers, strict=True), strict=True):
            yield batch, _merge(batch, [outputs for _, outputs in answered])


def single_pairs(batches: Iterable[dict[str, Tensor]], endpoint: str,
                 options: Mapping[str, Any]) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """``(batch, outputs)`` for each batch, all rows from the one teacher at ``endpoint``."""
    with DistillReader(batches, teachers=endpoint, **options) as reader:
        yield from reader


class RoutedScorer:
    """On-policy scoring, each row by its task's expert: one loader-less reader per expert."""

    def __init__(self, experts: Mapping[str, str], options: Mapping[str, Any]) -> None:
        self._readers = [DistillReader(None, teachers=experts[task], **options) for task in TASKS]

    def __enter__(self) -> RoutedScorer:
        for reader in self._readers:
            reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for reader in self._readers:
            reader.close()

    def score(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The outputs of ``batch``, each row's from its expert (the experts work on their parts at once)."""
        futures = [reader.submit(_rows(batch, i)) for i, reader in enumerate(self._readers)]
        return _merge(batch, [f.result() for f in futures])
