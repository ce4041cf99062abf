"""`distill-autoscaler`: keep a teacher service's pool sized to its students.

    distill-autoscaler --registry etcd://10.0.0.5:2379 --service cifar-teacher --backend local \\
        --min 1 --max 8 --devices cuda:0,cuda:1 -- teacher-server --model examples.refteacher:build

    distill-autoscaler --registry etcd://etcd:2379 --service cifar-teacher --backend kubernetes \\
        --deployment cifar-teacher --namespace distill --min 1 --max 8

Everything after ``--`` is the local backend's teacher command template (see
``distill.autoscale.backends.local``). Bad input (min > max, negative values, an unknown backend,
a missing command or Deployment) exits with status 2 and a message saying what to fix. SIGTERM
and Ctrl-C stop the controller: it resigns the leadership and stops the teachers it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from discovery.options import add_registry_security_args, registry_security_options
from discovery.signals import StopSignals
from distill.autoscale.backends import BACKENDS, Backend, KubernetesBackend, LocalBackend
from distill.autoscale.controller import Controller, ControllerConfig, default_identity
from distill.autoscale.errors import AutoscaleError, BackendError, PolicyConfigError
from distill.autoscale.policy import PolicyConfig

__all__ = ["build_parser", "main", "run"]

log = logging.getLogger("distill.autoscale")

_DEFAULTS = PolicyConfig()


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _pos_float(text: str) -> float:
    value = _nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _backend_name(text: str) -> str:
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose one of: {', '.join(BACKENDS)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distill-autoscaler",
        description="Keep a teacher service's pool sized to its students' demand.",
        epilog="Everything after '--' is the teacher command template of the local backend, e.g. "
        "-- teacher-server --model examples.refteacher:build --name ref_teacher",
    )
    p.add_argument("--registry", required=True, help="etcd://HOST:PORT[,HOST:PORT] (the election lives there too)")
    p.add_argument("--service", required=True, help="the teacher service to size")
    p.add_argument("--backend", type=_backend_name, default="local", help="local (default) or kubernetes")
    add_registry_security_args(p)

    s = p.add_argument_group("policy")
    s.add_argument(
        "--min",
        dest="min_teachers",
        type=_nonneg_int,
        default=_DEFAULTS.min_teachers,
        help="fewest teachers (0: none without students; default %(default)s)",
    )
    s.add_argument(
        "--max",
        dest="max_teachers",
        type=_pos_int,
        default=_DEFAULTS.max_teachers,
        help="most teachers (default %(default)s)",
    )
    s.add_argument(
        "--target-utilisation",
        "--target-utilization",
        dest="target_utilisation",
        type=_pos_float,
        default=_DEFAULTS.target_utilisation,
        help="busy fraction teachers are sized for (default %(default)s)",
    )
    s.add_argument(
        "--headroom",
        type=_nonneg_float,
        default=_DEFAULTS.headroom,
        help="extra capacity over the estimated demand, 0.1 = 10%% (default %(default)s)",
    )
    s.add_argument(
        "--stall-threshold",
        type=_nonneg_float,
        default=_DEFAULTS.stall_threshold,
        help="mean student wait fraction that counts as waiting (default %(default)s)",
    )
    s.add_argument(
        "--busy-threshold",
        type=_pos_float,
        default=_DEFAULTS.busy_threshold,
        help="mean teacher busy fraction that counts as busy (default %(default)s)",
    )
    s.add_argument(
        "--queue-threshold",
        type=_nonneg_float,
        default=_DEFAULTS.queue_threshold,
        help="mean queued requests per teacher that also count as busy (default %(default)s)",
    )
    s.add_argument(
        "--up-window",
        type=_nonneg_float,
        default=_DEFAULTS.up_window,
        help="seconds a higher count must be wanted before scaling up (default %(default)s)",
    )
    s.add_argument(
        "--settle",
        type=_nonneg_float,
        default=_DEFAULTS.settle,
        help="seconds after new teachers registered before another scale-up (default %(default)s)",
    )
    s.add_argument(
        "--down-window",
        type=_nonneg_float,
        default=_DEFAULTS.down_window,
        help="seconds demand must stay low before scaling down (default %(default)s)",
    )
    s.add_argument(
        "--max-step",
        type=_pos_int,
        default=_DEFAULTS.max_step,
        help="most teachers added or removed at once (default %(default)s)",
    )
    s.add_argument(
        "--start-timeout",
        type=_pos_float,
        default=_DEFAULTS.start_timeout,
        help="seconds a started teacher counts as capacity before it registers (default %(default)s)",
    )
    s.add_argument("--gpu-budget", type=_nonneg_int, default=None, help="accelerators the pool may use in all")
    s.add_argument(
        "--gpus-per-teacher",
        type=_pos_int,
        default=_DEFAULTS.gpus_per_teacher,
        help="accelerators one teacher uses (default %(default)s)",
    )
    s.add_argument(
        "--capacity-hint",
        type=_nonneg_float,
        default=_DEFAULTS.capacity_hint,
        help="samples/s per teacher to assume before one has measured it (default: none)",
    )

    c = p.add_argument_group("controller")
    c.add_argument("--period", type=_pos_float, default=1.0, help="seconds between decisions (default %(default)s)")
    c.add_argument("--metrics-port", type=_nonneg_int, default=None, help="serve Prometheus /metrics on this port")
    c.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics server (default %(default)s)")
    c.add_argument("--identity", default=None, help="name in the leader election (default: host-pid)")
    c.add_argument(
        "--election-ttl",
        type=_pos_float,
        default=5.0,
        help="leader lease seconds: a dead leader is replaced within about this (default %(default)s)",
    )
    c.add_argument(
        "--registry-timeout",
        type=_pos_float,
        default=3.0,
        help="seconds allowed for one registry read (default %(default)s)",
    )

    lb = p.add_argument_group("local backend")
    lb.add_argument("--devices", default="cpu", help="where teachers run, spread evenly: cpu or cuda:0,cuda:1,...")
    lb.add_argument(
        "--teachers-per-device",
        type=_pos_int,
        default=1,
        help="most teachers per accelerator (default %(default)s; cpu is unlimited)",
    )
    lb.add_argument(
        "--grace", type=_pos_float, default=40.0, help="seconds from SIGTERM (drain) to SIGKILL (default %(default)s)"
    )
    lb.add_argument("--log-dir", default=None, help="teacher logs go here (default: a temporary directory)")

    kb = p.add_argument_group("kubernetes backend")
    kb.add_argument("--deployment", default=None, help="the teacher Deployment to scale")
    kb.add_argument("--namespace", default=None, help="its namespace (default: $POD_NAMESPACE, the pod's, or default)")
    kb.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    kb.add_argument("--context", default=None, help="kubeconfig context")
    kb.add_argument(
        "--api-timeout",
        type=_pos_float,
        default=10.0,
        help="seconds allowed for one Kubernetes API call (default %(default)s)",
    )

    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    args = list(argv)
    if "--" in args:
        i = args.index("--")
        return args[:i], args[i + 1 :]
    return args, []


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    """The :class:`PolicyConfig` the flags describe (raises :class:`PolicyConfigError`)."""
    return PolicyConfig(
        min_teachers=args.min_teachers,
        max_teachers=args.max_teachers,
        target_utilisation=args.target_utilisation,
        headroom=args.headroom,
        stall_threshold=args.stall_threshold,
        busy_threshold=args.busy_threshold,
        queue_threshold=args.queue_threshold,
        up_window=args.up_window,
        settle=args.settle,
        down_window=args.down_window,
        max_step=args.max_step,
        start_timeout=args.start_timeout,
        gpu_budget=args.gpu_budget,
        gpus_per_teacher=args.gpus_per_teacher,
        capacity_hint=args.capacity_hint,
    )


def backend_from_args(args: argparse.Namespace, command: Sequence[str]) -> Backend:
    """The backend the flags describe (raises :class:`BackendError` for a bad combination)."""
    if args.backend == "local":
        if args.deployment:
            raise BackendError("--deployment is for --backend kubernetes")
        return LocalBackend(
            command,
            registry=args.registry,
            service=args.service,
            devices=args.devices.split(","),
            teachers_per_device=args.teachers_per_device,
            grace=args.grace,
            start_timeout=args.start_timeout,
            log_dir=args.log_dir,
        )
    if command:
        raise BackendError("a teacher command after '--' is for --backend local; the Deployment defines the teachers")
    if not args.deployment:
        raise BackendError("--backend kubernetes needs --deployment NAME (the teacher Deployment)")
    return KubernetesBackend(
        args.deployment, args.namespace, kubeconfig=args.kubeconfig, context=args.context, timeout=args.api_timeout
    )


def registry_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``open_registry`` from the flags (TLS, user, timeout)."""
    return {"timeout": args.registry_timeout, **registry_security_options(args)}


async def run(args: argparse.Namespace, command: Sequence[str]) -> None:
    """Run the autoscaler until SIGTERM/SIGINT. Configuration errors raise ``AutoscaleError``."""
    from discovery import open_registry

    policy = policy_from_args(args)
    config = ControllerConfig(
        service=args.service,
        period=args.period,
        identity=args.identity or default_identity(),
        election_ttl=args.election_ttl,
        registry_timeout=args.registry_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    backend = backend_from_args(args, command)
    stop = StopSignals().install()  # SIGTERM/SIGINT: stop cleanly, exit 0 (also with SIGINT inherited ignored)
    registry = open_registry(args.registry, **registry_options(args))
    try:
        controller = Controller(registry, backend, policy, config)
        try:
            await controller.start()
        except BaseException:
            await backend.close()
            raise
        try:
            waiter = asyncio.ensure_future(controller.wait())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, stopper):
                task.cancel()
            if waiter in done and not waiter.cancelled() and waiter.exception() is not None:
                raise waiter.exception()  # type: ignore[misc]
            log.info("autoscaler of %r: stopping", args.service)
        finally:
            await controller.close()
    finally:
        await registry.close()
        stop.uninstall()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distill-autoscaler`` and ``python -m distill.autoscale``."""
    ours, command = _split(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        from discovery.address import parse_address
        from discovery.backends import backend, shared_forms
        from discovery.keys import validate_name

        if not backend(parse_address(args.registry).scheme).shared:
            raise ValueError(
                f"--registry must be {shared_forms()} (the autoscaler reads demand and elects a leader "
                f"there), not {args.registry!r}"
            )
        validate_name("service name", args.service)
        registry_options(args)
        policy_from_args(args)
        backend_from_args(args, command)
    except (PolicyConfigError, BackendError, ValueError) as e:
        parser.error(str(e))
    try:
        asyncio.run(run(args, command))
    except (AutoscaleError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover - the signal handler normally gets it first
        return 130
    return 0
