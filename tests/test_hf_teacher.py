"""`--model hf:DIR`: a tiny random Llama saved with save_pretrained, served from its directory with
attention masks, against the same model in process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg

from teacher_server import BatchingConfig, ServerConfig
from teacher_server.model import ModelLoadError, load_model
from tests.hf_models import load_reference
from tests.servers import ServerThread, teacher_process

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _save_llama(directory: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(directory))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    _save_llama(directory)
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


@pytest.fixture(scope="module")
def hf_server(llama_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu")) as s:
        yield s


def _batch() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(0).integers(1, VOCAB, size=(3, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    mask[2, :3] = 0  # left padding: the real tokens' answers depend on the mask reaching the model
    ids[mask == 0] = 0
    return ids, mask


def _inputs(ids: np.ndarray, mask: np.ndarray) -> list[tg.InferInput]:
    out = []
    for name, x in (("INPUT_IDS", ids), ("ATTENTION_MASK", mask)):
        i = tg.InferInput(name, list(x.shape), "INT64")
        i.set_data_from_numpy(x)
        out.append(i)
    return out


def _reference_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    return logits


def _rows_alone(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, torch.Tensor]]:
    """Per row, (start, stop, logits) of its marked positions run alone: the server cuts a padded
    request's rows back to their masks and answers zeros at padding (teacher_server.rows)."""
    out = []
    for r in range(ids.shape[0]):
        marked = np.flatnonzero(mask[r])
        a, b = int(marked[0]), int(marked[-1]) + 1
        out.append((a, b, _reference_logits(model, ids[r : r + 1, a:b], mask[r : r + 1, a:b])[0]))
    return out


def test_requests_of_other_lengths_share_a_batch_and_get_their_own_positions(
        llama_dir: Path, reference: torch.nn.Module) -> None:
    """A causal LM declares its inputs padded itself: single sequences of 9, 10, 12 and 14 tokens
    from concurrent clients, with no mask sent, run as one padded batch (one execution), and each
    gets exactly its own positions, equal to the model on that sequence alone."""
    import asyncio

    import tritonclient.grpc.aio as tga

    lengths = (11, 12, 13, 14)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, VOCAB, size=(1, n), dtype=np.int64) for n in lengths]
    config = ServerConfig(model=f"hf:{llama_dir}", name="llama", device="cpu", instances=1,
                          batching=BatchingConfig(max_batch_size=len(lengths), max_queue_delay_us=2_000_000))

    async def send(url: str) -> list[np.ndarray]:
        client = tga.InferenceServerClient(url)
        try:
            calls = []
            for ids in seqs:
                i = tga.InferInput("INPUT_IDS", list(ids.shape), "INT64")
                i.set_data_from_numpy(ids)
                calls.append(client.infer("llama", [i], client_timeout=60))
            results = await asyncio.gather(*calls)
            stats = await client.get_inference_statistics("llama", as_json=True)
        finally:
            await client.close()
        assert int(stats["model_stats"][0]["execution_count"]) == 1, stats
        return [r.as_numpy("LOGITS") for r in results]

    with ServerThread(config) as s:
        got = asyncio.run(send(s.url))
    for ids, out in zip(seqs, got, strict=True):
        assert out.shape == (1, ids.shape[1], VOCAB)
        want = _reference_logits(reference, ids, np.ones_like(ids))
        assert np.allclose(out, want.numpy(), atol=1e-4)


def test_the_teacher_declares_its_tensors(hf_server: ServerThread) -> None:
    c = tg.InferenceServerClient(hf_server.url)
    try:
        meta = c.get_model_metadata("llama", as_json=True)
    finally:
        c.close()
    assert meta["inputs"] == [{"name": "INPUT_IDS", "datatype": "INT64", "shape": ["-1", "-1"]},
                              {"name": "ATTENTION_MASK", "datatype": "INT64", "shape": ["-1", "-1"]}]
    assert meta["outputs"] == [{"name": "LOGITS", "datatype": "FP32", "shape": ["-1", "-1", str(VOCAB)]}]


def test_logits_with_attention_masks_match_the_in_process_model(
        hf_server: ServerThread, reference: torch.nn.Module) -> None:
    ids, mask = _batch()
    c = tg.InferenceServerClient(hf_server.url)
    try:
        full = c.infer("llama", _inputs(ids, mask))
        topk = c.infer("llama", _inputs(ids, mask),
                       parameters={"logprobs": True, "temperature": 2.0, "top_k": 8, "topk_tail": True})
    finally:
        c.close()
    got = full.as_numpy("LOGITS")
    assert got.shape == (3, 9, VOCAB)
    unmasked = _reference_logits(reference, ids, np.ones_like(mask))
    assert not np.allclose(got[2, 3:], unmasked[2, 3:].numpy(), atol=1e-3)  # so the test can fail
    values = topk.as_numpy("LOGITS_TOPK_VALUES")
    assert values.shape == (3, 9, 8) and topk.as_numpy("LOGITS_TOPK_INDICES").dtype == np.int32
    for r, (a, b, logits) in enumerate(_rows_alone(reference, ids, mask)):
        assert np.allclose(got[r, a:b], logits.numpy(), atol=1e-4)
        assert not got[r, :a].any() and not got[r, b:].any()  # padding comes back as zeros
        want = torch.topk(torch.log_softmax(logits / 2.0, dim=-1), 8, dim=-1)
        assert np.allclose(values[r, a:b], want.values.numpy(), atol=1e-4)
        assert np.array_equal(topk.as_numpy("LOGITS_TOPK_INDICES")[r, a:b], want.indices.numpy())
    assert np.allclose(topk.as_numpy("LOGITS_TOPK_TAIL")[mask == 1], 1 - np.exp(values[mask == 1]).sum(-1), atol=1e-5)


def test_compute_dtype_loads_the_weights_in_it(llama_dir: Path, reference: torch.nn.Module) -> None:
    """The served BF16 model is the same model run in BF16 in process, to one bf16 step (2**-7 of
    the value: a different kernel order may round one step apart), and as far from fp32 as bf16's
    precision allows at these logits' scale. Logits of this tiny model are small (|x| < 0.5), so an
    absolute tolerance of 0.1 would accept the logits scaled by 0.75; these bounds are relative."""
    model = load_model(f"hf:{llama_dir}", device="cpu", compute_dtype="BF16")
    assert isinstance(model.module, torch.nn.Module)
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
    ids, mask = _batch()
    with torch.inference_mode():
        [out] = model.forward([torch.from_numpy(ids), torch.from_numpy(mask)])
    assert out.shape == (3, 9, VOCAB)
    in_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama_dir), local_files_only=True, dtype=torch.bfloat16).eval()
    want = _reference_logits(in_bf16, ids, mask)
    assert want.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)
    fp32 = _reference_logits(reference, ids, mask)
    scale = float(fp32.abs().max())
    # bf16 keeps 8 significant bits; two layers of rounding stay within a few steps at this scale.
    torch.testing.assert_close(out.float(), fp32, rtol=0, atol=16 * 2**-8 * scale)


def test_a_sequence_classifier_declares_class_logits(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=5, pad_token_id=0)
    torch.manual_seed(1)
    classifier = transformers.LlamaForSequenceClassification(config).eval()
    classifier.save_pretrained(str(tmp_path))
    model = load_model(f"hf:{tmp_path}", device="cpu")
    assert [(s.name, s.shape) for s in model.io.outputs] == [("LOGITS", (5,))]
    ids, mask = _batch()
    with torch.inference_mode():
        [out] = model.forward([torch.from_numpy(ids), torch.from_numpy(mask)])
        want = classifier(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    assert torch.allclose(out, want, atol=1e-5)


def test_a_directory_without_a_saved_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(f"hf:{tmp_path}", device="cpu")


def test_the_cli_serves_hf_dir_with_server_side_logprobs(
        llama_dir: Path, reference: torch.nn.Module, tmp_path: Path) -> None:
    """The real command line: --model hf:DIR with --logprobs --temperature --top-k --topk-tail defaults."""
    args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--logprobs", "--temperature", "2", "--top-k", "4", "--topk-tail"]
    ids, mask = _batch()
    with teacher_process(args, tmp_path) as (_, info), tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as c:
        result = c.infer("llama", _inputs(ids, mask))
    for r, (a, b, logits) in enumerate(_rows_alone(reference, ids, mask)):
        want = torch.topk(torch.log_softmax(logits / 2.0, dim=-1), 4, dim=-1)
        assert np.allclose(result.as_numpy("LOGITS_TOPK_VALUES")[r, a:b], want.values.numpy(), atol=1e-4)
        assert np.array_equal(result.as_numpy("LOGITS_TOPK_INDICES")[r, a:b], want.indices.numpy())
    assert result.as_numpy("LOGITS_TOPK_TAIL").shape == (3, 9)


def test_the_cli_serves_in_fp16_end_to_end(llama_dir: Path, tmp_path: Path) -> None:
    """`teacher-server --model hf:DIR --compute-dtype FP16`: the process loads the weights in fp16
    and its LOGITS (declared FP32) are the same model run in fp16 in process, to one fp16 step
    (2**-10 of the value); a wrong dtype (fp32 or bf16 weights) is further off than that."""
    args = ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--compute-dtype", "FP16"]
    ids, mask = _batch()
    with teacher_process(args, tmp_path) as (_, info), tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as c:
        result = c.infer("llama", _inputs(ids, mask))
    got = torch.from_numpy(result.as_numpy("LOGITS"))
    assert result.get_output("LOGITS").datatype == "FP32" and got.shape == (3, 9, VOCAB)
    in_fp16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama_dir), local_files_only=True, dtype=torch.float16).eval()
    in_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama_dir), local_files_only=True, dtype=torch.bfloat16).eval()
    # The server cuts each row back to its mask (teacher_server.rows): compare row by row, zeros at padding.
    rows = zip(_rows_alone(in_fp16, ids, mask), _rows_alone(in_bf16, ids, mask), strict=True)
    for row, ((a, b, want), (_, _, other)) in enumerate(rows):
        assert want.dtype == torch.float16
        torch.testing.assert_close(got[row, a:b], want.float(), rtol=2**-10, atol=1e-6)
        assert (got[row, :a] == 0).all() and (got[row, b:] == 0).all()
        assert not torch.allclose(got[row, a:b], other.float(), rtol=2**-10, atol=1e-6)
