"""The local backend's teacher command template: checked once, filled in per teacher.

``distill-autoscaler ... -- teacher-server --model examples.refteacher:build --name ref_teacher``:
the words after ``--`` may use ``{port}``, ``{device}``, ``{gpu}``, ``{instance_id}``,
``{registry}`` and ``{service}`` (write ``{{``/``}}`` for literal braces). The flags ``--port``,
``--device``, ``--instance-id``, ``--registry`` and ``--service`` are appended when the template
does not set them, so the short form works.

An engine with its registrar is a *wrapper* template: it has a ``--`` of its own, after which
comes the engine's command,

    distill register --engine vllm --url http://127.0.0.1:{port} --registry {registry} \\
        --service {service} -- python -m vllm.entrypoints.openai.api_server --model DIR --port {port}

Then only ``--instance-id``, ``--registry`` and ``--service`` are appended, before that ``--`` (the
registrar's flags; the engine takes none of them), and the template must place ``{port}`` itself
(every engine would otherwise listen on its default port). ``{gpu}`` is the device's index
(``cuda:1`` -> ``1``, empty on CPU) for ``CUDA_VISIBLE_DEVICES={gpu}`` in front of an engine.

A command not on ``PATH`` is looked for beside this interpreter (the console scripts of its
environment: ``teacher-server``, ``distill``); ``teacher-server`` is run as ``python -m
teacher_server`` when it is not there either. Why checked at start: a typo in a placeholder would
otherwise surface as a crash loop of teachers, long after the operator looked away.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from distill.autoscale.errors import BackendError

__all__ = ["PLACEHOLDERS", "check_template", "device_index", "fill"]

PLACEHOLDERS: tuple[str, ...] = ("port", "device", "gpu", "instance_id", "registry", "service")
_APPENDED: tuple[tuple[str, str], ...] = (
    ("--port", "{port}"),
    ("--device", "{device}"),
    ("--instance-id", "{instance_id}"),
    ("--registry", "{registry}"),
    ("--service", "{service}"),
)
# What a wrapper (registrar) template gets appended before its own `--`.
_WRAPPER_APPENDED: tuple[str, ...] = ("--instance-id", "--registry", "--service")


def _sets(words: Sequence[str], flag: str) -> bool:
    return any(tok == flag or tok.startswith(flag + "=") for tok in words)


def check_template(command: list[str], append: bool) -> list[str]:
    """The template to run: flags appended (``append``), every placeholder known, the executable
    found (``BackendError`` naming what is wrong otherwise)."""
    if not command:
        raise BackendError(
            "the local backend needs a teacher command after '--', e.g. "
            "-- teacher-server --model examples.refteacher:build --name ref_teacher"
        )
    command = list(command)
    wrapper = "--" in command
    if wrapper:
        split = command.index("--")
        if split == len(command) - 1:
            raise BackendError(
                f"the teacher command {' '.join(command)!r} ends with '--': put the engine's command after it"
            )
        if not any("{port}" in tok for tok in command):
            raise BackendError(
                "a registrar template must place {port} itself, in the registrar's --url and the engine's "
                "port flag (e.g. --url http://127.0.0.1:{port} -- ... --port {port})"
            )
        if append:
            own = command[:split]
            added = [w for flag, value in _APPENDED if flag in _WRAPPER_APPENDED and not _sets(own, flag)
                     for w in (flag, value)]  # fmt: skip
            command = own + added + command[split:]
    elif append:
        for flag, value in _APPENDED:
            if not _sets(command, flag):
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
        beside = Path(sys.executable).parent / exe
        if beside.is_file() and os.access(beside, os.X_OK):
            return [str(beside), *command[1:]]
        if exe == "teacher-server":
            return [sys.executable, "-m", "teacher_server", *command[1:]]
        raise BackendError(f"teacher command {exe!r} not found on PATH")
    return command


def device_index(device: str) -> str:
    """``{gpu}`` of a device: ``cuda:1`` -> ``1``, ``cuda`` -> ``0``, ``cpu``/``mps`` -> ``""``."""
    if device.startswith("cuda:"):
        return device[5:]
    return "0" if device == "cuda" else ""


def fill(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """One teacher's argv: the checked template with ``values`` for its placeholders."""
    return [tok.format_map(values) for tok in command]
