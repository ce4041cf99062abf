"""The teachers one `distill gateway` serves: `--teacher NAME=SPEC`, each a `TeacherSpec`.

    distill gateway --teacher math=etcd://10.0.0.5:2379/math-svc --teacher code=10.0.0.7:9898,10.0.0.8:9898

NAME is what a request's `model` names and the teacher's own base URL (`/teachers/NAME`); SPEC is
where its servers are: a registry service (`etcd://HOST:PORT[,HOST:PORT]/SERVICE`) or a fixed
list (`HOST:PORT[,HOST:PORT]`). Parsed without importing the reader (``distill --help`` stays quick).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distill.checks import registry_address, service_name, teacher_list

__all__ = ["TEACHER_FORM", "TeacherSpec", "teacher_spec"]

TEACHER_FORM = "NAME=etcd://HOST:PORT/SERVICE or NAME=HOST:PORT[,HOST:PORT]"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A teacher's name: one URL path segment and an OpenAI model id, so letters, digits, `.`, `_`, `-`."""


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher behind the gateway: `name` (the `model` requests name; its base URL is
    `/teachers/NAME`) and exactly one of `teachers` (a fixed list) and `registry` + `service`."""

    name: str
    teachers: str | None = None
    registry: str | None = None
    service: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"teacher name {self.name!r}: use letters, digits, '.', '_' or '-' (at most 128, "
                             "starting with a letter or digit): it is a URL path segment and a model id")
        if (self.teachers is None) == (self.registry is None) or (self.registry is None) != (self.service is None):
            raise ValueError(f"teacher {self.name!r} needs exactly one of a teacher list and a registry with a "
                             f"service ({TEACHER_FORM})")

    @property
    def where(self) -> str:
        """Where its servers are, as messages say it."""
        return f"service {self.service!r} in {self.registry}" if self.registry else f"teachers {self.teachers}"


def teacher_spec(text: str) -> TeacherSpec:
    """`--teacher NAME=SPEC` read into a TeacherSpec; ValueError says the accepted forms."""
    name, sep, spec = text.strip().partition("=")
    if not sep or not name.strip() or not spec.strip():
        raise ValueError(f"bad --teacher {text!r}: expected {TEACHER_FORM}")
    name, spec = name.strip(), spec.strip()
    if spec.lower().startswith("etcd://"):
        address, slash, service = spec[len("etcd://"):].partition("/")
        if not slash or not service.strip("/"):
            raise ValueError(f"--teacher {name}={spec}: name the service the teachers register under after the "
                             f"address (etcd://HOST:PORT/SERVICE)")
        return TeacherSpec(name, registry=registry_address("etcd://" + address),
                           service=service_name(service.strip("/")))
    return TeacherSpec(name, teachers=teacher_list(spec))
