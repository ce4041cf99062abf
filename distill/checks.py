"""The rules for single option values, each stated once: numbers, choices, model names and the
teacher and registry addresses. ``distill.options`` declares which rule checks which option; the
``--distill_*`` flags (``distill.flags``) and ``ReaderOptions`` both apply them from there, so a
value is judged, and its error worded, the same way however it was given.

A rule takes the value (a string from the command line, or the Python value) and returns it
normalised, or raises ``ValueError`` saying what is wrong; ``checked`` prefixes the message with
the option or flag it is about.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from discovery.address import parse_address
from discovery.backends import BACKENDS
from discovery.keys import validate_name
from discovery.static import ENGINE_PROTOCOLS, parse_teachers

__all__ = [
    "CACHE_MODES",
    "FALLBACKS",
    "NONFINITE",
    "OUTPUT_DTYPES",
    "TRANSPORTS",
    "cache_mode_choice",
    "checked",
    "fallback_choice",
    "hedge_from_ms",
    "maybe_bool",
    "model_name",
    "non_negative_float",
    "non_negative_int",
    "nonfinite_choice",
    "normalize_inputs",
    "one_of",
    "output_dtype_choice",
    "output_names",
    "parameter_arg",
    "parameters_from_flags",
    "positive_float",
    "positive_int",
    "registry_address",
    "request_parameters",
    "service_name",
    "teacher_list",
    "torch_device",
    "transport_choice",
]

_T = TypeVar("_T")

InputSpec = str | Sequence[str] | Mapping[str, str | int]
"""Which batch fields go to the teacher: names (field = teacher input), or {teacher input: field}."""

FALLBACKS: tuple[str, ...] = ("error", "hard_labels")
"""What the reader does after ``no_teacher_timeout`` seconds without any teacher: raise, or yield
batches with ``None`` teacher outputs (train on hard labels, see ``KDLoss``)."""

NONFINITE: tuple[str, ...] = ("error", "mask")
"""What the reader does with a batch a teacher answered with inf or NaN in some rows: raise
``NonFiniteOutputError`` naming the batch and rows, or deliver it with ``VALID_ROWS`` marking them."""

OUTPUT_DTYPES: tuple[str, ...] = ("FP32", "FP16", "BF16")
"""The float types a reader may ask teachers to send their outputs in (FP16 / BF16 halve the bytes)."""

_TEACHERS_FORM = "[vllm://|sglang://]HOST:PORT[,...] (e.g. 10.0.0.7:9898,vllm://10.0.0.8:8000)"
_REGISTRY_FORM = "etcd://HOST:PORT[,HOST:PORT...] (e.g. etcd://10.0.0.5:2379)"

def teacher_list(text: str) -> str:
    """A static teacher list, normalised to ``host:port,host:port`` (a ``static://`` prefix is allowed).

    Parsing is ``discovery.static``'s, so the flag accepts exactly what the static registry does
    (IPv6 in brackets, duplicates dropped, engines named by scheme: ``vllm://host:port``).
    """
    text = text.strip()
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme not in ("static", "kserve", *ENGINE_PROTOCOLS) and scheme in BACKENDS:
        raise ValueError(
            f"--distill_teachers takes teacher addresses, {_TEACHERS_FORM}; "
            f"for a registry use --distill_registry {_REGISTRY_FORM}"
        )
    try:
        teachers = parse_teachers(text)
    except ValueError as e:
        raise ValueError(f"bad teacher list {text!r}: {e}") from None
    return ",".join(str(t) for t in teachers)


def registry_address(text: str) -> str:
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


def service_name(text: str) -> str:
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


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """The check of an option that takes one of `choices`, exactly as written."""

    def choice(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return choice


nonfinite_choice = one_of(NONFINITE)
fallback_choice = one_of(FALLBACKS)


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


CACHE_MODES: tuple[str, ...] = ("read", "write", "read_write")
"""How a reader uses its teacher-output store (``cache_mode``): see ``ReaderOptions``."""


cache_mode_choice = one_of(CACHE_MODES)


TRANSPORTS: tuple[str, ...] = ("call", "stream")
"""How a reader sends chunks to a KServe teacher (``transport``): see ``ReaderOptions``."""


transport_choice = one_of(TRANSPORTS)


def checked(check: Callable[[Any], _T], name: str, value: Any) -> _T:
    """``check(value)``, its ValueError prefixed with the flag or option name it is about."""
    try:
        return check(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def normalize_inputs(inputs: InputSpec) -> dict[str, str | int]:
    """`inputs` as teacher input name -> batch field (key or position)."""
    if isinstance(inputs, str):
        return {inputs: inputs}
    if isinstance(inputs, Mapping):
        if not inputs:
            raise ValueError("inputs is empty: name at least one batch field to send to the teachers")
        for name, field in inputs.items():
            if not isinstance(name, str) or not isinstance(field, (str, int)):
                raise TypeError(f"inputs maps teacher input names to batch keys or positions; got {name!r}: {field!r}")
        return dict(inputs)
    names = list(inputs)
    if not names:
        raise ValueError("inputs is empty: name at least one batch field to send to the teachers")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"inputs {names!r}: a list names fields that are also the teacher's input names; for tuple "
            "batches map names to positions, e.g. inputs={'INPUT': 0}"
        )
    return {n: n for n in names}


def request_parameters(given: Mapping[str, Any] | None) -> dict[str, bool | int | float | str]:
    """Extra request parameters (of transforms a teacher registered): string names, scalar values."""
    out: dict[str, bool | int | float | str] = {}
    for name, value in dict(given or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter names are non-empty strings, got {name!r}")
        if not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"parameter {name!r}: a request parameter is a bool, int, float or str, got {value!r}")
        out[name] = value
    return out


def parameter_arg(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE`` from the command line: VALUE read as JSON (true, 3, 0.5, "s"), else as a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"{text!r} is not KEY=VALUE")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{text!r}: VALUE must be a bool, a number or a string")
    return name, value


def parameters_from_flags(items: Sequence[tuple[str, bool | int | float | str]] | None) -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` flags as one mapping; a key given twice is refused."""
    out: dict[str, Any] = {}
    for name, value in items or ():
        if name in out:
            raise ValueError(f"parameter {name} is given twice")
        out[name] = value
    return out


def hedge_from_ms(ms: float | None) -> float | str | None:
    """--distill_hedge_ms: absent is adaptive ("auto"), 0 is off (None), else seconds."""
    return "auto" if ms is None else (ms / 1000.0 if ms > 0 else None)


def torch_device(device: Any) -> Any:
    """A device name or torch.device as a torch.device (torch imported only here, when used)."""
    import torch

    return torch.device(device)


def output_names(outputs: Sequence[str] | None) -> tuple[str, ...] | None:
    """The outputs asked for, as a tuple; None (or empty) for all the teacher has."""
    return tuple(outputs) if outputs else None
