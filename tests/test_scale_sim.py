"""`benchmarks.scale_sim`: its model of watch events (load puts x load watchers + membership changes
x all watchers) and a small run against a real etcd, where what the watchers received and what etcd
counted must agree with the model fed the sources the simulator counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale_sim import parse_args
from benchmarks.scale_sim_worker import nominal
from tests.servers import REPO

pytestmark = pytest.mark.timeout(240)


def test_the_nominal_counts_churn_for_every_watcher() -> None:
    """At 1,000 x 200, worst-case load puts (200/s) reach the one load watcher; the probe's two
    membership changes a second reach all 1,000 students and the autoscaler."""
    full = nominal(1000, 200, probe_every=1.0)
    assert full["membership_changes_per_s"] == 2.0
    assert full["events_by_source"] == {"load": 200.0, "membership": 2002.0, "demand": 0.0}
    assert full["events_by_watcher"] == {"student": 2000.0, "autoscaler": 202.0}
    assert full["watch_events_per_s"] == 2202.0
    ten = nominal(10_000, 2_000, probe_every=1.0)
    assert ten["events_by_watcher"]["student"] == 20_000.0
    assert nominal(1000, 200, probe_every=0.0)["watch_events_per_s"] == 200.0  # no churn: loads only


def test_fractions_up_to_ten_are_accepted() -> None:
    assert parse_args(["--fractions", "0.1,10"]).fractions == (0.1, 10.0)
    with pytest.raises(SystemExit):
        parse_args(["--fractions", "10.5"])


def test_a_small_run_matches_the_model_per_watcher_kind(tmp_path: Path) -> None:
    """20 students x 4 teachers on a real etcd for a few seconds: events per watcher kind, and
    etcd's own count, within 20 % of the model; the churn happened (probe teachers came and went)."""
    env = {**os.environ, "DISTILL_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_sim", "--fractions", "0.02", "--seconds", "5", "--ramp", "2",
         "--settle", "1", "--workers", "1", "--clients", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "scale_sim.json").read_text())
    [row] = doc["rows"]
    events = row["events"]
    assert events["sources_per_s"]["membership_changes_per_s"] > 0, events  # the scenario: churn
    for kind, ratio in events["ratio_by_watcher"].items():
        assert ratio is not None and 0.8 <= ratio <= 1.2, (kind, events)
    assert 0.8 <= events["ratio_etcd_total"] <= 1.2, events
    assert "events/s by watcher kind (measured / model)" in proc.stdout


def test_through_an_etcd_grpc_proxy_every_student_still_gets_every_change(tmp_path: Path) -> None:
    """The same run with the students and teachers behind one `etcd grpc-proxy`: the discovery
    code works through it unchanged (every watcher gets the events the model says), while etcd
    itself sends a small fraction of them (the proxy coalesces the identical watches) and starts
    no keepalive stream per refresh."""
    env = {**os.environ, "DISTILL_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_sim", "--fractions", "0.02", "--seconds", "5", "--ramp", "2",
         "--settle", "1", "--workers", "1", "--clients", "2", "--proxies", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads((tmp_path / "scale_sim_proxy1.json").read_text())["rows"]
    events = row["events"]
    assert row["proxies"] == 1 and events["sources_per_s"]["membership_changes_per_s"] > 0, events
    for kind, ratio in events["ratio_by_watcher"].items():
        assert ratio is not None and 0.8 <= ratio <= 1.2, (kind, events)
    assert events["ratio_etcd_total"] < 0.5, events  # 20 student watches became a few at etcd
    assert row["measured"]["grpc_started_per_method_per_s"].get("LeaseKeepAlive", 0) == 0, row["measured"]
