"""The local backend's teacher command template: checked once, filled in per teacher.

``distill-autoscaler ... -- teacher-server --model examples.refteacher:build --name ref_teacher``:
the words after ``--`` may use ``{port}``, ``{device}``, ``{instance_id}``, ``{registry}`` and
``{service}`` (write ``{{``/``}}`` for literal braces). The flags ``--port``, ``--device``,
``--instance-id``, ``--registry`` and ``--service`` are appended when the template does not set
them, so the short form works. ``teacher-server`` is run as ``python -m teacher_server`` from this
interpreter when it is not on ``PATH``. Why checked at start: a typo in a placeholder would
otherwise surface as a crash loop of teachers, long after the operator looked away.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from distill.autoscale.errors import BackendError

__all__ = ["PLACEHOLDERS", "check_template", "fill"]

PLACEHOLDERS: tuple[str, ...] = ("port", "device", "instance_id", "registry", "service")
_APPENDED: tuple[tuple[str, str], ...] = (
    ("--port", "{port}"),
    ("--device", "{device}"),
    ("--instance-id", "{instance_id}"),
    ("--registry", "{registry}"),
    ("--service", "{service}"),
)


def check_template(command: list[str], append: bool) -> list[str]:
    """The template to run: flags appended (``append``), every placeholder known, the executable
    found (``BackendError`` naming what is wrong otherwise)."""
    if not command:
        raise BackendError(
            "the local backend needs a teacher command after '--', e.g. "
            "-- teacher-server --model examples.refteacher:build --name ref_teacher"
        )
    if append:
        for flag, value in _APPENDED:
            if not any(tok == flag or tok.startswith(flag + "=") for tok in command):
                command += [flag, value]
    sample = dict.fromkeys(PLACEHOLDERS, "x")
    for tok in command:
        try:
            tok.format_map(sample)
        except KeyError as e:
            raise BackendError(
                f"unknown placeholder {{{e.args[0]}}} in teacher command argument {tok!r}; "
                f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)} (write {{{{ and }}}} for braces)"
            ) from None
        except (ValueError, IndexError) as e:
            raise BackendError(
                f"bad braces in teacher command argument {tok!r}: {e}; write {{{{ and }}}}"
            ) from None
    exe = command[0]
    if os.sep not in exe and shutil.which(exe) is None:
        if exe == "teacher-server":
            return [sys.executable, "-m", "teacher_server", *command[1:]]
        raise BackendError(f"teacher command {exe!r} not found on PATH")
    return command


def fill(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """One teacher's argv: the checked template with ``values`` for its placeholders."""
    return [tok.format_map(values) for tok in command]
