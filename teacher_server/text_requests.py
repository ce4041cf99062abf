"""Text requests: a teacher with a tokenizer scores text in its own tokens, over KServe v2.

A request sends input `TEXT` (BYTES `[B, 1]`, one UTF-8 string per row) in place of the token ids
and the attention mask (`protos.text`). `TextRequests.prepare` tokenizes the rows with the teacher's
own tokenizer (`teacher_server.tokenizer`, one worker-thread call per request), pads them on the
right to the longest tokenization T, and hands the lifecycle the ids request the rest of the path
already serves: validation, answer size, rows, the batcher (which sees only ids, so text and id
requests of different clients share batches) and the transforms are unchanged. Its answer gains,
before the model's outputs and as asked:

* `TEXT_IDS` INT64 `[B, T]`: the teacher's ids, the tokenizer's specials included, padded with the
  tokenizer's pad id (else the model's pad value);
* `TEXT_SPANS` INT32 `[B, T, 2]`: each token's byte span in its row's UTF-8 text by the one rule of
  `teacher_server.text_spans` (exact with the vocabulary's pieces), (-1, -1) for tokens the
  tokenizer added and for padding;
* `TEXT_MASK` INT8 `[B, T]`: 1 for the row's tokens, 0 for padding.

The model's outputs are those of the same ids sent as `INPUT_IDS` with their mask. A request asking
only text outputs is answered without the model. `VOCAB_IDS` (INT64 `[N, 1]`) is answered with
`VOCAB_PIECES` (BYTES `[N, 1]`: each id's piece, `teacher_server.vocab_pieces`, empty for an id with
none) from a table built once, without the batcher.

Refusals (`InvalidRequestError`): no tokenizer (saying what the directory needs), a row that is not
UTF-8 or is empty, a text longer than the model's context once tokenized, TEXT beside the ids,
datatypes and shapes other than the above, VOCAB_IDS outside the vocabulary.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protos.kserve import DATATYPES, shape_numel
from protos.text import (
    OPTIONAL_INPUTS,
    TEXT,
    TEXT_IDS,
    TEXT_INPUTS,
    TEXT_MASK,
    TEXT_OUTPUTS,
    TEXT_SPANS,
    VOCAB_IDS,
    VOCAB_PIECES,
    TensorDecl,
    decode_bytes,
    encode_bytes,
    gather_bytes,
)
from teacher_server.errors import InvalidRequestError, echo
from teacher_server.infer_request import InferRequest, InputTensor, RawBuffer, RequestedOutput
from teacher_server.outputs import EncodedOutput
from teacher_server.spec import ModelIO
from teacher_server.text_spans import byte_spans
from teacher_server.tokenizer import Tokenizer
from teacher_server.transform_checks import token_input
from teacher_server.vocab_pieces import vocab_pieces

__all__ = ["TextPlan", "TextRequests", "text_scoreable", "text_tensors"]

_TEXT_OUTPUTS = (TEXT_IDS, TEXT_SPANS, TEXT_MASK)


def text_scoreable(io: ModelIO) -> bool:
    """Whether a model with these tensors can score text: a padded token input and an attention
    mask to send the tokenized rows as (an hf: causal LM)."""
    return token_input(io) is not None and io.attention_mask is not None


def text_tensors(text_prompts: bool) -> tuple[tuple[TensorDecl, ...], tuple[TensorDecl, ...]]:
    """The optional inputs and the outputs a server declares besides its model's (none without text)."""
    return (TEXT_INPUTS, TEXT_OUTPUTS) if text_prompts else ((), ())


@dataclass(frozen=True)
class TextPlan:
    """What the lifecycle does with a text or vocabulary request: run `request` (the ids request)
    and put `outputs` (the text outputs) before its answer, or, when `request` is None, answer
    `outputs` as they are."""

    request: InferRequest | None
    outputs: list[EncodedOutput]
    batch_size: int

    def answer(self, model_outputs: list[EncodedOutput]) -> list[EncodedOutput]:
        return [*self.outputs, *model_outputs]


@dataclass(frozen=True)
class _Vocab:
    """Every id's piece, serialised once as BYTES elements in one buffer, and as objects for spans."""

    blob: np.ndarray  # uint8: the serialised elements, id order
    starts: np.ndarray  # int64 [V]: where id i's element (length prefix included) starts in blob
    ends: np.ndarray
    pieces: np.ndarray  # object [V]: bytes or None

    @classmethod
    def of(cls, tokenizer: Any) -> _Vocab:
        pieces = vocab_pieces(tokenizer)
        sizes = np.fromiter((4 + len(p or b"") for p in pieces), dtype=np.int64, count=len(pieces))
        ends = np.cumsum(sizes)
        blob = np.frombuffer(encode_bytes([p or b"" for p in pieces]), dtype=np.uint8)
        table = np.empty(len(pieces), dtype=object)
        table[:] = pieces
        return cls(blob, ends - sizes, ends, table)


@dataclass(frozen=True)
class _Tokenized:
    ids: np.ndarray  # int64 [B, T]
    spans: np.ndarray  # int32 [B, T, 2]
    mask: np.ndarray  # int8 [B, T]
    lengths: np.ndarray  # int64 [B]


class TextRequests:
    """The text path of one served model: its tokenizer (shared with the vLLM routes) and its
    vocabulary table. `load()` once at start decides `available` (the `text_prompts` capability)."""

    def __init__(self, source: str) -> None:
        self.tokenizer = Tokenizer(source)
        self._vocab: _Vocab | None = None
        self._lock = asyncio.Lock()

    @property
    def available(self) -> bool:
        """Whether text requests are served (the tokenizer loaded); False before `load()`."""
        return self._vocab is not None

    async def load(self) -> bool:
        """Load the tokenizer and build the vocabulary table (off the event loop, once)."""
        if self._vocab is None:
            async with self._lock:
                tokenizer = await self.tokenizer.get()
                if tokenizer is not None and self._vocab is None:
                    self._vocab = await asyncio.to_thread(_Vocab.of, tokenizer)
        return self._vocab is not None

    @staticmethod
    def applies(request: InferRequest, io: ModelIO) -> bool:
        """Whether `request` sends TEXT or VOCAB_IDS (and the model has no input of that name itself)."""
        return any(t.name in OPTIONAL_INPUTS and io.input(t.name) is None for t in request.inputs)

    def _refuse_unavailable(self, name: str) -> None:
        if self._vocab is None:
            raise InvalidRequestError(
                f"input {name!r}: text requests need the teacher's tokenizer, and {self.tokenizer.why_not}; "
                "send token ids (INPUT_IDS) instead")

    async def prepare(self, request: InferRequest, io: ModelIO, max_batch_size: int,
                      max_answer_bytes: int = 0) -> TextPlan:
        """The plan for a request that `applies`; InvalidRequestError saying what is wrong with it.
        `max_answer_bytes` bounds a vocabulary answer (0: no bound); the lifecycle bounds the rest."""
        await self.load()
        names = [t.name for t in request.inputs]
        if VOCAB_IDS in names:
            self._refuse_unavailable(VOCAB_IDS)
            if len(names) != 1:
                raise InvalidRequestError(f"input {VOCAB_IDS!r} comes alone (it asks the vocabulary); this request "
                                          f"also sends {[n for n in names if n != VOCAB_IDS]}")
            plan = self._vocabulary(request, io)
            size = sum(len(raw) for *_, raw in plan.outputs)
            if max_answer_bytes and size > max_answer_bytes:
                raise InvalidRequestError(
                    f"the answer would be {size:,} bytes of {VOCAB_PIECES}, over the teacher's limit of "
                    f"{max_answer_bytes:,} bytes a message; ask fewer {VOCAB_IDS} per request")
            return plan
        self._refuse_unavailable(TEXT)
        index = token_input(io)
        if index is None or io.attention_mask is None:
            raise InvalidRequestError(f"input {TEXT!r}: this model has no padded token input to score text with")
        ids_spec = io.inputs[index]
        both = [n for n in names if n in (ids_spec.name, io.attention_mask)]
        if both:
            raise InvalidRequestError(f"input {TEXT!r} comes in place of {ids_spec.name!r} and {io.attention_mask!r}; "
                                      f"this request also sends {both}: send the text or the ids, not both")
        texts = _texts(request, names.index(TEXT), max_batch_size)
        wanted_text, model_outputs = _split_outputs(request.outputs)
        assert self._vocab is not None
        tokenized = await asyncio.to_thread(self._tokenize, texts, ids_spec.pad_value)
        if ids_spec.max_length is not None and int(tokenized.lengths.max()) > ids_spec.max_length:
            row = int(np.argmax(tokenized.lengths > ids_spec.max_length))
            count = int(tokenized.lengths[row])
            raise InvalidRequestError(
                f"input {TEXT!r}: row {row} is {count} tokens once tokenized, over the model's context of "
                f"{ids_spec.max_length} positions; send shorter texts (at most {ids_spec.max_length} tokens each)",
                {"kind": "context", "input": TEXT, "value": count, "limit": ids_spec.max_length, "index": [row]})
        b, t = tokenized.ids.shape
        encoded: dict[str, EncodedOutput] = {
            TEXT_IDS: (TEXT_IDS, "INT64", [b, t], tokenized.ids.tobytes()),
            TEXT_SPANS: (TEXT_SPANS, "INT32", [b, t, 2], tokenized.spans.tobytes()),
            TEXT_MASK: (TEXT_MASK, "INT8", [b, t], tokenized.mask.tobytes())}
        outputs = [encoded[n] for n in wanted_text]
        if request.outputs and not model_outputs:
            return TextPlan(None, outputs, b)
        mask_spec = io.input(io.attention_mask)
        assert mask_spec is not None
        inputs = [InputTensor(ids_spec.name, ids_spec.datatype, [b, t]),
                  InputTensor(mask_spec.name, mask_spec.datatype, [b, t])]
        raws: list[RawBuffer] = [_as(tokenized.ids, ids_spec.datatype), _as(tokenized.mask, mask_spec.datatype)]
        for i, other in enumerate(request.inputs):  # SCORE_IDS and any other input pass through
            if other.name != TEXT:
                inputs.append(InputTensor(other.name, other.datatype, other.shape, (), other.parameters))
                raws.append(request.raw_inputs[i] if request.raw_inputs else _typed_raw(other))
        ids_request = InferRequest(request.model_name, request.model_version, request.id, inputs, model_outputs,
                                   request.parameters, raws)
        return TextPlan(ids_request, outputs, b)

    def _tokenize(self, texts: list[str], pad_value: float | None) -> _Tokenized:
        """Ids, spans and mask of every row, padded to the longest (on a worker thread)."""
        assert self._vocab is not None
        ids, offsets, special = self.tokenizer.tokenize(texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        width = max(int(lengths.max()), 1)
        real = np.arange(width)[None, :] < lengths[:, None]
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        pad = self.tokenizer.pad_id()
        padded = np.full((len(ids), width), pad if pad is not None else int(pad_value or 0), dtype=np.int64)
        padded[real] = flat
        spans = np.full((len(ids), width, 2), -1, dtype=np.int32)
        in_vocab = flat[(flat >= 0) & (flat < len(self._vocab.pieces))]
        rows: list[np.ndarray | None] = [None] * len(ids)
        if in_vocab.size == flat.size:  # ids past the table (a model wider than its tokenizer) go by offsets
            rows = list(np.split(self._vocab.pieces[flat], np.cumsum(lengths)[:-1]))
        spans[real] = np.concatenate([byte_spans(text, offs, marks, None if p is None else p.tolist())
                                      for text, offs, marks, p in zip(texts, offsets, special, rows, strict=True)])
        return _Tokenized(padded, spans, real.astype(np.int8), lengths)

    def _vocabulary(self, request: InferRequest, io: ModelIO) -> TextPlan:
        """VOCAB_PIECES of the ids asked, gathered from the table (no model, no batcher)."""
        assert self._vocab is not None
        t = request.inputs[0]
        shape = list(t.shape) if len(t.shape) == 2 else None
        if t.datatype != "INT64" or shape is None or shape[1] != 1 or shape[0] < 1:
            raise InvalidRequestError(f"input {VOCAB_IDS!r}: {echo(t.datatype)} {_shape(t.shape)} received; send "
                                      "INT64 [N, 1] (N >= 1), the ids whose pieces you want")
        for o in request.outputs:
            if o.name != VOCAB_PIECES:
                raise InvalidRequestError(f"output {echo(o.name)}: a {VOCAB_IDS} request answers {VOCAB_PIECES} only")
        n = shape[0]
        if request.raw_inputs:
            raw = request.raw_inputs[0]
            if len(raw) != n * 8:
                raise InvalidRequestError(f"input {VOCAB_IDS!r}: {len(raw)} bytes received, shape {shape} of INT64 "
                                          f"needs {n * 8}")
            wanted = np.frombuffer(raw, dtype="<i8")
        else:
            try:
                wanted = np.asarray(t.values, dtype=np.int64).reshape(n)
            except (ValueError, TypeError):
                raise InvalidRequestError(f"input {VOCAB_IDS!r}: {n} INT64 values expected") from None
        size = len(self._vocab.pieces)
        index = token_input(io)
        limit = max(size, (io.inputs[index].max_value or 0) if index is not None else 0)
        bad = np.flatnonzero((wanted < 0) | (wanted >= limit))
        if bad.size:
            row = int(bad[0])
            raise InvalidRequestError(
                f"input {VOCAB_IDS!r}: id {int(wanted[row])} at row {row} is outside the vocabulary of {limit} "
                f"(ids must be in 0..{limit - 1})",
                {"kind": "vocabulary", "input": VOCAB_IDS, "value": int(wanted[row]), "limit": limit, "index": [row]})
        known = np.minimum(wanted, size - 1)
        raw_out = gather_bytes(self._vocab.blob, self._vocab.starts, self._vocab.ends, known)
        if (wanted >= size).any():  # ids the model has and the tokenizer does not: empty pieces
            items = decode_bytes(raw_out, n)
            raw_out = encode_bytes([b"" if w >= size else p for w, p in zip(wanted.tolist(), items, strict=True)])
        return TextPlan(None, [(VOCAB_PIECES, "BYTES", [n, 1], raw_out)], n)


def _texts(request: InferRequest, i: int, max_batch_size: int) -> list[str]:
    """The TEXT rows as strings; InvalidRequestError naming the datatype, shape or row at fault."""
    t = request.inputs[i]
    shape = list(t.shape) if len(t.shape) == 2 else None
    if t.datatype != "BYTES" or shape is None or shape[1] != 1 or shape[0] < 1:
        raise InvalidRequestError(f"input {TEXT!r}: {echo(t.datatype)} {_shape(t.shape)} received; send BYTES "
                                  "[B, 1], one UTF-8 string per row")
    b = shape[0]
    if b > max_batch_size:
        raise InvalidRequestError(f"input {TEXT!r}: batch size {b} exceeds the model's max_batch_size {max_batch_size}")
    if request.raw_inputs:
        try:
            rows = decode_bytes(request.raw_inputs[i], b)
        except ValueError as e:
            raise InvalidRequestError(f"input {TEXT!r}: {e}") from None
    else:
        rows = [bytes(v) for v in t.values]
        if len(rows) != b:
            raise InvalidRequestError(f"input {TEXT!r}: {len(rows)} strings for shape {shape}; send one per row")
    texts = []
    for row, data in enumerate(rows):
        if not data:
            raise InvalidRequestError(f"input {TEXT!r}: row {row} is empty; send at least one character per row")
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"input {TEXT!r}: row {row} is not UTF-8 (byte {e.start}: {e.reason}); "
                                      "send each text encoded as UTF-8") from None
    return texts


def _split_outputs(outputs: Sequence[RequestedOutput]) -> tuple[list[str], list[RequestedOutput]]:
    """The text outputs asked (all three when the request names none) and the model's outputs asked."""
    if not outputs:
        return list(_TEXT_OUTPUTS), []
    for o in outputs:
        if o.name == VOCAB_PIECES:
            raise InvalidRequestError(f"output {VOCAB_PIECES!r} answers a {VOCAB_IDS} request, not a {TEXT} one")
    return [o.name for o in outputs if o.name in _TEXT_OUTPUTS], [o for o in outputs if o.name not in _TEXT_OUTPUTS]


def _as(values: np.ndarray, datatype: str) -> bytes:
    return values.astype(DATATYPES[datatype].numpy_dtype, copy=False).tobytes()


def _typed_raw(t: InputTensor) -> bytes:
    """The raw bytes of an input that came as typed values (validation checks its shape and datatype)."""
    dt = DATATYPES.get(t.datatype)
    if dt is None or dt.name == "BF16":
        raise InvalidRequestError(f"input {t.name!r}: datatype {echo(t.datatype)} cannot come beside {TEXT!r}")
    values = np.asarray(t.values, dtype=dt.numpy_dtype)
    if values.size != shape_numel(list(t.shape)):
        raise InvalidRequestError(f"input {t.name!r}: {values.size} values for shape {list(t.shape)}")
    return values.tobytes()


def _shape(shape: Sequence[int]) -> str:
    return str(list(shape)) if len(shape) <= 8 else f"({len(shape)} dimensions)"
