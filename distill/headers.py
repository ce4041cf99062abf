"""gRPC headers sent to every teacher (access tokens): the name and value rules, and
``--distill_header KEY[=VALUE]``.

Header values are credentials: no message, repr or log line here shows one. ``--distill_header
KEY`` without ``=VALUE`` takes the value from ``$DISTILL_HEADER_<KEY>`` (upper case, other
characters as ``_``), which keeps the token off the command line, where ``ps`` and job logs show it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["HeaderArg", "header_env_var", "headers_from_flags", "headers_map"]


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


def headers_from_flags(args: list[HeaderArg] | None) -> dict[str, str]:
    """Repeated ``--distill_header`` flags as one mapping; a name given twice is refused."""
    headers: dict[str, str] = {}
    for header in args or ():
        name, value = header.resolve()
        if name in headers:
            raise ValueError(f"--distill_header {name} is given twice (names are case-insensitive)")
        headers[name] = value
    return headers
