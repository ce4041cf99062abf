"""The teacher's output transforms, each declared once: the registry every other layer reads.

A `Transform` entry declares
* its request parameters (`Param`): wire name, Python type, KServe parameter field, server
  default, help text and check. Validation parses request-level and per-output parameters from
  them, near-misses of them (`topk`, `log_probs`) are refused by name, and the config/CLI layer
  derives its flags and defaults from them (`teacher_server.config.transform_setting`); see
  `teacher_server.near_miss` for the names refused as misspellings;
* the extra inputs it reads besides the model's (`AuxInput`, e.g. `SCORE_IDS`);
* the output names it adds, `<OUT>` + each suffix (e.g. `LOGITS_TOPK_VALUES`);
* whether it replaces the full tensor (`reduces`), and a check of a wanted output against the
  model's declaration;
* its device-side `apply` (in `teacher_server.transform_rows`), which `teacher_server.outputs`
  runs on chunks of positions, before the device-to-host copy.

The full output is sent only when no active transform `reduces` it: asking for `top_k`,
`token_logprobs` or sending `SCORE_IDS` replaces `<OUT>` by what those add. The scoring entries'
wire contract, for any KServe v2 client:
* `token_logprobs: true` (request or output parameter) adds `<OUT>_TOKEN_LOGPROBS` `[B, T]`: at
  position t, log p(x[t+1] | x[<=t]) after `temperature` (aligned with the logits at t, as
  Hugging Face labels after the shift), 0 at each sequence's last position and on padding;
* input `SCORE_IDS` (INT32 `[B, T, m]`, padded like the ids) adds `<OUT>_SCORED_LOGPROBS`
  `[B, T, m]`: the log-probabilities (after `temperature`) at those ids at each position, 0 on
  padding. Both apply to floating per-position outputs of a model with a padded token input (an
  `hf:` causal LM's LOGITS) and combine with `top_k`, `topk_tail`, `temperature` and `output_dtype`
  (fp32 unless `output_dtype` says otherwise).

Adding a transform is one entry in `REGISTRY` (in the order the transforms run) and its test on
the teacher, plus, for a parameter with a server default, one typed field of
`teacher_server.config.OutputSettings` (``top_k: int = transform_setting("top_k")``): the flag and
``serve()``'s keyword take the Param's default, help and check. `register(Transform(...))` adds a
transform from outside this module (its parameters are then per request: no flag).

`OutputTransform` is one output's wanted transforms (the value of every parameter), built by
validation from the server's `OutputDefaults` and the request's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from teacher_server import param_checks as checks
from teacher_server.param_checks import Check
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO, TensorSpec
from teacher_server.transform_rows import (
    Rows,
    apply_logprobs,
    apply_scored,
    apply_temperature,
    apply_token_logprobs,
    apply_token_ranks,
    apply_top_k,
    apply_topk_tail,
)


@dataclass(frozen=True)
class Param:
    """One request parameter of a transform, and its server-wide default.

    `check(value)` returns the value to use (normalised, e.g. 'fp16' -> 'FP16') or raises
    ValueError with the expectation in words ("must be a boolean"); validation prefixes where
    the parameter was found. `server_default`: whether the server takes a default for it (a flag).
    """

    name: str
    type: type
    default: object
    help: str
    check: Check
    wire: str  # the KServe parameter field a client sets: bool_param, int64_param, double_param, string_param
    choices: tuple[str, ...] = ()
    server_default: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name

    def argparse_options(self) -> dict[str, Any]:
        """Keyword arguments of `ArgumentParser.add_argument(self.flag, ...)` for the server default."""
        if self.type is bool:
            return {"action": "store_true", "help": self.help}
        opts: dict[str, Any] = {"type": str.upper if self.choices else self.type, "default": self.default,
                                "help": self.help}
        if self.choices:
            opts["choices"] = list(self.choices)
        return opts


@dataclass(frozen=True)
class AuxInput:
    """An input a transform reads besides the model's own: never passed to forward()."""

    name: str
    datatype: str
    help: str


@dataclass(frozen=True)
class Transform:
    """One registry entry (module docstring)."""

    name: str
    params: tuple[Param, ...]
    outputs: tuple[str, ...]  # suffixes of the output names it adds
    active: Callable[[OutputTransform, bool], bool]  # (want, the request sent the aux inputs)
    apply: Callable[[Rows], None] | None
    reduces: bool = False  # replaces the full tensor: the full output is sent only if no active one does
    floating: bool = True  # its math runs in fp32 on floating outputs
    check: Callable[[OutputTransform, TensorSpec, frozenset[str]], str | None] | None = None
    inputs: tuple[AuxInput, ...] = ()
    needs_tokens: bool = False  # reads the next token of each position (the model's token input)

    @property
    def names(self) -> frozenset[str]:
        """Its parameters' wire names."""
        return _NAMES.get(self.name) or frozenset(p.name for p in self.params)


def _class_dim(what: str) -> Callable[[OutputTransform, TensorSpec, frozenset[str]], str | None]:
    def check(want: OutputTransform, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        floating = spec.datatype in FLOAT_OUTPUT_DTYPES or spec.datatype == "FP64"
        if want[what] and floating and not spec.shape:
            return f"output {want.name!r} has no class dimension; {what} needs one"
        return None
    return check


def _check_top_k(want: OutputTransform, spec: TensorSpec, asked: frozenset[str]) -> str | None:
    if not want.top_k:
        return None
    if not spec.shape:
        return f"output {want.name!r} has no class dimension; top_k needs one"
    if spec.shape[-1] != -1 and want.top_k > spec.shape[-1]:
        return f"output {want.name!r}: top_k {want.top_k} exceeds its last dimension {spec.shape[-1]}"
    return None


def _check_tail(want: OutputTransform, spec: TensorSpec, asked: frozenset[str]) -> str | None:
    if want.topk_tail and not want.top_k and "topk_tail" in asked:
        return f"output {want.name!r}: topk_tail is the probability mass outside the top-k; ask for top_k too"
    return None


def _per_position(what: str) -> Callable[[OutputTransform, TensorSpec, frozenset[str]], str | None]:
    def check(want: OutputTransform, spec: TensorSpec, asked: frozenset[str]) -> str | None:
        if not want[what]:
            return None
        if not spec.per_position or not spec.datatype.startswith(("FP", "BF")) or len(spec.shape) < 2:
            return (f"output {want.name!r}: {what} needs a floating per-position output [T, V] of a model with a "
                    "padded token input (an hf: causal LM has one: LOGITS)")
        return None
    return check


SCORE_IDS = AuxInput("SCORE_IDS", "INT32",
                     "[B, T, m] token ids, padded like the ids: adds <OUT>_SCORED_LOGPROBS, the log-probabilities "
                     "(after temperature) at those ids at each position")

REGISTRY: list[Transform] = [
    Transform(
        "temperature",
        (Param("temperature", float, 1.0, "divisor of floating outputs before log-softmax, top-k and scoring "
               "(request parameter temperature)", checks.temperature, "double_param"),),
        (), lambda w, aux: w.temperature != 1.0, apply_temperature),
    Transform(
        "logprobs",
        (Param("logprobs", bool, False, "send log_softmax(x / temperature) of floating outputs, computed on the "
               "model's device (request parameter logprobs)", checks.boolean("logprobs"), "bool_param"),),
        (), lambda w, aux: w.logprobs, apply_logprobs, check=_class_dim("logprobs")),
    Transform(
        "top_k",
        (Param("top_k", int, 0, "send the top k of every output as <OUT>_TOPK_VALUES/_INDICES (0: full tensors; "
               "request parameter top_k)", checks.top_k, "int64_param"),),
        ("_TOPK_VALUES", "_TOPK_INDICES"), lambda w, aux: w.top_k > 0, apply_top_k, reduces=True,
        floating=False, check=_check_top_k),
    Transform(
        "topk_tail",
        (Param("topk_tail", bool, False, "with top-k, also send <OUT>_TOPK_TAIL, the probability mass outside the "
               "top-k per position (request parameter topk_tail)", checks.boolean("topk_tail"), "bool_param"),),
        ("_TOPK_TAIL",), lambda w, aux: w.topk_tail and w.top_k > 0, apply_topk_tail, check=_check_tail),
    Transform(
        "token_logprobs",
        (Param("token_logprobs", bool, False, "send <OUT>_TOKEN_LOGPROBS [B, T]: log p(x[t+1] | x[<=t]) after "
               "temperature, 0 at each sequence's last position and on padding", checks.boolean("token_logprobs"),
               "bool_param", server_default=False),),
        ("_TOKEN_LOGPROBS",), lambda w, aux: w.token_logprobs, apply_token_logprobs, reduces=True,
        check=_per_position("token_logprobs"), needs_tokens=True),
    Transform(
        "token_ranks",
        (Param("token_ranks", bool, False, "send <OUT>_TOKEN_RANKS [B, T] INT32: the rank of x[t+1] among the "
               "classes at position t (1 + how many score higher; vLLM's prompt-token rank), 0 at each sequence's "
               "last position and on padding", checks.boolean("token_ranks"), "bool_param", server_default=False),),
        ("_TOKEN_RANKS",), lambda w, aux: w.token_ranks, apply_token_ranks, reduces=True,
        check=_per_position("token_ranks"), needs_tokens=True),
    Transform(
        "score_ids", (), ("_SCORED_LOGPROBS",), lambda w, aux: aux, apply_scored, reduces=True,
        inputs=(SCORE_IDS,)),
    Transform(
        "output_dtype",
        (Param("output_dtype", str, None, "dtype of floating outputs (request parameter output_dtype)",
               checks.output_dtype, "string_param", choices=tuple(FLOAT_OUTPUT_DTYPES)),),
        (), lambda w, aux: False, None),
]
"""The transforms in the order they run; extend it with `register` (the tables below follow)."""

PARAMETERS: dict[str, Param] = {p.name: p for t in REGISTRY for p in t.params}
"""Every transform parameter by wire name, in declaration order."""

_NAMES: dict[str, frozenset[str]] = {t.name: frozenset(p.name for p in t.params) for t in REGISTRY}

AUX_INPUTS: dict[str, AuxInput] = {i.name: i for t in REGISTRY for i in t.inputs}
"""Inputs the transforms read besides the model's, by name."""

_DEFAULTS: dict[str, object] = {p.name: p.default for p in PARAMETERS.values()}

# The active entries per distinct set of parameter values, shared by all requests that ask the same.
_ACTIVE: dict[tuple[tuple[tuple[str, object], ...], bool], list[Transform]] = {}
_MAX_ACTIVE = 4096

OTHER_PARAMETERS = ("priority", "timeout")
"""Request parameters the server reads that are not transforms' (scheduling)."""

_MISSING = object()


def register(transform: Transform) -> None:
    """Add `transform` to the registry, after the built-in ones; its parameters, inputs and
    outputs are then validated, applied and recognised like theirs. Parameters and inputs must
    not clash with those already registered."""
    if any(t.name == transform.name for t in REGISTRY):
        raise ValueError(f"a transform named {transform.name!r} is registered already")
    clash = [p.name for p in transform.params if p.name in PARAMETERS or p.name in OTHER_PARAMETERS]
    clash += [i.name for i in transform.inputs if i.name in AUX_INPUTS]
    if clash:
        raise ValueError(f"transform {transform.name!r}: {clash} are taken by registered transforms")
    REGISTRY.append(transform)
    _index()


def unregister(name: str) -> None:
    """Remove the transform `name` (one added by `register`; tests use it to clean up)."""
    REGISTRY[:] = [t for t in REGISTRY if t.name != name]
    _index()


def _index() -> None:
    """Rebuild the tables derived from REGISTRY, in place (other modules hold them)."""
    PARAMETERS.clear()
    PARAMETERS.update({p.name: p for t in REGISTRY for p in t.params})
    _NAMES.clear()
    _NAMES.update({t.name: frozenset(p.name for p in t.params) for t in REGISTRY})
    AUX_INPUTS.clear()
    AUX_INPUTS.update({i.name: i for t in REGISTRY for i in t.inputs})
    _DEFAULTS.clear()
    _DEFAULTS.update({p.name: p.default for p in PARAMETERS.values()})
    _ACTIVE.clear()


class OutputTransform:
    """One output a request wants, and the value of every transform parameter for it.

    Constructed positionally as before the registry (name, datatype, top_k, logprobs,
    temperature, topk_tail) or with any parameter by its wire name; read with `want[name]` or
    the named properties. Immutable, hashable and compared by value.
    """

    __slots__ = ("_active", "_map", "_values", "name")

    # Positional as it was before the registry, for callers that build one by hand.
    def __init__(self, name: str, datatype: str | None = None, top_k: int = 0, logprobs: bool = False,  # noqa: PLR0917
                 temperature: float = 1.0, topk_tail: bool = False, **more: object) -> None:
        values = dict(_DEFAULTS)
        values.update(output_dtype=datatype, top_k=top_k, logprobs=logprobs, temperature=temperature,
                      topk_tail=topk_tail)
        unknown = [k for k in more if k not in PARAMETERS]
        if unknown:
            raise TypeError(f"OutputTransform: unknown transform parameters {unknown}; known: {list(PARAMETERS)}")
        values.update(more)
        self._set(name, values)

    def _set(self, name: str, values: dict[str, object]) -> None:
        self.name = name
        self._map = values
        self._values: tuple[tuple[str, object], ...] = tuple(values.items())
        self._active: dict[bool, list[Transform]] = {}

    def __getitem__(self, key: str) -> object:
        found = self._map.get(key, _MISSING)
        return PARAMETERS[key].default if found is _MISSING else found

    def values(self) -> dict[str, object]:
        return dict(self._map)

    def replace(self, name: str | None = None, /, **changes: object) -> OutputTransform:
        """A copy with another name and/or other parameter values (wire names, checked already)."""
        unknown = [k for k in changes if k not in PARAMETERS]
        if unknown:
            raise TypeError(f"OutputTransform: unknown transform parameters {unknown}; known: {list(PARAMETERS)}")
        out = OutputTransform.__new__(OutputTransform)
        out._set(self.name if name is None else name, {**self._map, **changes} if changes else self._map)
        return out

    def with_name(self, name: str) -> OutputTransform:
        return self.replace(name)

    def active(self, aux: bool = False) -> list[Transform]:
        """The registry entries this output runs (`aux`: the request sent the transforms' inputs)."""
        found = self._active.get(aux)
        if found is None:
            key = (self._values, aux)
            found = _ACTIVE.get(key)
            if found is None:
                found = [t for t in REGISTRY if t.active(self, aux)]
                if len(_ACTIVE) < _MAX_ACTIVE:  # clients choose the values (temperature): bounded
                    _ACTIVE[key] = found
            self._active[aux] = found
        return found

    def reduces(self, aux: bool = False) -> bool:
        """Some active transform replaces the full tensor (so the full output is not sent)."""
        return any(t.reduces for t in self.active(aux))

    @property
    def datatype(self) -> str | None:
        value = self["output_dtype"]
        return None if value is None else str(value)

    @property
    def top_k(self) -> int:
        return int(self["top_k"])  # type: ignore[call-overload]

    @property
    def logprobs(self) -> bool:
        return bool(self["logprobs"])

    @property
    def temperature(self) -> float:
        return float(self["temperature"])  # type: ignore[arg-type]

    @property
    def topk_tail(self) -> bool:
        return bool(self["topk_tail"])

    @property
    def token_logprobs(self) -> bool:
        return bool(self["token_logprobs"])

    @property
    def token_ranks(self) -> bool:
        return bool(self["token_ranks"])

    @property
    def needs_tokens(self) -> bool:
        """Some wanted transform reads each position's next token (token_logprobs, token_ranks)."""
        return any(t.needs_tokens for t in self.active())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputTransform) and (self.name, self._values) == (other.name, other._values)

    def __hash__(self) -> int:
        return hash((self.name, self._values))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self._values if v != PARAMETERS[k].default)
        return f"OutputTransform({self.name!r}{', ' if changed else ''}{changed})"


class OutputDefaults:
    """Server-wide defaults of the transform parameters; requests override them.

    Positional as before the registry (datatype, top_k, logprobs, temperature, topk_tail), or
    any parameter by wire name; `from_options` takes a mapping (unknown keys ignored), so a
    config object's fields can be passed whole.
    """

    __slots__ = ("_base",)

    def __init__(self, datatype: str | None = None, top_k: int = 0, logprobs: bool = False,
                 temperature: float = 1.0, topk_tail: bool = False, **more: object) -> None:
        self._base = OutputTransform("", datatype, top_k, logprobs, temperature, topk_tail, **more)

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> OutputDefaults:
        values = {k: v for k, v in options.items() if k in PARAMETERS}
        dtype = values.pop("output_dtype", None)
        return cls(dtype, **values)  # type: ignore[arg-type]

    def transform(self, name: str = "") -> OutputTransform:
        return self._base.with_name(name)

    @property
    def datatype(self) -> str | None:
        return self._base.datatype

    @property
    def top_k(self) -> int:
        return self._base.top_k

    @property
    def logprobs(self) -> bool:
        return self._base.logprobs

    @property
    def temperature(self) -> float:
        return self._base.temperature

    @property
    def topk_tail(self) -> bool:
        return self._base.topk_tail

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputDefaults) and self._base == other._base

    def __hash__(self) -> int:
        return hash(self._base)

    def __repr__(self) -> str:
        return f"OutputDefaults({self._base.values()})"


def scoreable(spec: TensorSpec) -> bool:
    """Whether the scoring transforms apply to output `spec`: floating, per position, with classes."""
    return spec.per_position and spec.datatype.startswith(("FP", "BF")) and len(spec.shape) >= 2


def token_input(io: ModelIO) -> int | None:
    """The index of the model's token input: its first padded integer input that is not the
    attention mask (an hf: causal LM's INPUT_IDS); None when it has none."""
    for i, s in enumerate(io.inputs):
        if s.pad_value is not None and not s.attention_mask and s.datatype.startswith(("INT", "UINT")):
            return i
    return None
