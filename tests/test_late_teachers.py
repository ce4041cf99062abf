"""Teachers of a fixed list that are not ready when a reader or `distill gateway` first reaches
them (not listening yet, or listening while their model loads) are asked again on the ejection
back-off and used once ready; a teacher SIGKILLed behind the gateway costs its requests a re-send
to the live one, not the no-teacher timeout; and a teacher serving another model than the one
asked for stays out, with a message naming the option of the program that printed it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from discovery.local_etcd import free_port
from distill import DistillReader, TeacherMismatchError
from distill.router import RouterConfig
from teacher_server import ModelIO, ServerConfig, TeacherServer
from tests.etcd_fixtures import arun
from tests.models import Affine
from tests.servers import ServerThread, teacher_process

VOCAB = 32
LOAD_S = 3.0
"""How long `slow_token_lm` takes to load: longer than the reader's back-off at its cap, so the
gateway's reader reaches the teacher while its model loads, whatever its timing."""


class TokenLM(nn.Module):
    """Per-position logits of a padded token input: what the gateway's scoring asks of a teacher."""

    io_spec = ModelIO.parse(["INPUT_IDS:INT64:-1:pad=0"], [f"LOGITS:FP32:-1,{VOCAB}:per_position"])

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]


def token_lm() -> TokenLM:
    return TokenLM()


def slow_token_lm() -> TokenLM:
    """Loads for LOAD_S, like a big checkpoint (in-process teachers only)."""
    time.sleep(LOAD_S)
    return TokenLM()


@contextlib.contextmanager
def loading_teacher(config: ServerConfig) -> Iterator[TeacherServer]:
    """A teacher-server on its own event loop thread, yielded as soon as it listens: its model may
    still be loading then (its RepositoryIndex says LOADING, ModelInfer UNAVAILABLE)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="loading-teacher")
    thread.start()
    server = TeacherServer(config)
    starting = asyncio.run_coroutine_threadsafe(server.start(), loop)
    try:
        for _ in range(3000):  # the port is bound before the model loads
            if server.port or starting.done():
                break
            time.sleep(0.01)
        assert server.port, f"the teacher did not listen: {starting.exception() if starting.done() else 'no port'}"
        yield server
    finally:
        with contextlib.suppress(Exception):
            starting.result(60)
            asyncio.run_coroutine_threadsafe(server.stop(5.0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def inferences(server: TeacherServer) -> int:
    return server.metrics.snapshot().inference_count


# ---- the reader -------------------------------------------------------------------------------------
def test_a_listed_teacher_started_after_the_reader_serves_once_its_model_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`DistillReader(teachers="A,B")` with B not even listening; B then starts and loads its model
    for 2 s (the reader reaches it meanwhile, at its 0.5 s back-off cap): B answers batches once
    ready, and was never ejected for good."""
    monkeypatch.setenv("TEST_LOAD_S", "2")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = Affine()(x)
    port = free_port()
    with ServerThread(ServerConfig(model="tests.models:affine", name="affine", device="cpu")) as a, \
            DistillReader(None, teachers=f"{a.url},127.0.0.1:{port}", inputs=["X"], outputs=["Y"], timeout=5.0,
                          no_teacher_timeout=30.0, router=RouterConfig(backoff_max_s=0.5)) as reader:
        assert torch.allclose(reader.score({"X": x}, deadline_s=30)["Y"], want, atol=1e-5)  # A alone
        with loading_teacher(ServerConfig(model="tests.models:slow_load", name="affine", device="cpu",
                                          port=port)) as b:
            deadline = time.monotonic() + 60
            states = set()
            for _ in range(1200):
                assert torch.allclose(reader.score({"X": x}, deadline_s=30)["Y"], want, atol=1e-5)
                states.add(reader.stats().teachers["teachers"][f"127.0.0.1:{port}"]["state"])
                if inferences(b) > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert inferences(b) > 0, f"the late teacher never got a batch; its states: {states}"
    assert not any("incompatible" in s for s in states), states
    assert any("still loading" in s for s in states), f"the reader never reached B while it loaded: {states}"


def test_a_teacher_serving_another_model_stays_out_naming_the_readers_option() -> None:
    """model='nope' against a teacher serving 'affine': it is out for good at once (waiting does not
    change what it serves), and the error says model='NAME' (--distill_model NAME)."""
    with ServerThread(ServerConfig(model="tests.models:affine", name="affine", device="cpu")) as a:
        started = time.monotonic()
        with pytest.raises(TeacherMismatchError) as error, \
                DistillReader(None, teachers=a.url, inputs=["X"], model="nope", no_teacher_timeout=60.0):
            pass
        waited = time.monotonic() - started
    message = str(error.value)
    assert a.url in message and "does not serve model 'nope'" in message and "serves 'affine'" in message, message
    assert "model='NAME' (--distill_model NAME)" in message and "--model NAME" not in message, message
    assert waited < 60.0, "raised at once, not after no_teacher_timeout"


# ---- the gateway ------------------------------------------------------------------------------------
def test_the_gateway_uses_a_teacher_that_loads_and_answers_through_it_when_the_other_is_sigkilled(
        tmp_path: Path) -> None:
    """`distill gateway --teachers A,B --timeout 2`, A up (a process), B listening while its model
    loads: B takes requests once ready; then A is SIGKILLed and every next request is answered (200)
    by B, each within 4x --timeout (a hang guard: the no-teacher timeout is 30 s)."""
    from distill.gateway import Gateway, GatewayConfig

    timeout = 2.0
    args = ["--model", "tests.test_late_teachers:token_lm", "--name", "lm", "--device", "cpu"]
    with teacher_process(args, tmp_path) as (proc, info), \
            loading_teacher(ServerConfig(model="tests.test_late_teachers:slow_token_lm", name="lm",
                                         device="cpu")) as b:
        teachers = f"127.0.0.1:{info['port']},127.0.0.1:{b.port}"

        async def go() -> tuple[list[int], int, int]:
            import aiohttp

            config = GatewayConfig(port=0, teachers=teachers, timeout=timeout, no_teacher_timeout=30.0)
            body = {"prompt": [[1, 2, 3, 4, 5]], "max_tokens": 1, "prompt_logprobs": 2}
            async with Gateway(config) as gw, aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{gw.port}/v1/completions"

                async def post(limit_s: float) -> int:
                    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
                        answer = await resp.json()
                        if resp.status == 200:
                            assert len(answer["choices"][0]["prompt_logprobs"]) == 5, answer
                        return resp.status

                deadline = time.monotonic() + 60
                for _ in range(1200):  # B loads for LOAD_S, then is asked again within the back-off
                    assert await post(60) == 200
                    if inferences(b) > 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                before = inferences(b)
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)
                statuses = [await post(4 * timeout) for _ in range(6)]
                return statuses, before, inferences(b)

        statuses, before, after = arun(go(), 180)
    assert before > 0, "the gateway never sent the teacher that was loading a request"
    assert statuses == [200] * 6, statuses
    assert after >= before + 6, (before, after)
    assert proc.returncode == -9  # it was killed, not drained


def test_the_gateway_names_its_own_model_flag_for_a_teacher_serving_another_model(
        caplog: pytest.LogCaptureFixture) -> None:
    """`distill gateway --model nope` against a teacher serving 'affine': 503 at once, and both the
    answer and the log say --model NAME, a flag the gateway has, not the reader's --distill_model."""
    from distill.gateway import Gateway, GatewayConfig

    caplog.set_level(logging.INFO)
    with ServerThread(ServerConfig(model="tests.models:affine", name="affine", device="cpu")) as a:

        async def go() -> tuple[int, str]:
            import aiohttp

            config = GatewayConfig(port=0, teachers=a.url, model="nope", timeout=2.0, no_teacher_timeout=60.0)
            body = {"prompt": [[1, 2, 3]], "max_tokens": 1}
            async with Gateway(config) as gw, aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{gw.port}/v1/completions", json=body) as resp:
                return resp.status, (await resp.json())["error"]["message"]

        status, message = arun(go(), 120)
    assert status == 503 and "does not serve model 'nope'" in message, message
    assert "--model NAME" in message and "--distill_model" not in message and "model='NAME'" not in message, message
    ejected = [r.getMessage() for r in caplog.records if "ejected" in r.getMessage() and a.url in r.getMessage()]
    assert ejected and all("--model NAME" in m and "--distill_model" not in m for m in ejected), ejected
