"""`teacher-server`: serve one PyTorch teacher over the KServe v2 gRPC protocol.

    teacher-server --model examples.refteacher:build --name ref_teacher --port 9898 --device cpu

SIGTERM or SIGINT drains: health goes NOT_SERVING, new requests get UNAVAILABLE, the registry
entry is revoked, in-flight requests finish (bounded by --drain-grace), and the process exits 0.

A thin layer over `teacher_server.serve`: this module parses the flags, refuses bad values in the
flags' own words, and maps each flag onto one of serve()'s keywords; building the config, loading,
the warm-up, registration and the drain are the API's, so the CLI and Python serving cannot drift.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from discovery.options import PASSWORD_ENV, add_registry_security_args, registry_security_options
from teacher_server import api
from teacher_server.api import RegistryAccessError, first_line
from teacher_server.model import FLOAT_OUTPUT_DTYPES, ModelLoadError
from teacher_server.server import ServerConfig
from teacher_server.spec import SpecError

log = logging.getLogger("teacher_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teacher-server",
        description="Serve a PyTorch teacher over the Triton / KServe v2 gRPC inference protocol.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True,
                   help="package.module:factory (returns an nn.Module), a TorchScript file, "
                   "a torch.export .pt2 file, or hf:DIR (a transformers causal LM or sequence classifier "
                   "saved with save_pretrained; read locally, never from a hub)")
    m.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for a module:factory (repeat); VALUE is parsed as JSON when it "
                   "parses (3, 0.5, true, [1,2], \"text\"), else taken as a string")
    m.add_argument("--name", default="teacher", help="model name clients ask for (default: %(default)s)")
    m.add_argument("--version", default="1", help="model version (default: %(default)s)")
    m.add_argument("--input", action="append", default=[], metavar="NAME:DTYPE:SHAPE[:pad=V|:mask]",
                   help="declare an input, e.g. INPUT:FP32:3,32,32 (repeat, in forward() order); "
                   "TOKENS:INT64:-1:pad=0 lets requests of different lengths share a batch, padded with 0; "
                   ":mask marks the attention mask (padded with 0, all ones when a client sends none)")
    m.add_argument("--output", action="append", default=[], metavar="NAME:DTYPE:SHAPE[:per_position]",
                   help="declare an output, e.g. LOGITS:FP32:100 (repeat, in return order); inferred if omitted; "
                   "LOGITS:FP32:-1,100:per_position is cut back to each request's own sequence length")
    m.add_argument("--attention-mask", default=None, metavar="NAME",
                   help="the --input that is the attention mask (same as giving it :mask)")
    m.add_argument("--model-config", help="inputs, outputs and max_batch_size from a file: Triton's config.pbtxt, "
                   "Triton-style JSON (input/output, data_type, dims) or ours (inputs/outputs, datatype, shape)")
    m.add_argument("--model-path", action="append", default=[], metavar="DIR",
                   help="directory to import --model's module from, put first on sys.path (repeat for several; "
                   "default: the working directory, as with python -m)")
    m.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda when available, else cpu)")
    m.add_argument("--compute-dtype", default="FP32", type=str.upper, choices=list(FLOAT_OUTPUT_DTYPES),
                   help="autocast dtype for the forward pass; an hf:DIR teacher loads its weights in it "
                   "(default: %(default)s)")
    m.add_argument("--instances", type=int, default=0,
                   help="model instances, each on its own thread (default: one per core on CPU, 1 on GPU)")
    m.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per process (default: cores / instances)")

    b = p.add_argument_group("batching")
    b.add_argument("--max-batch-size", type=int, default=None, help="largest batch a model instance runs (default 256)")
    b.add_argument("--max-queue-delay-us", type=int, default=500,
                   help="longest wait for more requests to fill a batch (default: %(default)s)")
    b.add_argument("--max-queue-size", type=int, default=512,
                   help="requests allowed to wait; beyond it: RESOURCE_EXHAUSTED (default: %(default)s)")
    b.add_argument("--no-dynamic-batching", action="store_true", help="run every request as its own batch")
    b.add_argument("--max-batch-tokens", type=int, default=0,
                   help="models with padded inputs: the batch bound, samples x padded length "
                   "(default 0: max-batch-size x 64; a larger single request still runs alone)")
    b.add_argument("--no-length-buckets", action="store_true",
                   help="models with padded inputs: pad requests of any length together (default: by length bucket)")

    o = p.add_argument_group("outputs")
    o.add_argument("--output-dtype", type=str.upper, choices=list(FLOAT_OUTPUT_DTYPES), default=None,
                   help="default dtype of floating outputs; requests override with the output_dtype parameter")
    o.add_argument("--top-k", type=int, default=0,
                   help="default: send the top k of every output as <OUT>_TOPK_VALUES/_INDICES (0: full tensors)")
    o.add_argument("--logprobs", action="store_true",
                   help="default: send log_softmax(x / --temperature) of floating outputs, computed on the "
                   "model's device (requests override with the logprobs parameter)")
    o.add_argument("--temperature", type=float, default=1.0,
                   help="default divisor of floating outputs before log-softmax and top-k; requests override "
                   "with the temperature parameter (default: %(default)s)")
    o.add_argument("--topk-tail", action="store_true",
                   help="default: with top-k, also send <OUT>_TOPK_TAIL, the probability mass outside the top-k "
                   "per position (requests override with the topk_tail parameter)")

    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    n.add_argument("--port", type=int, default=8001, help="gRPC port, 0 for a free one (default: %(default)s)")
    n.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (default: off)")
    n.add_argument("--http-port", type=int, default=None,
                   help="KServe v2 HTTP/REST port beside gRPC, 0 for a free one (default: off)")
    n.add_argument("--max-message-mb", type=int, default=256, help="largest request or response (default: 256)")
    n.add_argument("--drain-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default: %(default)s)")
    n.add_argument("--ready-file", help="write {endpoint, metrics_port, pid} as JSON here once serving")
    n.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    n.add_argument("--tls-key", help="PEM private key of --tls-cert")
    n.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")

    r = p.add_argument_group("registry")
    r.add_argument("--registry", default=None, help="etcd://host:2379[,host:2379]: register under a lease")
    r.add_argument("--service", default=None, help="service name to register under (with --registry)")
    r.add_argument("--advertise", default="", help="host:port students dial (default: --host:--port)")
    r.add_argument("--ttl", type=float, default=10.0, help="registration lease TTL in seconds (default: 10)")
    r.add_argument("--instance-id", default="", help="registry identity (default: name + random suffix)")
    add_registry_security_args(r)

    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default: %(default)s)")
    return p


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad flag values before anything loads: SpecError naming the flag, the value and the
    fix (a model can take minutes to load; a typo should cost none of them)."""
    check_device(args.device)
    parse_model_args(args.model_arg)
    if args.threads < 0:
        raise SpecError(f"--threads must be >= 0 (0: cores / instances), got {args.threads}")
    if not args.drain_grace >= 0:
        raise SpecError(f"--drain-grace must be >= 0 seconds, got {args.drain_grace}")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise SpecError(f"--metrics-port must be in 0..65535 (0: a free port), got {args.metrics_port}")
    if not (args.ttl > 0 and math.isfinite(args.ttl)):
        raise SpecError(f"--ttl must be a positive number of seconds (the registration lease; default 10), "
                        f"got {args.ttl}")
    if args.max_batch_tokens < 0:
        raise SpecError(f"--max-batch-tokens must be >= 0 (0: no cap), got {args.max_batch_tokens}")
    if args.model_config and not Path(args.model_config).is_file():
        raise SpecError(f"--model-config {args.model_config} does not exist")
    if args.instances < 0:
        raise SpecError(f"--instances must be >= 0 (0: one per core on CPU, 1 on GPU), got {args.instances}")
    if args.attention_mask and not args.input and not args.model_config:
        raise SpecError("--attention-mask needs the inputs declared (--input or --model-config)")
    if args.output and not args.input:
        raise SpecError("--output needs --input too (declare the inputs the outputs come from)")
    if args.service and not args.registry:
        raise SpecError("--service needs --registry etcd://host:2379")
    if args.registry and not args.service:
        raise SpecError("--registry needs --service NAME (the name students ask the registry for)")


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """`--model-arg KEY=VALUE` flags as keyword arguments: VALUE as JSON when it parses, else the
    string itself; SpecError for a malformed or repeated KEY."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise SpecError(f"--model-arg {item!r}: expected KEY=VALUE with KEY a Python identifier "
                            "(a keyword argument of the factory), e.g. --model-arg hidden=256")
        if key in out:
            raise SpecError(f"--model-arg {key} given twice")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def apply_model_path(args: argparse.Namespace) -> list[str]:
    """Put --model-path's directories (default: the working directory) first on sys.path, so
    that `--model mymodel:build` finds ./mymodel.py from the `teacher-server` script too (a script's
    sys.path starts with its own bin directory, not the working directory). Returns what was added."""
    dirs = [str(Path(d).resolve()) for d in (args.model_path or [os.getcwd()])]
    for d in args.model_path:
        if not Path(d).is_dir():
            raise SpecError(f"--model-path {d} is not a directory")
    for d in reversed(dirs):
        if d not in sys.path[: len(dirs)]:
            sys.path.insert(0, d)
    return dirs


def check_device(device: str | None) -> None:
    """SpecError unless `device` names a device this machine has (None/'auto': chosen later)."""
    if device in (None, "", "auto"):
        return
    assert device is not None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise SpecError(f"--device {device}: teacher-server serves on cpu or cuda:N")


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `teacher_server.server_config`'s keyword arguments, one to one."""
    return dict(
        name=args.name, version=args.version, inputs=args.input, outputs=args.output,
        attention_mask=args.attention_mask, model_config=args.model_config, device=args.device,
        compute_dtype=args.compute_dtype, max_batch_size=args.max_batch_size,
        max_queue_delay_us=args.max_queue_delay_us, max_queue_size=args.max_queue_size,
        dynamic_batching=not args.no_dynamic_batching, max_batch_tokens=args.max_batch_tokens,
        length_buckets=not args.no_length_buckets,
        instances=args.instances, output_dtype=args.output_dtype, top_k=args.top_k, logprobs=args.logprobs,
        temperature=args.temperature, topk_tail=args.topk_tail, model_args=parse_model_args(args.model_arg),
        host=args.host, port=args.port, metrics_port=args.metrics_port, http_port=args.http_port,
        max_message_mb=args.max_message_mb, drain_grace_s=args.drain_grace, instance_id=args.instance_id,
        advertise=args.advertise, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
    )


def serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `teacher_server.serve`'s keyword arguments (config, registry, ready file, threads)."""
    registry = dict(registry=args.registry, service=args.service, ttl=args.ttl,
                    registry_options=registry_security_options(args)) if args.registry else {}
    return {**config_options(args), **registry, "ready_file": args.ready_file, "threads": args.threads or None}


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig `teacher-server ARGS` serves (flags checked first)."""
    check_flags(args)
    return api.server_config(args.model, **config_options(args))


def _registry_refusal(e: RegistryAccessError) -> str:
    """RegistryAccessError in the flags' words: which flag to fix and where the password goes."""
    if e.user:
        return (f"--registry {e.registry}: etcd refused user {e.user} ({e.said}); check --registry-user and the "
                f"password in ${PASSWORD_ENV}")
    return (f"--registry {e.registry}: etcd requires authentication ({e.said}); pass --registry-user and export "
            f"its password in ${PASSWORD_ENV}")


def _refuse(parser: argparse.ArgumentParser, message: str) -> int:
    """A refused flag or file: one line on stderr, exit status 2 (argparse's own, for usage errors)."""
    print(f"{parser.prog}: error: {first_line(message, 2000)}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, check them, and hand them to `teacher_server.serve`; map its errors to an
    exit status: 2 for a refused flag, file or model, 1 when the server cannot serve (a port)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        check_flags(args)
        apply_model_path(args)
        abandoned = api.serve(args.model, **serve_options(args))
    except RegistryAccessError as e:
        return _refuse(parser, _registry_refusal(e))
    except ModelLoadError as e:
        log.error("%s", e)
        return 2
    except (SpecError, ValueError) as e:
        return _refuse(parser, str(e))
    except OSError as e:
        log.error("cannot serve: %s", e)
        return 1
    if abandoned:
        # A forward pass cannot be interrupted, and interpreter shutdown would join its thread:
        # the process would outlive --drain-grace by however long the pass takes. Its callers were
        # answered UNAVAILABLE and the registry entry is gone, so leave now.
        logging.shutdown()
        os._exit(0)
    return 0
