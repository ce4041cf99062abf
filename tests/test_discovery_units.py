"""Discovery pieces that need no etcd: addresses, keys, subsetting, the static backend, dispatch,
and that TLS/auth options reach the etcd client object."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from discovery import (
    ElectionError,
    EtcdRegistry,
    Registry,
    RegistryError,
    RegistryUnsupportedError,
    StaticRegistry,
    TeacherEntry,
    TeacherSet,
    keys,
    open_registry,
    parse_address,
    parse_registry_address,
    subset,
)
from discovery.address import Endpoint
from discovery.backends import BACKENDS, Backend
from protos import registry_pb2
from tests.etcd_fixtures import arun

pytestmark = pytest.mark.timeout(60)


# -- addresses ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "scheme", "endpoints"),
    [
        ("etcd://10.0.0.5:2379", "etcd", ["10.0.0.5:2379"]),
        ("etcd://h1:2379,h2:2380", "etcd", ["h1:2379", "h2:2380"]),
        ("etcd://etcd-0.etcd.svc:2379", "etcd", ["etcd-0.etcd.svc:2379"]),
        ("etcd://myhost", "etcd", ["myhost:2379"]),
        ("ETCD://h:1/", "etcd", ["h:1"]),
        ("etcd://[::1]:2379", "etcd", ["[::1]:2379"]),
        ("etcd://[::1]:2379,127.0.0.1:2379", "etcd", ["[::1]:2379", "127.0.0.1:2379"]),
        ("etcd://[fe80::1%eth0]:2379", "etcd", ["[fe80::1%eth0]:2379"]),
        ("static://127.0.0.1:9898,127.0.0.1:9899", "static", ["127.0.0.1:9898", "127.0.0.1:9899"]),
        ("static://a:1, b:2 ,a:1", "static", ["a:1", "b:2"]),
    ],
)
def test_parse_address_accepts(text: str, scheme: str, endpoints: list[str]) -> None:
    addr = parse_address(text)
    assert addr.scheme == scheme
    assert list(addr.hostports) == endpoints
    assert parse_address(str(addr)) == addr


def test_ipv6_endpoint_keeps_host_without_brackets() -> None:
    (ep,) = parse_address("etcd://[::1]:2379").endpoints
    assert ep == Endpoint("::1", 2379)
    assert ep.is_ipv6


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("etcd://", "no endpoints"),
        ("static://", "no endpoints"),
        ("static://nohostport", "no port"),
        ("http://h:2379", "unknown scheme"),
        ("h:2379", "missing scheme"),
        ("", "missing scheme"),
        ("etcd://h:0", "port"),
        ("etcd://h:65536", "port"),
        ("etcd://h:abc", "port"),
        ("etcd://h:", "port"),
        ("etcd://:2379", "no host"),
        ("etcd://::1:2379", "brackets"),
        ("etcd://[::1:2379", "never closes"),
        ("etcd://[nothex]:2379", "IPv6"),
        ("etcd://h:1,,h:2", "empty endpoint"),
        ("etcd://user:pw@h:2379", "credentials"),
        ("etcd://h:2379/path", "path"),
        ("etcd://bad host:1", "not a valid host"),
    ],
)
def test_parse_address_rejects_with_accepted_forms(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_address(text)
    msg = str(info.value)
    assert reason in msg
    assert "etcd://HOST:PORT" in msg and "static://HOST:PORT" in msg


# -- keys -----------------------------------------------------------------------------------------
def test_key_layout() -> None:
    assert keys.teacher_key("svc", "t1") == "/distill/v1/svc/teachers/t1"
    assert keys.load_key("svc", "t1") == "/distill/v1/svc/load/t1"
    assert keys.student_key("svc", "s1") == "/distill/v1/svc/students/s1"
    assert keys.autoscaler_prefix("svc") == "/distill/v1/svc/autoscaler/"
    assert keys.teacher_key("svc", "10.0.0.1:9898") == "/distill/v1/svc/teachers/10.0.0.1:9898"
    assert keys.split_key("svc", b"/distill/v1/svc/teachers/t1") == ("teachers", "t1")
    assert keys.split_key("svc", "/distill/v1/svc/load/t1") == ("load", "t1")
    assert keys.split_key("svc", "/distill/v1/other/load/t1") is None
    assert keys.split_key("svc", "/distill/v1/svc/teachers/t1/extra") is None
    assert keys.split_key("svc", "/distill/v1/svc/unknown/t1") is None


@pytest.mark.parametrize("bad", ["", "a/b", "/", " lead", "trail ", "nul\x00", "x" * 300])
def test_key_names_are_validated(bad: str) -> None:
    with pytest.raises(ValueError, match="service name"):
        keys.service_prefix(bad)
    with pytest.raises(ValueError, match="instance_id"):
        keys.teacher_key("svc", bad)
    with pytest.raises(ValueError, match="student_id"):
        keys.student_key("svc", bad)


def test_register_rejects_bad_records_at_once() -> None:
    reg = EtcdRegistry("127.0.0.1:1")
    with pytest.raises(ValueError, match="instance_id"):
        reg.register("svc", registry_pb2.TeacherRecord(endpoint="h:1"))
    with pytest.raises(ValueError, match="endpoint"):
        reg.register("svc", registry_pb2.TeacherRecord(instance_id="t1"))
    with pytest.raises(ValueError, match="service name"):
        reg.register("a/b", registry_pb2.TeacherRecord(instance_id="t1", endpoint="h:1"))
    with pytest.raises(ValueError, match="ttl"):
        reg.register("svc", registry_pb2.TeacherRecord(instance_id="t1", endpoint="h:1"), ttl=0)
    with pytest.raises(TypeError):
        reg.register("svc", "not a record")  # type: ignore[arg-type]


# -- subset ---------------------------------------------------------------------------------------
teacher_names = st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=30, unique=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(student=st.text(max_size=12), teachers=teacher_names, k=st.integers(0, 10))
def test_subset_is_deterministic_and_sized(student: str, teachers: list[str], k: int) -> None:
    chosen = subset(student, teachers, k)
    assert chosen == subset(student, list(reversed(teachers)), k)
    assert chosen == subset(student, teachers + teachers, k)
    assert len(chosen) == min(k, len(teachers))
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(teachers)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(student=st.text(max_size=12), teachers=teacher_names, k=st.integers(1, 10), data=st.data())
def test_subset_is_stable_when_a_teacher_leaves(student: str, teachers: list[str], k: int, data: st.DataObject) -> None:
    if not teachers:
        return
    before = subset(student, teachers, k)
    gone = data.draw(st.sampled_from(teachers))
    after = subset(student, [t for t in teachers if t != gone], k)
    if gone not in before:
        assert after == before  # an unrelated teacher leaving changes nothing
    else:
        assert set(before) - {gone} <= set(after)  # only the leaver is replaced
        assert len(set(after) - set(before)) <= 1


@settings(max_examples=200, deadline=None, derandomize=True)
@given(student=st.text(max_size=12), teachers=teacher_names, k=st.integers(1, 10), new=st.text(min_size=1, max_size=12))
def test_subset_changes_at_most_one_member_when_a_teacher_joins(
    student: str, teachers: list[str], k: int, new: str
) -> None:
    if new in teachers:
        return
    before = set(subset(student, teachers, k))
    after = set(subset(student, [*teachers, new], k))
    assert after - before <= {new}
    assert len(before - after) <= 1


def test_subset_spreads_students_over_teachers() -> None:
    teachers = [f"10.0.0.{i}:9898" for i in range(10)]
    counts = Counter(t for s in range(1000) for t in subset(f"student-{s}", teachers, 3))
    assert sum(counts.values()) == 3000
    assert all(200 <= c <= 400 for c in counts.values()), counts


def test_subset_rejects_negative_k() -> None:
    with pytest.raises(ValueError):
        subset("s", ["a"], -1)


# -- static backend and dispatch ------------------------------------------------------------------
def test_static_registry_yields_one_snapshot_then_blocks_until_closed() -> None:
    async def main() -> None:
        reg = open_registry("static://127.0.0.1:9898,[::1]:9899")
        assert isinstance(reg, StaticRegistry)
        watch = reg.watch("svc")
        snap = await watch.__anext__()
        assert set(snap) == {"127.0.0.1:9898", "[::1]:9899"}
        entry = snap["[::1]:9899"]
        assert entry.record.endpoint == "[::1]:9899" and entry.record.instance_id == "[::1]:9899"
        assert entry.record.model_name == "" and entry.load is None
        nxt = asyncio.ensure_future(watch.__anext__())
        await asyncio.sleep(0.2)
        assert not nxt.done()  # nothing more until closed
        await reg.close()
        with pytest.raises(StopAsyncIteration):
            await nxt
        with pytest.raises(RegistryError):
            await reg.teachers("svc")

    arun(main())


def test_static_registry_register_and_demand_are_noops() -> None:
    async def main() -> None:
        async with StaticRegistry(["127.0.0.1:9898"]) as reg:
            rec = registry_pb2.TeacherRecord(instance_id="t1", endpoint="h:1")
            async with reg.register("svc", rec, load=registry_pb2.TeacherLoad) as r:
                assert not r.registered and r.lease_id is None
                assert await r.wait_registered(0.01) is False
            demand = registry_pb2.StudentDemand(student_id="s1")
            async with reg.publish_demand("svc", lambda: demand):
                pass
            assert await reg.demand("svc") == []
            assert await reg.loads("svc") == {}
            assert set(await reg.teachers("svc")) == {"127.0.0.1:9898"}
        with pytest.raises(RegistryError):
            reg.watch("svc")

    arun(main())


def test_open_registry_dispatches_on_scheme() -> None:
    etcd = open_registry("etcd://127.0.0.1:2379,127.0.0.2:2379", timeout=2.0)
    assert isinstance(etcd, EtcdRegistry) and isinstance(etcd, Registry)
    assert [str(e) for e in etcd.endpoints] == ["127.0.0.1:2379", "127.0.0.2:2379"]
    assert etcd.timeout == 2.0
    assert isinstance(open_registry("static://h:1"), StaticRegistry)
    with pytest.raises(ValueError, match="accepted forms"):
        open_registry("zookeeper://h:2181")


def test_static_registry_has_no_view_and_no_election() -> None:
    async def main() -> None:
        async with open_registry("static://127.0.0.1:9898") as reg:
            assert reg.address == "static://127.0.0.1:9898"
            assert await reg.autoscaler_decision("svc") is None
            with pytest.raises(RegistryUnsupportedError, match="keeps no loads"):
                await reg.view()
            with pytest.raises(ElectionError, match="etcd registry"):
                reg.election("svc", identity="a")

    arun(main())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("e:2379", "expected etcd://HOST:PORT"),
        ("static://a:1", "a registry address is etcd://"),
        ("http://e:2379", "unknown scheme 'http://'"),
        ("etcd://", "no endpoints"),
    ],
)
def test_parse_registry_address_accepts_only_backends_with_shared_state(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        parse_registry_address(text, hint="for a fixed list use --teachers")
    if "://" not in text or text.startswith("static"):
        assert str(e.value).endswith("; for a fixed list use --teachers")
    assert str(parse_registry_address("etcd://h1, h2:2380")) == "etcd://h1:2379,h2:2380"


def test_a_backend_is_one_entry_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new scheme is known to the address parser, the registry flags and open_registry as soon
    as its entry is registered (here: the static class under another name, with a default port)."""
    monkeypatch.setitem(BACKENDS, "fixed", Backend("fixed", "discovery.static:StaticRegistry", 9898, False,
                                                   "fixed://h:9898"))
    address = parse_address("fixed://h1,h2:1")
    assert address.scheme == "fixed" and address.hostports == ("h1:9898", "h2:1")
    assert isinstance(open_registry("fixed://h1"), StaticRegistry)
    with pytest.raises(ValueError, match="no shared state"):
        parse_registry_address("fixed://h1")
    monkeypatch.setitem(BACKENDS, "fixed", Backend("fixed", "discovery.etcd:EtcdRegistry", 2379, True,
                                                   "fixed://h:2379"))
    assert str(parse_registry_address("fixed://h1")) == "fixed://h1:2379"
    with pytest.raises(ValueError, match=r"etcd://HOST:PORT.* or fixed://HOST:PORT"):
        parse_registry_address("h1")


def test_teacher_set_is_an_immutable_mapping() -> None:
    rec = registry_pb2.TeacherRecord(instance_id="t1", endpoint="h:1")
    snap = TeacherSet({"t1": TeacherEntry(rec)}, revision=7)
    assert snap.revision == 7 and len(snap) == 1 and snap["t1"].endpoint == "h:1"
    assert snap.endpoints() == {"t1": "h:1"}
    assert snap == TeacherSet({"t1": TeacherEntry(registry_pb2.TeacherRecord(instance_id="t1", endpoint="h:1"))})
    with pytest.raises(TypeError):
        snap["t2"] = TeacherEntry(rec)  # type: ignore[index]


# -- TLS and authentication options reach the client ---------------------------------------------
def test_tls_and_auth_options_reach_the_etcd_client(tmp_path: Path) -> None:
    ca, key, cert = tmp_path / "ca.pem", tmp_path / "client.key", tmp_path / "client.pem"
    ca.write_bytes(b"CA-PEM")
    key.write_bytes(b"KEY-PEM")
    cert.write_bytes(b"CERT-PEM")
    reg = open_registry(
        "etcd://127.0.0.1:1,[::1]:2",
        ca_cert=ca,
        cert_key=str(key),
        cert_cert=cert,
        username="alice",
        password="s3cret",
        timeout=1.5,
    )
    assert isinstance(reg, EtcdRegistry)
    client = reg.client()
    assert client.tls is True
    assert isinstance(client.credentials, grpc.ChannelCredentials)
    assert (client.root_certificates, client.private_key, client.certificate_chain) == (
        b"CA-PEM",
        b"KEY-PEM",
        b"CERT-PEM",
    )
    assert client.username == "alice" and client._username == "alice" and client._password == "s3cret"
    assert client._timeout == 1.5
    assert client.target == "127.0.0.1:1"
    assert client._options["grpc.max_reconnect_backoff_ms"] > 0

    plain = EtcdRegistry("[::1]:2379").client()
    assert plain.tls is False and plain.credentials is None and plain.target == "[::1]:2379"


def test_bad_security_options_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both username and password"):
        EtcdRegistry("h:1", username="alice")
    with pytest.raises(ValueError, match="cert_key and cert_cert"):
        EtcdRegistry("h:1", cert_key=tmp_path / "k")
    with pytest.raises(ValueError, match="cannot read ca_cert"):
        EtcdRegistry("h:1", ca_cert=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="timeout"):
        EtcdRegistry("h:1", timeout=0)
