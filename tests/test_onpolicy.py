"""On-policy distillation through the reader (issue 22), against real `hf:DIR` teacher processes.

* `token_logprobs=True` and a `SCORE_IDS` batch field, read through `DistillReader` from a loader
  of padded sequences of mixed lengths: `<OUT>_TOKEN_LOGPROBS` and `<OUT>_SCORED_LOGPROBS` equal
  `log_softmax(model(x) / T)` of the same Llama in this process, gathered at the next tokens and at
  the score ids.
* A reader with no loader scores batches the training loop made: a tiny student Llama samples
  continuations, the teachers score the sampled tokens and the student's own top-k, the losses of
  `distill.losses` step an optimizer, with staleness 1 (step n's batch scored while step n+1 is
  generated). One of two teachers is SIGKILLed mid-run and no step is lost: every submitted batch
  gets its outputs, equal to the in-process teacher's.
* The bounds of `submit`: beyond `prefetch` unsettled it raises SubmitLimitError; `close()` fails
  what is unsettled with ReaderClosedError; a deadline settles a batch no teacher answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill import BatchRejectedError, DistillReader, ReaderClosedError, SubmitLimitError
from distill.errors import InputRefusal
from distill.losses import ScoredTargets, TokenKDLoss, sampled_token_pg_loss
from teacher_server.launch import TeacherProcess
from tests.hf_models import load_reference
from tests.servers import REPO, start_all, teacher_process

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(240)

VOCAB, CONTEXT, TEMPERATURE, M = 97, 64, 2.0, 4
INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask", "SCORE_IDS": "score_ids"}


def _llama(seed: int, hidden: int) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("onpolicy-llama")
    _llama(0, 32).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> torch.nn.Module:
    return load_reference(llama_dir)


def _args(llama_dir: Path) -> list[str]:
    return ["--model", f"hf:{llama_dir}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "4", "--max-queue-delay-us", "2000"]


@pytest.fixture(scope="module")
def teacher(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with teacher_process(_args(llama_dir), tmp_path_factory.mktemp("onpolicy-logs")) as (_, info):
        yield info


def _expected(reference: torch.nn.Module, ids: torch.Tensor, score_ids: torch.Tensor,
              temperature: float = TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """(token log-probs [T], scored log-probs [T, m]) of one unpadded sequence, in this process."""
    with torch.inference_mode():
        lp = torch.log_softmax(reference(input_ids=ids[None]).logits[0].float() / temperature, dim=-1)
    tokens = torch.zeros(ids.shape[0])
    tokens[:-1] = lp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    return tokens, lp.gather(-1, score_ids.long())


def _check(reference: torch.nn.Module, batch: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
           temperature: float = TEMPERATURE) -> None:
    assert set(outputs) == {"LOGITS_TOKEN_LOGPROBS", "LOGITS_SCORED_LOGPROBS"}  # the full [B, T, V] never comes
    tokens, scored = outputs["LOGITS_TOKEN_LOGPROBS"], outputs["LOGITS_SCORED_LOGPROBS"]
    assert tokens.shape == batch["input_ids"].shape and scored.shape == batch["score_ids"].shape
    for row in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][row].sum())
        want_tokens, want_scored = _expected(reference, batch["input_ids"][row, :n], batch["score_ids"][row, :n],
                                             temperature)
        torch.testing.assert_close(tokens[row, :n], want_tokens, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(scored[row, :n], want_scored, atol=1e-4, rtol=1e-4)
        assert (tokens[row, n - 1:] == 0).all() and (scored[row, n:] == 0).all()  # the last position, padding


def _padded_batch(lengths: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, :n] = 1
    score_ids = torch.randint(0, VOCAB, (len(lengths), width, M), generator=g, dtype=torch.int32) * mask[..., None]
    return {"input_ids": ids, "attention_mask": mask, "score_ids": score_ids.to(torch.int32)}


def test_a_loader_reader_gets_token_and_scored_logprobs_equal_to_the_model(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    batches = [_padded_batch((5, 9, 12), seed=1), _padded_batch((16, 3), seed=2), _padded_batch((7,), seed=3)]
    with DistillReader(batches, teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS, outputs=["LOGITS"],
                       token_logprobs=True, temperature=TEMPERATURE, timeout=30.0) as reader:
        seen = 0
        for batch, outputs in reader:
            _check(reference, batch, outputs)
            seen += 1
    assert seen == len(batches)


def test_score_ids_must_be_int32(teacher: dict[str, Any]) -> None:
    batch = _padded_batch((4,), seed=4)
    batch["score_ids"] = batch["score_ids"].long()
    with DistillReader(None, teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS, token_logprobs=True) as reader:
        with pytest.raises(TypeError, match="'SCORE_IDS' must be INT32"):
            reader.submit(batch)
        with pytest.raises(TypeError, match="no loader"):
            iter(reader)
    with (DistillReader([batch], teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS) as reader,
          pytest.raises(TypeError, match="built without a loader")):
        reader.submit(batch)


def test_submit_is_bounded_and_close_fails_what_is_unsettled(teacher: dict[str, Any],
                                                             reference: torch.nn.Module) -> None:
    reader = DistillReader(None, teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS, outputs=["LOGITS"],
                           token_logprobs=True, temperature=TEMPERATURE, prefetch=2).start()
    try:
        batches = [_padded_batch((6, 8), seed=10 + n) for n in range(3)]
        first, second = reader.submit(batches[0]), reader.submit(batches[1])
        with pytest.raises(SubmitLimitError, match="prefetch=2"):
            reader.submit(batches[2])
        _check(reference, batches[0], first.result(60))
        _check(reference, batches[1], asyncio.run(_awaited(second)))  # the same future, awaited on another loop
        _check(reference, batches[2], reader.score(batches[2]))  # room again
        # A settled batch is let go at once: its deadline timer (80 s here) no longer holds its outputs.
        settled = weakref.ref(first)
        del first
        for _ in range(50):  # the hedge timer (at least 0.25 s) may hold it a moment
            gc.collect()
            if settled() is None:
                break
            time.sleep(0.1)
        assert settled() is None
        pending = [reader.submit(b) for b in batches[:2]]
    finally:
        reader.close()
    for fut in pending:  # each settles: answered before close, or failed by it
        with contextlib.suppress(ReaderClosedError):
            fut.result(10)
    with pytest.raises(ReaderClosedError):
        reader.submit(batches[0])


async def _awaited(fut: concurrent.futures.Future[Any]) -> Any:
    return await asyncio.wrap_future(fut)


def test_submitted_batches_carry_their_own_temperature_and_a_refusal_its_facts(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """One reader, batches submitted together at four temperatures (the reader's own among them):
    each is answered at its own, so none shared a request with a batch of another. A batch with an id
    past the vocabulary in its sixth row (past the teacher's 4-row batches) fails with the facts of
    it: the input, the row and position in the batch, the id and the vocabulary; so do a sequence
    past the context and a score id past the classes."""
    temperatures = [None, 0.5, 1.0, 3.0]
    with DistillReader(None, teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS, outputs=["LOGITS"],
                       token_logprobs=True, temperature=TEMPERATURE, timeout=30.0, prefetch=8) as reader:
        batches = [_padded_batch((5, 7), seed=20 + n) for n in range(8)]
        futures = [reader.submit(b, temperature=temperatures[n % 4]) for n, b in enumerate(batches)]
        for n, (batch, fut) in enumerate(zip(batches, futures, strict=True)):
            _check(reference, batch, fut.result(60), temperatures[n % 4] or TEMPERATURE)
        bad = _padded_batch((6,) * 6, seed=30)
        bad["input_ids"][5, 3] = VOCAB
        with pytest.raises(BatchRejectedError) as refused:
            reader.score(bad, temperature=0.5)
        assert refused.value.refusal == InputRefusal("vocabulary", "INPUT_IDS", VOCAB, VOCAB, (5, 3))
        assert f"id {VOCAB} at [1, 3]" in refused.value.reason  # the teacher's words: its request's rows
        long = _padded_batch((CONTEXT + 6,), seed=31)
        with pytest.raises(BatchRejectedError) as refused:
            reader.score(long)
        assert refused.value.refusal == InputRefusal("context", "INPUT_IDS", CONTEXT + 6, CONTEXT, ())
        scored = _padded_batch((5, 6), seed=32)
        scored["score_ids"][1, 2, 3] = VOCAB
        with pytest.raises(BatchRejectedError) as refused:
            reader.score(scored)
        assert refused.value.refusal == InputRefusal("classes", "SCORE_IDS", VOCAB, VOCAB, (1, 2, 3))
        with pytest.raises(ValueError, match="temperature: must be > 0"):
            reader.submit(batches[0], temperature=0)


def test_over_a_stream_answers_are_the_same_and_a_refusal_keeps_its_facts(
        teacher: dict[str, Any], reference: torch.nn.Module) -> None:
    """transport="stream": the same values as over calls, and a refusal arriving as a stream
    message still carries its facts (the id, its row and position, the vocabulary)."""
    with DistillReader(None, teachers=f"127.0.0.1:{teacher['port']}", inputs=INPUTS, outputs=["LOGITS"],
                       token_logprobs=True, temperature=TEMPERATURE, timeout=30.0, transport="stream") as reader:
        batch = _padded_batch((5, 7, 3), seed=40)
        _check(reference, batch, reader.score(batch), TEMPERATURE)
        bad = _padded_batch((6,) * 6, seed=41)
        bad["input_ids"][5, 3] = VOCAB
        with pytest.raises(BatchRejectedError) as refused:
            reader.score(bad)
        assert refused.value.refusal == InputRefusal("vocabulary", "INPUT_IDS", VOCAB, VOCAB, (5, 3))
        _check(reference, batch, reader.score(batch), TEMPERATURE)  # the stream goes on


def test_a_batch_no_teacher_answers_settles_at_its_deadline(llama_dir: Path, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        t = TeacherProcess(_args(llama_dir), label="lone", cwd=REPO, log=tmp_path / "lone.log", stop_grace=5.0)
        stack.callback(t.cleanup)
        t.launch()
        t.wait_ready()
        reader = stack.enter_context(DistillReader(
            None, teachers=t.endpoint, inputs=INPUTS, outputs=["LOGITS"], token_logprobs=True, timeout=2.0,
            no_teacher_timeout=60.0))
        t.kill()
        assert t.proc is not None and t.proc.wait(30) == -9
        fut = reader.submit(_padded_batch((5,), seed=5), deadline_s=3.0)
        with pytest.raises(TimeoutError, match="within 3 s"):
            fut.result(30)


def _student_batch(student: Any, prompts: torch.Tensor, new_tokens: int) -> dict[str, torch.Tensor]:
    """The student samples continuations of `prompts`; SCORE_IDS is its own top-M per position."""
    with torch.no_grad():
        ids = student.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        logits = student(input_ids=ids).logits
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "score_ids": logits.topk(M, dim=-1).indices.to(torch.int32)}


def _train_step(student: Any, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                outputs: dict[str, torch.Tensor]) -> float:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = student(input_ids=ids, attention_mask=mask).logits
    next_ids = torch.full_like(ids, -100)
    next_ids[:, :-1] = ids[:, 1:]
    pg = sampled_token_pg_loss(logits, next_ids, outputs["LOGITS_TOKEN_LOGPROBS"], temperature=TEMPERATURE)
    support = ScoredTargets(batch["score_ids"], outputs["LOGITS_SCORED_LOGPROBS"])
    kd = TokenKDLoss("reverse_kl", temperature=TEMPERATURE)(logits, support, attention_mask=mask)
    loss = pg + kd
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def test_an_on_policy_loop_loses_no_step_when_a_teacher_is_killed(
        llama_dir: Path, teacher: dict[str, Any], reference: torch.nn.Module, tmp_path: Path) -> None:
    """Two teachers: one of this test's own, killed mid-loop, and the module's, which takes the rest."""
    steps, kill_after = 8, 3
    student = _llama(1, 16)
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    with contextlib.ExitStack() as stack:
        victim = TeacherProcess(_args(llama_dir), label="llama-victim", cwd=REPO, log=tmp_path / "llama-victim.log",
                                stop_grace=5.0)
        start_all(stack, [victim])
        endpoints = [victim.endpoint, teacher["endpoint"]]
        reader = stack.enter_context(DistillReader(
            None, teachers=",".join(endpoints), inputs=INPUTS, outputs=["LOGITS"],
            token_logprobs=True, temperature=TEMPERATURE, teacher_batch_size=2, timeout=10.0, prefetch=2))
        # Staleness 1: step n is scored while step n+1 is generated, then step n trains.
        batch = _student_batch(student, torch.randint(1, VOCAB, (4, 6), generator=g), new_tokens=8)
        fut = reader.submit(batch)
        losses = []
        served_before_kill: dict[str, Any] = {}
        for step in range(steps):
            nxt = None
            if step + 1 < steps:
                nxt = _student_batch(student, torch.randint(1, VOCAB, (4, 6), generator=g), new_tokens=8)
                nxt_fut = reader.submit(nxt)
            if step == kill_after:  # with step n+1's chunks just sent
                served_before_kill = reader.stats().teachers["teachers"][victim.endpoint]
                victim.kill()
            outputs = fut.result(120)
            _check(reference, batch, outputs)
            losses.append(_train_step(student, opt, batch, outputs))
            if nxt is not None:
                batch, fut = nxt, nxt_fut
        assert victim.proc is not None and victim.proc.wait(30) == -9
        stats = reader.stats()
        assert stats.batches == steps
        assert int(served_before_kill["ok"]) >= 1  # the killed teacher had served its share
        survivor = stats.teachers["teachers"][teacher["endpoint"]]
        assert int(survivor["samples"]) >= 4 * (steps - kill_after - 1)  # and the other took the rest
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
