"""An engine's HTTP pool (`distill.engines.http.EngineHTTP`) against a real aiohttp server on
loopback that closes connections: a request that fails before any answer (a pooled connection the
server closed while idle) is sent once more on a new connection; a second such failure, or a drop
after the answer began, is UNAVAILABLE; idle connections are kept for less than the servers' own
idle timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from aiohttp import web

from distill.engines.http import KEEPALIVE_S, EngineHTTP
from distill.teacher_client import TeacherCallError

Handler = Callable[[web.Request], Any]


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def _drop(request: web.Request) -> web.Response:
    """Close the connection without a byte of answer, as a server that timed it out idle does."""
    assert request.transport is not None
    request.transport.close()
    return web.Response(text="never sent")


async def _counted(drop_first: int) -> tuple[web.AppRunner, dict[str, Any]]:
    """A server that drops its first `drop_first` requests unanswered and echoes the rest; a body
    with "cut" gets the start of an answer, then the connection closes."""
    state: dict[str, Any] = {"seen": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        state["seen"] += 1
        body = await request.json()
        if state["seen"] <= drop_first:
            return await _drop(request)
        if body.get("cut"):
            resp = web.StreamResponse(headers={"Content-Length": "100", "Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"partial": ')
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.json_response({"echo": body["x"]})

    runner, state["base"] = await _serve(handler)
    return runner, state


def _run(drop_first: int, body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """One call through a fresh pool; (its answer or the TeacherCallError it raised, the server's state)."""
    async def go() -> tuple[Any, dict[str, Any]]:
        runner, state = await _counted(drop_first)
        http = EngineHTTP(state["base"])
        try:
            try:
                answer: Any = await asyncio.wait_for(http.call("POST", "/score", 5.0, body), 10)
            except TeacherCallError as e:
                answer = e
            state["keepalive"] = http._open().connector._keepalive_timeout  # type: ignore[union-attr]
        finally:
            await http.close()
            await runner.cleanup()
        return answer, state

    return asyncio.run(go())


def test_a_request_dropped_before_any_answer_is_sent_once_more() -> None:
    answer, state = _run(1, {"x": 7})
    assert answer == {"echo": 7}
    assert state["seen"] == 2, "the dropped request, then the same request on a new connection"


def test_two_drops_in_a_row_are_unavailable() -> None:
    answer, state = _run(2, {"x": 1})
    assert isinstance(answer, TeacherCallError)
    assert answer.code is grpc.StatusCode.UNAVAILABLE and "twice" in str(answer)
    assert state["seen"] == 2, "sent once more, not again and again"


def test_a_drop_after_the_answer_began_is_not_sent_again() -> None:
    answer, state = _run(0, {"x": 1, "cut": True})
    assert isinstance(answer, TeacherCallError) and answer.code is grpc.StatusCode.UNAVAILABLE
    assert state["seen"] == 1


def test_the_pool_keeps_idle_connections_less_than_uvicorns_five_seconds() -> None:
    answer, state = _run(0, {"x": 2})
    assert answer == {"echo": 2}
    assert 0 < KEEPALIVE_S < 5.0 and state["keepalive"] == KEEPALIVE_S


def _raw_answer(body: bytes) -> Any:
    """One call to a server that answers `body` as it is, through a fresh pool: the parsed answer
    or the error the pool raised."""
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def go() -> Any:
        runner, base = await _serve(handler)
        http = EngineHTTP(base)
        try:
            return await asyncio.wait_for(http.call("POST", "/score", 5.0, {"x": 1}), 10)
        except Exception as e:  # the test reads which error it was
            return e
        finally:
            await http.close()
            await runner.cleanup()

    return asyncio.run(go())


def test_answers_parse_to_the_same_objects_as_the_standard_library_non_finite_literals_included() -> None:
    """Strict JSON goes through the fast parser, and `NaN`/`-Infinity` (what Python's json writes for
    a model's non-finite log-prob) still arrive as floats; a body that is not JSON is a
    MalformedAnswerError naming the bytes."""
    import json
    import math

    from distill.call_errors import MalformedAnswerError

    strict = {"choices": [{"index": 0, "prompt_logprobs": [None, {"7": {"logprob": -0.125, "rank": 1,
                                                                         "decoded_token": "w7 é"}}]}],
              "big": 2**70, "small": -1.5e-300}
    assert _raw_answer(json.dumps(strict).encode()) == strict
    loose = _raw_answer(b'{"a": [NaN, -Infinity, Infinity, 0.5]}')
    assert math.isnan(loose["a"][0]) and loose["a"][1:] == [-math.inf, math.inf, 0.5]
    bad = _raw_answer(b'{"a": [1, 2')
    assert isinstance(bad, MalformedAnswerError) and "not JSON" in str(bad), bad
