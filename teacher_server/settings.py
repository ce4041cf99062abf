"""Each teacher setting declared once: default, check, help text and flag, on the config it configures.

A config dataclass declares a field with ``setting(...)`` (PyTriton's config-as-documentation):
the field's default is the setting's default, and the same declaration carries the help text, the
flag's spelling and the check. From those declarations ``teacher-server`` builds its argparse
flags, ``teacher_server.serve()``/``server_config()`` learn which keywords they take and their
defaults, and every entry point runs the same check, so a flag, a keyword and a config field
cannot disagree. A new setting is one declaration (plus its test).

A refusal names the setting the way its caller spelled it: ``--top-k`` on the command line,
``top_k=`` from Python (``FLAGS`` / ``KEYWORDS``); a config built directly names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from teacher_server.spec import SpecError

__all__ = ["FLAGS", "KEYWORDS", "Setting", "Words", "setting", "settings_of"]

Check = Callable[[Any], "str | None"]
"""What is wrong with a value, as the words that follow the setting's name
(``"must be >= 0, got -1"``), or None when it is fine."""

Kind = Literal["value", "switch", "negated", "repeat"]


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Setting:
    """One option of the teacher: serve()'s keyword ``name`` and its ``flag`` on the command line.

    kind: ``value`` (``--flag VALUE``), ``switch`` (``--flag`` sets True), ``negated`` (``--no-x``
    sets the keyword False), ``repeat`` (``--flag`` given once per item, a list).
    default: the keyword's default (server_config(), and the field's in a config dataclass);
    serve_default: serve()'s and the command line's, where a process wants another (the gRPC port).
    from_flag: turns the flag's value into the keyword's (``--model-arg K=V`` -> a dict).
    scope: ``config`` (a ServerConfig / batching / model-declaration keyword of server_config()),
    ``serve`` (serve() only: registration, ready file, threads), ``cli`` (the command line only).
    """

    name: str
    help: str
    group: str
    default: Any = None
    flag: str = ""
    kind: Kind = "value"
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    check: Check | None = None
    serve_default: Any = UNSET
    from_flag: Callable[[Any], Any] | None = None
    scope: Literal["config", "serve", "cli"] = "config"
    required: bool = False

    @property
    def option(self) -> str:
        """The flag, ``--name-with-dashes`` unless declared otherwise."""
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def launch_default(self) -> Any:
        """The default of serve() and of the command line."""
        return self.default if self.serve_default is UNSET else self.serve_default

    def problem(self, value: Any) -> str | None:
        if self.choices is not None and value is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, got {value!r}"
        return None if self.check is None or value is None else self.check(value)

    def refuse_bad(self, value: Any, words: Words) -> None:
        """SpecError naming this setting in `words` when `value` fails its check."""
        problem = self.problem(value)
        if problem is not None:
            raise SpecError(f"{words(self)} {problem}")

    @property
    def dest(self) -> str:
        """The flag's attribute on argparse's namespace (argparse's own choice: ``drain_grace``)."""
        return self.option.lstrip("-").replace("-", "_")

    def add_to(self, group: argparse._ActionsContainer) -> None:
        """This setting as one argparse flag."""
        kw: dict[str, Any] = {"help": self.help}
        if self.kind in ("switch", "negated"):
            kw.update(action="store_true", default=False)
        else:
            kw.update(default=[] if self.kind == "repeat" else self.launch_default)
            if self.kind == "repeat":
                kw["action"] = "append"
            if self.type is not None:
                kw["type"] = self.type
            if self.choices is not None:
                kw["choices"] = list(self.choices)
            if self.metavar is not None:
                kw["metavar"] = self.metavar
            if self.required:
                kw["required"] = True
        group.add_argument(self.option, **kw)

    def from_namespace(self, args: argparse.Namespace) -> Any:
        """The keyword's value from the parsed flags (``--no-x`` given: False; ``from_flag`` applied)."""
        value = getattr(args, self.dest)
        if self.kind == "negated":  # a None default (chosen later, e.g. by device) stays None unless --no-x
            return False if value else (None if self.launch_default is None else True)
        return self.from_flag(value) if self.from_flag is not None else value


class Words:
    """How a refusal spells a setting: its flag, or its keyword (``name=``)."""

    def __init__(self, as_flag: bool) -> None:
        self.as_flag = as_flag

    def __call__(self, s: Setting, example: str | None = None) -> str:
        if self.as_flag:
            return s.option if example is None else f"{s.option} {example}"
        return f"{s.name}=" if example is None else f"{s.name}={example!r}"


FLAGS = Words(as_flag=True)
KEYWORDS = Words(as_flag=False)


def setting(default: Any, help: str, *, group: str, field_default: Any = UNSET, **declared: Any) -> Any:
    """A dataclass field that is also a setting: ``top_k: int = setting(0, "...", group="outputs")``.
    ``declared``: the rest of ``Setting``'s attributes (flag, kind, type, check, ...).
    ``field_default``: the field's default where a config built directly wants another than the
    keyword's (``instances``: 0, chosen for the device, from serve(); 1 in a hand-built config)."""
    meta = {"setting": dict(help=help, group=group, default=default, **declared)}
    value = default if field_default is UNSET else field_default
    if isinstance(value, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=value, metadata=meta)


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings a config dataclass declares, in field order (inherited fields first)."""
    out = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("setting")
        if declared is not None:
            out.append(Setting(name=f.name, **declared))
    return tuple(out)


def check_fields(obj: Any, words: Words = FLAGS) -> None:
    """Run every declared check on a config dataclass's values (its __post_init__ calls this)."""
    for s in settings_of(type(obj)):
        s.refuse_bad(getattr(obj, s.name), words)


def by_name(settings: Iterable[Setting]) -> dict[str, Setting]:
    return {s.name: s for s in settings}


def check_values(values: Mapping[str, Any], settings: Mapping[str, Setting], words: Words) -> None:
    """Check each given value against its declaration (unknown names are the caller's to refuse)."""
    for name, value in values.items():
        if name in settings:
            settings[name].refuse_bad(value, words)


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting],
                  groups: Mapping[str, argparse._ActionsContainer]) -> None:
    """Every setting with a flag as argparse flags, each in its group (``""``: the parser itself)."""
    for s in settings:
        s.add_to(groups.get(s.group, parser))


def from_args(args: argparse.Namespace, settings: Iterable[Setting]) -> dict[str, Any]:
    """The parsed flags as keywords: each setting's flag value, through its ``from_flag``."""
    return {s.name: s.from_namespace(args) for s in settings}


# ---- checks, each returning the words that follow the setting's name ---------------------------
def at_least(low: float, note: str = "") -> Check:
    """``must be >= low`` (NaN refused too); `note` explains the special values, e.g. ``(0: no cap)``."""
    suffix = f" {note}" if note else ""
    return lambda v: None if v >= low else f"must be >= {low}{suffix}, got {v}"


def in_port_range(note: str = "") -> Check:
    suffix = f" {note}" if note else ""
    return lambda v: None if 0 <= v < 65536 else f"must be in 0..65535{suffix}, got {v}"


def positive_finite(what: str) -> Check:
    """``must be {what}`` unless the value is a finite number > 0."""
    return lambda v: None if math.isfinite(v) and v > 0 else f"must be {what}, got {v}"


def existing_file(v: Any) -> str | None:
    return None if Path(v).is_file() else f"{v} does not exist"
