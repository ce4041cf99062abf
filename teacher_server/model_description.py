"""What the server says about its model in KServe v2 / Triton terms: its metadata and its
ModelConfig.

Each is built in one place and answered two ways, so the two protocols can never disagree: over
gRPC as the message itself, over HTTP as the JSON form of it (`as_json`). That form is protobuf's
JSON mapping with the .proto's field names and every field shown (empty lists included: a tensor
of per-sample shape ``[]`` still has ``"dims": []``), except that 64-bit integers are JSON numbers,
as Triton writes them, where protobuf's mapping writes strings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from protos.kserve import BY_LENGTH_PARAMETER, DATATYPES, FINGERPRINT_PARAMETER, model_config_pb2, service_pb2
from teacher_server.capabilities import CAPABILITIES_PARAMETER, capabilities_json
from teacher_server.spec import ModelIO
from teacher_server.text_requests import text_tensors

if TYPE_CHECKING:
    from teacher_server.lifecycle import ServedModel

__all__ = ["as_json", "config_message", "metadata_message"]

_INT64 = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})


def metadata_message(model: ServedModel, io: ModelIO) -> service_pb2.ModelMetadataResponse:
    """The model's KServe v2 metadata: its tensors, batch dimension first (-1), and, when it scores
    text, the text tensors (`protos.text`)."""
    resp = service_pb2.ModelMetadataResponse(name=model.name, versions=[model.version], platform="pytorch_libtorch")
    for s in io.inputs:
        resp.inputs.add(name=s.name, datatype=s.datatype, shape=[-1, *s.shape])
    for s in io.outputs:
        resp.outputs.add(name=s.name, datatype=s.datatype, shape=[-1, *s.shape])
    inputs, outputs = text_tensors(model.text_prompts)  # optional: ModelConfig marks them so
    for name, dtype, shape in inputs:
        resp.inputs.add(name=name, datatype=dtype, shape=[-1, *shape])
    for name, dtype, shape in outputs:
        resp.outputs.add(name=name, datatype=dtype, shape=[-1, *shape])
    return resp


def config_message(model: ServedModel, io: ModelIO) -> model_config_pb2.ModelConfig:
    """The model's configuration as Triton reports one: tensors, batching, instances, whether it
    batches padded rows by length (`BY_LENGTH_PARAMETER`) and its fingerprint
    (`FINGERPRINT_PARAMETER`), both of which students read, and what it can compute
    (`CAPABILITIES_PARAMETER`, which a KServe registrar copies into the record)."""
    batching = model.batching
    cfg = model_config_pb2.ModelConfig(
        name=model.name, platform="pytorch_libtorch", backend="pytorch", max_batch_size=batching.max_batch_size,
    )
    for s in io.inputs:
        cfg.input.add(name=s.name, data_type=DATATYPES[s.datatype].config_type, dims=list(s.shape))
    for s in io.outputs:
        cfg.output.add(name=s.name, data_type=DATATYPES[s.datatype].config_type, dims=list(s.shape))
    inputs, outputs = text_tensors(model.text_prompts)
    for name, dtype, shape in inputs:  # sent in place of the model's inputs (text) or alone (vocabulary)
        cfg.input.add(name=name, data_type=_config_type(dtype), dims=list(shape), optional=True)
    for name, dtype, shape in outputs:
        cfg.output.add(name=name, data_type=_config_type(dtype), dims=list(shape))
    if batching.enabled:
        cfg.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
        cfg.dynamic_batching.default_queue_policy.max_queue_size = batching.queue_bound(io.padded)
    if batching.by_length(io.padded):
        cfg.parameters[BY_LENGTH_PARAMETER].string_value = "true"
    if model.fingerprint:
        cfg.parameters[FINGERPRINT_PARAMETER].string_value = model.fingerprint
    cfg.parameters[CAPABILITIES_PARAMETER].string_value = capabilities_json(io, model.text_prompts)  # as the record
    gpu = model.device.type == "cuda"
    group = cfg.instance_group.add(
        name=f"{model.name}_0", count=model.instances,
        kind=model_config_pb2.ModelInstanceGroup.KIND_GPU if gpu else model_config_pb2.ModelInstanceGroup.KIND_CPU,
    )
    if gpu:
        group.gpus.append(model.device.index or 0)
    return cfg


def _config_type(dtype: str) -> int:
    """ModelConfig's data type of a KServe datatype (BYTES is Triton's TYPE_STRING)."""
    return model_config_pb2.DataType.TYPE_STRING if dtype == "BYTES" else DATATYPES[dtype].config_type


def as_json(message: Message) -> dict[str, Any]:
    """The JSON form of `message` that Triton's HTTP front end answers with (``/v2/models/NAME``,
    ``/v2/models/NAME/config``)."""
    doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    _numbers(doc, message.DESCRIPTOR)
    return doc


def _numbers(doc: dict[str, Any], descriptor: Descriptor) -> None:
    """Turn the strings protobuf's JSON mapping gives 64-bit integers back into numbers, in place."""
    for name, value in doc.items():
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        if field.type in _INT64:
            doc[name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                entry = field.message_type.fields_by_name["value"]
                if entry.type in _INT64:
                    doc[name] = {k: int(v) for k, v in value.items()}
                elif entry.message_type is not None:
                    for v in value.values():
                        _numbers(v, entry.message_type)
            else:
                for item in value if isinstance(value, list) else [value]:
                    _numbers(item, field.message_type)
