"""The example's mesh: a local etcd, the teacher server registered in it, and the readers' keywords.

Why a registry rather than a fixed ``host:port``: a batch of texts goes only to a teacher whose
registry record declares the ``text_prompts`` capability (a teacher-server with its tokenizer
declares it when it registers); a teacher known only by its address declares nothing, so the
reader would refuse to send it texts. So the run starts a single-member etcd on loopback
(``discovery.local_etcd.LocalEtcd``) and one ``python -m teacher_server --model hf:DIR`` that
registers under ``SERVICE``; both KD arms find it there, and both are stopped when the run ends.

The server's defaults are the LLM example's (``examples.llm.mesh``: top-k log-probabilities with
the tail, float16 values, ``--max-batch-size`` the student's batch size, no queue delay); the
readers state the same settings on every request anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from examples.llm.mesh import MODEL_NAME, teacher_version

SERVICE = "crosstok-teacher"
OUTPUT = "LOGITS"


@dataclass(frozen=True)
class Mesh:
    """Where the teacher is: the registry and service the readers use, and the server's own
    ``host:port`` (the vocabulary request goes to it directly)."""

    registry: str
    service: str
    endpoint: str

    def reader_location(self) -> dict[str, Any]:
        """``DistillReader`` keywords that find the teacher: the registry, the service, the model."""
        return {"registry": self.registry, "service": self.service, "model": MODEL_NAME}


@contextlib.contextmanager
def serve(teacher_dir: Any, *, k: int, temperature: float, max_batch_size: int, threads: int,
          ready_timeout: float = 180.0) -> Iterator[Mesh]:
    """A local etcd and one teacher server for ``teacher_dir`` registered in it; stopped on exit."""
    from discovery.local_etcd import LocalEtcd
    from teacher_server.launch import TeacherProcess

    with LocalEtcd() as etcd:
        args = ["--model", f"hf:{teacher_dir}", "--name", MODEL_NAME, "--version", teacher_version(teacher_dir),
                "--device", "cpu", "--threads", str(threads), "--max-batch-size", str(max_batch_size),
                "--max-queue-delay-us", "0", "--top-k", str(k), "--logprobs", "--topk-tail",
                "--temperature", str(temperature), "--output-dtype", "FP16", "--host", "127.0.0.1",
                "--registry", etcd.address, "--service", SERVICE]
        with TeacherProcess(args, label="crosstok-teacher", ready_timeout=ready_timeout, stop_grace=10.0) as server:
            yield Mesh(etcd.address, SERVICE, server.endpoint)


def topk_options(*, k: int, temperature: float) -> dict[str, Any]:
    """The request settings every KD arm states: top-k log-probabilities with the tail, float16."""
    return {"top_k": k, "logprobs": True, "topk_tail": True, "temperature": temperature, "output_dtype": "FP16"}
