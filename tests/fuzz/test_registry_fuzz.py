"""Malformed etcd records under a service's teacher keys, and malformed registry addresses.

Records: whatever bytes land under ``/distill/v1/<svc>/teachers/`` (garbage, another message
type, a record without an endpoint, keys with extra segments), the watch skips what is not a
usable TeacherRecord, never dies, and keeps showing the valid teachers. Addresses:
``parse_address`` on any string returns an address or raises ValueError, nothing else.

Default 1,000 cases (records: a fifth of that, each costs etcd round trips); nightly-style run:
``FUZZ_EXAMPLES=10000 .venv/bin/pytest tests/fuzz``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from discovery import EtcdRegistry, keys
from discovery.address import parse_address
from discovery.local_etcd import LocalEtcd
from protos import registry_pb2
from tests.etcd_fixtures import next_matching, raw_client, record, unique_service
from tests.faults.helpers import LoopThread
from tests.fuzz.wire import EXAMPLES

pytestmark = pytest.mark.timeout(600)

SERVICE = unique_service("fuzz")
PREFIX = keys.teachers_prefix(SERVICE)


class Watcher:
    """One etcd, one raw client for the fuzzer's writes, one EtcdRegistry watch, all on one loop."""

    def __init__(self, etcd: LocalEtcd, loop: LoopThread) -> None:
        self.etcd, self.loop = etcd, loop
        self.marker = 0
        self._raw_cm: Any = None
        self.raw: Any = None
        self.registry: EtcdRegistry | None = None
        self.watch: Any = None

    async def open(self) -> None:
        self._raw_cm = raw_client(self.etcd)
        self.raw = await self._raw_cm.__aenter__()
        self.registry = EtcdRegistry(self.etcd.endpoint, timeout=5.0)
        await self.registry.__aenter__()
        self.watch = self.registry.watch(SERVICE)
        await self.raw.put(keys.teacher_key(SERVICE, "good").encode(), record("good").SerializeToString())
        await next_matching(self.watch, lambda s: "good" in s)

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.aclose()
        if self.registry is not None:
            await self.registry.__aexit__(None, None, None)
        if self._raw_cm is not None:
            await self._raw_cm.__aexit__(None, None, None)

    async def inject(self, entries: list[tuple[bytes, bytes]]) -> set[str]:
        """Write ``entries``, then bump a marker teacher and wait until the watch shows it: etcd
        delivers events in order, so that snapshot reflects every write before it. Returns the ids
        in that snapshot; the entries are deleted again afterwards."""
        for key, value in entries:
            await self.raw.put(key, value)
        self.marker += 1
        mark = self.marker
        await self.raw.put(keys.teacher_key(SERVICE, "marker").encode(),
                           record("marker", started_at=float(mark)).SerializeToString())
        snap = await next_matching(
            self.watch, lambda s: "marker" in s and s["marker"].record.started_at == float(mark), timeout=10)
        for key, _ in entries:
            await self.raw.delete(key)
        return set(snap)


@pytest.fixture(scope="module")
def watcher() -> Iterator[Watcher]:
    with LocalEtcd() as etcd, LoopThread() as loop:
        w = Watcher(etcd, loop)
        loop.run(w.open())
        try:
            yield w
        finally:
            loop.run(w.close())


def _usable(key: bytes, value: bytes) -> str | None:
    """The id the watch may show for this entry: a teacher key of ours holding a TeacherRecord
    with an endpoint (random bytes sometimes are one); None when it must be skipped."""
    split = keys.split_key(SERVICE, key)
    if split is None or split[0] != "teachers":
        return None
    rec = registry_pb2.TeacherRecord()
    try:
        rec.ParseFromString(value)
    except Exception:
        return None
    return split[1] if rec.endpoint else None


key_names = st.sampled_from(["bad", "good", "a/b", "", "x" * 300, "é", "marker2"]) | st.text(
    st.characters(blacklist_categories=["Cs"]), max_size=12)
values = st.one_of(
    st.binary(max_size=256),
    st.just(b""),
    st.builds(lambda: registry_pb2.TeacherLoad(instance_id="bad", queue_depth=3).SerializeToString()),
    st.builds(lambda: registry_pb2.StudentDemand(student_id="s", samples_per_s=1.0).SerializeToString()),
    st.builds(lambda: registry_pb2.TeacherRecord(instance_id="no-endpoint", model_name="m").SerializeToString()),
    st.integers(0, 40).map(lambda n: record("cut", 9100).SerializeToString()[:n]),
    st.binary(max_size=32).map(lambda b: record("tail", 9101).SerializeToString() + b),
)


@settings(max_examples=max(50, EXAMPLES // 5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(st.tuples(key_names, values), min_size=1, max_size=4, unique_by=lambda e: e[0]))
def test_malformed_teacher_records_are_skipped(watcher: Watcher, entries: list[tuple[str, bytes]]) -> None:
    written = [((PREFIX + name).encode("utf-8", "surrogatepass"), value) for name, value in entries
               if name not in ("good", "marker")]
    seen = watcher.loop.run(watcher.inject(written), timeout=30)
    allowed = {"good", "marker"} | {u for k, v in written if (u := _usable(k, v)) is not None}
    assert {"good", "marker"} <= seen, f"a valid teacher disappeared: {seen}"
    assert seen <= allowed, f"unusable records shown: {seen - allowed}"


@settings(max_examples=EXAMPLES, deadline=None)
@given(text=st.one_of(
    st.text(max_size=40),
    st.tuples(
        st.sampled_from(["etcd://", "static://", "ETCD://", "http://", "etcd:/", "", "etcd://etcd://"]),
        st.lists(st.tuples(
            st.sampled_from(["127.0.0.1", "localhost", "[::1]", "::1", "[::1", "", "h_1", "-x", "a..b", "[]"])
            | st.text(max_size=8),
            st.sampled_from(["", ":", ":2379", ":0", ":65536", ":-1", ":99999999999999999999", ":x", "::"])
            | st.integers(-10, 70000).map(lambda p: f":{p}")),
            max_size=3).map(lambda eps: ",".join(h + p for h, p in eps)),
        st.sampled_from(["", "/", "/path", "?q", "#f", " ", ",", "\x00"]),
    ).map("".join),
))
def test_parse_address_raises_only_value_error(text: str) -> None:
    try:
        addr = parse_address(text)
    except ValueError as e:
        assert str(e), "an empty error message"
        return
    assert addr.scheme in ("etcd", "static") and addr.endpoints, addr
    assert all(1 <= ep.port <= 65535 and ep.host for ep in addr.endpoints), addr
