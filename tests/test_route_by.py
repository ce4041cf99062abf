"""Per-sample routing (`route_by`): each row to its own expert teacher service, one dict of outputs
per batch in row order, against real teacher servers."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from distill import DistillReader
from distill.errors import RoutedOutputsMismatchError, RouteKeyError
from teacher_server import BatchingConfig, ModelIO, ServerConfig
from tests.models import Affine, Affine2
from tests.servers import ServerThread, teacher_process

MATH, CODE = Affine(), Affine2()  # same tensors, other weights: each row's answer shows its teacher


def _server(model: str, max_batch: int = 8) -> ServerThread:
    return ServerThread(ServerConfig(model=model, name="expert", device="cpu",
                                     batching=BatchingConfig(max_batch_size=max_batch, max_queue_delay_us=200)))


@pytest.fixture(scope="module")
def experts() -> Iterator[dict[str, str]]:
    with _server("tests.models:affine") as math, _server("tests.models:affine2") as code:
        yield {"math": math.url, "code": code.url}


def _batches(n: int, rows: int, seed: int = 0, labels: bool = False) -> list[dict[str, Any]]:
    """Batches whose rows name their teacher: by name, or as int labels (0 math, 1 code)."""
    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        which = torch.randint(0, 2, (rows,), generator=g)
        teacher: object = which if labels else ["math" if int(w) == 0 else "code" for w in which]
        out.append({"X": torch.randn(rows, 8, generator=g), "teacher": teacher, "which": which,
                    "idx": torch.full((rows,), i)})
    return out


def _expected(batch: dict[str, Any]) -> torch.Tensor:
    x, which = batch["X"], batch["which"]
    assert isinstance(x, torch.Tensor) and isinstance(which, torch.Tensor)
    with torch.inference_mode():
        return torch.where((which == 0).unsqueeze(1), MATH(x), CODE(x))


def test_rows_reach_their_own_teacher_and_come_back_in_order(experts: dict[str, str]) -> None:
    data = _batches(12, rows=20)  # 20 rows > max batch 8: each service's rows are split into chunks too
    data.append({**_batches(1, rows=5, seed=9)[0], "teacher": ["code"] * 5, "which": torch.ones(5, dtype=torch.long),
                 "idx": torch.full((5,), 12)})  # every row to one service: sent as it is
    seen = []
    with DistillReader(data, teachers=experts, route_by="teacher", inputs=["X"], outputs=["Y"]) as reader:
        for batch, teacher in reader:
            assert set(teacher) == {"Y"}, "one dict of outputs, not one per service"
            assert torch.allclose(teacher["Y"], _expected(batch), atol=1e-5), f"batch {int(batch['idx'][0])}"
            seen.append(int(batch["idx"][0]))
        stats = reader.stats()
    assert seen == list(range(13))
    rows = {s: int(sum(int((b["which"] == i).sum()) for b in data)) for i, s in enumerate(("math", "code"))}
    assert {s: v["rows"] for s, v in stats.routed.items()} == rows
    assert all(v["tokens"] == v["rows"] for v in stats.routed.values())  # flat inputs: a token a row
    assert all(t["samples"] > 0 for svc in stats.teachers.values() for t in svc.values())


def test_int_labels_through_route_map_and_a_default_for_unknown_keys(experts: dict[str, str]) -> None:
    data = _batches(4, rows=9, seed=3, labels=True)
    with DistillReader(data, teachers=experts, route_by="teacher", route_map={0: "math", 1: "code"},
                       inputs=["X"], prefetch=2) as reader:
        for batch, teacher in reader:
            assert torch.allclose(teacher["Y"], _expected(batch), atol=1e-5)
    # Keys 7 and None name no teacher: with default_teacher they go to it.
    x = torch.randn(4, 8)
    batch = {"X": x, "teacher": ["code", "bio", None, "math"]}
    with DistillReader([batch], teachers=experts, route_by="teacher", default_teacher="math",
                       inputs=["X"]) as reader:
        (_, teacher), = list(reader)
    with torch.inference_mode():
        want = torch.cat([CODE(x[:1]), MATH(x[1:])])
    assert torch.allclose(teacher["Y"], want, atol=1e-5)


def test_a_row_naming_no_teacher_refuses_its_batch_only(experts: dict[str, str]) -> None:
    good = _batches(2, rows=6, seed=4)
    bad = {**good[0], "teacher": ["math", "bio", "code", "math", "math", "math"]}
    with DistillReader([good[0], bad, good[1]], teachers=experts, route_by="teacher", inputs=["X"]) as reader:
        it = iter(reader)
        _, first = next(it)
        assert torch.allclose(first["Y"], _expected(good[0]), atol=1e-5)
        with pytest.raises(RouteKeyError, match=r"teacher key 'bio'.*\['math', 'code'\].*default_teacher") as err:
            next(it)
        assert err.value.key == "bio" and err.value.known == ("math", "code")
        _, last = next(it)  # the pass goes on with the next batch
        assert torch.allclose(last["Y"], _expected(good[1]), atol=1e-5)
    no_field = {"X": torch.randn(3, 8)}
    with DistillReader([no_field], teachers=experts, route_by="teacher", inputs=["X"]) as reader:
        with pytest.raises(RouteKeyError, match="no teacher key") as err:
            list(reader)
        assert err.value.key is None


def test_on_policy_score_is_routed(experts: dict[str, str]) -> None:
    batches = _batches(3, rows=7, seed=5)
    with DistillReader(None, teachers=experts, route_by="teacher", inputs=["X"]) as reader:
        for batch in batches:
            assert torch.allclose(reader.score(batch)["Y"], _expected(batch), atol=1e-5)
        futures = [reader.submit(b) for b in batches]
        assert all(torch.allclose(f.result(30)["Y"], _expected(b), atol=1e-5)
                   for f, b in zip(futures, batches, strict=True))
        with pytest.raises(RouteKeyError, match="'bio'"):
            reader.score({**batches[0], "teacher": ["bio"] * 7})
        assert reader.stats().routed["math"]["rows"] == 2 * sum(int((b["which"] == 0).sum()) for b in batches)


def test_services_with_other_outputs_are_refused_at_start(experts: dict[str, str]) -> None:
    narrow = ServerConfig(model="tests.models:undeclared", name="expert", device="cpu",
                          io=ModelIO.parse(["X:FP32:8"], ["Y:FP32:3"]))  # Y of 3 values, not 4
    with ServerThread(narrow) as other:
        reader = DistillReader([], teachers={"math": experts["math"], "narrow": other.url}, route_by="teacher",
                               inputs=["X"])
        with pytest.raises(RoutedOutputsMismatchError, match=r"'Y' is FP32 \[3\] per sample from service 'narrow' "
                           r"but FP32 \[4\] from 'math'"):
            reader.start()
        reader.close()
        # Compared after the reader's transforms: with top_k=2 both answer Y's top 2 of FP32, and may share a batch.
        with DistillReader([], teachers={"math": experts["math"], "narrow": other.url}, route_by="teacher",
                           inputs=["X"], top_k=2) as reader:
            assert reader.stats().teachers_in_use == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"teachers": "127.0.0.1:1", "route_by": "teacher"}, "this reader has 1"),
    ({"teachers": {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, "route_by": "t", "route_map": {0: "c"}},
     "maps 0 to 'c'"),
    ({"teachers": {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, "route_by": "t", "default_teacher": "c"},
     "default_teacher='c'"),
    ({"teachers": {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, "default_teacher": "a"}, "apply with route_by"),
])
def test_route_options_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistillReader([], inputs=["X"], **kwargs)


def test_a_teacher_killed_in_one_experts_pool_loses_nothing(experts: dict[str, str], tmp_path: Path) -> None:
    args = ["--model", "tests.models:sleepy_20", "--device", "cpu", "--max-batch-size", "4", "--name", "expert"]
    data = _batches(40, rows=10, seed=6)
    with teacher_process(args, tmp_path) as (victim, vinfo), teacher_process(args, tmp_path) as (_, sinfo):
        pool = f"{vinfo['endpoint']},{sinfo['endpoint']}"
        seen = []
        with DistillReader(data, teachers={"math": pool, "code": experts["code"]}, route_by="teacher", inputs=["X"],
                           timeout=5.0, prefetch=4) as reader:
            for i, (batch, teacher) in enumerate(reader):
                if i == 3:
                    victim.send_signal(signal.SIGKILL)
                assert torch.allclose(teacher["Y"], _expected(batch), atol=1e-5)  # sleepy_20 is Affine
                seen.append(int(batch["idx"][0]))
    assert seen == list(range(40))


def test_the_store_keeps_each_row_under_its_teacher(experts: dict[str, str], tmp_path: Path) -> None:
    data = _batches(4, rows=8, seed=7)
    for i, b in enumerate(data):
        b["index"] = torch.arange(i * 8, i * 8 + 8)
    store = str(tmp_path / "store")

    def one_pass(batches: list[dict[str, Any]]) -> dict[str, int]:
        with DistillReader(batches, teachers=experts, route_by="teacher", inputs=["X"], outputs=["Y"], cache=store,
                           key="index") as reader:
            for batch, teacher in reader:
                assert torch.allclose(teacher["Y"], _expected(batch), atol=1e-5)
            stats = reader.stats()
        return {"hits": stats.cache_hits, "misses": stats.cache_misses}

    assert one_pass(data) == {"hits": 0, "misses": 32}
    assert one_pass(data)["hits"] == 32  # every row stored under its own teacher
    # Rows 0..2 of each batch now go to the other teacher: asked of it, not served the first one's answer.
    moved = []
    for b in data:
        which = b["which"].clone()
        assert isinstance(which, torch.Tensor)
        which[:3] = 1 - which[:3]
        moved.append({**b, "which": which, "teacher": ["math" if int(w) == 0 else "code" for w in which]})
    assert one_pass(moved) == {"hits": 20, "misses": 12}


def test_padded_rows_come_back_at_the_batchs_own_width() -> None:
    from tests import seq_models

    def seq_server() -> ServerThread:
        return ServerThread(ServerConfig(model="tests.seq_models:causal_conv_lm", name="seq", device="cpu",
                                         batching=BatchingConfig(max_batch_size=16, max_queue_delay_us=200)))

    lengths = [3, 12, 2, 9, 4, 12, 5, 11]  # short rows to "short", long ones to "long": groups of other widths
    g = torch.Generator().manual_seed(8)
    tokens = torch.zeros(len(lengths), 12, dtype=torch.int64)
    mask = torch.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, seq_models.VOCAB, (n,), generator=g)
        mask[i, :n] = 1
    batch = {"TOKENS": tokens, "MASK": mask, "teacher": ["short" if n <= 5 else "long" for n in lengths]}
    ref = seq_models.causal_conv_lm()
    with seq_server() as short, seq_server() as long, \
            DistillReader(None, teachers={"short": short.url, "long": long.url}, route_by="teacher",
                          inputs=["TOKENS", "MASK"], outputs=["LOGITS", "POOLED"]) as reader:
        out = reader.score(batch)
        routed = reader.stats().routed
    assert out["LOGITS"].shape == (8, 12, seq_models.VOCAB) and out["POOLED"].shape == (8, seq_models.HIDDEN)
    for i, n in enumerate(lengths):
        with torch.inference_mode():
            want = ref(tokens[i:i + 1, :n], mask[i:i + 1, :n])
        assert torch.allclose(out["LOGITS"][i, :n], want["LOGITS"][0], atol=1e-5), f"row {i}"
        assert torch.allclose(out["POOLED"][i], want["POOLED"][0], atol=1e-5), f"row {i}"
    # No input named ATTENTION_MASK: a row's tokens are the token ids' padded width.
    assert routed["short"] == {"rows": 4, "tokens": 4 * 12} and routed["long"] == {"rows": 4, "tokens": 4 * 12}


def test_each_rows_service_whatever_form_its_key_takes() -> None:
    import numpy as np

    from distill.routing_keys import RouteTable

    services = ("math", "code", "bio")
    table = RouteTable("teacher", services, {0: "math", 1: "code", "alias": "bio", b"raw": "code"}, "bio")

    def one_by_one(keys: list[Any]) -> list[int]:  # each key on its own: names, aliases, labels, the default
        lookup = {"math": 0, "code": 1, "bio": 2, 0: 0, 1: 1, "alias": 2, b"raw": 1}
        return [lookup.get(int(k) if isinstance(k, str) and k.isdigit() else k, 2) for k in keys]

    cases: list[list[Any]] = [
        ["math", "code", "alias", "math", "bio", "code"],  # names and an alias
        ["math", "1", "", "nobody", "code", "0"],  # int labels written as strings, a missing and an unknown key
        [0, 1, 1, 0, 7],  # int labels; 7 goes to the default
        [b"raw", b"math", b"zzz"],  # bytes keys
        ["code", None, 0, "math"],  # a mixed list: None missing, 0 a label
    ]
    for keys in cases:
        got = table.which({"teacher": keys}, len(keys))
        assert got.dtype == np.int64 and got.tolist() == one_by_one(keys), keys
    labels = torch.tensor([1, 0, 0, 1, 5])
    assert table.which({"teacher": labels}, 5).tolist() == [1, 0, 0, 1, 2]
    assert table.which({"teacher": "code"}, 3).tolist() == [1, 1, 1]  # one key for the whole batch
    strict = RouteTable("teacher", services, {"alias": "bio"}, None)
    with pytest.raises(RouteKeyError, match="'nobody'") as err:  # the first unknown key, in sorted order
        strict.which({"teacher": ["math", "zed", "nobody", "code"]}, 4)
    assert err.value.key == "nobody"


def test_a_routed_batch_merges_bfloat16_and_marks_rows_of_inf_or_nan() -> None:
    import numpy as np

    from distill.batches import Job, signature_of
    from distill.outputs import VALID_ROWS
    from distill.routing_keys import RouteTable
    from distill.routing_rows import MERGED, route_job
    from distill.types import FieldArray

    keys = ["code", "math", "math", "code", "math"]
    fields = {"X": FieldArray(np.arange(10, dtype=np.float32).reshape(5, 2), "FP32")}
    table = RouteTable("teacher", ("math", "code"), {}, None)
    job = Job(0, 0, None, 5, fields, signature_of(fields))
    parts = route_job(job, table.plan(table.which({"teacher": keys}, 5), fields))
    assert [next(iter(p.remaining)) for p in parts] == ["math", "code"] and job.routed is not None
    for part in parts:  # each service answers its rows' inputs, doubled; "code" marks its second row invalid
        service = next(iter(part.remaining))
        x = torch.from_numpy(part.fields["X"].array)
        job.outputs[service] = {"Y": (2 * x).to(torch.bfloat16), "N": 2 * x,
                                **({VALID_ROWS: torch.tensor([True, False])} if service == "code" else {})}
    job.routed.merge()
    merged = job.outputs[MERGED]
    assert merged is not None
    want = 2 * torch.from_numpy(fields["X"].array)
    assert merged["Y"].dtype == torch.bfloat16 and torch.equal(merged["Y"].float(), want)
    assert merged["N"].dtype == torch.float32 and torch.equal(merged["N"], want)
    assert merged[VALID_ROWS].tolist() == [True, True, True, False, True]  # row 3: code's second row
