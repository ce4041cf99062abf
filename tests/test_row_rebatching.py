"""Teachers re-batch what students pad (issue 26): a padded request's rows are cut back to their
attention masks on arrival, batched with every other queued sequence, and the answer comes back
at the request's padded width, zeros at padding, in row order.

Against real servers: the tiny Llama served as `hf:DIR` by a teacher process (its answer to a
padded batch equals the same rows sent one by one; the token metrics count by the mask), and the
causal conv model of `tests.seq_models` with its instance held busy, so the batches that form
from a padded request, a tritonclient gRPC client and an HTTP client can be seen.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from teacher_server import BatchingConfig, ServerConfig
from tests import seq_models
from tests.servers import ServerThread, teacher_process
from tests.test_padded_batching import PADDED, _wait_for

transformers = pytest.importorskip("transformers")

VOCAB = 97


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    return directory


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    seq_models.GATE.set()
    yield
    seq_models.GATE.set()


def _inputs(names: tuple[str, str], ids: np.ndarray, mask: np.ndarray | None) -> list[tg.InferInput]:
    out = []
    for name, x in zip(names, (ids, mask), strict=True):
        if x is None:
            continue
        i = tg.InferInput(name, list(x.shape), "INT64")
        i.set_data_from_numpy(x)
        out.append(i)
    return out


def _tokens_total(metrics_port: int) -> tuple[float, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    found = {}
    for line in body.splitlines():
        for name in ("teacher_useful_tokens_total", "teacher_padded_tokens_total"):
            if line.startswith(name + "{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found["teacher_useful_tokens_total"], found["teacher_padded_tokens_total"]


def _padded_batch(lengths: list[int], width: int, seed: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded rows of `lengths`, pad id 0, at `width`."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(1, vocab, size=n)
        mask[r, :n] = 1
    return ids, mask


# ---- the tiny Llama, served by a teacher process -----------------------------------------------
def test_a_padded_request_equals_its_rows_sent_one_by_one(llama_dir: Path, tmp_path: Path) -> None:
    lengths, width = [12, 5, 9, 1], 16
    ids, mask = _padded_batch(lengths, width, seed=1, vocab=VOCAB)
    args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--metrics-port", "0", "--max-queue-delay-us", "20000"]
    params = {"logprobs": True, "top_k": 8, "topk_tail": True}
    with teacher_process(args, tmp_path) as (_, info), tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as c:
        names = ("INPUT_IDS", "ATTENTION_MASK")
        useful0, computed0 = _tokens_total(int(info["metrics_port"]))
        full = c.infer("llama", _inputs(names, ids, mask), client_timeout=60)
        topk = c.infer("llama", _inputs(names, ids, mask), parameters=params, client_timeout=60)
        useful1, computed1 = _tokens_total(int(info["metrics_port"]))
        alone = [c.infer("llama", _inputs(names, ids[r : r + 1, :n], None), client_timeout=60)
                 for r, n in enumerate(lengths)]
        alone_topk = [c.infer("llama", _inputs(names, ids[r : r + 1, :n], None), parameters=params, client_timeout=60)
                      for r, n in enumerate(lengths)]
    logits = full.as_numpy("LOGITS")
    assert logits is not None and logits.shape == (4, width, VOCAB)
    for r, n in enumerate(lengths):
        one = alone[r].as_numpy("LOGITS")
        assert one is not None and one.shape == (1, n, VOCAB)
        assert np.allclose(logits[r, :n], one[0], atol=1e-5), f"row {r}"
        assert not logits[r, n:].any(), f"row {r}: padding must come back as zeros"
        for out, tol in (("LOGITS_TOPK_VALUES", 1e-5), ("LOGITS_TOPK_INDICES", 0), ("LOGITS_TOPK_TAIL", 1e-6)):
            got, want = topk.as_numpy(out), alone_topk[r].as_numpy(out)
            assert got is not None and want is not None and got.shape[:2] == (4, width)
            assert np.allclose(got[r, :n], want[0], atol=tol), f"row {r} {out}"
            assert not got[r, n:].any(), f"row {r} {out}: padding must come back as zeros"
    # Two padded requests: the metrics count the positions the masks mark, and the rows were cut
    # back before they ran (sent as is, each request computes 4 x 16 positions).
    assert useful1 - useful0 == 2 * sum(lengths)
    assert 2 * sum(lengths) <= computed1 - computed0 < 2 * len(lengths) * width


# ---- the conv model, instance held busy: which batches form -------------------------------------
class _Held:
    """A server whose one instance is held busy (GATE closed) on a first request, so requests sent
    afterwards queue in a known order; release() lets everything run."""

    def __init__(self, s: ServerThread) -> None:
        self.s = s
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        seq_models.GATE.clear()
        seq_models.BATCHES.clear()
        assert s.server is not None
        self.batcher = s.server.batcher
        self.send(lambda: self._grpc(np.ones((1, 30), dtype=np.int64), None, ("LOGITS",)), rows=0)
        _wait_for("the first request to reach the model", lambda: self.batcher.executing == 1)

    def _grpc(self, ids: np.ndarray, mask: np.ndarray | None, outputs: tuple[str, ...]) -> tg.InferResult:
        with tg.InferenceServerClient(self.s.url) as c:
            return c.infer("seq", _inputs(("TOKENS", "MASK"), ids, mask),
                           outputs=[tg.InferRequestedOutput(o) for o in outputs], client_timeout=60)

    def send(self, call: object, rows: int) -> dict[str, object]:
        """Run call() on a thread; wait until its `rows` queued rows are in the batcher's queue."""
        box: dict[str, object] = {}
        before = self.batcher.queue_depth

        def run() -> None:
            try:
                box["result"] = call()  # type: ignore[operator]
            except BaseException as e:
                box["error"] = e
                self.errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)
        if rows:
            _wait_for(f"{rows} rows to be queued", lambda: self.batcher.queue_depth == before + rows)
        return box

    def release(self) -> None:
        seq_models.GATE.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads)
        assert not self.errors, self.errors[0]


def _reference(tokens: np.ndarray, mask: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    ref = seq_models.causal_conv_lm()
    t = torch.from_numpy(tokens)
    with torch.inference_mode():
        out: dict[str, torch.Tensor] = ref(t, torch.ones_like(t) if mask is None else torch.from_numpy(mask))
    return out


def _server(http: bool = False) -> ServerThread:
    return ServerThread(ServerConfig(
        model=PADDED, name="seq", device="cpu", instances=1, metrics_port=0, http_port=0 if http else None,
        batching=BatchingConfig(max_batch_size=64, max_queue_delay_us=20000)))


def test_padded_and_unpadded_clients_share_batches() -> None:
    """Rows of a padded gRPC request, a single sequence from tritonclient gRPC and one from the
    HTTP front end, queued together: each row batches with the sequences of its length."""
    ids, mask = _padded_batch([7, 16, 3], 20, seed=2, vocab=seq_models.VOCAB)
    single8 = np.random.default_rng(3).integers(1, seq_models.VOCAB, size=(1, 8), dtype=np.int64)
    single15 = np.random.default_rng(4).integers(1, seq_models.VOCAB, size=(1, 15), dtype=np.int64)
    with _server(http=True) as s:
        held = _Held(s)
        padded = held.send(lambda: held._grpc(ids, mask, ("LOGITS", "POOLED")), rows=3)
        grpc_one = held.send(lambda: held._grpc(single8, None, ("LOGITS", "POOLED")), rows=1)

        def over_http() -> th.InferResult:
            with th.InferenceServerClient(f"127.0.0.1:{s.server.http_port}", network_timeout=60) as c:  # type: ignore[union-attr]
                inp = th.InferInput("TOKENS", [1, 15], "INT64")
                inp.set_data_from_numpy(single15)
                return c.infer("seq", [inp], outputs=[th.InferRequestedOutput("LOGITS"),
                                                      th.InferRequestedOutput("POOLED")])

        http_one = held.send(over_http, rows=1)
        held.release()
        batches = list(seq_models.BATCHES)
        useful, computed = _tokens_total(s.server.metrics_port)  # type: ignore[union-attr,arg-type]
    # Oldest first: row 7 takes the 8 of its length bucket, row 16 takes the 15, row 3 runs alone.
    assert batches == [(1, 30), (2, 8), (2, 16), (1, 3)]
    assert useful == 30 + 7 + 16 + 3 + 8 + 15
    assert computed == 30 + 2 * 8 + 2 * 16 + 3
    result = padded["result"]
    assert isinstance(result, tg.InferResult)
    logits, pooled = result.as_numpy("LOGITS"), result.as_numpy("POOLED")
    assert logits is not None and logits.shape == (3, 20, seq_models.VOCAB)
    assert pooled is not None and pooled.shape == (3, seq_models.HIDDEN)
    for r, n in enumerate([7, 16, 3]):
        want = _reference(ids[r : r + 1, :n])
        assert torch.allclose(torch.from_numpy(logits[r : r + 1, :n]), want["LOGITS"], atol=1e-5)
        assert not logits[r, n:].any()
        assert torch.allclose(torch.from_numpy(pooled[r : r + 1]), want["POOLED"], atol=1e-5)
    for box, tokens in ((grpc_one, single8), (http_one, single15)):
        got = box["result"]
        want = _reference(tokens)
        assert torch.allclose(torch.from_numpy(got.as_numpy("LOGITS")), want["LOGITS"], atol=1e-5)  # type: ignore[attr-defined]
        assert torch.allclose(torch.from_numpy(got.as_numpy("POOLED")), want["POOLED"], atol=1e-5)  # type: ignore[attr-defined]


def test_left_right_and_inner_padding() -> None:
    """Each row is cut to its first..last marked position: right, left and both-sided padding give
    the row's own answer there and zeros around it; zeros inside a row stay, with its mask."""
    rng = np.random.default_rng(5)
    ids = rng.integers(1, seq_models.VOCAB, size=(5, 12), dtype=np.int64)
    mask = np.zeros_like(ids)
    spans = [(0, 9), (4, 12), (2, 10), (0, 12), (0, 0)]
    for r, (a, b) in enumerate(spans):
        mask[r, a:b] = 1
    mask[3, 5:7] = 0  # zeros inside a row
    with _server() as s, tg.InferenceServerClient(s.url) as c:
        got = c.infer("seq", _inputs(("TOKENS", "MASK"), ids, mask), outputs=[tg.InferRequestedOutput("LOGITS")],
                      client_timeout=60).as_numpy("LOGITS")
        useful, _ = _tokens_total(s.server.metrics_port)  # type: ignore[union-attr,arg-type]
    assert got is not None and got.shape == (5, 12, seq_models.VOCAB)
    assert useful == mask.sum()
    for r, (a, b) in enumerate(spans):
        assert not got[r, :a].any() and not got[r, b:].any(), f"row {r}: padding must be zeros"
        if a < b:
            want = _reference(ids[r : r + 1, a:b], mask[r : r + 1, a:b])["LOGITS"]
            assert torch.allclose(torch.from_numpy(got[r : r + 1, a:b]), want, atol=1e-5), f"row {r}"


def test_rows_that_are_all_padding() -> None:
    """A row with no marked position has per-position answers of zeros, but no sequence-level
    answer: asking for one is refused naming the row, and so is a request with no marked position."""
    ids, mask = _padded_batch([6, 0, 4], 8, seed=6, vocab=seq_models.VOCAB)
    with _server() as s, tg.InferenceServerClient(s.url) as c:
        names = ("TOKENS", "MASK")
        logits = c.infer("seq", _inputs(names, ids, mask), outputs=[tg.InferRequestedOutput("LOGITS")],
                         client_timeout=60).as_numpy("LOGITS")
        with pytest.raises(InferenceServerException, match="row 1 marks no position, and output 'POOLED'") as e:
            c.infer("seq", _inputs(names, ids, mask), client_timeout=60)
        assert "INVALID_ARGUMENT" in str(e.value.status())
        with pytest.raises(InferenceServerException, match="marks no position in any row") as e:
            c.infer("seq", _inputs(names, ids, np.zeros_like(mask)), outputs=[tg.InferRequestedOutput("LOGITS")],
                    client_timeout=60)
        assert "INVALID_ARGUMENT" in str(e.value.status())
    assert logits is not None and logits.shape == (3, 8, seq_models.VOCAB)
    assert not logits[1].any()
    assert torch.allclose(torch.from_numpy(logits[2:, :4]), _reference(ids[2:, :4])["LOGITS"], atol=1e-5)


def test_outputs_derived_from_a_per_position_output_are_reassembled_along_its_axis() -> None:
    """Any `<OUT>_...` output a transform adds to a per-position output is per-position too; a
    declared output that is not per-position is concatenated even when its name shares the prefix."""
    from teacher_server.rows import Rows

    rows = Rows([], [(0, 2), (1, 3)], 3, {"LOGITS": 1}, frozenset({"LOGITS_POOLED"}))
    assert rows.axis("LOGITS") == 1 and rows.axis("LOGITS_TOPK_VALUES") == 1 and rows.axis("LOGITS_SCORES") == 1
    assert rows.axis("LOGITS_POOLED") is None and rows.axis("POOLED") is None
    a = ("LOGITS_SCORES", "FP32", [1, 2], np.array([[1, 2]], dtype=np.float32).tobytes())
    b = ("LOGITS_SCORES", "FP32", [1, 2], np.array([[3, 4]], dtype=np.float32).tobytes())
    [(name, dtype, shape, raw)] = rows.assemble([[a], [b]])
    assert (name, dtype, shape) == ("LOGITS_SCORES", "FP32", [2, 3])
    assert np.frombuffer(raw, dtype=np.float32).reshape(2, 3).tolist() == [[1, 2, 0], [0, 3, 4]]
