"""A CV teacher of a real shape for GPU measurements: ResNet-50 (torchvision), random weights.

    teacher-server --model benchmarks.cv_teacher:resnet50 --device cuda --compute-dtype FP16

Its input is what a real image pipeline sends, uint8 `[3, 224, 224]` (a quarter of the bytes of
fp32), scaled on the device; its output is the 1,000 ImageNet logits. torchvision is imported
when the factory is called: the GPU image has it, the project does not depend on it.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.spec import ModelIO

IO = ModelIO.parse(inputs=["IMAGES:UINT8:3,224,224"], outputs=["LOGITS:FP32:1000"])


class ScaledImages(nn.Module):
    """uint8 pixels to [0, 1] floats on the model's device, then the network."""

    io_spec = IO

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(images.float().div_(255.0))
        return out


def resnet50(seed: int = 0) -> ScaledImages:
    """ResNet-50 with seeded random weights (the shape is what is measured, not the accuracy)."""
    try:
        from torchvision.models import resnet50 as tv_resnet50
    except ImportError as e:
        raise SystemExit("benchmarks.cv_teacher:resnet50 needs torchvision (pip install torchvision "
                         "matching your torch)") from e
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ScaledImages(tv_resnet50(weights=None))
