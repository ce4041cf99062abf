"""The student side of the distillation mesh.

A training job reads its batches through a reader that sends them to teacher servers (found from
a fixed list or the etcd registry), routes chunks to the least-loaded teacher, and yields each
batch with its teacher outputs; the KD losses here turn those outputs into a training signal;
``add_distill_args`` gives every script the same ``--distill_*`` flags; ``distill.autoscale``
keeps the teacher pool sized to the students' demand.
"""

from distill.errors import DistillError, NoTeacherError, ReaderClosedError, TeacherMismatchError
from distill.flags import add_distill_args, distill_options_from_args
from distill.losses import KDLoss, SparseTargets, average_teachers
from distill.reader import DistillReader
from distill.router import RouterConfig
from distill.stats import ReaderStats

__all__ = [
    "DistillError",
    "DistillReader",
    "KDLoss",
    "NoTeacherError",
    "ReaderClosedError",
    "ReaderStats",
    "RouterConfig",
    "SparseTargets",
    "TeacherMismatchError",
    "add_distill_args",
    "average_teachers",
    "distill_options_from_args",
]
