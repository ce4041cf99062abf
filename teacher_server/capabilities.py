"""What a teacher-server can compute for its model, declared once for every place that says it:
its registry record (`TeacherRecord.capabilities`, read by students' routers:
`distill.capabilities`) and its ModelConfig (`CAPABILITIES_PARAMETER`, the JSON form of the same
message, which `distill register --engine kserve` copies into the record of a teacher-server it
registers). Both come from `declared_capabilities(io)`, so the two can never disagree.
"""

from __future__ import annotations

from google.protobuf import json_format

from protos import registry_pb2
from teacher_server.spec import ModelIO
from teacher_server.transform_checks import scoreable, token_input

__all__ = ["CAPABILITIES_PARAMETER", "UNBOUNDED_TOP_K", "capabilities_json", "declared_capabilities"]

CAPABILITIES_PARAMETER = "capabilities"
"""The ModelConfig parameter holding the JSON form of `registry.Capabilities` (what a KServe
registrar reads)."""

UNBOUNDED_TOP_K = 2**31 - 1
"""The widest top-k a record declares (int32): a model whose class dimension is variable has no bound."""


def declared_capabilities(io: ModelIO, text_prompts: bool = False) -> registry_pb2.Capabilities:
    """What this server can compute for a model with these tensors, so that students send it only
    requests it can answer. Every transform runs in chunks of positions and the whole outputs are
    always available; top-k reaches the widest class dimension (unbounded when a width is
    variable); the tail needs a floating output with classes; token log-probs and SCORE_IDS need a
    padded token input and a floating per-position output (as validation requires of a request).
    `text_prompts`: it scores text with its own tokenizer (an hf: directory holding one:
    `teacher_server.text_requests`)."""
    widths = [s.shape[-1] for s in io.outputs if s.shape]
    max_top_k = UNBOUNDED_TOP_K if any(w < 0 for w in widths) else min(max(widths, default=0), UNBOUNDED_TOP_K)
    floating = any(s.shape and s.datatype.startswith(("FP", "BF")) for s in io.outputs)
    scoring = io.padded and token_input(io) is not None and any(scoreable(s) for s in io.outputs)
    return registry_pb2.Capabilities(
        declared=True, max_top_k=max_top_k, token_logprobs=scoring, score_ids=scoring, text_prompts=text_prompts,
        chunked=True, full_outputs=True, tail=max_top_k > 0 and floating)


def capabilities_json(io: ModelIO, text_prompts: bool = False) -> str:
    """`declared_capabilities(io, text_prompts)` in the JSON form ModelConfig's `CAPABILITIES_PARAMETER`
    carries (the .proto's field names, every field shown)."""
    return json_format.MessageToJson(declared_capabilities(io, text_prompts), preserving_proto_field_name=True,
                                     indent=None, always_print_fields_with_no_presence=True)
