"""Variable-length requests in the dynamic batcher (issue #11), against real servers.

Without a padding declaration, requests whose client-sized dimensions differ never share a
batch; with one, they are padded to the longest in the batch, the attention mask is built when a
client sends none, outputs are cut back to each request's length, and batches stay within
--max-batch-tokens. Every output is checked against the model run in-process on that sequence alone.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from teacher_server import BatchingConfig, ModelIO, ServerConfig, SpecError, TensorSpec
from teacher_server.cli import build_parser, config_from_args
from teacher_server.model_config import ModelFileConfig
from tests import seq_models
from tests.servers import ServerThread

PADDED = "tests.seq_models:causal_conv_lm"
UNPADDED = "tests.seq_models:unpadded_seq"


def _server(model: str, delay_us: int = 20000, max_batch_tokens: int = 0, max_batch_size: int = 64) -> ServerThread:
    return ServerThread(ServerConfig(
        model=model, name="seq", device="cpu", instances=1, metrics_port=0,
        batching=BatchingConfig(max_batch_size=max_batch_size, max_queue_delay_us=delay_us,
                                max_batch_tokens=max_batch_tokens),
    ))


@pytest.fixture(scope="module")
def reference() -> seq_models.CausalConvLM:
    return seq_models.causal_conv_lm()


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    seq_models.GATE.set()
    yield
    seq_models.GATE.set()


def _tokens(length: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    return g.integers(1, seq_models.VOCAB, size=(1, length), dtype=np.int64)


def _infer(c: tg.InferenceServerClient, tokens: np.ndarray, with_mask: bool = False,
           outputs: tuple[str, ...] = ("LOGITS", "POOLED")) -> tg.InferResult:
    inputs = [tg.InferInput("TOKENS", list(tokens.shape), "INT64")]
    inputs[0].set_data_from_numpy(tokens)
    if with_mask:
        inputs.append(tg.InferInput("MASK", list(tokens.shape), "INT64"))
        inputs[1].set_data_from_numpy(np.ones_like(tokens))
    return c.infer("seq", inputs, outputs=[tg.InferRequestedOutput(n) for n in outputs], client_timeout=60)


def _check(ref: seq_models.CausalConvLM, tokens: np.ndarray, result: tg.InferResult) -> None:
    """The server's answer equals the model run in-process on this sequence alone, unpadded."""
    t = torch.from_numpy(tokens)
    with torch.inference_mode():
        want = ref(t, torch.ones_like(t))
    logits = result.as_numpy("LOGITS")
    assert logits is not None and logits.shape == (1, tokens.shape[1], seq_models.VOCAB)
    assert torch.allclose(torch.from_numpy(logits), want["LOGITS"], atol=1e-5)
    pooled = result.as_numpy("POOLED")
    assert pooled is not None
    assert torch.allclose(torch.from_numpy(pooled), want["POOLED"], atol=1e-5)


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _metric(s: ServerThread, name: str) -> float:
    assert s.server is not None and s.server.metrics_port is not None
    body = urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


class _Queued:
    """Holds the only model instance busy (GATE closed) on a first request, then queues requests
    one by one in a known order; release() lets every batch run and returns the results."""

    def __init__(self, s: ServerThread, first: int) -> None:
        self.s = s
        self.client = tg.InferenceServerClient(s.url)
        self.results: dict[int, tg.InferResult | InferenceServerException] = {}
        self.done = threading.Event()
        self.sent: list[np.ndarray] = []
        seq_models.GATE.clear()
        seq_models.BATCHES.clear()
        self.add(first)
        assert s.server is not None
        batcher = s.server.batcher
        _wait_for("the first request to reach the model", lambda: batcher.executing == 1)

    def add(self, length: int) -> None:
        assert self.s.server is not None
        batcher = self.s.server.batcher
        before = batcher.queue_depth
        k = len(self.sent)
        tokens = _tokens(length, seed=100 + k)
        self.sent.append(tokens)

        def callback(result: tg.InferResult | None, error: InferenceServerException | None) -> None:
            if error is not None:
                self.results[k] = error
            elif result is not None:
                self.results[k] = result
            if len(self.results) == len(self.sent):
                self.done.set()

        inp = tg.InferInput("TOKENS", [1, length], "INT64")
        inp.set_data_from_numpy(tokens)
        self.client.async_infer("seq", [inp], callback, client_timeout=60)
        if k > 0:
            _wait_for(f"request {k} to be queued", lambda: batcher.queue_depth == before + 1)

    def release(self) -> list[tg.InferResult | InferenceServerException]:
        seq_models.GATE.set()
        assert self.done.wait(60), "queued requests did not all finish"
        self.client.close()
        return [self.results[k] for k in range(len(self.sent))]


def _ok(r: tg.InferResult | InferenceServerException) -> tg.InferResult:
    assert not isinstance(r, InferenceServerException), r
    return r


# ---- padded model --------------------------------------------------------------------------------
def test_mixed_lengths_from_concurrent_clients_match_the_model_alone(reference: seq_models.CausalConvLM) -> None:
    n_clients, per_client = 6, 6
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_clients)
    rng = random.Random(11)
    lengths = [[rng.randint(5, 40) for _ in range(per_client)] for _ in range(n_clients)]
    with _server(PADDED) as s:
        useful0 = _metric(s, "teacher_useful_tokens_total")

        def run(k: int) -> None:
            try:
                with tg.InferenceServerClient(s.url) as c:
                    barrier.wait(30)
                    for j in range(per_client):
                        tokens = _tokens(lengths[k][j], seed=k * per_client + j)
                        _check(reference, tokens, _infer(c, tokens, with_mask=j % 2 == 1))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads)
        useful = _metric(s, "teacher_useful_tokens_total") - useful0
        padded = _metric(s, "teacher_padded_tokens_total")
    assert useful == sum(map(sum, lengths))
    assert padded >= useful


def test_queued_requests_share_padded_batches_by_length_bucket(reference: seq_models.CausalConvLM) -> None:
    with _server(PADDED) as s:
        q = _Queued(s, first=20)
        for length in (9, 5, 11, 30, 13, 7, 16):
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
        useful = _metric(s, "teacher_useful_tokens_total")
        padded = _metric(s, "teacher_padded_tokens_total")
    for tokens, r in zip(q.sent, results, strict=True):
        _check(reference, tokens, _ok(r))  # no mask sent: the server built it
    # Oldest first; each batch takes the queued requests of its first request's length bucket
    # while its padding efficiency stays >= 0.85: 9 takes 11 (20 / 22), not 13 (33 / 39) or 16.
    assert batches == [(1, 20), (2, 11), (2, 7), (1, 30), (2, 16)]
    lengths = [20, 9, 5, 11, 30, 13, 7, 16]
    assert useful == sum(lengths)
    assert padded == 20 + 2 * 11 + 2 * 7 + 30 + 2 * 16


def test_max_batch_tokens_bounds_a_batch(reference: seq_models.CausalConvLM) -> None:
    with _server(PADDED, max_batch_tokens=40) as s:
        q = _Queued(s, first=3)
        for length in (9, 12, 10, 16, 15):
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
    for tokens, r in zip(q.sent, results, strict=True):
        _check(reference, tokens, _ok(r))
    # 9, 12, 10 pad to 3 x 12 = 36 tokens; adding 16 would make 4 x 16 = 64 > 40.
    assert batches == [(1, 3), (3, 12), (2, 16)]


def test_the_default_bound_of_a_padded_model_is_a_token_budget(reference: seq_models.CausalConvLM) -> None:
    # max_batch_size 4 and no --max-batch-tokens: batches hold up to 4 x 64 = 256 positions, so six
    # sequences of 8 share one batch, and sequences of 60 go four at a time.
    assert BatchingConfig(max_batch_size=4).token_budget == 256
    assert BatchingConfig(max_batch_size=4, max_batch_tokens=100).token_budget == 100
    with _server(PADDED, max_batch_size=4) as s:
        q = _Queued(s, first=20)
        for length in (8,) * 6 + (60,) * 5:
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
    for tokens, r in zip(q.sent, results, strict=True):
        _check(reference, tokens, _ok(r))
    assert batches == [(1, 20), (6, 8), (4, 60), (1, 60)]


def test_a_sent_mask_is_padded_and_used() -> None:
    # The client's own mask hides its last positions: POOLED must average only the marked ones.
    ref = seq_models.causal_conv_lm()
    tokens = _tokens(12, seed=5)
    mask = np.ones_like(tokens)
    mask[0, 8:] = 0
    with _server(PADDED, delay_us=0) as s, tg.InferenceServerClient(s.url) as c:
        inputs = [tg.InferInput("TOKENS", [1, 12], "INT64"), tg.InferInput("MASK", [1, 12], "INT64")]
        inputs[0].set_data_from_numpy(tokens)
        inputs[1].set_data_from_numpy(mask)
        got = c.infer("seq", inputs, client_timeout=60).as_numpy("POOLED")
    with torch.inference_mode():
        want = ref(torch.from_numpy(tokens), torch.from_numpy(mask))["POOLED"]
    assert got is not None and torch.allclose(torch.from_numpy(got), want, atol=1e-5)


def test_padded_inputs_of_one_request_must_agree_on_length() -> None:
    with _server(PADDED, delay_us=0) as s, tg.InferenceServerClient(s.url) as c:
        inputs = [tg.InferInput("TOKENS", [1, 12], "INT64"), tg.InferInput("MASK", [1, 10], "INT64")]
        inputs[0].set_data_from_numpy(_tokens(12, seed=1))
        inputs[1].set_data_from_numpy(np.ones((1, 10), dtype=np.int64))
        with pytest.raises(InferenceServerException, match="sequence length 10 differs"):
            c.infer("seq", inputs, client_timeout=60)


# ---- no padding declared -------------------------------------------------------------------------
def test_unpadded_variable_lengths_from_concurrent_clients_all_succeed() -> None:
    # Issue #11: lengths 5, 7, 11, 13 from 4 concurrent clients used to fail with "Sizes of tensors
    # must match" when the batcher concatenated them.
    ref = seq_models.unpadded_seq()
    errors: list[BaseException] = []
    lengths = (5, 7, 11, 13)
    barrier = threading.Barrier(len(lengths))
    with _server(UNPADDED) as s:
        def run(k: int) -> None:
            try:
                with tg.InferenceServerClient(s.url) as c:
                    barrier.wait(30)
                    for j in range(10):
                        tokens = _tokens(lengths[k], seed=k * 10 + j)
                        inp = tg.InferInput("TOKENS", list(tokens.shape), "INT64")
                        inp.set_data_from_numpy(tokens)
                        got = c.infer("seq", [inp], client_timeout=60).as_numpy("LOGITS")
                        with torch.inference_mode():
                            want = ref(torch.from_numpy(tokens))
                        assert got is not None and torch.allclose(torch.from_numpy(got), want, atol=1e-5)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(lengths))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert _metric(s, "teacher_padded_tokens_total") == 0  # nothing is padded without a declaration


def test_unpadded_requests_are_grouped_by_shape() -> None:
    with _server(UNPADDED) as s:
        q = _Queued(s, first=4)
        for length in (5, 7, 5, 7, 5, 9):
            q.add(length)
        results = q.release()
        batches = list(seq_models.BATCHES)
    ref = seq_models.unpadded_seq()
    for tokens, r in zip(q.sent, results, strict=True):
        got = _ok(r).as_numpy("LOGITS")
        with torch.inference_mode():
            want = ref(torch.from_numpy(tokens))
        assert got is not None and torch.allclose(torch.from_numpy(got), want, atol=1e-5)
    # Equal shapes share a batch across other shapes queued between them; unequal ones never do.
    assert batches == [(1, 4), (3, 5), (2, 7), (1, 9)]


# ---- declarations --------------------------------------------------------------------------------
def test_flag_forms() -> None:
    io = ModelIO.parse(["TOKENS:INT64:-1:pad=0", "MASK:INT64:-1"], ["LOGITS:FP32:-1,50:per_position"],
                       attention_mask="MASK")
    assert io.padded and io.attention_mask == "MASK"
    assert io.inputs[0].pad_value == 0 and io.inputs[1].attention_mask
    assert io.outputs[0].per_position and io.outputs[0].seq_axis == 0
    assert ModelIO.parse(["TOKENS:INT64:-1:pad=0", "M:INT64:-1:mask"]).attention_mask == "M"
    assert not ModelIO.parse(["TOKENS:INT64:-1"]).padded


@pytest.mark.parametrize("inputs,outputs,mask,why", [
    (["T:INT64:-1,-1:pad=0"], [], None, "exactly one -1"),
    (["T:INT64:8:pad=0"], [], None, "exactly one -1"),
    (["T:INT64:-1:pad=0.5"], [], None, "does not fit INT64"),
    (["T:INT64:-1:padding"], [], None, "unknown option"),
    (["T:INT64:-1:pad=x"], [], None, "bad pad value"),
    (["T:INT64:-1", "M:INT64:-1"], [], "M", "no input is padded"),
    (["T:INT64:-1:pad=0"], [], "M", "not one of the inputs"),
    (["T:INT64:-1:pad=0"], ["L:FP32:-1:pad=0"], None, "belong to inputs"),
    (["T:INT64:-1:per_position"], [], None, "belongs to outputs"),
])
def test_bad_declarations_are_refused(inputs: list[str], outputs: list[str], mask: str | None, why: str) -> None:
    with pytest.raises(SpecError, match=why):
        ModelIO.parse(inputs, outputs, mask)


def test_model_config_json(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({
        "inputs": [{"name": "TOKENS", "datatype": "INT64", "shape": [-1], "pad_value": 0},
                   {"name": "MASK", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "LOGITS", "datatype": "FP32", "shape": [-1, 50], "per_position": True}],
        "attention_mask": "MASK",
    }))
    io = ModelFileConfig.load(path).io
    assert io is not None
    assert io == ModelIO((TensorSpec("TOKENS", "INT64", (-1,), 0.0), TensorSpec("MASK", "INT64", (-1,))),
                         (TensorSpec("LOGITS", "FP32", (-1, 50), per_position=True),), "MASK")


def test_cli_flags() -> None:
    args = build_parser().parse_args([
        "--model", PADDED, "--device", "cpu", "--input", "TOKENS:INT64:-1:pad=0", "--input", "MASK:INT64:-1",
        "--output", "LOGITS:FP32:-1,50:per_position", "--attention-mask", "MASK", "--max-batch-tokens", "4096",
    ])
    cfg = config_from_args(args)
    assert cfg.io is not None and cfg.io.attention_mask == "MASK" and cfg.io.inputs[0].pad_value == 0
    assert cfg.io.outputs[0].per_position
    assert cfg.batching.max_batch_tokens == 4096
    bad = build_parser().parse_args(["--model", PADDED, "--device", "cpu", "--max-batch-tokens", "-1"])
    with pytest.raises(SpecError, match="--max-batch-tokens must be >= 0"):
        config_from_args(bad)
    no_inputs = build_parser().parse_args(["--model", PADDED, "--device", "cpu", "--attention-mask", "MASK"])
    with pytest.raises(SpecError, match="--attention-mask needs the inputs declared"):
        config_from_args(no_inputs)
