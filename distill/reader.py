"""DistillReader: the training loop's view of the mesh.

    with DistillReader(loader, teachers="127.0.0.1:9898", inputs=["INPUT"], outputs=["LOGITS"]) as reader:
        for batch, teacher in reader:          # teacher: {"LOGITS": tensor}
            ...

It is a plain iterator: the asyncio engine runs on its own thread (uvloop when available), reads
ahead up to `prefetch` batches, and has their teacher outputs ready by the time the loop asks.
Each `iter(reader)` is one pass over `loader` (an epoch). Every batch the loader yields comes out
exactly once, with its teacher outputs, in loader order unless `ordered=False`.

A batch the teachers refuse (inputs that do not fit their metadata, or a model that raises on it)
raises `BatchRejectedError` from `next()` in its place; the iterator stays usable and the next
`next()` yields the following batch. One reader feeds one training loop: a second `iter()` while
another thread is inside `next()` raises `ReaderInUseError`, and an iterator replaced by a newer
`iter()` raises `StaleIteratorError` instead of waiting for batches that will never come.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distill.batches import normalize_inputs
from distill.engine import Engine
from distill.errors import BatchRejectedError, ReaderClosedError, ReaderInUseError, StaleIteratorError
from distill.flags import (
    OUTPUT_DTYPES,
    checked,
    distill_options_from_args,
    fallback_choice,
    headers_map,
    maybe_bool,
    non_negative_int,
    positive_float,
    positive_int,
)
from distill.router import RouterConfig
from distill.stats import ConsumptionMeter, ReaderStats
from distill.teacher_client import ClientTLS

log = logging.getLogger("distill.reader")

_FLOAT_DTYPES = OUTPUT_DTYPES
CACHE_MODES = ("read", "write", "read_write")


def default_student_id() -> str:
    """host-pid, plus the torchrun rank when there is one: unique per training process."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    base = f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-rank{rank}" if rank is not None else base


@dataclass(frozen=True)
class ReaderOptions:
    """Everything a reader is told, validated once here; the engine takes it as is.

    Built by ``DistillReader(loader, **kwargs)`` (the keywords are these fields) and by
    ``ReaderOptions.from_args(args, ...)`` / ``DistillReader.from_args`` from ``add_distill_args``
    flags. Fields given as user-friendly forms are normalised in place (``inputs`` to a mapping,
    ``outputs`` to a tuple, ``device`` to a ``torch.device``, ``output_dtype`` to upper case, a
    missing ``student_id`` to host-pid[-rankN]).

    Args:
        inputs: teacher input names taken from batch fields of the same name, or a mapping
            {teacher_input: batch_key_or_position}.
        outputs: teacher outputs to fetch (default: all the teacher has).
        teachers: fixed teachers, "host:port,host:port"; or {service: "host:port,..."} for several.
        registry: "etcd://host:2379[,host:2379]" to find teachers under `service` as they come and go.
        service: the service name(s) in the registry; several give a mixture of teachers, and the
            outputs come per service: {service: {name: tensor}}.
        model: model name on the teachers (default: what each teacher registered / serves). Needed
            with a Triton that restricts its model-repository API (PyTriton does by default).
        timeout: deadline per chunk, seconds; a chunk that misses it goes to another teacher.
        no_teacher_timeout: seconds without any usable teacher before NoTeacherError (or fallback).
        fallback: "error" (default) or "hard_labels": yield None outputs while there is no teacher, and
            for a batch the teachers refuse (instead of raising BatchRejectedError for it).
        max_teachers: use at most this many teachers (a stable per-student subset); 0 for all.
        prefetch: batches read ahead of the training loop.
        teacher_batch_size: largest chunk to send (default: each teacher's max_batch_size).
        hedge_after: seconds after which a late chunk is raced on a second teacher; "auto" (default):
            4x the pool's median latency, at least 0.25 s; None: never hedge.
        ordered: deliver in loader order (default) or as soon as each batch is ready.
        device: put teacher outputs on this device (via pinned memory on CUDA).
        top_k: ask teachers for top-k outputs (<OUT>_TOPK_VALUES / _TOPK_INDICES) instead of full tensors.
        output_dtype: ask for FP16 / BF16 outputs to halve the bytes on the wire.
        logprobs: ask for log_softmax(x / temperature) of floating outputs instead of raw values (True), or
            raw values (False); None (default): the teacher server's default. Every setting that changes
            the numbers is stated per request, so a server's defaults never leak into a student that set it.
        temperature: ask teachers to divide floating outputs by this before log-softmax and top-k, on the
            full last dimension (the only place a temperature is exact under top-k); None: the server's.
        topk_tail: with `top_k`, also fetch <OUT>_TOPK_TAIL, the probability mass outside the top-k per
            position (True), or never (False); None: the server's default, and the tail is not returned.
        student_id: identity in the registry (default: host-pid[-rankN]).
        registry_options: passed to the etcd client (TLS files, user, password).
        tls_ca, tls_cert, tls_key: TLS towards the teachers: the CA that signed their certificates,
            and this student's certificate and key when they require mutual TLS.
        tls_server_name: the name to verify in the teachers' certificates, when it differs from the
            endpoint's host.
        router: the router's tuning (limits, backoff, probe deadline).
        headers: gRPC headers sent on every call to every teacher, e.g. the access token of a Triton
            that restricts its API: {"triton-grpc-protocol-<key>": token}. Names are lower-cased;
            values are never logged or shown in the options' repr.
        cache: a teacher-output store's directory (`distill.cache`, docs/cache.md): samples it holds
            are not asked of a teacher, and what teachers answer is written to it off the training thread.
        cache_mode: "read_write" (default): read the store, ask teachers for the missing samples only
            and store their answers; "read": only read it (with no teachers at all it trains offline, and a
            missing sample raises CacheMissError naming its key, or with fallback="hard_labels" yields None
            outputs); "write": ask teachers for every sample and store their answers.
        key: the batch field (a dict key, or a tuple position) holding each sample's key in the store:
            a dataset index or a content hash. Required with `cache`.
    """

    inputs: Any  # an InputSpec (distill.batches); a {teacher input: batch field} dict after validation
    outputs: Sequence[str] | None = None
    teachers: str | Mapping[str, str] | None = None
    registry: str | None = None
    service: str | Sequence[str] | None = None
    model: str | None = None
    model_version: str = ""
    timeout: float = 10.0
    no_teacher_timeout: float = 60.0
    fallback: str = "error"
    max_teachers: int = 0
    prefetch: int = 4
    teacher_batch_size: int = 0
    hedge_after: float | str | None = "auto"
    ordered: bool = True
    device: str | torch.device | None = None
    top_k: int = 0
    output_dtype: str | None = None
    logprobs: bool | None = None
    temperature: float | None = None
    topk_tail: bool | None = None
    student_id: str = ""  # "": host-pid[-rankN]
    registry_options: Mapping[str, Any] = field(default_factory=dict)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # values are credentials
    cache: str | os.PathLike[str] | None = None
    cache_mode: str = "read_write"
    key: str | int | None = None
    # Derived in __post_init__:
    services: tuple[str, ...] = field(init=False)
    static: Mapping[str, str] | None = field(init=False)  # service -> "host:port,..." for fixed lists
    client_tls: ClientTLS | None = field(init=False)

    def __post_init__(self) -> None:
        teachers, service = self.teachers, self.service
        offline = teachers is None and self.registry is None and self.cache is not None and self.cache_mode == "read"
        if (teachers is None) == (self.registry is None) and not offline:
            raise ValueError("pass exactly one of teachers='host:port,...' and registry='etcd://host:2379' (or, to "
                             "train from a teacher-output store alone, cache=PATH with cache_mode='read')")
        self._check_cache()
        static: dict[str, str] | None
        if offline:
            static = {}
        elif isinstance(teachers, str):
            static = {service if isinstance(service, str) else "teachers": teachers}
        else:
            static = dict(teachers) if teachers is not None else None
        services: tuple[str, ...]
        if offline:
            services = ()
        elif static is not None:
            services = tuple(static)
        elif isinstance(service, str):
            services = (service,)
        elif service:
            services = tuple(service)
        else:
            raise ValueError("registry= needs service='NAME' (the name teachers registered under)")
        # The same rules, and messages, as the --distill_* flags (distill.flags).
        checked(fallback_choice, "fallback", self.fallback)
        timeout = checked(positive_float, "timeout", self.timeout)
        numbers: dict[str, Any] = {
            "timeout": timeout,
            "no_teacher_timeout": checked(positive_float, "no_teacher_timeout", self.no_teacher_timeout),
            "prefetch": checked(positive_int, "prefetch", self.prefetch),
            **{name: checked(non_negative_int, name, getattr(self, name))
               for name in ("max_teachers", "teacher_batch_size", "top_k")},
        }
        hedge = self.hedge_after
        if isinstance(hedge, str):
            if hedge != "auto":
                raise ValueError(f"hedge_after must be seconds, 'auto' or None, got {hedge!r}")
        elif hedge is not None and not 0 < hedge < timeout:
            raise ValueError(f"hedge_after must be between 0 and timeout ({timeout:g} s), got {hedge}")
        dtype = self.output_dtype
        if dtype is not None and dtype.upper() not in _FLOAT_DTYPES:
            raise ValueError(f"output_dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
        checked(maybe_bool, "logprobs", self.logprobs)
        checked(maybe_bool, "topk_tail", self.topk_tail)
        if self.topk_tail and not numbers["top_k"]:
            raise ValueError("topk_tail=True is the probability mass outside the top-k: ask for top_k=K too")
        temperature = None if self.temperature is None else checked(positive_float, "temperature", self.temperature)
        logprobs, topk_tail = self.logprobs, self.topk_tail
        if self.cache is not None:
            # A store's namespace must name the values it holds: state every value transform, so a
            # teacher's own defaults (teacher-server --logprobs/--temperature/--topk-tail) never
            # decide what lands in it unnamed.
            logprobs = bool(logprobs)
            temperature = 1.0 if temperature is None else temperature
            if numbers["top_k"]:
                topk_tail = bool(topk_tail)
        tls = (ClientTLS(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
               if any((self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)) else None)
        normalised: dict[str, Any] = {
            **numbers,
            "inputs": normalize_inputs(self.inputs),
            "outputs": tuple(self.outputs) if self.outputs else None,
            "device": torch.device(self.device) if self.device is not None else None,
            "output_dtype": dtype.upper() if dtype else None,
            "temperature": temperature, "logprobs": logprobs, "topk_tail": topk_tail,
            "student_id": self.student_id or default_student_id(),
            "registry_options": dict(self.registry_options or {}),
            "router": self.router or RouterConfig(),
            "headers": checked(headers_map, "headers", self.headers),
            "services": services, "static": static or None, "client_tls": tls,
            "cache": os.fspath(self.cache) if self.cache is not None else None,
        }
        if self.cache is not None and len(services) > 1:
            raise ValueError(f"cache= serves one teacher service; this reader has {len(services)} ({services}): "
                             "give each service's reader its own cache, or drop cache=")
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def _check_cache(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        if self.cache is None:
            return
        if self.key is None:
            raise ValueError("cache= needs key=: the batch field holding each sample's key (a dataset index or a "
                             "content hash), e.g. key='index'")
        if not isinstance(self.key, (str, int)):
            raise TypeError(f"key must be a batch field name or a tuple position, got {self.key!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kwargs: Any) -> ReaderOptions:
        """From `add_distill_args` flags; keyword arguments (inputs, outputs, ...) are added or override."""
        return cls(**{**distill_options_from_args(args), **kwargs})

    @property
    def hedge_s(self) -> float | None:
        """The fixed hedge delay in seconds; None when adaptive or off."""
        return None if isinstance(self.hedge_after, str) else self.hedge_after

    @property
    def adaptive_hedge(self) -> bool:
        return self.hedge_after == "auto"

    @property
    def torch_device(self) -> torch.device | None:
        """`device` as a torch.device (None: outputs stay on the CPU)."""
        return torch.device(self.device) if self.device is not None else None

    @property
    def pin_memory(self) -> bool:
        """Outputs land in pinned memory when they go on to a CUDA device."""
        device = self.torch_device
        return device is not None and device.type == "cuda"


# The queue between the engine thread and the training loop carries (epoch, kind, payload).
# ERROR ends the pass; REJECTED is one batch's error, in that batch's place.
BATCH, END, ERROR, REJECTED = "batch", "end", "error", "rejected"


class Outbox:
    """The engine's sink (`distill.engine.Sink`) on the reader's side: a thread-safe queue that the
    training loop's thread reads with `items`."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[int, str, Any]] = queue.Queue()

    def batch(self, epoch: int, batch: Any, outputs: Any, size: int) -> None:
        self._queue.put((epoch, BATCH, (batch, outputs, size)))

    def end(self, epoch: int) -> None:
        self._queue.put((epoch, END, None))

    def error(self, epoch: int, error: BaseException) -> None:
        self._queue.put((epoch, ERROR, error))

    def rejected(self, epoch: int, error: BaseException) -> None:
        self._queue.put((epoch, REJECTED, error))

    def items(self, epoch: int, alive: Callable[[], bool], poll_s: float = 0.5) -> Iterator[tuple[str, Any]]:
        """Items of `epoch`; stale epochs are skipped. Raises if the engine died."""
        while True:
            try:
                item_epoch, kind, payload = self._queue.get(timeout=poll_s)
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


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class DistillReader:
    """Wraps a loader; yields (batch, teacher_outputs). See the module docstring.

    `DistillReader(loader, inputs=["INPUT"], teachers="host:port")`: the keywords are the fields of
    `ReaderOptions` (documented there), or pass a built `ReaderOptions` as `options=`.
    """

    def __init__(self, loader: Iterable[Any], options: ReaderOptions | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise TypeError("pass either options=ReaderOptions(...) or keyword arguments, not both")
        self._options = options if options is not None else ReaderOptions(**kwargs)
        self._loader = loader
        self._meter = ConsumptionMeter()
        self._out = Outbox()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._closed = False
        self._epoch = 0  # the newest pass; only its iterator yields
        self._in_next = threading.Lock()  # held while a thread is inside next() or starting a pass

    @classmethod
    def from_args(cls, args: argparse.Namespace, loader: Iterable[Any], **kwargs: Any) -> DistillReader:
        """Build from `add_distill_args` flags; keyword arguments (inputs, outputs, ...) are added."""
        return cls(loader, ReaderOptions.from_args(args, **kwargs))

    @property
    def student_id(self) -> str:
        return self._options.student_id

    @property
    def options(self) -> ReaderOptions:
        return self._options

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> DistillReader:
        """Connect, find teachers and check them; raises NoTeacherError / TeacherMismatchError here."""
        if self._closed:
            raise ReaderClosedError("this reader is closed; make a new one")
        if self._engine is not None:
            return self
        loop = _new_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="distill-reader", daemon=True)
        self._thread.start()

        async def boot() -> Engine:
            engine = Engine(self._options, self._out, self._meter)
            try:
                await engine.start()
            except BaseException:
                await engine.close()
                raise
            return engine

        try:
            self._engine = asyncio.run_coroutine_threadsafe(boot(), loop).result()
        except BaseException:
            self._stop_loop()
            raise
        return self

    def close(self) -> None:
        """Cancel all work, close channels and registry sessions, and join the engine thread."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._engine.close(), self._loop).result(30)
            except Exception:
                log.exception("closing the reader's engine failed")
        # Engine.close() closed every channel and broke the engine's reference cycles (CallWatch's call
        # map, the pools' and the watch's hold on the engine, the finished epoch task), so nothing gRPC
        # waits for a garbage collection, perhaps at interpreter exit (tests/test_reader_release.py). An
        # iterator the user still holds keeps the engine object, but no channel, client or thread.
        self._engine = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> DistillReader:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_engine", None) is not None:
            self.close()

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """A new pass over the loader. Raises ReaderInUseError while another thread is inside next()."""
        self.start()
        assert self._loop is not None and self._engine is not None
        engine, loop = self._engine, self._loop
        if not self._in_next.acquire(blocking=False):
            raise _in_use()
        try:
            epoch = asyncio.run_coroutine_threadsafe(_call(engine.begin_epoch, self._loader), loop).result(30)
            self._epoch = epoch
        finally:
            self._in_next.release()
        return _Pass(self, engine, loop, epoch)

    def _next(self, p: _Pass) -> tuple[Any, Any]:
        """One item of pass `p` (see _Pass); called with `_in_next` held."""
        if self._closed:
            raise ReaderClosedError("the reader was closed during iteration")
        if p.epoch != self._epoch:
            raise StaleIteratorError(
                f"this iterator's pass was replaced by a newer iter(reader) (pass {self._epoch}); iterate the "
                "newest iterator, or give each consumer its own DistillReader")
        started = time.perf_counter()
        kind, payload = next(p.items)
        waited = time.perf_counter() - started
        if kind == END:
            raise StopIteration
        if kind == ERROR:
            raise payload
        p.loop.call_soon_threadsafe(p.engine.consumed, p.epoch)
        if kind == REJECTED:
            raise payload
        assert kind == BATCH
        batch, outputs, size = payload
        self._meter.record(size, waited)
        return batch, as_device(outputs, self._options.torch_device)

    def stats(self) -> ReaderStats:
        """Throughput, wait fraction, and per-teacher latency/errors (see ReaderStats)."""
        if self._engine is None or self._loop is None:
            rate, wait = self._meter.figures()
            return ReaderStats(self._meter.batches, self._meter.samples, rate, wait, 0, 0, 0, 0, 0)
        stats: ReaderStats = asyncio.run_coroutine_threadsafe(_call(self._engine.stats), self._loop).result(10)
        return stats


class _Pass(Iterator[tuple[Any, Any]]):
    """The iterator of one pass: yields (batch, teacher outputs). After StopIteration or an error that
    ended the pass it stays exhausted; after a BatchRejectedError it goes on with the next batch."""

    def __init__(self, reader: DistillReader, engine: Engine, loop: asyncio.AbstractEventLoop, epoch: int) -> None:
        self.reader, self.engine, self.loop, self.epoch = reader, engine, loop, epoch
        thread = reader._thread
        self.items = reader._out.items(
            epoch, lambda: thread is not None and thread.is_alive() and not reader._closed)
        self._over = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._over:
            raise StopIteration
        lock = self.reader._in_next
        if not lock.acquire(blocking=False):
            raise _in_use()
        try:
            return self.reader._next(self)
        except (StopIteration, ReaderInUseError, StaleIteratorError):
            raise
        except BatchRejectedError:
            raise  # one batch lost; the pass goes on
        except BaseException:
            self._over = True
            raise
        finally:
            lock.release()


def _in_use() -> ReaderInUseError:
    return ReaderInUseError(
        "another thread is iterating this DistillReader right now; one reader feeds one training loop: give "
        "each thread its own reader")


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
