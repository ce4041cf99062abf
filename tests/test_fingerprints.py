"""Teacher identity: a teacher's fingerprint (teacher_server.fingerprint) where students and people
read it, the reader pinning one per service (distill.fingerprints), and `distill check-teachers`.

Real parts throughout: teacher-server processes and in-process servers on loopback, a real etcd,
real tiny models (tests.models.tiny_lm drawn from a seed, a tiny Hugging Face Llama on disk)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families

from discovery import open_registry
from discovery.local_etcd import LocalEtcd
from distill import DistillReader, cli
from distill.fingerprints import FingerprintChangedError
from protos.kserve import FINGERPRINT_PARAMETER
from teacher_server import ServerConfig, launch
from teacher_server.fingerprint import of_source
from tests.etcd_fixtures import arun, unique_service
from tests.hf_models import save_llama
from tests.models import tiny_lm
from tests.servers import REPO, ServerThread

LM = ["--model", "tests.models:tiny_lm", "--name", "lm", "--device", "cpu", "--max-batch-size", "16", "--ttl", "3",
      "--metrics-port", "0"]


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One service, three teachers: two of seed 0 (a teacher-server process and one in this process)
    and a process of seed 1 (other weights)."""
    service = unique_service("fp")
    logs = tmp_path_factory.mktemp("fp-teachers")
    with contextlib.ExitStack() as stack:
        servers = {iid: launch.TeacherProcess(
            [*LM, "--model-arg", f"seed={seed}", "--registry", etcd.address, "--service", service, "--instance-id",
             iid], cwd=REPO, log=logs / f"{iid}.log", ready_timeout=120, stop_grace=5.0)
            for iid, seed in (("a-1", 0), ("b-odd", 1))}
        here = stack.enter_context(ServerThread(_lm(0)))  # started while the processes start
        launch.start_all(stack, list(servers.values()))
        stack.enter_context(_registered(here, etcd, service, "a-2"))
        assert here.server is not None
        info = {iid: server.ready for iid, server in servers.items()}
        info["a-2"] = {"endpoint": here.url, "metrics_port": here.server.metrics_port}
        yield {"service": service, "info": info, "records": _records(etcd, service, 3)}


def _records(etcd: LocalEtcd, service: str, count: int) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        async with open_registry(etcd.address) as reg:
            for _ in range(100):
                found = await reg.teachers(service)
                if len(found) == count:
                    return {iid: entry.record for iid, entry in found.items()}
                await asyncio.sleep(0.1)
        raise AssertionError(f"{count} teachers did not register in {service!r}")

    return arun(read())


def _requests(metrics_port: int) -> float:
    """The teacher's successful inference requests (Triton's nv_inference_request_success)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "nv_inference_request_success":
            return sum(s.value for s in fam.samples)
    raise AssertionError("/metrics has no nv_inference_request_success")


def _config_fingerprint(endpoint: str, model: str) -> str:
    with tg.InferenceServerClient(endpoint) as c:
        return str(c.get_model_config(model).config.parameters[FINGERPRINT_PARAMETER].string_value)


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return {"TOKENS": torch.randint(0, 50, (4, 6), generator=g), "idx": torch.arange(4 * i, 4 * i + 4)}


def _logits(seed: int, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tiny_lm(seed=seed)(tokens)


def test_same_weights_same_fingerprint_across_processes_other_weights_or_dtype_another(
        replicas: dict[str, Any]) -> None:
    recs, info = replicas["records"], replicas["info"]
    fps = {iid: rec.fingerprint for iid, rec in recs.items()}
    assert all(fp.startswith("fp-") and len(fp) == 19 for fp in fps.values()), fps
    assert fps["a-1"] == fps["a-2"] != fps["b-odd"]
    for iid, fp in fps.items():  # the model metadata says what the record says
        assert _config_fingerprint(info[iid]["endpoint"], "lm") == fp
    # a-2 runs in this process: the same factory and seed give a-1's fingerprint; another compute dtype another.
    bf16 = ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", model_args={"seed": 0},
                        compute_dtype="BF16")
    with ServerThread(bf16) as b:
        assert b.server is not None
        assert b.server.record().fingerprint not in (fps["a-1"], fps["b-odd"], "")


def _http(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_an_hf_teacher_is_known_by_its_files_in_record_metadata_models_and_system_fingerprint(
        tmp_path: Path) -> None:
    """hf:DIR hashes the directory's files: hashing them again gives what the server computed at
    load, another seed or compute dtype another; /v1/models and every /v1/completions answer carry it."""
    for name, seed in (("one", 0), ("other", 1)):
        save_llama(tmp_path / name, seed=seed)
    with ServerThread(ServerConfig(model=f"hf:{tmp_path / 'one'}", name="llama", device="cpu", http_port=0)) as s:
        assert s.server is not None
        fp = s.server.record().fingerprint
        assert fp.startswith("fp-") and _config_fingerprint(s.url, "llama") == fp
        base = f"http://127.0.0.1:{s.server.http_port}"
        assert _http(base + "/v1/models")["data"][0]["fingerprint"] == fp
        answer = _http(base + "/v1/completions", {"prompt": [[5, 9, 30]], "max_tokens": 1, "prompt_logprobs": 1})
        assert answer["system_fingerprint"] == fp
    # What the server computed at load, from the files alone (no model loaded here):
    assert of_source(f"hf:{tmp_path / 'one'}", "FP32") == fp
    others = {of_source(f"hf:{tmp_path / 'other'}", "FP32"), of_source(f"hf:{tmp_path / 'one'}", "BF16")}
    assert len(others) == 2 and fp not in others, others


def test_a_replica_with_other_weights_is_never_used_and_check_teachers_names_it(
        etcd: LocalEtcd, replicas: dict[str, Any]) -> None:
    service, info, recs = replicas["service"], replicas["info"], replicas["records"]
    batches = [_batch(i) for i in range(12)]
    with DistillReader(batches, registry=etcd.address, service=service, inputs=["TOKENS"],
                       outputs=["LOGITS"], timeout=10) as reader:
        for batch, teacher in reader:
            torch.testing.assert_close(teacher["LOGITS"], _logits(0, batch["TOKENS"]))
        pinned = reader.stats().fingerprints[service]
    assert pinned["pinned"] == recs["a-1"].fingerprint
    assert pinned["refused"] == 1 and pinned["refused_endpoints"] == [info["b-odd"]["endpoint"]]
    assert _requests(info["b-odd"]["metrics_port"]) == 0
    assert _requests(info["a-1"]["metrics_port"]) + _requests(info["a-2"]["metrics_port"]) > 0

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["check-teachers", "--registry", etcd.address, "--service", service])
    table = out.getvalue()
    assert status == 1, table
    [odd] = [line for line in table.splitlines() if line.startswith(info["b-odd"]["endpoint"])]
    assert recs["b-odd"].fingerprint in odd and "OTHER FINGERPRINT" in odd and "OUTPUTS DIFFER" in odd
    for iid in ("a-1", "a-2"):
        [line] = [x for x in table.splitlines() if x.startswith(info[iid]["endpoint"])]
        assert recs[iid].fingerprint in line and ("reference" in line or "same" in line), table
    same = io.StringIO()
    with contextlib.redirect_stdout(same):
        status = cli.main(["check-teachers", "--teachers", f"{info['a-1']['endpoint']},{info['a-2']['endpoint']}"])
    assert status == 0 and "2 of 2 replica(s) agree" in same.getvalue(), same.getvalue()


def test_the_store_records_the_fingerprint_of_the_teachers_that_answered(
        etcd: LocalEtcd, replicas: dict[str, Any], tmp_path: Path) -> None:
    service = replicas["service"]
    with DistillReader([_batch(i) for i in range(6)], registry=etcd.address, service=service, inputs=["TOKENS"],
                       outputs=["LOGITS"], cache=tmp_path / "store", key="idx") as reader:
        assert sum(1 for _ in reader) == 6
    shards = sorted((tmp_path / "store" / "shards").glob("*.arrow"))
    assert shards, "no shard was sealed"
    for shard in shards:
        with pa.OSFile(str(shard), "rb") as f:
            meta = pa.ipc.open_file(f).schema.metadata
        recorded = json.loads(meta[b"distill.cache.teacher_fingerprints"])
        assert recorded == {service: replicas["records"]["a-1"].fingerprint}


def test_distill_top_shows_each_replicas_fingerprint_and_that_they_differ(
        etcd: LocalEtcd, replicas: dict[str, Any]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["top", "--registry", etcd.address, "--service", replicas["service"], "--once"]) == 0
    screen = out.getvalue()
    assert "FINGERPRINT" in screen and "2 different fingerprints" in screen, screen
    for iid, rec in replicas["records"].items():
        [row] = [line for line in screen.splitlines() if replicas["info"][iid]["endpoint"] in line]
        assert rec.fingerprint in row, screen


@contextlib.contextmanager
def _registered(s: ServerThread, etcd: LocalEtcd, service: str, instance_id: str) -> Iterator[None]:
    """`s` registered under `service` while the block runs (deregistered at its end: it left)."""
    stack = contextlib.AsyncExitStack()

    async def enter() -> None:
        assert s.server is not None
        reg = await stack.enter_async_context(open_registry(etcd.address))
        record = s.server.record()
        record.instance_id = instance_id
        await stack.enter_async_context(reg.register(service, record, ttl=3))

    s.call(enter())
    try:
        yield
    finally:
        s.call(stack.aclose())


def _lm(seed: int) -> ServerConfig:
    return ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", metrics_port=0,
                        model_args={"seed": seed})


def _wait_for(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["fail", "switch"])
def test_a_finished_rolling_upgrade_fails_or_switches(etcd: LocalEtcd, mode: str) -> None:
    """The old teacher serves; a new one (other weights) joins and is refused; the old one leaves.
    "fail" raises FingerprintChangedError naming both; "switch" goes on with the new teacher."""
    service = unique_service(f"upgrade-{mode}")
    with ServerThread(_lm(0)) as old, ServerThread(_lm(1)) as new:
        assert old.server is not None and new.server is not None
        old_fp, new_fp = old.server.record().fingerprint, new.server.record().fingerprint
        with contextlib.ExitStack() as leaving:
            leaving.enter_context(_registered(old, etcd, service, "old"))
            reader = DistillReader((_batch(i) for i in range(200)), registry=etcd.address, service=service,
                                   inputs=["TOKENS"], outputs=["LOGITS"], prefetch=1, timeout=10,
                                   no_teacher_timeout=30, on_fingerprint_change=mode)
            with reader, _registered(new, etcd, service, "new"):
                batches = iter(reader)
                for _ in range(3):
                    batch, teacher = next(batches)
                    torch.testing.assert_close(teacher["LOGITS"], _logits(0, batch["TOKENS"]))
                _wait_for(lambda: reader.stats().fingerprints[service]["refused"] == 1, "the new teacher is refused")
                leaving.close()  # the old teacher deregisters: the upgrade is finished
                if mode == "fail":
                    with pytest.raises(FingerprintChangedError) as failed:
                        for _ in range(20):
                            next(batches)
                    assert (failed.value.old, failed.value.new) == (old_fp, new_fp)
                    assert old_fp in str(failed.value) and new_fp in str(failed.value)
                    assert "on_fingerprint_change='switch'" in str(failed.value)
                    assert _requests(new.server.metrics_port or 0) == 0
                    return
                switched = False
                for _ in range(20):
                    batch, teacher = next(batches)
                    if torch.allclose(teacher["LOGITS"], _logits(1, batch["TOKENS"])):
                        switched = True
                        break
                    torch.testing.assert_close(teacher["LOGITS"], _logits(0, batch["TOKENS"]))  # read ahead
                assert switched, "no batch answered by the new teacher"
                stats = reader.stats().fingerprints[service]
                assert stats["pinned"] == new_fp and stats["switches"] == 1 and stats["refused"] == 0
                assert _requests(new.server.metrics_port or 0) > 0
