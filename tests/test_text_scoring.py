"""Text requests (`teacher_server.text_requests`): a teacher-server process per tokenizer kind
(`tests.tokenizer_models`) takes TEXT over gRPC and KServe HTTP, answers in its own tokens with
their byte spans, and scores them exactly as the same model in process scores those ids; a text
request and an id request share one batch; every refusal; the vocabulary request."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from protos import registry_pb2
from protos.text import TEXT_INPUTS, TEXT_OUTPUTS
from teacher_server import ServerConfig
from teacher_server.capabilities import CAPABILITIES_PARAMETER
from teacher_server.text_spans import NO_SPAN
from teacher_server.vocab_pieces import vocab_pieces
from tests.hf_models import load_reference, reference_logprobs, save_llama
from tests.servers import ServerThread, teacher_process
from tests.tokenizer_models import KINDS, TEXTS, save_text_teacher

transformers = pytest.importorskip("transformers")

TOP_K = 4
CONTEXT = 128


class Teacher:
    """One teacher-server process of a tokenizer kind, its tokenizer and the same model in process."""

    def __init__(self, kind: str, directory: Path, info: dict[str, Any], tokenizer: Any) -> None:
        self.kind = kind
        self.directory = directory
        self.info = info
        self.tokenizer = tokenizer
        self.reference = load_reference(directory)
        self.client = tg.InferenceServerClient(info["endpoint"])

    def infer(self, inputs: list[tg.InferInput], outputs: tuple[str, ...] = ("TEXT_IDS", "TEXT_SPANS", "TEXT_MASK",
                                                                              "LOGITS"),
              **parameters: Any) -> tg.InferResult:
        return self.client.infer("text", inputs, outputs=[tg.InferRequestedOutput(n) for n in outputs],
                                 parameters=parameters or None, client_timeout=60)


@pytest.fixture(scope="module", params=sorted(KINDS))
def teacher(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Teacher]:
    kind = request.param
    directory = tmp_path_factory.mktemp(f"text-{kind}")
    tokenizer = save_text_teacher(directory, kind, context=CONTEXT)
    # A queue delay long enough that two requests sent together share a batch.
    args = ["--model", f"hf:{directory}", "--name", "text", "--device", "cpu", "--http-port", "0",
            "--metrics-port", "0", "--max-queue-delay-us", "300000", "--max-message-mb", "4"]
    with teacher_process(args, directory, timeout=120) as (_, info):
        t = Teacher(kind, directory, info, tokenizer)
        try:
            yield t
        finally:
            t.client.close()


def _text(texts: list[str] | list[bytes]) -> tg.InferInput:
    rows = [t if isinstance(t, bytes) else t.encode() for t in texts]
    i = tg.InferInput("TEXT", [len(rows), 1], "BYTES")
    i.set_data_from_numpy(np.array(rows, dtype=object).reshape(-1, 1))
    return i


def _ids(ids: np.ndarray, mask: np.ndarray) -> list[tg.InferInput]:
    out = []
    for name, array in (("INPUT_IDS", ids), ("ATTENTION_MASK", mask.astype(np.int64))):
        i = tg.InferInput(name, list(array.shape), "INT64")
        i.set_data_from_numpy(array)
        out.append(i)
    return out


def _refused(teacher: Teacher, inputs: list[tg.InferInput], *words: str, outputs: tuple[str, ...] = ("LOGITS",)
             ) -> None:
    with pytest.raises(InferenceServerException) as e:
        teacher.infer(inputs, outputs)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value
    for w in words:
        assert w in e.value.message(), (w, e.value.message())


# ---- what the teacher declares ----------------------------------------------------------------------
def test_the_teacher_declares_the_text_tensors_and_capability(teacher: Teacher) -> None:
    meta = teacher.client.get_model_metadata("text", as_json=True)
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]}
    for name, dtype, shape in TEXT_INPUTS:
        assert inputs[name] == (dtype, ["-1", *map(str, shape)])
    for name, dtype, shape in TEXT_OUTPUTS:
        assert outputs[name] == (dtype, ["-1", *map(str, shape)])
    config = teacher.client.get_model_config("text", as_json=True)["config"]
    optional = {i["name"]: i.get("optional", False) for i in config["input"]}
    assert optional == {"INPUT_IDS": False, "ATTENTION_MASK": False, "TEXT": True, "VOCAB_IDS": True}
    caps = json_format.Parse(config["parameters"][CAPABILITIES_PARAMETER]["string_value"], registry_pb2.Capabilities())
    assert caps.text_prompts and caps.token_logprobs


# ---- answers --------------------------------------------------------------------------------------
def test_text_is_scored_in_the_teachers_own_tokens_with_byte_spans(teacher: Teacher) -> None:
    r = teacher.infer([_text(TEXTS)], token_logprobs=True, top_k=TOP_K, logprobs=True)
    ids, spans, mask = r.as_numpy("TEXT_IDS"), r.as_numpy("TEXT_SPANS"), r.as_numpy("TEXT_MASK")
    logprobs, top = r.as_numpy("LOGITS_TOKEN_LOGPROBS"), r.as_numpy("LOGITS_TOPK_VALUES")
    top_ids = r.as_numpy("LOGITS_TOPK_INDICES")
    width = max(len(teacher.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert ids.shape == mask.shape == logprobs.shape == (len(TEXTS), width) and spans.shape == (len(TEXTS), width, 2)
    assert ids.dtype == np.int64 and spans.dtype == np.int32 and mask.dtype == np.int8
    for row, text in enumerate(TEXTS):
        enc = teacher.tokenizer(text, return_special_tokens_mask=True)
        n = len(enc["input_ids"])
        assert ids[row, :n].tolist() == enc["input_ids"], text
        assert (ids[row, n:] == teacher.tokenizer.pad_token_id).all() and (mask[row, n:] == 0).all()
        assert (mask[row, :n] == 1).all() and (spans[row, n:] == NO_SPAN).all()
        added = np.asarray(enc["special_tokens_mask"], dtype=bool)
        assert added[0] and (spans[row, :n][added] == NO_SPAN).all(), "the BOS the tokenizer added has no bytes"
        real = spans[row, :n][~added]
        assert real[0, 0] == 0 and real[-1, 1] == len(text.encode()), "the spans cover the text's bytes"
        assert (real[1:, 0] == real[:-1, 1]).all() and (real[:, 1] >= real[:, 0]).all(), "and tile them"
        want = reference_logprobs(teacher.reference, enc["input_ids"])
        nxt = torch.tensor(enc["input_ids"][1:])
        own = want[:-1].gather(1, nxt[:, None])[:, 0].numpy()
        assert np.allclose(logprobs[row, :n - 1], own, atol=1e-4), text
        assert (logprobs[row, n - 1:] == 0).all(), "0 at the last position and on padding"
        values, indices = torch.topk(want, TOP_K, dim=-1)
        assert np.allclose(top[row, :n], values.numpy(), atol=1e-4)
        assert (top_ids[row, :n] == indices.numpy()).all()


def test_a_text_answers_as_its_ids_do(teacher: Teacher) -> None:
    texts = TEXTS[:4]
    by_text = teacher.infer([_text(texts)], token_logprobs=True, top_k=TOP_K)
    ids, mask = by_text.as_numpy("TEXT_IDS"), by_text.as_numpy("TEXT_MASK")
    by_ids = teacher.infer(_ids(ids, mask), ("LOGITS",), token_logprobs=True, top_k=TOP_K)
    for name in ("LOGITS_TOKEN_LOGPROBS", "LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES"):
        a, b = by_text.as_numpy(name), by_ids.as_numpy(name)
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-5), name
    only = teacher.infer([_text(texts)], ("TEXT_IDS",))
    assert (only.as_numpy("TEXT_IDS") == ids).all() and only.as_numpy("LOGITS") is None, \
        "a request for text outputs only is answered without the model"


def test_a_text_request_and_an_id_request_share_a_batch(teacher: Teacher) -> None:
    def executions() -> float:
        url = f"http://127.0.0.1:{teacher.info['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        (line,) = [line for line in text.splitlines() if line.startswith("nv_inference_exec_count{")]
        return float(line.rsplit(" ", 1)[1])

    ids = np.asarray([teacher.tokenizer(TEXTS[0])["input_ids"]], dtype=np.int64)  # one length: one bucket
    done = threading.Event()
    answers: dict[str, Any] = {}

    def callback(key: str) -> Any:
        def record(result: Any, error: Any) -> None:
            answers[key] = error if error is not None else result
            if len(answers) == 2:
                done.set()
        return record

    before = executions()
    params = {"token_logprobs": True}
    out = [tg.InferRequestedOutput("LOGITS")]
    teacher.client.async_infer("text", [_text([TEXTS[0]])], callback("text"), outputs=out, parameters=params)
    teacher.client.async_infer("text", _ids(ids, np.ones_like(ids)), callback("ids"), outputs=out, parameters=params)
    assert done.wait(60), "both answers came"
    assert executions() - before == 1, "the text request and the id request ran in one batch"
    for key, row_ids in (("text", teacher.tokenizer(TEXTS[0])["input_ids"]), ("ids", ids[0].tolist())):
        got = answers[key]
        assert not isinstance(got, Exception), got
        want = reference_logprobs(teacher.reference, row_ids)
        own = want[:-1].gather(1, torch.tensor(row_ids[1:])[:, None])[:, 0].numpy()
        assert np.allclose(got.as_numpy("LOGITS_TOKEN_LOGPROBS")[0, :-1], own, atol=1e-4), key


def test_kserve_http_binary_and_json_answer_the_same(teacher: Teacher) -> None:
    texts = TEXTS[:3]
    grpc_answer = teacher.infer([_text(texts)], token_logprobs=True)
    url = f"127.0.0.1:{teacher.info['http_port']}"
    with th.InferenceServerClient(url, connection_timeout=60, network_timeout=60) as client:
        i = th.InferInput("TEXT", [len(texts), 1], "BYTES")
        i.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1))
        binary = client.infer("text", [i], outputs=[th.InferRequestedOutput(n) for n in ("TEXT_IDS", "LOGITS")],
                              parameters={"token_logprobs": True})
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts), 1], "data": [[t] for t in texts]}],
            "outputs": [{"name": "TEXT_IDS"}, {"name": "TEXT_SPANS"}, {"name": "LOGITS"}],
            "parameters": {"token_logprobs": True}}
    request = urllib.request.Request(f"http://{url}/v2/models/text/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    doc = json.loads(urllib.request.urlopen(request, timeout=60).read())
    got = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in doc["outputs"]}
    for name in ("TEXT_IDS", "LOGITS_TOKEN_LOGPROBS"):
        assert np.allclose(binary.as_numpy(name), grpc_answer.as_numpy(name), atol=1e-6), name
        assert np.allclose(got[name], grpc_answer.as_numpy(name), atol=1e-6), name
    assert (got["TEXT_SPANS"] == grpc_answer.as_numpy("TEXT_SPANS")).all()
    vocab = {"inputs": [{"name": "VOCAB_IDS", "datatype": "INT64", "shape": [2, 1], "data": [3, 4]}]}
    request = urllib.request.Request(f"http://{url}/v2/models/text/infer", json.dumps(vocab).encode(),
                                     {"Content-Type": "application/json"})
    doc = json.loads(urllib.request.urlopen(request, timeout=60).read())
    pieces = vocab_pieces(teacher.tokenizer)
    assert [s.encode("utf-8", "surrogateescape") for s in doc["outputs"][0]["data"]] == pieces[3:5]
    bad = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [""]}]}
    request = urllib.request.Request(f"http://{url}/v2/models/text/infer", json.dumps(bad).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400 and "row 0 is empty" in json.loads(e.value.read())["error"]


def test_the_vocabulary_request_returns_the_tokenizers_pieces(teacher: Teacher) -> None:
    pieces = vocab_pieces(teacher.tokenizer)
    got: list[bytes] = []
    page = 64
    for start in range(0, len(pieces), page):  # a student pages through range(vocab_size)
        ids = np.arange(start, min(start + page, len(pieces)), dtype=np.int64).reshape(-1, 1)
        i = tg.InferInput("VOCAB_IDS", list(ids.shape), "INT64")
        i.set_data_from_numpy(ids)
        answer = teacher.infer([i], ("VOCAB_PIECES",)).as_numpy("VOCAB_PIECES")
        assert answer.shape == ids.shape
        got.extend(bytes(p) for p in answer[:, 0])
    assert got == [p or b"" for p in pieces]
    for bad in (-1, len(pieces)):
        i = tg.InferInput("VOCAB_IDS", [2, 1], "INT64")
        i.set_data_from_numpy(np.array([[0], [bad]], dtype=np.int64))
        _refused(teacher, [i], f"id {bad} at row 1", f"0..{len(pieces) - 1}", outputs=("VOCAB_PIECES",))


# ---- refusals --------------------------------------------------------------------------------------
def test_bad_text_requests_are_refused_and_the_teacher_goes_on(teacher: Teacher) -> None:
    _refused(teacher, [_text(["fine", b"\xff\xfe"])], "row 1 is not UTF-8")
    _refused(teacher, [_text(["fine", ""])], "row 1 is empty")
    long = "the teacher " * CONTEXT
    count = len(teacher.tokenizer(long)["input_ids"])
    _refused(teacher, [_text(["fine", long])], "row 1", f"{count} tokens", f"context of {CONTEXT}")
    ids = np.ones((1, 3), dtype=np.int64)
    _refused(teacher, [_text(["fine"]), *_ids(ids, ids)], "not both")
    wrong = tg.InferInput("TEXT", [1, 1], "INT64")
    wrong.set_data_from_numpy(np.ones((1, 1), dtype=np.int64))
    _refused(teacher, [wrong], "send BYTES [B, 1]")
    flat = tg.InferInput("TEXT", [2], "BYTES")
    flat.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    _refused(teacher, [flat], "'BYTES' [2] received", "[B, 1]")
    _refused(teacher, [_text(["fine"])], "VOCAB_IDS", outputs=("VOCAB_PIECES",))
    r = teacher.infer([_text(TEXTS[:1])], token_logprobs=True)
    assert r.as_numpy("LOGITS_TOKEN_LOGPROBS").shape[0] == 1, "still serving"


@pytest.fixture(scope="module")
def bare_teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    directory = tmp_path_factory.mktemp("bare-llama")
    save_llama(directory)  # no tokenizer files
    with ServerThread(ServerConfig(model=f"hf:{directory}", name="bare", device="cpu")) as s:
        yield s


def test_a_teacher_without_a_tokenizer_says_what_its_directory_needs(bare_teacher: ServerThread) -> None:
    assert bare_teacher.server is not None
    assert not bare_teacher.server.record().capabilities.text_prompts
    with tg.InferenceServerClient(bare_teacher.url) as client:
        names = [i["name"] for i in client.get_model_metadata("bare", as_json=True)["inputs"]]
        assert names == ["INPUT_IDS", "ATTENTION_MASK"]
        with pytest.raises(InferenceServerException) as e:
            client.infer("bare", [_text(["some text"])])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "holds no tokenizer files" in e.value.message() and "save_pretrained" in e.value.message()
        ids = np.ones((1, 3), dtype=np.int64)
        assert client.infer("bare", _ids(ids, ids)).as_numpy("LOGITS").shape[:2] == (1, 3)
