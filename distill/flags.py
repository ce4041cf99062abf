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
when 0: off), and ``--distill_header`` (repeatable) which becomes the ``headers`` mapping.

Header values are access tokens: they are never put in a message or a repr. ``--distill_header
KEY`` without ``=VALUE`` takes the value from ``$DISTILL_HEADER_<KEY>`` (upper case, other
characters as ``_``), which keeps the token off the command line, where ``ps`` and job logs show it.

The value checkers here (``positive_float``, ``non_negative_int``, ``fallback_choice``, ...) are the
only definition of each rule: ``distill.reader.ReaderOptions`` validates its fields with them too.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from discovery.address import parse_address, parse_endpoints
from discovery.keys import validate_name
from discovery.options import etcd_options

__all__ = [
    "FALLBACKS",
    "OUTPUT_DTYPES",
    "HeaderArg",
    "add_distill_args",
    "checked",
    "distill_options_from_args",
    "fallback_choice",
    "header_env_var",
    "headers_map",
    "maybe_bool",
    "model_name",
    "non_negative_float",
    "non_negative_int",
    "output_dtype_choice",
    "positive_float",
    "positive_int",
]

FALLBACKS: tuple[str, ...] = ("error", "hard_labels")
"""What the reader does after ``no_teacher_timeout`` seconds without any teacher: raise, or yield
batches with ``None`` teacher outputs (train on hard labels, see ``KDLoss``)."""

OUTPUT_DTYPES: tuple[str, ...] = ("FP32", "FP16", "BF16")
"""The float types a reader may ask teachers to send their outputs in (FP16 / BF16 halve the bytes)."""

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


def output_dtype_choice(text: str) -> str:
    """One of OUTPUT_DTYPES, in any case; returned upper case."""
    if not isinstance(text, str) or text.upper() not in OUTPUT_DTYPES:
        raise ValueError(f"must be one of {', '.join(OUTPUT_DTYPES)}, got {text!r}")
    return text.upper()


def maybe_bool(value: object) -> bool | None:
    """A tri-state switch: True, False, or None for "the teacher server's default"."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"must be True, False or None (the server's default), got {value!r}")


def model_name(text: str) -> str:
    """A model name as the teachers serve it (Triton's names are free-form): non-empty, printable."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"must be a model name, got {text!r}")
    if text != text.strip() or not text.isprintable():
        raise ValueError(f"{text!r} has surrounding spaces or control characters")
    return text


# gRPC metadata keys: lower-case letters, digits, '-', '_' and '.'; "grpc-" is gRPC's own, "-bin"
# marks binary values, and these are HTTP/2 headers gRPC sets itself.
_HEADER_KEY = re.compile(r"[0-9a-z_.-]+")
_RESERVED_HEADERS = frozenset({"content-type", "te", "host", "user-agent", "authority"})


def _header_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a header name must be a non-empty string, got {key!r}")
    lower = key.lower()
    if not _HEADER_KEY.fullmatch(lower):
        raise ValueError(f"header name {key!r} is not a valid gRPC metadata key: use letters, digits, '-', '_' "
                         "and '.' only")
    if lower.startswith("grpc-") or lower in _RESERVED_HEADERS:
        raise ValueError(f"header name {key!r} is reserved: gRPC sets it itself")
    if lower.endswith("-bin"):
        raise ValueError(f"header name {key!r} ends with '-bin', which gRPC keeps for binary values; "
                         "only text headers are supported")
    return lower


def _header_value(key: str, value: object) -> str:
    # The value is a credential: no message may show it.
    if not isinstance(value, str):
        raise ValueError(f"header {key!r}: the value must be a string, got a {type(value).__name__}")
    if not value:
        raise ValueError(f"header {key!r}: the value is empty")
    if not all(" " <= c <= "~" for c in value):
        raise ValueError(f"header {key!r}: the value must be printable ASCII (not shown here: it may be a token)")
    return value


def headers_map(headers: Mapping[str, str] | None) -> dict[str, str]:
    """gRPC call metadata to send on every call to every teacher: names lower-cased (gRPC requires
    it), names and values checked; the messages name the header, never its value."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise ValueError(f"expected a mapping {{name: value}}, got a {type(headers).__name__}")
    out: dict[str, str] = {}
    for key, value in headers.items():
        name = _header_key(key)
        if name in out:
            raise ValueError(f"header {name!r} is given twice (names are case-insensitive)")
        out[name] = _header_value(name, value)
    return out


def header_env_var(key: str) -> str:
    """Where ``--distill_header KEY`` (no value) takes the value from: ``DISTILL_HEADER_<KEY>``."""
    return "DISTILL_HEADER_" + re.sub(r"[^0-9A-Z]", "_", key.upper())


@dataclass(frozen=True)
class HeaderArg:
    """One parsed ``--distill_header``: the name, and the value, or None to read it from the
    environment (`header_env_var`) when the options are built. Its repr hides the value, so a
    script that prints its parsed arguments does not print the token."""

    key: str
    value: str | None

    def __repr__(self) -> str:
        shown = f"<from ${header_env_var(self.key)}>" if self.value is None else "<hidden>"
        return f"HeaderArg({self.key!r}, {shown})"

    @classmethod
    def parse(cls, text: str) -> HeaderArg:
        """``KEY=VALUE``, or ``KEY`` alone for a value from the environment."""
        key, sep, value = text.partition("=")
        name = _header_key(key.strip())
        if not sep:
            return cls(name, None)
        return cls(name, _header_value(name, value))

    def resolve(self) -> tuple[str, str]:
        """(name, value), the value read from the environment if the flag did not give it."""
        if self.value is not None:
            return self.key, self.value
        env = header_env_var(self.key)
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"--distill_header {self.key} takes its value from ${env}, which is not set; "
                             f"set it, or pass --distill_header {self.key}=VALUE")
        return self.key, _header_value(self.key, value)


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
    g.add_argument(
        "--distill_model",
        type=_argtype(model_name, "model"),
        default=None,
        metavar="NAME",
        help="the model to use on the teachers (default: what each teacher registered, else the one "
        "model its repository lists); needed with a Triton that restricts its model-repository API",
    )
    g.add_argument(
        "--distill_top_k",
        type=_argtype(non_negative_int, "count"),
        default=0,
        metavar="K",
        help="fetch each output's top K values and indices instead of the full tensor (OUT_TOPK_VALUES, "
        "OUT_TOPK_INDICES; the teachers must support it); 0 = full outputs (default: %(default)s)",
    )
    g.add_argument(
        "--distill_output_dtype",
        type=_argtype(output_dtype_choice, "dtype"),
        default=None,
        metavar="{FP32,FP16,BF16}",
        help="ask the teachers for outputs in this float type; FP16 and BF16 halve the bytes on the wire "
        "(default: the model's own)",
    )
    g.add_argument(
        "--distill_logprobs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the teachers for log_softmax(x / T) of floating outputs (computed over the full last dimension "
        "on the teacher, before top-k), or with --no-distill_logprobs for raw values (default: the server's)",
    )
    g.add_argument(
        "--distill_temperature",
        type=_argtype(positive_float, "temperature"),
        default=None,
        metavar="T",
        help="ask the teachers to divide floating outputs by T before log-softmax and top-k (default: the server's)",
    )
    g.add_argument(
        "--distill_topk_tail",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --distill_top_k, also fetch OUT_TOPK_TAIL, the probability mass outside the top K per position "
        "(--no-distill_topk_tail: never; default: the server's, and the reader keeps it only when asked)",
    )
    g.add_argument(
        "--distill_header",
        type=_argtype(HeaderArg.parse, "header"),
        action="append",
        default=None,
        metavar="KEY[=VALUE]",
        help="send this gRPC header on every call to every teacher (repeatable), e.g. the access token of a "
        "Triton that restricts its API: triton-grpc-protocol-<key>=<token>. Without =VALUE the value comes "
        "from $DISTILL_HEADER_<KEY> (upper case, other characters as _), which keeps it off the command line",
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
    (``"etcd://..."`` or None), ``service``, ``model`` (None: what each teacher serves), ``timeout``,
    ``fallback``, ``no_teacher_timeout``, ``max_teachers``, ``prefetch``, ``teacher_batch_size``
    (0 = the teacher's max), ``hedge_after`` (seconds; "auto" when the flag is absent; None when it
    is 0: off), ``top_k``, ``output_dtype``, ``logprobs``, ``temperature`` and ``topk_tail`` (None: the
    teacher server's default), ``headers`` ({name: value}, values from the environment
    where the flag gave none), the TLS files and ``registry_options``. Raises ``ValueError`` naming
    the flag to pass or fix.
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

    # Read with defaults: a namespace built by hand for an older flag set still works.
    model = getattr(args, "distill_model", None)
    output_dtype = getattr(args, "distill_output_dtype", None)
    temperature = getattr(args, "distill_temperature", None)
    headers: dict[str, str] = {}
    for arg in getattr(args, "distill_header", None) or ():
        header = arg if isinstance(arg, HeaderArg) else checked(HeaderArg.parse, "--distill_header", arg)
        name, value = header.resolve()
        if name in headers:
            raise ValueError(f"--distill_header {name} is given twice (names are case-insensitive)")
        headers[name] = value

    return {
        "teachers": teachers,
        "registry": registry,
        "service": service,
        "model": None if model is None else checked(model_name, "--distill_model", model),
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
        "top_k": checked(non_negative_int, "--distill_top_k", getattr(args, "distill_top_k", 0)),
        "output_dtype": None if output_dtype is None else checked(output_dtype_choice, "--distill_output_dtype",
                                                                  output_dtype),
        "logprobs": checked(maybe_bool, "--distill_logprobs", getattr(args, "distill_logprobs", None)),
        "temperature": None if temperature is None else checked(positive_float, "--distill_temperature",
                                                                temperature),
        "topk_tail": checked(maybe_bool, "--distill_topk_tail", getattr(args, "distill_topk_tail", None)),
        "headers": headers,
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
