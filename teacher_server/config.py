"""`ServerConfig`: everything a TeacherServer needs, each field declared once as a setting.

Each field's ``setting(...)`` is its default, its check, its help text and its flag: ``teacher-server``
builds its flags from these declarations and ``serve()``/``server_config()`` take them as keywords
(`teacher_server.options` adds the settings that are not ServerConfig fields: the model's
declaration, batching, registration). A ServerConfig built directly is checked by the same
declarations, its refusals naming the flag.

`OutputSettings` holds the server-wide defaults of the output transforms (``--top-k``,
``--logprobs``, ...): one typed field each, whose default, help text and check are the transform
registry's (`teacher_server.transforms`, through `transform_setting`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import grpc
import torch

from teacher_server.batcher import BatchingConfig
from teacher_server.outputs import CHUNK_BYTES
from teacher_server.settings import (
    Check,
    at_least,
    check_fields,
    existing_file,
    in_port_range,
    positive_finite,
    setting,
)
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO, SpecError
from teacher_server.transforms import PARAMETERS, OutputDefaults, Param

__all__ = ["HTTPLimits", "OutputSettings", "ServerConfig", "check_device", "parse_model_args", "transform_setting"]

DTYPES = tuple(FLOAT_OUTPUT_DTYPES)


def check_device(device: str) -> str | None:
    """What is wrong with `device` on this machine (None: a device it has; 'auto': chosen later)."""
    if device in ("", "auto"):
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"{device!r} is not a device; use cpu, cuda or cuda:N"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"{device}: CUDA is not available on this machine; use --device cpu"
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            return f"{device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    elif dev.type != "cpu":
        return f"{device}: teacher-server serves on cpu or cuda:N"
    return None


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


def _param_check(p: Param) -> Check:
    """The registry's check of `p` in the settings' convention: it returns the words that follow
    the setting's name (``must be a non-negative integer, got -1``) instead of raising ValueError
    with the request parameter's name and its KServe field (``top_k must be ... (int64_param)``),
    which mean nothing on the command line."""
    def check(value: Any) -> str | None:
        try:
            p.check(value)
        except ValueError as e:
            words = str(e).replace(f" ({p.wire})", "")
            return words[len(p.name) + 1:] if words.startswith(p.name + " ") else f"is refused: {words}"
        return None
    return check


def transform_setting(name: str) -> Any:
    """The server default of the transform parameter `name` as a setting (``--top-k``, ``top_k=``):
    its default, help text, choices and check are the registry's `Param`
    (`teacher_server.transforms.PARAMETERS`), so they are stated once, there."""
    p = PARAMETERS[name]
    if not p.server_default:
        raise ValueError(f"transform parameter {name!r} is per request only (Param.server_default=False)")
    given = "" if p.default is None or p.type is bool else " (%(default)s unless given)"
    text = f"default for requests{given}: " + p.help.replace("%", "%%")  # argparse formats help with %
    if p.type is bool:  # a flag sets the value that is not the default
        return setting(p.default, text, group="outputs", kind="negated" if p.default else "switch",
                       flag=f"--no-{p.flag[2:]}" if p.default else "", check=_param_check(p))
    declared: dict[str, Any] = {"type": str.upper if p.choices else p.type, "check": _param_check(p)}
    if p.choices:
        declared["choices"] = p.choices
    return setting(p.default, text, group="outputs", **declared)


@dataclass(frozen=True, kw_only=True)
class OutputSettings:
    """Server-wide defaults of the output transforms; a request overrides each with its parameter.

    One typed field per registry parameter that takes a server default (`Param.server_default`),
    everything else about it read from the registry by `transform_setting`."""

    output_dtype: str | None = transform_setting("output_dtype")
    top_k: int = transform_setting("top_k")
    logprobs: bool = transform_setting("logprobs")
    temperature: float = transform_setting("temperature")
    topk_tail: bool = transform_setting("topk_tail")

    def output_defaults(self) -> OutputDefaults:
        """These defaults as validation takes them, by the registry's parameter names."""
        return OutputDefaults.from_options({f.name: getattr(self, f.name) for f in fields(OutputSettings)})


@dataclass(frozen=True, kw_only=True)
class HTTPLimits:
    """What one HTTP client may hold of the teacher: time for a body to arrive, idle time, connections,
    log-probs per position on vLLM's /v1/completions."""

    http_request_timeout_s: float = setting(
        30.0, "seconds an HTTP request body may take to arrive; beyond it: 408 and the connection is closed "
        "(default: %(default)s)", group="network", flag="--http-request-timeout", type=float,
        check=positive_finite("a positive number of seconds"))
    http_idle_timeout_s: float = setting(
        75.0, "seconds an HTTP connection may wait for its next request (or its first request's headers) "
        "before it is closed (default: %(default)s)", group="network", flag="--http-idle-timeout", type=float,
        check=positive_finite("a positive number of seconds"))
    http_max_connections: int = setting(
        256, "HTTP connections held at once; a connection beyond them is answered 503 and closed, those held "
        "are served on (default: %(default)s)", group="network", type=int, check=at_least(1))
    max_logprobs: int = setting(
        20, "most prompt_logprobs per position on /v1/completions (vLLM's flag and default; a body's -1 asks "
        "for the whole vocabulary, answered when this allows it); -1: the whole vocabulary (default: "
        "%(default)s)", group="network", type=int, metavar="K",
        check=lambda v: None if v == -1 or v >= 1 else f"must be >= 1 or -1 (the whole vocabulary), got {v}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig(OutputSettings, HTTPLimits):
    """Everything a TeacherServer needs; the CLI flags map onto it one to one (keyword-only)."""

    model: str
    name: str = setting("teacher", "model name clients ask for (default: %(default)s)", group="model")
    version: str = setting("1", "model version (default: %(default)s)", group="model")
    device: str | None = setting(
        None, "cpu or cuda:N (default: cuda when available, else cpu)", group="model", check=check_device)
    compute_dtype: str = setting(
        "FP32", "autocast dtype for the forward pass; an hf:DIR teacher loads its weights in it "
        "(default: %(default)s)", group="model", type=str.upper, choices=DTYPES)
    # serve() and the CLI default to 0 (one per usable core on CPU, 2 on GPU); a config built directly, to 1.
    instances: int = setting(
        0, "model instances, each on its own thread (default: one per usable core on CPU, 2 on GPU)", group="model",
        type=int, check=at_least(0, "(0: one per usable core on CPU, 2 on GPU)"), field_default=1)
    output_chunk_mb: int = setting(
        CHUNK_BYTES >> 20, "output transforms of sequence models (top-k, log-probs, scores, an hf: LM's output "
        "projection) run this many MiB of fp32 logits at a time: larger chunks launch fewer, larger kernels, "
        "smaller ones hold less memory (default: %(default)s)", group="model", type=int, check=at_least(1))
    model_args: Mapping[str, Any] = setting(
        {}, "keyword argument for a module:factory (repeat); VALUE is parsed as JSON when it parses "
        "(3, 0.5, true, [1,2], \"text\"), else taken as a string", group="model", flag="--model-arg",
        kind="repeat", metavar="KEY=VALUE", from_flag=parse_model_args)
    io: ModelIO | None = None  # from the model's declaration settings (teacher_server.options)
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # likewise
    host: str = setting("127.0.0.1", "address to bind (default: %(default)s)", group="network")
    port: int = setting(
        0, "gRPC port, 0 for a free one (default: %(default)s)", group="network", type=int,
        check=in_port_range(), serve_default=8001)  # serve()/CLI: Triton's gRPC port
    metrics_port: int | None = setting(
        None, "Prometheus /metrics port (default: off)", group="network", type=int,
        check=in_port_range("(0: a free port)"))
    http_port: int | None = setting(
        None, "KServe v2 HTTP/REST port beside gRPC, 0 for a free one (default: off)", group="network",
        type=int, check=in_port_range())
    max_message_mb: int = setting(
        256, "largest request or response (default: 256)", group="network", type=int, check=at_least(1))
    drain_grace_s: float = setting(
        30.0, "seconds in-flight requests get to finish on SIGTERM (default: %(default)s)", group="network",
        flag="--drain-grace", type=float, check=at_least(0, "seconds"))
    tls_cert: str | None = setting(
        None, "PEM certificate chain: serve gRPC over TLS (with --tls-key)", group="network", check=existing_file)
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", group="network", check=existing_file)
    tls_client_ca: str | None = setting(
        None, "PEM CA bundle: require client certificates it signed (mutual TLS)", group="network",
        check=existing_file)
    advertise: str = setting("", "host:port students dial (default: --host:--port)", group="registry")
    instance_id: str = setting("", "registry identity (default: name + random suffix)", group="registry")

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SpecError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SpecError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
        check_fields(self)
        if self.instances < 1:
            raise SpecError(f"--instances must be >= 1, got {self.instances}")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials from the PEM files; None for plaintext. Client certificates are required
        exactly when a client CA is given."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        client_ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())],
            root_certificates=client_ca, require_client_auth=client_ca is not None,
        )
