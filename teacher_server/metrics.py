"""Server metrics: Triton's Prometheus families, and the load figures the registry publishes.

Families keep Triton's exact names (`nv_inference_count`, not `nv_inference_count_total`), so
dashboards and alerts written for Triton work unchanged. prometheus-client insists on the
`_total` suffix for counters, so these families are rendered here; the process collector
(RSS, CPU seconds) comes from prometheus-client as usual.

All counters are updated on the server's event loop only, so they need no locks; the HTTP
thread reads a consistent-enough snapshot of plain floats.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from teacher_server.batch_cost import BatchCostFigures
from teacher_server.device_memory import DeviceMemory

_COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of N counts N)",
    "nv_inference_exec_count": "Number of model executions performed (batches)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds",
}
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


def _labels(d: dict[str, str]) -> str:
    """Prometheus' label set, each value escaped as its text format asks (backslash, quote, newline)."""
    def escaped(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    body = ",".join(f'{k}="{escaped(v)}"' for k, v in d.items())
    return "{" + body + "}"


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters at one moment, for ModelStatistics-style answers."""

    request_success: int
    request_failure: int
    inference_count: int
    exec_count: int
    request_duration_us: float
    queue_duration_us: float
    compute_infer_duration_us: float
    last_inference_ms: float


class ServerMetrics:
    """Triton-named counters for one served model, recorded through the record_* methods."""

    def __init__(self, model: str, version: str) -> None:
        self.labels = {"model": model, "version": version}
        self._request_success = 0
        self._request_failure = dict.fromkeys(FAILURE_REASONS, 0)
        self._inference_count = 0
        self._exec_count = 0
        self._request_duration_us = 0.0
        self._queue_duration_us = 0.0
        self._compute_infer_duration_us = 0.0
        self._last_inference_ms = 0.0
        self._useful_tokens = 0
        self._computed_tokens = 0
        self._nonfinite_rows = 0
        # Read at scrape time (from the HTTP thread): the batcher's queue length.
        self._pending_source: Callable[[], int] = lambda: 0
        self._in_flight_source: Callable[[], int] = lambda: 0
        self._batch_cost_source: Callable[[], BatchCostFigures] | None = None
        self._device_memory_source: Callable[[], DeviceMemory | None] | None = None

    def record_success(self, batch_size: int, request_ns: int, queue_ns: int, compute_ns: int) -> None:
        """One request answered: `batch_size` inferences, its whole duration, its time queued and
        the compute time of the batch that carried it."""
        self._request_success += 1
        self._inference_count += batch_size
        self._request_duration_us += request_ns / 1000
        self._queue_duration_us += queue_ns / 1000
        self._compute_infer_duration_us += compute_ns / 1000
        self._last_inference_ms = time.time() * 1000

    def record_failure(self, reason: str) -> None:
        """One request failed; `reason` is one of FAILURE_REASONS (Triton's label values)."""
        if reason not in self._request_failure:
            raise ValueError(f"failure reason {reason!r}; use one of {', '.join(FAILURE_REASONS)}")
        self._request_failure[reason] += 1

    def record_execution(self) -> None:
        """One batch ran on a model instance."""
        self._exec_count += 1

    def record_nonfinite(self, rows: int) -> None:
        """An answered request had `rows` rows whose outputs hold inf or NaN (marked in its answer)."""
        self._nonfinite_rows += rows

    @property
    def nonfinite_rows(self) -> int:
        return self._nonfinite_rows

    def record_tokens(self, useful: int, computed: int) -> None:
        """One batch of a padded model ran: `useful` positions the requests needed, `computed`
        positions the model computed (padding included); their gap is the padding waste."""
        self._useful_tokens += useful
        self._computed_tokens += computed

    @property
    def tokens(self) -> tuple[int, int]:
        """(useful, computed) sequence positions over all batches of a padded model."""
        return self._useful_tokens, self._computed_tokens

    def watch_pending(self, source: Callable[[], int]) -> None:
        """Where the pending-request gauge is read from at scrape time (the batcher's queue)."""
        self._pending_source = source

    def watch_in_flight(self, source: Callable[[], int]) -> None:
        """Where the in-flight gauge is read from at scrape time (the request lifecycle)."""
        self._in_flight_source = source

    def watch_batch_cost(self, source: Callable[[], BatchCostFigures]) -> None:
        """Where a padded model's batch cost and padding floor are read from at scrape time (the batcher)."""
        self._batch_cost_source = source

    def watch_device_memory(self, source: Callable[[], DeviceMemory | None] | None) -> None:
        """Where a GPU model's device memory figures are read from at scrape time
        (`device_memory.device_memory_source`; None: a CPU model, no such families)."""
        self._device_memory_source = source

    def failures(self, reason: str) -> int:
        return self._request_failure[reason]

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            self._request_success, sum(self._request_failure.values()), self._inference_count, self._exec_count,
            self._request_duration_us, self._queue_duration_us, self._compute_infer_duration_us,
            self._last_inference_ms,
        )

    def render(self) -> str:
        lab = _labels(self.labels)
        values: dict[str, list[tuple[str, float]]] = {
            "nv_inference_request_success": [(lab, self._request_success)],
            "nv_inference_request_failure": [
                (_labels({**self.labels, "reason": r}), n) for r, n in self._request_failure.items()
            ],
            "nv_inference_count": [(lab, self._inference_count)],
            "nv_inference_exec_count": [(lab, self._exec_count)],
            "nv_inference_request_duration_us": [(lab, self._request_duration_us)],
            "nv_inference_queue_duration_us": [(lab, self._queue_duration_us)],
            "nv_inference_compute_infer_duration_us": [(lab, self._compute_infer_duration_us)],
        }
        lines: list[str] = []
        for name, doc in _COUNTERS.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            lines += [f"{name}{labels} {float(v)}" for labels, v in values[name]]
        lines += _family("nv_inference_pending_request_count", "gauge", lab, self._pending_source(),
                         "Instantaneous number of pending requests awaiting execution per-model.")
        # Not a Triton family: what a drain waits for, so operators (and tests) can watch it.
        lines += _family("teacher_in_flight_request_count", "gauge", lab, self._in_flight_source(),
                         "Requests admitted and not yet answered (queued, executing or being validated).")
        # Not a Triton family: rows answered with inf or NaN in their outputs (an overflowing model).
        lines += _family("teacher_nonfinite_output_rows_total", "counter", lab, self._nonfinite_rows,
                         "Rows answered whose outputs hold a value that is not finite (inf or NaN).")
        # Not Triton families: padding waste of models with padded sequence inputs.
        lines += _family("teacher_useful_tokens_total", "counter", lab, self._useful_tokens,
                         "Sequence positions requests needed (samples x own length).")
        lines += _family("teacher_padded_tokens_total", "counter", lab, self._computed_tokens,
                         "Sequence positions computed, padding included (samples x padded length).")
        if self._batch_cost_source is not None:
            cost = self._batch_cost_source()
            lines += _family("teacher_batch_fixed_seconds", "gauge", lab, cost.fixed_s,
                             "Device time a batch costs whatever its size, fitted from the batches run (0 until "
                             "known).")
            lines += _family("teacher_batch_position_seconds", "gauge", lab, cost.per_position_s,
                             "Device time a batch costs per computed position, fitted from the batches run (0 "
                             "until known).")
            lines += _family("teacher_padding_floor", "gauge", lab, cost.padding_floor,
                             "Least useful / computed positions of a batch, as batches are formed now.")
        if self._device_memory_source is not None and (memory := self._device_memory_source()) is not None:
            gpu = _labels({"gpu_uuid": memory.gpu_uuid})
            for name, kind, value, doc in memory.families():
                lines += _family(name, kind, gpu, value, doc)
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, labels: str, value: float, doc: str) -> list[str]:
    """One metric family of a single sample, in Prometheus' text format."""
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]


@dataclass(frozen=True)
class LoadFigures:
    samples_per_s: float
    busy_fraction: float
    capacity_samples_per_s: float


class LoadMeter:
    """Throughput, busy fraction and measured capacity over a sliding window of batches.

    Capacity is what the instances deliver when fully busy: samples per compute-second over the
    whole window, times the instance count. The autoscaler sizes the pool from it, so it is
    measured, never guessed, and it is a ratio of window totals rather than a per-batch rate, so
    one slow batch (a GC pause, a cold cache) cannot make a teacher look half as fast. It keeps its
    last value while the teacher idles, and is 0 until the first batch ran.
    """

    def __init__(self, instances: int, window_s: float = 10.0) -> None:
        self._instances = instances
        self._window_s = window_s
        self._batches: collections.deque[tuple[float, int, int]] = collections.deque()
        self._capacity = 0.0
        self._started = time.monotonic()

    def record(self, samples: int, requests: int, compute_ns: int) -> None:
        del requests
        now = time.monotonic()
        self._batches.append((now, samples, compute_ns))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._batches and now - self._batches[0][0] > self._window_s:
            self._batches.popleft()

    def figures(self) -> LoadFigures:
        now = time.monotonic()
        self._trim(now)
        span = min(self._window_s, max(now - self._started, 1e-3))
        samples = sum(b[1] for b in self._batches)
        compute_s = sum(b[2] for b in self._batches) / 1e9
        busy = min(1.0, compute_s / (span * self._instances))
        if compute_s > 0:
            self._capacity = samples / compute_s * self._instances
        return LoadFigures(samples / span, busy, self._capacity)


class MetricsHTTPServer:
    """Serves /metrics on its own thread; close() stops it."""

    def __init__(self, metrics: ServerMetrics, host: str, port: int) -> None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "metrics are served at /metrics")
                    return
                body = (metrics.render() + generate_latest(registry).decode()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
