"""Watching a service in etcd as a stream of full, consistent teacher-set snapshots.

etcd gives events; students want the whole current set. So a watch does one consistent read of the
teachers (and their loads), then watches from the next revision; bursts are coalesced and paced; a
dropped stream is resumed from the last revision seen; a compacted revision (or a different etcd
cluster) triggers a full reload; a periodic full read guards against anything missed. Values that
do not parse are skipped with one warning per key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import aetcd
from google.protobuf.message import DecodeError

from discovery import keys
from discovery.aio import Backoff, StateLog, cancel_and_wait, deadline
from discovery.base import StudentDemand, TeacherEntry, TeacherLoad, TeacherRecord, TeacherSet, TeacherWatch
from discovery.etcd.client import EtcdConnection, describe_error

__all__ = ["WatchState", "parse_all", "produce_snapshots"]

# One logger for the whole etcd backend's watch messages, as before the package split.
log = logging.getLogger("discovery.etcd")

# Snapshot pacing: membership changes reach consumers after at most this long...
_MIN_PUBLISH_INTERVAL = 0.05
# ...while load-only changes (every teacher, every second) are folded into fewer snapshots.
_LOAD_PUBLISH_INTERVAL = 0.25


class WatchState:
    """The teachers and loads of one service as known to one watch, plus revisions per prefix."""

    def __init__(self, service: str, warned: set[bytes]) -> None:
        self.service = service
        self.teachers: dict[str, TeacherRecord] = {}
        self.loads: dict[str, TeacherLoad] = {}
        self.rev: dict[str, int] = {"teachers": 0, "load": 0}
        self.cluster_id: int | None = None
        self.membership_dirty = False
        self.load_dirty = False
        self._warned = warned

    @property
    def revision(self) -> int:
        return max(self.rev.values())

    def reset(self, revision: int, cluster_id: int, teacher_kvs: Iterable[Any], load_kvs: Iterable[Any]) -> None:
        teachers = parse_all(self.service, "teachers", teacher_kvs, self._warned)
        loads = parse_all(self.service, "load", load_kvs, self._warned)
        if teachers != self.teachers:
            self.membership_dirty = True
        if loads != self.loads:
            self.load_dirty = True
        self.teachers, self.loads = teachers, loads
        self.rev = {"teachers": revision, "load": revision}
        self.cluster_id = cluster_id

    def apply(self, kind: str, event: aetcd.Event) -> None:
        kv = event.kv
        if kv.mod_revision <= self.rev[kind]:
            return  # already reflected by a later full read
        self.rev[kind] = kv.mod_revision
        split = keys.split_key(self.service, kv.key)
        if split is None or split[0] != kind:
            return
        name = split[1]
        table: dict[str, Any] = self.teachers if kind == "teachers" else self.loads
        if event.kind == aetcd.EventKind.DELETE:
            self._warned.discard(kv.key)
            if table.pop(name, None) is not None:
                self._mark(kind)
            return
        msg = _parse(self.service, kind, name, kv.key, kv.value, warned=self._warned)
        if msg is None:
            if table.pop(name, None) is not None:
                self._mark(kind)
        elif table.get(name) != msg:
            table[name] = msg
            self._mark(kind)

    def _mark(self, kind: str) -> None:
        if kind == "teachers":
            self.membership_dirty = True
        else:
            self.load_dirty = True

    def snapshot(self) -> TeacherSet:
        self.membership_dirty = self.load_dirty = False
        return TeacherSet(
            {iid: TeacherEntry(rec, self.loads.get(iid)) for iid, rec in self.teachers.items()},
            self.revision,
        )


def _parse(service: str, kind: str, name: str, key: bytes, value: bytes, *, warned: set[bytes]) -> Any:
    """Decode one value; None (with one warning per key) if it is not a usable message."""
    cls = {"teachers": TeacherRecord, "load": TeacherLoad, "students": StudentDemand}[kind]
    msg = cls()
    problem = None
    try:
        msg.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError) as e:
        problem = f"does not parse as {msg.DESCRIPTOR.full_name} ({e})"
    else:
        if kind == "teachers" and not msg.endpoint:
            problem = "is a TeacherRecord without an endpoint"
    if problem is not None:
        if key not in warned:
            warned.add(key)
            log.warning(
                "skipping etcd key %s of service %r: its value (%d bytes) %s",
                key.decode("utf-8", "replace"),
                service,
                len(value),
                problem,
            )
        return None
    warned.discard(key)
    id_field = "student_id" if kind == "students" else "instance_id"
    if not getattr(msg, id_field):
        setattr(msg, id_field, name)
    return msg


def parse_all(service: str, kind: str, kvs: Iterable[Any], warned: set[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        split = keys.split_key(service, kv.key)
        if split is None or split[0] != kind:
            continue
        msg = _parse(service, kind, split[1], kv.key, kv.value, warned=warned)
        if msg is not None:
            out[split[1]] = msg
    return out


class _WatchEnded(Exception):
    """The etcd watch stream ended without an error (the client was closed or switched)."""


async def _pump(kind: str, stream: aetcd.Watch, queue: asyncio.Queue[Any]) -> None:
    try:
        async for event in stream:
            queue.put_nowait((kind, event))
        queue.put_nowait(_WatchEnded(f"the {kind} watch stream ended"))
    except Exception as e:
        queue.put_nowait(e)


async def produce_snapshots(
    conn: EtcdConnection, watch: TeacherWatch, service: str, resync_interval: float, loads: bool = True
) -> None:
    """The producer of one :class:`TeacherWatch`: read, watch, apply, publish; resume, reload or
    re-sync as needed. Runs until cancelled; never raises because etcd is unreachable."""
    state = WatchState(service, set())
    prefixes = {"teachers": keys.teachers_prefix(service), "load": keys.load_prefix(service)}
    kinds = ("teachers", "load") if loads else ("teachers",)
    backoff = Backoff(cap=conn.retry_max_backoff)
    slog = StateLog(log)
    need_reload = True
    published: list[TeacherSet | None] = [None]
    while True:
        client = conn.client()
        streams: list[aetcd.Watch] = []
        pumps: list[asyncio.Task[None]] = []
        try:
            if not need_reload:
                revision, cluster_id = await conn.read_header(client, prefixes["teachers"])
                if cluster_id != state.cluster_id or revision < state.revision:
                    log.info(
                        "watch of %r: etcd history does not continue from revision %d "
                        "(now %d, cluster %x, was %x); reading everything again",
                        service,
                        state.revision,
                        revision,
                        cluster_id,
                        state.cluster_id or 0,
                    )
                    need_reload = True
            if need_reload:
                revision, cluster_id, kvs = await conn.read_prefixes(client, [prefixes[k] for k in kinds])
                state.reset(revision, cluster_id, kvs[0], kvs[1] if loads else [])
                need_reload = False
                _publish(watch, state, published, force=published[0] is None)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            for kind in kinds:
                stream = await conn.call(
                    client.watch_prefix(prefixes[kind].encode(), start_revision=state.rev[kind] + 1)
                )
                streams.append(stream)
                pumps.append(asyncio.get_running_loop().create_task(_pump(kind, stream, queue)))
            was = slog.state
            slog.change(
                "watching",
                logging.INFO if was is not None else logging.DEBUG,
                "watching service %r at etcd %s from revision %d",
                service,
                client.endpoint,
                state.revision + 1,
            )
            backoff.reset()
            await _consume(watch, state, queue, published, time.monotonic() + resync_interval)
            need_reload = True  # periodic re-sync: a full read, then a fresh watch
        except aetcd.RevisionCompactedError as e:
            log.info(
                "watch of %r: revision %d is compacted (%s); reading everything again",
                service,
                state.revision + 1,
                e,
            )
            need_reload = True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            watch.note_error(e)
            slog.change(
                "down",
                logging.WARNING,
                "watch of %r at etcd %s interrupted (%s); keeping the last snapshot and "
                "retrying with backoff up to %g s",
                service,
                client.endpoint,
                describe_error(e),
                conn.retry_max_backoff,
            )
            conn.failed(client, e)
            await conn.pause(client, backoff.next_delay())
        finally:
            for task in pumps:
                await cancel_and_wait(task)
            for stream in streams:
                try:
                    async with deadline(1.0):
                        await stream.cancel()
                except Exception as e:
                    log.debug("cancelling an etcd watch: %s", describe_error(e))


def _publish(watch: TeacherWatch, state: WatchState, published: list[TeacherSet | None], force: bool) -> None:
    snap = state.snapshot()
    if force or snap != published[0]:
        published[0] = snap
        watch.publish(snap)


async def _consume(
    watch: TeacherWatch,
    state: WatchState,
    queue: asyncio.Queue[Any],
    published: list[TeacherSet | None],
    resync_at: float,
) -> None:
    """Apply events in batches and publish paced snapshots until a re-sync is due."""
    last_publish = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= resync_at:
            return
        due = resync_at
        if state.membership_dirty:
            due = min(due, last_publish + _MIN_PUBLISH_INTERVAL)
        elif state.load_dirty:
            due = min(due, last_publish + _LOAD_PUBLISH_INTERVAL)
        items: list[Any] = []
        if due > now:
            try:
                async with deadline(due - now):
                    items.append(await queue.get())
            except asyncio.TimeoutError:
                pass
        while not queue.empty():
            items.append(queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                if state.membership_dirty or state.load_dirty:
                    _publish(watch, state, published, force=False)
                raise item
            state.apply(*item)
        now = time.monotonic()
        if (state.membership_dirty and now >= last_publish + _MIN_PUBLISH_INTERVAL) or (
            state.load_dirty and now >= last_publish + _LOAD_PUBLISH_INTERVAL
        ):
            _publish(watch, state, published, force=False)
            last_publish = now
