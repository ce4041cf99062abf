"""Serve the trained NLP teacher with ``teacher-server``: prints the exact command, then runs it.

    python -m examples.nlp.serve                                    # 127.0.0.1:9899, unregistered
    python -m examples.nlp.serve --registry etcd://127.0.0.1:2379   # also register as nlp-teacher
    python -m examples.nlp.serve --from pt2 --print                 # only print the command
    python -m examples.nlp.serve -- --top-k 10                      # top-10 logits by default, for every client

Top-k: a student asks per request (``DistillReader(top_k=10)``, ``--top_k 10`` in
``examples.nlp.train_student``) and gets ``LOGITS_TOPK_VALUES``/``LOGITS_TOPK_INDICES``;
``--top-k`` on the server makes top-k the default for clients that do not ask, so those students
must also pass ``top_k``. The process becomes the server (exec): Ctrl-C / SIGTERM drain it.
``--smoke`` starts it on a free port, checks one top-10 request against the in-process teacher,
and stops it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np
import torch

from examples.common import ServeCommand, build_serve_parser, serve_main, teacher_server_process
from examples.nlp import data
from examples.nlp.export import io_flags
from examples.nlp.teacher import WEIGHTS_ENV, load_teacher, weights_path

MODEL_NAME = "nlp_teacher"
SERVICE = "nlp-teacher"
SOURCES = ("factory", "pt2")


def teacher_args(*, source: str = "factory", port: int = 9899, device: str = "cpu", registry: str | None = None,
                 service: str = SERVICE, extra: Sequence[str] = ()) -> list[str]:
    """The teacher-server arguments (after the program name) for one form of the NLP teacher."""
    if source == "factory":
        model = ["--model", "examples.nlp.teacher:build"]
    else:
        model = ["--model", str(weights_path().parent / "teacher.pt2"), *io_flags()]
    args = [*model, "--name", MODEL_NAME, "--device", device, "--port", str(port)]
    if registry:
        args += ["--registry", registry, "--service", service]
    return [*args, *extra]


def _check_files(source: str) -> str | None:
    if not weights_path().is_file():
        return f"no trained teacher at {weights_path()}: run `python -m examples.nlp.train_teacher` first"
    if source == "pt2" and not (weights_path().parent / "teacher.pt2").is_file():
        return "no exported program: run `python -m examples.nlp.export` first"
    return None


def smoke(args: list[str], k: int = 10) -> int:
    """Serve with ``args`` (port 0), ask for the top-``k`` logits of 32 test sentences, compare the
    class ids with the in-process teacher's, stop. Returns the exit code."""
    import tritonclient.grpc as tg

    tokens = data.test_set(32).tokens.numpy()
    with teacher_server_process(args) as endpoint:
        inp = tg.InferInput("TOKENS", list(tokens.shape), "INT64")
        inp.set_data_from_numpy(np.ascontiguousarray(tokens))
        with tg.InferenceServerClient(endpoint) as client:
            result = client.infer(MODEL_NAME, [inp], parameters={"top_k": k})
            values, indices = result.as_numpy("LOGITS_TOPK_VALUES"), result.as_numpy("LOGITS_TOPK_INDICES")
    with torch.inference_mode():
        local = load_teacher()(torch.from_numpy(tokens)).topk(k, dim=1)
    agree = int((indices[:, 0] == local.indices[:, 0].numpy()).sum())
    err = float(np.abs(values - local.values.numpy()).max())
    print(f"smoke: {endpoint} answered top-{k} logits {list(values.shape)} for 32 sentences; "
          f"{agree}/32 top-1 classes match the in-process teacher, max |value diff| {err:.1e}")
    return 0 if agree == 32 else 1


COMMAND = ServeCommand(
    example="nlp", description=__doc__.split("\n")[0], default_port=9899, service=SERVICE, sources=SOURCES,
    weights_env=WEIGHTS_ENV, teacher_args=teacher_args, check_files=_check_files, smoke=smoke,
    from_help="serve the module:factory, or the .pt2 written by examples.nlp.export",
    smoke_help="serve briefly on a free port, check one request, stop",
)


def build_parser() -> argparse.ArgumentParser:
    return build_serve_parser(COMMAND)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(COMMAND, argv)


if __name__ == "__main__":
    sys.exit(main())
