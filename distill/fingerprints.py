"""One teacher per run: the reader pins one fingerprint per service (`teacher_server.fingerprint`).

Replicas of a service that register different fingerprints serve different weights (a rolling
upgrade half done, a replica started from the wrong checkpoint); a student that mixed their answers
would learn from two teachers at once without knowing. So the first teacher admitted fixes the
service's fingerprint for the run (or `ReaderOptions.fingerprint`, ``--distill_fingerprint``, given
by the user), and a replica with another one is refused through the pool's admission
(`TeacherPool.admit`): logged once, never sent a chunk, counted in ``reader.stats().fingerprints``.
A teacher that states no fingerprint (a Triton, an older teacher-server) cannot be told apart and
is admitted.

When no replica with the pinned fingerprint is left while others with another one are live (a
finished rolling upgrade), `ReaderOptions.on_fingerprint_change` decides: ``"fail"`` (default)
raises `FingerprintChangedError` from the training loop, naming both fingerprints and the option;
``"switch"`` pins the new one (the most common among the live replicas), logs it, counts it, and
the replicas refused for it serve from then on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from distill.errors import NoTeacherError

if TYPE_CHECKING:
    from distill.router import Router
    from distill.teacher_state import TeacherState
    from distill.types import TeacherMetadata

__all__ = ["ANY", "FINGERPRINT_CHANGES", "FingerprintChangedError", "FingerprintPin", "fingerprint_change_choice",
           "fingerprint_value"]

log = logging.getLogger("distill.reader")

FINGERPRINT_CHANGES = ("fail", "switch")
ANY = "any"
"""`ReaderOptions.fingerprint` that pins nothing: replicas that differ on purpose all serve."""
_REFUSED = "its fingerprint "  # how a refusal for the fingerprint begins (TeacherState.incompatible)


class FingerprintChangedError(NoTeacherError):
    """No teacher with the fingerprint this reader pinned is left, while teachers with another one
    are live (a finished rolling upgrade), and ``on_fingerprint_change`` is "fail". `old` and `new`
    are the two fingerprints; pass ``on_fingerprint_change="switch"`` to go on with the new teacher,
    or ``fingerprint=NEW`` to a new run."""

    def __init__(self, message: str, *, old: str, new: str) -> None:
        super().__init__(message)
        self.old, self.new = old, new


def fingerprint_change_choice(text: str) -> str:
    if text not in FINGERPRINT_CHANGES:
        raise ValueError(f"must be one of {', '.join(FINGERPRINT_CHANGES)}, got {text!r}")
    return text


def fingerprint_value(text: str) -> str:
    """A fingerprint as teachers state it ("fp-" and hex digits; see ``distill check-teachers``), or
    `ANY` (no pin: every teacher serves whatever its fingerprint)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"must be a teacher's fingerprint such as 'fp-0123456789abcdef', or {ANY!r}, got {text!r}")
    return text.strip()


def _nothing(t: TeacherState) -> None:
    """The recheck of a closed pool's pin."""


class FingerprintPin:
    """The fingerprint one service's teachers must have for this run; lives on the engine's loop.

    `check` is the pool's admission rule; the pool calls `review` after each change of its members
    (and of a member's metadata), which decides a finished rolling upgrade. `recheck` is the pool's
    own check of a member, run again on the replicas a switch readmits."""

    def __init__(self, service: str, router: Router, recheck: Callable[[TeacherState], None], *,
                 pinned: str | None, on_change: str, setting: Callable[[str, str], str]) -> None:
        self.service = service
        self.pinned = pinned or ""
        self.given = bool(pinned)
        self.on_change = on_change
        self.switches = 0
        self.error: FingerprintChangedError | None = None
        self._router = router
        self._recheck = recheck
        self._setting = setting  # ReaderOptions.setting: the keyword and flag that fix something

    def detach(self) -> None:
        """At the pool's close: drop the pool's method this pin calls back (a reference cycle that
        would keep the pool and its channels alive until the next garbage collection)."""
        self._recheck = _nothing

    def propose(self, metas: Iterable[TeacherMetadata | None]) -> None:
        """The teachers of the first snapshot, before they are checked: with none pinned yet, pin the
        fingerprint most of them state (the first of those tied), so that one odd replica listed
        first does not become the run's teacher."""
        if self.pinned:
            return
        counts = collections.Counter(m.fingerprint for m in metas if m is not None and m.fingerprint)
        if counts:
            self.pinned = counts.most_common(1)[0][0]
            log.info("service %r: this reader uses the teachers of fingerprint %s", self.service, self.pinned)

    def check(self, meta: TeacherMetadata) -> str | None:
        """None when a teacher with `meta` may serve; else why not. The first fingerprint seen is pinned."""
        fp = meta.fingerprint
        if not fp or self.pinned in (fp, ANY):
            return None
        if not self.pinned:
            self.pinned = fp
            log.info("service %r: this reader uses the teachers of fingerprint %s", self.service, fp)
            return None
        why = "the one given" if self.given else "the first teacher's"
        return (f"{_REFUSED}{fp} is not {self.pinned}, {why}: it serves other weights, config or dtype than the "
                f"teachers this reader uses (distill check-teachers compares them; "
                f"{self._setting('fingerprint', fp)} picks that teacher instead)")

    def review(self) -> None:
        """After the members changed: with no replica of the pinned fingerprint left and replicas of
        another live, fail or switch (`on_change`). Members whose metadata is still coming may be
        the pinned teacher starting: nothing is decided while one is."""
        if not self.pinned or self.pinned == ANY or self.error is not None:
            return
        members = [t for t in self._router.teachers.values() if not t.removed]
        if self._unproven(members):
            return
        if any(t.meta is None or t.meta.fingerprint in ("", self.pinned) for t in members):
            return
        others = collections.Counter(t.meta.fingerprint for t in members if t.meta is not None)
        if not others:
            return
        new, count = others.most_common(1)[0]
        old = self.pinned
        if self.on_change == "switch":
            self.pinned = new
            self.switches += 1
            log.warning("service %r: no teacher of fingerprint %s is left; switching to %s (%d teacher(s)), as "
                        "on_fingerprint_change='switch' says", self.service, old, new, count)
            self._readmit(members)
            return
        self.error = FingerprintChangedError(
            f"service {self.service!r}: no teacher of fingerprint {old} is left, and {sum(others.values())} "
            f"teacher(s) of fingerprint {new} are live (a rolling upgrade to other weights?); this reader does not "
            f"mix teachers. Pass {self._setting('on_fingerprint_change', 'switch')} to go on with the new "
            f"teacher, or start the run again with {self._setting('fingerprint', new)}.", old=old, new=new)
        log.error("%s", self.error)
        self._router.notify()

    def _unproven(self, members: list[TeacherState]) -> bool:
        """A pin that came from the first teacher admitted, whose teachers are all out (their answers
        contradicted their metadata, they refused access) before answering anything, moves to the
        fingerprint most of the teachers it refused state: nothing was learned from it, so no
        teachers are mixed. True when it moved."""
        pinned = [t for t in members if t.meta is not None and t.meta.fingerprint == self.pinned]
        if self.given or not pinned or any(t.incompatible is None or t.ok or t.samples for t in pinned):
            return False
        refused = collections.Counter(t.meta.fingerprint for t in self.refused() if t.meta is not None)
        if not refused:
            return False
        old, self.pinned = self.pinned, refused.most_common(1)[0][0]
        log.info("service %r: the teachers of fingerprint %s are out before answering anything; this reader uses "
                 "those of fingerprint %s instead", self.service, old, self.pinned)
        self._readmit(members)
        return True

    def _readmit(self, members: list[TeacherState]) -> None:
        """Check the members refused for their fingerprint again, against the new pin."""
        for t in members:
            if t.incompatible is not None and t.incompatible.startswith(_REFUSED):
                t.incompatible = None
                assert t.meta is not None
                self._router.set_metadata(t, t.meta)  # wakes the choosers, recounts teachers by length
                self._recheck(t)

    def refused(self) -> list[TeacherState]:
        """The members refused for their fingerprint."""
        return [t for t in self._router.teachers.values()
                if not t.removed and t.incompatible is not None and t.incompatible.startswith(_REFUSED)]

    def counters(self) -> dict[str, Any]:
        """What ``reader.stats().fingerprints[service]`` shows."""
        refused = self.refused()
        return {"pinned": self.pinned, "refused": len(refused),
                "refused_endpoints": sorted(t.endpoint for t in refused), "switches": self.switches}
