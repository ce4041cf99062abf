"""On-policy distillation across tokenizers (`distill.crosstok.on_policy`) against real teacher-server
processes whose tokenizer is not the student's (`tests.tokenizer_models`).

* The text rule: the samples' texts are their tokens' pieces joined, each token's span its piece's
  bytes (bytes that are not UTF-8 one U+FFFD each); rows of no text are refused before sending.
* A byte-level BPE student's samples scored by a Unigram teacher-server through a reader: the
  teacher's tokens, the alignment, the per-token advantages and the GOLD/ULD loss equal what the
  same teacher gives in this process on the same texts; the prompt's tokens are never counted; a
  text past the teacher's context is refused with `SamplesRefusedError`.
* An on-policy loop (a Unigram student, two byte-level BPE teacher processes, staleness 1) whose
  first teacher is SIGKILLed mid-run: every step is answered once, each step's targets equal the
  in-process teacher's, and the student trains on all of them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from discovery.local_etcd import LocalEtcd
from distill import DistillReader
from distill.crosstok import (
    CrossTokenizerLoss,
    OnPolicyScorer,
    OnPolicyTargets,
    SamplesRefusedError,
    SampleTextError,
    VocabMap,
)
from distill.crosstok.on_policy import targets_of
from teacher_server.launch import TeacherProcess
from teacher_server.vocab_pieces import vocab_pieces
from tests.crosstok_teachers import InProcessTextTeacher
from tests.etcd_fixtures import unique_service
from tests.servers import REPO, start_all
from tests.tokenizer_models import TEXTS, save_text_teacher, save_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

K = 8
OUTPUTS = ["TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS"]


def _student(tokenizer: Any, seed: int) -> Any:
    """A tiny random Llama over `tokenizer`'s vocabulary: the student that samples."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def _args(directory: Path, name: str, etcd: LocalEtcd, service: str, instance: str) -> list[str]:
    """A text teacher registered in `etcd` under `service` (its record declares text prompts, which a
    reader needs before it sends texts)."""
    return ["--model", f"hf:{directory}", "--name", name, "--device", "cpu", "--max-batch-size", "4",
            "--max-queue-delay-us", "2000", "--registry", etcd.address, "--service", service,
            "--instance-id", instance]


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as e:
        yield e


def _sample(student: Any, tokenizer: Any, prompts: list[str], new_tokens: int) -> tuple[torch.Tensor, int]:
    """(ids [B, P + new_tokens], P): the prompts left-padded to P, then sampled continuations."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = student.generate(enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=tokenizer.pad_token_id, suppress_tokens=tokenizer.all_special_ids)
    mask = torch.cat([enc["attention_mask"], torch.ones(ids.shape[0], new_tokens, dtype=torch.int64)], dim=1)
    return ids * mask, enc["input_ids"].shape[1]


def _attention(ids: torch.Tensor, prompt: int, pad: int) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[:, :prompt] = (ids[:, :prompt] != pad).long()
    return mask


def _same(got: OnPolicyTargets, want: OnPolicyTargets, logits: torch.Tensor, loss: CrossTokenizerLoss) -> None:
    """`got` (a teacher-server's answer through the reader) is `want` (the in-process teacher's)."""
    rows = got.teacher.ids.shape[0]
    for r in range(rows):
        n = int(want.teacher.mask[r].sum())
        assert torch.equal(got.teacher.ids[r, :n], want.teacher.ids[r, :n]), f"row {r}: the teacher's tokens"
        assert torch.equal(got.teacher.spans[r, :n], want.teacher.spans[r, :n].to(got.teacher.spans.dtype))
    assert torch.equal(got.alignment.student_chunk, want.alignment.student_chunk)
    assert torch.equal(got.counted, want.counted) and bool(got.counted.any())
    torch.testing.assert_close(got.advantages(logits), want.advantages(logits), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.kd_loss(logits, loss), want.kd_loss(logits, loss), atol=1e-4, rtol=1e-4)


# ---- the text rule, no server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_tokenizer(tmp_path_factory.mktemp("byte-tok"), "byte_bpe")


def test_texts_are_the_sampled_pieces_and_spans_tile_them(byte_tok: Any) -> None:
    scorer = OnPolicyScorer(None, byte_tok)
    whole = byte_tok(TEXTS[1])["input_ids"]  # <s> + the text's tokens: its pieces spell it
    g = torch.Generator().manual_seed(3)
    broken = [1, *torch.randint(3, len(byte_tok), (14,), generator=g).tolist()]  # bytes that may not be UTF-8
    width = max(len(whole), len(broken))
    ids = torch.zeros(2, width, dtype=torch.int64)
    ids[0, :len(whole)], ids[1, :len(broken)] = torch.tensor(whole), torch.tensor(broken)
    mask = (torch.arange(width) < torch.tensor([[len(whole)], [len(broken)]])).long()
    samples = scorer.texts(ids, attention_mask=mask, prompt_length=4)
    assert samples.texts[0] == TEXTS[1], "the pieces of a text's own tokens spell it"
    for r, text in enumerate(samples.texts):
        data = text.encode("utf-8")
        spans = samples.tokens.spans[r][samples.tokens.spans[r, :, 0] >= 0].tolist()
        assert spans[0][0] == 0 and spans[-1][1] == len(data), "the spans cover the text"
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "and tile it"
        for t in range(1, int(mask[r].sum())):
            piece = scorer.pieces[int(ids[r, t])]
            s, e = samples.tokens.spans[r, t].tolist()
            assert piece is not None
            assert data[s:e] == piece or "\ufffd" in data[s:e].decode("utf-8", "replace"), (r, t)
    assert samples.tokens.spans[0, 0].tolist() == [-1, -1], "the BOS spells nothing"
    assert samples.completion[:, :4].sum() == 0 and torch.equal(samples.completion[:, 4:], mask[:, 4:] != 0)
    with pytest.raises(SampleTextError, match="row 1: its tokens spell no text"):
        scorer.texts(torch.tensor([[1, 5, 6], [1, 0, 0]]), prompt_length=1)
    with pytest.raises(SampleTextError, match="exactly one of prompt_length"):
        scorer.texts(ids)


# ---- a Unigram teacher-server scores a byte-level BPE student's samples ---------------------------------
@pytest.fixture(scope="module")
def unigram_teacher(tmp_path_factory: pytest.TempPathFactory, etcd: LocalEtcd) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("unigram-teacher")
    save_text_teacher(directory, "unigram", seed=5)
    service = unique_service("crosstok-unigram")
    with contextlib.ExitStack() as stack:
        t = TeacherProcess(_args(directory, "unigram", etcd, service, "unigram-1"), label="unigram", cwd=REPO,
                           log=directory / "teacher.log", ready_timeout=180, stop_grace=5.0)
        stack.callback(t.cleanup)
        t.launch()
        t.wait_ready()
        yield {"etcd": etcd, "service": service, "inproc": InProcessTextTeacher(directory)}


def test_advantages_and_targets_equal_the_in_process_teachers(unigram_teacher: dict[str, Any], byte_tok: Any,
                                                              etcd: LocalEtcd) -> None:
    student = _student(byte_tok, seed=1)
    teacher = unigram_teacher["inproc"]
    vocab = VocabMap.from_pieces(vocab_pieces(byte_tok), teacher.pieces)
    loss = CrossTokenizerLoss(vocab, divergence="forward_kl")
    ids, prompt = _sample(student, byte_tok, ["The teacher scores", "Café déjà", "digits 12"], new_tokens=10)
    mask = _attention(ids, prompt, byte_tok.pad_token_id)
    with DistillReader(None, registry=etcd.address, service=unigram_teacher["service"], inputs=["TEXT"],
                       outputs=OUTPUTS, top_k=K, logprobs=True, topk_tail=True, token_logprobs=True,
                       timeout=30.0) as reader:
        scorer = OnPolicyScorer(reader, byte_tok)
        got = scorer.score(ids, attention_mask=mask, prompt_length=prompt)
        too_long = torch.cat([ids, torch.randint(3, len(byte_tok), (3, 150))], dim=1)
        with pytest.raises(SamplesRefusedError) as refused:
            scorer.score(too_long, prompt_length=prompt)
    assert refused.value.refusal is not None and refused.value.refusal.kind == "context"
    assert len(refused.value.texts) == 3
    want = targets_of(got.samples, teacher.answer(got.samples.texts, K))
    with torch.no_grad():
        logits = student(input_ids=ids, attention_mask=mask).logits
    _same(got, want, logits, loss)
    # the prompt's tokens are context only: no counted chunk holds one, and their positions carry nothing
    chunk = got.alignment.student_chunk
    in_prompt = chunk[:, :prompt]
    counted_in_prompt = [bool(got.counted[r, c]) for r in range(3) for c in in_prompt[r].tolist() if c >= 0]
    assert not any(counted_in_prompt)
    assert (got.advantages(logits)[:, :prompt - 1] == 0).all()
    # a one-to-one chunk's advantage is -(log q(x) - log p(x)), p the teacher model's own on its token
    logp = teacher.log_probs(want.teacher.ids, want.teacher.mask.long())
    one = got.alignment.one_to_one & got.counted
    r, c = one.nonzero()[0].tolist()
    s, t = int(got.alignment.student_first[r, c]), int(got.alignment.teacher_first[r, c])
    log_q = torch.log_softmax(logits[r, s - 1], -1)[ids[r, s]]
    log_p = logp[r, t - 1, want.teacher.ids[r, t]]
    torch.testing.assert_close(got.advantages(logits)[r, s - 1], -(log_q - log_p), atol=1e-4, rtol=1e-4)


# ---- an on-policy loop, two byte-level BPE teachers, one SIGKILLed -------------------------------------
def test_an_on_policy_loop_across_tokenizers_loses_no_step_when_a_teacher_is_killed(tmp_path: Path,
                                                                                    etcd: LocalEtcd) -> None:
    steps, kill_after = 6, 2
    directory = tmp_path / "bpe-teacher"
    save_text_teacher(directory, "byte_bpe", seed=2)
    student_tok = save_tokenizer(tmp_path / "unigram-student", "unigram")
    student = _student(student_tok, seed=4).train()
    inproc = InProcessTextTeacher(directory)
    loss = CrossTokenizerLoss(VocabMap.from_pieces(vocab_pieces(student_tok), inproc.pieces))
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    prompts = [t for t in TEXTS if len(t) > 8]
    service = unique_service("crosstok-bpe")
    with contextlib.ExitStack() as stack:
        teachers = [TeacherProcess(_args(directory, "bpe", etcd, service, f"bpe-{n}"), label=f"bpe-{n}", cwd=REPO,
                                   log=tmp_path / f"bpe-{n}.log", ready_timeout=180, stop_grace=5.0)
                    for n in range(2)]
        start_all(stack, teachers)
        reader = stack.enter_context(DistillReader(
            None, registry=etcd.address, service=service, inputs=["TEXT"], outputs=OUTPUTS, top_k=K,
            logprobs=True, topk_tail=True, token_logprobs=True, teacher_batch_size=2, timeout=10.0, prefetch=2))
        scorer = OnPolicyScorer(reader, student_tok)

        def sample(step: int) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
            picked = [prompts[(step + j) % len(prompts)][:12] for j in range(4)]
            student.eval()
            ids, prompt = _sample(student, student_tok, picked, new_tokens=6)
            student.train()
            mask = _attention(ids, prompt, student_tok.pad_token_id)
            return ids, mask, prompt, scorer.submit(ids, attention_mask=mask, prompt_length=prompt)

        # Staleness 1: step n is scored while step n+1 is sampled, then step n trains.
        current = sample(0)
        checked, losses = [], []
        served_before_kill: dict[str, Any] = {}
        for step in range(steps):
            following = sample(step + 1) if step + 1 < steps else None
            if step == kill_after:  # with step n+1's texts just sent
                served_before_kill = dict(reader.stats().teachers[service][teachers[0].endpoint])
                teachers[0].kill()
            ids, mask, _, pending = current
            got = pending.result(120)
            want = targets_of(got.samples, inproc.answer(got.samples.texts, K))
            logits = student(input_ids=ids, attention_mask=mask).logits
            _same(got, want, logits.detach(), loss)
            checked.append(step)
            step_loss = got.pg_loss(logits) + got.kd_loss(logits, loss)
            opt.zero_grad()
            step_loss.backward()
            opt.step()
            losses.append(float(step_loss.detach()))
            if following is not None:
                current = following
        assert teachers[0].proc is not None and teachers[0].proc.wait(30) == -9
        stats = reader.stats()
        assert stats.batches == steps, "every step answered exactly once"
        assert int(served_before_kill["ok"]) >= 1, "the killed teacher had served its share"
        survivor = stats.teachers[service][teachers[1].endpoint]
        assert int(survivor["samples"]) >= 4 * (steps - kill_after - 1), "the other teacher took the rest"
    assert checked == list(range(steps)) and all(torch.isfinite(torch.tensor(losses)))
