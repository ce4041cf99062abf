"""Deterministic subsetting: which ``k`` teachers one student uses.

Why: with 1,000 students and 100 teachers, every student connecting to every teacher means
100,000 channels and each teacher juggling 1,000 clients. Each student instead uses ``k`` teachers
chosen by rendezvous (highest-random-weight) hashing:

* deterministic: the same student and teacher set always give the same subset, in every process
  and on every machine (``hashlib.blake2b``, not Python's per-process salted ``hash()``);
* balanced: over many students every teacher is picked about equally often;
* stable: a teacher joining or leaving changes at most one member of any student's subset, so
  students do not reshuffle their connections when the pool changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["rendezvous_weight", "subset"]


def rendezvous_weight(student_id: str, teacher: str) -> int:
    """The 64-bit weight of ``teacher`` for ``student_id``; higher wins."""
    h = hashlib.blake2b(digest_size=8)
    h.update(student_id.encode("utf-8"))
    h.update(b"\x00")  # separator: ("ab", "c") and ("a", "bc") must differ
    h.update(teacher.encode("utf-8"))
    return int.from_bytes(h.digest(), "big")


def subset(student_id: str, teachers: Iterable[str], k: int) -> list[str]:
    """The ``k`` teachers (all of them if there are fewer) with the highest rendezvous weight for
    ``student_id``, highest first. Duplicates in ``teachers`` count once. ``k`` must be >= 0."""
    if k < 0:
        raise ValueError(f"k must be >= 0, not {k}")
    unique = set(teachers)
    ranked = sorted(unique, key=lambda t: (rendezvous_weight(student_id, t), t), reverse=True)
    return ranked[:k]
