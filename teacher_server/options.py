"""Every option of ``teacher-server`` and ``serve()``, from their declarations, and the rules between them.

The settings live with what they configure: `ServerConfig`'s fields (`teacher_server.config`),
the model's declaration (`ModelDeclaration`: inputs, outputs, mask, config file), batching
(`BatchingConfig`'s fields, whose defaults and checks are its own), registration and the process
(`LaunchSettings`), and the few that only the command line has (`--model`, `--model-path`,
`--log-level`). `SETTINGS` is all of them: the CLI's flags, ``server_config()``'s and ``serve()``'s
keywords and their checks are derived from it, so none is spelled out twice.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teacher_server.batcher import BatchingConfig
from teacher_server.config import ServerConfig
from teacher_server.model_config import ModelFileConfig, load_model_config
from teacher_server.settings import (
    FLAGS,
    UNSET,
    Setting,
    Words,
    at_least,
    by_name,
    check_fields,
    check_values,
    existing_file,
    positive_finite,
    setting,
    settings_of,
)
from teacher_server.spec import ModelIO, SpecError, TensorSpec

__all__ = ["SETTINGS", "LaunchSettings", "ModelDeclaration", "batching_config", "check_options"]

TensorDecl = str | TensorSpec
GROUPS = ("model", "batching", "outputs", "network", "registry", "")


def _specs(decls: Sequence[TensorDecl], what: str) -> tuple[TensorSpec, ...]:
    if isinstance(decls, (str, TensorSpec)):
        raise SpecError(f"{what}= takes a list of declarations, e.g. {what}=['INPUT:FP32:3,32,32']")
    return tuple(d if isinstance(d, TensorSpec) else TensorSpec.parse(d) for d in decls)


@dataclass(frozen=True)
class ModelDeclaration:
    """The model's tensors as the caller declares them (else the model's own ``io_spec``, else the warm-up)."""

    inputs: Sequence[TensorDecl] = setting(
        [], "declare an input, e.g. INPUT:FP32:3,32,32 (repeat, in forward() order); TOKENS:INT64:-1:pad=0 lets "
        "requests of different lengths share a batch, padded with 0; :mask marks the attention mask (padded "
        "with 0, all ones when a client sends none)", group="model", flag="--input", kind="repeat",
        metavar="NAME:DTYPE:SHAPE[:pad=V|:mask]")
    outputs: Sequence[TensorDecl] = setting(
        [], "declare an output, e.g. LOGITS:FP32:100 (repeat, in return order); inferred if omitted; "
        "LOGITS:FP32:-1,100:per_position is cut back to each request's own sequence length", group="model",
        flag="--output", kind="repeat", metavar="NAME:DTYPE:SHAPE[:per_position]")
    attention_mask: str | None = setting(
        None, "the --input that is the attention mask (same as giving it :mask)", group="model", metavar="NAME")
    model_config: str | Path | None = setting(  # noqa: RUF009 - a dataclass field: setting() returns field()
        None, "inputs, outputs and max_batch_size from a file: Triton's config.pbtxt, Triton-style JSON "
        "(input/output, data_type, dims) or ours (inputs/outputs, datatype, shape)", group="model",
        check=existing_file)

    def resolve(self, words: Words = FLAGS) -> tuple[ModelIO | None, ModelFileConfig | None]:
        """The declared ModelIO (None: the model declares its own) and the config file, when given."""
        check_rules(dataclasses.asdict(self), words)
        file_cfg = load_model_config(self.model_config) if self.model_config is not None else None
        if self.inputs:
            inputs, outputs = _specs(self.inputs, "inputs"), _specs(self.outputs, "outputs")
            return ModelIO(inputs, outputs, self.attention_mask), file_cfg
        io = file_cfg.io if file_cfg is not None else None
        if self.attention_mask is not None:
            if io is None:
                s = ALL
                raise SpecError(f"{words(s['attention_mask'])} needs the inputs declared ({words(s['inputs'])} "
                                f"or {words(s['model_config'])}); {self.model_config} declares none")
            io = ModelIO(io.inputs, io.outputs, self.attention_mask)
        return io, file_cfg


@dataclass(frozen=True)
class LaunchSettings:
    """What ``serve()`` and ``teacher-server`` add to a running server: registration, the ready file, threads,
    the allocator's thresholds."""

    registry: str | None = setting(
        None, "etcd://host:2379[,host:2379]: register under a lease", group="registry", scope="serve")
    service: str | None = setting(
        None, "service name to register under (with --registry)", group="registry", scope="serve")
    ttl: float = setting(
        10.0, "registration lease TTL in seconds (default: 10)", group="registry", type=float, scope="serve",
        check=positive_finite("a positive number of seconds (the registration lease; default 10)"))
    ready_file: str | Path | None = setting(  # noqa: RUF009 - a dataclass field: setting() returns field()
        None, "write {endpoint, metrics_port, pid} as JSON here once serving", group="network", scope="serve")
    threads: int | None = setting(
        0, "torch intra-op threads per process (default: cores / instances)", group="model", type=int,
        scope="serve", check=at_least(0, "(0: cores / instances)"))
    malloc_tuning: bool = setting(
        True, "keep glibc malloc's defaults: memory freed after each batch goes back to the kernel and is "
        "page-faulted in again by the next (default: fixed thresholds keep a batch's working memory mapped; "
        "never over MALLOC_* variables, GLIBC_TUNABLES or an LD_PRELOAD allocator)", group="model",
        flag="--no-malloc-tuning", kind="negated", scope="serve")

    def __post_init__(self) -> None:
        check_fields(self)
        check_rules(dataclasses.asdict(self), FLAGS)


_BATCHING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BatchingConfig)}
# serve()'s keyword -> BatchingConfig's field, where the two differ.
_BATCHING_FIELD = {"dynamic_batching": "enabled"}
BATCHING = (
    Setting("max_batch_size", "largest batch a model instance runs (default 256)", "batching", type=int),
    Setting("max_queue_delay_us", "longest wait for more requests to fill a batch (default: %(default)s)",
            "batching", _BATCHING_DEFAULTS["max_queue_delay_us"], type=int),
    Setting("max_queue_size", "requests allowed to wait (rows, once a padded request is split); beyond it: "
            "RESOURCE_EXHAUSTED (default: 512, or 2,048 rows for a model that batches padded rows by length)",
            "batching", _BATCHING_DEFAULTS["max_queue_size"], type=int),
    Setting("dynamic_batching", "run every request as its own batch", "batching", _BATCHING_DEFAULTS["enabled"],
            flag="--no-dynamic-batching", kind="negated"),
    Setting("max_batch_tokens", "models with padded inputs: the batch bound, samples x padded length (default 0: "
            "max-batch-size x 64, for an hf: teacher on a GPU capped to what its instances' batches hold in the "
            "free device memory; a larger single request still runs alone)", "batching",
            _BATCHING_DEFAULTS["max_batch_tokens"], type=int, check=at_least(0, "(0: max-batch-size x 64)")),
    Setting("length_buckets", "models with padded inputs: pad requests of any length together (default: by "
            "length bucket)", "batching", _BATCHING_DEFAULTS["length_buckets"], flag="--no-length-buckets",
            kind="negated"),
    Setting("min_padding_efficiency", "models with padded inputs, by length bucket: the least useful / computed "
            "positions a batch may have; a request that would pad more waits for a later batch (default: "
            "%(default)s)", "batching", _BATCHING_DEFAULTS["min_padding_efficiency"], type=float),
    Setting("cost_aware_floor", "models with padded inputs: keep --min-padding-efficiency as set (default: on "
            "a GPU, lower it by the share of a full batch's device time that a batch's fixed cost takes, "
            "measured from the batches run, so a device that pays much per forward pass runs fewer, fuller "
            "batches; on CPU, as set)",
            "batching", _BATCHING_DEFAULTS["cost_aware_floor"], flag="--no-cost-aware-floor", kind="negated"),
    Setting("async_outputs", "finish each batch (wait for its device-to-host copies, cut and encode each "
            "request's outputs) on the instance's thread before it takes the next batch (default: on a GPU, "
            "on a finishing thread of its own, overlapping the next batch's compute; on CPU, on the "
            "instance's thread)", "batching",
            _BATCHING_DEFAULTS["async_outputs"], flag="--no-async-outputs", kind="negated"),
    Setting("batches_ahead", "batches an instance may hold formed and not yet answered: staged, computing, "
            "being finished (default 0: 3 on a GPU, 1 on CPU, 2 there with asynchronous outputs); fewer are "
            "formed later, from more queued requests, and fuller", "batching",
            _BATCHING_DEFAULTS["batches_ahead"], type=int, check=at_least(0, "(0: what the device wants)")),
)

COMMAND_LINE = (
    Setting("model", "package.module:factory (returns an nn.Module), a TorchScript file, a torch.export .pt2 "
            "file, or hf:DIR (a transformers causal LM or sequence classifier saved with save_pretrained; read "
            "locally, never from a hub)", "model", required=True, scope="cli"),
    Setting("model_path", "directory to import --model's module from, put first on sys.path (repeat for "
            "several; default: the working directory, as with python -m)", "model", kind="repeat", metavar="DIR",
            scope="cli"),
    Setting("log_level", "(default: %(default)s)", "", "INFO", type=str.upper,
            choices=("DEBUG", "INFO", "WARNING", "ERROR"), scope="cli"),
)

_SERVER_FIELDS = settings_of(ServerConfig)
SETTINGS: tuple[Setting, ...] = tuple(sorted(
    (*COMMAND_LINE[:1], *_SERVER_FIELDS, *settings_of(ModelDeclaration), *BATCHING, *COMMAND_LINE[1:],
     *settings_of(LaunchSettings)), key=lambda s: GROUPS.index(s.group)))
ALL = by_name(SETTINGS)
CONFIG = {s.name: s for s in SETTINGS if s.scope == "config"}  # server_config()'s keywords
LAUNCH = {s.name: s for s in SETTINGS if s.scope == "serve"}  # serve() adds these


def check_rules(values: Mapping[str, Any], words: Words) -> None:
    """The rules between settings, in the caller's words (only those whose settings were given)."""
    s = ALL
    if values.get("attention_mask") and not values.get("inputs") and not values.get("model_config"):
        raise SpecError(f"{words(s['attention_mask'])} needs the inputs declared "
                        f"({words(s['inputs'])} or {words(s['model_config'])})")
    if values.get("outputs") and not values.get("inputs"):
        raise SpecError(f"{words(s['outputs'])} needs {words(s['inputs'])} too "
                        "(declare the inputs the outputs come from)")
    if values.get("service") and not values.get("registry"):
        raise SpecError(f"{words(s['service'])} needs {words(s['registry'], 'etcd://host:2379')}")
    if values.get("registry") and not values.get("service"):
        raise SpecError(f"{words(s['registry'])} needs {words(s['service'], 'NAME')} "
                        "(the name students ask the registry for)")


def check_options(values: Mapping[str, Any], words: Words) -> None:
    """Every given value against its declaration, then the rules between them, then batching's own checks."""
    check_values(values, ALL, words)
    check_rules(values, words)
    batching_config(values, None, words)


def refuse_unknown(options: Mapping[str, Any], known: Mapping[str, Setting], extra: Sequence[str] = ()) -> None:
    """SpecError for keywords no setting declares, with the closest one when there is one."""
    unknown = sorted(set(options) - set(known) - set(extra))
    if not unknown:
        return
    names = sorted({*known, *extra})
    hints = [f"{u}: did you mean {close[0]}?" for u in unknown if (close := difflib.get_close_matches(u, names, 1))]
    raise SpecError(f"unknown option(s) {', '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
                    + f"; the options are {', '.join(names)}")


def batching_config(values: Mapping[str, Any], file_max_batch_size: int | None, words: Words) -> BatchingConfig:
    """The BatchingConfig the batching settings give. Its checks are its own (BatchingConfig's), its
    refusals led by the flag on the command line: ``--max-batch-size: max_batch_size must be >= 1``."""
    kwargs = {_BATCHING_FIELD.get(s.name, s.name): values.get(s.name, s.default) for s in BATCHING}
    if kwargs["max_batch_size"] is None:
        kwargs["max_batch_size"] = file_max_batch_size or _BATCHING_DEFAULTS["max_batch_size"]
    try:
        return BatchingConfig(**kwargs)
    except ValueError as e:  # "max_queue_size must be >= 1, got 0": BatchingConfig names its field first
        field = str(e).partition(" ")[0]
        keyword = {v: k for k, v in _BATCHING_FIELD.items()}.get(field, field)
        if keyword not in ALL or not words.as_flag:
            raise SpecError(str(e)) from None
        raise SpecError(f"{words(ALL[keyword])}: {e}") from None


def launch_defaults() -> dict[str, Any]:
    """serve()'s and the command line's defaults where they differ from server_config()'s (the port)."""
    return {s.name: s.launch_default for s in CONFIG.values() if s.serve_default is not UNSET}


def server_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """ServerConfig's own fields among `values` (defaults for those not given)."""
    return {s.name: values.get(s.name, s.default) for s in _SERVER_FIELDS}


def declaration(values: Mapping[str, Any]) -> ModelDeclaration:
    return ModelDeclaration(**{f.name: values[f.name] for f in dataclasses.fields(ModelDeclaration)
                               if f.name in values})
