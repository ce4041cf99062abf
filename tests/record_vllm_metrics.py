"""Record real vLLM's Prometheus `/metrics` text for tests/test_registrar.py's metrics parser.

    python -m tests.record_vllm_metrics [--vllm-python /root/.cache/distill-vllm-venv/bin/python]

Run from the repository root with the project's own virtualenv. It serves the vLLM-shaped tiny
Llama with real vLLM exactly as tests/record_vllm_answers.py does (same virtualenv, same flags),
answers a few scoring requests, then writes two scrapes of `/metrics`: one while a burst of
requests runs (`tests/data/vllm_metrics_busy.txt`) and one after they all finished
(`tests/data/vllm_metrics_idle.txt`). It is not run by CI: it needs that venv and takes minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from teacher_server.registrar.load import read_figures
from tests.hf_models import save_vllm_llama
from tests.record_vllm_answers import SERVED_NAME, _call, _free_port, _wait_ready

DATA = Path(__file__).parent / "data"
BURST = 32


def _scrape(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        return str(resp.read().decode("utf-8"))


def record(vllm_python: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tiny-llama"
        save_vllm_llama(directory)
        port = _free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        log = open(Path(tmp) / "vllm.log", "wb")  # noqa: SIM115 (closed below, after the process)
        process = subprocess.Popen(
            [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory), "--dtype",
             "float32", "--max-logprobs", "20", "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, process)
            request = {"model": SERVED_NAME, "prompt": list(range(5, 25)), "max_tokens": 100, "prompt_logprobs": 5,
                       "ignore_eos": True}
            for _ in range(3):
                _call(base + "/v1/completions", request)
            burst = [threading.Thread(target=_call, args=(base + "/v1/completions", request)) for _ in range(BURST)]
            for t in burst:
                t.start()
            busy = _scrape(base)
            for _ in range(200):  # until the burst shows as running or waiting (bounded: 20 s)
                figures = read_figures("vllm", busy)
                if (figures.running or 0) + (figures.waiting or 0) > 0:
                    break
                time.sleep(0.1)
                busy = _scrape(base)
            for t in burst:
                t.join(120)
            idle = _scrape(base)
        except BaseException:
            log.flush()
            sys.stderr.write((Path(tmp) / "vllm.log").read_text(errors="replace")[-4000:])
            raise
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
            log.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_metrics_busy.txt").write_text(busy)
    (out / "vllm_metrics_idle.txt").write_text(idle)
    print(f"wrote {out}/vllm_metrics_busy.txt and vllm_metrics_idle.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default="/root/.cache/distill-vllm-venv/bin/python",
                        help="the python of a virtualenv with vllm-cpu installed (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DATA, help="the directory to write to (default: %(default)s)")
    args = parser.parse_args()
    record(args.vllm_python, args.out)


if __name__ == "__main__":
    main()
