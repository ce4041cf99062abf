"""Command-line flags for a student job, so every training script spells the mesh the same way.

``add_distill_args(parser)`` adds a "distillation" group; ``distill_options_from_args(args)`` turns
the parsed namespace into the keyword arguments ``DistillReader`` takes. Both come from the
options' declarations (``distill.options.ReaderOptions``: each field's flag, rule and help text),
so a flag never states a default or a rule of its own. Per-flag checks happen while parsing
(argparse reports them with the flag's name and exits, as for any bad flag); checks that involve
several flags happen in ``distill_options_from_args`` and raise ``ValueError``, because argparse
has no hook for them and a script may also build the namespace itself. The same per-flag checks
run again there, so a hand-built ``argparse.Namespace`` gets the same guarantees.

Flag names use underscores (``--distill_teachers``) to match the call form the users' scripts
already have; the reader's keyword names are the flag names without the ``distill_`` prefix,
except ``--distill_hedge_ms`` which becomes ``hedge_after`` in seconds ("auto" when not given, None
when 0: off), and ``--distill_header`` (repeatable) which becomes the ``headers`` mapping.

Header values are access tokens: they are never put in a message or a repr (``distill.headers``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from distill.checks import (
    FALLBACKS,
    OUTPUT_DTYPES,
    checked,
    fallback_choice,
    maybe_bool,
    model_name,
    non_negative_float,
    non_negative_int,
    output_dtype_choice,
    positive_float,
    positive_int,
)
from distill.declare import Declared, Flag, declared
from distill.headers import HeaderArg, header_env_var, headers_map
from distill.options import ReaderOptions, options_from_args

__all__ = [
    "FALLBACKS",
    "OUTPUT_DTYPES",
    "HeaderArg",
    "add_distill_args",
    "add_transform_args",
    "argument_type",
    "checked",
    "distill_options_from_args",
    "fallback_choice",
    "header_env_var",
    "headers_map",
    "maybe_bool",
    "model_name",
    "non_negative_float",
    "non_negative_int",
    "output_dtype_choice",
    "positive_float",
    "positive_int",
]

_T = TypeVar("_T")

distill_options_from_args = options_from_args


def argument_type(check: Callable[[Any], _T], name: str) -> Callable[[str], _T]:
    """A checker (``distill.checks``) as an argparse ``type``, for commands that declare flags of
    their own (``distill gateway``): argparse shows its ArgumentTypeError message verbatim, so a bad
    value is refused with the checker's own words and the flag's name."""

    def parse(text: str) -> _T:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name  # argparse names the type in its fallback message
    return parse


def _add(group: Any, d: Declared, flag: Flag, name: str) -> None:
    """One declared flag on `group`, under `name`."""
    default = d.flag_default(flag)
    kwargs: dict[str, Any] = {"default": default, "help": flag.help or d.option.help}
    parse = flag.parse or (d.option.check if len(d.flags) == 1 else None)
    if flag.switch:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif flag.choices is not None:
        kwargs["choices"] = flag.choices
    else:
        if parse is not None:
            kwargs["type"] = argument_type(parse, d.name)
        kwargs["metavar"] = flag.metavar
    if flag.repeat:
        kwargs["action"] = "append"
    elif default is not None and not flag.switch:
        kwargs["help"] += " (default: %(default)s)"
    group.add_argument(name, **kwargs)


def add_distill_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "distillation" flag group to ``parser`` and return it (so calls can be chained).

    Teachers come from exactly one of ``--distill_teachers`` (a fixed list) or
    ``--distill_registry`` plus ``--distill_service`` (teachers that register themselves and come
    and go); ``distill_options_from_args`` enforces that. All other flags have working defaults.
    """
    group = parser.add_argument_group(
        "distillation",
        "Where the teachers are and how the student talks to them. Pass either --distill_teachers or "
        "--distill_registry with --distill_service.",
    )
    for d in declared(ReaderOptions):
        for flag in d.flags:
            _add(group, d, flag, flag.name)
    return parser


def add_transform_args(parser: argparse.ArgumentParser | Any) -> list[str]:
    """Add one ``--name-with-dashes`` flag per output transform a reader can ask teachers for
    (``--top-k``, ``--output-dtype``, ``--logprobs``, ...: ``distill record``'s), declared like the
    reader's own; returns the option names, which are also the flags' ``dest``."""
    names = []
    for d in declared(ReaderOptions):
        if d.option.wire is None or len(d.flags) != 1:
            continue
        flag = d.flags[0]
        _add(parser, d, Flag(switch=flag.switch, metavar=flag.metavar, parse=flag.parse),
             "--" + d.name.replace("_", "-"))
        names.append(d.name)
    return names
