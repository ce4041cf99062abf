"""Serve the trained CV teacher with ``teacher-server``: prints the exact command, then runs it.

    python -m examples.cv.serve                                    # 127.0.0.1:9898, unregistered
    python -m examples.cv.serve --registry etcd://127.0.0.1:2379   # also register as service cv-teacher
    python -m examples.cv.serve --from pt2 --print                 # only print the command (model file form)
    python -m examples.cv.serve -- --instances 2                   # anything after -- goes to teacher-server

The process *becomes* the server (exec), so Ctrl-C / SIGTERM reach it directly and it drains:
it deregisters, finishes in-flight requests and exits. ``--smoke`` instead starts it on a free
port, checks one batch of test digits against the in-process teacher, and stops it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np
import torch

from examples.common import ServeCommand, build_serve_parser, serve_main, teacher_server_process
from examples.cv import data
from examples.cv.export import io_flags
from examples.cv.teacher import WEIGHTS_ENV, load_teacher, weights_path

MODEL_NAME = "cv_teacher"
SERVICE = "cv-teacher"
SOURCES = ("factory", "torchscript", "pt2")


def teacher_args(
    *,
    source: str = "factory",
    port: int = 9898,
    device: str = "cpu",
    registry: str | None = None,
    service: str = SERVICE,
    extra: Sequence[str] = (),
) -> list[str]:
    """The teacher-server arguments (after the program name) for one form of the CV teacher."""
    if source == "factory":
        model = ["--model", "examples.cv.teacher:build"]
    else:
        path = weights_path().parent / ("teacher.ts" if source == "torchscript" else "teacher.pt2")
        model = ["--model", str(path), *io_flags()]
    args = [*model, "--name", MODEL_NAME, "--device", device, "--port", str(port)]
    if registry:
        args += ["--registry", registry, "--service", service]
    return [*args, *extra]


def _check_files(source: str) -> str | None:
    """A message saying which script to run first, or None when the model can be served."""
    if not weights_path().is_file():
        return f"no trained teacher at {weights_path()}: run `python -m examples.cv.train_teacher` first"
    if source != "factory":
        path = weights_path().parent / ("teacher.ts" if source == "torchscript" else "teacher.pt2")
        if not path.is_file():
            return f"no exported model at {path}: run `python -m examples.cv.export` first"
    return None


def smoke(args: list[str]) -> int:
    """Start the server with ``args`` (use port 0: a free one), compare one batch of test digits
    with the in-process teacher, stop it. Returns the exit code."""
    import tritonclient.grpc as tg

    with teacher_server_process(args) as endpoint:
        x = data.load().test_x[:64].numpy()
        inp = tg.InferInput("INPUT", list(x.shape), "FP32")
        inp.set_data_from_numpy(np.ascontiguousarray(x))
        with tg.InferenceServerClient(endpoint) as client:
            served = client.infer(MODEL_NAME, [inp]).as_numpy("LOGITS")
    with torch.inference_mode():
        local = load_teacher()(torch.from_numpy(x)).numpy()
    agree = int((served.argmax(1) == local.argmax(1)).sum())
    print(f"smoke: {endpoint} answered 64 test digits; {agree}/64 predictions match the in-process teacher")
    return 0 if agree == 64 else 1


COMMAND = ServeCommand(
    example="cv", description=__doc__.split("\n")[0], default_port=9898, service=SERVICE, sources=SOURCES,
    weights_env=WEIGHTS_ENV, teacher_args=teacher_args, check_files=_check_files, smoke=smoke,
    from_help="serve the module:factory, or a file written by examples.cv.export",
    smoke_help="serve briefly on a free port, check one batch, stop",
)


def build_parser() -> argparse.ArgumentParser:
    return build_serve_parser(COMMAND)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
