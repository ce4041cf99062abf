"""Calls in flight at each teacher, and what happens when one is late.

A late call gets its teacher a readiness probe. An answer (ready or not) means the call is slow,
not lost, and its deadline stands; no answer in time, and no other call answered meanwhile (a busy
engine may serve its health route behind its queue), means the teacher hung: it is marked so, its
calls are given up (the engine re-sends their chunks at once, not at their deadlines), and it is
probed until it answers again. Hedging, racing a late chunk on a second teacher, has its own timer
in the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from distill.pool import TeacherPool, spawn_closed
from distill.teacher_client import TeacherCallError, TeacherGoneError
from distill.teacher_state import TeacherState

SpawnAux = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class CallWatch:
    """Owned by the engine, on its event loop; `closed` stops it acting once the engine closes."""

    def __init__(self, spawn_aux: SpawnAux) -> None:
        self._spawn_aux = spawn_aux
        self._calls: dict[TeacherState, set[asyncio.Task[None]]] = {}  # in-flight calls per teacher
        self._abandoned: set[asyncio.Task[None]] = set()  # calls given up on because their teacher hung
        self.hung_ejections = 0
        self.closed = False

    def track(self, t: TeacherState, task: asyncio.Task[None]) -> None:
        """`task` is a call in flight at `t`; `untrack` it when it ends (the dispatcher's done-callback)."""
        self._calls.setdefault(t, set()).add(task)

    def untrack(self, t: TeacherState, task: asyncio.Task[None]) -> None:
        calls = self._calls.get(t)
        if calls is not None:
            calls.discard(task)
            if not calls and t.removed:
                del self._calls[t]

    def was_abandoned(self, task: asyncio.Task[None]) -> bool:
        """Whether `task` was cancelled because its teacher hung (its chunk is to be re-sent now)."""
        if task in self._abandoned:
            self._abandoned.discard(task)
            return True
        return False

    def late(self, pool: TeacherPool, t: TeacherState, task: asyncio.Task[None]) -> None:
        """`task` at `t` is late: check that `t` still answers at all."""
        if task.done() or self.closed:
            return
        if t.needs_probe:  # already found hung (or failing): do not wait for the deadline
            self.abandon(t)
        elif not t.checking and not t.removed and t.meta is not None:
            t.checking = True
            self._spawn_aux(self._check_alive(pool, t), f"alive-{t.endpoint}")

    async def _check_alive(self, pool: TeacherPool, t: TeacherState) -> None:
        """A readiness probe of a teacher holding a late chunk: no answer in time means it hung."""
        assert t.meta is not None
        started = time.monotonic()
        try:
            try:
                await t.client.ready(t.meta.model_name, timeout=pool.router.config.probe_timeout_s)
                return  # it answers (ready or not): the chunk is slow, not lost; its deadline stands
            except TeacherCallError as e:
                detail = f"the readiness probe failed ({e})"
            except TeacherGoneError:
                return
            if not self._calls.get(t) or t.removed:
                return  # its calls ended meanwhile: nothing is waiting on it
            if t.last_result >= started:
                return  # it answered a call while the probe waited: busy (an engine's queue), not hung
            self.hung_ejections += 1
            pool.router.hung(t, detail)
            self.abandon(t)
            pool.probe_if_ejected(t)
        finally:
            t.checking = False

    def close(self) -> None:
        """Stop acting and drop the call map, after the engine cancelled the calls. The map keys are
        teacher states, which hold the clients and their gRPC channels; and `_spawn_aux` is the
        engine's own method, a reference cycle: cleared here, both go the moment the engine does,
        not at some later garbage collection."""
        self.closed = True
        self._calls.clear()
        self._abandoned.clear()
        self._spawn_aux = spawn_closed

    def abandon(self, t: TeacherState) -> None:
        """Give up the calls in flight at a hung teacher: their chunks are re-sent now."""
        for task in list(self._calls.get(t, ())):
            if not task.done():
                self._abandoned.add(task)
                task.cancel()
