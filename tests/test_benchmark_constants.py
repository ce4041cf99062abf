"""The benchmarks state their workloads' constants once (benchmarks/common.py) as plain values;
this checks that those values still describe the models and the server they name."""

from __future__ import annotations

import importlib

from benchmarks import common
from benchmarks.autoscale import settings as w4
from examples import emulated
from teacher_server.batcher import BatchingConfig
from teacher_server.cli import build_parser


def test_benchmark_constants_agree_with_the_models_and_the_server() -> None:
    assert common.W1_BATCH == emulated.BATCH == w4.BATCH
    assert common.EMULATED_TEACHER_MS_ENV == emulated.TEACHER_MS_ENV == w4.TEACHER_MS_ENV
    assert BatchingConfig().max_queue_delay_us == common.SERVER_QUEUE_DELAY_US
    assert build_parser().parse_args(["--model", "m:f"]).max_queue_delay_us == common.SERVER_QUEUE_DELAY_US
    for ref in (common.EMULATED_MODEL_REF, common.REF_MODEL_REF):
        module, _, factory = ref.partition(":")
        assert callable(getattr(importlib.import_module(module), factory)), ref
