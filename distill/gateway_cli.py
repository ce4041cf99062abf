"""The ``distill gateway`` subcommand's flags, read into a `distill.gateway.GatewayConfig`.

    distill gateway --registry etcd://HOST:2379 --service NAME [--port 8000] [--host 127.0.0.1]
                    [--registry-ca-cert FILE --registry-cert FILE --registry-key FILE --registry-user USER]
    distill gateway --teachers HOST:PORT[,HOST:PORT] [--port 8000]
    distill gateway --teacher NAME=etcd://HOST:2379/SERVICE --teacher NAME=HOST:PORT[,HOST:PORT] [--port 8000]

The registry flags are spelled as on every other command (``discovery.options``); the password of
``--registry-user`` comes from $DISTILL_REGISTRY_PASSWORD, never the command line. Flags are parsed
without importing the gateway (``distill --help`` stays quick); `run` imports it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from discovery.options import add_registry_security_args, registry_security_options
from distill.checks import positive_float, positive_int, registry_address, service_name, teacher_list
from distill.flags import argument_type
from distill.gateway_teachers import TEACHER_FORM, teacher_spec

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``gateway`` on the ``distill`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "gateway", help="serve vLLM's scoring API (/v1/completions with prompt_logprobs) on loopback, answered by "
        "the teacher pool",
        description="A student-side gateway for trainers that speak vLLM's API (TRL, verl): GET /health, GET "
        "/v1/models and POST /v1/completions with token-id prompts, max_tokens 1 and prompt_logprobs, each "
        "request answered through the mesh (teachers from the registry or a list, binary KServe v2, routing, "
        "failover, hedging, demand for the autoscaler). Point the trainer at http://HOST:PORT, or with several "
        "teachers (--teacher NAME=...) at http://HOST:PORT/teachers/NAME for each.")
    where = p.add_argument_group("teachers (--teacher once per teacher; or, for one, --teachers or --registry with "
                                 "--service)")
    where.add_argument("--teacher", dest="named_teachers", action="append", default=[],
                       type=argument_type(teacher_spec, "teacher"), metavar="NAME=SPEC",
                       help=f"a teacher served as model NAME and at /teachers/NAME, from a registry service or a "
                       f"fixed list ({TEACHER_FORM}); repeat for each teacher")
    where.add_argument("--teachers", type=argument_type(teacher_list, "teachers"), metavar="HOST:PORT[,HOST:PORT]",
                       help="a fixed list of teacher servers (gRPC ports)")
    where.add_argument("--registry", type=argument_type(registry_address, "registry"), metavar="etcd://HOST:PORT",
                       help="etcd endpoints where teachers register")
    where.add_argument("--service", type=argument_type(service_name, "service"), metavar="NAME",
                       help="the service the teachers register under")
    add_registry_security_args(where)
    p.add_argument("--port", type=int, default=8000, help="port to serve on (0: a free one; default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback: "
                   "the gateway is the trainer's own process)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="the teachers' model (default: what each teacher registered)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name /v1/models reports and requests' model must match, with one teacher "
                   "(default: --model, else --service, else 'teacher'; with --teacher, each NAME)")
    p.add_argument("--max-logprobs", type=argument_type(positive_int, "max_logprobs"), default=20, metavar="K",
                   help="most prompt_logprobs per position, and the top-k asked of the teachers (default: "
                   "%(default)s, vLLM's)")
    p.add_argument("--max-model-len", type=argument_type(positive_int, "max_model_len"), default=None, metavar="N",
                   help="the context length /v1/models reports; longer prompts are refused here (default: "
                   "unreported, the teachers refuse what exceeds their context)")
    p.add_argument("--input", default="INPUT_IDS", metavar="NAME", help="the teachers' token-id input "
                   "(default: %(default)s)")
    p.add_argument("--output", default="LOGITS", metavar="NAME", help="the teachers' per-position output "
                   "(default: %(default)s)")
    p.add_argument("--timeout", type=argument_type(positive_float, "timeout"), default=30.0, metavar="SECONDS",
                   help="deadline for one prompt at one teacher before it is re-sent to another (default: "
                   "%(default)s)")
    p.add_argument("--no-teacher-timeout", type=argument_type(positive_float, "no_teacher_timeout"), default=30.0,
                   metavar="SECONDS", help="how long a request waits for a usable teacher before 503 (default: "
                   "%(default)s)")
    p.add_argument("--max-body-mb", type=argument_type(positive_float, "max_body_mb"), default=64.0, metavar="MB",
                   help="largest request body (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The `GatewayConfig` of parsed ``distill gateway`` flags; ValueError names the flag to fix."""
    from distill.gateway import GatewayConfig

    registry = args.registry or any(t.registry for t in args.named_teachers)
    return GatewayConfig(
        port=args.port, host=args.host, teachers=args.teachers, registry=args.registry, service=args.service,
        named_teachers=tuple(args.named_teachers),
        registry_options=registry_security_options(args) if registry else {}, model=args.model,
        served_model_name=args.served_model_name, input_name=args.input, output_name=args.output,
        max_logprobs=args.max_logprobs, max_model_len=args.max_model_len, max_body_mb=args.max_body_mb,
        timeout=args.timeout, no_teacher_timeout=args.no_teacher_timeout)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit status 2 for flags that do not go together."""
    from distill.gateway import run_gateway

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"distill gateway: error: {e}")
        return 2
    return run_gateway(config)
