"""Export the trained CV teacher as model files the teacher-server loads without this repository's code.

    python -m examples.cv.export                 # writes teacher.ts (TorchScript) and teacher.pt2 (torch.export)

Three ways to serve the same weights, all with ``teacher-server``:

* ``--model examples.cv.teacher:build``: a ``module:factory``; needs this package importable, and
  declares its tensors itself (``io_spec``);
* ``--model <dir>/teacher.ts --input INPUT:FP32:1,8,8 --output LOGITS:FP32:10``: TorchScript;
* ``--model <dir>/teacher.pt2 --input ... --output ...``: a ``torch.export`` program, the format
  PyTorch recommends now that TorchScript is deprecated.

A model file carries no ``io_spec``, hence the ``--input/--output`` flags. Every exported file is
checked against the eager model on a batch before this script reports success.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from examples.cv.models import IO
from examples.cv.teacher import load_teacher, weights_path
from teacher_server.model import ModelLoadError

FORMATS = ("torchscript", "pt2")


def io_flags() -> list[str]:
    """The ``--input/--output`` flags a model file needs (the factory declares them itself)."""
    flags: list[str] = []
    for kind, specs in (("--input", IO.inputs), ("--output", IO.outputs)):
        for s in specs:
            flags += [kind, f"{s.name}:{s.datatype}:{','.join(map(str, s.shape))}"]
    return flags


def export_torchscript(model: torch.nn.Module, path: Path) -> Path:
    """``torch.jit.script`` + ``torch.jit.save``. TorchScript is deprecated in PyTorch 2.x but still
    what many serving stacks load; the warning is silenced here because the user asked for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model)
        torch.jit.save(scripted, str(path))
    return path


def export_program(model: torch.nn.Module, path: Path) -> Path:
    """``torch.export`` with a dynamic batch dimension (the server batches requests together)."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    example = torch.zeros(4, *IO.inputs[0].shape)
    program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))
    return path


def _check(path: Path, model: torch.nn.Module) -> float:
    """Max |file - eager| on a random batch; loads the file the way the server does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load: see export_torchscript
        loaded = torch.export.load(str(path)).module() if path.suffix == ".pt2" else torch.jit.load(str(path))
    x = torch.rand(7, *IO.inputs[0].shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return float((loaded(x) - model(x)).abs().max())


def export(weights: Path, out_dir: Path, formats: Sequence[str] = FORMATS) -> dict[str, Path]:
    """Write the requested formats into ``out_dir``; raise ``RuntimeError`` if one does not match."""
    model = load_teacher(weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for fmt in formats:
        path = out_dir / ("teacher.ts" if fmt == "torchscript" else "teacher.pt2")
        (export_torchscript if fmt == "torchscript" else export_program)(model, path)
        err = _check(path, model)
        if err > 1e-4:
            raise RuntimeError(f"{path} differs from the eager teacher by {err:.2e}")
        written[fmt] = path
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.cv.export", description=__doc__.split("\n")[0])
    p.add_argument("--weights", type=Path, default=None, help=f"trained state dict (default: {weights_path()})")
    p.add_argument("--out-dir", type=Path, default=None, help="where to write (default: beside the weights)")
    p.add_argument("--format", choices=[*FORMATS, "all"], default="all", help="(default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="same as a normal run (exporting takes seconds)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    weights = args.weights or weights_path()
    out_dir = args.out_dir or weights.parent
    formats = FORMATS if args.format == "all" else (args.format,)
    try:
        written = export(weights, out_dir, formats)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    flags = " ".join(io_flags())
    for fmt, path in written.items():
        print(f"{fmt}: {path} (matches the eager teacher)")
        print(f"  serve: teacher-server --model {path} {flags} --name cv_teacher --device cpu --port 9898")
    print("  or the factory: teacher-server --model examples.cv.teacher:build --name cv_teacher --device cpu "
          "--port 9898")
    return 0


if __name__ == "__main__":
    sys.exit(main())
