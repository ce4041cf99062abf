"""The reader's nested settings objects: the router's tuning and TLS towards the teachers.

Fields of ``distill.options.ReaderOptions`` (``router=``, and ``tls_*`` made into a `ClientTLS`);
small frozen dataclasses, each the documentation of its own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the flags (distill --help) need no grpc
    import grpc

__all__ = ["ClientTLS", "RouterConfig"]


@dataclass(frozen=True)
class RouterConfig:
    """The router's tuning: in-flight limits, ejection backoff, the probe deadline.

    `min_limit` is the floor of the latency gradient (overload answers still halve below it, and
    successes bring the limit back one request each): the requests each teacher should always be
    allowed to hold, whatever its latency does. A teacher that batches padded rows by length says
    so, and its limit counts rows instead of calls, however they are cut into calls: it fills its
    batches from the rows queued, so the more it holds, the fewer and fuller its batches. A student
    keeps up to `by_length_rows` rows in flight to it: from a quarter of them, each answer within
    half the reader's timeout adds its rows, and each slower one takes a tenth off (the deadline
    is the only latency that counts), overload answers halve it. A few hundred rows in flight let
    such a teacher form batches of like lengths; a few calls of a student's batch each do not (the
    benchmarks page, docs/benchmarks.md, measures it). Such a teacher's
    queue holds 2,048 rows by default (`--max-queue-size`), four students' worth: past it, it
    sheds.
    """

    initial_limit: float = 2.0
    max_limit: int = 16
    min_limit: float = 1.0
    by_length_rows: int = 512
    backoff_base_s: float = 0.25
    # A failing or not-ready teacher is asked again within this (one cheap ModelReady, or its metadata),
    # so one that comes back (restarted, its model loaded) takes work again within a few seconds.
    backoff_max_s: float = 4.0
    probe_timeout_s: float = 1.0
    lost_races_eject: int = 3
    stale_after_s: float = 1.0
    overload_backoff_base_s: float = 0.05  # first cool-down after an overload answer; doubles per repeat
    overload_backoff_max_s: float = 2.0
    reject_strikes: int = 3  # refusals in a row of inputs other teachers accepted: incompatible

    def __post_init__(self) -> None:
        if not 1.0 <= self.min_limit <= self.max_limit:
            raise ValueError(f"RouterConfig: min_limit {self.min_limit} must be between 1 and max_limit "
                             f"{self.max_limit}")
        if self.by_length_rows < 1:
            raise ValueError(f"RouterConfig: by_length_rows must be at least 1, got {self.by_length_rows}")
        if not 1.0 <= self.initial_limit <= self.max_limit:
            raise ValueError(f"RouterConfig: initial_limit {self.initial_limit} must be between 1 and "
                             f"max_limit {self.max_limit}")


@dataclass(frozen=True)
class ClientTLS:
    """TLS towards teachers: the CA that signed their certificates, and this student's own
    certificate and key when teachers require mutual TLS. `server_name` overrides the name checked
    against the teacher's certificate (when endpoints are IPs the certificate does not list)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate for mutual TLS needs both tls_cert and tls_key")
        for label, path in (("tls_ca", self.ca), ("tls_cert", self.cert), ("tls_key", self.key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{label} {path} does not exist")

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))
