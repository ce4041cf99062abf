from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TeacherRecord(_message.Message):
    __slots__ = ("instance_id", "endpoint", "model_name", "model_version", "max_batch_size", "inputs", "outputs", "device", "started_at", "instances", "tls", "batches_by_length", "protocol", "path", "capabilities", "fingerprint")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_BY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    endpoint: str
    model_name: str
    model_version: str
    max_batch_size: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    device: str
    started_at: float
    instances: int
    tls: bool
    batches_by_length: bool
    protocol: str
    path: str
    capabilities: Capabilities
    fingerprint: str
    def __init__(self, instance_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., device: _Optional[str] = ..., started_at: _Optional[float] = ..., instances: _Optional[int] = ..., tls: _Optional[bool] = ..., batches_by_length: _Optional[bool] = ..., protocol: _Optional[str] = ..., path: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("declared", "max_top_k", "token_logprobs", "score_ids", "text_prompts", "chunked", "full_outputs", "tail")
    DECLARED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    FULL_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    declared: bool
    max_top_k: int
    token_logprobs: bool
    score_ids: bool
    text_prompts: bool
    chunked: bool
    full_outputs: bool
    tail: bool
    def __init__(self, declared: _Optional[bool] = ..., max_top_k: _Optional[int] = ..., token_logprobs: _Optional[bool] = ..., score_ids: _Optional[bool] = ..., text_prompts: _Optional[bool] = ..., chunked: _Optional[bool] = ..., full_outputs: _Optional[bool] = ..., tail: _Optional[bool] = ...) -> None: ...

class TeacherLoad(_message.Message):
    __slots__ = ("instance_id", "queue_depth", "in_flight", "samples_per_s", "busy_fraction", "capacity_samples_per_s", "updated_at", "draining")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    queue_depth: int
    in_flight: int
    samples_per_s: float
    busy_fraction: float
    capacity_samples_per_s: float
    updated_at: float
    draining: bool
    def __init__(self, instance_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., capacity_samples_per_s: _Optional[float] = ..., updated_at: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class StudentDemand(_message.Message):
    __slots__ = ("student_id", "samples_per_s", "wait_fraction", "in_flight", "teachers_in_use", "updated_at", "rows_routed", "tokens_routed")
    STUDENT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TEACHERS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ROWS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    student_id: str
    samples_per_s: float
    wait_fraction: float
    in_flight: int
    teachers_in_use: int
    updated_at: float
    rows_routed: int
    tokens_routed: int
    def __init__(self, student_id: _Optional[str] = ..., samples_per_s: _Optional[float] = ..., wait_fraction: _Optional[float] = ..., in_flight: _Optional[int] = ..., teachers_in_use: _Optional[int] = ..., updated_at: _Optional[float] = ..., rows_routed: _Optional[int] = ..., tokens_routed: _Optional[int] = ...) -> None: ...
