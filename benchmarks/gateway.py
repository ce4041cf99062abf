"""What `distill gateway` costs over a direct call to teacher-server's own `/v1/completions`.

    .venv/bin/python -m benchmarks.gateway [--reps 5] [--quick] [--device cuda --compute-dtype BF16]

One `teacher-server --model hf:DIR --http-port 0` process serves the tiny random Llama of
`benchmarks.vllm_json` (vocabulary 32,000, 2 layers, hidden 64: cheap, so the protocols' own cost
shows); one `distill gateway --teachers 127.0.0.1:PORT` process fronts it. The same sequences
(fixed seed) are scored with the request TRL's `VLLMClient.get_sequence_logprobs` sends
(`max_tokens: 1`, `prompt_logprobs: k`), one sequence per request, through

  * direct:  the teacher's own `/v1/completions` (JSON from the teacher);
  * gateway: the gateway's `/v1/completions`, which sends each prompt to the teacher in binary
             KServe v2 (top-k reduced on the teacher) through the student reader and writes the
             same JSON itself.

Per variant: tokens/s with --clients requests in flight, milliseconds per request with one
client, and the CPU per token of the teacher and of the gateway process. Variants are
interleaved per repetition; medians are reported, with the gateway/direct ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import format_table, machine_info, median, run_and_report
from benchmarks.cpu import process_cpu_seconds
from benchmarks.vllm_json import Settings, draw, measure_json, save_teacher
from benchmarks.vllm_json import parse_args as scoring_args

VARIANTS = ("direct", "gateway")
REPO = Path(__file__).resolve().parent.parent


def stop_gateway(gateway: subprocess.Popen[bytes]) -> None:
    """SIGTERM the gateway started by `start_gateway`, SIGKILL it after 20 s, and close its pipe."""
    gateway.terminate()
    try:
        gateway.wait(20)
    except subprocess.TimeoutExpired:
        gateway.kill()
        gateway.wait(10)
    if gateway.stdout is not None:
        gateway.stdout.close()


def start_gateway(address: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`distill gateway --teachers ADDRESS --port 0`; (process, URL) once it listens and has the teacher."""
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distill.cli", "gateway", "--teachers", address, "--model",
                                 "tiny-llama", "--port", "0", "--log-level", "WARNING"], cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"the gateway exited ({proc.returncode}): {log.read_text()[-2000:]}")
    return proc, f"http://127.0.0.1:{json.loads(line)['port']}"


async def wait_healthy(url: str, timeout: float = 120.0) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout / 0.2)):
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout} s")


def run(s: Settings) -> dict[str, Any]:
    from teacher_server.launch import teacher_process

    seqs = draw(s)
    tokens = sum(len(q) for q in seqs)
    per_rep: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        directory = Path(tmp) / "teacher"
        save_teacher(directory, s.vocab, max(s.max_len, 64))
        args = ["--model", f"hf:{directory}", "--name", "tiny-llama", "--device", s.device,
                "--compute-dtype", s.compute_dtype, "--http-port", "0"]
        with teacher_process(args, log=Path(tmp) / "teacher.log", ready_timeout=300, stop_grace=10) as (_, info):
            gateway, gateway_url = start_gateway(f"127.0.0.1:{info['port']}", Path(tmp) / "gateway.log")
            try:
                asyncio.run(wait_healthy(gateway_url))
                urls = {"direct": f"http://127.0.0.1:{info['http_port']}", "gateway": gateway_url}
                pids = {"teacher": info["pid"], "gateway": gateway.pid}

                def measure(name: str, clients: int) -> Callable[[], Awaitable[tuple[float, int]]]:
                    return lambda: measure_json(urls[name], seqs, replace(s, clients=clients))

                for name in VARIANTS:  # warm-up: connections, thread pools, the gateway's reader
                    asyncio.run(measure(name, s.clients)())
                for rep in range(s.reps):
                    for name in (VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))):
                        cpu0 = {k: process_cpu_seconds(p) for k, p in pids.items()}
                        seconds, _ = asyncio.run(measure(name, s.clients)())
                        cpu = {k: process_cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
                        one_client, _ = asyncio.run(measure(name, 1)())
                        m = {"tokens_per_s": tokens / seconds, "ms_per_request": one_client / len(seqs) * 1000,
                             "teacher_cpu_us_per_token": cpu["teacher"] / tokens * 1e6,
                             "gateway_cpu_us_per_token": cpu["gateway"] / tokens * 1e6}
                        per_rep[name].append(m)
                        print(f"rep {rep} {name:8s} {m['tokens_per_s']:9,.0f} tokens/s  {m['ms_per_request']:7.2f} "
                              f"ms/request  teacher {m['teacher_cpu_us_per_token']:5,.0f}  gateway "
                              f"{m['gateway_cpu_us_per_token']:5,.0f} CPU µs/token", flush=True)
            finally:
                stop_gateway(gateway)
    keys = ("tokens_per_s", "ms_per_request", "teacher_cpu_us_per_token", "gateway_cpu_us_per_token")
    summary: dict[str, dict[str, float]] = {
        name: {k: round(median([m[k] for m in ms]), 2) for k in keys} for name, ms in per_rep.items()}
    ratios = [g["tokens_per_s"] / d["tokens_per_s"] for d, g in zip(per_rep["direct"], per_rep["gateway"],
                                                                     strict=True)]
    extra = [g["ms_per_request"] - d["ms_per_request"] for d, g in zip(per_rep["direct"], per_rep["gateway"],
                                                                        strict=True)]
    return {"benchmark": "gateway", "settings": s.__dict__, "tokens": tokens, "summary": summary,
            "gateway_vs_direct_throughput": round(median(ratios), 3),
            "gateway_added_ms_per_request": round(median(extra), 2), "per_rep": per_rep, "machine": machine_info()}


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = [(name, v["tokens_per_s"], v["ms_per_request"], v["teacher_cpu_us_per_token"],
             v["gateway_cpu_us_per_token"]) for name, v in doc["summary"].items()]
    head = (f"{s['sequences']} sequences ({doc['tokens']} tokens), prompt_logprobs {s['top_k']}, {s['clients']} "
            f"clients (ms/request: 1 client), device {s['device']}, median of {s['reps']}; gateway/direct "
            f"throughput {doc['gateway_vs_direct_throughput']}, +{doc['gateway_added_ms_per_request']} ms/request")
    return head + "\n" + format_table(["path", "tokens/s", "ms/request", "teacher CPU µs/tok",
                                       "gateway CPU µs/tok"], rows)


def parse_args(argv: Sequence[str] | None) -> Settings:
    return scoring_args(argv, prog="benchmarks.gateway", doc=__doc__, reps=5)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    return run_and_report(lambda: run(s), "gateway_quick" if s.quick else "gateway", report)


if __name__ == "__main__":
    raise SystemExit(main())
