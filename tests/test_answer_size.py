"""A request whose answer cannot be sent is refused on arrival (`teacher_server.answer_size`).

The estimate is checked against real answers: for every transform, the tensors a real server sends
(names, datatypes, shapes, bytes) are the ones estimated, and the whole message fits the estimate's
margin on gRPC and on HTTP. Then a real `python -m teacher_server` with a 32k-vocabulary `hf:`
teacher and --max-message-mb 1 is asked for full LOGITS through tritonclient (gRPC and HTTP) and
/v1/completions: each refusal names the size, the limit and top_k, the model never runs it, a
well-formed client is served meanwhile, and the log holds no traceback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from protos.kserve import serialize_infer_request, service_pb2
from protos.outputs import DERIVED, DerivedOutput
from teacher_server import ServerConfig
from teacher_server.answer_size import FRAME_BYTES_PER_OUTPUT, answer_bytes, answer_tensors
from teacher_server.grpc_codec import deserialize_infer
from teacher_server.http_codec import decode_infer, encode_response
from teacher_server.launch import TeacherProcess
from teacher_server.transforms import REGISTRY
from teacher_server.validation import validate
from tests.servers import REPO, ServerThread

pytestmark = pytest.mark.timeout(300)

INFER = "/inference.GRPCInferenceService/ModelInfer"
VOCAB, CONTEXT = 32768, 8192
LIMIT = 1 << 20  # --max-message-mb 1
POSITIONS = 64  # full LOGITS of one 64-token sequence: 8 MiB, eight times the limit


def save_qwen2(directory: Path, vocab: int, context: int) -> None:
    """A tiny random Qwen2 (one layer, hidden 16) of `vocab` ids and `context` positions: a
    large-vocabulary teacher whose full logits are big while its forward pass stays cheap."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=context, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(str(directory))


def test_every_transform_that_adds_outputs_declares_them() -> None:
    """The estimate reads each added output's shape and dtype from its declaration in
    protos.outputs: every registry output is one, and declared for the student too."""
    adding = [o for t in REGISTRY for o in t.outputs]
    assert adding and all(isinstance(o, DerivedOutput) for o in adding)
    assert adding == DERIVED


# ---- the estimate against real answers ---------------------------------------------------------

def _param(value: object) -> service_pb2.InferParameter:
    if isinstance(value, bool):
        return service_pb2.InferParameter(bool_param=value)
    if isinstance(value, int):
        return service_pb2.InferParameter(int64_param=value)
    if isinstance(value, float):
        return service_pb2.InferParameter(double_param=value)
    return service_pb2.InferParameter(string_param=str(value))


def _lm_request(params: dict[str, object], score_ids: int = 0) -> bytes:
    """Two sequences of 6 positions, the second padded after 4 (so the request is cut into rows)."""
    req = service_pb2.ModelInferRequest(model_name="qwen", id="estimate")
    ids = torch.tensor([[5, 9, 11, 300, 7, 2], [4, 8, 15, 16, 0, 0]], dtype=torch.int64)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.int64)
    raws = [ids.numpy().tobytes(), mask.numpy().tobytes()]
    req.inputs.add(name="INPUT_IDS", datatype="INT64", shape=[2, 6])
    req.inputs.add(name="ATTENTION_MASK", datatype="INT64", shape=[2, 6])
    if score_ids:
        req.inputs.add(name="SCORE_IDS", datatype="INT32", shape=[2, 6, score_ids])
        raws.append((torch.arange(2 * 6 * score_ids, dtype=torch.int32) % 500).numpy().tobytes())
    for k, v in params.items():
        req.parameters[k].CopyFrom(_param(v))
    return serialize_infer_request(req, raws)


def _heads_request(params: dict[str, object], sum_params: dict[str, object]) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="heads", id="estimate")
    req.inputs.add(name="A", datatype="FP32", shape=[3, 4])
    req.inputs.add(name="B", datatype="INT64", shape=[3, 4])
    out = req.outputs.add(name="SUM")
    for k, v in sum_params.items():
        out.parameters[k].CopyFrom(_param(v))
    req.outputs.add(name="ARGMAX")
    for k, v in params.items():
        req.parameters[k].CopyFrom(_param(v))
    return serialize_infer_request(req, [torch.ones(3, 4).numpy().tobytes(),
                                         torch.arange(12, dtype=torch.int64).numpy().tobytes()])


@pytest.fixture(scope="module")
def small_lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    directory = tmp_path_factory.mktemp("qwen-small")
    save_qwen2(directory, 512, 64)
    with ServerThread(ServerConfig(model=f"hf:{directory}", name="qwen", device="cpu", instances=1)) as s:
        yield s


@pytest.fixture(scope="module")
def heads() -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(model="tests.models:two_heads", name="heads", device="cpu", instances=1)) as s:
        yield s


def _check_estimate(server: ServerThread, data: bytes) -> list[str]:
    """The estimate of the request in `data` against the server's answer to it; the names sent."""
    srv = server.server
    assert srv is not None
    request = deserialize_infer(data)
    work = validate(request, srv.io, srv.config.batching.max_batch_size, srv.config.output_defaults())
    estimated = answer_tensors(work, srv.io)
    with grpc.insecure_channel(server.url) as ch:
        answer = ch.unary_unary(INFER, request_serializer=None,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)(data, timeout=60)
    sent = [(o.name, o.datatype, tuple(o.shape)) for o in answer.outputs]
    assert [(t.name, t.datatype, t.shape) for t in estimated] == sent
    assert [t.nbytes for t in estimated] == [len(raw) for raw in answer.raw_output_contents]
    names = len(answer.model_name) + len(answer.model_version) + len(answer.id)
    size = answer_bytes(estimated, names)
    raw = sum(t.nbytes for t in estimated)
    assert raw < answer.ByteSize() <= size, "the gRPC message is larger than its estimate"
    outputs = [(o.name, o.datatype, list(o.shape), r) for o, r in zip(answer.outputs, answer.raw_output_contents,
                                                                       strict=True)]
    http = decode_infer(json.dumps({"id": answer.id, "inputs": [], "parameters": {"binary_data_output": True}})
                        .encode(), None, answer.model_name)
    assert raw < encode_response(http, answer.model_name, answer.model_version, outputs).size <= size, \
        "the HTTP answer is larger than its estimate"
    assert size - raw <= 1024 + FRAME_BYTES_PER_OUTPUT * 2 * len(estimated), "the margin is out of proportion"
    return [name for name, _, _ in sent]


@pytest.mark.parametrize(("params", "score_ids", "names"), [
    ({}, 0, ["LOGITS"]),
    ({"output_dtype": "FP16", "temperature": 2.0}, 0, ["LOGITS"]),
    ({"logprobs": True}, 0, ["LOGITS"]),
    ({"top_k": 5}, 0, ["LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES"]),
    ({"top_k": 5, "topk_tail": True, "output_dtype": "BF16"}, 0,
     ["LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES", "LOGITS_TOPK_TAIL"]),
    ({"token_logprobs": True, "token_ranks": True}, 0, ["LOGITS_TOKEN_LOGPROBS", "LOGITS_TOKEN_RANKS"]),
    ({"top_k": 3, "token_ranks": True}, 3,
     ["LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES", "LOGITS_TOKEN_RANKS", "LOGITS_SCORED_LOGPROBS"]),
    ({"output_dtype": "FP16"}, 2, ["LOGITS_SCORED_LOGPROBS"]),
])
def test_the_estimate_is_what_an_lm_teacher_sends(small_lm: ServerThread, params: dict[str, object],
                                                   score_ids: int, names: list[str]) -> None:
    assert _check_estimate(small_lm, _lm_request(params, score_ids)) == names


@pytest.mark.parametrize(("params", "sum_params"), [({}, {}), ({"output_dtype": "FP16"}, {"top_k": 2})])
def test_the_estimate_is_what_a_module_teacher_sends(heads: ServerThread, params: dict[str, object],
                                                      sum_params: dict[str, object]) -> None:
    sent = _check_estimate(heads, _heads_request(params, sum_params))
    assert sent == (["SUM", "ARGMAX"] if not sum_params else ["SUM_TOPK_VALUES", "SUM_TOPK_INDICES", "ARGMAX"])


def test_an_answer_larger_than_its_estimate_is_refused_before_it_is_sent(caplog: pytest.LogCaptureFixture) -> None:
    """tiny_lm's LOGITS [-1, V] follow its input's length, which its declaration does not tie to the
    request (not per position): on arrival its size is a lower bound. Computed, the answer is refused
    with the same words before it is sent, not failed by gRPC's send limit with a traceback."""
    cfg = ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", instances=1, max_message_mb=1,
                       model_args={"vocab": 4096})
    with ServerThread(cfg) as s:
        client = tg.InferenceServerClient(s.url)
        x = tg.InferInput("TOKENS", [1, 100], "INT64")
        x.set_data_from_numpy(_ids(100))
        with pytest.raises(InferenceServerException) as e:
            client.infer("lm", [x], client_timeout=60)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value
        assert f"LOGITS [1, 100, 4096] FP32 {100 * 4096 * 4:,} bytes" in e.value.message(), e.value.message()
        assert "cannot be sent" in e.value.message() and "top_k" in e.value.message()
        values = client.infer("lm", [x], parameters={"top_k": 4}, client_timeout=60).as_numpy("LOGITS_TOPK_VALUES")
        assert values is not None and values.shape == (1, 100, 4)
    assert not [r for r in caplog.records if r.exc_info], caplog.text[-3000:]
    assert "Sent message larger" not in caplog.text


# ---- a real teacher process refusing what it cannot send ---------------------------------------

@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeacherProcess]:
    directory = tmp_path_factory.mktemp("qwen-32k")
    save_qwen2(directory, VOCAB, CONTEXT)
    args = ["--model", f"hf:{directory}", "--name", "qwen", "--device", "cpu", "--instances", "2",
            "--max-message-mb", "1", "--http-port", "0", "--max-queue-delay-us", "0"]
    with TeacherProcess(args, cwd=REPO, env={"PYTHONPATH": str(REPO)}, ready_timeout=120, stop_grace=10) as t:
        yield t
        log = t.log_path.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def _ids(n: int = POSITIONS) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) % 1000 + 1)[None]


def _counts(client: tg.InferenceServerClient) -> tuple[int, int]:
    """The model's (inference_count, execution_count)."""
    stats = client.get_inference_statistics("qwen").model_stats[0]
    return int(stats.inference_count), int(stats.execution_count)


def _assert_refusal(message: str) -> None:
    full = POSITIONS * VOCAB * 4
    assert f"{full:,} bytes" in message, message  # the full LOGITS' own size, then the whole answer's
    assert f"{LIMIT:,} bytes" in message and "--max-message-mb 1" in message, message
    assert "top_k" in message and "output_dtype" in message and "fewer positions" in message, message


def _no_traceback(teacher: TeacherProcess) -> None:
    log = teacher.log_path.read_text()
    assert "Traceback" not in log and "Sent message larger" not in log, log[-3000:]


def test_grpc_full_logits_over_the_limit_are_refused_on_arrival(teacher: TeacherProcess) -> None:
    """Eight concurrent tritonclient calls for the full LOGITS of 64 positions (8 MiB each) are
    INVALID_ARGUMENT naming the size, the limit and top_k; a top_k client calling meanwhile is served;
    the model runs none of the oversized requests."""
    client = tg.InferenceServerClient(teacher.endpoint)
    before = _counts(client)

    def full() -> InferenceServerException | None:
        x = tg.InferInput("INPUT_IDS", [1, POSITIONS], "INT64")
        x.set_data_from_numpy(_ids())
        try:
            tg.InferenceServerClient(teacher.endpoint).infer(
                "qwen", [x], outputs=[tg.InferRequestedOutput("LOGITS")], client_timeout=60)
        except InferenceServerException as e:
            return e
        return None

    def top_k() -> np.ndarray:
        x = tg.InferInput("INPUT_IDS", [1, POSITIONS], "INT64")
        x.set_data_from_numpy(_ids())
        result = tg.InferenceServerClient(teacher.endpoint).infer(
            "qwen", [x], parameters={"top_k": 8}, client_timeout=60)
        values = result.as_numpy("LOGITS_TOPK_VALUES")
        assert values is not None
        return values

    with ThreadPoolExecutor(9) as pool:
        refused = [pool.submit(full) for _ in range(8)]
        served = pool.submit(top_k)
        errors = [f.result(timeout=120) for f in refused]
        values = served.result(timeout=120)
    assert values.shape == (1, POSITIONS, 8)
    for e in errors:
        assert e is not None and e.status() == "StatusCode.INVALID_ARGUMENT", e
        _assert_refusal(e.message())
    assert _counts(client) == (before[0] + 1, before[1] + 1), "an oversized request reached the model"
    _no_traceback(teacher)


def test_http_full_logits_over_the_limit_are_400(teacher: TeacherProcess) -> None:
    """The same over KServe v2 HTTP (tritonclient.http, binary outputs): 400 with the same words; with
    top_k the request is served."""
    client = th.InferenceServerClient(f"127.0.0.1:{teacher.ready['http_port']}", network_timeout=60)
    before = _counts(tg.InferenceServerClient(teacher.endpoint))
    x = th.InferInput("INPUT_IDS", [1, POSITIONS], "INT64")
    x.set_data_from_numpy(_ids())
    with pytest.raises(InferenceServerException) as e:
        client.infer("qwen", [x], outputs=[th.InferRequestedOutput("LOGITS", binary_data=True)])
    assert e.value.status() == "400", e.value
    _assert_refusal(e.value.message())
    result = client.infer("qwen", [x], parameters={"top_k": 8},
                          outputs=[th.InferRequestedOutput("LOGITS", binary_data=True)])
    values = result.as_numpy("LOGITS_TOPK_VALUES")
    assert values is not None and values.shape == (1, POSITIONS, 8)
    assert _counts(tg.InferenceServerClient(teacher.endpoint))[0] == before[0] + 1
    _no_traceback(teacher)


def _complete(teacher: TeacherProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{teacher.ready['http_port']}/v1/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_over_the_limit_are_400(teacher: TeacherProcess) -> None:
    """/v1/completions with 20 prompt_logprobs of a 6,400-token prompt asks for 1.07 MB of top-k
    values, ids, log-probs and ranks: 400 with the same words, never run; a short prompt is served."""
    before = _counts(tg.InferenceServerClient(teacher.endpoint))
    long_prompt = [int(i) for i in _ids(6400)[0]]
    status, body = _complete(teacher, {"prompt": long_prompt, "max_tokens": 1, "prompt_logprobs": 20})
    assert status == 400, body
    message = body["error"]["message"]
    assert f"{LIMIT:,} bytes" in message and "top_k" in message and "fewer positions" in message, message
    status, body = _complete(teacher, {"prompt": long_prompt[:32], "max_tokens": 1, "prompt_logprobs": 20})
    assert status == 200, body
    assert len(body["choices"][0]["prompt_logprobs"]) == 32
    assert _counts(tg.InferenceServerClient(teacher.endpoint))[0] == before[0] + 1
    _no_traceback(teacher)
