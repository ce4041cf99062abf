"""A prompt whose teacher outputs hold inf or NaN is never answered 200 over `/v1/completions`:
teacher-server's own route and `distill gateway` in front of it both answer 500 naming the prompt
(its place in the body's `prompt` list), while the other prompts' bodies are answered as usual.
The teacher is a real teacher-server process serving `tests.bad_models:overflow_lm`, which divides
its logits by zero at every position holding MARK_TOKEN."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from distill.gateway import Gateway, GatewayConfig
from tests.bad_models import MARK_TOKEN
from tests.etcd_fixtures import arun
from tests.servers import teacher_process


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_prompt_answered_with_inf_gets_a_500_naming_it_from_the_teacher_and_through_the_gateway(
        tmp_path: Path) -> None:
    good = {"prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 1, "prompt_logprobs": 2}
    bad = {"prompt": [[1, 2, 3], [4, MARK_TOKEN, 6]], "max_tokens": 1, "prompt_logprobs": 2}
    args = ["--model", "tests.bad_models:overflow_lm", "--name", "lm", "--device", "cpu", "--http-port", "0"]
    with teacher_process(args, tmp_path) as (_, info):
        direct = f"http://127.0.0.1:{info['http_port']}/v1/completions"
        assert _post(direct, good)[0] == 200
        status, answer = _post(direct, bad)

        async def through_gateway() -> list[tuple[int, Any]]:
            config = GatewayConfig(port=0, teachers=f"127.0.0.1:{info['port']}", model="lm", input_name="TOKENS",
                                   timeout=10.0, no_teacher_timeout=30.0)
            async with Gateway(config) as gw:
                url = f"http://127.0.0.1:{gw.port}/v1/completions"
                return [await asyncio.to_thread(_post, url, body) for body in (good, bad, good)]

        gateway = arun(through_gateway(), 120)
    assert status == 500, answer
    assert "prompt(s) [1]" in answer["error"]["message"] and "not finite" in answer["error"]["message"], answer
    assert [s for s, _ in gateway] == [200, 500, 200], gateway
    message = gateway[1][1]["error"]["message"]
    assert "prompt(s) [1]" in message and "not finite" in message, message
    assert "nonfinite" not in message and "DistillReader" not in message, message  # said of the HTTP request
    assert all(len(a["choices"]) == 2 for s, a in gateway if s == 200)
