"""The order the suite's files run in under ``pytest -n 3 --dist loadfile`` (make test).

xdist hands each worker one file at a time, by default the files with the most tests first, so
the files of one long test each (a benchmark's smoke run, a real vLLM start) would come last,
one worker running the last of them while the others sit idle. The files known to take the
longest run first instead, the rest after them as xdist would order them, so the end of the run
is many short files that the workers share out.
"""

from __future__ import annotations

from collections import Counter

import pytest

# The files that take the longest on two cores (setup, calls and teardown together), longest first.
# A file missing here only runs later; keep the list to the files that take tens of seconds.
SLOWEST_FIRST = (
    "tests/test_bench_smoke.py",
    "tests/test_registrar.py",
    "tests/test_gateway.py",
    "tests/test_teacher_lifecycle.py",
    "tests/test_teacher_memory_bench.py",
    "tests/test_gpu_table_smoke.py",
    "tests/test_engine_clients.py",
    "tests/test_elastic.py",
    "tests/test_serving_pytriton_bench.py",
    "tests/test_model_config.py",
    "tests/test_scoring_bench.py",
    "tests/test_reader_overhead_bench.py",
    "tests/test_llm_compare.py",
    "tests/test_llm_example.py",
    "tests/test_reader.py",
    "tests/faults/test_etcd_faults.py",
    "tests/test_crosstok_example.py",
    "tests/test_registry_e2e.py",
    "tests/test_reader_release.py",
    "tests/test_llm_serving_bench.py",
    "tests/test_autoscale_local.py",
    "tests/test_scale_sim.py",
    "tests/test_demo.py",
    "tests/test_hf_scoring.py",
    "tests/test_trl_trainer.py",
    "tests/test_engines_bench.py",
    "tests/test_autoscale_engine.py",
    "tests/faults/test_teacher_faults.py",
    "tests/test_onpolicy_bench.py",
    "tests/test_deploy_llm_serve.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """xdist's loadfile schedule keeps the collection's order of files (set below) instead of its own."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of SLOWEST_FIRST first, in its order; then the others, most tests first (xdist's
    own order). Each file's tests keep their order."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    counts = Counter(item.nodeid.split("::")[0] for item in items)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        return rank.get(path, len(rank)), -counts[path]

    items.sort(key=key)
