"""The GPU's memory and the caching allocator on /metrics (`teacher_server.device_memory`): Triton's
two whole-device gauges and this server's allocator figures, for a model on CUDA; none for a CPU
model. The server test runs on whatever device this machine has and checks what that device must show."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families

from teacher_server import ServerConfig
from teacher_server.device_memory import DeviceMemory, device_memory_source
from teacher_server.metrics import ServerMetrics
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(120)

READING = DeviceMemory(gpu_uuid="GPU-0f1e2d3c-aaaa-bbbb-cccc-000011112222", total_bytes=80 << 30,
                       used_bytes=21 << 30, allocated_bytes=3 << 30, reserved_bytes=19 << 30,
                       device_allocations=41, device_frees=7, alloc_retries=2, ooms=0)


def _families(text: str) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    return {f.name: (f.type, [(s.labels, s.value) for s in f.samples]) for f in text_string_to_metric_families(text)}


def _device_families(reading: DeviceMemory) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    """The GPU families of a metrics endpoint whose source reads `reading`, parsed back."""
    m = ServerMetrics("m", "1")
    m.watch_device_memory(lambda: reading)
    return {k: v for k, v in _families(m.render()).items() if k.startswith(("nv_gpu_", "teacher_cuda_"))}


def test_the_figures_render_under_their_names_types_and_the_gpus_uuid() -> None:
    got = _device_families(READING)
    labels = {"gpu_uuid": READING.gpu_uuid}
    assert got["nv_gpu_memory_total_bytes"] == ("gauge", [(labels, float(80 << 30))])
    assert got["nv_gpu_memory_used_bytes"] == ("gauge", [(labels, float(21 << 30))])
    assert got["teacher_cuda_memory_allocated_bytes"] == ("gauge", [(labels, float(3 << 30))])
    assert got["teacher_cuda_memory_reserved_bytes"] == ("gauge", [(labels, float(19 << 30))])
    # prometheus-client names a counter family without its _total suffix
    assert got["teacher_cuda_device_allocations"] == ("counter", [(labels, 41.0)])
    assert got["teacher_cuda_device_frees"] == ("counter", [(labels, 7.0)])
    assert got["teacher_cuda_alloc_retries"] == ("counter", [(labels, 2.0)])
    assert got["teacher_cuda_ooms"] == ("counter", [(labels, 0.0)])
    assert len(got) == 8


def test_a_label_value_with_a_quote_or_backslash_stays_one_label() -> None:
    odd = DeviceMemory("GPU-a\"b\\c", 1, 0, 0, 0, 0, 0, 0, 0)
    got = _device_families(odd)
    assert got["nv_gpu_memory_total_bytes"][1] == [({"gpu_uuid": 'GPU-a"b\\c'}, 1.0)]


def test_the_metrics_show_the_figures_only_while_the_source_has_them() -> None:
    m = ServerMetrics("m", "1")
    assert "nv_gpu_" not in m.render() and "teacher_cuda_" not in m.render()  # a CPU model: no source
    readings: list[DeviceMemory | None] = [READING, None]
    m.watch_device_memory(lambda: readings.pop(0))
    first, second = m.render(), m.render()
    assert 'nv_gpu_memory_used_bytes{gpu_uuid="GPU-0f1e2d3c-aaaa-bbbb-cccc-000011112222"}' in first
    assert "teacher_cuda_alloc_retries_total" in first
    # the CUDA runtime failed to answer: the other families are still served
    assert "nv_gpu_" not in second and "nv_inference_request_success" in second


def test_a_cpu_device_has_no_source() -> None:
    assert device_memory_source(torch.device("cpu")) is None
    assert device_memory_source(torch.device("meta")) is None


def test_a_device_that_cannot_answer_gives_no_figures_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    """A CUDA device this machine lacks (cuda:0 without CUDA; one past the last GPU with it): the
    source is built all the same and its reads give None, logged once, never an exception."""
    read = device_memory_source(torch.device("cuda", torch.cuda.device_count()))
    assert read is not None
    with caplog.at_level("WARNING", logger="teacher_server.device_memory"):
        assert read() is None and read() is None
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1


def test_a_served_model_shows_its_devices_memory() -> None:
    """A teacher-server on this machine's default device (a GPU where there is one) after one
    request: on CUDA the families are there and consistent; on CPU there are none."""
    config = ServerConfig(model="tests.models:affine", name="affine", device="auto", instances=1, metrics_port=0)
    with ServerThread(config) as s:
        assert s.server is not None and s.server.metrics_port is not None
        client = tg.InferenceServerClient(s.url)
        try:
            x = tg.InferInput("X", [4, 8], "FP32")
            x.set_data_from_numpy(np.random.default_rng(0).standard_normal((4, 8), dtype=np.float32))
            client.infer("affine", [x], client_timeout=60)
        finally:
            client.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10) as r:
            got = _families(r.read().decode("utf-8"))
        assert got["nv_inference_request_success"][1][0][1] == 1.0
        if s.server.device.type != "cuda":
            assert not [name for name in got if name.startswith(("nv_gpu_", "teacher_cuda_"))]
            return
        (labels, total), = got["nv_gpu_memory_total_bytes"][1]
        assert labels["gpu_uuid"].startswith("GPU-") and len(labels["gpu_uuid"]) > 8
        used = got["nv_gpu_memory_used_bytes"][1][0][1]
        allocated = got["teacher_cuda_memory_allocated_bytes"][1][0][1]
        reserved = got["teacher_cuda_memory_reserved_bytes"][1][0][1]
        assert total >= used >= reserved >= allocated > 0  # the weights at least
        assert got["teacher_cuda_device_allocations"][1][0][1] >= 1
        assert got["teacher_cuda_ooms"][1][0][1] == 0


def test_the_benchmarks_record_what_the_allocator_did_over_a_pass() -> None:
    from benchmarks.llm_parts import device_memory_change

    before = {"teacher_cuda_device_allocations_total": 40.0, "teacher_cuda_device_frees_total": 2.0,
              "teacher_cuda_alloc_retries_total": 1.0, "teacher_cuda_memory_reserved_bytes": 1.0 * 2**30,
              "nv_gpu_memory_used_bytes": 2.0 * 2**30}
    after = {**before, "teacher_cuda_device_allocations_total": 52.0, "teacher_cuda_device_frees_total": 9.0,
             "teacher_cuda_memory_reserved_bytes": 12.5 * 2**30, "nv_gpu_memory_used_bytes": 14.0 * 2**30}
    assert device_memory_change(before, after) == {"device_allocations": 12.0, "device_frees": 7.0,
                                                   "alloc_retries": 0.0, "reserved_gib": 12.5,
                                                   "device_used_gib": 14.0}
    assert device_memory_change({}, {}) is None  # a server on the CPU
