"""``--model-config`` in its three forms: our JSON, Triton's config.pbtxt and Triton's JSON.

Files are written to tmp_path and read through the same function the CLI uses; one test serves a
model declared by a config.pbtxt and calls it with tritonclient.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg

from teacher_server.model_config import ModelFileConfig
from teacher_server.spec import ModelIO, SpecError
from tests.servers import teacher_process

PBTXT = """
name: "ref_teacher"
platform: "pytorch_libtorch"
max_batch_size: 64
input [
  { name: "X" data_type: TYPE_FP32 dims: [ 8 ] }
]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] }
]
"""
EXPECTED = ModelIO.parse(["X:FP32:8"], ["Y:FP32:4"])


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_triton_pbtxt_declares_inputs_outputs_and_batch(tmp_path: Path) -> None:
    cfg = ModelFileConfig.load(_write(tmp_path, "config.pbtxt", PBTXT))
    assert cfg.io == EXPECTED and cfg.max_batch_size == 64 and cfg.name == "ref_teacher"
    # the file name does not decide the format: text that is not JSON is read as protobuf text
    assert ModelFileConfig.load(_write(tmp_path, "model.cfg", PBTXT)).io == EXPECTED


def test_triton_json_and_our_json_read_the_same(tmp_path: Path) -> None:
    triton = {"name": "m", "max_batch_size": 16,
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [8]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": ["4"]}]}  # int64 dims: JSON may quote them
    ours = {"name": "m", "max_batch_size": 16,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [8]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}]}
    a = ModelFileConfig.load(_write(tmp_path, "triton.json", json.dumps(triton)))
    b = ModelFileConfig.load(_write(tmp_path, "ours.json", json.dumps(ours)))
    assert a == b == ModelFileConfig(EXPECTED, 16, "m")


def test_triton_datatypes_map_to_kserve_names(tmp_path: Path) -> None:
    text = """max_batch_size: 8
    input [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] }, { name: "MASK" data_type: TYPE_BOOL dims: [ 1 ] } ]
    output [ { name: "LOGITS" data_type: TYPE_FP16 dims: [ -1, 100 ] }, { name: "B" data_type: TYPE_BF16 dims: [ 2 ] } ]
    """
    cfg = ModelFileConfig.load(_write(tmp_path, "config.pbtxt", text))
    assert cfg.io == ModelIO.parse(["IDS:INT64:-1", "MASK:BOOL:1"], ["LOGITS:FP16:-1,100", "B:BF16:2"])
    strings = 'max_batch_size: 8 input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]'
    with pytest.raises(SpecError, match="TYPE_STRING is not supported; use one of TYPE_BOOL"):
        ModelFileConfig.load(_write(tmp_path, "s.pbtxt", strings))


def test_no_batching_config_is_served_when_the_first_dim_is_variable(tmp_path: Path) -> None:
    ok = 'max_batch_size: 0 input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 8 ] } ]'
    cfg = ModelFileConfig.load(_write(tmp_path, "a.pbtxt", ok))
    assert cfg.io == ModelIO.parse(["X:FP32:8"]) and cfg.max_batch_size is None
    fixed = 'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4, 8 ] } ]'
    with pytest.raises(SpecError, match="always batches: set max_batch_size > 0"):
        ModelFileConfig.load(_write(tmp_path, "b.pbtxt", fixed))


@pytest.mark.parametrize(("name", "text", "says"), [
    ("config.pbtxt", PBTXT + 'instance_group [ { count: 2 kind: KIND_GPU } ]',
     r"instance_group are not understood.*--instances and --device"),
    ("config.pbtxt", PBTXT + "dynamic_batching { max_queue_delay_microseconds: 100 }",
     r"dynamic_batching are not understood.*--max-queue-delay-us"),
    ("config.pbtxt", PBTXT.replace('dims: [ 8 ]', 'dims: [ 8 ] reshape: { shape: [ 2, 4 ] }'),
     r"input 'X': key\(s\) reshape are not understood"),
    ("config.pbtxt", PBTXT.replace("max_batch_size", "max_batchsize"), r'no field named "max_batchsize"'),
    ("t.json", json.dumps({"input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [8], "shapes": [1]}]}),
     "no field named \"shapes\""),
    ("t.json", json.dumps({"platform": "onnxruntime_onnx", "sequence_batching": {}}),
     "sequence_batching are not understood"),
    ("ours.json", json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [8]}], "instances": 2}),
     "instances are not understood"),
    ("ours.json", json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [8], "dims": [8]}]}),
     "inputs entry 'X': key\\(s\\) dims are not understood"),
    ("ours.json", json.dumps({"outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}]}),
     "declares outputs but no inputs"),
    ("ours.json", json.dumps({"inputs": [], "max_batch_size": "lots"}), "max_batch_size must be a positive integer"),
    ("x.pbtxt", 'input [ { name: "X" data_type: TYPE_FP32 dims: [ 8 ] } ', "not a Triton config.pbtxt"),
    ("x.json", "[1, 2]", "must be a JSON object"),
])
def test_keys_we_would_ignore_are_refused_by_name(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(SpecError, match=says) as info:
        ModelFileConfig.load(path)
    assert str(path) in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        ModelFileConfig.load(tmp_path / "nope.pbtxt")


def test_cli_serves_a_model_declared_by_config_pbtxt(tmp_path: Path) -> None:
    config = _write(tmp_path, "config.pbtxt", PBTXT.replace("ref_teacher", "affine"))
    args = ["--model", "tests.models:affine", "--name", "affine", "--device", "cpu", "--instances", "1",
            "--model-config", str(config)]
    with teacher_process(args, tmp_path) as (_proc, info), tg.InferenceServerClient(info["endpoint"]) as c:
        meta = c.get_model_metadata("affine", as_json=True)
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [("X", "FP32", ["-1", "8"])]
        assert c.get_model_config("affine", as_json=True)["config"]["max_batch_size"] == 64
        x = np.ones((3, 8), dtype=np.float32)
        inp = tg.InferInput("X", [3, 8], "FP32")
        inp.set_data_from_numpy(x)
        assert c.infer("affine", [inp]).as_numpy("Y").shape == (3, 4)
