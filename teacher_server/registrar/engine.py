"""Which engine a registrar watches, and where: the parsed ``--engine`` / ``--url`` / ``--metrics-url``.

Why strict parsing here: a typo in ``--url`` otherwise looks like an engine that never becomes
ready, and the registrar would probe it for ever. So a bad engine kind or URL is refused at start
(exit 2) with the accepted forms in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from discovery.address import parse_endpoint
from teacher_server.registrar.errors import RegistrarUsageError

__all__ = ["ENGINES", "HTTP_ENGINES", "EngineAddress", "parse_engine"]

HTTP_ENGINES = ("vllm", "sglang")
ENGINES = ("kserve", *HTTP_ENGINES)

_HTTP_FORMS = "http://HOST:PORT[/PATH] or https://HOST:PORT[/PATH]"
_KSERVE_FORMS = "grpc://HOST:PORT, grpcs://HOST:PORT (TLS) or HOST:PORT"


@dataclass(frozen=True)
class EngineAddress:
    """One engine: its ``kind`` (the record's protocol), the ``host:port`` students dial, the HTTP
    path prefix before the protocol's own routes ("" = the root), whether it expects TLS, the base
    URL of its HTTP routes (None for a gRPC engine) and where its Prometheus metrics are read
    (None: nowhere; the load then says only whether it drains)."""

    kind: str
    host: str
    port: int
    path: str
    tls: bool
    base_url: str | None
    metrics_url: str | None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_engine(kind: str, url: str, metrics_url: str | None = None) -> EngineAddress:
    """The engine ``--engine KIND --url URL`` names. vLLM and SGLang are HTTP servers
    (``http[s]://host:port[/path]``; metrics default to ``URL/metrics``); a KServe v2 engine
    (teacher-server, Triton) is a gRPC address (``grpc://``, ``grpcs://`` or bare ``host:port``;
    its metrics live on another port, so only ``--metrics-url`` names them).

    Raises :class:`RegistrarUsageError` saying what is wrong and what is accepted."""
    kind = kind.strip().lower()
    if kind not in ENGINES:
        raise RegistrarUsageError(f"--engine {kind!r}: not an engine the registrar knows; use one of "
                                  f"{', '.join(ENGINES)}")
    if metrics_url is not None:
        _check_http(metrics_url, "--metrics-url")
    if kind == "kserve":
        return _kserve(url, metrics_url)
    parts = _check_http(url, "--url")
    path = parts.path.rstrip("/")
    base = f"{parts.scheme}://{parts.netloc}{path}"
    try:
        ep = parse_endpoint(parts.netloc, default_port=443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise RegistrarUsageError(f"--url {url!r}: {e}; use {_HTTP_FORMS}") from None
    return EngineAddress(kind, ep.host, ep.port, path, parts.scheme == "https", base,
                         metrics_url if metrics_url is not None else f"{base}/metrics")


def _check_http(url: str, flag: str) -> SplitResult:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RegistrarUsageError(f"{flag} {url!r}: not an HTTP URL; use {_HTTP_FORMS}")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise RegistrarUsageError(f"{flag} {url!r}: a query, fragment or credentials are not accepted; use "
                                  f"{_HTTP_FORMS}")
    return parts


def _kserve(url: str, metrics_url: str | None) -> EngineAddress:
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "grpc", text
    if scheme not in ("grpc", "grpcs") or "/" in rest:
        raise RegistrarUsageError(f"--url {url!r}: a KServe v2 engine is a gRPC address; use {_KSERVE_FORMS}")
    try:
        ep = parse_endpoint(rest)
    except ValueError as e:
        raise RegistrarUsageError(f"--url {url!r}: {e}; use {_KSERVE_FORMS}") from None
    return EngineAddress("kserve", ep.host, ep.port, "", scheme == "grpcs", None, metrics_url)
