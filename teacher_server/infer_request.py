"""One inference request as any front end hands it to the server, before validation.

A front end (the gRPC service today, a KServe v2 HTTP one later) turns what it received into an
`InferRequest` without judging it; `validation.validate` then checks it against the model and
`lifecycle.RequestLifecycle.infer` runs it. Nothing here names a protocol type: parameter values
are plain Python values, and raw tensor bytes stay views into the received message (no copy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Parameters = Mapping[str, object]
"""Request, input or output parameters by name; a value is a str, int, float, bool, or None when
the sender set the name without a value."""

RawBuffer = bytes | memoryview

# Not frozen: a request is built once per call on the event loop, and frozen dataclasses pay for
# object.__setattr__ on every field. Treat instances as read-only all the same.


@dataclass(slots=True)
class InputTensor:
    """One input as received: declared name, datatype and shape, and its values when they came
    typed (a list of numbers) instead of as raw bytes.

    `shape` is kept as received (it may be any length); validation checks its length before
    looking at it.
    """

    name: str
    datatype: str
    shape: Sequence[int]
    values: Sequence[Any] = ()
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the request names, with its own parameters (output_dtype, top_k)."""

    name: str
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """A received request, protocol-neutral.

    `raw_inputs` are the inputs' bytes, one buffer per input in `inputs` order (KServe's
    raw_input_contents, or the HTTP binary-data extension); empty when the values came typed.
    `malformed` is set by a front end whose bytes did not decode into a request at all: the
    lifecycle refuses it as invalid (and counts it) before looking at anything else.
    """

    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: Sequence[InputTensor] = ()
    outputs: Sequence[RequestedOutput] = ()
    parameters: Parameters = field(default_factory=dict)
    raw_inputs: Sequence[RawBuffer] = field(default_factory=tuple)
    malformed: str = ""
