"""What the GPU's memory and PyTorch's caching allocator are doing, for the metrics endpoint.

A served LLM teacher's batches change shape every time (rows x length), and the caching allocator
keeps blocks of the shapes it has seen. When no cached block fits and the device is full, the
allocator frees its cached blocks and tries again: each `cudaFree` waits for the whole device, so
every instance and every stream on it stops until the work already queued has drained. That idle
time looks like a slow batch from outside. These figures make it visible on any teacher, at no
cost to the data path: they are read only when `/metrics` is scraped.

The two whole-device gauges keep Triton's names and label (`nv_gpu_memory_total_bytes`,
`nv_gpu_memory_used_bytes`, `gpu_uuid`), so dashboards written for Triton read them unchanged; the
allocator's own figures are this server's (`teacher_cuda_*`). A CPU model has none of them, as
Triton shows no GPU families on a machine without GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DeviceMemory", "device_memory_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a GPU's memory, and of this process's caching allocator on it."""

    gpu_uuid: str
    total_bytes: int  # the device's memory
    used_bytes: int  # used on the device by every process
    allocated_bytes: int  # held by this process's live tensors
    reserved_bytes: int  # held by this process's caching allocator (live tensors and cached blocks)
    device_allocations: int  # cudaMalloc calls so far
    device_frees: int  # cudaFree calls so far: each one waits for the device
    alloc_retries: int  # allocations that freed the cached blocks and tried again
    ooms: int  # allocations that failed even then

    def families(self) -> list[tuple[str, str, float, str]]:
        """(name, Prometheus type, value, help) of each family, one series each; the metrics
        endpoint labels them with `gpu_uuid`."""
        return [(name, kind, float(getattr(self, field)), doc) for name, kind, field, doc in _FAMILIES]


def _gpu_uuid(index: int) -> str:
    """The device's UUID as NVML and Triton write it (``GPU-…``); its index where torch has none."""
    try:
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # a build or runtime without it: the label is still unique on this machine
        uuid = ""
    if not uuid:
        return f"cuda:{index}"
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def device_memory_source(device: torch.device) -> Callable[[], DeviceMemory | None] | None:
    """A reader of `device`'s memory figures, or None where there are none (any device but CUDA).

    The reader is called from the metrics endpoint's thread. It returns None, and logs once, when
    the CUDA runtime fails to answer (a lost device) or answers unexpectedly: these figures are
    for watching, so they never fail a scrape's other families or the server's start."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = _gpu_uuid(index)
    failed = False

    def read() -> DeviceMemory | None:
        nonlocal failed
        try:
            free, total = torch.cuda.mem_get_info(index)
            stats = torch.cuda.memory_stats(index)
            return DeviceMemory(
                gpu_uuid=uuid, total_bytes=int(total), used_bytes=int(total - free),
                allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
                reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
                device_allocations=int(stats.get("num_device_alloc", 0)),
                device_frees=int(stats.get("num_device_free", 0)),
                alloc_retries=int(stats.get("num_alloc_retries", 0)),
                ooms=int(stats.get("num_ooms", 0)))
        except Exception as e:
            if not failed:
                log.warning("the GPU's memory figures cannot be read (%s: %s); /metrics leaves them out",
                            type(e).__name__, e)
                failed = True
            return None

    return read


# name, Prometheus type, field, help
_FAMILIES = (
    ("nv_gpu_memory_total_bytes", "gauge", "total_bytes", "GPU total memory, in bytes."),
    ("nv_gpu_memory_used_bytes", "gauge", "used_bytes", "GPU memory used by every process, in bytes."),
    ("teacher_cuda_memory_allocated_bytes", "gauge", "allocated_bytes",
     "GPU memory held by this server's live tensors, in bytes."),
    ("teacher_cuda_memory_reserved_bytes", "gauge", "reserved_bytes",
     "GPU memory held by this server's caching allocator (live tensors and cached blocks), in bytes."),
    ("teacher_cuda_device_allocations_total", "counter", "device_allocations",
     "Memory the caching allocator took from the device (cudaMalloc calls)."),
    ("teacher_cuda_device_frees_total", "counter", "device_frees",
     "Memory the caching allocator gave back to the device (cudaFree calls; each waits for the whole device)."),
    ("teacher_cuda_alloc_retries_total", "counter", "alloc_retries",
     "Allocations that found no cached block, freed the cache and tried again (the device idles meanwhile)."),
    ("teacher_cuda_ooms_total", "counter", "ooms", "Allocations that failed for lack of GPU memory."),
)
