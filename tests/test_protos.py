"""The committed registry_pb2 matches registry.proto, and the tensor codec round-trips every datatype."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import registry_pb2
from protos.kserve import DATATYPES, datatype, decode_tensor, encode_tensor

PROTOS = Path(__file__).resolve().parent.parent / "protos"
# Lines that name the generator's own version, not the schema: they may differ between patch releases.
_VERSION_LINES = re.compile(r"^(# Protobuf Python Version:.*|\s+\d+,\s*)$", re.M)


def _normalise(text: str) -> str:
    return _VERSION_LINES.sub("", text)


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", str(PROTOS / "registry.proto")],
        check=True, capture_output=True, timeout=60,
    )
    for name in ("registry_pb2.py", "registry_pb2.pyi"):
        fresh = _normalise((tmp_path / name).read_text())
        committed = _normalise((PROTOS / name).read_text())
        assert fresh == committed, f"protos/{name} is stale: run `make protos` and commit the result"


def test_registry_messages_round_trip() -> None:
    rec = registry_pb2.TeacherRecord(instance_id="t1", endpoint="127.0.0.1:9", model_name="m", max_batch_size=8)
    rec.inputs.add(name="INPUT", datatype="FP32", shape=[3, 32, 32])
    again = registry_pb2.TeacherRecord.FromString(rec.SerializeToString())
    assert again == rec and list(again.inputs[0].shape) == [3, 32, 32]


@pytest.mark.parametrize("name", list(DATATYPES))
def test_codec_round_trips_every_datatype(name: str) -> None:
    dt = DATATYPES[name]
    src = (torch.arange(24) % 7 - 3).reshape(2, 3, 4).to(dt.torch_dtype)
    wire_name, shape, raw = encode_tensor(src)
    assert wire_name == name and shape == [2, 3, 4] and len(raw) == 24 * dt.itemsize
    back = decode_tensor(raw, datatype(wire_name), shape)
    assert back.dtype == src.dtype and torch.equal(back, src)


def test_decode_is_zero_copy() -> None:
    raw = bytes(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    t = decode_tensor(raw, DATATYPES["FP32"], [2, 3])
    import numpy as np

    assert np.shares_memory(t.numpy(), np.frombuffer(raw, dtype=np.float32))


def test_unknown_datatype_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="supported: BOOL"):
        datatype("STRING")


def test_parse_infer_request_round_trips_and_keeps_views() -> None:
    import numpy as np

    from protos.kserve import parse_infer_request, serialize_infer_request, service_pb2

    header = service_pb2.ModelInferRequest(model_name="m", id="9")
    header.inputs.add(name="X", datatype="FP32", shape=[2, 3])
    header.parameters["top_k"].int64_param = 4
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    wire = serialize_infer_request(header, [a])
    parsed, raws = parse_infer_request(wire)
    assert parsed == header and len(raws) == 1 and bytes(raws[0]) == a.tobytes()
    assert raws[0].obj is wire, "raw inputs are views into the received bytes, not copies"


@given(st.binary(max_size=256))
@settings(max_examples=400, deadline=None)
def test_parse_infer_request_rejects_garbage_with_its_own_error(data: bytes) -> None:
    """Garbage either raises WireFormatError, or parses to exactly what protobuf itself reads
    from the same bytes: the header fields, and field 7 as the raw inputs in order."""
    from protos.kserve import WireFormatError, parse_infer_request, service_pb2

    try:
        header, raws = parse_infer_request(data)
    except WireFormatError:
        return
    reference = service_pb2.ModelInferRequest.FromString(data)  # must parse too: same bytes, same rules
    assert [bytes(r) for r in raws] == list(reference.raw_input_contents)
    assert not header.raw_input_contents, "raw inputs are views, never copied into the header"
    reference.ClearField("raw_input_contents")
    assert header == reference
    assert header.SerializeToString(deterministic=True) == reference.SerializeToString(deterministic=True)
