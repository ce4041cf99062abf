"""Every serving benchmark takes --device and --compute-dtype (benchmarks/device.py), hands them
to its teacher servers and runs its in-process baseline the same way. These run on the CPU; W6
runs end to end in test_llm_serving_bench.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from benchmarks import llm_serving, mesh, serving
from benchmarks.device import DeviceChoice, InProcessModel, parse_device


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_devices_accepted(text: str) -> None:
    assert parse_device(text) == text


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_devices_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="use cpu, cuda or cuda:N"):
        parse_device(text)


def test_every_benchmark_passes_the_device_to_its_servers() -> None:
    flags = ["--device", "cuda:1", "--compute-dtype", "bf16"]
    s1 = serving.parse_args(flags)
    assert (s1.device, s1.compute_dtype) == ("cuda:1", "BF16")
    args = serving.server_args(s1, batching=True)
    assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--compute-dtype") + 1] == "BF16"
    s2 = mesh.parse_args(flags)
    args = mesh.server_args(s2)
    assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--compute-dtype") + 1] == "BF16"
    assert mesh.result_name(s2) == "mesh_cuda1_bf16"  # never replaces the CPU results
    s3 = llm_serving.parse_args(flags)
    args = llm_serving.server_args(s3, Path("/x"), 0, 10, True)
    assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--compute-dtype") + 1] == "BF16"
    ab = llm_serving.parse_args(["--server-arg=--no-async-outputs"])  # the async-output A/B
    assert "--no-async-outputs" in llm_serving.server_args(ab, Path("/x"), 0, 10, True)
    for s in (serving.parse_args([]), mesh.parse_args([]), llm_serving.parse_args([])):
        assert (s.device, s.compute_dtype) == ("cpu", "FP32")


def test_the_json_names_the_device() -> None:
    assert DeviceChoice().info() == {"device": "cpu", "compute_dtype": "FP32", "gpu": None}
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA is not available"):
            DeviceChoice("cuda").check()


def test_the_cpu_baseline_is_the_model_itself() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    x = torch.randn(4, 3, 2, 2)
    wrapped = InProcessModel(model, DeviceChoice(), images=True)
    with torch.inference_mode():
        assert torch.equal(wrapped(x), model(x))
    assert wrapped.place(x) is x


def test_the_llm_cuda_baseline_sorts_by_length_within_the_token_budget() -> None:
    seqs = [[1] * n for n in (30, 5, 64, 7, 33, 12, 60)]
    batches = llm_serving.sorted_batches(seqs, budget=100, pad_id=0)
    widths = [ids.shape[1] for ids, _, _ in batches]
    assert widths == sorted(widths)
    assert all(ids.numel() <= 100 or ids.shape[0] == 1 for ids, _, _ in batches)
    assert sum(n for _, _, n in batches) == sum(map(len, seqs))
    assert [tuple(ids.shape) for ids, _, _ in batches] == [(3, 12), (2, 33), (1, 60), (1, 64)]
