"""On-policy distillation across tokenizers: the student's samples, scored by a teacher of another
tokenizer as text, as per-student-token advantages and top-k targets over the sampled tokens.

Per step the training loop hands `OnPolicyScorer` the ids it sampled (prompt + continuation, in the
student's tokens). The scorer turns each row into text, sends the texts through a reader
(`DistillReader(None, inputs=["TEXT"], ...)`), and, when the teacher has answered, aligns the
teacher's tokens with the *sampled* ids by bytes (`OnPolicyTargets`): the advantages of the sampled
tokens (`chunk_log_ratio`, `chunk_pg_loss`) and the GOLD/ULD targets (`CrossTokenizerLoss`), both
over the continuation's tokens only.

The text rule. A row's text is the bytes its sampled tokens stand for, joined: each token's piece
(`teacher_server.vocab_pieces`), and each token's span is where its piece lies in those bytes. It is
not the student's re-tokenization of ``tokenizer.decode(ids)``: that may split the text otherwise
than the student sampled it (a sampled ``"▁th" "e"`` re-tokenizes as ``"▁the"``), and the policy
gradient needs the log-probabilities of the tokens actually sampled. For a byte-level BPE the joined
pieces are exactly the decoded text; for a Metaspace tokenizer they keep the leading space the
decoder strips (the teacher scores what the tokens spell). Further rules:

* the tokenizer's special tokens (BOS, EOS, padding, ``<unk>``) and tokens with no or an empty
  piece stand for no bytes: span (-1, -1), in no chunk, never counted;
* positions where ``attention_mask`` is 0 are padding (either side of a row);
* bytes that are not UTF-8 (a byte-level student can sample half a character) become U+FFFD, one per
  byte: the token that holds such a byte spans that character's 3 bytes in the text, the others keep
  their bytes, so the spans still tile the text the teacher scores;
* a row whose tokens spell no bytes is refused (`SampleTextError`): a teacher cannot score an empty text.

The prompt's tokens are scored as context but never counted: a chunk counts only when all its
student tokens are sampled (``completion_mask``), so a chunk that straddles the prompt's end is left
out. Rows are the samples as given; the student's logits must be computed on the same ``ids``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from distill.crosstok.align import Alignment, align
from distill.crosstok.loss import CrossTokenizerLoss
from distill.crosstok.sampled import chunk_log_ratio, chunk_pg_loss, teacher_chunk_logprobs
from distill.crosstok.spans import TextTokens
from distill.crosstok.teacher import TeacherText
from distill.errors import BatchRejectedError
from teacher_server.text_spans import NO_SPAN
from teacher_server.vocab_pieces import vocab_pieces

__all__ = [
    "OnPolicyScorer",
    "OnPolicyTargets",
    "PendingTargets",
    "SampleTextError",
    "SampledTexts",
    "SamplesRefusedError",
    "sampled_texts",
    "targets_of",
]


class SampleTextError(ValueError):
    """The samples cannot be sent as text: bad shapes, or a row whose tokens spell no bytes (all
    special tokens or padding). Drop such rows, or keep at least one prompt token with text."""


class SamplesRefusedError(BatchRejectedError):
    """The teacher refused the texts of one step's samples (e.g. a text of more of its tokens than its
    context: sample fewer tokens). Only that step is lost; `texts` are what was sent, `reason` and
    `refusal` the teacher's words and facts (`BatchRejectedError`)."""

    def __init__(self, message: str, *, texts: Sequence[str], reason: str = "", refusal: Any = None) -> None:
        super().__init__(message, reason=reason, refusal=refusal)
        self.texts = list(texts)


@dataclass(frozen=True)
class SampledTexts:
    """The samples as texts: `texts` (one per row), `tokens` (the sampled ids as given, each token's
    byte span in its row's text, the attention mask as `mask`) and bool ``completion`` ``[B, T]``."""

    texts: list[str]
    tokens: TextTokens
    completion: Tensor


def _utf8(data: bytes) -> tuple[str, np.ndarray]:
    """(text, where): `data` as text, each byte that is not part of a UTF-8 character replaced by
    U+FFFD; ``where[o]`` is byte offset ``o`` of `data` in the text's UTF-8 (``len(data) + 1`` entries)."""
    try:
        return data.decode("utf-8"), np.arange(len(data) + 1, dtype=np.int64)
    except UnicodeDecodeError:
        pass
    n = len(data)
    where = np.empty(n + 1, dtype=np.int64)
    parts: list[str] = []
    i = pos = 0
    while i < n:
        lead = data[i]
        size = 1 if lead < 0x80 else 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else \
            4 if 0xF0 <= lead <= 0xF4 else 0
        char = None
        if size and i + size <= n:
            try:
                char = data[i:i + size].decode("utf-8")
            except UnicodeDecodeError:
                char = None
        if char is None:
            parts.append("\ufffd")
            where[i] = pos
            i, pos = i + 1, pos + 3
            continue
        where[i:i + size] = np.arange(pos, pos + size)
        parts.append(char)
        i, pos = i + size, pos + size
    where[n] = pos
    return "".join(parts), where


def _completion(ids: Tensor, mask: Tensor, prompt_length: Any, completion_mask: Tensor | None) -> Tensor:
    if (prompt_length is None) == (completion_mask is None):
        raise SampleTextError("give exactly one of prompt_length (the position where sampling began, per row "
                              "or for all) and completion_mask ([B, T], nonzero on the sampled tokens)")
    if completion_mask is not None:
        c = torch.as_tensor(completion_mask)
        if tuple(c.shape) != tuple(ids.shape):
            raise SampleTextError(f"completion_mask {tuple(c.shape)} must have the ids' shape {tuple(ids.shape)}")
        return (c.cpu() != 0) & (mask != 0)
    start = torch.as_tensor(prompt_length, dtype=torch.int64).reshape(-1, 1)
    if start.shape[0] not in (1, ids.shape[0]) or bool((start < 1).any()):
        raise SampleTextError(f"prompt_length must be one int >= 1 or one per row ({ids.shape[0]}), got "
                              f"{prompt_length!r}: the prompt keeps at least one token as the samples' context")
    return (torch.arange(ids.shape[1]).unsqueeze(0) >= start) & (mask != 0)


def sampled_texts(ids: Tensor, pieces: Sequence[bytes | None], special_ids: Sequence[int], *,
                  attention_mask: Tensor | None = None, prompt_length: Any = None,
                  completion_mask: Tensor | None = None) -> SampledTexts:
    """The samples `ids` ``[B, T]`` as texts by the module's text rule, with each sampled token's byte
    span; `pieces` the student vocabulary's (`vocab_pieces`), `special_ids` its special tokens'."""
    ids = torch.as_tensor(ids).cpu()
    if ids.dim() != 2 or ids.is_floating_point():
        raise SampleTextError(f"ids must be integer [B, T], got {ids.dtype} {tuple(ids.shape)}")
    mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).cpu()
    if tuple(mask.shape) != tuple(ids.shape):
        raise SampleTextError(f"attention_mask {tuple(mask.shape)} must have the ids' shape {tuple(ids.shape)}")
    completion = _completion(ids, mask, prompt_length, completion_mask)
    special = set(int(i) for i in special_ids)
    size = len(pieces)
    spans = np.full((*ids.shape, 2), NO_SPAN, dtype=np.int32)
    texts: list[str] = []
    for r, row in enumerate(ids.tolist()):
        data = bytearray()
        bounds: list[tuple[int, int, int]] = []
        for t, i in enumerate(row):
            piece = pieces[i] if 0 <= i < size and i not in special else None
            if not mask[r, t] or not piece:
                continue
            bounds.append((t, len(data), len(data) + len(piece)))
            data += piece
        if not data:
            raise SampleTextError(f"row {r}: its tokens spell no text (only special tokens or padding); a teacher "
                                  "cannot score an empty text: leave the row out")
        text, where = _utf8(bytes(data))
        for t, start, end in bounds:
            spans[r, t] = (where[start], where[end])
        texts.append(text)
    tokens = TextTokens(ids.to(torch.int64), torch.from_numpy(spans), (mask != 0).to(torch.int8))
    return SampledTexts(texts, tokens, completion)



@dataclass(frozen=True)
class OnPolicyTargets:
    """One step's targets: the samples (`samples`), the teacher's answer for their texts (`teacher`)
    and the byte alignment of the two (`alignment`). Every method takes the student's logits
    ``[B, T, V]`` computed on ``samples.tokens.ids`` and counts only the chunks whose student tokens
    are all sampled."""

    samples: SampledTexts
    teacher: TeacherText
    alignment: Alignment

    @property
    def counted(self) -> Tensor:
        """bool ``[B, C]``: the chunks the targets count (valid, all their student tokens sampled)."""
        return self.alignment.counted(self.samples.completion)

    def log_ratio(self, student_logits: Tensor, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """`chunk_log_ratio` over the sampled tokens: (``[B, T]`` per position ``t`` the value of token
        ``t + 1``, bool ``[B, T]`` the positions that count)."""
        return chunk_log_ratio(student_logits, self.samples.tokens.ids, self.teacher, self.alignment,
                               temperature=temperature, student_loss_mask=self.samples.completion)

    def advantages(self, student_logits: Tensor, *, temperature: float = 1.0) -> Tensor:
        """Detached ``[B, T]``: each sampled token's advantage ``-(log q(chunk) - log p(chunk)) / n``
        at the position before it (0 where not counted), what `pg_loss` weighs ``log q`` by."""
        ratio, keep = self.log_ratio(student_logits, temperature=temperature)
        return torch.where(keep, -ratio.detach(), torch.zeros_like(ratio))

    def pg_loss(self, student_logits: Tensor, *, temperature: float = 1.0, reduction: str = "token_mean") -> Tensor:
        """`chunk_pg_loss` over the sampled tokens."""
        return chunk_pg_loss(student_logits, self.samples.tokens.ids, self.teacher, self.alignment,
                             temperature=temperature, student_loss_mask=self.samples.completion, reduction=reduction)

    def kd_loss(self, student_logits: Tensor, loss: CrossTokenizerLoss) -> Tensor:
        """`loss` (GOLD/ULD on the teacher's top-k) over the sampled tokens' chunks."""
        return loss(student_logits, self.samples.tokens, self.teacher, self.alignment, self.samples.completion)

    def teacher_chunk_logprobs(self) -> Tensor:
        """``[B, C]``: the teacher's log-probability of each chunk given the text before it."""
        return teacher_chunk_logprobs(self.teacher, self.alignment)


def targets_of(samples: SampledTexts, outputs: Any, output: str = "LOGITS") -> OnPolicyTargets:
    """The targets of `samples` from the reader's outputs for their texts."""
    teacher = TeacherText.from_outputs(outputs, output)
    teacher.token_scores()  # refuses an answer without token log-probabilities, saying what to ask for
    return OnPolicyTargets(samples, teacher,
                           align(samples.tokens.spans, samples.tokens.mask, teacher.spans, teacher.mask))


class PendingTargets:
    """One submitted step: `result()` waits for the teacher's answer and aligns it on the caller's
    thread (never on the reader's)."""

    def __init__(self, samples: SampledTexts, future: concurrent.futures.Future[Any], output: str) -> None:
        self.samples, self._future, self._output = samples, future, output

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> OnPolicyTargets:
        """The step's targets. Raises SamplesRefusedError when the teacher refused the texts, the
        reader's errors otherwise (TimeoutError past the step's deadline, ReaderClosedError)."""
        try:
            outputs = self._future.result(timeout)
        except BatchRejectedError as e:
            if type(e) is not BatchRejectedError:  # the reader's own (no capable teacher, ...): as they are
                raise
            raise SamplesRefusedError(f"the teacher refused this step's sampled texts: {e}", texts=self.samples.texts,
                                      reason=e.reason, refusal=e.refusal) from e
        return targets_of(self.samples, outputs, self._output)


class OnPolicyScorer:
    """Scores a student's samples with a teacher of another tokenizer, one call per training step.

    Args:
        reader: a `DistillReader(None, ...)` whose ``inputs`` send the batch field `field` as the
            teacher input ``TEXT``, asking for ``TEXT_IDS``, ``TEXT_SPANS``, ``TEXT_MASK`` and `output`
            with ``token_logprobs=True`` (and ``top_k``, ``logprobs=True`` for `kd_loss`).
        tokenizer: the student's (a transformers tokenizer; its ``all_special_ids`` spell no text).
        pieces: the student vocabulary's pieces (default `vocab_pieces(tokenizer)`, read once).
        field: the batch field the reader sends as ``TEXT``.
        output: the teacher output whose top-k and token log-probabilities are read.
    """

    def __init__(self, reader: Any, tokenizer: Any, *, pieces: Sequence[bytes | None] | None = None,
                 field: str = "TEXT", output: str = "LOGITS") -> None:
        self.reader, self.field, self.output = reader, field, output
        self.pieces: list[bytes | None] = list(vocab_pieces(tokenizer) if pieces is None else pieces)
        self.special_ids = sorted(set(int(i) for i in getattr(tokenizer, "all_special_ids", ())))

    def texts(self, ids: Tensor, *, attention_mask: Tensor | None = None, prompt_length: Any = None,
              completion_mask: Tensor | None = None) -> SampledTexts:
        """`sampled_texts` with this student's pieces and specials."""
        return sampled_texts(ids, self.pieces, self.special_ids, attention_mask=attention_mask,
                             prompt_length=prompt_length, completion_mask=completion_mask)

    def submit(self, ids: Tensor, *, attention_mask: Tensor | None = None, prompt_length: Any = None,
               completion_mask: Tensor | None = None, deadline_s: float | None = None) -> PendingTargets:
        """Send the samples' texts now (never blocks; the reader's `SubmitLimitError` beyond its
        `prefetch`); give exactly one of `prompt_length` (int or one per row: the position where
        sampling began) and `completion_mask` (``[B, T]``, nonzero on the sampled tokens)."""
        samples = self.texts(ids, attention_mask=attention_mask, prompt_length=prompt_length,
                             completion_mask=completion_mask)
        return PendingTargets(samples, self.reader.submit({self.field: samples.texts}, deadline_s=deadline_s),
                              self.output)

    def score(self, ids: Tensor, *, attention_mask: Tensor | None = None, prompt_length: Any = None,
              completion_mask: Tensor | None = None, deadline_s: float | None = None) -> OnPolicyTargets:
        """``submit(...).result()``: the targets of this step's samples (staleness 0)."""
        return self.submit(ids, attention_mask=attention_mask, prompt_length=prompt_length,
                           completion_mask=completion_mask, deadline_s=deadline_s).result()
