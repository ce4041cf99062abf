"""vLLM's scoring subset on the teacher: each prompt becomes one protocol-neutral `InferRequest`,
and its encoded outputs become the `Scored` arrays `protos.vllm` writes vLLM's answer from.

Each prompt is sent to the teacher's own lifecycle as its own request (batch 1) asking for the
causal LM's output with `protos.vllm.scoring_parameters` (`logprobs`, `top_k`, `temperature`,
`token_logprobs`, `token_ranks`; `teacher_server.transforms`), so the padded batcher groups prompts
by length with everyone else's and only `[T, k]` values, ids, and the prompt tokens' own log-probs
and ranks leave the device. The JSON shapes themselves are `protos.vllm` (shared with the
student-side gateway); nothing here touches the event loop or a socket: `teacher_server.vllm_routes`
does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protos.kserve import DATATYPES
from protos.vllm import Scored, scoring_parameters
from teacher_server.infer_request import InferRequest, InputTensor, RequestedOutput
from teacher_server.outputs import EncodedOutput

__all__ = ["infer_request", "scored"]


def infer_request(model: str, ids: Sequence[int], *, input_name: str, datatype: str, output_name: str, top_k: int,
                  temperature: float, request_id: str = "") -> InferRequest:
    """One prompt as a batch-1 KServe request for the causal LM's per-position output."""
    raw = np.asarray(ids, dtype=DATATYPES[datatype].numpy_dtype).tobytes()
    return InferRequest(model_name=model, id=request_id,
                        inputs=[InputTensor(input_name, datatype, [1, len(ids)])],
                        outputs=[RequestedOutput(output_name, scoring_parameters(top_k, temperature))],
                        raw_inputs=[raw])


def scored(outputs: Sequence[EncodedOutput], output_name: str) -> Scored:
    """The four reduced outputs of one prompt's answer, viewed as arrays."""
    by_name = {name: (dtype, shape, raw) for name, dtype, shape, raw in outputs}

    def get(suffix: str) -> np.ndarray:
        dtype, shape, raw = by_name[output_name + suffix]
        return np.frombuffer(raw, dtype=DATATYPES[dtype].numpy_dtype).reshape(shape)[0]

    return Scored(get("_TOPK_VALUES"), get("_TOPK_INDICES"), get("_TOKEN_LOGPROBS"), get("_TOKEN_RANKS"))
