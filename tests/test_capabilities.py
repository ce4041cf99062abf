"""Capabilities routing: a request goes only to teachers that can answer it.

* Pure functions (`distill.capabilities`): what a request needs (its parameters and SCORE_IDS),
  what a record offers (declared, undeclared, none), the gaps in words, the router's choice among
  real `TeacherState` records, and what teacher-server declares for a model's tensors.
* Real teacher-server processes (a tiny `hf:` Llama) and a real etcd: the record a teacher-server
  registers declares its capabilities; a service with two teachers, one registering itself and one
  registered by hand with fewer capabilities (top-k at most 8, no SCORE_IDS, no tail, no whole
  outputs), sends plain requests to both, requests needing more only to the capable one (each
  teacher's own request counter says so), and fails a request none can answer at once with
  `NoCapableTeacherError` naming the gap and what each teacher offers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import tritonclient.grpc as tg
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import BatchRejectedError, DistillReader, NoCapableTeacherError, NoTeacherError
from distill.batches import Chunk, Job
from distill.capabilities import (
    ALL,
    UNBOUNDED_TOP_K,
    Needs,
    Offers,
    covers,
    describe_offers,
    missing,
    needs_of,
    offers_of,
    request_needs,
    unanswerable,
)
from distill.router import Router
from distill.types import ChunkRequest, FieldArray, TeacherMetadata
from protos import registry_pb2
from teacher_server.capabilities import CAPABILITIES_PARAMETER, declared_capabilities
from teacher_server.launch import TeacherProcess
from teacher_server.spec import ModelIO, TensorSpec
from tests.etcd_fixtures import arun, unique_service
from tests.hf_models import VOCAB, save_llama
from tests.servers import REPO

pytestmark = pytest.mark.timeout(240)

# ---- pure functions ---------------------------------------------------------------------------


def test_needs_follow_the_parameters_and_score_ids() -> None:
    assert needs_of({}) == Needs(full_outputs=True)
    assert needs_of({"top_k": 0, "logprobs": True}) == Needs(full_outputs=True)  # top_k 0: the full outputs
    assert needs_of({"top_k": 8, "logprobs": True}) == Needs(top_k=8)
    assert needs_of({"top_k": 8, "topk_tail": True}) == Needs(top_k=8, tail=True)
    assert needs_of({"topk_tail": True}) == Needs(full_outputs=True)  # a tail without top-k brings nothing
    assert needs_of({"token_logprobs": True}) == Needs(token_logprobs=True)
    assert needs_of({"token_logprobs": True}, ["INPUT_IDS", "SCORE_IDS"]) == Needs(token_logprobs=True,
                                                                                    score_ids=True)
    ids = FieldArray(torch.zeros(2, 5, dtype=torch.int64).numpy(), "INT64")
    scores = FieldArray(torch.zeros(2, 5, 3, dtype=torch.int32).numpy(), "INT32")
    req = ChunkRequest("m", "", "0:0:0", {"INPUT_IDS": ids, "SCORE_IDS": scores}, 0, 2, ("LOGITS",),
                       parameters={"top_k": 4})
    assert request_needs(req) == Needs(top_k=4, score_ids=True)


def test_needs_are_computed_once_per_parameter_mapping() -> None:
    params = {"top_k": 16, "logprobs": True}
    first = needs_of(params)
    assert needs_of(params) is first  # the same mapping: the cached needs
    changed = {"top_k": 2}
    assert needs_of(changed) == Needs(top_k=2)  # another mapping, even at a reused id, is read afresh


def test_offers_come_from_the_record_and_default_to_everything() -> None:
    assert offers_of(None) is ALL  # a static host:port
    plain = registry_pb2.TeacherRecord(endpoint="127.0.0.1:1", model_name="m")
    assert offers_of(plain) is ALL  # a teacher-server of before capabilities
    engine = registry_pb2.TeacherRecord(endpoint="127.0.0.1:2", protocol="vllm", capabilities=registry_pb2.Capabilities(
        declared=True, max_top_k=20, token_logprobs=True, chunked=True))
    offers = offers_of(engine)
    assert offers == Offers("vllm", True, 20, True, False, False, False, True, False)
    assert not offers.complete and ALL.complete
    assert describe_offers(offers) == "vllm: top_k<=20, token_logprobs"
    assert "everything" in describe_offers(ALL)
    static_engine = offers_of(registry_pb2.TeacherRecord(endpoint="127.0.0.1:3", protocol="sglang"))
    assert (static_engine.protocol, static_engine.declared, static_engine.score_ids, static_engine.full_outputs,
            static_engine.token_logprobs, static_engine.max_top_k) == ("sglang", False, False, False, True,
                                                                       UNBOUNDED_TOP_K)
    assert describe_offers(static_engine) == "sglang: top_k, topk_tail, token_logprobs"


def test_missing_names_each_gap() -> None:
    engine = Offers("vllm", True, 20, True, False, False, False)
    assert missing(engine, Needs(top_k=64, token_logprobs=True, score_ids=True)) == [
        "top_k 64 > its max 20", "SCORE_IDS"]
    assert missing(engine, Needs(top_k=8, tail=True)) == ["topk_tail"]
    assert missing(engine, Needs(full_outputs=True)) == ["dense outputs"]
    assert missing(Offers("kserve", True, 0, False, False, False, True), Needs(top_k=2)) == ["top_k"]
    assert missing(engine, Needs(top_k=20, token_logprobs=True)) == []
    assert covers(engine, Needs(top_k=20)) and not covers(engine, Needs(top_k=21))
    assert missing(ALL, Needs(top_k=10**6, tail=True, token_logprobs=True, score_ids=True, full_outputs=True)) == []


def test_the_router_picks_only_teachers_that_can_answer() -> None:
    router = Router("llm")
    small = router.add("small", "127.0.0.1:1", None, None)  # type: ignore[arg-type]  # no client: never called
    big = router.add("big", "127.0.0.1:2", None, None)  # type: ignore[arg-type]
    for t in (small, big):
        router.set_metadata(t, TeacherMetadata("m", "", 4, {}, {}))
    router.set_offers(small, Offers("vllm", True, 8, True, False, False, False))
    for _ in range(20):  # the policy chooses among the able ones only, however its dice fall
        assert router.pick(needs=Needs(top_k=16)) is big
        assert router.pick(needs=Needs(score_ids=True)) is big
    assert {router.pick(needs=Needs(top_k=4)).key for _ in range(40)} == {"small", "big"}  # type: ignore[union-attr]
    router.set_offers(big, Offers("kserve", True, 8, True, False, False, True))
    assert router.pick(needs=Needs(top_k=16)) is None


def test_the_error_names_each_teachers_gaps_or_the_capable_ones_state() -> None:
    router = Router("llm")
    a = router.add("a", "127.0.0.1:1", None, None)  # type: ignore[arg-type]  # no client: never called
    b = router.add("b", "127.0.0.1:2", None, None)  # type: ignore[arg-type]
    gone = router.add("c", "127.0.0.1:3", None, None)  # type: ignore[arg-type]
    router.set_offers(a, Offers("kserve", True, 100, True, False, True, True))
    router.set_offers(b, Offers("vllm", True, 20, True, True, True, False))
    router.remove("c")
    chunk = Chunk(Job(0, 3), "llm", 0, 2)
    needs = Needs(top_k=64, score_ids=True)
    error = unanswerable("llm", chunk, needs, [a, b, gone])
    assert error is not None and error.missing == ()  # no gap is common to both: each one's is named
    assert "batch 3 of this pass (rows 0..1)" in str(error) and "127.0.0.1:3" not in str(error)
    assert ("each lacks part of it: 127.0.0.1:1 lacks SCORE_IDS; 127.0.0.1:2 lacks top_k 64 > its max 20"
            in str(error)), str(error)
    assert unanswerable("llm", chunk, needs, [gone]) is None  # none live: the no-teacher case, not this one
    able = Needs(top_k=64)
    assert unanswerable("llm", chunk, able, [a, b]) is None  # a can answer it
    late = unanswerable("llm", chunk, able, [a, b], waited_s=30)  # ... but was not usable for 30 s
    assert late is not None and "the teachers that offer it were not usable for 30 s (127.0.0.1:1 [" in str(late)


def test_teacher_server_declares_what_its_model_allows() -> None:
    vision = ModelIO((TensorSpec("INPUT", "FP32", (3, 8, 8)),), (TensorSpec("LOGITS", "FP32", (100,)),))
    caps = declared_capabilities(vision)
    assert (caps.declared, caps.max_top_k, caps.tail, caps.full_outputs, caps.chunked) == (True, 100, True, True, True)
    assert not caps.token_logprobs and not caps.score_ids and not caps.text_prompts
    lm = ModelIO((TensorSpec("IDS", "INT64", (-1,), pad_value=0),),
                 (TensorSpec("LOGITS", "FP32", (-1, 50), per_position=True),))
    caps = declared_capabilities(lm)
    assert (caps.max_top_k, caps.token_logprobs, caps.score_ids, caps.tail) == (50, True, True, True)
    open_classes = ModelIO((TensorSpec("X", "FP32", (4,)),), (TensorSpec("Y", "INT64", (-1,)),))
    caps = declared_capabilities(open_classes)
    assert caps.max_top_k == UNBOUNDED_TOP_K and not caps.tail  # an integer output has no tail mass
    pooled = ModelIO((TensorSpec("X", "FP32", (4,)),), (TensorSpec("Y", "FP32", ()),))
    assert declared_capabilities(pooled).max_top_k == 0


# ---- real teachers and a real etcd ------------------------------------------------------------

INPUTS = {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask"}
LIMITED = registry_pb2.Capabilities(declared=True, max_top_k=8, token_logprobs=True, score_ids=False, tail=False,
                                    full_outputs=False, chunked=True)


class HeldRegistration:
    """A record registered by hand (`Registry.register`), held on its own event loop thread until exit."""

    def __init__(self, address: str, service: str, record: registry_pb2.TeacherRecord) -> None:
        self.address, self.service, self.record = address, service, record
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="test-registration")
        self._stack = contextlib.AsyncExitStack()

    def __enter__(self) -> HeldRegistration:
        self._thread.start()

        async def enter() -> None:
            reg = await self._stack.enter_async_context(open_registry(self.address))
            await self._stack.enter_async_context(reg.register(self.service, self.record, ttl=5.0))

        asyncio.run_coroutine_threadsafe(enter(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stack.aclose(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


def _requests(metrics_port: int) -> float:
    """A teacher's own count of answered inference requests (its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "nv_inference_request_success":
            return sum(s.value for s in family.samples)
    raise AssertionError("the teacher's /metrics has no nv_inference_request_success")


def _registered(address: str, service: str) -> dict[str, registry_pb2.TeacherRecord]:
    async def read() -> dict[str, registry_pb2.TeacherRecord]:
        async with open_registry(address) as reg:
            snapshot = await reg.teachers(service)
            return {iid: entry.record for iid, entry in snapshot.items()}

    return arun(read())


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """etcd; teacher A registering itself under service `svc`; teacher B (no registry of its own)
    registered by hand under `svc` and alone under `limited` with the LIMITED capabilities."""
    pytest.importorskip("transformers")
    model = tmp_path_factory.mktemp("caps-llama")
    save_llama(model)
    logs = tmp_path_factory.mktemp("caps-logs")
    service, limited = unique_service("caps"), unique_service("caps-limited")
    args = ["--model", f"hf:{model}", "--name", "llama", "--device", "cpu", "--instances", "1",
            "--max-batch-size", "4", "--max-queue-delay-us", "2000", "--metrics-port", "0"]
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd())
        teachers = [TeacherProcess(args, log=logs / name, cwd=REPO, ready_timeout=180, stop_grace=5.0)
                    for name, args in (("a.log", [*args, "--registry", etcd.address, "--service", service,
                                                   "--instance-id", "a-full"]), ("b.log", args))]
        for teacher in teachers:  # both load at once
            stack.callback(teacher.cleanup)
            teacher.launch()
        a, b = (teacher.wait_ready().ready for teacher in teachers)
        record = _registered(etcd.address, service)["a-full"]
        for name, instance in ((service, "b-limited"), (limited, "b-alone")):
            copy = registry_pb2.TeacherRecord()
            copy.CopyFrom(record)
            copy.instance_id, copy.endpoint = instance, b["endpoint"]
            copy.capabilities.CopyFrom(LIMITED)
            stack.enter_context(HeldRegistration(etcd.address, name, copy))
        yield {"etcd": etcd, "a": a, "b": b, "service": service, "limited": limited}


def _batches(n: int, scored: bool = False) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (2, 6), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "i": torch.full((2,), i)}
        if scored:
            batch["score_ids"] = torch.randint(0, VOCAB, (2, 6, 3), generator=g, dtype=torch.int32)
        out.append(batch)
    return out


def _read(mesh: dict[str, Any], n: int, scored: bool = False, **options: Any) -> tuple[float, float]:
    """Read `n` batches of the service through a reader with `options`; each teacher's requests."""
    before = _requests(mesh["a"]["metrics_port"]), _requests(mesh["b"]["metrics_port"])
    inputs = {**INPUTS, "SCORE_IDS": "score_ids"} if scored else INPUTS
    with DistillReader(_batches(n, scored), registry=mesh["etcd"].address, service=mesh["service"], inputs=inputs,
                       outputs=["LOGITS"], timeout=30.0, **options) as reader:
        seen = [int(batch["i"][0]) for batch, _ in reader]
        offers = {endpoint: t["offers"] for endpoint, t in reader.stats().teachers[mesh["service"]].items()}
    full = f"kserve: top_k<={VOCAB}, topk_tail, token_logprobs, SCORE_IDS, dense outputs"
    assert offers == {mesh["a"]["endpoint"]: full, mesh["b"]["endpoint"]: "kserve: top_k<=8, token_logprobs"}
    assert seen == list(range(n))
    return (_requests(mesh["a"]["metrics_port"]) - before[0], _requests(mesh["b"]["metrics_port"]) - before[1])


def test_a_teacher_server_registers_its_capabilities(mesh: dict[str, Any]) -> None:
    records = _registered(mesh["etcd"].address, mesh["service"])
    assert set(records) == {"a-full", "b-limited"}
    a = records["a-full"]
    assert a.protocol == "kserve" and a.endpoint == mesh["a"]["endpoint"]
    caps = a.capabilities
    assert (caps.declared, caps.max_top_k, caps.token_logprobs, caps.score_ids, caps.tail, caps.full_outputs,
            caps.chunked, caps.text_prompts) == (True, VOCAB, True, True, True, True, True, False)
    # Its ModelConfig says the same (what `distill register --engine kserve` copies into a record).
    with tg.InferenceServerClient(mesh["a"]["endpoint"]) as client:
        parameters = client.get_model_config("llama", as_json=True)["config"]["parameters"]
    assert json_format.Parse(parameters[CAPABILITIES_PARAMETER]["string_value"], registry_pb2.Capabilities()) == caps


def test_plain_requests_use_both_teachers(mesh: dict[str, Any]) -> None:
    a, b = _read(mesh, 24, top_k=4, logprobs=True)
    assert a > 0 and b > 0, f"requests: capable {a}, limited {b}"


def test_requests_needing_more_go_only_to_the_capable_teacher(mesh: dict[str, Any]) -> None:
    a, b = _read(mesh, 8, top_k=16, logprobs=True)  # wider than the limited teacher's 8
    assert a > 0 and b == 0, f"requests: capable {a}, limited {b}"
    a, b = _read(mesh, 8, scored=True, token_logprobs=True)  # SCORE_IDS, which the limited one lacks
    assert a > 0 and b == 0, f"requests: capable {a}, limited {b}"
    a, b = _read(mesh, 6)  # whole LOGITS, which the limited one does not send
    assert a > 0 and b == 0, f"requests: capable {a}, limited {b}"


def test_a_request_no_teacher_can_answer_fails_at_once_naming_the_gap(mesh: dict[str, Any]) -> None:
    before = _requests(mesh["a"]["metrics_port"]), _requests(mesh["b"]["metrics_port"])
    # no_teacher_timeout past the test's own timeout: only an answer at once passes.
    with DistillReader(_batches(2), registry=mesh["etcd"].address, service=mesh["service"], inputs=INPUTS,
                       outputs=["LOGITS"], top_k=VOCAB + 3, logprobs=True, no_teacher_timeout=600) as reader:
        items = iter(reader)
        with pytest.raises(NoCapableTeacherError) as caught:
            next(items)
        with pytest.raises(NoCapableTeacherError):  # only that batch is lost: the next one fails alike
            next(items)
    message = str(caught.value)
    assert isinstance(caught.value, BatchRejectedError) and not isinstance(caught.value, NoTeacherError)
    assert f"top_k {VOCAB + 3}" in message and f"none offers top_k {VOCAB + 3}" in message, message
    assert f"{mesh['a']['endpoint']} (kserve: top_k<={VOCAB}, topk_tail, token_logprobs, SCORE_IDS" in message
    assert f"{mesh['b']['endpoint']} (kserve: top_k<=8, token_logprobs)" in message, message
    assert caught.value.missing == (f"top_k {VOCAB + 3}",) and caught.value.service == mesh["service"]
    after = _requests(mesh["a"]["metrics_port"]), _requests(mesh["b"]["metrics_port"])
    assert after == before, "a teacher was sent a request it cannot answer"


def test_a_scored_request_to_a_service_without_score_ids_fails_naming_it(mesh: dict[str, Any]) -> None:
    inputs = {**INPUTS, "SCORE_IDS": "score_ids"}
    with (DistillReader(None, registry=mesh["etcd"].address, service=mesh["limited"], inputs=inputs,
                        outputs=["LOGITS"], token_logprobs=True, no_teacher_timeout=600) as reader,
          pytest.raises(NoCapableTeacherError) as caught):
        reader.score(_batches(1, scored=True)[0], deadline_s=600)
    message = str(caught.value)
    assert f"teachers of service {mesh['limited']!r}: {mesh['b']['endpoint']} (kserve: top_k<=8, token_logprobs)" \
        in message and "none offers SCORE_IDS" in message, message
    assert caught.value.missing == ("SCORE_IDS",)
