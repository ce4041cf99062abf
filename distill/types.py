"""The messages of the student side, at the bottom of ``distill`` so that every layer imports them
downward (vLLM v1 keeps its engine's message types below both client and core the same way).

* `FieldArray`: one teacher input of one batch, as the loader thread made it (contiguous numpy).
* `TensorMeta` / `TeacherMetadata`: what a teacher declares it serves.
* `ChunkRequest`: rows of one batch for one teacher, the outputs to fetch and the transforms to
  ask for; the client turns it into a ModelInfer and checks the answer against it.
* `StoredRows` / `OutputCache`: the small interface through which a batch's delivery reaches a
  teacher-output store (``distill.cache.reader_side`` implements it), so nothing above this module
  knows how a store is laid out.

Nothing here imports another module of ``distill``, nor numpy, torch or protobuf at run time, so
``distill --help`` (whose ``record`` flags come from the options) starts without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the libraries' types only: importing the options (and the flags) stays cheap
    import numpy as np
    import torch

    from protos import registry_pb2

__all__ = [
    "ChunkRequest",
    "FieldArray",
    "OutputCache",
    "ParameterValue",
    "Signature",
    "StoredRows",
    "TeacherMetadata",
    "TensorMeta",
]

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]
"""A batch's teacher inputs as (name, datatype, per-sample shape)."""

ParameterValue = bool | int | float | str
"""A request parameter's value; its Python type picks the KServe parameter kind (bool, int64,
double, string)."""


@dataclass(frozen=True)
class FieldArray:
    """One teacher input of one batch: a contiguous array and its wire datatype."""

    array: np.ndarray
    datatype: str

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape[1:])


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch dimension

    def accepts(self, datatype: str, shape: tuple[int, ...]) -> bool:
        return datatype == self.datatype and len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )


@dataclass(frozen=True)
class TeacherMetadata:
    """What a student must know to call a teacher: model, batch limit, tensors, and whether it
    batches padded rows by length (`protos.kserve.BY_LENGTH_PARAMETER`: the router then keeps
    requests in flight to it however their latency moves), and its fingerprint (a digest of its
    weights, config, tokenizer and compute dtype, `protos.kserve.FINGERPRINT_PARAMETER`; "" when
    the teacher does not say): replicas with different fingerprints are different teachers."""

    model_name: str
    model_version: str
    max_batch_size: int
    inputs: dict[str, TensorMeta]
    outputs: dict[str, TensorMeta]
    batches_by_length: bool = False
    fingerprint: str = ""

    @classmethod
    def from_record(cls, rec: registry_pb2.TeacherRecord) -> TeacherMetadata | None:
        """From a registry record; None when the record lacks the model facts (static lists)."""
        if not rec.model_name or not rec.inputs:
            return None
        return cls(
            rec.model_name, rec.model_version, rec.max_batch_size,
            {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in rec.inputs},
            {t.name: TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in rec.outputs},
            rec.batches_by_length, rec.fingerprint,
        )


_NO_DECLARED: Mapping[str, TensorMeta] = {}


class ChunkRequest:
    """Rows [start, stop) of one batch's inputs for one teacher, which outputs to fetch, and the
    request parameters that ask for output transforms.

    ``parameters`` maps a parameter's wire name to its value (``{"top_k": 0, "logprobs": True}``);
    the reader computes it once from its options (``ReaderOptions.request_parameters``). Keyword
    arguments beyond the named ones are parameters too (``top_k=8``); a None value is not sent.
    ``declared`` is the teacher's metadata for its outputs: every answer is checked against it.
    ``owned``: the answer's tensors become the batch's own as they are, so a client returns tensors
    nothing else holds or writes (not views of a response buffer); without it, views are fine.
    ``pieces``: a request for several batches' rows (``distill.bundles``), each ``(inputs, start,
    stop)`` with the same input shapes; ``inputs`` is then the first's (its names, datatypes and
    sample shapes), rows ``0..stop`` count them all, and ``rows(name)`` or the wire encoder joins them.
    A plain slotted class, not a dataclass: one is built per chunk on the engine's hot path.
    """

    __slots__ = ("declared", "inputs", "model_name", "model_version", "outputs", "owned", "parameters",
                 "pieces", "request_id", "start", "stop")

    def __init__(self, model_name: str, model_version: str, request_id: str,  # noqa: PLR0917 (the dataclass's order)
                 inputs: Mapping[str, FieldArray],
                 start: int, stop: int, outputs: tuple[str, ...],
                 declared: Mapping[str, TensorMeta] | None = None,
                 parameters: Mapping[str, ParameterValue] | None = None, owned: bool = False,
                 pieces: tuple[tuple[Mapping[str, FieldArray], int, int], ...] | None = None,
                 **transforms: ParameterValue | None) -> None:
        self.owned = owned
        self.pieces = pieces
        self.model_name = model_name
        self.model_version = model_version
        self.request_id = request_id
        self.inputs = inputs  # the whole batch; the request carries rows start..stop
        self.start = start
        self.stop = stop
        self.outputs = outputs
        self.declared = _NO_DECLARED if declared is None else declared
        if transforms:
            merged = dict(parameters or {})
            merged.update({k: v for k, v in transforms.items() if v is not None})
            parameters = merged
        self.parameters: Mapping[str, ParameterValue] = parameters if parameters is not None else {}

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def parts(self) -> tuple[tuple[Mapping[str, FieldArray], int, int], ...]:
        """Where the request's rows are, in order: its `pieces`, or rows start..stop of `inputs`."""
        return self.pieces if self.pieces is not None else ((self.inputs, self.start, self.stop),)

    def rows(self, name: str) -> np.ndarray:
        """Input `name`'s rows of this request: a view of the batch's array, or for several batches'
        pieces a new array of them in order (for clients that do not stream them to the wire)."""
        if self.pieces is None:
            return self.inputs[name].array[self.start:self.stop]
        import numpy

        return numpy.concatenate([inputs[name].array[a:b] for inputs, a, b in self.pieces])

    def __repr__(self) -> str:
        return (f"ChunkRequest({self.model_name!r}, {self.request_id!r}, rows {self.start}..{self.stop}, "
                f"outputs={self.outputs}, parameters={dict(self.parameters)})")


class StoredRows(Protocol):
    """What a teacher-output store held for one batch (``distill.cache.reader_side.CachedRows``)."""

    @property
    def outputs(self) -> Mapping[str, torch.Tensor]:
        """The stored rows' outputs (the hits, in batch order)."""

    @property
    def all_hit(self) -> bool: ...

    @property
    def miss_indices(self) -> np.ndarray:
        """Rows of the batch the store lacks: the rows that go to a teacher."""

    @property
    def hit_indices(self) -> np.ndarray: ...

    def fit(self, name: str, answer: torch.Tensor) -> torch.Tensor:
        """The stored rows of output `name`, shaped like a teacher's `answer` for the other rows."""

    def missing_keys(self) -> Any:
        """The sample keys of the missing rows (what a teacher's answer is stored under)."""


class OutputCache(Protocol):
    """A teacher-output store as the reader's engine and a batch's delivery use it."""

    @property
    def mode(self) -> str:
        """``read``, ``write`` or ``read_write`` (see ``ReaderOptions.cache_mode``)."""

    def rows_to_send(self, batch: Any, size: int, fields: dict[str, FieldArray]
                     ) -> tuple[dict[str, FieldArray], StoredRows]:
        """On the loader thread: the inputs of the rows a teacher must answer, and what is stored."""

    def write_back(self, keys: Any, outputs: Mapping[str, torch.Tensor]) -> None:
        """On the event loop, never blocking: store the teachers' rows of a completed batch."""

    def seal(self) -> None:
        """The pass ended: make what was written readable by the next pass (never blocking)."""

    def miss_error(self, rows: StoredRows, seq: int) -> Exception:
        """The error for batch `seq`, which has rows missing and no teacher to ask."""

    def counters(self) -> dict[str, int]:
        """What ``reader.stats()`` shows of the store."""

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued and release the store (blocking: off the event loop)."""
