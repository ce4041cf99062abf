"""RefTeacher, the reference model of W2/W3 (docs/design/workloads.md): an MLP 3072→2048→2048→100 with GELU.

Serve it with `teacher-server --model examples.refteacher:build --name ref_teacher`. Its tensors
are declared on the module (`io_spec`), so no --input/--output flags are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.spec import ModelIO

IO = ModelIO.parse(inputs=["INPUT:FP32:3,32,32"], outputs=["LOGITS:FP32:100"])


class RefTeacher(nn.Module):
    io_spec = IO

    def __init__(self, hidden: int = 2048, classes: int = 100) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(3 * 32 * 32, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def build(seed: int = 0) -> RefTeacher:
    """Deterministic weights (seeded), so a test can rebuild the same model in-process."""
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        return RefTeacher().eval()
