"""A transform registered from outside the library reaches the student: `tests.entropy_transform`
declares `<OUT>_ENTROPY` once, registers it on the teacher (a real `python -m teacher_server`
process, and the in-process server) and, in the student's process, passes the same declaration
to `distill.outputs.register`; `DistillReader` then receives it with the shape its declaration
says, the answer's size is estimated from that declaration, and no other library file knows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill import DistillReader, ReaderOptions
from distill.outputs import derived_names, per_sample_shape, register, unregister, wanted_outputs
from distill.types import TensorMeta
from protos.kserve import service_pb2
from protos.outputs import DERIVED
from teacher_server import ServerConfig
from teacher_server.answer_size import answer_tensors
from teacher_server.grpc_codec import deserialize_infer
from teacher_server.server import TeacherServer
from teacher_server.transforms import REGISTRY
from teacher_server.transforms import unregister as unregister_transform
from teacher_server.validation import validate
from teacher_server.work import Work
from tests.entropy_transform import ENTROPY, ENTROPY_OUTPUT, entropy_lm
from tests.models import tiny_lm
from tests.servers import ServerThread, teacher_process

pytestmark = pytest.mark.timeout(300)

VOCAB, T = 41, 7
ARGS: dict[str, Any] = {"vocab": VOCAB, "hidden": 12, "seed": 3, "scale": 2.0}


@pytest.fixture
def student_side() -> Iterator[None]:
    """The student's one registration call, undone afterwards (the teacher's too, where a test
    registered it in this process)."""
    register(ENTROPY_OUTPUT)
    try:
        yield
    finally:
        unregister(ENTROPY_OUTPUT)
        unregister_transform(ENTROPY.name)
    assert ENTROPY_OUTPUT not in DERIVED and ENTROPY not in REGISTRY


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"TOKENS": torch.randint(0, VOCAB, (3, T), generator=g), "idx": torch.full((3,), i)} for i in range(n)]


def _entropy(tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    with torch.inference_mode():
        lp = torch.log_softmax(tiny_lm(**ARGS).eval()(tokens) / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)


def _read(url: str, **options: object) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    data = _batches(4)
    opts = ReaderOptions(teachers=url, inputs=["TOKENS"], outputs=["LOGITS"],  # type: ignore[arg-type]
                         parameters={"entropy": True}, **options)
    with DistillReader(data, options=opts) as reader:
        got = [(batch, teacher) for batch, teacher in reader]
    assert [int(b["idx"][0]) for b, _ in got] == list(range(len(data)))
    return got


def _validated(srv: TeacherServer, entropy: bool) -> Work:
    req = service_pb2.ModelInferRequest(model_name="lm", id="size")
    req.inputs.add(name="TOKENS", datatype="INT64", shape=[2, T])
    req.parameters["entropy"].bool_param = entropy
    req.raw_input_contents.append(torch.zeros(2, T, dtype=torch.int64).numpy().tobytes())
    return validate(deserialize_infer(req.SerializeToString()), srv.io, srv.config.batching.max_batch_size,
                    srv.config.output_defaults())


def test_the_declaration_is_what_the_student_expects(student_side: None) -> None:
    declared = {"LOGITS": TensorMeta("LOGITS", "FP32", (-1, VOCAB))}
    assert wanted_outputs(("LOGITS",), {"entropy": True, "top_k": 3}) == [
        "LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES", "LOGITS_ENTROPY"]
    assert wanted_outputs(("LOGITS",), {"entropy": False}) == ["LOGITS"]
    assert per_sample_shape("LOGITS_ENTROPY", declared, {"entropy": True}) == (-1,)
    assert "LOGITS_ENTROPY" in derived_names("LOGITS")
    assert ENTROPY_OUTPUT.datatype(None, "BF16") == "FP32" and ENTROPY_OUTPUT.datatype("FP16", "FP32") == "FP16"
    unregister(ENTROPY_OUTPUT)
    assert per_sample_shape("LOGITS_ENTROPY", declared, {"entropy": True}) is None
    assert wanted_outputs(("LOGITS",), {"entropy": True}) == ["LOGITS"]


def test_a_real_teacher_process_serves_the_registered_output(student_side: None, tmp_path: Path) -> None:
    """The teacher registers it in its own process (its model factory); the student only declares it."""
    args = ["--model", "tests.entropy_transform:entropy_lm", "--name", "lm", "--device", "cpu",
            *(a for k, v in ARGS.items() for a in ("--model-arg", f"{k}={v}"))]
    assert ENTROPY not in REGISTRY  # nothing in this process serves it
    with teacher_process(args, tmp_path) as (_proc, info):
        got = _read(info["endpoint"], top_k=3)
    for batch, teacher in got:
        assert sorted(teacher) == ["LOGITS_ENTROPY", "LOGITS_TOPK_INDICES", "LOGITS_TOPK_VALUES"]
        assert teacher["LOGITS_ENTROPY"].shape == (3, T) and teacher["LOGITS_ENTROPY"].dtype == torch.float32
        assert torch.allclose(teacher["LOGITS_ENTROPY"], _entropy(batch["TOKENS"]), atol=1e-5)
        assert teacher["LOGITS_TOPK_VALUES"].shape == (3, T, 3)


def test_the_in_process_server_serves_and_sizes_it(student_side: None) -> None:
    """In one process the teacher's `register` declares it for the student too; the reader's
    temperature reaches it, and the answer's estimate (teacher_server.answer_size) names it with
    the shape and dtype of its declaration."""
    entropy_lm(**ARGS)  # registers ENTROPY here
    cfg = ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", model_args=ARGS)
    with ServerThread(cfg) as server:
        got = _read(server.url, temperature=2.0, output_dtype="FP16")
        assert server.server is not None
        srv = server.server
        plain = answer_tensors(_validated(srv, entropy=False), srv.io)
        estimated = answer_tensors(_validated(srv, entropy=True), srv.io)
    # tiny_lm's positions are a dimension the model chooses (counted as 1): the estimate is LOGITS'
    # shape with the class dimension dropped, in FP32, as the declaration says.
    assert [(t.name, t.datatype, t.shape) for t in plain] == [("LOGITS", "FP32", (2, 1, VOCAB))]
    assert [(t.name, t.datatype, t.shape) for t in estimated] == [("LOGITS_ENTROPY", "FP32", (2, 1))]
    for batch, teacher in got:
        assert list(teacher) == ["LOGITS_ENTROPY"]
        assert teacher["LOGITS_ENTROPY"].shape == (3, T) and teacher["LOGITS_ENTROPY"].dtype == torch.float16
        assert torch.allclose(teacher["LOGITS_ENTROPY"].float(), _entropy(batch["TOKENS"], 2.0), atol=1e-2)


def test_a_registered_transforms_parameter_is_an_option_a_flag_and_part_of_a_stores_namespace() -> None:
    import argparse

    from distill import add_distill_args

    args = add_distill_args(argparse.ArgumentParser()).parse_args(
        ["--distill_teachers", "127.0.0.1:1", "--distill_parameter", "entropy=true", "--distill_parameter", "k=3",
         "--distill_parameter", "mode=fast"])
    opts = ReaderOptions.from_args(args, inputs=["TOKENS"])
    assert opts.parameters == {"entropy": True, "k": 3, "mode": "fast"}
    assert {"entropy": True, "k": 3, "mode": "fast"}.items() <= opts.request_parameters.items()
    stored = ReaderOptions(teachers="127.0.0.1:1", inputs=["TOKENS"], parameters={"entropy": True}, cache="/tmp/x",
                           key="idx").store_fields()
    assert ("entropy", "true") in stored["extra"]
    with pytest.raises(ValueError, match="has an option of its own: pass top_k="):
        ReaderOptions(teachers="127.0.0.1:1", inputs=["TOKENS"], parameters={"top_k": 3})
    with pytest.raises(ValueError, match="a bool, int, float or str"):
        ReaderOptions(teachers="127.0.0.1:1", inputs=["TOKENS"], parameters={"entropy": [1]})
    with pytest.raises(SystemExit):
        add_distill_args(argparse.ArgumentParser()).parse_args(["--distill_parameter", "noequals"])
