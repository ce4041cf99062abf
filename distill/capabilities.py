"""What a request needs of a teacher and what a teacher offers, so that a chunk goes only to
teachers that can answer it.

A teacher's registry record declares what it can compute (`TeacherRecord.capabilities`): the
widest top-k, the sequence's own token log-probs, scores of a per-position id set (SCORE_IDS), the
top-k's tail mass, whole outputs (dense LOGITS) rather than reductions of them. A vLLM engine, for
one, sends at most its `--max-logprobs` entries per position and never whole logits; a
teacher-server computes every transform its model allows. A record that declares nothing (an older
teacher-server, a teacher known only by a static host:port) is taken to offer everything its
metadata declares, as before capabilities existed; one that speaks an engine's protocol (a static
``vllm://`` or ``sglang://`` item) what every engine's protocol carries (`ENGINE`).

A request's needs follow from its request parameters (`top_k`, `token_logprobs`, `topk_tail`, by
their wire names), its auxiliary inputs (SCORE_IDS) and whether it sends texts (the TEXT input:
only a record declaring `text_prompts` takes those; a teacher that declares nothing takes them when
its metadata declares TEXT, `distill.teacher_state.TeacherState.can`); it needs
whole outputs when it asks for no derived output at all. `missing(offers, needs)` names each gap in
words ("top_k 64 > its max 20", "SCORE_IDS"). The router (`distill.router`) picks among the
teachers whose offers cover a chunk's needs; when no live teacher of the service covers them the
batch fails at once with `NoCapableTeacherError` (`unanswerable`).

The hot path pays a dict lookup: a request's needs are computed once per distinct parameter
mapping and SCORE_IDS presence (the reader reuses the same mapping for its whole life), a
teacher's offers once per registry record, and whether offers cover needs once per pair.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from distill.errors import BatchRejectedError
from distill.types import ChunkRequest, ParameterValue
from protos import outputs as declared_outputs
from protos.outputs import SCORE_IDS
from protos.text import TEXT

if TYPE_CHECKING:
    from protos import registry_pb2

__all__ = [
    "ALL",
    "ENGINE",
    "UNBOUNDED_TOP_K",
    "Needs",
    "NoCapableTeacherError",
    "Offers",
    "covers",
    "describe_needs",
    "describe_offers",
    "missing",
    "needs_of",
    "offers_of",
    "request_needs",
    "unanswerable",
]

UNBOUNDED_TOP_K = 2**31 - 1
"""`Offers.max_top_k` of a teacher whose top-k has no known bound (its classes' width is not declared)."""


class Needs(NamedTuple):
    """What one request asks a teacher to compute (a tuple: hashed and compared cheaply)."""

    top_k: int = 0  # entries per position, 0: no top-k
    token_logprobs: bool = False  # <OUT>_TOKEN_LOGPROBS
    tail: bool = False  # <OUT>_TOPK_TAIL, the mass outside the top-k
    score_ids: bool = False  # the SCORE_IDS input, <OUT>_SCORED_LOGPROBS
    full_outputs: bool = False  # the outputs whole: no derived output is asked for
    text: bool = False  # the TEXT input: texts scored in the teacher's own tokens (protos.text)


@dataclass(frozen=True)
class Offers:
    """What one teacher can compute, from its registry record (`offers_of`). The defaults are a
    teacher that declared nothing: everything. `complete`: it covers any needs (the router's
    shortcut)."""

    protocol: str = "kserve"
    declared: bool = False
    max_top_k: int = UNBOUNDED_TOP_K
    token_logprobs: bool = True
    score_ids: bool = True
    tail: bool = True
    full_outputs: bool = True
    chunked: bool = True
    text_prompts: bool = False
    complete: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "complete", self.max_top_k >= UNBOUNDED_TOP_K and self.token_logprobs
                           and self.score_ids and self.tail and self.full_outputs)


ALL = Offers()
"""The offers of a teacher that declares none: a teacher-server before capabilities, a static host:port."""

ENGINE = Offers(score_ids=False, full_outputs=False)
"""What an engine (vLLM, SGLang) offers when its record declares nothing (a static ``vllm://`` item):
its protocol carries the prompt's top-k log-probs, own log-probs and so their tail, never whole
logits nor scores of a given id set; its top-k bound (vLLM's ``--max-logprobs``) is not known here."""


def offers_of(record: registry_pb2.TeacherRecord | None) -> Offers:
    """A teacher's offers from its registry record: its declared capabilities, or everything when it
    declares none (`Capabilities.declared` false, or no record: a static host:port)."""
    if record is None:
        return ALL
    protocol = record.protocol or "kserve"
    caps = record.capabilities
    if not caps.declared:
        return ALL if protocol == "kserve" else dataclasses.replace(ENGINE, protocol=protocol)
    return Offers(protocol, True, caps.max_top_k, caps.token_logprobs, caps.score_ids, caps.tail,
                  caps.full_outputs, caps.chunked, caps.text_prompts)


# Needs by (id of the parameter mapping, SCORE_IDS sent); an entry keeps the mapping it was made
# from, so the id in its key stays that mapping's (as distill.teacher_client's `_expected`).
_NEEDS: dict[tuple[int, bool, bool], tuple[Mapping[str, ParameterValue], Needs]] = {}


def needs_of(parameters: Mapping[str, ParameterValue], inputs: Collection[str] = ()) -> Needs:
    """What a request with these request parameters (wire names) and inputs needs of a teacher."""
    scored = SCORE_IDS.name in inputs
    text = TEXT in inputs
    key = (id(parameters), scored, text)
    hit = _NEEDS.get(key)
    if hit is not None and hit[0] is parameters:
        return hit[1]
    top_k = int(parameters.get("top_k") or 0)
    sent = (SCORE_IDS.name,) if scored else ()
    derived = any(d.active(parameters, sent) for d in declared_outputs.DERIVED)
    needs = Needs(top_k, bool(parameters.get("token_logprobs")), top_k > 0 and bool(parameters.get("topk_tail")),
                  scored, not derived, text)
    if len(_NEEDS) >= 256:
        _NEEDS.clear()
    _NEEDS[key] = (parameters, needs)
    return needs


def request_needs(request: ChunkRequest) -> Needs:
    """What a `ChunkRequest` needs of the teacher that answers it."""
    return needs_of(request.parameters, request.inputs)


def _gaps(offers: Offers, needs: Needs) -> list[tuple[str, str]]:
    """(what, in words) for each need `offers` does not cover."""
    gaps = []
    if needs.top_k > offers.max_top_k:
        gaps.append(("top_k", f"top_k {needs.top_k} > its max {offers.max_top_k}" if offers.max_top_k else "top_k"))
    if needs.tail and not offers.tail:
        gaps.append(("tail", "topk_tail"))
    if needs.token_logprobs and not offers.token_logprobs:
        gaps.append(("token_logprobs", "token_logprobs"))
    if needs.score_ids and not offers.score_ids:
        gaps.append(("score_ids", SCORE_IDS.name))
    if needs.full_outputs and not offers.full_outputs:
        gaps.append(("full_outputs", "dense outputs"))
    if needs.text and not offers.text_prompts:
        gaps.append(("text", "text prompts"))
    return gaps


def missing(offers: Offers, needs: Needs) -> list[str]:
    """Each need `offers` does not cover, in words ("top_k 64 > its max 20", "SCORE_IDS"); [] when
    the teacher can answer."""
    return [words for _, words in _gaps(offers, needs)]


@functools.lru_cache(maxsize=4096)
def covers(offers: Offers, needs: Needs) -> bool:
    """Whether a teacher with `offers` can answer a request with `needs` (cached per pair)."""
    return (offers.complete and not needs.text) or not _gaps(offers, needs)


def describe_needs(needs: Needs) -> str:
    """A request's needs in words: "top_k 64, token_logprobs, SCORE_IDS"."""
    parts = [f"top_k {needs.top_k}"] if needs.top_k else []
    parts += [name for name, on in (("topk_tail", needs.tail), ("token_logprobs", needs.token_logprobs),
                                    (SCORE_IDS.name, needs.score_ids), ("dense outputs", needs.full_outputs),
                                    ("text prompts", needs.text)) if on]
    return ", ".join(parts) or "nothing beyond its model"


def describe_offers(offers: Offers) -> str:
    """A teacher's offers in words: "vllm: top_k<=20, token_logprobs"."""
    if not offers.declared and offers.complete:
        return f"{offers.protocol}: everything its metadata declares (no capabilities declared)"
    parts = []
    if offers.max_top_k >= UNBOUNDED_TOP_K:
        parts.append("top_k")
    elif offers.max_top_k:
        parts.append(f"top_k<={offers.max_top_k}")
    parts += [name for name, on in (("topk_tail", offers.tail), ("token_logprobs", offers.token_logprobs),
                                    (SCORE_IDS.name, offers.score_ids), ("dense outputs", offers.full_outputs),
                                    ("text prompts", offers.text_prompts)) if on]
    return f"{offers.protocol}: {', '.join(parts) or 'nothing'}"


class NoCapableTeacherError(BatchRejectedError):
    """No live teacher of the service can compute what this batch asks for (a top-k wider than any
    teacher's, token log-probs, SCORE_IDS, dense outputs from an engine that sends only log-probs),
    as their registry records declare (`TeacherRecord.capabilities`). Raised at once, not after a
    timeout: waiting does not give a teacher a capability. Only this batch is lost, like any
    `BatchRejectedError`: catch it around ``next()`` (or the future of ``submit``) to go on, or
    start a teacher that offers what is missing. The message names what is missing and what each
    teacher offers; `missing` holds the gaps no teacher covers ("SCORE_IDS", "top_k 64"), `service`
    the teacher service asked."""

    def __init__(self, message: str, *, service: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.service = service
        self.missing = missing


def unanswerable(service: str, chunk: Any, needs: Needs, teachers: Iterable[Any],
                 waited_s: float | None = None) -> NoCapableTeacherError | None:
    """The error for `chunk` (a `distill.batches.Chunk`) when none of `teachers` (the router's
    records of the service's members: `distill.teacher_state.TeacherState`) that are live can answer
    `needs`; None when one can, or when none is live (then it is the no-teacher case). `waited_s`:
    teachers that can answer are live, but none was usable for that long (ejected, while only
    teachers that cannot were usable): the error says so."""
    live = [t for t in teachers if not t.removed and t.incompatible is None]
    capable = [t for t in live if t.can(needs)]
    if not live or (capable and waited_s is None):
        return None
    what = f"batch {chunk.job.seq} of this pass (rows {chunk.start}..{chunk.stop - 1})"
    listed = ", ".join(f"{t.endpoint} ({describe_offers(t.offers)})" for t in live[:8])
    if len(live) > 8:
        listed += f", and {len(live) - 8} more"
    if capable:
        states = ", ".join(t.describe() for t in capable[:4])
        return NoCapableTeacherError(
            f"service {service!r}: {what} needs {describe_needs(needs)}; the teachers that offer it were not "
            f"usable for {waited_s:g} s ({states}); teachers of service {service!r}: {listed}. Only this batch "
            "is lost: check those teachers, or catch BatchRejectedError around next() to skip such batches.",
            service=service, missing=())
    per_teacher = [dict(_gaps(t.offers, needs)) for t in live]
    common = [kind for kind in per_teacher[0] if all(kind in gaps for gaps in per_teacher)]
    gone = tuple(f"top_k {needs.top_k}" if kind == "top_k" else per_teacher[0][kind] for kind in common)
    summary = (f"none offers {', '.join(gone)}" if gone else
               "each lacks part of it: " + "; ".join(f"{t.endpoint} lacks {', '.join(gaps.values())}"
                                                     for t, gaps in zip(live[:8], per_teacher, strict=False)))
    return NoCapableTeacherError(
        f"service {service!r}: no teacher can answer {what}: it needs {describe_needs(needs)}; teachers of "
        f"service {service!r}: {listed}; {summary}. Only this batch is lost: start a teacher that offers it "
        "(a teacher-server computes every transform its model allows), or ask for less (a smaller top_k, no "
        "token_logprobs or SCORE_IDS).",
        service=service, missing=gone)
