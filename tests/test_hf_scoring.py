"""Scoring given tokens on an `hf:DIR` teacher: `token_logprobs` and `SCORE_IDS` through a real
teacher process, concurrent requests of mixed lengths, against log_softmax(model(x) / T) in
process; ids, score ids and lengths beyond the model refused per request while the rest of the
batch is answered; the output projection applied a chunk of positions at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as tga
from tritonclient.utils import InferenceServerException

from teacher_server.instance import ModelInstance
from teacher_server.model import load_model
from teacher_server.outputs import OutputTransform
from teacher_server.scoring import head_split
from teacher_server.spec import SpecError
from teacher_server.validation import pad_plan
from teacher_server.work import Work
from tests.hf_models import load_reference
from tests.servers import teacher_process

transformers = pytest.importorskip("transformers")

VOCAB, CONTEXT = 97, 64


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("scoring-llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def teacher(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One teacher process; a batch closes when 4 requests are in it (or after 2 s)."""
    args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "4", "--max-queue-delay-us", "2000000"]
    with teacher_process(args, tmp_path_factory.mktemp("scoring-logs")) as (_, info):
        yield info


def _log_probs(model: torch.nn.Module, ids: np.ndarray, temperature: float) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.from_numpy(ids)).logits
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _want_tokens(lp: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    """log p(x[t+1] | x[<=t]) at t, 0 at the last position."""
    nxt = torch.from_numpy(ids[:, 1:]).unsqueeze(-1)
    out = torch.zeros(ids.shape)
    out[:, :-1] = lp[:, :-1].gather(-1, nxt).squeeze(-1)
    return out.numpy()


def _inputs(ids: np.ndarray, scores: np.ndarray | None) -> list[tga.InferInput]:
    i = tga.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    i.set_data_from_numpy(ids)
    out = [i]
    if scores is not None:
        s = tga.InferInput("SCORE_IDS", list(scores.shape), "INT32")
        s.set_data_from_numpy(scores)
        out.append(s)
    return out


async def _infer_all(url: str, calls: list[tuple[np.ndarray, np.ndarray | None, dict[str, Any]]]) -> list[Any]:
    client = tga.InferenceServerClient(url)
    try:
        before = await client.get_inference_statistics("llama", as_json=True)
        results = await asyncio.gather(
            *(client.infer("llama", _inputs(ids, scores), parameters=params, client_timeout=60)
              for ids, scores, params in calls), return_exceptions=True)
        after = await client.get_inference_statistics("llama", as_json=True)
    finally:
        await client.close()
    executions = int(after["model_stats"][0].get("execution_count", 0)) - int(
        before["model_stats"][0].get("execution_count", 0))  # JSON leaves a count of 0 out
    return [*results, executions]


def _sequences(lengths: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=(1, n), dtype=np.int64) for n in lengths]


def test_token_and_scored_logprobs_of_one_batch_of_mixed_lengths_match_the_model(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """Four sequences of 13-16 tokens (a batch above the batcher's 0.85 padding floor), each with its
    own number of score ids, run as one padded batch (one execution), with top-k, tail and
    temperature in the same request."""
    seqs = _sequences((13, 14, 15, 16), seed=1)
    rng = np.random.default_rng(2)
    scores = [rng.integers(0, VOCAB, size=(1, s.shape[1], m), dtype=np.int32) for s, m in zip(seqs, (3, 5, 1, 4),
                                                                                           strict=True)]
    params = {"token_logprobs": True, "temperature": 2.0, "top_k": 4, "topk_tail": True, "logprobs": True}
    *results, executions = asyncio.run(_infer_all(
        f"127.0.0.1:{teacher['port']}", [(s, sc, params) for s, sc in zip(seqs, scores, strict=True)]))
    assert executions == 1
    for ids, sc, r in zip(seqs, scores, results, strict=True):
        lp = _log_probs(reference, ids, 2.0)
        assert {o.name for o in r.get_response().outputs} == {
            "LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES", "LOGITS_TOPK_TAIL", "LOGITS_TOKEN_LOGPROBS",
            "LOGITS_SCORED_LOGPROBS"}
        tokens = r.as_numpy("LOGITS_TOKEN_LOGPROBS")
        assert tokens.shape == ids.shape and tokens.dtype == np.float32
        assert np.allclose(tokens, _want_tokens(lp, ids), atol=1e-4)
        assert tokens[0, -1] == 0.0 and (tokens[0, :-1] < 0).all()
        scored = r.as_numpy("LOGITS_SCORED_LOGPROBS")
        assert scored.shape == sc.shape
        assert np.allclose(scored, lp.gather(-1, torch.from_numpy(sc).long()).numpy(), atol=1e-4)
        top = torch.topk(lp, 4, dim=-1)
        assert np.allclose(r.as_numpy("LOGITS_TOPK_VALUES"), top.values.numpy(), atol=1e-4)
        assert np.array_equal(r.as_numpy("LOGITS_TOPK_INDICES"), top.indices.numpy())


def test_a_student_padded_scoring_request_is_scored_row_by_row(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """One request of 3 rows right-padded to 12 with an attention mask and SCORE_IDS padded like the
    ids: the teacher cuts the rows back to their masks, each with its own slice of SCORE_IDS, and
    the answer at the padded width equals each row scored alone, zeros at padding."""
    lengths = (12, 7, 9)
    seqs = _sequences(lengths, seed=5)
    rng = np.random.default_rng(6)
    ids = np.zeros((3, 12), dtype=np.int64)
    mask = np.zeros((3, 12), dtype=np.int64)
    scores = np.zeros((3, 12, 3), dtype=np.int32)
    for r, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        ids[r, :n], mask[r, :n] = s[0], 1
        scores[r, :n] = rng.integers(0, VOCAB, size=(n, 3), dtype=np.int32)
    inputs = _inputs(ids, scores)
    m = tga.InferInput("ATTENTION_MASK", list(mask.shape), "INT64")
    m.set_data_from_numpy(mask)
    inputs.append(m)
    params = {"token_logprobs": True, "temperature": 1.5, "top_k": 2}

    async def go() -> Any:
        client = tga.InferenceServerClient(f"127.0.0.1:{teacher['port']}")
        try:
            return await client.infer("llama", inputs, parameters=params, client_timeout=60)
        finally:
            await client.close()

    r = asyncio.run(asyncio.wait_for(go(), 90))
    tokens, scored = r.as_numpy("LOGITS_TOKEN_LOGPROBS"), r.as_numpy("LOGITS_SCORED_LOGPROBS")
    assert tokens.shape == (3, 12) and scored.shape == (3, 12, 3)
    for row, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        lp = _log_probs(reference, s, 1.5)
        assert np.allclose(tokens[row, :n], _want_tokens(lp, s)[0], atol=1e-4)
        want = lp[0].gather(-1, torch.from_numpy(scores[row, :n]).long()).numpy()
        assert np.allclose(scored[row, :n], want, atol=1e-4)
        assert (tokens[row, n:] == 0).all() and (scored[row, n:] == 0).all()


def test_mixed_requests_in_one_batch_each_get_what_they_asked(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """Requests wanting different transforms in one batch: token log-probs alone (no LOGITS, no
    top-k: 2 bytes a token in FP16), scores alone, full logits, and all of them per output."""
    seqs = _sequences((10, 12, 14, 15), seed=3)
    sc = np.random.default_rng(4).integers(0, VOCAB, size=(1, 12, 2), dtype=np.int32)
    calls: list[tuple[np.ndarray, np.ndarray | None, dict[str, Any]]] = [
        (seqs[0], None, {"token_logprobs": True, "output_dtype": "FP16"}),
        (seqs[1], sc, {}),
        (seqs[2], None, {}),
        (seqs[3], None, {"token_logprobs": True, "temperature": 0.5, "top_k": 2, "logprobs": True}),
    ]
    *results, executions = asyncio.run(_infer_all(f"127.0.0.1:{teacher['port']}", calls))
    assert executions == 1
    only_tokens, only_scores, full, topk = results
    assert [o.name for o in only_tokens.get_response().outputs] == ["LOGITS_TOKEN_LOGPROBS"]
    assert only_tokens.get_output("LOGITS_TOKEN_LOGPROBS").datatype == "FP16"
    assert len(only_tokens.get_response().raw_output_contents[0]) == 2 * seqs[0].shape[1]
    assert np.allclose(only_tokens.as_numpy("LOGITS_TOKEN_LOGPROBS").astype(np.float32),
                       _want_tokens(_log_probs(reference, seqs[0], 1.0), seqs[0]), atol=2e-2)
    assert [o.name for o in only_scores.get_response().outputs] == ["LOGITS_SCORED_LOGPROBS"]
    lp1 = _log_probs(reference, seqs[1], 1.0)
    assert np.allclose(only_scores.as_numpy("LOGITS_SCORED_LOGPROBS"),
                       lp1.gather(-1, torch.from_numpy(sc).long()).numpy(), atol=1e-4)
    with torch.inference_mode():
        logits = reference(input_ids=torch.from_numpy(seqs[2])).logits
    assert np.allclose(full.as_numpy("LOGITS"), logits.numpy(), atol=1e-4)
    lp3 = _log_probs(reference, seqs[3], 0.5)
    assert np.allclose(topk.as_numpy("LOGITS_TOKEN_LOGPROBS"), _want_tokens(lp3, seqs[3]), atol=1e-4)
    assert np.allclose(topk.as_numpy("LOGITS_TOPK_VALUES"), torch.topk(lp3, 2).values.numpy(), atol=1e-4)


def test_bad_ids_and_lengths_are_refused_and_the_batch_is_answered(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """An id beyond the vocabulary, a score id beyond it and a sequence beyond the context, sent
    among good requests: each bad one INVALID_ARGUMENT naming the tensor, the limit and the value;
    the good ones answered (today: INTERNAL 'index out of range in self' for the whole batch)."""
    good = _sequences((9, 12), seed=5)
    bad_id = _sequences((10,), seed=6)[0]
    bad_id[0, 4] = VOCAB + 3
    too_long = _sequences((CONTEXT + 6,), seed=7)[0]
    ok_ids = _sequences((11,), seed=8)[0]
    bad_scores = np.zeros((1, 11, 2), dtype=np.int32)
    bad_scores[0, 5, 1] = VOCAB
    calls: list[tuple[np.ndarray, np.ndarray | None, dict[str, Any]]] = [
        (good[0], None, {"token_logprobs": True}), (bad_id, None, {"token_logprobs": True}),
        (too_long, None, {"token_logprobs": True}), (ok_ids, bad_scores, {"token_logprobs": True}),
        (good[1], None, {"token_logprobs": True})]
    *results, _ = asyncio.run(_infer_all(f"127.0.0.1:{teacher['port']}", calls))
    for i in (0, 4):
        ids = calls[i][0]
        assert np.allclose(results[i].as_numpy("LOGITS_TOKEN_LOGPROBS"),
                           _want_tokens(_log_probs(reference, ids, 1.0), ids), atol=1e-4)
    refusals = {1: ("INPUT_IDS", f"id {VOCAB + 3}", f"vocabulary of {VOCAB}"),
                2: ("INPUT_IDS", f"sequence length {CONTEXT + 6}", f"context of {CONTEXT}"),
                3: ("SCORE_IDS", f"id {VOCAB}", f"classes of {VOCAB}")}
    for i, words in refusals.items():
        err = results[i]
        assert isinstance(err, InferenceServerException) and err.status() == "StatusCode.INVALID_ARGUMENT", err
        assert all(w in err.message() for w in words), err.message()


def test_the_projection_runs_a_chunk_at_a_time_and_changes_nothing(llama_dir: Path) -> None:
    """In process: the hf: teacher offers its forward pass split at the output projection; with
    it (chunks of 5 positions) and without it the outputs are the same."""
    model = load_model(f"hf:{llama_dir}", device="cpu")
    split = head_split(model.module)
    assert split is not None and split.head_output == "LOGITS"
    seqs = [torch.from_numpy(s) for s in _sequences((7, 12), seed=9)]
    scores = torch.from_numpy(np.random.default_rng(10).integers(0, VOCAB, size=(1, 12, 3), dtype=np.int32))
    want = [OutputTransform("LOGITS", None, 3, True, 1.5, True, token_logprobs=True)]
    plan = pad_plan(model.io)

    def run(chunked: bool, chunk_bytes: int) -> list[list[tuple[str, str, list[int], bytes]]]:
        inst = ModelInstance(model, 0, max_batch_size=4)
        inst.chunked = chunked
        inst.chunk_bytes = chunk_bytes
        works = [Work([s, torch.ones_like(s)], 1, want, (), s.shape[1], plan) for s in seqs]
        works[1].aux = {"SCORE_IDS": scores}
        try:
            return inst.run(works).per_request
        finally:
            inst.close()

    whole = run(False, 1 << 30)
    chunked = run(True, 5 * VOCAB * 4)
    assert [[(n, d, s) for n, d, s, _ in r] for r in whole] == [[(n, d, s) for n, d, s, _ in r] for r in chunked]
    for a, b in zip(whole, chunked, strict=True):
        for (name, _, _, x), (_, _, _, y) in zip(a, b, strict=True):
            dtype = np.int32 if name.endswith("INDICES") else np.float32
            assert np.allclose(np.frombuffer(x, dtype), np.frombuffer(y, dtype), atol=1e-5), name
    assert [n for n, *_ in chunked[1]][-1] == "LOGITS_SCORED_LOGPROBS"


def test_output_chunk_mb_sets_the_instances_chunks_and_changes_no_answer(llama_dir: Path) -> None:
    """--output-chunk-mb (serve()'s output_chunk_mb) reaches every model instance; a server with
    1 MiB chunks answers as the default one does."""
    from teacher_server import ServerConfig
    from teacher_server.api import server_config
    from teacher_server.cli import build_parser, flag_values
    from teacher_server.outputs import CHUNK_BYTES
    from tests.servers import ServerThread

    assert flag_values(build_parser().parse_args(["--model", "m:f", "--output-chunk-mb", "64"]))[
        "output_chunk_mb"] == 64
    assert server_config("m:f", output_chunk_mb=8).output_chunk_mb == 8
    with pytest.raises(SpecError, match="output_chunk_mb= must be >= 1"):
        server_config("m:f", output_chunk_mb=0)
    ids = _sequences((9, 14), seed=21)
    answers = []
    for mb in (CHUNK_BYTES >> 20, 1):
        cfg = ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu", instances=2, output_chunk_mb=mb)
        with ServerThread(cfg) as s:
            assert s.server is not None
            assert [inst.chunk_bytes for inst in s.server.batcher.instances] == [mb << 20] * 2
            results = asyncio.run(_infer_all(s.url, [(seq, None, {"top_k": 3, "logprobs": True}) for seq in ids]))
        answers.append([(r.as_numpy("LOGITS_TOPK_VALUES"), r.as_numpy("LOGITS_TOPK_INDICES")) for r in results[:-1]])
    for (v1, i1), (v2, i2) in zip(*answers, strict=True):
        assert np.array_equal(i1, i2) and np.allclose(v1, v2, atol=1e-6)


def test_scoring_over_http_with_per_output_parameters(llama_dir: Path, reference: torch.nn.Module) -> None:
    """KServe v2 HTTP/REST: token_logprobs as a parameter of the output, SCORE_IDS as binary data."""
    import tritonclient.http as th

    from teacher_server import ServerConfig
    from tests.servers import ServerThread

    ids = _sequences((13,), seed=11)[0]
    sc = np.random.default_rng(12).integers(0, VOCAB, size=(1, 13, 3), dtype=np.int32)
    with ServerThread(ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu", http_port=0)) as s:
        assert s.server is not None and s.server.http_port is not None
        c = th.InferenceServerClient(f"127.0.0.1:{s.server.http_port}", network_timeout=60.0)
        try:
            i = th.InferInput("INPUT_IDS", list(ids.shape), "INT64")
            i.set_data_from_numpy(ids)
            j = th.InferInput("SCORE_IDS", list(sc.shape), "INT32")
            j.set_data_from_numpy(sc, binary_data=True)
            out = th.InferRequestedOutput("LOGITS", binary_data=True)
            out._parameters["token_logprobs"] = True
            out._parameters["temperature"] = 1.5
            result = c.infer("llama", [i, j], outputs=[out])
        finally:
            c.close()
    lp = _log_probs(reference, ids, 1.5)
    assert np.allclose(result.as_numpy("LOGITS_TOKEN_LOGPROBS"), _want_tokens(lp, ids), atol=1e-4)
    assert np.allclose(result.as_numpy("LOGITS_SCORED_LOGPROBS"),
                       lp.gather(-1, torch.from_numpy(sc).long()).numpy(), atol=1e-4)


def test_an_unpadded_classifier_declares_its_limits_too() -> None:
    """A sequence classifier without a pad token has no padded axis; its context is checked all the same."""
    from teacher_server.errors import InvalidRequestError
    from teacher_server.hf_model import SEQUENCE_CLASSIFICATION, HFTeacher
    from teacher_server.infer_request import InferRequest, InputTensor
    from teacher_server.outputs import OutputDefaults
    from teacher_server.validation import validate

    io = HFTeacher(torch.nn.Identity(), SEQUENCE_CLASSIFICATION, 3, None, vocab_size=VOCAB, max_positions=16).io_spec
    assert io.inputs[0].seq_axis is None and (io.inputs[0].max_value, io.inputs[0].max_length) == (VOCAB, 16)

    def request(ids: list[int]) -> InferRequest:
        return InferRequest("m", inputs=[InputTensor("INPUT_IDS", "INT64", [1, len(ids)], ids),
                                         InputTensor("ATTENTION_MASK", "INT64", [1, len(ids)], [1] * len(ids))])

    assert validate(request(list(range(1, 17))), io, 4, OutputDefaults()).batch_size == 1
    with pytest.raises(InvalidRequestError, match="'INPUT_IDS': sequence length 17 exceeds the model's context of 16"):
        validate(request(list(range(1, 18))), io, 4, OutputDefaults())
    with pytest.raises(InvalidRequestError, match=rf"id -1 at \[0, 2\] is outside the vocabulary of {VOCAB}"):
        validate(request([1, 2, -1]), io, 4, OutputDefaults())


def test_a_model_that_caps_its_logits_is_not_split(tmp_path: Path) -> None:
    """Gemma 2 soft-caps its logits after the projection: the split would change them, so the
    teacher runs it whole (the check compares both on a short sequence at load)."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, pad_token_id=0, final_logit_softcapping=0.5)
    torch.manual_seed(3)
    transformers.Gemma2ForCausalLM(config).eval().save_pretrained(str(tmp_path))
    model = load_model(f"hf:{tmp_path}", device="cpu")
    assert head_split(model.module) is None
