"""A real Triton (PyTriton) serving a numpy or a torch model, for the tests and benchmarks.

Run inside the PyTriton virtualenv that `benchmarks/pytriton_env.py` builds, never in the
project's own (PyTriton pins numpy<2):

    pytriton-venv/bin/python benchmarks/pytriton_server.py --model linear --dim 16 --classes 10

By default it serves `LOGITS = INPUT @ W` (INPUT FP32 [-1, dim], LOGITS FP32 [-1, classes]) with
dynamic batching through the real Triton core, which PyTriton runs on CPU. `W` comes from
`weights()`, a closed formula with small integers, so a test that feeds integer-valued inputs gets
sums that are exact in FP32 whatever the BLAS and summation order: it can compare bit for bit.

`--torch-model MODULE:FN` serves the torch module `FN()` returns instead (INPUT FP32
[-1, *--input-shape], LOGITS FP32 [-1, classes]), in FP32 on the CPU under `inference_mode`, with
`--instances` model instances (one inference thread each, sharing the module) and
`--threads` torch intra-op threads: the benchmarks' PyTriton side, the same model and thread
layout as a teacher-server. The PyTriton venv has no torch: `--import-path` directories (the
project's root, the running project's site-packages) are appended to `sys.path`, after the venv's
own packages, so PyTriton's numpy and gRPC win and torch comes from the project (the venv is built
from the project's interpreter, so torch's binaries match it).

When the model is ready it prints one JSON line on stdout (where Triton logs too) and on `--ready-fd`:

    {"ready": true, "grpc_port": ..., "http_port": ..., "model": ..., "dim": ..., "classes": ...,
     "max_batch_size": ..., "input_shape": [...], "instances": ...,
     "restriction": null | {"header": ..., "value": ..., "endpoints": [...]}}

and serves until SIGTERM or SIGINT, or until its parent process is gone, then stops Triton and
exits 0.

Restriction: PyTriton 0.7.0, unless told otherwise, starts Triton with
`--grpc-restricted-protocol` and `--http-restricted-api` set to
`shared-memory,model-repository,statistics,trace,logging:triton-access-token=<random token>`:
those endpoint groups answer UNAVAILABLE ("This protocol is restricted, expecting header ...")
to any call without that header. `model-repository` covers RepositoryIndex, which a client that
is not told the model's name uses to find it. `--restrict default` serves exactly that (a
hardened Triton); `--restrict none` (the default here) serves everything openly; a
comma-separated list of endpoint groups restricts those. The header's name and value are in the
ready line so a test can call the restricted endpoints too.

Only numpy is imported at module level: the project's tests import `weights()` from here with
their own numpy, without PyTriton.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

READY_KEY = "ready"


def weights(dim: int, classes: int) -> np.ndarray:
    """The model's W [dim, classes]: integers in [-8, 8] from a fixed formula (no RNG, so any numpy
    version, here or in the PyTriton venv, computes the same matrix)."""
    i = np.arange(dim, dtype=np.int64)[:, None]
    j = np.arange(classes, dtype=np.int64)[None, :]
    return (((i * 7 + j * 3 + (i * j) % 5) % 17) - 8).astype(np.float32)


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, all held open together so the kernel cannot hand one out twice.
    Triton binds them a moment later; the launcher retries the rare start that loses one meanwhile."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", default="linear", help="model name Triton serves")
    p.add_argument("--dim", type=int, default=16, help="INPUT width D")
    p.add_argument("--classes", type=int, default=10, help="LOGITS width C")
    p.add_argument("--torch-model", default=None, metavar="MODULE:FN",
                   help="serve the torch module FN() returns instead of INPUT @ W")
    p.add_argument("--input-shape", default=None,
                   help="INPUT's shape without the batch dimension, comma-separated (--torch-model only)")
    p.add_argument("--import-path", action="append", default=[],
                   help="directory appended to sys.path before --torch-model is imported (repeatable)")
    p.add_argument("--instances", type=int, default=1, help="model instances (inference threads)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads, --torch-model only (0: torch's default)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-queue-delay-us", type=int, default=200, help="dynamic batcher's queue delay")
    p.add_argument("--grpc-port", type=int, default=0, help="0: a free loopback port")
    p.add_argument("--http-port", type=int, default=0, help="0: a free loopback port")
    p.add_argument(
        "--restrict", default="none",
        help="'none' (open), 'default' (PyTriton's default restriction) or a comma-separated list of "
             "endpoint groups (model-repository, statistics, ...) to restrict behind the access header",
    )
    p.add_argument("--access-token", default=None, help="the header's value (default: a random token)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-fd", type=int, default=None,
                   help="also write the ready line to this inherited file descriptor, then close it")
    p.add_argument("--workspace", default=None,
                   help="PyTriton's workspace (model store, sockets); default: a new one under ~/.cache/pytriton")
    args = p.parse_args(argv)
    if args.instances < 1:
        p.error("--instances must be >= 1")
    if args.input_shape is not None and args.torch_model is None:
        p.error("--input-shape goes with --torch-model")
    if args.torch_model is not None and ":" not in args.torch_model:
        p.error("--torch-model takes MODULE:FN, e.g. examples.refteacher:build")
    return args


InferFn = Callable[..., dict[str, np.ndarray]]


def _torch_infer(args: argparse.Namespace) -> tuple[Callable[[], InferFn], tuple[int, ...]]:
    """A factory of infer callables running `--torch-model`, and INPUT's shape without the batch.

    Every instance gets its own callable (PyTriton binds one per instance) around the one module:
    inference does not write to it, so the instances share it as a teacher-server's do.
    """
    sys.path.extend(args.import_path)
    import importlib

    import torch
    from pytriton.decorators import batch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    module_name, _, fn_name = args.torch_model.partition(":")
    module = getattr(importlib.import_module(module_name), fn_name)().float().eval()
    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else (args.dim,)
    # Triton hands @batch read-only views of its buffers; the model only reads them.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def make() -> InferFn:
        @batch
        def infer(INPUT: np.ndarray) -> dict[str, np.ndarray]:  # @batch passes tensors by their Triton names
            with torch.inference_mode():
                out = module(torch.from_numpy(INPUT))
            return {"LOGITS": out.float().numpy()}

        return infer

    return make, shape


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    parent = os.getppid()
    if args.ready_fd is not None:
        # Keep it out of tritonserver and the backend stubs, so the reader sees EOF when this process dies.
        os.set_inheritable(args.ready_fd, False)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    # PyTriton is only importable inside its own virtualenv.
    from pytriton import triton as pt_triton
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    if args.torch_model is not None:
        make, input_shape = _torch_infer(args)
    else:
        w = weights(args.dim, args.classes)
        input_shape = (args.dim,)

        def make() -> InferFn:
            @batch
            def infer(INPUT: np.ndarray) -> dict[str, np.ndarray]:  # @batch passes tensors by their Triton names
                return {"LOGITS": (INPUT.astype(np.float32) @ w).astype(np.float32)}

            return infer

    if args.restrict == "none":
        security = TritonSecurityConfig(restricted_endpoints=[])
    elif args.restrict == "default":
        security = TritonSecurityConfig(access_token=args.access_token)
    else:
        endpoints = [e.strip() for e in args.restrict.split(",") if e.strip()]
        security = TritonSecurityConfig(access_token=args.access_token, restricted_endpoints=endpoints)

    free = _free_ports(2)
    grpc_port = args.grpc_port or free[0]
    http_port = args.http_port or free[1]
    config = TritonConfig(
        grpc_address="127.0.0.1", grpc_port=grpc_port, http_address="127.0.0.1", http_port=http_port,
        allow_metrics=False, log_verbose=args.log_verbose, exit_on_error=True,
    )

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    with Triton(config=config, security_config=security, workspace=args.workspace) as server:
        server.bind(
            model_name=args.model,
            infer_func=[make() for _ in range(args.instances)],
            inputs=[Tensor(name="INPUT", dtype=np.float32, shape=input_shape)],
            outputs=[Tensor(name="LOGITS", dtype=np.float32, shape=(args.classes,))],
            config=ModelConfig(
                batching=True,
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us),
            ),
            # strict: PyTriton checks every answer against the outputs declared; the tests want that, a benchmark not.
            strict=args.torch_model is None,
        )
        server.run()  # starts tritonserver, loads the model, waits until both are ready
        restriction = None
        endpoints = security.restricted_endpoints or []
        if security.access_token and endpoints:
            restriction = {"header": pt_triton.TRITON_ACCESS_HEADER, "value": security.access_token,
                           "endpoints": list(endpoints)}
        ready = {
            READY_KEY: True, "grpc_port": grpc_port, "http_port": http_port, "model": args.model,
            "dim": args.dim, "classes": args.classes, "max_batch_size": args.max_batch_size,
            "input_shape": list(input_shape), "instances": args.instances, "restriction": restriction,
        }
        line = json.dumps(ready) + "\n"
        print(line, end="", flush=True)
        if args.ready_fd is not None:
            os.write(args.ready_fd, line.encode())
            os.close(args.ready_fd)
        # Serve until told to stop, until the process that started us is gone (a test run killed
        # before its teardown must not leave a Triton behind), or until Triton dies (exit non-zero).
        while not stop.wait(1.0):
            if os.getppid() != parent:
                logging.getLogger("pytriton_server").warning("parent process gone; stopping")
                break
            if not server.is_alive():
                logging.getLogger("pytriton_server").error("Triton exited on its own")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
