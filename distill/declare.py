"""How a reader option is declared once: its default, rule, help text, flag and wire name.

PyTriton's configs are dataclasses that are at once the documentation, the defaults and the
validation; ``ReaderOptions`` (``distill.options``) is one, each field made by `option`:

    top_k: int = option(0, check=non_negative_int, wire="top_k", store=lambda k: {"top_k": k or None},
                        help="ask teachers for each output's top K values and indices; 0: full outputs",
                        flag=Flag(metavar="K"))

From that one declaration come the keyword's check (``ReaderOptions.__post_init__``), the
``--distill_top_k`` flag (``distill.flags.add_distill_args``), reading it back
(``distill.options.options_from_args``), the request parameter that asks the teachers for it
(``ReaderOptions.request_parameters``), the field of a teacher-output store's namespace that
names it (``ReaderOptions.store_fields``), ``distill record``'s ``--top-k``, and the option's
entry in ``help(ReaderOptions)``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = ["SAME", "Declared", "Flag", "Option", "declared", "document", "option", "read_flags"]

SAME: Any = object()
"""A flag's default when it is the option's own."""


@dataclass(frozen=True)
class Flag:
    """The ``--distill_*`` command-line form of an option.

    ``parse`` is the rule for the flag's value (default: the option's ``check``); ``to_option``
    turns the checked flag value into the option's (``--distill_hedge_ms`` is milliseconds, the
    option ``hedge_after`` seconds). ``required``: a namespace without this flag was not built
    by ``add_distill_args`` (flags added later are read with their defaults instead, so a
    namespace built by hand for an older flag set still works).
    """

    name: str = ""  # default: --distill_<option>
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # --X / --no-X, leaving None when neither is given
    repeat: bool = False  # may be given several times: a list
    default: Any = SAME
    required: bool = False
    help: str = ""  # default: the option's help
    to_option: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Option:
    """What a field of ``ReaderOptions`` is, besides its type and default (see the module docstring).

    check: the rule for the value (``distill.checks``): returns it normalised or raises ValueError;
        not applied to None (an option whose default is None: unset).
    flags: its command-line form(s); several flags make one option through ``combine``, read only
        when option ``needs`` is set (``registry_options`` from the four ``--distill_registry_*``).
    wire: the request parameter that asks the teachers for this output transform; sent with every
        request unless the value is None (left to the teacher's default).
    store: the fields of a teacher-output store's namespace that name the value (default for a wire
        option: an ``extra`` entry ``(wire, value)`` while the value is not None).
    stated: the value a reader with a store states when the option was left to the teacher
        (``stated(value, values)``), so a teacher's own default never lands in a store unnamed.
    """

    help: str
    check: Callable[[Any], Any] | None = None
    flags: tuple[Flag, ...] = ()
    combine: Callable[..., Any] | None = None
    needs: str | None = None
    wire: str | None = None
    store: Callable[[Any], dict[str, Any]] | None = None
    stated: Callable[[Any, Mapping[str, Any]], Any] | None = None

    def namespace_fields(self, value: Any) -> dict[str, Any]:
        """The store's namespace fields that name `value` (see ``store``)."""
        if self.store is not None:
            return self.store(value)
        if self.wire is None or value is None:
            return {}
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return {"extra": ((self.wire, text),)}


_KEY = "distill.option"


def option(default: Any = MISSING, *, help: str, check: Callable[[Any], Any] | None = None,
           flag: Flag | tuple[Flag, ...] | None = None, combine: Callable[..., Any] | None = None,
           needs: str | None = None, wire: str | None = None, store: Callable[[Any], dict[str, Any]] | None = None,
           stated: Callable[[Any, Mapping[str, Any]], Any] | None = None,
           default_factory: Callable[[], Any] | None = None, repr: bool = True) -> Any:
    """A dataclass field carrying its `Option` (see the module docstring)."""
    flags = () if flag is None else flag if isinstance(flag, tuple) else (flag,)
    meta = {_KEY: Option(help, check, flags, combine, needs, wire, store, stated)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, repr=repr, metadata=meta)
    return dataclasses.field(default=default, repr=repr, metadata=meta)


@dataclass(frozen=True)
class Declared:
    """One declared option: its field name, default (MISSING when required) and declaration."""

    name: str
    default: Any
    option: Option

    @property
    def flags(self) -> tuple[Flag, ...]:
        """Its flags, each with its name filled in."""
        return tuple(f if f.name else dataclasses.replace(f, name=f"--distill_{self.name}") for f in self.option.flags)

    def flag_default(self, flag: Flag) -> Any:
        """The flag's default: its own, else the option's (None for one of several flags)."""
        if flag.default is not SAME:
            return flag.default
        return self.default if len(self.option.flags) == 1 else None


def declared(cls: type) -> Iterator[Declared]:
    """The declared options of dataclass `cls`, in field order."""
    for f in dataclasses.fields(cls):
        opt = f.metadata.get(_KEY)
        if opt is None:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        yield Declared(f.name, default, opt)


def _flag_value(args: argparse.Namespace, flag: Flag, default: Any, parse: Callable[[Any], Any] | None) -> Any:
    if flag.required:
        try:
            value = getattr(args, flag.dest)
        except AttributeError:
            raise ValueError(
                f"args has no {flag.dest!r}; build the parser with distill.add_distill_args(parser)") from None
    else:  # a flag added later: a namespace built by hand for an older flag set gets its default
        value = getattr(args, flag.dest, default)
    if value is not None and parse is not None:
        try:
            value = ([v if not isinstance(v, str) else parse(v) for v in value] if flag.repeat
                     else parse(value))
        except ValueError as e:
            raise ValueError(f"{flag.name}: {e}") from None
    return flag.to_option(value) if flag.to_option is not None else value


def read_flags(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{option: value} for every option of `cls` that has flags, read from a parsed namespace and
    checked by each flag's rule (ValueError naming the flag); an option that `needs` another one
    unset gets its default without its flags being read."""
    out: dict[str, Any] = {}
    for d in declared(cls):
        flags = d.flags
        if not flags:
            continue
        if d.option.needs is not None and out.get(d.option.needs) is None:
            out[d.name] = d.default
            continue
        single = len(flags) == 1
        values = [_flag_value(args, f, d.flag_default(f), f.parse or (d.option.check if single else None))
                  for f in flags]
        out[d.name] = d.option.combine(*values) if d.option.combine is not None else values[0]
    return out


def document(cls: type) -> str:
    """An "Args:" section for `cls`'s docstring, from the declarations."""
    lines = ["", "Args:"]
    for d in declared(cls):
        flags = ", ".join(f.name for f in d.flags)
        lines.append(f"    {d.name}: {d.option.help}" + (f" (flag: {flags})" if flags else ""))
    return "\n".join(lines) + "\n"
