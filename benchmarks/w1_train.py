"""W1 with a real student: a student trained on the device with a teacher's soft labels, the teacher
served (a teacher-server on the same device, through `DistillReader`) against the teacher in the
training process.

  pure     the student's training step on hard labels alone: the ceiling
  inline   the teacher's forward pass in the training loop (the best plain PyTorch: inference mode,
           autocast, channels_last and cudnn.benchmark on CUDA), then the student's step with KDLoss
  service  DistillReader over a teacher-server on the same device, outputs delivered on the device;
           the same step

Each step moves a uint8 image batch from pinned host memory to the device, runs the student under
autocast, and steps SGD; nothing synchronizes inside a pass, only at its ends. The modes are
interleaved per repetition; the headline is the median of the per-repetition ratios. Before timing,
the served teacher's logits are checked against the in-process teacher's on one batch.

On one GPU the served teacher shares the device with the student, as the in-process one does; the
served teacher's work overlaps the student's step instead of running between steps.

    python -m benchmarks.w1_train --device cuda --compute-dtype FP16   # ResNet-18 student, ResNet-50 teacher
    python -m benchmarks.w1_train --quick                                # CPU smoke: small convnets, 32x32

On CUDA the defaults need torchvision (the GPU image has it); `--student` / `--teacher` take any
`module:factory` whose model maps uint8 `IMAGES` to `LOGITS`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common import REPO_ROOT, interleave, machine_info, median, paired_ratios, run_and_report
from benchmarks.device import DeviceChoice, InProcessModel, add_device_args
from distill import DistillReader, KDLoss
from teacher_server.launch import TeacherProcess
from teacher_server.spec import ModelIO

SMALL_IO = ModelIO.parse(["IMAGES:UINT8:3,32,32"], ["LOGITS:FP32:10"])
Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # images, labels, teacher logits


class ConvNet(nn.Module):
    """uint8 32x32 images to 10 class logits: conv blocks whose width and depth set the cost."""

    io_spec = SMALL_IO

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(images.float().div(255.0)))
        return out


def small_teacher() -> ConvNet:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ConvNet(width=48, depth=4)


def small_student() -> ConvNet:
    return ConvNet(width=16, depth=2)


def resnet18_student() -> nn.Module:
    """ResNet-18 on uint8 224x224 images (torchvision, random weights), the student of the GPU run."""
    from benchmarks.cv_teacher import ScaledImages

    try:
        from torchvision.models import resnet18
    except ImportError as e:
        raise SystemExit("benchmarks.w1_train:resnet18_student needs torchvision") from e
    return ScaledImages(resnet18(weights=None))


def _factory(ref: str) -> Callable[[], nn.Module]:
    module, _, name = ref.partition(":")
    fn: Callable[[], nn.Module] = getattr(importlib.import_module(module), name)
    return fn


@dataclass(frozen=True)
class Settings:
    choice: DeviceChoice
    teacher: str
    student: str
    batch: int
    steps: int
    warmup: int
    reps: int
    pool: int
    prefetch: int
    out: str


class Trainer:
    """The student's training step, the same in every mode."""

    def __init__(self, s: Settings) -> None:
        self.choice = s.choice
        self.device = s.choice.torch_device
        self.model = _factory(s.student)().to(self.device).train()
        if s.choice.cuda:
            torch.backends.cudnn.benchmark = True
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.kd = KDLoss(temperature=2.0, alpha=0.5)

    def place(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.choice.cuda else x

    def step(self, images: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None) -> None:
        x, y = self.place(images), labels.to(self.device, non_blocking=True)
        with self.choice.autocast():
            logits = self.model(x)
        loss = (nn.functional.cross_entropy(logits.float(), y) if teacher is None
                else self.kd(logits.float(), teacher.float(), y))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        self.choice.synchronize()


@torch.inference_mode()
def teacher_logits(teacher: InProcessModel, images: torch.Tensor) -> torch.Tensor:
    """The in-process teacher's logits for a batch already on the device (no autograd graph)."""
    return teacher(images).float()


def _shapes(model: nn.Module, ref: str) -> tuple[tuple[int, ...], int]:
    """The teacher's image shape and class count, from its declared `io_spec` (uint8 IMAGES -> LOGITS)."""
    spec = getattr(model, "io_spec", None)
    if not isinstance(spec, ModelIO) or [t.datatype for t in spec.inputs] != ["UINT8"] or len(spec.outputs) != 1:
        raise SystemExit(f"teacher {ref}: its io_spec must declare one UINT8 input (images) and one output (logits)")
    return spec.inputs[0].shape, spec.outputs[0].shape[-1]


def _pool(s: Settings, image: tuple[int, ...], classes: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    pin = s.choice.cuda
    out = []
    for _ in range(s.pool):
        images = torch.randint(0, 256, (s.batch, *image), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, classes, (s.batch,), generator=g)
        out.append({"IMAGES": images.pin_memory() if pin else images, "LABELS": labels.pin_memory() if pin else labels})
    return out


def _loader(pool: list[dict[str, torch.Tensor]], n: int) -> Iterator[dict[str, torch.Tensor]]:
    return (pool[i % len(pool)] for i in range(n))


def timed(trainer: Trainer, batches: Iterator[Batch], s: Settings) -> float:
    """Samples/s of `s.steps` steps after `s.warmup` untimed ones."""
    started = 0.0
    done = 0
    for i, (images, labels, teacher) in enumerate(batches):
        if i == s.warmup:
            trainer.sync()
            started = time.perf_counter()
        trainer.step(images, labels, teacher)
        done = i + 1
        if done == s.warmup + s.steps:
            break
    trainer.sync()
    assert done == s.warmup + s.steps, f"the loader ran dry after {done} batches"
    return s.steps * s.batch / (time.perf_counter() - started)


def run(s: Settings) -> dict[str, Any]:
    s.choice.check()
    torch.manual_seed(0)
    # The teacher in the training process, as the best plain PyTorch runs it, not synchronized per call.
    inline = InProcessModel(_factory(s.teacher)(), s.choice, images=True, sync=False)
    image, classes = _shapes(inline.model, s.teacher)
    pool = _pool(s, image, classes)
    total = s.warmup + s.steps
    trainer = Trainer(s)
    server = ["--model", s.teacher, "--name", "teacher", *s.choice.server_args(), "--port", "0",
              "--max-batch-size", str(2 * s.batch), "--log-level", "WARNING"]
    with TeacherProcess(server, label="teacher", cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                        ready_timeout=600.0, stop_grace=20.0) as teacher:

        def reader(n: int) -> DistillReader:
            return DistillReader(_loader(pool, n), teachers=teacher.endpoint, inputs=["IMAGES"], outputs=["LOGITS"],
                                 device=s.choice.device, prefetch=s.prefetch, timeout=120.0)

        with reader(1) as r:  # the check: served logits against the in-process teacher's, on one batch
            batch, served = next(iter(r))
        want = teacher_logits(inline, trainer.place(batch["IMAGES"]))
        diff = float((served["LOGITS"].float() - want).abs().max())
        scale = float(want.abs().max())
        agree = float((served["LOGITS"].argmax(1) == want.argmax(1)).float().mean())
        tolerance = 1e-3 * max(1.0, scale) if s.choice.compute_dtype == "FP32" else 0.05 * max(1.0, scale)
        assert diff <= tolerance, f"served logits differ from the in-process teacher's by {diff} (scale {scale})"

        def pure() -> float:
            return timed(trainer, ((b["IMAGES"], b["LABELS"], None) for b in _loader(pool, total)), s)

        def inline_mode() -> float:
            return timed(trainer, ((b["IMAGES"], b["LABELS"], teacher_logits(inline, trainer.place(b["IMAGES"])))
                                   for b in _loader(pool, total)), s)

        def service() -> float:
            with reader(total) as r:
                return timed(trainer, ((b["IMAGES"], b["LABELS"], out["LOGITS"]) for b, out in r), s)

        def show(rep: int, name: str, rate: float) -> None:
            print(f"rep {rep + 1}/{s.reps} {name:<8} {rate:9,.0f} samples/s", flush=True)

        rates = interleave(s.reps, {"pure": pure, "inline": inline_mode, "service": service}, show)
    ratios = {"service_vs_pure": paired_ratios(rates["service"], rates["pure"]),
              "service_vs_inline": paired_ratios(rates["service"], rates["inline"]),
              "inline_vs_pure": paired_ratios(rates["inline"], rates["pure"])}
    return {
        "benchmark": "w1_train",
        "settings": {**s.choice.info(), "teacher": s.teacher, "student": s.student, "image": list(image),
                     "classes": classes, "batch": s.batch, "steps": s.steps, "warmup": s.warmup, "reps": s.reps,
                     "prefetch": s.prefetch, "teacher_server": "the server's defaults for the device"},
        "machine": machine_info(),
        "check": {"max_abs_diff": diff, "logit_scale": scale, "argmax_agreement": agree},
        "samples_per_s": {name: [round(r, 1) for r in rs] for name, rs in rates.items()},
        "median_samples_per_s": {name: round(median(rs), 1) for name, rs in rates.items()},
        "per_rep_ratios": {name: [round(r, 4) for r in rs] for name, rs in ratios.items()},
        "ratios": {name: round(median(rs), 4) for name, rs in ratios.items()},
    }


def report(doc: dict[str, Any]) -> str:
    med, ratios, st = doc["median_samples_per_s"], doc["ratios"], doc["settings"]
    where = st["gpu"] or st["device"]
    return "\n".join([
        f"W1 with a real student on {where} ({st['compute_dtype']}): student {st['student']}, teacher {st['teacher']}, "
        f"batch {st['batch']}",
        *(f"{name:<8} {med[name]:9,.0f} samples/s" for name in ("pure", "inline", "service")),
        f"service / pure {ratios['service_vs_pure']:.3f}, service / inline {ratios['service_vs_inline']:.3f}, "
        f"inline / pure {ratios['inline_vs_pure']:.3f} (medians of per-repetition ratios)",
        f"served vs in-process teacher logits: max |diff| {doc['check']['max_abs_diff']:.3g}, argmax agreement "
        f"{doc['check']['argmax_agreement']:.3f}"])


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w1_train", description=__doc__.splitlines()[0])
    add_device_args(p)
    p.add_argument("--teacher", default=None, help="module:factory (default: ResNet-50 on CUDA, a convnet on CPU)")
    p.add_argument("--student", default=None, help="module:factory (default: ResNet-18 on CUDA, a convnet on CPU)")
    p.add_argument("--batch", type=int, default=None, help="samples per step (default 128 on CUDA, 64 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode and repetition (default 100)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    p.add_argument("--prefetch", type=int, default=4, help="the reader's read-ahead (default 4)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 repetitions of 10 steps")
    p.add_argument("--out", default=None, help="the results file's name (default w1_train[_gpu])")
    a = p.parse_args(argv)
    choice = DeviceChoice.from_args(a)
    for name in ("batch", "steps", "reps"):
        value = getattr(a, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1")
    gpu = choice.cuda
    return Settings(
        choice=choice,
        teacher=a.teacher or ("benchmarks.cv_teacher:resnet50" if gpu else "benchmarks.w1_train:small_teacher"),
        student=a.student or ("benchmarks.w1_train:resnet18_student" if gpu else "benchmarks.w1_train:small_student"),
        batch=a.batch or (128 if gpu else 64),
        steps=a.steps or (10 if a.quick else 100), warmup=3 if a.quick else 10, reps=a.reps or (2 if a.quick else 5),
        pool=4 if a.quick else 16, prefetch=a.prefetch, out=a.out or ("w1_train_gpu" if gpu else "w1_train"))


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: run(s), s.out, report)


if __name__ == "__main__":
    sys.exit(main())
