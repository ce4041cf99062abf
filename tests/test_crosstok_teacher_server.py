"""Cross-tokenizer distillation against a real teacher-server process (`--model hf:DIR` with a
Unigram tokenizer): its answer to TEXT aligns exactly as the same model's answer built in process,
the losses on it are the same, and its vocabulary comes back through VOCAB_IDS within a deadline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg

from distill.call_errors import TeacherCallError
from distill.crosstok import CrossTokenizerLoss, SpanTokenizer, TeacherText, VocabMap, align, teacher_chunk_logprobs
from distill.crosstok.teacher_vocab import fetch_vocab_pieces
from teacher_server.vocab_pieces import vocab_pieces
from tests.crosstok_teachers import InProcessTextTeacher
from tests.servers import teacher_process
from tests.tokenizer_models import TEXTS, save_text_teacher, save_tokenizer

K = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], InProcessTextTeacher]]:
    directory = Path(tmp_path_factory.mktemp("crosstok-teacher"))
    save_text_teacher(directory, "unigram", seed=3)
    args = ["--model", f"hf:{directory}", "--name", "text", "--device", "cpu", "--http-port", "0",
            "--metrics-port", "0"]
    with teacher_process(args, directory, timeout=120) as (_, info):
        yield info, InProcessTextTeacher(directory)


def _ask(endpoint: str, texts: list[str]) -> dict[str, torch.Tensor]:
    client = tg.InferenceServerClient(endpoint)
    try:
        text = tg.InferInput("TEXT", [len(texts), 1], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1))
        names = ["TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS"]
        result = client.infer("text", [text], outputs=[tg.InferRequestedOutput(n) for n in names],
                              parameters={"top_k": K, "logprobs": True, "topk_tail": True, "token_logprobs": True},
                              client_timeout=60)
        keys = ["TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES",
                "LOGITS_TOPK_TAIL", "LOGITS_TOKEN_LOGPROBS"]
        return {k: torch.from_numpy(np.array(result.as_numpy(k))) for k in keys}
    finally:
        client.close()


def test_the_servers_answer_aligns_as_the_model_in_process(served, tmp_path: Path) -> None:
    info, local = served
    texts = TEXTS[:6]
    remote = TeacherText.from_outputs(_ask(info["endpoint"], texts))
    here = TeacherText.from_outputs(local.answer(texts, K))
    assert torch.equal(remote.ids, here.ids) and torch.equal(remote.mask.long(), here.mask.long())
    assert torch.equal(remote.spans.long(), here.spans.long())
    student_tok = SpanTokenizer(save_tokenizer(tmp_path / "student", "byte_bpe"))
    s = student_tok(texts)
    a_remote = align(s.spans, s.mask, remote.spans, remote.mask)
    a_here = align(s.spans, s.mask, here.spans, here.mask)
    for field in ("student_chunk", "teacher_chunk", "num_chunks", "valid", "chunk_bytes", "teacher_first",
                  "teacher_count"):
        assert torch.equal(getattr(a_remote, field), getattr(a_here, field)), field
    torch.testing.assert_close(teacher_chunk_logprobs(remote, a_remote), teacher_chunk_logprobs(here, a_here),
                               rtol=1e-4, atol=1e-4)
    vocab = VocabMap.from_pieces(student_tok.pieces, local.pieces)
    logits = torch.randn(*s.ids.shape, len(student_tok.tokenizer), generator=torch.Generator().manual_seed(0))
    loss = CrossTokenizerLoss(vocab)
    torch.testing.assert_close(loss(logits, s, remote, a_remote), loss(logits, s, here, a_here), rtol=1e-4, atol=1e-4)


def test_the_vocabulary_comes_from_the_teacher_in_pages_within_a_deadline(served) -> None:
    info, local = served
    want = [p or None for p in vocab_pieces(local.tokenizer)]
    assert fetch_vocab_pieces(info["endpoint"], page=50) == want, "every page, in id order"
    assert fetch_vocab_pieces(info["endpoint"], "text", vocab_size=10) == want[:10]
    with pytest.raises(TeacherCallError) as e:
        fetch_vocab_pieces(info["endpoint"], vocab_size=len(want) + 5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in e.value.details
    with pytest.raises(TeacherCallError) as e:
        fetch_vocab_pieces(info["endpoint"], timeout=1e-9)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
