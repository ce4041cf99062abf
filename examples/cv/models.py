"""The CV teacher (a wider CNN) and student (a tiny MLP) for 8x8 digits.

The gap between them is the point of the example: the student has 5x fewer parameters and no
convolutions, so it cannot discover translation invariance from a few labelled images by itself;
the teacher's soft outputs on shifted images carry that knowledge to it.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.spec import ModelIO

IO = ModelIO.parse(inputs=["INPUT:FP32:1,8,8"], outputs=["LOGITS:FP32:10"])
"""What the teacher looks like on the wire: one image in, ten logits out."""


class TeacherCNN(nn.Module):
    """Three 3x3 conv layers (16-32-64 channels, batch norm) and a linear head; ~24k parameters."""

    io_spec = IO

    def __init__(self, width: int = 16, classes: int = 10, dropout: float = 0.2) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1),
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(2 * w, 4 * w, 3, padding=1),
            nn.BatchNorm2d(4 * w),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * w, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


class StudentMLP(nn.Module):
    """Flatten → Linear(64, hidden) → ReLU → Linear(hidden, 10); ~4.8k parameters at hidden=64."""

    def __init__(self, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
