"""The local backend's child processes: one teacher (or an engine's registrar) each, found in the
registry by the record it writes, and stopped with its whole process group.

A child is *registered* when a record carries its instance id (``--instance-id`` of teacher-server
and of ``distill register``), or else when a record's endpoint is this child's loopback port: a
registrar that names its records itself is still counted as the teacher the backend started.

Every child runs in its own session (a process group led by it). SIGTERM goes to the leader only:
teacher-server drains itself, and a registrar withdraws the record, waits for the engine's work,
then stops its engine; an engine signalled at the same time would stop serving while students
still route to it. SIGKILL, after the grace, and the sweep after the leader exits go to the whole
group, so what a child started in its group (the engine of a shell wrapper) goes with it.
``distill register`` gives its engine a session of its own and the kernel's parent-death signal,
so its engine stops when the registrar dies, however it dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distill.autoscale.errors import BackendError
from teacher_server import launch

__all__ = ["Child", "free_port", "kill_group", "registered_id", "tail"]

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})


@dataclass
class Child:
    instance_id: str
    device: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    term_at: float | None = None
    warned_slow: bool = False

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None


def free_port(host: str, taken: set[int]) -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port
    raise BackendError(f"no free TCP port found on {host}")


def tail(path: Path, lines: int = 15) -> str:
    text = launch.log_tail(path, lines)
    return "\n".join("    " + line for line in text.splitlines()) or "    (no output)"


def _host_port(endpoint: str) -> tuple[str, int] | None:
    """``host:port`` of an endpoint written as ``host:port``, ``[v6]:port`` or ``http://host:port/path``."""
    rest = endpoint.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def registered_id(child: Child, teachers: Mapping[str, object], host: str) -> str | None:
    """The registry's instance id of ``child``'s record, None while it has none (see the module
    docstring for how a record is recognised)."""
    if child.instance_id in teachers:
        return child.instance_id
    hosts = _LOOPBACK | {host}
    for iid, entry in teachers.items():
        parsed = _host_port(str(getattr(entry, "endpoint", "")))
        if parsed is not None and parsed[1] == child.port and parsed[0] in hosts:
            return iid
    return None


def kill_group(child: Child) -> None:
    """SIGKILL ``child``'s process group (it leads one: started in its own session). Called while
    the leader lives or right after it was reaped, so the group id is still this child's."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, signal.SIGKILL)
