"""Command-line flags for a student job, so every training script spells the mesh the same way.

``add_distill_args(parser)`` adds a "distillation" group; ``distill_options_from_args(args)`` turns
the parsed namespace into the keyword arguments ``DistillReader`` takes. Per-flag checks happen
while parsing (argparse reports them with the flag's name and exits, as for any bad flag);
checks that involve several flags happen in ``distill_options_from_args`` and raise ``ValueError``,
because argparse has no hook for them and a script may also build the namespace itself. The same
per-flag checks run again there, so a hand-built ``argparse.Namespace`` gets the same guarantees.

Flag names use underscores (``--distill_teachers``) to match the call form the users' scripts
already have; the reader's keyword names are the flag names without the ``distill_`` prefix,
except ``--distill_hedge_ms`` which becomes ``hedge_after`` in seconds ("auto" when not given, None
when 0: off).

The value checkers here (``positive_float``, ``non_negative_int``, ``fallback_choice``, ...) are the
only definition of each rule: ``distill.reader.ReaderOptions`` validates its fields with them too.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, TypeVar

from discovery.address import parse_address, parse_endpoints
from discovery.keys import validate_name
from discovery.options import etcd_options

__all__ = [
    "FALLBACKS",
    "add_distill_args",
    "checked",
    "distill_options_from_args",
    "fallback_choice",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]

FALLBACKS: tuple[str, ...] = ("error", "hard_labels")
"""What the reader does after ``no_teacher_timeout`` seconds without any teacher: raise, or yield
batches with ``None`` teacher outputs (train on hard labels, see ``KDLoss``)."""

_TEACHERS_FORM = "HOST:PORT[,HOST:PORT...] (e.g. 10.0.0.7:9898,10.0.0.8:9898)"
_REGISTRY_FORM = "etcd://HOST:PORT[,HOST:PORT...] (e.g. etcd://10.0.0.5:2379)"

_T = TypeVar("_T")


def _teachers(text: str) -> str:
    """A static teacher list, normalised to ``host:port,host:port`` (a ``static://`` prefix is allowed).

    Parsing is ``discovery.address``'s, so the flag accepts exactly what the static registry does
    (IPv6 in brackets, duplicates dropped).
    """
    text = text.strip()
    if "://" in text:
        try:
            address = parse_address(text)
        except ValueError as e:
            raise ValueError(f"{e}; for --distill_teachers write {_TEACHERS_FORM}") from None
        if address.scheme != "static":
            raise ValueError(
                f"--distill_teachers takes teacher addresses, {_TEACHERS_FORM}; "
                f"for a registry use --distill_registry {_REGISTRY_FORM}"
            )
        return ",".join(address.hostports)
    try:
        endpoints = parse_endpoints(text)
    except ValueError as e:
        raise ValueError(f"bad teacher list {text!r}: {e} (expected {_TEACHERS_FORM})") from None
    return ",".join(str(ep) for ep in endpoints)


def _registry(text: str) -> str:
    """An etcd registry address, normalised to ``etcd://host:port,host:port`` (port 2379 if left out)."""
    if "://" not in text:
        raise ValueError(
            f"bad registry {text.strip()!r}: expected {_REGISTRY_FORM}; "
            "for a fixed list of teachers use --distill_teachers HOST:PORT[,HOST:PORT]"
        )
    address = parse_address(text)
    if address.scheme != "etcd":
        raise ValueError(
            f"--distill_registry takes an etcd address, {_REGISTRY_FORM}; "
            "for a fixed list of teachers use --distill_teachers HOST:PORT[,HOST:PORT]"
        )
    return str(address)


def _service(text: str) -> str:
    # The service name is one segment of the etcd key /distill/v1/<service>/...
    return validate_name("service name", text)


def _float(text: str | float) -> float:
    if isinstance(text, bool):
        raise ValueError("expected a number, got a bool")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def _int(text: str | int) -> int:
    if isinstance(text, bool):
        raise ValueError("expected an integer, got a bool")
    if isinstance(text, int):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def positive_float(text: str | float) -> float:
    value = _float(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return value


def non_negative_float(text: str | float) -> float:
    value = _float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text!r}")
    return value


def positive_int(text: str | int) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str | int) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {text!r}")
    return value


def fallback_choice(text: str) -> str:
    if text not in FALLBACKS:
        raise ValueError(f"must be one of {', '.join(FALLBACKS)}, got {text!r}")
    return text


def _argtype(check: Callable[[Any], _T], name: str) -> Callable[[str], _T]:
    """Wrap a checker as an argparse ``type``: argparse shows ArgumentTypeError messages verbatim."""

    def parse(text: str) -> _T:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name  # argparse names the type in its fallback message
    return parse


def add_distill_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "distillation" flag group to ``parser`` and return it (so calls can be chained).

    Teachers come from exactly one of ``--distill_teachers`` (a fixed list) or
    ``--distill_registry`` plus ``--distill_service`` (teachers that register themselves and come
    and go); ``distill_options_from_args`` enforces that. All other flags have working defaults.
    """
    g = parser.add_argument_group(
        "distillation",
        "Where the teachers are and how the student talks to them. Pass either --distill_teachers or "
        "--distill_registry with --distill_service.",
    )
    g.add_argument(
        "--distill_teachers",
        type=_argtype(_teachers, "teachers"),
        default=None,
        metavar="HOST:PORT[,HOST:PORT]",
        help="a fixed list of teacher servers",
    )
    g.add_argument(
        "--distill_registry",
        type=_argtype(_registry, "registry"),
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT]",
        help="etcd endpoints where teachers register; needs --distill_service",
    )
    g.add_argument(
        "--distill_service",
        type=_argtype(_service, "service"),
        default=None,
        metavar="NAME",
        help="the teacher service to use from the registry (the name teachers register under)",
    )
    g.add_argument(
        "--distill_timeout",
        type=_argtype(positive_float, "seconds"),
        default=10.0,
        metavar="SECONDS",
        help="deadline for one chunk at one teacher; a chunk that misses it is re-sent to another "
        "teacher (default: %(default)s)",
    )
    g.add_argument(
        "--distill_fallback",
        default="error",
        choices=FALLBACKS,
        help="with no teacher for --distill_no_teacher_timeout: raise (error) or yield batches "
        "with no teacher outputs (hard_labels) (default: %(default)s)",
    )
    g.add_argument(
        "--distill_no_teacher_timeout",
        type=_argtype(positive_float, "seconds"),
        default=60.0,
        metavar="SECONDS",
        help="how long to wait with no teacher at all before --distill_fallback applies "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--distill_max_teachers",
        type=_argtype(non_negative_int, "count"),
        default=0,
        metavar="N",
        help="use at most N teachers, chosen by deterministic subsetting so that many students "
        "spread over the pool; 0 = all (default: %(default)s)",
    )
    g.add_argument(
        "--distill_prefetch",
        type=_argtype(positive_int, "count"),
        default=4,
        metavar="N",
        help="loader batches in flight to teachers ahead of the training loop (default: %(default)s)",
    )
    g.add_argument(
        "--distill_teacher_batch_size",
        type=_argtype(non_negative_int, "count"),
        default=0,
        metavar="N",
        help="split batches into chunks of at most N samples per request; 0 = the teacher's "
        "max batch size (default: %(default)s)",
    )
    g.add_argument(
        "--distill_hedge_ms",
        type=_argtype(non_negative_float, "milliseconds"),
        default=None,
        metavar="MS",
        help="send a second copy of a chunk to another teacher after MS milliseconds without a "
        "reply, and take whichever answers first; 0 = off (default: adaptive, 4x the teachers' "
        "median latency and at least 250 ms)",
    )
    g.add_argument("--distill_tls_ca", metavar="FILE", help="CA certificate that signed the teachers' TLS certificates")
    g.add_argument("--distill_tls_cert", metavar="FILE", help="this student's certificate (teachers with mutual TLS)")
    g.add_argument("--distill_tls_key", metavar="FILE", help="the key of --distill_tls_cert")
    g.add_argument("--distill_registry_ca_cert", metavar="FILE", help="CA certificate for etcd over TLS")
    g.add_argument("--distill_registry_cert", metavar="FILE", help="client certificate for etcd (with the key)")
    g.add_argument("--distill_registry_key", metavar="FILE", help="client key for etcd (with the certificate)")
    g.add_argument("--distill_registry_user", metavar="USER",
                   help="etcd user; the password comes from $DISTILL_REGISTRY_PASSWORD")
    g.add_argument("--distill_cache", metavar="PATH",
                   help="a teacher-output store (distill.cache): stored samples are not asked of a teacher, and "
                   "teacher answers are stored (the program names the batch's key field)")
    g.add_argument("--distill_cache_mode", choices=("read", "write", "read_write"), default="read_write",
                   help="read_write: read the store and store what teachers answer; read: only read it (with no "
                   "teachers, train offline); write: ask teachers for everything and store it (default: %(default)s)")
    return parser


def _get(args: argparse.Namespace, name: str) -> Any:
    try:
        return getattr(args, name)
    except AttributeError:
        raise ValueError(
            f"args has no {name!r}; build the parser with distill.add_distill_args(parser)"
        ) from None


def checked(check: Callable[[Any], _T], flag: str, value: Any) -> _T:
    """``check(value)``, its ValueError prefixed with the flag or option name it is about."""
    try:
        return check(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def distill_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``DistillReader`` from flags added by ``add_distill_args``.

    Returns a dict with keys ``teachers`` (``"host:port,host:port"`` or None), ``registry``
    (``"etcd://..."`` or None), ``service``, ``timeout``, ``fallback``, ``no_teacher_timeout``,
    ``max_teachers``, ``prefetch``, ``teacher_batch_size`` (0 = the teacher's max) and
    ``hedge_after`` (seconds; "auto" when the flag is absent; None when it is 0: off). Raises
    ``ValueError`` naming the flag to pass or fix.
    """
    teachers = _get(args, "distill_teachers")
    registry = _get(args, "distill_registry")
    service = _get(args, "distill_service")

    offline = getattr(args, "distill_cache", None) is not None and getattr(args, "distill_cache_mode", "") == "read"
    if teachers is None and registry is None and not offline:
        raise ValueError(
            "no teachers configured: pass --distill_teachers host:port[,host:port] for a fixed set of "
            "teachers, or --distill_registry etcd://host:2379 with --distill_service NAME to find them "
            "in the registry"
        )
    if teachers is not None and registry is not None:
        raise ValueError(
            "pass only one of --distill_teachers (a fixed set) and --distill_registry (discovery), not both"
        )
    if teachers is not None:
        teachers = checked(_teachers, "--distill_teachers", teachers)
        if service is not None:
            raise ValueError(
                "--distill_service applies only with --distill_registry; "
                "drop it when using --distill_teachers"
            )
    elif registry is not None:
        registry = checked(_registry, "--distill_registry", registry)
        if service is None:
            raise ValueError(
                "--distill_registry needs --distill_service NAME, the service the teachers register under"
            )
        service = checked(_service, "--distill_service", service)

    timeout = checked(positive_float, "--distill_timeout", _get(args, "distill_timeout"))
    raw_hedge = _get(args, "distill_hedge_ms")
    hedge_ms = None if raw_hedge is None else checked(non_negative_float, "--distill_hedge_ms", raw_hedge)
    hedge_after: float | str | None = "auto" if hedge_ms is None else (hedge_ms / 1000.0 if hedge_ms > 0 else None)
    if isinstance(hedge_after, float) and hedge_after >= timeout:
        raise ValueError(
            f"--distill_hedge_ms {hedge_ms:g} is not shorter than --distill_timeout {timeout:g} s, "
            "so a hedge would never be sent before the chunk is re-routed anyway; "
            "note that the hedge flag is in milliseconds"
        )

    return {
        "teachers": teachers,
        "registry": registry,
        "service": service,
        "timeout": timeout,
        "fallback": checked(fallback_choice, "--distill_fallback", _get(args, "distill_fallback")),
        "no_teacher_timeout": checked(
            positive_float, "--distill_no_teacher_timeout", _get(args, "distill_no_teacher_timeout")
        ),
        "max_teachers": checked(
            non_negative_int, "--distill_max_teachers", _get(args, "distill_max_teachers")
        ),
        "prefetch": checked(positive_int, "--distill_prefetch", _get(args, "distill_prefetch")),
        "teacher_batch_size": checked(
            non_negative_int, "--distill_teacher_batch_size", _get(args, "distill_teacher_batch_size")
        ),
        "hedge_after": hedge_after,
        "tls_ca": getattr(args, "distill_tls_ca", None),
        "tls_cert": getattr(args, "distill_tls_cert", None),
        "tls_key": getattr(args, "distill_tls_key", None),
        "registry_options": etcd_options(
            getattr(args, "distill_registry_ca_cert", None), getattr(args, "distill_registry_cert", None),
            getattr(args, "distill_registry_key", None), getattr(args, "distill_registry_user", None),
        ) if registry is not None else {},
        **({"cache": args.distill_cache, "cache_mode": getattr(args, "distill_cache_mode", "read_write")}
           if getattr(args, "distill_cache", None) is not None else {}),
    }
