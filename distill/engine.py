"""The reader's engine: an asyncio program on a background thread.

The data path, in order:
  loader thread   next(loader) -> fields -> contiguous numpy arrays      (never on the event loop)
  read-ahead      a Job per batch, at most `prefetch` not yet consumed
  dispatcher      one per service: take the oldest chunk, pick a teacher, split the chunk to the
                  teacher's max batch, send it (ModelInfer, pre-serialized, with a deadline)
  on answer       check the outputs, copy them into the job's output tensors
  on failure      put the chunk back at the head of the queue: another teacher takes it
  delivery        completed jobs go to the training loop in loader order (or as they finish)

Exactly-once towards the training loop: a job is delivered once, when all its chunks have an
answer; duplicate answers (hedges, late retries) are dropped. At-least-once towards teachers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import torch

from discovery import Registry, TeacherSet, open_registry, subset
from distill.errors import NoTeacherError, TeacherMismatchError
from distill.fields import FieldArray, extract_inputs
from distill.router import Router, RouterConfig, Teacher
from distill.stats import ConsumptionMeter, ReaderStats
from distill.teacher_client import ClientTLS, TeacherClient, TeacherMetadata
from protos import registry_pb2
from protos.kserve import DATATYPES, decode_tensor, serialize_infer_request, service_pb2, shape_numel

log = logging.getLogger("distill.reader")

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class EngineOptions:
    """The reader's options, validated by DistillReader."""

    inputs: Mapping[str, str | int]
    outputs: tuple[str, ...] | None
    services: tuple[str, ...]
    static: Mapping[str, str] | None  # service -> "host:port,..." for fixed teacher lists
    registry: str | None
    registry_options: Mapping[str, Any]
    model: str | None
    model_version: str
    timeout: float
    no_teacher_timeout: float
    fallback: str
    max_teachers: int
    prefetch: int
    teacher_batch_size: int
    hedge_after: float | None  # fixed hedge delay in seconds; None: adaptive (see _hedge_delay) or off
    adaptive_hedge: bool
    ordered: bool
    top_k: int
    output_dtype: str | None
    student_id: str
    pin_memory: bool
    tls: ClientTLS | None = None
    router: RouterConfig = field(default_factory=RouterConfig)


# Items for the training loop's queue: (epoch, kind, payload).
BATCH, END, ERROR = "batch", "end", "error"


@dataclass(eq=False)
class Job:
    epoch: int
    seq: int
    batch: Any = None
    size: int = 0
    fields: dict[str, FieldArray] = field(default_factory=dict)
    signature: Signature = ()
    remaining: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, dict[str, torch.Tensor] | None] = field(default_factory=dict)
    error: BaseException | None = None
    delivered: bool = False


@dataclass(eq=False)
class Chunk:
    job: Job
    service: str
    start: int
    stop: int
    done: bool = False
    winner: str = ""
    sends: set[asyncio.Task[None]] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return self.stop - self.start


class _LoaderThread:
    """Pulls batches from the user's loader on a daemon thread, so a blocking loader never blocks the
    event loop and never keeps the interpreter from exiting."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distill-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # delivered to the awaiting coroutine
                _deliver(loop, _set_exception, fut, e)
            else:
                _deliver(loop, _set_result, fut, result)

        self._jobs.put(run)
        return fut

    def close(self) -> None:
        self._jobs.put(None)


def _deliver(loop: asyncio.AbstractEventLoop, setter: Callable[[asyncio.Future[Any], Any], None],
             fut: asyncio.Future[Any], value: Any) -> None:
    """Hand a loader result to the loop; if the reader closed meanwhile, nobody waits for it."""
    try:
        loop.call_soon_threadsafe(setter, fut, value)
    except RuntimeError:  # the event loop is closed
        pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_END_OF_LOADER = object()


class _Service:
    """One teacher service: its router, chunk queue and background tasks."""

    def __init__(self, name: str, config: RouterConfig) -> None:
        self.name = name
        self.router = Router(name, config)
        self.queue: deque[Chunk] = deque()
        self.arrived = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def push(self, chunk: Chunk, front: bool = False) -> None:
        (self.queue.appendleft if front else self.queue.append)(chunk)
        self.arrived.set()

    async def pop(self) -> Chunk:
        while not self.queue:
            self.arrived.clear()
            await self.arrived.wait()
        return self.queue.popleft()


class Engine:
    """Lives on the reader's event loop thread; the DistillReader talks to it thread-safely."""

    def __init__(self, options: EngineOptions, out: queue.Queue[tuple[int, str, Any]],
                 meter: ConsumptionMeter) -> None:
        self.opts = options
        self._out = out
        self._meter = meter
        self._services = {s: _Service(s, options.router) for s in options.services}
        self._registries: list[Registry] = []
        self._closing: list[contextlib.AbstractAsyncContextManager[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loader = _LoaderThread()
        self.epoch = 0
        self._epoch_task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(options.prefetch)
        self._ready: dict[int, Job] = {}
        self._next_seq = 0
        self._end_seq: int | None = None
        self.fallback_batches = 0
        self.retries = 0
        self.hedges = 0
        self._tls = options.tls.credentials() if options.tls is not None else None

    # ---- start-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Find teachers, check they serve what was asked, start dispatching; raises on mismatch."""
        opts = self.opts
        for svc in self._services.values():
            registry = self._registry_for(svc.name)
            # Membership only: routing uses the reader's own latency figures, and a drain shows as the
            # teacher's deregistration; load reports would reach every student 1/s per teacher.
            watch = registry.watch(svc.name, connect_timeout=min(opts.no_teacher_timeout, 30.0), loads=False)
            first = await watch.__anext__()  # RegistryUnavailableError surfaces here, at start
            self._apply_snapshot(svc, first)
            svc.tasks.append(self._spawn(self._watch(svc, watch), f"watch-{svc.name}"))
            svc.tasks.append(self._spawn(self._dispatch(svc), f"dispatch-{svc.name}"))
            if opts.registry and not opts.static:
                demand = registry.publish_demand(svc.name, self._demand_fn(svc), student_id=opts.student_id)
                await demand.__aenter__()
                self._closing.append(demand)
        for svc in self._services.values():
            await self._check_first_teacher(svc)

    def _registry_for(self, service: str) -> Registry:
        if self.opts.static is not None:
            reg = open_registry(f"static://{self.opts.static[service]}")
        else:
            if not self._registries:
                assert self.opts.registry is not None
                self._registries.append(open_registry(self.opts.registry, **self.opts.registry_options))
            return self._registries[0]
        self._registries.append(reg)
        return reg

    async def _check_first_teacher(self, svc: _Service) -> None:
        """Wait for one teacher's metadata and check names, so a typo fails before training starts."""
        deadline = time.monotonic() + self.opts.no_teacher_timeout
        while True:
            metas = [t for t in svc.router.teachers.values() if t.meta is not None]
            if metas:
                break
            if time.monotonic() >= deadline:
                if self.opts.fallback == "hard_labels":
                    log.warning("no teacher for service %r yet; training on hard labels until one appears", svc.name)
                    return
                raise self._no_teacher_error(svc)
            await svc.router.wait_change(min(1.0, deadline - time.monotonic()))
        t = metas[0]
        assert t.meta is not None
        missing_in = [n for n in self.opts.inputs if n not in t.meta.inputs]
        if missing_in:
            raise TeacherMismatchError(
                f"service {svc.name!r}: teacher {t.endpoint} (model {t.meta.model_name!r}) has no input "
                f"{missing_in[0]!r}; its inputs are {sorted(t.meta.inputs)}. Fix `inputs=` (teacher input name "
                "-> batch field)."
            )
        for name in self.opts.outputs or ():
            if name not in t.meta.outputs:
                raise TeacherMismatchError(
                    f"service {svc.name!r}: teacher {t.endpoint} (model {t.meta.model_name!r}) has no output "
                    f"{name!r}; its outputs are {sorted(t.meta.outputs)}. Fix `outputs=`."
                )

    def _no_teacher_error(self, svc: _Service) -> NoTeacherError:
        tried = ", ".join(t.describe() for t in svc.router.teachers.values()) or "none found"
        where = f"registry {self.opts.registry}" if self.opts.registry else "the static teacher list"
        return NoTeacherError(
            f"no usable teacher for service {svc.name!r} for {self.opts.no_teacher_timeout:g} s (from {where}); "
            f"teachers: {tried}. Start teacher-server processes, check the registry address and service name, "
            "or pass fallback='hard_labels' to train on labels alone meanwhile."
        )

    # ---- membership -------------------------------------------------------------------------
    async def _watch(self, svc: _Service, watch: Any) -> None:
        async with contextlib.aclosing(watch):
            async for snapshot in watch:
                self._apply_snapshot(svc, snapshot)

    def _apply_snapshot(self, svc: _Service, snapshot: TeacherSet) -> None:
        keys = list(snapshot)
        if self.opts.max_teachers and len(keys) > self.opts.max_teachers:
            keys = subset(self.opts.student_id, keys, self.opts.max_teachers)
        wanted = {k: snapshot[k] for k in keys}
        router = svc.router
        for key in list(router.teachers):
            t = router.teachers[key]
            entry = wanted.get(key)
            if entry is None or entry.endpoint != t.endpoint or (entry.load is not None and entry.load.draining):
                router.remove(key)
                self._spawn(self._close_when_idle(router, t), f"close-{t.endpoint}", critical=False)
                log.info("teacher %s left service %r", t.endpoint, svc.name)
            elif t.meta is None or t.meta != self._metadata_from(entry.record):
                meta = self._metadata_from(entry.record)
                if meta is not None:
                    router.set_metadata(t, meta)
        for key, entry in wanted.items():
            if key in router.teachers or (entry.load is not None and entry.load.draining):
                continue
            meta = self._metadata_from(entry.record)
            t = router.add(key, entry.endpoint, self._client(entry.endpoint, entry.record.tls), meta)
            log.info("teacher %s joined service %r", t.endpoint, svc.name)
            if meta is None:
                self._spawn(self._fetch_metadata(svc, t), f"metadata-{t.endpoint}", critical=False)
            else:
                self._check_model(svc, t)

    def _client(self, endpoint: str, registered_tls: bool) -> TeacherClient:
        """Plaintext, unless the reader was given TLS settings or the teacher registered as TLS
        (then the system's root certificates verify it)."""
        credentials = self._tls if self._tls is not None else (grpc.ssl_channel_credentials() if registered_tls
                                                               else None)
        server_name = self.opts.tls.server_name if self.opts.tls is not None else None
        return TeacherClient(endpoint, credentials, server_name)

    def _metadata_from(self, record: registry_pb2.TeacherRecord) -> TeacherMetadata | None:
        return TeacherMetadata.from_record(record)

    def _check_model(self, svc: _Service, t: Teacher) -> None:
        if t.meta is None:
            return
        if self.opts.model and t.meta.model_name != self.opts.model:
            svc.router.mark_incompatible(t, f"it serves model {t.meta.model_name!r}, not {self.opts.model!r}")
        elif t.meta.max_batch_size < 1:
            svc.router.mark_incompatible(t, "its model does not batch (max_batch_size 0)")
        else:
            missing = [n for n in self.opts.outputs or () if n not in t.meta.outputs]
            if missing:
                svc.router.mark_incompatible(t, f"it has no output {missing[0]!r} (outputs: {sorted(t.meta.outputs)})")

    async def _fetch_metadata(self, svc: _Service, t: Teacher) -> None:
        delay = 0.2
        while not t.removed:
            try:
                meta = await t.client.fetch_metadata(self.opts.model, self.opts.model_version,
                                                     timeout=min(self.opts.timeout, 10.0))
            except grpc.aio.AioRpcError as e:
                t.last_error = f"{e.code().name}: {e.details()}"
            except grpc.aio.UsageError:
                return  # the teacher left and its channel was closed
            except ValueError as e:
                svc.router.mark_incompatible(t, str(e))
                return
            else:
                svc.router.set_metadata(t, meta)
                self._check_model(svc, t)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _close_when_idle(self, router: Router, t: Teacher) -> None:
        """A departed teacher may still answer chunks it accepted (a drain); close after them."""
        deadline = time.monotonic() + self.opts.timeout + 1
        while t.in_flight > 0 and (remaining := deadline - time.monotonic()) > 0:
            await router.wait_change(remaining)
        await t.client.close()

    # ---- epochs -----------------------------------------------------------------------------
    def begin_epoch(self, loader: Any) -> int:
        """Start reading a new pass over `loader` (called on the loop thread); returns its epoch id."""
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        self.epoch += 1
        self._slots = asyncio.Semaphore(self.opts.prefetch)
        self._ready = {}
        self._next_seq = 0
        self._end_seq = None
        for svc in self._services.values():
            svc.queue.clear()
        self._epoch_task = self._spawn(self._read(self.epoch, loader), f"epoch-{self.epoch}")
        return self.epoch

    def consumed(self, epoch: int) -> None:
        """The training loop took a batch of `epoch`: one more may be read ahead."""
        if epoch == self.epoch:
            self._slots.release()

    async def _read(self, epoch: int, loader: Any) -> None:
        loop = asyncio.get_running_loop()
        inputs = self.opts.inputs
        try:
            iterator = await self._loader.submit(loop, lambda: iter(loader))
        except Exception as e:
            self._finish_with_error(epoch, 0, e)
            return

        def next_batch() -> tuple[Any, int, dict[str, FieldArray]] | object:
            try:
                batch = next(iterator)
            except StopIteration:
                return _END_OF_LOADER
            size, fields = extract_inputs(batch, inputs)
            return batch, size, fields

        seq = 0
        while True:
            await self._slots.acquire()
            if epoch != self.epoch:
                return
            try:
                item = await self._loader.submit(loop, next_batch)
            except Exception as e:  # the user's loader raised, or a batch could not be split
                self._finish_with_error(epoch, seq, e)
                return
            if epoch != self.epoch:
                return
            if item is _END_OF_LOADER:
                self._end_seq = seq
                self._flush()
                return
            batch, size, fields = cast(tuple[Any, int, dict[str, FieldArray]], item)
            job = Job(epoch, seq, batch, size, fields,
                      tuple((n, f.datatype, f.sample_shape) for n, f in fields.items()))
            seq += 1
            for svc in self._services.values():
                job.remaining[svc.name] = size
                svc.push(Chunk(job, svc.name, 0, size))

    def _finish_with_error(self, epoch: int, seq: int, error: BaseException) -> None:
        if epoch != self.epoch:
            return
        self._ready[seq] = Job(epoch, seq, error=error)
        self._end_seq = seq + 1
        self._flush()

    # ---- dispatch -----------------------------------------------------------------------------
    async def _dispatch(self, svc: _Service) -> None:
        while True:
            chunk = await svc.pop()
            if chunk.done or chunk.job.epoch != self.epoch or chunk.job.outputs.get(svc.name, {}) is None:
                continue
            teacher = await self._acquire(svc, chunk)
            if teacher is None:
                self._no_teacher(svc, chunk)
                continue
            assert teacher.meta is not None
            limit = teacher.meta.max_batch_size
            if self.opts.teacher_batch_size:
                limit = min(limit, self.opts.teacher_batch_size)
            if chunk.size > limit:
                rest = Chunk(chunk.job, svc.name, chunk.start + limit, chunk.stop)
                chunk.stop = chunk.start + limit
                svc.push(rest, front=True)
            self._send(svc, chunk, teacher)

    async def _acquire(self, svc: _Service, chunk: Chunk) -> Teacher | None:
        """A teacher with a free slot that accepts this chunk's inputs; None after no_teacher_timeout."""
        router = svc.router
        while True:
            t = router.pick(frozenset(chunk.tried) if chunk.sends else frozenset())
            if t is not None:
                if router.check_signature(t, chunk.job.signature):
                    return t
                continue
            waited = router.no_teacher_for()
            if waited >= self.opts.no_teacher_timeout:
                return None
            await router.wait_change(None if waited == 0 else self.opts.no_teacher_timeout - waited + 0.01)

    def _no_teacher(self, svc: _Service, chunk: Chunk) -> None:
        if self.opts.fallback != "hard_labels":
            self._fatal(self._no_teacher_error(svc))
            return
        job = chunk.job
        if job.outputs.get(svc.name, {}) is not None:
            self.fallback_batches += 1
            log.warning("no teacher for service %r: batch %d goes on with hard labels", svc.name, job.seq)
        job.outputs[svc.name] = None
        job.remaining[svc.name] = 0
        self._maybe_complete(job)

    def _send(self, svc: _Service, chunk: Chunk, t: Teacher) -> None:
        task = self._spawn(self._call(svc, chunk, t), "chunk")
        chunk.sends.add(task)
        chunk.tried.add(t.key)
        task.add_done_callback(chunk.sends.discard)
        delay = self._hedge_delay(svc)
        if delay is not None and len(chunk.tried) == 1:
            asyncio.get_running_loop().call_later(delay, self._hedge, svc, chunk)

    def _hedge_delay(self, svc: _Service) -> float | None:
        """When a chunk counts as late. Adaptive: 4x the pool's median latency, at least 0.25 s and at
        most half the deadline, so healthy variance never hedges but a hung teacher costs < 1 s."""
        if self.opts.hedge_after is not None or not self.opts.adaptive_hedge:
            return self.opts.hedge_after
        known = sorted(t.ewma_s for t in svc.router.teachers.values() if t.ewma_s > 0)
        typical = known[len(known) // 2] if known else 0.25
        return min(max(0.25, 4 * typical), self.opts.timeout / 2)

    def _hedge(self, svc: _Service, chunk: Chunk) -> None:
        """The chunk is late: if another teacher has a free slot, race it there."""
        if chunk.done or chunk.job.epoch != self.epoch or not chunk.sends:
            return
        t = svc.router.pick(frozenset(chunk.tried))
        if t is None or not svc.router.check_signature(t, chunk.job.signature):
            return
        assert t.meta is not None
        if chunk.size > t.meta.max_batch_size:
            return
        self.hedges += 1
        self._send(svc, chunk, t)

    def _encode(self, chunk: Chunk, t: Teacher) -> bytes:
        assert t.meta is not None
        job = chunk.job
        header = service_pb2.ModelInferRequest(model_name=t.meta.model_name, model_version=self.opts.model_version,
                                               id=f"{job.epoch}:{job.seq}:{chunk.start}")
        raws = []
        for name, f in job.fields.items():
            header.inputs.add(name=name, datatype=f.datatype, shape=[chunk.size, *f.sample_shape])
            raws.append(f.array[chunk.start:chunk.stop])
        for name in self.opts.outputs or t.meta.outputs:
            header.outputs.add(name=name)
        # Always stated, 0 included: a teacher started with a --top-k default must still send this
        # reader the full tensors it expects.
        header.parameters["top_k"].int64_param = self.opts.top_k
        if self.opts.output_dtype:
            header.parameters["output_dtype"].string_param = self.opts.output_dtype
        return serialize_infer_request(header, raws)

    async def _call(self, svc: _Service, chunk: Chunk, t: Teacher) -> None:
        router = svc.router
        router.started(t)
        started = time.perf_counter()
        try:
            wire = self._encode(chunk, t)
            response = await t.client.infer(wire, self.opts.timeout)
            outputs = self._decode(response, chunk, t)
        except asyncio.CancelledError:
            if chunk.done and chunk.winner != t.key:
                router.outpaced(t)
                self._probe_if_ejected(svc, t)
            else:
                router.cancelled(t)
            raise
        except grpc.aio.AioRpcError as e:
            router.failed(t, e.code(), e.details() or "")
            self._probe_if_ejected(svc, t)
            self._retry(svc, chunk)
            return
        except grpc.aio.UsageError:  # the teacher left and its channel closed under this call
            router.failed(t, grpc.StatusCode.UNAVAILABLE, "channel closed: the teacher left")
            self._retry(svc, chunk)
            return
        except (ValueError, grpc.RpcError) as e:
            router.failed(t, grpc.StatusCode.INTERNAL, str(e))
            router.mark_incompatible(t, f"its answer did not fit the request: {e}")
            self._retry(svc, chunk)
            return
        router.succeeded(t, time.perf_counter() - started, chunk.size)
        if chunk.done:
            return
        chunk.done = True
        chunk.winner = t.key
        for other in list(chunk.sends):
            if other is not asyncio.current_task():
                other.cancel()
        self._fill(chunk, outputs)

    def _probe_if_ejected(self, svc: _Service, t: Teacher) -> None:
        if t.needs_probe and not t.probing and not t.removed:
            t.probing = True
            self._spawn(self._probe(svc, t), f"probe-{t.endpoint}", critical=False)

    async def _probe(self, svc: _Service, t: Teacher) -> None:
        """Readmit an ejected teacher only once a ModelReady answers within the probe deadline."""
        try:
            while t.needs_probe and not t.removed and t.meta is not None:
                delay = t.ejected_until - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if t.removed:
                    return  # it left the registry meanwhile; its channel may already be closed
                try:
                    ok = await t.client.ready(t.meta.model_name, timeout=svc.router.config.probe_timeout_s)
                    detail = "" if ok else "ModelReady answered not ready"
                except grpc.aio.AioRpcError as e:
                    ok, detail = False, f"probe: {e.code().name}: {e.details()}"
                except grpc.aio.UsageError:
                    return  # the channel was closed because the teacher left
                svc.router.probed(t, ok, detail)
        finally:
            t.probing = False

    def _retry(self, svc: _Service, chunk: Chunk) -> None:
        others = [s for s in chunk.sends if s is not asyncio.current_task() and not s.done()]
        if chunk.done or chunk.job.epoch != self.epoch or others:
            return
        self.retries += 1
        chunk.tried.clear()
        svc.push(chunk, front=True)

    def _decode(self, resp: service_pb2.ModelInferResponse, chunk: Chunk, t: Teacher) -> dict[str, torch.Tensor]:
        assert t.meta is not None
        if len(resp.raw_output_contents) != len(resp.outputs):
            raise ValueError(f"{len(resp.outputs)} outputs but {len(resp.raw_output_contents)} raw buffers")
        out: dict[str, torch.Tensor] = {}
        for spec, raw in zip(resp.outputs, resp.raw_output_contents, strict=True):
            dt = DATATYPES.get(spec.datatype)
            shape = list(spec.shape)
            if dt is None:
                raise ValueError(f"output {spec.name!r} has unsupported datatype {spec.datatype!r}")
            if not shape or shape[0] != chunk.size:
                raise ValueError(f"output {spec.name!r} has shape {shape} for a chunk of {chunk.size}")
            if len(raw) != shape_numel(shape) * dt.itemsize:
                raise ValueError(f"output {spec.name!r}: {len(raw)} bytes for shape {shape} of {spec.datatype}")
            out[spec.name] = decode_tensor(raw, dt, shape)
        wanted = list(self.opts.outputs or t.meta.outputs)
        if self.opts.top_k:
            wanted = [f"{n}_TOPK_{part}" for n in wanted for part in ("VALUES", "INDICES")]
        missing = [n for n in wanted if n not in out]
        if missing:
            raise ValueError(f"the answer lacks outputs {missing} (got {sorted(out)})")
        return {n: out[n] for n in wanted}

    def _fill(self, chunk: Chunk, outputs: dict[str, torch.Tensor]) -> None:
        job = chunk.job
        if job.epoch != self.epoch or job.delivered:
            return
        dest = job.outputs.setdefault(chunk.service, {})
        if dest is None:  # this service already fell back to hard labels for the batch
            return
        for name, value in outputs.items():
            buf = dest.get(name)
            if buf is None:
                buf = torch.empty((job.size, *value.shape[1:]), dtype=value.dtype, pin_memory=self.opts.pin_memory)
                dest[name] = buf
            buf[chunk.start:chunk.stop].copy_(value)
        job.remaining[chunk.service] -= chunk.size
        self._maybe_complete(job)

    # ---- delivery ---------------------------------------------------------------------------
    def _maybe_complete(self, job: Job) -> None:
        if job.delivered or any(job.remaining.values()):
            return
        job.fields = {}  # the inputs are no longer needed; free them before the loop takes the batch
        if self.opts.ordered:
            self._ready[job.seq] = job
            self._flush()
        else:
            self._deliver(job)
            self._next_seq += 1
            self._flush()

    def _flush(self) -> None:
        if self.opts.ordered:
            while self._next_seq in self._ready:
                job = self._ready.pop(self._next_seq)
                self._next_seq += 1
                if job.error is not None:
                    self._out.put((job.epoch, ERROR, job.error))
                    return
                self._deliver(job)
        if self._end_seq is not None and self._next_seq >= self._end_seq:
            self._out.put((self.epoch, END, None))
            self._end_seq = None

    def _deliver(self, job: Job) -> None:
        job.delivered = True
        if len(self._services) == 1:
            outputs: Any = next(iter(job.outputs.values()))
        else:
            outputs = dict(job.outputs)
        self._out.put((job.epoch, BATCH, (job.batch, outputs, job.size)))

    def _fatal(self, error: BaseException) -> None:
        self._out.put((self.epoch, ERROR, error))
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        for svc in self._services.values():
            svc.queue.clear()

    # ---- stats, demand, close -----------------------------------------------------------------
    def _demand_fn(self, svc: _Service) -> Callable[[], registry_pb2.StudentDemand]:
        def demand() -> registry_pb2.StudentDemand:
            rate, wait = self._meter.figures()
            now = time.monotonic()
            return registry_pb2.StudentDemand(
                student_id=self.opts.student_id, samples_per_s=rate, wait_fraction=wait,
                in_flight=sum(t.in_flight for t in svc.router.teachers.values()),
                teachers_in_use=sum(1 for t in svc.router.teachers.values() if t.usable(now)),
                updated_at=time.time(),
            )

        return demand

    def stats(self) -> ReaderStats:
        rate, wait = self._meter.figures()
        now = time.monotonic()
        teachers = [t for svc in self._services.values() for t in svc.router.teachers.values()]
        return ReaderStats(
            batches=self._meter.batches, samples=self._meter.samples, samples_per_s=rate, wait_fraction=wait,
            in_flight=sum(t.in_flight for t in teachers), teachers_in_use=sum(1 for t in teachers if t.usable(now)),
            fallback_batches=self.fallback_batches, retries=self.retries, hedges=self.hedges,
            teachers={s: dict(svc.router.snapshot()) for s, svc in self._services.items()},
        )

    def _spawn(self, coro: Any, name: str, critical: bool = True) -> asyncio.Task[Any]:
        """An owned task, cancelled on close. A critical task's failure (data path: reading, dispatch,
        a chunk) ends the epoch with the error; an auxiliary one's (probe, metadata, closing a
        departed teacher's channel) is logged, since the teacher it served is at worst unusable."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done if critical else self._aux_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("reader task %s failed", task.get_name(), exc_info=error)
            self._fatal(error)

    def _aux_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("reader task %s failed: %r", task.get_name(), error)

    async def close(self) -> None:
        """Cancel everything, withdraw demand, close channels and registries."""
        tasks = list(self._tasks)
        for task in tasks:
            task.remove_done_callback(self._task_done)
            task.remove_done_callback(self._aux_done)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for cm in reversed(self._closing):
            with contextlib.suppress(Exception):
                await cm.__aexit__(None, None, None)
        for svc in self._services.values():
            for t in list(svc.router.teachers.values()):
                with contextlib.suppress(Exception):
                    await t.client.close()
        for reg in self._registries:
            with contextlib.suppress(Exception):
                await reg.close()
        self._loader.close()


def iterate_queue(out: queue.Queue[tuple[int, str, Any]], epoch: int, alive: Callable[[], bool],
                  poll_s: float = 0.5) -> Iterator[tuple[str, Any]]:
    """Items of `epoch` from the engine's queue; stale epochs are skipped. Raises if the engine died."""
    while True:
        try:
            item_epoch, kind, payload = out.get(timeout=poll_s)
        except queue.Empty:
            if not alive():
                raise RuntimeError("the reader's engine thread stopped unexpectedly") from None
            continue
        if item_epoch != epoch:
            continue
        yield kind, payload


def as_device(outputs: Any, device: torch.device | None) -> Any:
    """Teacher outputs on the student's device (non-blocking from pinned memory on CUDA)."""
    if device is None or outputs is None:
        return outputs
    if isinstance(outputs, torch.Tensor):
        return outputs.to(device, non_blocking=True)
    return {k: as_device(v, device) for k, v in outputs.items()}

