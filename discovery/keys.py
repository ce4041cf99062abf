"""The etcd key layout, in one place.

::

    /distill/v1/<service>/teachers/<instance_id>   TeacherRecord   (lease-bound)
    /distill/v1/<service>/load/<instance_id>       TeacherLoad     (lease-bound, ~1 Hz, same lease)
    /distill/v1/<service>/students/<student_id>    StudentDemand   (lease-bound, ~1 Hz)
    /distill/v1/<service>/autoscaler/...           reserved for the autoscaler's own state

The version segment (``v1``) lets a future layout live beside this one during an upgrade. Teachers
and their load live under *separate* prefixes so that a student can watch exactly what it needs:
watching the whole service prefix would also stream every student's 1 Hz demand to every student.
Names are validated here (non-empty, no ``/``) because a ``/`` inside a name would silently move a
key into another part of the tree.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ROOT",
    "Kind",
    "autoscaler_prefix",
    "load_key",
    "load_prefix",
    "service_prefix",
    "split_key",
    "student_key",
    "students_prefix",
    "teacher_key",
    "teachers_prefix",
    "validate_name",
]

ROOT = "/distill/v1"

Kind = Literal["teachers", "load", "students", "autoscaler"]
_KINDS: tuple[Kind, ...] = ("teachers", "load", "students", "autoscaler")
_MAX_NAME = 256


def validate_name(what: str, name: object) -> str:
    """Return ``name`` if it can be a key segment, else raise ``ValueError`` naming ``what``.

    A segment must be a non-empty string of at most 256 characters without ``/``, control
    characters or surrounding whitespace.
    """
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a string, not {type(name).__name__}")
    if not name:
        raise ValueError(f"{what} must not be empty")
    if "/" in name:
        raise ValueError(f"{what} {name!r} must not contain '/' (it is one segment of an etcd key)")
    if name != name.strip():
        raise ValueError(f"{what} {name!r} must not start or end with whitespace")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"{what} {name!r} must not contain control characters")
    if len(name) > _MAX_NAME:
        raise ValueError(f"{what} is {len(name)} characters long; the limit is {_MAX_NAME}")
    return name


def service_prefix(service: str) -> str:
    """``/distill/v1/<service>/``: everything the mesh keeps for one service."""
    return f"{ROOT}/{validate_name('service name', service)}/"


def teachers_prefix(service: str) -> str:
    return f"{service_prefix(service)}teachers/"


def load_prefix(service: str) -> str:
    return f"{service_prefix(service)}load/"


def students_prefix(service: str) -> str:
    return f"{service_prefix(service)}students/"


def autoscaler_prefix(service: str) -> str:
    """Reserved for the autoscaler's state; nothing in ``discovery`` reads or writes it."""
    return f"{service_prefix(service)}autoscaler/"


def teacher_key(service: str, instance_id: str) -> str:
    return f"{teachers_prefix(service)}{validate_name('teacher instance_id', instance_id)}"


def load_key(service: str, instance_id: str) -> str:
    return f"{load_prefix(service)}{validate_name('teacher instance_id', instance_id)}"


def student_key(service: str, student_id: str) -> str:
    return f"{students_prefix(service)}{validate_name('student_id', student_id)}"


def split_key(service: str, key: str | bytes) -> tuple[Kind, str] | None:
    """``(kind, name)`` for a key of ``service`` (``("teachers", "t1")``), or None if it is not one.

    Keys with extra segments below a name are not ours and give None.
    """
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError:
            return None
    prefix = service_prefix(service)
    if not key.startswith(prefix):
        return None
    kind, sep, name = key[len(prefix) :].partition("/")
    if not sep or not name or "/" in name:
        return None
    for k in _KINDS:
        if k == kind:
            return k, name
    return None
