"""The map between a student's and a teacher's vocabularies: entries that stand for the same bytes.

GOLD's matched-vocabulary divergence compares the two next-token distributions on the entries both
vocabularies have. Entries are compared by their *piece* (`teacher_server.vocab_pieces`), the bytes
each stands for, not by their token strings (a byte-level BPE writes a space as ``Ġ``, a Metaspace
vocabulary as ``▁``: the same piece ``b" "``).

One piece may have several entries on a side (a SentencePiece vocabulary's ``A`` and its byte
fallback ``<0x41>``; an added token whose text is also a regular entry). The entries of one piece
form one *class*: a distribution's mass on a class is the sum over its entries, on each side. The
unmatched entries are those whose piece the other side lacks, entries with no piece (None: an id no
entry has) and entries with an empty piece; they take part in the divergences only through the
"rest" bin (the mass outside the matched classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VocabMap"]


@dataclass(frozen=True)
class VocabMap:
    """Matched classes of two vocabularies, as index tensors (CPU; `to` moves them).

    Attributes:
        student_class: int64 ``[V_student]``: each student id's class, -1 when unmatched.
        teacher_class: int64 ``[V_teacher]``: each teacher id's class, -1 when unmatched.
        student_ids, teacher_ids: int64 ``[P]``: every pair (student id, teacher id) whose pieces are
            equal and non-empty, in order of the teacher's id, then the student's.
        pieces: the piece of each class, indexed by class.
    """

    student_class: Tensor
    teacher_class: Tensor
    student_ids: Tensor
    teacher_ids: Tensor
    pieces: tuple[bytes, ...]

    @classmethod
    def from_pieces(cls, student: Sequence[bytes | None], teacher: Sequence[bytes | None]) -> VocabMap:
        """Build from both vocabularies' pieces (`vocab_pieces(tokenizer)` for the student, the
        teacher's ``VOCAB_PIECES`` or `vocab_pieces` of its tokenizer), indexed by id."""
        by_piece: dict[bytes, list[int]] = {}
        for i, piece in enumerate(student):
            if piece:
                by_piece.setdefault(bytes(piece), []).append(i)
        classes: dict[bytes, int] = {}
        teacher_class = [-1] * len(teacher)
        pairs_s: list[int] = []
        pairs_t: list[int] = []
        for j, piece in enumerate(teacher):
            if not piece:
                continue
            owners = by_piece.get(bytes(piece))
            if owners is None:
                continue
            teacher_class[j] = classes.setdefault(bytes(piece), len(classes))
            pairs_s.extend(owners)
            pairs_t.extend([j] * len(owners))
        student_class = [-1] * len(student)
        for piece, c in classes.items():
            for i in by_piece[piece]:
                student_class[i] = c
        return cls(torch.tensor(student_class, dtype=torch.int64), torch.tensor(teacher_class, dtype=torch.int64),
                   torch.tensor(pairs_s, dtype=torch.int64), torch.tensor(pairs_t, dtype=torch.int64),
                   tuple(classes))

    @property
    def num_classes(self) -> int:
        """The number of pieces both vocabularies have."""
        return len(self.pieces)

    @property
    def student_size(self) -> int:
        return int(self.student_class.numel())

    @property
    def teacher_size(self) -> int:
        return int(self.teacher_class.numel())

    def unmatched_student(self) -> Tensor:
        """The student ids with no teacher entry of the same piece."""
        return (self.student_class < 0).nonzero().squeeze(1)

    def unmatched_teacher(self) -> Tensor:
        """The teacher ids with no student entry of the same piece."""
        return (self.teacher_class < 0).nonzero().squeeze(1)

    def to(self, device: torch.device | str) -> VocabMap:
        """The same map with its tensors on `device`."""
        return VocabMap(self.student_class.to(device), self.teacher_class.to(device),
                        self.student_ids.to(device), self.teacher_ids.to(device), self.pieces)

    def same_piece(self, student_ids: Tensor, teacher_ids: Tensor) -> Tensor:
        """bool, elementwise: the student id and the teacher id stand for the same (non-empty) piece.
        Ids outside a vocabulary are never matched."""
        s_cls = _lookup(self.student_class, student_ids)
        t_cls = _lookup(self.teacher_class, teacher_ids)
        return (s_cls >= 0) & (s_cls == t_cls)

    def __repr__(self) -> str:
        return (f"VocabMap(classes={self.num_classes}, student={self.student_size} "
                f"({int(self.unmatched_student().numel())} unmatched), teacher={self.teacher_size} "
                f"({int(self.unmatched_teacher().numel())} unmatched))")


def _lookup(table: Tensor, ids: Tensor) -> Tensor:
    """``table[ids]``, -1 for ids outside the table."""
    t = table.to(ids.device)
    inside = (ids >= 0) & (ids < t.numel())
    got = t[torch.where(inside, ids, torch.zeros_like(ids)).long()] if t.numel() else torch.full_like(ids, -1)
    return torch.where(inside, got, torch.full_like(got, -1))
