"""The reader sends texts (`distill.text_fields`): a real etcd and a teacher-server process with a
tokenizer (`tests.tokenizer_models`) registered with `text_prompts`; batches whose field is a list
of str come back in order, exactly once, their chunks' widths merged; `score()` takes texts; a
service whose record does not declare `text_prompts` is refused at once, a static teacher whose
metadata declares TEXT takes them; a store refuses texts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from discovery.local_etcd import LocalEtcd
from distill import DistillReader, NoCapableTeacherError
from distill.text_fields import PAD_VALUES
from protos import registry_pb2
from teacher_server.launch import TeacherProcess
from tests.etcd_fixtures import unique_service
from tests.hf_models import load_reference, reference_logprobs
from tests.servers import REPO
from tests.test_capabilities import HeldRegistration, _registered
from tests.tokenizer_models import TEXTS, save_text_teacher

transformers = pytest.importorskip("transformers")

MAX_BATCH = 2  # a batch of 5 texts goes as 3 chunks of other widths


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """etcd; a byte-level BPE text teacher registered under `service`, and its record without
    `text_prompts` alone under `plain`."""
    directory = tmp_path_factory.mktemp("text-reader")
    tokenizer = save_text_teacher(directory, "byte_bpe")
    service, plain = unique_service("text"), unique_service("text-plain")
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd())
        args = ["--model", f"hf:{directory}", "--name", "text", "--device", "cpu", "--max-batch-size",
                str(MAX_BATCH), "--max-queue-delay-us", "2000", "--registry", etcd.address, "--service", service,
                "--instance-id", "text-1"]
        teacher = TeacherProcess(args, log=directory / "teacher.log", cwd=REPO, ready_timeout=180, stop_grace=5.0)
        stack.callback(teacher.cleanup)
        info = teacher.start().ready
        record = _registered(etcd.address, service)["text-1"]
        assert record.capabilities.text_prompts, "a teacher with a tokenizer declares text prompts"
        copy = registry_pb2.TeacherRecord()
        copy.CopyFrom(record)
        copy.instance_id = "no-text"
        copy.capabilities.text_prompts = False
        stack.enter_context(HeldRegistration(etcd.address, plain, copy))
        yield {"etcd": etcd, "service": service, "plain": plain, "endpoint": info["endpoint"],
               "tokenizer": tokenizer, "reference": load_reference(directory)}


def _batches(n: int) -> list[dict[str, Any]]:
    """n batches of 5 texts each (rows of TEXTS in a batch-dependent order), with their index."""
    out = []
    for i in range(n):
        order = [(i + j * 3) % len(TEXTS) for j in range(5)]
        out.append({"text": [TEXTS[k] for k in order], "i": torch.full((5,), i)})
    return out


def _check(mesh: dict[str, Any], texts: list[str], outputs: dict[str, torch.Tensor]) -> None:
    """Each row is the teacher's tokenization and the model's log-probs on it, padded to the
    batch's widest row as `distill.text_fields` says."""
    tok = mesh["tokenizer"]
    encoded = [tok(t)["input_ids"] for t in texts]
    width = max(len(e) for e in encoded)
    ids, spans, mask = outputs["TEXT_IDS"], outputs["TEXT_SPANS"], outputs["TEXT_MASK"]
    logprobs = outputs["LOGITS_TOKEN_LOGPROBS"]
    assert ids.shape == mask.shape == logprobs.shape == (len(texts), width), "padded to the batch's widest"
    assert spans.shape == (len(texts), width, 2)
    for row, (text, want_ids) in enumerate(zip(texts, encoded, strict=True)):
        n = len(want_ids)
        assert ids[row, :n].tolist() == want_ids and (ids[row, n:] == 0).all()
        assert (mask[row, :n] == 1).all() and (mask[row, n:] == 0).all()
        assert (spans[row, n:] == PAD_VALUES["TEXT_SPANS"]).all() and spans[row, n - 1, 1] == len(text.encode())
        want = reference_logprobs(mesh["reference"], want_ids)
        own = want[:-1].gather(1, torch.tensor(want_ids[1:])[:, None])[:, 0]
        assert torch.allclose(logprobs[row, :n - 1], own, atol=1e-4), text
        assert (logprobs[row, n - 1:] == 0).all()


def test_a_reader_sends_texts_and_merges_the_chunks_widths(mesh: dict[str, Any]) -> None:
    batches = _batches(4)
    with DistillReader(batches, registry=mesh["etcd"].address, service=mesh["service"], inputs={"TEXT": "text"},
                       outputs=["TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS"], token_logprobs=True,
                       timeout=30.0) as reader:
        got = list(reader)
    assert [int(b["i"][0]) for b, _ in got] == list(range(len(batches))), "in order, each batch once"
    widths = set()
    for batch, outputs in got:
        _check(mesh, batch["text"], outputs)
        widths.add(outputs["TEXT_IDS"].shape[1])
    assert len(widths) > 1, "batches of other texts come back at their own widths"


def test_score_takes_texts(mesh: dict[str, Any]) -> None:
    texts = list(TEXTS[:3])
    with DistillReader(None, registry=mesh["etcd"].address, service=mesh["service"], inputs=["TEXT"],
                       token_logprobs=True, timeout=30.0) as reader:
        outputs = reader.score(texts)  # a batch that is its texts
        by_array = reader.score({"TEXT": np.array(texts)})
    assert set(outputs) == {"TEXT_IDS", "TEXT_SPANS", "TEXT_MASK", "LOGITS_TOKEN_LOGPROBS"}, \
        "with no outputs named, every declared output but the vocabulary's"
    _check(mesh, texts, outputs)
    assert all(torch.equal(outputs[n], by_array[n]) for n in outputs)


def test_texts_go_only_to_teachers_that_declare_text_prompts(mesh: dict[str, Any]) -> None:
    with DistillReader(_batches(1), registry=mesh["etcd"].address, service=mesh["plain"], inputs={"TEXT": "text"},
                       outputs=["LOGITS"], token_logprobs=True, timeout=30.0) as reader, \
            pytest.raises(NoCapableTeacherError) as e:
        next(iter(reader))
    assert "text prompts" in str(e.value) and e.value.missing == ("text prompts",)


def test_a_store_refuses_texts(mesh: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not store answers to texts"):
        DistillReader(_batches(1), registry=mesh["etcd"].address, service=mesh["service"], inputs={"TEXT": "text"},
                      outputs=["LOGITS"], cache=str(tmp_path / "store"), key="i")


def test_a_row_that_is_not_text_is_named(mesh: dict[str, Any]) -> None:
    with DistillReader(None, registry=mesh["etcd"].address, service=mesh["service"], inputs=["TEXT"],
                       timeout=30.0) as reader, pytest.raises(TypeError, match="row 1 is a int"):
        reader.score({"TEXT": np.array(["fine", 3], dtype=object)})


def test_a_static_teacher_takes_texts_when_its_metadata_declares_text(mesh: dict[str, Any]) -> None:
    texts = list(TEXTS[3:6])
    with DistillReader(None, teachers=mesh["endpoint"], inputs=["TEXT"], token_logprobs=True,
                       timeout=30.0) as reader:
        outputs = reader.score(texts)
    _check(mesh, texts, outputs)
