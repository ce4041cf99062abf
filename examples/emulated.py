"""The emulated accelerator of W1 (and W4/W5; docs/design/workloads.md): a teacher, a student step and a loader.

W1 asks what the mesh costs a training loop, not how fast a CPU runs a network, so the expensive
parts are emulated by sleeps: the teacher spends a fixed time per batch of up to 256 samples and
the student step a fixed time per batch. `time.sleep` releases the GIL, as a real accelerator
kernel launch-and-wait does, so whatever CPU the mesh itself burns (serialization, gRPC, Python
bookkeeping) shows up in the measurement instead of being hidden behind a busy model.

Serve the teacher with `teacher-server --model examples.emulated:build --name emulated`; its
per-batch time comes from EMULATED_TEACHER_MS (default 20) because a factory takes no flags.

The logits are a cheap deterministic function of the input (4x4 average pooling followed by a
seeded linear map), so a benchmark can check that the outputs a student received through the
mesh belong to the batch it received them with: rebuild the model in-process, recompute, compare.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.spec import ModelIO

IO = ModelIO.parse(inputs=["INPUT:FP32:3,32,32"], outputs=["LOGITS:FP32:100"])

INPUT_SHAPE = (3, 32, 32)
CLASSES = 100
BATCH = 256
TEACHER_MS_ENV = "EMULATED_TEACHER_MS"
DEFAULT_TEACHER_MS = 20.0
DEFAULT_STUDENT_MS = 25.0
_POOL = 4  # pooled to [3, 4, 4] = 48 features: cheap, yet every pixel moves the logits


class EmulatedTeacher(nn.Module):
    """Sleeps `step_ms` per started batch of `max_batch` samples, then returns cheap logits.

    A batch of 1..256 samples costs one step and 257..512 two, as on an accelerator whose batch
    is sized to 256: the server's dynamic batcher gains by filling batches, not by splitting them.
    The weights are buffers (not parameters): nothing here is trained, and `.to(device)` still
    moves them.
    """

    io_spec = IO
    weight: torch.Tensor
    bias: torch.Tensor

    def __init__(self, step_ms: float = DEFAULT_TEACHER_MS, max_batch: int = BATCH, classes: int = CLASSES,
                 seed: int = 0) -> None:
        super().__init__()
        if step_ms < 0:
            raise ValueError(f"step_ms must be >= 0, got {step_ms}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.step_s = step_ms / 1000.0
        self.max_batch = max_batch
        features = INPUT_SHAPE[0] * _POOL * _POOL
        gen = torch.Generator().manual_seed(seed)  # private generator: the global RNG is left alone
        self.register_buffer("weight", torch.randn(features, classes, generator=gen) / math.sqrt(features))
        self.register_buffer("bias", torch.randn(classes, generator=gen) * 0.1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs without the emulated compute time: what a checker compares against."""
        pooled = F.adaptive_avg_pool2d(x, _POOL).flatten(1)
        out: torch.Tensor = torch.addmm(self.bias, pooled, self.weight)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = max(1, math.ceil(x.shape[0] / self.max_batch))
        if self.step_s:
            time.sleep(self.step_s * steps)  # releases the GIL, like waiting on a device
        return self.logits(x)


def build(step_ms: float | None = None, seed: int = 0) -> EmulatedTeacher:
    """`teacher-server --model examples.emulated:build`; the step time comes from EMULATED_TEACHER_MS."""
    if step_ms is None:
        step_ms = float(os.environ.get(TEACHER_MS_ENV, DEFAULT_TEACHER_MS))
    return EmulatedTeacher(step_ms=step_ms, seed=seed).eval()


def student_step(batch: Any, teacher_logits: torch.Tensor | None = None, step_ms: float = DEFAULT_STUDENT_MS) -> None:
    """The emulated student's forward + backward + optimizer step: a sleep that releases the GIL.

    It takes the batch and the teacher outputs only so call sites read like a training loop;
    it checks the teacher outputs' shape, which costs nothing and catches a wiring mistake.
    """
    if teacher_logits is not None and teacher_logits.shape[-1] != CLASSES:
        raise ValueError(f"teacher logits have shape {tuple(teacher_logits.shape)}, expected [N, {CLASSES}]")
    if step_ms:
        time.sleep(step_ms / 1000.0)


class W1Loader:
    """A re-iterable loader of `steps` W1 batches: {"INPUT": [256,3,32,32] fp32, "label": [256] int64, "index": i}.

    Inputs come from a few pre-generated batches reused round-robin, so iterating costs
    nothing and the measurement is the mesh's, not the loader's. With `distinct=True` batch i
    is `pool[i % pool_size] + i * 1e-3` instead (one 3 MB add per batch), so every batch of a
    long epoch has different inputs and `inputs(i)` rebuilds them for checking teacher outputs.
    Every `iter()` starts a new epoch from index 0.
    """

    def __init__(self, steps: int, *, batch_size: int = BATCH, pool: int = 4, distinct: bool = False,
                 seed: int = 0) -> None:
        if steps < 0 or batch_size < 1 or pool < 1:
            raise ValueError("steps must be >= 0, batch_size and pool >= 1")
        self.steps = steps
        self.batch_size = batch_size
        self.distinct = distinct
        gen = torch.Generator().manual_seed(seed)
        self._x = [torch.randn((batch_size, *INPUT_SHAPE), generator=gen) for _ in range(pool)]
        self._y = [torch.randint(0, CLASSES, (batch_size,), generator=gen) for _ in range(pool)]

    def __len__(self) -> int:
        return self.steps

    def inputs(self, index: int) -> torch.Tensor:
        """The INPUT tensor of batch `index` (a shared pool tensor unless `distinct`: do not modify it)."""
        x = self._x[index % len(self._x)]
        return x + index * 1e-3 if self.distinct else x

    def batch(self, index: int) -> dict[str, Any]:
        return {"INPUT": self.inputs(index), "label": self._y[index % len(self._y)], "index": index}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.steps):
            yield self.batch(i)
