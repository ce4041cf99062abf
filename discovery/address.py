"""Registry addresses: ``etcd://host:port[,host:port]`` and ``static://host:port[,host:port]``.

One string names both *where* teachers are found and *how*: the scheme picks the backend, the rest
lists endpoints. Students pass it as ``--distill_registry`` (or build ``static://`` from
``--distill_teachers``), teachers as ``--registry``. Parsing is strict and every error message
repeats the accepted forms, because a typo here otherwise surfaces much later as "no teachers".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from discovery.backends import BACKENDS, backend, shared_forms

__all__ = [
    "ACCEPTED_FORMS",
    "DEFAULT_ETCD_PORT",
    "Endpoint",
    "RegistryAddress",
    "Scheme",
    "parse_address",
    "parse_endpoint",
    "parse_endpoints",
    "parse_registry_address",
]

Scheme = str
"""A backend's scheme (``"etcd"``, ``"static"``): the keys of :data:`discovery.backends.BACKENDS`."""

DEFAULT_ETCD_PORT = 2379


def accepted_forms() -> str:
    """Every known backend's address form, for error messages."""
    forms = " or ".join(b.form for b in BACKENDS.values())
    return f"accepted forms: {forms}; write IPv6 hosts in brackets, e.g. etcd://[::1]:2379"


ACCEPTED_FORMS = accepted_forms()

# RFC 1123 host names (plus '_', which real deployments use) and dotted IPv4.
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?$")


@dataclass(frozen=True)
class Endpoint:
    """One ``host:port``. ``host`` is kept without brackets; ``str()`` adds them back for IPv6."""

    host: str
    port: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RegistryAddress:
    """A parsed registry address: the backend ``scheme`` and its ``endpoints`` in the given order."""

    scheme: Scheme
    endpoints: tuple[Endpoint, ...]

    @property
    def hostports(self) -> tuple[str, ...]:
        """The endpoints as ``host:port`` strings (IPv6 bracketed)."""
        return tuple(str(e) for e in self.endpoints)

    def __str__(self) -> str:
        return f"{self.scheme}://{','.join(self.hostports)}"


class _Bad(ValueError):
    pass


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise _Bad(f"port {text!r} is not a number in 1..65535")
    return int(text)


def parse_endpoint(text: str, *, default_port: int | None = None) -> Endpoint:
    """Parse one ``host:port`` (``[v6addr]:port`` for IPv6).

    ``default_port`` is used when the port is left out; without it a missing port is an error.
    Raises ``ValueError`` describing what is wrong with ``text`` (without the accepted forms: the
    callers add the forms that apply to them).
    """
    s = text.strip()
    if not s:
        raise _Bad("empty endpoint")
    if "@" in s:
        raise _Bad(f"{text!r} contains credentials; pass username/password as options instead")
    if s.startswith("["):
        close = s.find("]")
        if close < 0:
            raise _Bad(f"{text!r} opens '[' for an IPv6 host but never closes it")
        host, rest = s[1:close], s[close + 1 :]
        if not host or ":" not in host or not _IPV6.match(host):
            raise _Bad(f"{host!r} in {text!r} is not an IPv6 address")
        if rest == "":
            if default_port is None:
                raise _Bad(f"{text!r} has no port")
            return Endpoint(host, default_port)
        if not rest.startswith(":"):
            raise _Bad(f"expected ':PORT' after ']' in {text!r}")
        return Endpoint(host, _port(rest[1:]))
    if s.count(":") > 1:
        raise _Bad(f"{text!r} looks like an IPv6 address without brackets; write [ADDR]:PORT")
    host, sep, port = s.partition(":")
    if not host:
        raise _Bad(f"{text!r} has no host")
    if not _HOSTNAME.match(host):
        raise _Bad(f"{host!r} in {text!r} is not a valid host name or IPv4 address")
    if not sep:
        if default_port is None:
            raise _Bad(f"{text!r} has no port; write HOST:PORT")
        return Endpoint(host, default_port)
    return Endpoint(host, _port(port))


def parse_endpoints(text: str, *, default_port: int | None = None) -> tuple[Endpoint, ...]:
    """Parse a comma-separated ``host:port`` list (duplicates dropped, order kept)."""
    out: list[Endpoint] = []
    for part in text.split(","):
        ep = parse_endpoint(part, default_port=default_port)
        if ep not in out:
            out.append(ep)
    return tuple(out)


def parse_address(text: str) -> RegistryAddress:
    """Parse ``etcd://host:port[,host:port]`` or ``static://host:port[,host:port]``.

    For ``etcd://`` a missing port means etcd's default, 2379; ``static://`` endpoints are teacher
    servers and need an explicit port. Raises ``ValueError`` whose message says what is wrong and
    shows the accepted forms.
    """
    if not isinstance(text, str):
        raise TypeError(f"registry address must be a str, not {type(text).__name__}")
    try:
        scheme, sep, rest = text.strip().partition("://")
        if not sep:
            raise _Bad(f"missing scheme ({' or '.join(f'{s}://' for s in BACKENDS)})")
        scheme = scheme.lower()
        if scheme not in BACKENDS:
            raise _Bad(f"unknown scheme {scheme + '://'!r}")
        if rest.endswith("/"):
            rest = rest[:-1]
        if "/" in rest or "?" in rest or "#" in rest:
            raise _Bad("a path, query or fragment is not allowed")
        if not rest.strip():
            raise _Bad("no endpoints after the scheme")
        endpoints = parse_endpoints(rest, default_port=backend(scheme).default_port)
        return RegistryAddress(scheme, endpoints)
    except _Bad as e:
        raise ValueError(f"invalid registry address {text!r}: {e}; {accepted_forms()}") from None


def parse_registry_address(text: str, *, hint: str = "") -> RegistryAddress:
    """Parse the address of a registry that keeps shared state (teachers register there, students
    publish demand, an autoscaler elects its leader): ``etcd://...`` today, any backend whose
    :class:`~discovery.backends.Backend` entry says ``shared``.

    What ``--distill_registry``, the autoscaler's and ``distill top``'s ``--registry`` accept. A
    static teacher list, or text without a scheme, is refused with the accepted forms; ``hint``
    (e.g. "for a fixed list of teachers use --distill_teachers HOST:PORT") is appended to the message.
    """
    tail = f"; {hint}" if hint else ""
    if not isinstance(text, str) or "://" not in text:
        raise ValueError(f"bad registry {str(text).strip()!r}: expected {shared_forms()}{tail}")
    address = parse_address(text)
    if not backend(address.scheme).shared:
        raise ValueError(
            f"{str(address)!r} is a fixed list with no shared state (no loads, demand or leader); "
            f"a registry address is {shared_forms()}{tail}"
        )
    return address
