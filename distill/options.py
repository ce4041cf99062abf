"""Everything a reader is told, each option declared once (``distill.declare``): `ReaderOptions`.

A field's declaration holds its default, its rule, its help text, its ``--distill_*`` flag, and for
an output transform its request parameter and how a teacher-output store names it. The keyword
checks (``ReaderOptions(...)``), the flags (``distill.flags.add_distill_args``) and reading them
back (`options_from_args`), the request parameters and the store's namespace all come from it.
The rules that involve several options are here for keywords and in ``distill.flag_rules`` for
flags (whose messages name the flags). Adding a reader option is one declaration in this module.

This module sits at the bottom of ``distill`` with the message types (``distill.types``): the
engine, the router, the teacher pool and the store all read `ReaderOptions`, and import it downward.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from discovery.options import etcd_options
from distill.checks import (
    CACHE_MODES,
    FALLBACKS,
    NONFINITE,
    TRANSPORTS,
    cache_mode_choice,
    checked,
    fallback_choice,
    hedge_from_ms,
    maybe_bool,
    model_name,
    non_negative_float,
    non_negative_int,
    nonfinite_choice,
    normalize_inputs,
    output_dtype_choice,
    output_names,
    parameter_arg,
    parameters_from_flags,
    positive_float,
    positive_int,
    registry_address,
    request_parameters,
    service_name,
    teacher_list,
    torch_device,
    transport_choice,
)
from distill.config import ClientTLS, RouterConfig
from distill.declare import Flag, declared, document, option
from distill.fingerprints import FINGERPRINT_CHANGES, fingerprint_change_choice, fingerprint_value
from distill.flag_rules import read_back
from distill.headers import HeaderArg, headers_from_flags, headers_map
from distill.routing import PolicySpec, policy_spec
from distill.routing_keys import check_route_options
from distill.types import ParameterValue
from protos.text import TEXT

if TYPE_CHECKING:  # imported where used: the flags (distill --help) need no torch
    import torch

__all__ = ["CACHE_MODES", "ClientTLS", "ReaderOptions", "RouterConfig", "default_student_id", "options_from_args"]


def default_student_id() -> str:
    """host-pid, plus the torchrun rank when there is one: unique per training process."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    base = f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-rank{rank}" if rank is not None else base


# ---- how single options are read, checked and stored ------------------------------------------------
_STORE_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}


def _stated(off: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    """With a store, a transform left to the teacher's default is stated as `off`."""
    return lambda value, _: off if value is None else value


def _tail_stated(value: Any, values: Mapping[str, Any]) -> Any:
    return bool(value) if values["top_k"] else value


@dataclass(frozen=True)
class ReaderOptions:
    """Everything a reader is told, validated once here; the engine takes it as is.

    Built by ``DistillReader(loader, **kwargs)`` (the keywords are these fields) and by
    ``ReaderOptions.from_args(args, ...)`` / ``DistillReader.from_args`` from ``add_distill_args``
    flags. Fields given as user-friendly forms are normalised in place (``inputs`` to a mapping,
    ``outputs`` to a tuple, ``device`` to a ``torch.device``, ``output_dtype`` to upper case, a
    missing ``student_id`` to host-pid[-rankN]). Each field's declaration below is its documentation,
    default and rule (``distill.declare``).
    """

    inputs: Any = option(  # noqa: RUF009 (option() is dataclasses.field)
        help="teacher input names taken from batch fields of the same name, or a mapping {teacher input: batch "
        "key or tuple position}", check=normalize_inputs)
    outputs: Sequence[str] | None = option(None, help="teacher outputs to fetch (default: all the teacher has)",
                                           check=output_names)
    teachers: str | Mapping[str, str] | None = option(
        None, help="fixed teachers, 'host:port,host:port'; or {service: 'host:port,...'} for several",
        flag=Flag(metavar="HOST:PORT[,HOST:PORT]", parse=teacher_list, required=True,
                  help="a fixed list of teacher servers"))
    registry: str | None = option(
        None, help="'etcd://host:2379[,host:2379]': find teachers under `service` as they come and go",
        flag=Flag(metavar="etcd://HOST:PORT[,HOST:PORT]", parse=registry_address, required=True,
                  help="etcd endpoints where teachers register; needs --distill_service"))
    service: str | Sequence[str] | None = option(
        None, help="the service name(s) teachers register under; several give a mixture of teachers, and the "
        "outputs come per service: {service: {name: tensor}}",
        flag=Flag(metavar="NAME", parse=service_name, required=True,
                  help="the teacher service to use from the registry (the name teachers register under)"))
    model: str | None = option(
        None, help="the model to use on the teachers (default: what each teacher registered, else the one model its "
        "repository lists); needed with a Triton that restricts its model-repository API (PyTriton does by default)",
        flag=Flag(metavar="NAME", parse=model_name))
    model_version: str = option("", help="the model version to ask the teachers for (default: the teacher's)")
    fingerprint: str | None = option(
        None, help="use only teachers of this fingerprint (a digest of their weights, config, tokenizer and compute "
        "dtype; distill check-teachers and distill top show it); default: the first teacher admitted fixes it for "
        "the run; 'any': use every teacher whatever its fingerprint (replicas that differ on purpose)",
        check=fingerprint_value, flag=Flag(metavar="FP"))
    on_fingerprint_change: str = option(
        "fail", help="when no teacher of the pinned fingerprint is left while teachers of another are live (a "
        "finished rolling upgrade): raise FingerprintChangedError ('fail'), or go on with the new one ('switch')",
        check=fingerprint_change_choice, flag=Flag(choices=FINGERPRINT_CHANGES))
    timeout: float = option(
        10.0, help="deadline for one chunk at one teacher, in seconds; a chunk that misses it is re-sent to another "
        "teacher", check=positive_float, flag=Flag(metavar="SECONDS", required=True))
    no_teacher_timeout: float = option(
        60.0, help="seconds without any usable teacher before NoTeacherError (or the fallback)", check=positive_float,
        flag=Flag(metavar="SECONDS", required=True,
                  help="how long to wait with no teacher at all before --distill_fallback applies"))
    fallback: str = option(
        "error", help="with no teacher for no_teacher_timeout: raise ('error'), or yield batches with None outputs "
        "('hard_labels'), also for a batch the teachers refuse (instead of raising BatchRejectedError for it)",
        check=fallback_choice,
        flag=Flag(choices=FALLBACKS, required=True, help="with no teacher for --distill_no_teacher_timeout: raise "
                  "(error) or yield batches with no teacher outputs (hard_labels)"))
    nonfinite: str = option(
        "error", help="a batch a teacher answered with inf or NaN in some rows (an overflowing model): raise "
        "NonFiniteOutputError naming the batch and rows ('error'), or deliver it with teacher['VALID_ROWS'] False at "
        "those rows ('mask', for KDLoss/TokenKDLoss valid=); such rows are never stored in the teacher-output store",
        check=nonfinite_choice, flag=Flag(choices=NONFINITE))
    max_teachers: int = option(
        0, help="use at most N teachers, chosen by deterministic subsetting so that many students spread over the "
        "pool; 0 = all", check=non_negative_int, flag=Flag(metavar="N", required=True))
    prefetch: int | None = option(
        None, help="loader batches in flight to teachers ahead of the training loop; with no loader, the most "
        "submitted batches unsettled at once (distill.submit). Default: 4, or as many as hold the router's "
        "by_length_rows rows (512) for every teacher that batches padded rows by length (it needs many rows queued), "
        "within read_ahead_mb",
        check=positive_int, flag=Flag(metavar="N", required=True))
    read_ahead_mb: float = option(
        1024.0, help="with prefetch unset, the most MiB the batches read ahead for teachers that batch by length may "
        "hold, teacher inputs and outputs counted at the largest batch answered so far (the loader's other fields "
        "are not seen); beyond it the reader reads ahead fewer batches than their rows want, never fewer than 4 (with "
        "ordered delivery, answered batches waiting for an earlier one may hold as much again)",
        check=positive_float, flag=Flag(metavar="MIB", required=True))
    teacher_batch_size: int = option(
        0, help="split batches into chunks of at most N samples per request; 0 = the teacher's max batch size",
        check=non_negative_int, flag=Flag(metavar="N", required=True))
    hedge_after: float | str | None = option(
        "auto", help="seconds after which a late chunk is raced on a second teacher, taking whichever answers "
        "first; 'auto': 4x the pool's median latency, at least 0.25 s; None: never hedge",
        flag=Flag(name="--distill_hedge_ms", metavar="MS", parse=non_negative_float, default=None, required=True,
                  to_option=hedge_from_ms,
                  help="send a second copy of a chunk to another teacher after MS milliseconds without a reply, and "
                  "take whichever answers first; 0 = off (default: adaptive, 4x the teachers' median latency and at "
                  "least 250 ms)"))
    ordered: bool = option(
        True, help="deliver in loader order (True), or each batch as soon as it is ready. In order, an answered batch "
        "waiting for an earlier one lends its read-ahead slot to the next batch, so a slow batch does not hold back "
        "the calls behind it; at most prefetch batches lend theirs. While the training loop takes batches 10 ms apart "
        "or more, batches delivered and not yet taken lend theirs too, at most a quarter of prefetch (at least 1), so "
        "the next call starts when an answer is delivered: the reader holds at most 2 x prefetch batches and that "
        "quarter")
    bundle: bool = option(
        True, help="send batches that reach the reader together with the same input shapes as one request, within "
        "the teacher's max batch size (distill.bundles): a small batch then costs the student a fraction of a call; "
        "False: one request per batch")
    device: str | torch.device | None = option(  # noqa: RUF009 (option() is dataclasses.field)
        None, help="put teacher outputs on this device (through pinned memory on CUDA)", check=torch_device)
    top_k: int = option(
        0, help="fetch each output's top K values and indices instead of the full tensor (<OUT>_TOPK_VALUES, "
        "<OUT>_TOPK_INDICES; the teachers must support it); 0 = full outputs", check=non_negative_int,
        wire="top_k", store=lambda k: {"top_k": k or None}, flag=Flag(metavar="K"))
    output_dtype: str | None = option(
        None, help="ask the teachers for outputs in this float type; FP16 and BF16 halve the bytes on the wire "
        "(default: the model's own)", check=output_dtype_choice, wire="output_dtype",
        store=lambda d: {"dtype": _STORE_DTYPES.get(d or "", "native")}, flag=Flag(metavar="{FP32,FP16,BF16}"))
    logprobs: bool | None = option(
        None, help="ask the teachers for log_softmax(x / T) of floating outputs (computed over the full last "
        "dimension on the teacher, before top-k), or False for raw values (default: the server's); every setting "
        "that changes the numbers is stated per request, so a server's defaults never leak into a student that "
        "set it", check=maybe_bool, wire="logprobs", store=lambda v: {"values": "logprobs" if v else "logits"},
        stated=_stated(False), flag=Flag(switch=True))
    temperature: float | None = option(
        None, help="ask the teachers to divide floating outputs by T before log-softmax and top-k, on the full last "
        "dimension, the only place a temperature is exact under top-k (default: the server's)", check=positive_float,
        wire="temperature", store=lambda t: {"temperature": None if t == 1.0 else t}, stated=_stated(1.0),
        flag=Flag(metavar="T"))
    topk_tail: bool | None = option(
        None, help="with top_k, also fetch <OUT>_TOPK_TAIL, the probability mass outside the top K per position, or "
        "False: never (default: the server's, and the reader keeps it only when asked)", check=maybe_bool,
        wire="topk_tail", stated=_tail_stated, flag=Flag(switch=True))
    token_logprobs: bool | None = option(
        None, help="ask the teachers for <OUT>_TOKEN_LOGPROBS [B, T], the log-probability (after temperature) of "
        "each position's next token, log p(x[t+1] | x[<=t]), 0 at the last position and on padding: the sampled "
        "tokens' scores of on-policy distillation, 4 bytes a token; replaces the full <OUT> (top_k and SCORE_IDS "
        "may be asked with it); False: never (default: the server's)", check=maybe_bool, wire="token_logprobs",
        store=lambda v: {"extra": (("token_logprobs", "true"),)} if v else {}, stated=_stated(False),
        flag=Flag(switch=True))
    token_ranks: bool | None = option(
        None, help="ask the teachers for <OUT>_TOKEN_RANKS [B, T] INT32, the rank of each position's next token among "
        "the classes (1 + how many score higher; vLLM's prompt-token rank), 0 at the last position and on padding",
        check=maybe_bool, wire="token_ranks", store=lambda v: {"extra": (("token_ranks", "true"),)} if v else {},
        stated=_stated(False), flag=Flag(switch=True))
    student_id: str = option("", help="identity in the registry (default: host-pid[-rankN])",
                             check=lambda s: s or default_student_id())
    registry_options: Mapping[str, Any] = option(
        default_factory=dict, help="passed to the etcd client (TLS files, user, password)",
        check=lambda o: dict(o or {}), combine=etcd_options, needs="registry", flag=(
            Flag(name="--distill_registry_ca_cert", metavar="FILE", help="CA certificate for etcd over TLS"),
            Flag(name="--distill_registry_cert", metavar="FILE", help="client certificate for etcd (with the key)"),
            Flag(name="--distill_registry_key", metavar="FILE", help="client key for etcd (with the certificate)"),
            Flag(name="--distill_registry_user", metavar="USER",
                 help="etcd user; the password comes from $DISTILL_REGISTRY_PASSWORD")))
    tls_ca: str | None = option(None, help="CA certificate that signed the teachers' TLS certificates",
                                flag=Flag(metavar="FILE"))
    tls_cert: str | None = option(None, help="this student's certificate (teachers with mutual TLS)",
                                  flag=Flag(metavar="FILE"))
    tls_key: str | None = option(None, help="the key of tls_cert", flag=Flag(metavar="FILE",
                                                                              help="the key of --distill_tls_cert"))
    tls_server_name: str | None = option(
        None, help="the name to verify in the teachers' certificates, when it differs from the endpoint's host")
    router: RouterConfig = option(  # noqa: RUF009 (option() is dataclasses.field)
        default_factory=RouterConfig, help="the router's tuning (limits, backoff, probe deadline)",
        check=lambda r: r or RouterConfig())
    headers: Mapping[str, str] = option(
        default_factory=dict, repr=False, check=headers_map,  # values are credentials: never in a repr
        help="gRPC headers sent on every call to every teacher, e.g. the access token of a Triton that restricts "
        "its API: {'triton-grpc-protocol-<key>': token}; names are lower-cased, values never logged or shown",
        flag=Flag(name="--distill_header", metavar="KEY[=VALUE]", parse=HeaderArg.parse, repeat=True, default=None,
                  to_option=headers_from_flags,
                  help="send this gRPC header on every call to every teacher (repeatable), e.g. the access token of a "
                  "Triton that restricts its API: triton-grpc-protocol-<key>=<token>. Without =VALUE the value comes "
                  "from $DISTILL_HEADER_<KEY> (upper case, other characters as _), which keeps it off the command "
                  "line"))
    transport: str = option(
        "call", help="how chunks go to a KServe teacher: 'call', one ModelInfer call a chunk, its deadline kept by "
        "gRPC and its work dropped by the teacher once the call is given up; or 'stream', every chunk on one "
        "ModelStreamInfer stream a teacher, where gRPC's own cost a small chunk is about a third of a call's "
        "(docs/guides/reader.md), its deadline kept here (a chunk given up is still computed)",
        check=transport_choice, flag=Flag(choices=TRANSPORTS))
    cache: str | os.PathLike[str] | None = option(  # noqa: RUF009 (option() is dataclasses.field)
        None, help="a teacher-output store's directory (distill.cache, docs/cache.md): samples it holds are not "
        "asked of a teacher, and teacher answers are written to it off the training thread", check=os.fspath,
        flag=Flag(metavar="PATH", help="a teacher-output store (distill.cache): stored samples are not asked of a "
                  "teacher, and teacher answers are stored (the program names the batch's key field)"))
    cache_mode: str = option(
        "read_write", help="read_write: read the store, ask teachers for the missing samples only and store their "
        "answers; read: only read it, never waiting for a teacher (with no teachers at all it trains offline, and a "
        "missing sample raises CacheMissError naming its key, or with fallback='hard_labels' yields None outputs); "
        "write: ask teachers for every sample and store their answers", check=cache_mode_choice,
        flag=Flag(choices=CACHE_MODES))
    key: str | int | None = option(
        None, help="the batch field (a dict key, or a tuple position) holding each sample's key in the store: a "
        "dataset index or a content hash; required with cache")
    route_by: str | int | None = option(
        None, help="with several services: the batch field (or tuple position) naming each row's teacher, a service "
        "name or a route_map key; each row goes to its own teacher and the outputs come back as one dict in row order "
        "(distill.routing_keys)", flag=Flag(metavar="FIELD"))
    route_map: Mapping[Any, str] = option(default_factory=dict, check=lambda m: dict(m or {}),
                                          help="route keys (int labels, aliases) -> service, for route_by")
    default_teacher: str | None = option(
        None, help="with route_by: the service for rows whose key is missing or unknown (default: such a batch is "
        "refused with RouteKeyError)", flag=Flag(metavar="SERVICE"))
    routing: PolicySpec = option(  # noqa: RUF009 (option() is dataclasses.field)
        "power_of_two", check=policy_spec,
        help="how the router picks among the teachers that may take a chunk (distill.routing): 'power_of_two' "
        "(expected completion time of two at random), 'round_robin', or a callable returning a policy (an object "
        "with choose(candidates, request)); health and in-flight limits apply whatever the policy")
    parameters: Mapping[str, ParameterValue] = option(
        default_factory=dict, check=request_parameters,
        store=lambda p: {"extra": tuple((k, json.dumps(v)) for k, v in sorted(p.items()))} if p else {},
        help="more request parameters sent with every request, for transforms a teacher registered beyond the "
        "built-in ones (teacher_server.transforms.register; declare their outputs on this side with "
        "distill.outputs.register), e.g. {'entropy': True}; a store names them in its namespace",
        flag=Flag(name="--distill_parameter", metavar="KEY=VALUE", parse=parameter_arg, repeat=True, default=None,
                  to_option=parameters_from_flags,
                  help="send this request parameter with every request (repeatable; VALUE as JSON, else a string), "
                  "for a transform the teacher registered beyond the built-in ones"))
    flag_names: Mapping[str, str] = option(
        default_factory=dict, check=lambda m: dict(m or {}),
        help="the flag of the program running this reader for each option it sets, {option: flag}, used where a "
        "message says which setting fixes it (distill gateway: {'model': '--model'}); an option not named is said as "
        "its keyword and its --distill_* flag")
    # Derived in __post_init__:
    services: tuple[str, ...] = field(init=False)
    static: Mapping[str, str] | None = field(init=False)  # service -> "host:port,..." for fixed lists
    client_tls: ClientTLS | None = field(init=False)
    request_parameters: Mapping[str, ParameterValue] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        teachers, service = self.teachers, self.service
        offline = teachers is None and self.registry is None and self.cache is not None and self.cache_mode == "read"
        if (teachers is None) == (self.registry is None) and not offline:
            raise ValueError("pass exactly one of teachers='host:port,...' and registry='etcd://host:2379' (or, to "
                             "train from a teacher-output store alone, cache=PATH with cache_mode='read')")
        static: dict[str, str] | None
        if offline:
            static = {}
        elif isinstance(teachers, str):
            static = {service if isinstance(service, str) else "teachers": teachers}
        else:
            static = dict(teachers) if teachers is not None else None
        services: tuple[str, ...]
        if offline:
            services = ()
        elif static is not None:
            services = tuple(static)
        elif isinstance(service, str):
            services = (service,)
        elif service:
            services = tuple(service)
        else:
            raise ValueError("registry= needs service='NAME' (the name teachers registered under)")
        # Each option's own rule, with the same messages as its flag's (distill.checks).
        values: dict[str, Any] = {}
        for d in declared(ReaderOptions):
            value = getattr(self, d.name)
            if d.option.check is not None and (value is not None or d.default is not None):
                value = checked(d.option.check, d.name, value)
            values[d.name] = value
        self._check_together(values, services)
        if self.cache is not None:
            # A store's namespace must name the values it holds: state every value transform, so a
            # teacher's own defaults (teacher-server --logprobs/--temperature/--topk-tail) never
            # decide what lands in it unnamed.
            for d in declared(ReaderOptions):
                if d.option.stated is not None:
                    values[d.name] = d.option.stated(values[d.name], values)
        tls = (ClientTLS(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
               if any((self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)) else None)
        values.update(services=services, static=static or None, client_tls=tls, request_parameters={
            **{d.option.wire: values[d.name] for d in declared(ReaderOptions)
               if d.option.wire is not None and values[d.name] is not None}, **values["parameters"]})
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def setting(self, name: str, value: str) -> str:
        """How this reader's user sets option `name` to `value`, for messages that say what to fix:
        the program's own flag (`flag_names`), else the keyword and its --distill_* flag."""
        flag = self.flag_names.get(name)
        if flag is not None:
            return f"{flag} {value}"
        flags = [f.name for d in declared(ReaderOptions) if d.name == name for f in d.flags]
        return f"{name}={value!r}" + (f" ({flags[0]} {value})" if flags else "")

    def _check_together(self, values: Mapping[str, Any], services: tuple[str, ...]) -> None:
        """The rules between options given as keywords (`distill.flag_rules` has the flags' own)."""
        hedge, timeout = values["hedge_after"], values["timeout"]
        if isinstance(hedge, str):
            if hedge != "auto":
                raise ValueError(f"hedge_after must be seconds, 'auto' or None, got {hedge!r}")
        elif hedge is not None and not 0 < hedge < timeout:
            raise ValueError(f"hedge_after must be between 0 and timeout ({timeout:g} s), got {hedge}")
        wired = {d.option.wire: d.name for d in declared(ReaderOptions) if d.option.wire is not None}
        for name in values["parameters"]:
            if name in wired:
                raise ValueError(f"parameters: {name!r} has an option of its own: pass {wired[name]}= instead")
        if values["topk_tail"] and not values["top_k"]:
            raise ValueError("topk_tail=True is the probability mass outside the top-k: ask for top_k=K too")
        check_route_options(self.route_by, values["route_map"], self.default_teacher, services)
        if self.cache is None:
            return
        if TEXT in values["inputs"]:
            raise ValueError("cache= does not store answers to texts (input TEXT): their positions are each teacher's "
                             "own tokens, which a store's samples cannot line up; drop cache= for this reader")
        if self.key is None:
            raise ValueError("cache= needs key=: the batch field holding each sample's key (a dataset index or a "
                             "content hash), e.g. key='index'")
        if not isinstance(self.key, (str, int)):
            raise TypeError(f"key must be a batch field name or a tuple position, got {self.key!r}")
        if len(services) > 1 and self.route_by is None:
            raise ValueError(f"cache= serves one teacher service; this reader has {len(services)} ({services}): "
                             "give each service's reader its own cache, or drop cache=")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kwargs: Any) -> ReaderOptions:
        """From `add_distill_args` flags; keyword arguments (inputs, outputs, ...) are added or override."""
        return cls(**{**options_from_args(args), **kwargs})

    def store_fields(self) -> dict[str, Any]:
        """The fields of a teacher-output store's namespace that name this reader's output settings
        (dtype, top-k and every value transform; see ``distill.cache.Namespace``)."""
        out: dict[str, Any] = {}
        extra: list[tuple[str, str]] = []
        for d in declared(ReaderOptions):
            if d.option.wire is None and d.option.store is None:
                continue
            for name, value in d.option.namespace_fields(getattr(self, d.name)).items():
                if name == "extra":
                    extra.extend(value)
                else:
                    out[name] = value
        out["extra"] = tuple(extra)
        return out

    @property
    def offline(self) -> bool:
        """Whether this reader never asks a teacher: ``cache_mode="read"``, with or without teachers
        named (a store replayed with a teacher list left on the command line waits for none)."""
        return self.cache is not None and self.cache_mode == "read"

    @property
    def hedge_s(self) -> float | None:
        """The fixed hedge delay in seconds; None when adaptive or off."""
        return None if isinstance(self.hedge_after, str) else self.hedge_after

    @property
    def adaptive_hedge(self) -> bool:
        return self.hedge_after == "auto"

    @property
    def torch_device(self) -> torch.device | None:
        """`device` as a torch.device (None: outputs stay on the CPU)."""
        return torch_device(self.device) if self.device is not None else None

    @property
    def pin_memory(self) -> bool:
        """Outputs land in pinned memory when they go on to a CUDA device."""
        device = self.torch_device
        return device is not None and device.type == "cuda"


ReaderOptions.__doc__ = (ReaderOptions.__doc__ or "") + document(ReaderOptions)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``DistillReader`` from the flags ``add_distill_args`` added; the rules
    between flags and their messages are ``distill.flag_rules.read_back``'s."""
    return read_back(ReaderOptions, args)
