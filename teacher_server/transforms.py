"""The teacher's output transforms, each declared once: the registry every other layer reads.

A `Transform` entry declares
* its request parameters (`Param`): wire name, Python type, KServe parameter field, server
  default, help text and check. Validation parses request-level and per-output parameters from
  them, near-misses of them (`topk`, `log_probs`) are refused by name, and the config/CLI layer
  derives its flags and defaults from them (`teacher_server.config.transform_setting`); see
  `teacher_server.near_miss` for the names refused as misspellings;
* the outputs it adds (`protos.outputs.DerivedOutput`, declared there once for the teacher and the
  student): each `<OUT>` + its suffix (e.g. `LOGITS_TOPK_VALUES`), with its shape relative to
  `<OUT>`, its datatype rule and the parameters or auxiliary input (`AuxInput`, e.g. `SCORE_IDS`,
  read besides the model's inputs) that bring it; the answer's size (`teacher_server.answer_size`)
  and the student's expectations (`distill.outputs`) are read from them;
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

Adding a transform is one entry in `REGISTRY` (in the order the transforms run), its outputs'
declarations in `protos.outputs`, and its test on the teacher, plus, for a parameter with a server
default, one typed field of `teacher_server.config.OutputSettings` (``top_k: int =
transform_setting("top_k")``): the flag and ``serve()``'s keyword take the Param's default, help and
check. The common entry, a boolean request parameter, names itself once:
``flag_transform("token_ranks", help, apply_token_ranks, outputs=(TOKEN_RANKS,), check=per_position)``,
with ``TOKEN_RANKS = flag_output("token_ranks", DROP_CLASSES, "INT32")`` (the output
``<OUT>_TOKEN_RANKS``, there when the parameter is true). `register(flag_transform(...))` adds a
transform from outside the library (its parameters are then per request: no flag) and declares
its outputs; a student in another process than the teacher declares the same objects with
``distill.outputs.register(...)``.

`OutputTransform` is one output's wanted transforms (the value of every parameter), built by
validation from the server's `OutputDefaults` and the request's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protos.outputs import (
    DROP_CLASSES,  # noqa: F401 (re-exported: the shape rules of a registered transform's outputs)
    PROBS,  # noqa: F401
    SCORE_IDS,  # noqa: F401
    SCORED_LOGPROBS,
    TOKEN_LOGPROBS,
    TOKEN_RANKS,
    TOPK_INDICES,
    TOPK_TAIL,
    TOPK_VALUES,
    AuxInput,
    DerivedOutput,
    declare,
    flag_output,  # noqa: F401
    undeclare,
)
from teacher_server import param_checks as checks
from teacher_server.param_checks import Check
from teacher_server.spec import FLOAT_OUTPUT_DTYPES
from teacher_server.transform_checks import (
    OutputCheck,
    class_dim,
    per_position,
    scoreable,  # noqa: F401 (re-exported)
    tail_check,
    token_input,  # noqa: F401 (re-exported)
    top_k_check,
)
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
class Transform:
    """One registry entry (module docstring). `active` None: active when any of its `outputs` is
    (its parameters set, its input sent), or, with no outputs, when its one parameter is set;
    `inputs` empty: those of its outputs."""

    name: str
    params: tuple[Param, ...]
    outputs: tuple[DerivedOutput, ...]  # the outputs it adds, declared in protos.outputs
    active: Callable[[OutputTransform, bool], bool] | None  # (want, the request sent the aux inputs)
    apply: Callable[[Rows], None] | None
    reduces: bool = False  # replaces the full tensor: the full output is sent only if no active one does
    floating: bool = True  # its math runs in fp32 on floating outputs
    check: OutputCheck | None = None
    inputs: tuple[AuxInput, ...] = ()
    needs_tokens: bool = False  # reads the next token of each position (the model's token input)

    def __post_init__(self) -> None:
        if not self.inputs:
            object.__setattr__(self, "inputs", tuple(dict.fromkeys(o.input for o in self.outputs if o.input)))

    def is_active(self, want: OutputTransform, aux: bool) -> bool:
        if self.active is not None:
            return self.active(want, aux)
        if self.outputs:
            return any(o.active(want.parameters, (o.input.name,) if aux and o.input else ()) for o in self.outputs)
        return len(self.params) == 1 and bool(want[self.params[0].name])

    @property
    def names(self) -> frozenset[str]:
        """Its parameters' wire names."""
        return _NAMES.get(self.name) or frozenset(p.name for p in self.params)


def flag_transform(name: str, help: str, apply: Callable[[Rows], None], *,
                   outputs: tuple[DerivedOutput, ...] = (), reduces: bool = False,
                   check: Callable[[str], OutputCheck] | None = None, needs_tokens: bool = False,
                   server_default: bool = True) -> Transform:
    """The common entry: a transform run by the boolean request parameter `name` (bool_param, False
    by default), active when an output of it is (or, with none, when the parameter is true); `check`
    is made for the parameter (`teacher_server.transform_checks.per_position`)."""
    param = Param(name, bool, False, help, checks.boolean(name), "bool_param", server_default=server_default)
    return Transform(name, (param,), outputs, None, apply, reduces=reduces,
                     check=None if check is None else check(name), needs_tokens=needs_tokens)


REGISTRY: list[Transform] = [
    Transform(
        "temperature",
        (Param("temperature", float, 1.0, "divisor of floating outputs before log-softmax, top-k and scoring "
               "(request parameter temperature)", checks.temperature, "double_param"),),
        (), lambda w, aux: w.temperature != 1.0, apply_temperature),
    flag_transform("logprobs", "send log_softmax(x / temperature) of floating outputs, computed on the model's "
                   "device (request parameter logprobs)", apply_logprobs, check=class_dim),
    Transform(
        "top_k",
        (Param("top_k", int, 0, "send the top k of every output as <OUT>_TOPK_VALUES/_INDICES (0: full tensors; "
               "request parameter top_k)", checks.top_k, "int64_param"),),
        (TOPK_VALUES, TOPK_INDICES), None, apply_top_k, reduces=True, floating=False, check=top_k_check("top_k")),
    flag_transform("topk_tail", "with top-k, also send <OUT>_TOPK_TAIL, the probability mass outside the top-k "
                   "per position (request parameter topk_tail)", apply_topk_tail, outputs=(TOPK_TAIL,),
                   check=tail_check),
    flag_transform("token_logprobs", "send <OUT>_TOKEN_LOGPROBS [B, T]: log p(x[t+1] | x[<=t]) after temperature, "
                   "0 at each sequence's last position and on padding", apply_token_logprobs,
                   outputs=(TOKEN_LOGPROBS,), reduces=True, check=per_position, needs_tokens=True,
                   server_default=False),
    flag_transform("token_ranks", "send <OUT>_TOKEN_RANKS [B, T] INT32: the rank of x[t+1] among the classes at "
                   "position t (1 + how many score higher; vLLM's prompt-token rank), 0 at each sequence's last "
                   "position and on padding", apply_token_ranks, outputs=(TOKEN_RANKS,), reduces=True,
                   check=per_position, needs_tokens=True, server_default=False),
    Transform("score_ids", (), (SCORED_LOGPROBS,), None, apply_scored, reduces=True),
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
    clash += [o.suffix for o in transform.outputs if any(o.suffix == d.suffix for t in REGISTRY for d in t.outputs)]
    if clash:
        raise ValueError(f"transform {transform.name!r}: {clash} are taken by registered transforms")
    declare(*transform.outputs)
    REGISTRY.append(transform)
    _index()


def unregister(name: str) -> None:
    """Remove the transform `name` (one added by `register`; tests use it to clean up), and the
    declarations of its outputs."""
    gone = [o for t in REGISTRY if t.name == name for o in t.outputs]
    REGISTRY[:] = [t for t in REGISTRY if t.name != name]
    undeclare(*gone)
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

    @property
    def parameters(self) -> Mapping[str, object]:
        """Every parameter's value by wire name (read-only: `replace` makes changed copies)."""
        return self._map

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
                found = [t for t in REGISTRY if t.is_active(self, aux)]
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

