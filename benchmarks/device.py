"""Where a benchmark runs its models: `--device` (cpu, cuda, cuda:N) and `--compute-dtype`.

Every serving benchmark (serving.py, mesh.py, llm_serving.py) takes both flags, hands them to the
teacher servers it starts, and runs its in-process baseline the same way, as the best plain
PyTorch a user would write on that device (`InProcessModel`): on CUDA, inputs already on the
device, cudnn.benchmark on, channels_last for image models, autocast in the compute dtype, and
every call finished (synchronized) before the next is timed. The JSON names the device, the GPU
and the dtype (`DeviceChoice.info`). On the CPU with FP32 (the defaults) nothing changes.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def parse_device(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"device {text!r}: use cpu, cuda or cuda:N")
    return text


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=parse_device, default="cpu",
                        help="where the teacher servers and the in-process baseline run: cpu, cuda, cuda:N "
                        "(default cpu)")
    parser.add_argument("--compute-dtype", type=str.upper, choices=list(DTYPES), default="FP32",
                        help="the models' compute dtype, servers and baseline alike (default FP32)")


@dataclass(frozen=True)
class DeviceChoice:
    device: str = "cpu"
    compute_dtype: str = "FP32"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DeviceChoice:
        return cls(args.device, args.compute_dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]

    @property
    def cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def autocast(self, enabled: bool = True) -> torch.autocast:
        """Autocast to the compute dtype on this device (a no-op for FP32, or with enabled=False)."""
        on = enabled and self.compute_dtype != "FP32"
        return torch.autocast(self.torch_device.type, dtype=self.dtype, enabled=on)

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
        if self.cuda:
            torch.cuda.synchronize(self.torch_device)

    def server_args(self) -> list[str]:
        return ["--device", self.device, "--compute-dtype", self.compute_dtype]

    def check(self) -> None:
        """Refuse a CUDA device this machine does not have, before any server starts."""
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit(f"--device {self.device}: CUDA is not available on this machine")

    def info(self) -> dict[str, Any]:
        """What the JSON records about where the models ran."""
        d: dict[str, Any] = {"device": self.device, "compute_dtype": self.compute_dtype, "gpu": None}
        if self.cuda and torch.cuda.is_available():
            index = self.torch_device.index if self.torch_device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            d |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                  "cuda": torch.version.cuda}
        return d


class InProcessModel:
    """A model as the in-process baseline runs it on `choice`'s device (see the module's doc).

    Called with a host or device tensor, returns the output on the device, the call finished
    (`sync=False`: only enqueued, for a caller whose next work on the device orders after it, as
    a training loop's step does)."""

    def __init__(self, model: torch.nn.Module, choice: DeviceChoice, *, images: bool = False,
                 sync: bool = True) -> None:
        self.choice = choice
        self.sync = sync
        self.images = images and choice.cuda
        self.model = model.to(choice.torch_device).eval()
        if choice.cuda:
            torch.backends.cudnn.benchmark = True
            if self.images:
                self.model = self.model.to(memory_format=torch.channels_last)

    def place(self, x: torch.Tensor) -> torch.Tensor:
        """An input where the model wants it (hoist this out of a timed loop)."""
        x = x.to(self.choice.torch_device)
        return x.contiguous(memory_format=torch.channels_last) if self.images and x.dim() == 4 else x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.place(x)
        with self.choice.autocast():
            out: torch.Tensor = self.model(x)
        if self.sync:
            self.choice.synchronize()
        return out
