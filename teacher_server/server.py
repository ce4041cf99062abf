"""TeacherServer: one model behind the KServe v2 gRPC protocol, from load to drain.

Lifecycle, in the order a student can observe it:
  start()   the port answers at once; health is NOT_SERVING and ModelInfer UNAVAILABLE while the
            model loads and warms up (off the event loop), then SERVING.
  drain()   health NOT_SERVING, new requests UNAVAILABLE (students re-route at once), requests
            already accepted finish, bounded by a grace period.
  stop()    drain, then close the batcher (whatever outlived the grace is answered UNAVAILABLE),
            gRPC, the instance threads and the metrics endpoint.
Requests themselves belong to the `RequestLifecycle` (`self.requests`), which the gRPC front end
(and any later one) calls; the server only moves it from loading to serving to draining.
The registry hook (discovery) sits between: registered once ready, deregistered before the drain
waits, so a student learns of the stop from two sides.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import replace

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from protos import registry_pb2
from teacher_server import fingerprint, token_budget
from teacher_server.batcher import DynamicBatcher
from teacher_server.capabilities import declared_capabilities
from teacher_server.config import ServerConfig
from teacher_server.device_memory import device_memory_source
from teacher_server.finishing import BusyClock
from teacher_server.grpc_service import InferenceService, add_inference_service
from teacher_server.http_service import HTTPFrontEnd, server_ssl_context
from teacher_server.instance import ModelInstance
from teacher_server.lifecycle import RequestLifecycle, ServedModel, ServingState
from teacher_server.metrics import LoadMeter, MetricsHTTPServer, ServerMetrics
from teacher_server.model import LoadedModel, _probe, load_model, resolve_device
from teacher_server.spec import ModelIO, SpecError
from teacher_server.text_requests import text_scoreable, text_tensors

log = logging.getLogger(__name__)
MiB = 1 << 20
# Calls gRPC may hold before the handler takes them (its default soft limit of 1,000 cancels the
# excess). Each costs its request bytes; the lifecycle refuses beyond the batcher's queue at once.
MAX_PENDING_CALLS = 100_000


class TeacherServer:
    """Serves one model; use `async with TeacherServer(cfg) as srv:` or start()/stop().

    The server owns the process-level pieces (gRPC transport, the optional KServe v2 HTTP/REST
    site, health, model load, batcher, instances, metrics endpoint) and drives a
    `RequestLifecycle`, which every front end shares and which owns each request from admission
    to answer.
    """

    def __init__(self, config: ServerConfig, model: LoadedModel | None = None) -> None:
        """`model`: None loads `config.model` in start(); a LoadedModel is served as it is, after
        the same warm-up forward in start() (a model that fails it raises ModelLoadError there and
        is never served). `teacher_server.prepare()` builds both from one set of options."""
        self.config = config
        self._model = model
        self.device = model.device if model is not None else resolve_device(config.device)
        self.metrics = ServerMetrics(config.name, config.version)
        self.requests = RequestLifecycle(
            ServedModel(config.name, config.version, self.device, config.instances, config.batching,
                        config.output_defaults(), config.model, max_answer_bytes=config.max_message_mb * MiB),
            self.metrics,
        )
        self.metrics.watch_in_flight(lambda: self.requests.in_flight)
        self.metrics.watch_device_memory(device_memory_source(self.device))
        self.instance_id = config.instance_id or f"{config.name}-{uuid.uuid4().hex[:12]}"
        self.started_at = time.time()
        self._grpc: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._batcher: DynamicBatcher | None = None
        self._load = LoadMeter(config.instances)
        self._metrics_http: MetricsHTTPServer | None = None
        self._http: HTTPFrontEnd | None = None
        self._port = 0
        self.abandoned_batches = 0  # forward passes still running when the server stopped
        self.grpc_service: InferenceService | None = None  # the gRPC front end, once started

    # ---- properties students and the registry read -----------------------------------------
    @property
    def model_name(self) -> str:
        return self.config.name

    @property
    def model_version(self) -> str:
        return self.config.version

    @property
    def io(self) -> ModelIO:
        """The served tensors; UnavailableError while the model loads."""
        return self.requests.io

    @property
    def batcher(self) -> DynamicBatcher:
        assert self._batcher is not None
        return self._batcher

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        return self.config.advertise or f"{self.config.host}:{self._port}"

    @property
    def http_port(self) -> int | None:
        """The bound KServe v2 HTTP/REST port; None when --http-port is off."""
        return self._http.port if self._http else None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_http.port if self._metrics_http else None

    @property
    def accepting(self) -> bool:
        return self.requests.accepting

    @property
    def draining(self) -> bool:
        return self.requests.state is ServingState.DRAINING

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        check_tls_files(cfg)
        _check_port_free("--port", cfg.host, cfg.port)
        max_bytes = cfg.max_message_mb * MiB
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.max_send_message_length", max_bytes),
                ("grpc.so_reuseport", 0),
                # Students ping idle channels to notice a dead teacher fast; allow it.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                ("grpc.http2.max_ping_strikes", 0),
                # gRPC's own pending-call limits would answer a burst CANCELLED before our handler
                # sees it, uncounted; let every call reach the lifecycle, whose bounded queue
                # refuses overload with RESOURCE_EXHAUSTED and counts it (REJECTED).
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                ("grpc.server_max_unrequested_time_in_server", 3600),
            ]
        )
        self.grpc_service = InferenceService(self.requests)
        add_inference_service(self.grpc_service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        credentials = cfg.server_credentials()
        address = f"{cfg.host}:{cfg.port}"
        try:
            if credentials is None:
                self._port = self._grpc.add_insecure_port(address)
            else:
                self._port = self._grpc.add_secure_port(address, credentials)
        except RuntimeError:
            self._port = 0
        if self._port == 0:
            self._grpc = None
            raise OSError(f"--port {cfg.port}: cannot bind {cfg.host}:{cfg.port}; is another process using it? "
                          "(--port 0 picks a free one)")
        await self._grpc.start()
        try:
            if cfg.http_port is not None:
                ssl_context = (None if cfg.tls_cert is None or cfg.tls_key is None
                               else server_ssl_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
                http = HTTPFrontEnd(self.requests, max_bytes, ssl_context, limits=cfg)
                await http.start(cfg.host, cfg.http_port)
                self._http = http
            if cfg.metrics_port is not None:
                self._metrics_http = _metrics_endpoint(self.metrics, cfg.host, cfg.metrics_port)
            if self._model is None:
                log.info("loading %s on %s", cfg.model, self.device)
                self._model = await asyncio.to_thread(
                    load_model, cfg.model, device=self.device, io=cfg.io, compute_dtype=cfg.compute_dtype,
                    model_args=cfg.model_args,
                )
            else:
                # A model handed in (teacher_server.start/serve, or TeacherServer(config, LoadedModel(...))
                # built by hand) gets the warm-up load_model gives a loaded one: one forward on zeros
                # shaped like its inputs, which also infers outputs it does not declare.
                log.info("warming up %s on %s", cfg.model, self.device)
                model = self._model
                model.io = await asyncio.to_thread(_probe, model)
            text = await self.requests.text.load() and text_scoreable(self._model.io)
            self.requests.model = replace(self.requests.model, fingerprint=await fingerprint.compute(self._model, cfg),
                                          text_prompts=text)
            chunk = cfg.output_chunk_mb << 20
            clock = BusyClock()  # the instances share the model's one device
            instances = [ModelInstance(self._model, i, cfg.batching.max_batch_size, chunk_bytes=chunk,
                                       device_clock=clock) for i in range(cfg.instances)]
            batching = token_budget.fit_to_memory(self._model, cfg.batching, cfg.instances, chunk)
            self._batcher = DynamicBatcher(instances, batching)
            self._batcher.on_batch(self._on_batch)
            self._batcher.on_tokens(self.metrics.record_tokens)
            batcher = self._batcher
            self.metrics.watch_pending(lambda: batcher.queue_depth)
            if self._model.io.padded:
                self.metrics.watch_batch_cost(batcher.cost_figures)
            self._batcher.start()
        except BaseException:
            await self._close_transport(0)
            raise
        self.requests.serve(self._model.io, self._batcher)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving %s (version %s) on %s%s, device %s, %d instance(s), max batch %d%s",
            cfg.name, cfg.version, self.endpoint,
            "" if cfg.tls_cert is None else " (mutual TLS)" if cfg.tls_client_ca else " (TLS)",
            self.device, cfg.instances, cfg.batching.max_batch_size,
            f", metrics on :{self.metrics_port}" if self._metrics_http else "",
        )
        if self._http is not None:
            log.info("KServe v2 HTTP/REST on %s:%d", cfg.host, self._http.port)

    def _on_batch(self, samples: int, requests: int, compute_ns: int) -> None:
        self.metrics.record_execution()
        self._load.record(samples, requests, compute_ns)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await self._health.set("", status)
        await self._health.set(self.config.name, status)
        await self._health.set("inference.GRPCInferenceService", status)

    async def begin_drain(self) -> None:
        """Stop taking new requests (health NOT_SERVING, ModelInfer UNAVAILABLE); return at once."""
        if self.draining:
            return
        self.requests.begin_drain()
        await self._health.enter_graceful_shutdown()
        log.info("draining: %d request(s) in flight", self.requests.in_flight)

    async def drain(self, grace_s: float | None = None) -> bool:
        """begin_drain(), then wait for accepted requests to finish; False if the grace ran out."""
        await self.begin_drain()
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        if await self.requests.wait_idle(grace):
            return True
        log.warning("drain grace of %.1fs ran out with %d request(s) in flight", grace, self.requests.in_flight)
        return False

    async def stop(self, grace_s: float | None = None) -> None:
        """drain(), then close. Requests still running when the grace ran out are answered
        UNAVAILABLE (students re-route them) before the transport closes; a forward pass that is
        still running is left behind (see `abandoned_batches`)."""
        if self._grpc is None:
            return
        await self.drain(grace_s)
        await self._close_transport(1.0)

    async def _close_transport(self, grace: float) -> None:
        # The batcher first: whatever it still holds fails with BatcherClosedError, which the
        # lifecycle answers as UNAVAILABLE while the transport is still open to carry the answer.
        if self._batcher is not None:
            self.abandoned_batches += await self._batcher.close()
            self._batcher = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._metrics_http is not None:
            self._metrics_http.close()
            self._metrics_http = None

    async def __aenter__(self) -> TeacherServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- what the registry publishes --------------------------------------------------------
    def record(self) -> registry_pb2.TeacherRecord:
        io = self.io
        rec = registry_pb2.TeacherRecord(
            instance_id=self.instance_id, endpoint=self.endpoint, model_name=self.config.name,
            model_version=self.config.version, max_batch_size=self.config.batching.max_batch_size,
            device=str(self.device), started_at=self.started_at, instances=self.config.instances,
            tls=self.config.tls_cert is not None, batches_by_length=self.config.batching.by_length(io.padded),
        )
        rec.fingerprint = self.requests.model.fingerprint
        for s in io.inputs:
            rec.inputs.add(name=s.name, datatype=s.datatype, shape=list(s.shape))
        for s in io.outputs:
            rec.outputs.add(name=s.name, datatype=s.datatype, shape=list(s.shape))
        text = self.requests.model.text_prompts
        for name, dtype, shape in text_tensors(text)[0]:
            rec.inputs.add(name=name, datatype=dtype, shape=list(shape))
        for name, dtype, shape in text_tensors(text)[1]:
            rec.outputs.add(name=name, datatype=dtype, shape=list(shape))
        rec.protocol = "kserve"
        rec.capabilities.CopyFrom(declared_capabilities(io, text_prompts=text))
        return rec

    def load(self) -> registry_pb2.TeacherLoad:
        f = self._load.figures()
        return registry_pb2.TeacherLoad(
            instance_id=self.instance_id,
            queue_depth=self._batcher.queue_depth if self._batcher else 0,
            in_flight=self.requests.in_flight, samples_per_s=f.samples_per_s, busy_fraction=f.busy_fraction,
            capacity_samples_per_s=f.capacity_samples_per_s, updated_at=time.time(), draining=self.draining,
        )


def _check_port_free(flag: str, host: str, port: int) -> None:
    """OSError naming the flag when `host:port` is taken. gRPC would only log its own line and
    return no port; a probe bind (with SO_REUSEADDR, as gRPC binds) says which flag to change."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # gRPC reports what it makes of the address
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as e:
                raise OSError(f"{flag} {port}: cannot bind {host}:{port} ({e.strerror or e}); is another process "
                              f"using it? ({flag} 0 picks a free one)") from None


def _metrics_endpoint(metrics: ServerMetrics, host: str, port: int) -> MetricsHTTPServer:
    try:
        return MetricsHTTPServer(metrics, host, port)
    except OSError as e:
        raise OSError(f"--metrics-port {port}: cannot bind {host}:{port} ({e.strerror or e}); "
                      "is another process using it? (--metrics-port 0 picks a free one)") from None


def check_tls_files(cfg: ServerConfig) -> None:
    """SpecError unless --tls-cert, --tls-key (and --tls-client-ca) are PEM files that belong
    together; gRPC itself only reports a failed bind, which reads like a port in use."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e).upper().replace(" ", "_"):
            raise SpecError(f"--tls-key {cfg.tls_key} does not match --tls-cert {cfg.tls_cert}; "
                            "pass the private key of that certificate") from None
        raise SpecError(f"--tls-cert {cfg.tls_cert} / --tls-key {cfg.tls_key}: not a PEM certificate chain and "
                        f"its private key ({e.reason or e}); pass PEM files") from None
    except OSError as e:
        raise SpecError(f"--tls-cert {cfg.tls_cert} / --tls-key {cfg.tls_key}: cannot read ({e})") from None
    if cfg.tls_client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=cfg.tls_client_ca)
        except (ssl.SSLError, OSError) as e:
            raise SpecError(f"--tls-client-ca {cfg.tls_client_ca}: not a PEM CA bundle ({e}); pass PEM "
                            "certificates") from None


GPU_INSTANCES = 2
"""Instances (a thread and a CUDA stream each) on a GPU by default, the count `benchmarks.instances`
measured best (docs/benchmarks.md). While one instance's thread does a batch's host work
(gathering inputs, launching, encoding answers), the other's batch keeps the GPU busy; a third adds
contention, not overlap. The weights are shared, so a second instance costs only its activations."""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's cpuset, `taskset`, a
    Kubernetes pod with exclusive CPUs), not the host's count, which `os.cpu_count()` gives."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def default_instances(device: str | None) -> int:
    """One single-threaded instance per usable core on CPU; GPU_INSTANCES on an accelerator.

    On CPU, one instance with a thread per core loses a whole batch step whenever the event loop or
    gRPC takes a core: every intra-op sync point waits for the descheduled thread. Independent
    single-threaded instances only lose that thread's share.
    """
    named = device not in (None, "", "auto")
    if (torch.device(str(device)).type if named else resolve_device(device).type) != "cpu":
        return GPU_INSTANCES
    return usable_cores()


def configure_torch_threads(threads: int | None, instances: int = 1) -> None:
    """Intra-op threads for the model: the usable cores shared out between the instances."""
    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // max(1, instances)))
