"""One service's teachers as the reader knows them: who is in the pool, what each serves, and
whether an ejected one may come back.

The pool follows the registry's snapshots (keeping this student's rendezvous subset when
`max_teachers` is set), opens a client per teacher, learns each teacher's model metadata (from its
registry record, else by asking it), refuses teachers that serve something else, and readmits an
ejected teacher only after a readiness probe answers in time. Choosing among the usable teachers
is the router's job (`distill.router`); sending chunks is the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from discovery import TeacherSet, subset
from discovery.aio import bounded
from discovery.base import TeacherRecord
from distill.call_errors import (
    ModelChoiceError,
    TeacherCallError,
    TeacherGoneError,
    TeacherRefusedError,
    access_refused,
)
from distill.capabilities import offers_of
from distill.errors import NoTeacherError, TeacherAccessError, TeacherMismatchError
from distill.fingerprints import FingerprintPin
from distill.options import ReaderOptions
from distill.outputs import AUX_INPUTS
from distill.router import Router
from distill.teacher_client import InferenceClient, TeacherMetadata
from distill.teacher_state import TeacherState

log = logging.getLogger("distill.reader")

Connect = Callable[[str, TeacherRecord], InferenceClient]
"""Opens a client to an endpoint, of the kind its record names (protocol, path, TLS)."""

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]
"""Starts an auxiliary task owned (and cancelled on close) by the engine."""


CLIENT_CLOSE_TIMEOUT_S = 5.0
"""How long closing one teacher's channel may take (it cancels that channel's calls at once)."""


def spawn_closed(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """The `Spawn` of a closed engine's parts: it starts nothing. Put in place of the engine's own
    method at close, so that the parts no longer hold the engine (a reference cycle)."""
    coro.close()
    raise RuntimeError(f"task {name!r} started after the reader's engine closed")


class TeacherPool:
    """The teachers of one service; lives on the engine's event loop."""

    def __init__(self, service: str, options: ReaderOptions, connect: Connect, spawn: Spawn) -> None:
        self.service = service
        self.opts = options
        self.router = Router(service, options.router, options.routing, deadline_s=options.timeout)
        self._connect = connect
        self._spawn = spawn
        # Teachers that refused this student access: key -> "RPC answered CODE: server's message".
        self._refused: dict[str, str] = {}
        # Teachers out for their model: several served and none named, or the named one not served.
        self._model_out: set[str] = set()
        self._admits: list[Callable[[TeacherMetadata], str | None]] = []  # see admit()
        self.fingerprints = FingerprintPin(service, self.router, self._check_model, pinned=options.fingerprint,
                                           on_change=options.on_fingerprint_change, setting=options.setting)
        self.admit(self.fingerprints.check)

    # ---- membership -------------------------------------------------------------------------
    async def follow(self, watch: Any) -> None:
        """Apply every snapshot of `watch` until cancelled."""
        async with contextlib.aclosing(watch):
            async for snapshot in watch:
                self.apply(snapshot)

    def apply(self, snapshot: TeacherSet) -> None:
        """Make the pool match the registry's snapshot: drop leavers (their channels close once their
        in-flight chunks end), add newcomers, refresh changed metadata."""
        keys = list(snapshot)
        if self.opts.max_teachers and len(keys) > self.opts.max_teachers:
            keys = subset(self.opts.student_id, keys, self.opts.max_teachers)
        wanted = {k: snapshot[k] for k in keys}
        router = self.router
        for key in list(router.teachers):
            t = router.teachers[key]
            entry = wanted.get(key)
            if entry is None or entry.endpoint != t.endpoint or (entry.load is not None and entry.load.draining):
                router.remove(key)
                self._refused.pop(key, None)
                self._model_out.discard(key)
                self._spawn(self._close_when_idle(t), f"close-{t.endpoint}")
                log.info("teacher %s left service %r", t.endpoint, self.service)
            else:
                meta = TeacherMetadata.from_record(entry.record)
                if meta is not None and t.meta != meta:
                    router.set_metadata(t, meta)
                    self._check_model(t)  # a teacher restarted in place may serve another model now
                router.set_offers(t, offers_of(entry.record))  # what it can compute: distill.capabilities
        self.fingerprints.propose(TeacherMetadata.from_record(e.record) for e in wanted.values())
        for key, entry in wanted.items():
            if key in router.teachers or (entry.load is not None and entry.load.draining):
                continue
            meta = TeacherMetadata.from_record(entry.record)
            t = router.add(key, entry.endpoint, self._connect(entry.endpoint, entry.record), meta)
            router.set_offers(t, offers_of(entry.record))
            log.info("teacher %s joined service %r", t.endpoint, self.service)
            if meta is None:
                self._spawn(self._fetch_metadata(t), f"metadata-{t.endpoint}")
            else:
                self._check_model(t)
        self.fingerprints.review()

    async def _close_when_idle(self, t: TeacherState) -> None:
        """A departed teacher may still answer chunks it accepted (a drain); close after them."""
        give_up_at = time.monotonic() + self.opts.timeout + 1
        while t.in_flight > 0 and (remaining := give_up_at - time.monotonic()) > 0:
            await self.router.wait_change(remaining)
        await bounded(t.client.close(), CLIENT_CLOSE_TIMEOUT_S)

    async def close(self) -> None:
        """Close every member's client (the engine has cancelled their calls already), then drop the
        references that would keep the clients and their gRPC channels alive past close: the members,
        and `_spawn` and the router's `on_by_length`, the engine's own methods (reference cycles through
        the engine), and the admission checks with the fingerprint pin that calls back into this pool."""
        self._spawn = spawn_closed
        self.router.on_by_length = None  # the engine's method, like `_spawn`
        self._admits.clear()
        self.fingerprints.detach()
        for t in list(self.router.teachers.values()):
            with contextlib.suppress(Exception):  # a timeout included: the next channel still closes
                await bounded(t.client.close(), CLIENT_CLOSE_TIMEOUT_S)
        self.router.teachers.clear()  # release the channels now, not at the next garbage collection

    # ---- metadata ---------------------------------------------------------------------------
    def admit(self, check: Callable[[TeacherMetadata], str | None]) -> None:
        """From now on a teacher serves this pool only if `check(its metadata)` finds nothing wrong
        (returns None; else the reason it is refused), besides the checks given before. Applied to
        the members known already too."""
        self._admits.append(check)
        for t in list(self.router.teachers.values()):
            self._check_model(t)

    def _check_model(self, t: TeacherState) -> None:
        if t.meta is None:
            return
        if self.opts.model and t.meta.model_name != self.opts.model:
            self.router.mark_incompatible(t, f"it serves model {t.meta.model_name!r}, not {self.opts.model!r}; "
                                             f"pass {self.opts.setting('model', t.meta.model_name)} to use it")
        elif t.meta.max_batch_size < 1:
            self.router.mark_incompatible(t, "its model does not batch (max_batch_size 0)")
        else:
            missing = [n for n in self.opts.outputs or () if n not in t.meta.outputs]
            if missing:
                self.router.mark_incompatible(
                    t, f"it has no output {missing[0]!r} (outputs: {sorted(t.meta.outputs)})")
            elif (reason := next(filter(None, (check(t.meta) for check in self._admits)), None)) is not None:
                self.router.mark_incompatible(t, reason)

    async def _fetch_metadata(self, t: TeacherState) -> None:
        """Ask `t` for its model's metadata until it answers. A teacher not listening yet, or whose
        model is still loading, is asked again on the ejection back-off (`Router.not_ready`), however
        long it takes: students start beside teachers that are still loading. Only what waiting cannot
        fix keeps it out for good: access refused, no model named while it serves several (or none),
        the named model not served (NOT_FOUND), metadata this reader cannot read."""
        while not t.removed:
            try:
                meta = await t.client.fetch_metadata(self.opts.model, self.opts.model_version,
                                                     timeout=min(self.opts.timeout, 10.0))
            except TeacherRefusedError as e:
                self._refuse(t, e.rpc, str(e))
                return
            except TeacherCallError as e:
                if e.code == grpc.StatusCode.NOT_FOUND and self.opts.model:
                    self._model_out.add(t.key)
                    self.router.mark_incompatible(t, f"it does not serve model {self.opts.model!r} ({e}); pass "
                                                     f"{self.opts.setting('model', 'NAME')} naming the model it serves")
                    return
                if str(e) != t.last_error:  # the cause reaches the log once, not every retry
                    log.info("teacher %s of service %r: metadata not fetched yet (%s); retrying",
                             t.endpoint, self.service, e)
                delay = self.router.not_ready(t, str(e))
            except TeacherGoneError:
                return
            except ModelChoiceError as e:
                self._model_out.add(t.key)
                self.router.mark_incompatible(t, f"{e}; pass {self.opts.setting('model', 'NAME')} to say which one")
                return
            except ValueError as e:
                self.router.mark_incompatible(t, str(e))
                return
            else:
                t.streak = 0  # its failures so far were not ejections: its first one logs
                self.router.set_metadata(t, meta)
                self._check_model(t)
                self.fingerprints.review()
                return
            await asyncio.sleep(delay)

    async def wait_first(self) -> None:
        """Wait for one teacher's metadata and check names, so a typo fails before training starts."""
        give_up_at = time.monotonic() + self.opts.no_teacher_timeout
        while True:
            metas = [t for t in self.router.teachers.values() if t.meta is not None]
            if metas:
                break
            if self.refused_all():  # whatever the fallback: it is a setup error
                raise self.no_teacher_error()
            live = list(self.router.teachers.values())
            if live and all(t.incompatible is not None for t in live) and any(t.key in self._model_out for t in live):
                raise TeacherMismatchError(  # each reason says which setting fixes it
                    f"service {self.service!r}: no teacher can be used: {'; '.join(t.describe() for t in live[:5])}.")
            if time.monotonic() >= give_up_at:
                if self.opts.fallback == "hard_labels":
                    log.warning("no teacher for service %r yet; training on hard labels until one appears",
                                self.service)
                    return
                raise self.no_teacher_error()
            await self.router.wait_change(min(1.0, give_up_at - time.monotonic()))
        t = metas[0]
        assert t.meta is not None
        missing_in = [n for n in self.opts.inputs if n not in t.meta.inputs and n not in AUX_INPUTS]
        if missing_in:
            raise TeacherMismatchError(
                f"service {self.service!r}: teacher {t.endpoint} (model {t.meta.model_name!r}) has no input "
                f"{missing_in[0]!r}; its inputs are {sorted(t.meta.inputs)}. Fix `inputs=` (teacher input name "
                "-> batch field)."
            )
        for name in self.opts.outputs or ():
            if name not in t.meta.outputs:
                raise TeacherMismatchError(
                    f"service {self.service!r}: teacher {t.endpoint} (model {t.meta.model_name!r}) has no output "
                    f"{name!r}; its outputs are {sorted(t.meta.outputs)}. Fix `outputs=`."
                )

    def no_teacher_error(self) -> NoTeacherError:
        """The error naming every teacher of the pool and its state, and what to do."""
        if self.fingerprints.error is not None:
            return self.fingerprints.error
        if any(key in self._refused for key in self.router.teachers):
            return self._access_error()
        tried = ", ".join(t.describe() for t in self.router.teachers.values()) or "none found"
        where = f"registry {self.opts.registry}" if self.opts.registry else "the static teacher list"
        return NoTeacherError(
            f"no usable teacher for service {self.service!r} for {self.opts.no_teacher_timeout:g} s (from {where}); "
            f"teachers: {tried}. Start teacher-server processes, check the registry address and service name, "
            "or pass fallback='hard_labels' to train on labels alone meanwhile."
        )

    # ---- access refusals ---------------------------------------------------------------------
    def refused_all(self) -> bool:
        """Every teacher is out for good and at least one refused this student access. A server's
        access rules do not change by waiting, so the reader says so now rather than after
        `no_teacher_timeout`."""
        self.fingerprints.review()  # a pin on teachers that are out before answering anything moves on
        if self.fingerprints.error is not None:  # a finished rolling upgrade: waiting cannot help either
            return True
        live = list(self.router.teachers.values())
        return (bool(live) and all(t.incompatible is not None for t in live)
                and any(t.key in self._refused for t in live))

    def _refuse(self, t: TeacherState, rpc: str, error: str) -> None:
        """`t` refused this student `rpc` (`error` is "CODE: the server's message"): it stays out,
        since retrying with the same headers cannot succeed; `no_teacher_error` explains it."""
        message = error[:300]
        self._refused[t.key] = f"{rpc} answered {message}"
        self.router.mark_incompatible(t, f"it refused {rpc} to this student ({message})")

    def _access_error(self) -> TeacherAccessError:
        """Which teachers refused what, in the servers' own words, and how to get in."""
        refused = [(t, self._refused[t.key]) for t in self.router.teachers.values() if t.key in self._refused]
        others = [t.describe() for t in self.router.teachers.values() if t.key not in self._refused]
        shown = "; ".join(f"{t.endpoint}: {what}" for t, what in refused[:3])
        if len(refused) > 3:
            shown += f"; and {len(refused) - 3} more"
        wanted = sorted({m.group(1) for _, what in refused
                         for m in [re.search(r"expecting header '([^']{1,200})'", what)] if m})
        header = wanted[0] if wanted else "HEADER"
        fixes = []
        index = any(what.startswith("RepositoryIndex ") for _, what in refused)
        if index:
            fixes.append(f"pass {self.opts.setting('model', 'NAME')}, so the reader need not list the server's "
                         "models through its model-repository API (it then calls only metadata, config, "
                         "readiness and inference)")
        if self.opts.headers:
            fixes.append(f"check the headers this reader sends ({', '.join(sorted(self.opts.headers))}): the "
                         f"server did not accept them; it expects {header!r} with its access token")
        else:
            fixes.append(f"{'if the server restricts those calls too, ' if index else ''}pass "
                         f"headers={{{header!r}: TOKEN}} (--distill_header {header}=TOKEN) with the access "
                         "token the server was started with")
        return TeacherAccessError(
            f"service {self.service!r}: {len(refused)} teacher(s) refused this student: {shown}. The server "
            "restricts part of its API to clients that send an access header (a hardened Triton; PyTriton "
            f"restricts its model-repository API by default). To fix: {'; '.join(fixes)}."
            + (f" Other teachers: {', '.join(others[:5])}." if others else "")
        )

    # ---- readmission --------------------------------------------------------------------------
    def probe_if_ejected(self, t: TeacherState) -> None:
        """Start the readiness probe of an ejected teacher, once; a teacher whose last failure was a
        refusal of access (the router's `last_error` is "CODE: message") stays out instead."""
        code, _, details = t.last_error.partition(": ")
        if t.needs_probe and not t.removed and t.incompatible is None and access_refused(code, details):
            self._refuse(t, "ModelInfer", t.last_error)
            return
        if t.needs_probe and not t.probing and not t.removed:
            t.probing = True
            self._spawn(self._probe(t), f"probe-{t.endpoint}")

    async def _probe(self, t: TeacherState) -> None:
        """Readmit an ejected teacher only once a ModelReady answers within the probe deadline."""
        try:
            while t.needs_probe and not t.removed and t.meta is not None:
                delay = t.ejected_until - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if t.removed:
                    return  # it left the registry meanwhile; its channel may already be closed
                try:
                    ok = await t.client.ready(t.meta.model_name, timeout=self.router.config.probe_timeout_s)
                    detail = "" if ok else "ModelReady answered not ready"
                except TeacherRefusedError as e:
                    self._refuse(t, e.rpc, str(e))
                    return
                except TeacherCallError as e:
                    ok, detail = False, f"probe: {e}"
                except TeacherGoneError:
                    return  # the channel was closed because the teacher left
                self.router.probed(t, ok, detail)
        finally:
            t.probing = False
