"""Export the trained NLP teacher as a ``torch.export`` program (``teacher.pt2``).

    python -m examples.nlp.export
    teacher-server --model ~/.cache/distill-mesh/nlp/teacher.pt2 \\
        --input TOKENS:INT64:16 --output LOGITS:FP32:120 --name nlp_teacher --device cpu --port 9899

Only ``torch.export`` here: TorchScript is deprecated, and ``torch.jit.script`` cannot compile this
model as written (it closes over a module constant); the CV example shows TorchScript. The
program has a dynamic batch dimension, and is checked against the eager model before reporting.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from examples.nlp import data
from examples.nlp.models import IO
from examples.nlp.teacher import load_teacher, weights_path
from teacher_server.model import ModelLoadError


def io_flags() -> list[str]:
    """The ``--input/--output`` flags a model file needs (the factory declares them itself)."""
    flags: list[str] = []
    for kind, specs in (("--input", IO.inputs), ("--output", IO.outputs)):
        for s in specs:
            flags += [kind, f"{s.name}:{s.datatype}:{','.join(map(str, s.shape))}"]
    return flags


def export(weights: Path, out: Path) -> Path:
    """Write ``out`` (.pt2) and check it against the eager teacher; ``RuntimeError`` on mismatch."""
    model = load_teacher(weights)
    example = data.test_set(8).tokens
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, (example,), dynamic_shapes={"tokens": {0: batch}})
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(out))
    loaded = torch.export.load(str(out)).module()
    x = data.test_set(64).tokens
    with torch.inference_mode():
        err = float((loaded(x) - model(x)).abs().max())
    if err > 1e-4:
        raise RuntimeError(f"{out} differs from the eager teacher by {err:.2e}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.nlp.export", description=__doc__.split("\n")[0])
    p.add_argument("--weights", type=Path, default=None, help=f"trained state dict (default: {weights_path()})")
    p.add_argument("--out", type=Path, default=None, help="program file (default: teacher.pt2 beside the weights)")
    p.add_argument("--smoke", action="store_true", help="same as a normal run (exporting takes seconds)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    weights = args.weights or weights_path()
    out = args.out or weights.parent / "teacher.pt2"
    try:
        export(weights, out)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"pt2: {out} (matches the eager teacher)")
    print(f"  serve: teacher-server --model {out} {' '.join(io_flags())} --name nlp_teacher --device cpu --port 9899")
    print("  or the factory: teacher-server --model examples.nlp.teacher:build --name nlp_teacher --device cpu "
          "--port 9899")
    return 0


if __name__ == "__main__":
    sys.exit(main())
