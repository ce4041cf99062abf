"""A validated request, as the batcher queues it and a model instance runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from teacher_server.outputs import OutputTransform


@dataclass
class Work:
    """One request's share of a batch: decoded inputs (CPU, declared order) and wanted outputs."""

    inputs: list[torch.Tensor]
    batch_size: int
    outputs: list[OutputTransform]
