"""Sequence batches through DistillReader (issue #11): collator-padded token ids and attention masks
of mixed lengths in, per-token top-k `[B, T, k]` out, against real teacher servers.

Every batch's values, indices and tail mass at the real positions equal
`topk(log_softmax(model(x) / T))` of the same model run in this process on each sequence alone,
unpadded; batches come exactly once and in order, also when one of two teachers is killed
mid-epoch. The value transforms the reader states (logprobs, temperature, topk_tail) override the
server's defaults per request, so two students with other settings share one server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill import DistillReader
from teacher_server import BatchingConfig, ServerConfig
from teacher_server.launch import TeacherProcess
from tests import seq_models
from tests.faults.helpers import assert_delivered_once_in_order
from tests.servers import REPO, ServerThread, start_all

pytestmark = pytest.mark.timeout(180)

MODEL = "tests.seq_models:causal_conv_lm"
INPUTS = {"TOKENS": "input_ids", "MASK": "attention_mask"}
K = 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def collate(seqs: list[torch.Tensor], idx: int) -> dict[str, torch.Tensor]:
    """Right-pads to the longest sequence (pad id 0, mask 0), as a language-model collator does."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "idx": torch.full((len(seqs),), idx)}


class SequenceLoader:
    """`batches` batches of 1..6 sequences of 1..24 tokens each, the same ones every pass; a pass
    can be told to wait (bounded) at batch `hold_at` until `resume` is set, so a fault lands mid-epoch."""

    def __init__(self, batches: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data: list[list[torch.Tensor]] = []
        for _ in range(batches):
            rows = int(torch.randint(1, 7, (1,), generator=g))
            self.data.append([torch.randint(1, seq_models.VOCAB, (int(torch.randint(1, 25, (1,), generator=g)),),
                                            generator=g) for _ in range(rows)])

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i, seqs in enumerate(self.data):
            yield collate(seqs, i)


@pytest.fixture(scope="module")
def reference() -> seq_models.CausalConvLM:
    return seq_models.causal_conv_lm().eval()


def expected_topk(ref: seq_models.CausalConvLM, seq: torch.Tensor, *, logprobs: bool, temperature: float,
                  k: int = K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-process answer for one unpadded sequence: top-k values, indices and tail mass [L, ...]."""
    with torch.inference_mode():
        logits = ref(seq[None], torch.ones(1, len(seq), dtype=torch.int64))["LOGITS"][0].float()
    x = logits / temperature
    logp = torch.log_softmax(x, dim=-1)
    values, indices = (logp if logprobs else x).topk(k, dim=-1)
    tail = (1.0 - logp.gather(-1, indices).exp().sum(-1)).clamp_min(0.0)
    return values, indices, tail


def check_batch(ref: seq_models.CausalConvLM, batch: dict[str, torch.Tensor], teacher: Any, *, logprobs: bool,
                temperature: float, tail: bool, dtype: torch.dtype) -> None:
    """The teacher's top-k at every real position equals the in-process model's on that sequence alone."""
    i = int(batch["idx"][0])
    assert teacher is not None, f"batch {i} came without teacher outputs"
    values, indices = teacher["LOGITS_TOPK_VALUES"], teacher["LOGITS_TOPK_INDICES"]
    rows, longest = batch["input_ids"].shape
    assert values.shape == indices.shape == (rows, longest, K), f"batch {i}: {tuple(values.shape)}"
    assert values.device.type == DEVICE and values.dtype == dtype and indices.dtype == torch.int32
    assert ("LOGITS_TOPK_TAIL" in teacher) == tail, f"batch {i}: outputs {sorted(teacher)}"
    for row in range(rows):
        n = int(batch["attention_mask"][row].sum())
        want_v, want_i, want_t = expected_topk(ref, batch["input_ids"][row, :n], logprobs=logprobs,
                                               temperature=temperature)
        assert torch.equal(indices[row, :n].cpu().long(), want_i), f"batch {i} row {row}: other top-k ids"
        torch.testing.assert_close(values[row, :n].cpu().float(), want_v, atol=2e-3, rtol=2e-3)
        if tail:
            got_t = teacher["LOGITS_TOPK_TAIL"]
            assert got_t.shape == (rows, longest) and got_t.device.type == DEVICE
            torch.testing.assert_close(got_t[row, :n].cpu().float(), want_t, atol=2e-3, rtol=2e-3)


def _server(**defaults: Any) -> ServerThread:
    return ServerThread(ServerConfig(
        model=MODEL, name="seq", device="cpu", metrics_port=0,
        batching=BatchingConfig(max_batch_size=16, max_queue_delay_us=2000), **defaults))


def _reader(loader: SequenceLoader, teachers: str, **kwargs: Any) -> DistillReader:
    options: dict[str, Any] = {"inputs": INPUTS, "outputs": ["LOGITS"], "top_k": K, "device": DEVICE,
                               "timeout": 30.0, "prefetch": 4, **kwargs}
    return DistillReader(loader, teachers=teachers, **options)


def test_padded_sequences_come_back_per_token_on_the_device(reference: seq_models.CausalConvLM) -> None:
    loader = SequenceLoader(12)
    # The server's own defaults differ from what this reader states, so a leak would show.
    with _server(temperature=3.0) as s, _reader(loader, s.url, logprobs=True, temperature=2.0, topk_tail=True,
                                                 output_dtype="FP16") as reader:
        seen = []
        for batch, teacher in reader:
            check_batch(reference, batch, teacher, logprobs=True, temperature=2.0, tail=True, dtype=torch.float16)
            seen.append(int(batch["idx"][0]))
    assert_delivered_once_in_order(seen, len(loader))


def test_two_students_with_other_settings_on_one_server_each_get_their_own(
        reference: seq_models.CausalConvLM) -> None:
    loader = SequenceLoader(8, seed=1)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(_server(logprobs=True, temperature=3.0, topk_tail=True))
        tempered = stack.enter_context(_reader(loader, s.url, logprobs=True, temperature=0.5, topk_tail=True,
                                               output_dtype="FP32"))
        raw = stack.enter_context(_reader(loader, s.url, logprobs=False, temperature=1.0, topk_tail=False))
        server_default = stack.enter_context(_reader(loader, s.url))
        seen: list[int] = []
        # Interleaved, so the three readers' requests share the server's batches.
        for (b1, t1), (b2, t2), (b3, t3) in zip(tempered, raw, server_default, strict=True):
            check_batch(reference, b1, t1, logprobs=True, temperature=0.5, tail=True, dtype=torch.float32)
            check_batch(reference, b2, t2, logprobs=False, temperature=1.0, tail=False, dtype=torch.float32)
            # Nothing stated: the server's defaults (logprobs at T=3); the tail is not kept unless asked.
            check_batch(reference, b3, t3, logprobs=True, temperature=3.0, tail=False, dtype=torch.float32)
            assert int(b1["idx"][0]) == int(b2["idx"][0]) == int(b3["idx"][0])
            seen.append(int(b1["idx"][0]))
    assert_delivered_once_in_order(seen, len(loader))


def test_two_teachers_one_killed_mid_epoch(reference: seq_models.CausalConvLM, tmp_path: Path) -> None:
    loader = SequenceLoader(30, seed=2)
    args = ["--model", MODEL, "--name", "seq", "--device", "cpu", "--max-batch-size", "4",
            "--max-queue-delay-us", "1000"]
    with contextlib.ExitStack() as stack:
        teachers = [TeacherProcess(args, label=f"seq-{n}", cwd=REPO, log=tmp_path / f"seq-{n}.log",
                                   stop_grace=5.0) for n in range(2)]
        start_all(stack, teachers)
        reader = stack.enter_context(_reader(
            loader, ",".join(t.endpoint for t in teachers), logprobs=True, temperature=1.0, topk_tail=True,
            output_dtype="FP16", teacher_batch_size=2, timeout=10.0))
        seen: list[int] = []
        killed_at = -1
        for batch, teacher in reader:
            check_batch(reference, batch, teacher, logprobs=True, temperature=1.0, tail=True, dtype=torch.float16)
            i = int(batch["idx"][0])
            seen.append(i)
            if i == 5:  # both have served by now (chunks of 2 rows are spread over the pool)
                teachers[0].kill()
                killed_at = i
        assert teachers[0].proc is not None and teachers[0].proc.wait(30) == -9
    assert killed_at == 5
    assert_delivered_once_in_order(seen, len(loader))


def test_a_tail_needs_top_k() -> None:
    with pytest.raises(ValueError, match="ask for top_k=K too"):
        DistillReader([], inputs=INPUTS, teachers="127.0.0.1:1", topk_tail=True)


def test_the_value_transforms_name_the_store(reference: seq_models.CausalConvLM, tmp_path: Path) -> None:
    from distill.cache import NamespaceMismatchError, TeacherOutputStore

    class Keyed(SequenceLoader):
        """Fixed-width batches (one shape per sample, as a store needs) with a per-sample key."""

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for i, seqs in enumerate(self.data):
                batch = collate([*seqs, torch.ones(24, dtype=torch.int64)], i)  # a full-length row pads all to 24
                batch["key"] = torch.arange(len(seqs) + 1) + 100 * i
                yield batch

    loader = Keyed(4, seed=3)
    store = tmp_path / "store"
    stated = {"logprobs": True, "temperature": 2.0, "topk_tail": True, "output_dtype": "FP16"}
    with _server() as s:
        with _reader(loader, s.url, cache=str(store), cache_mode="read_write", key="key", **stated) as reader:
            for batch, teacher in reader:
                check_batch(reference, batch, teacher, logprobs=True, temperature=2.0, tail=True,
                            dtype=torch.float16)
        with TeacherOutputStore.open(store, mode="r") as opened:
            ns = opened.namespace
        assert (ns.values, ns.temperature, dict(ns.extra), ns.dtype) == ("logprobs", 2.0, {"topk_tail": "true"},
                                                                         "float16")
        # A second student with another temperature on the same server and store: refused, not mixed.
        other = _reader(loader, s.url, cache=str(store), cache_mode="read_write", key="key",
                        **{**stated, "temperature": 1.0})
        with pytest.raises(NamespaceMismatchError, match="temperature"):
            other.start()
        other.close()
    # Offline, the stated transforms must match the store's as well; the same ones read it back.
    offline = {"inputs": INPUTS, "outputs": ["LOGITS"], "top_k": K, "device": DEVICE, "cache": str(store),
               "cache_mode": "read", "key": "key"}
    with pytest.raises(NamespaceMismatchError, match="values"):
        DistillReader(loader, **offline, **{**stated, "logprobs": False}).start()
    seen = []
    with DistillReader(loader, **offline, **stated) as reader:
        for batch, teacher in reader:
            check_batch(reference, batch, teacher, logprobs=True, temperature=2.0, tail=True, dtype=torch.float16)
            seen.append(int(batch["idx"][0]))
    assert_delivered_once_in_order(seen, len(loader))


def test_padded_batches_of_one_width_share_calls_and_each_gets_its_own_rows(
        reference: seq_models.CausalConvLM) -> None:
    """A collator that pads every batch to one width (`padding="max_length"`) gives batches of one
    shape: small ones from a loader that never waits share calls (distill.bundles), and every row of
    every batch still gets the model's answer for its own sequence alone, zeros past its mask."""
    loader = SequenceLoader(80, seed=3)

    def fixed_width() -> Iterator[dict[str, torch.Tensor]]:
        for i, seqs in enumerate(loader.data):
            batch = collate(seqs, i)
            pad = 24 - batch["input_ids"].shape[1]
            for name in ("input_ids", "attention_mask"):
                batch[name] = torch.nn.functional.pad(batch[name], (0, pad))
            yield batch

    class FixedWidth:
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return fixed_width()

    seen = []
    with _server() as s, DistillReader(FixedWidth(), teachers=s.url, inputs=INPUTS, outputs=["LOGITS"], top_k=K,
                                       logprobs=True, temperature=1.0, device=DEVICE, timeout=30.0,
                                       prefetch=32) as reader:
        for batch, teacher in reader:
            check_batch(reference, batch, teacher, logprobs=True, temperature=1.0, tail=False, dtype=torch.float32)
            n = batch["attention_mask"].sum(1)
            for row in range(batch["input_ids"].shape[0]):
                assert not teacher["LOGITS_TOPK_VALUES"][row, int(n[row]):].any(), "zeros past the mask"
            seen.append(int(batch["idx"][0]))
        bundled = reader.stats().bundled
    assert_delivered_once_in_order(seen, len(loader))
    assert bundled > 0, "80 small batches of one shape from a loader that never waits: some shared a call"
