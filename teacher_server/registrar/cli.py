"""The ``distill register`` subcommand: flags, exit statuses, and the event loop around the Registrar.

    distill register --engine kserve|vllm|sglang --url URL --registry etcd://HOST:2379 --service NAME
                     [--model NAME] [--max-top-k 20] [--drain-timeout 30] [--ready-timeout S]
                     [--metrics-url URL] [-- ENGINE COMMAND ...]

Exit statuses: 0 after a stop signal and the drain; 1 when the engine child exited on its own, the
engine was not ready within --ready-timeout or the engine command could not start; 2 for a bad
flag (--engine, --url, a value out of range).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

from discovery import open_registry, parse_address
from discovery.errors import RegistryError
from discovery.options import add_registry_security_args, registry_security_options
from discovery.signals import StopSignals
from teacher_server.registrar.engine import ENGINES, parse_engine
from teacher_server.registrar.errors import RegistrarError, RegistrarUsageError

__all__ = ["add_parser", "run"]

log = logging.getLogger("teacher_server.registrar")


def _number(kind: Callable[[str], Any], minimum: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (value >= minimum and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_SECONDS = _number(float, 0.0, "a number of seconds >= 0")
_POSITIVE_SECONDS = _number(float, 1e-3, "a positive number of seconds")
_COUNT = _number(int, 1, "a positive integer")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``register`` on the ``distill`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "register", help="put an inference engine (vLLM, SGLang, Triton, teacher-server) into the mesh while it "
        "is healthy",
        description="A sidecar (or, with -- COMMAND, the parent) of an inference engine: registers the engine in "
        "the registry once it answers its health and model checks, publishes its load from its Prometheus "
        "metrics about once a second, withdraws the record while it stops answering, and at SIGTERM withdraws "
        "first, then waits for the engine's in-flight work (exit 0).")
    engine = p.add_argument_group("engine")
    engine.add_argument("--engine", required=True, metavar="|".join(ENGINES),
                        help="the engine's protocol: kserve (KServe v2 gRPC: Triton, teacher-server), vllm "
                        "(vLLM's OpenAI-compatible server) or sglang (SGLang's native server)")
    engine.add_argument("--url", required=True, metavar="URL",
                        help="where the engine answers: http[s]://HOST:PORT[/PATH] for vllm and sglang (the path "
                        "prefix goes into the record), grpc://HOST:PORT, grpcs://HOST:PORT or HOST:PORT for kserve; "
                        "HOST:PORT is what students dial, so use an address they can reach")
    engine.add_argument("--model", default=None, metavar="NAME",
                        help="the served model to register (default: the only one the engine serves)")
    engine.add_argument("--metrics-url", default=None, metavar="URL",
                        help="the engine's Prometheus metrics (default: URL/metrics for vllm and sglang; none for "
                        "kserve: Triton serves them on :8002/metrics, teacher-server on --metrics-port)")
    engine.add_argument("--max-top-k", type=_COUNT, default=20, metavar="K",
                        help="the engine's top-k limit for vllm and sglang (vLLM's --max-logprobs; default: "
                        "%(default)s, vLLM's default)")
    engine.add_argument("--device", default="engine", help="the device the record names (default: %(default)s)")
    where = p.add_argument_group("registry")
    where.add_argument("--registry", required=True, metavar="etcd://HOST:PORT",
                       help="the registry the engine's record goes into")
    where.add_argument("--service", required=True, metavar="NAME", help="the service to register under")
    where.add_argument("--instance-id", default=None, metavar="ID",
                       help="the record's id (default: SERVICE-ENGINE-<random>)")
    where.add_argument("--ttl", type=_POSITIVE_SECONDS, default=10.0, metavar="SECONDS",
                       help="the registration lease: a registrar that dies is gone from the registry after it "
                       "(default: %(default)s)")
    add_registry_security_args(where)
    timing = p.add_argument_group("timing")
    timing.add_argument("--ready-timeout", type=_POSITIVE_SECONDS, default=None, metavar="SECONDS",
                        help="exit 1 when the engine is not ready this long after start (default: wait for ever; "
                        "loading a large model takes minutes)")
    timing.add_argument("--probe-interval", type=_POSITIVE_SECONDS, default=1.0, metavar="SECONDS",
                        help="health checks and metrics reads while registered (default: %(default)s)")
    timing.add_argument("--probe-timeout", type=_POSITIVE_SECONDS, default=5.0, metavar="SECONDS",
                        help="deadline of one probe call (default: %(default)s)")
    timing.add_argument("--unhealthy-after", type=_COUNT, default=3, metavar="N",
                        help="failed health checks in a row that withdraw the record (default: %(default)s)")
    timing.add_argument("--drain-timeout", type=_SECONDS, default=30.0, metavar="SECONDS",
                        help="at SIGTERM, the longest wait for the engine's in-flight work after the record is "
                        "withdrawn (default: %(default)s)")
    timing.add_argument("--stop-grace", type=_SECONDS, default=30.0, metavar="SECONDS",
                        help="with -- COMMAND: after SIGTERM to the engine, the wait before SIGKILL (default: "
                        "%(default)s)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("engine_command", nargs="*", metavar="-- ENGINE COMMAND",
                   help="start the engine as a child (its own process group) and stop it after the drain; "
                   "{port} in it is the port of --url")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``distill register``; the exit status (see the module docstring)."""
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        address = parse_engine(args.engine, args.url, args.metrics_url)
        security = registry_security_options(args)
        parse_address(args.registry)
    except ValueError as e:
        print(f"distill register: error: {e}", file=sys.stderr)
        return 2
    from teacher_server.registrar.child import EngineChild, engine_argv
    from teacher_server.registrar.probes import ProbeOptions, make_probe
    from teacher_server.registrar.supervisor import Registrar, RegistrarOptions, default_instance_id

    command = list(args.engine_command)
    options = RegistrarOptions(
        service=args.service, instance_id=args.instance_id or default_instance_id(args.service, address.kind),
        ttl=args.ttl, probe_interval=args.probe_interval, unhealthy_after=args.unhealthy_after,
        ready_timeout=args.ready_timeout, drain_timeout=args.drain_timeout, stop_grace=args.stop_grace)
    probe_options = ProbeOptions(model=args.model, max_top_k=args.max_top_k, device=args.device,
                                 timeout=args.probe_timeout)
    child = EngineChild(engine_argv(command, address.port)) if command else None

    async def main() -> int:
        with StopSignals() as stop:
            async with open_registry(args.registry, **security) as registry:
                registrar = Registrar(registry, make_probe(address, probe_options), options, child)
                return await registrar.run(stop)

    try:
        return asyncio.run(main())
    except RegistrarUsageError as e:
        print(f"distill register: error: {e}", file=sys.stderr)
        return 2
    except (RegistrarError, RegistryError, OSError) as e:
        print(f"distill register: error: {e}", file=sys.stderr)
        return 1
