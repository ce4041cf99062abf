"""Per-sample routing: which teacher service answers each row of a batch (``route_by``).

One student may learn from several expert teachers, each a service of its own (``teachers={"math":
..., "code": ...}``, or ``registry=`` with ``service=[...]``). With ``route_by="teacher"`` each row
names its teacher in the batch field ``teacher``: a service name, or a key of ``route_map`` (an int
label, an alias) that maps to one. A row whose key is missing (None, "") or unknown goes to
``default_teacher`` when one is set; otherwise the batch is refused with `RouteKeyError` naming the
key and the known teachers. The route field itself is never sent to a teacher.

`RouteTable.plan` runs where the batch's inputs are taken (the loader thread, or the thread that
calls ``submit``), never on the event loop: it finds each row's teacher with numpy (one vectorised
comparison per known key, a lookup per other distinct key, none per row), sorts the rows by teacher
and gathers each teacher's rows of every input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from distill.errors import RouteKeyError
from distill.types import FieldArray

__all__ = ["RouteGroup", "RoutePlan", "RouteTable", "Routed", "check_route_options"]

_NONE = np.array([None], dtype=object)
_MASK = "ATTENTION_MASK"  # with this input a row's tokens are its mask's sum, else its padded width


def check_route_options(route_by: Any, route_map: Mapping[Any, str], default: str | None,
                        services: tuple[str, ...]) -> None:
    """The rules between ``route_by``, ``route_map``, ``default_teacher`` and the services, raised as
    ValueError naming what to fix."""
    if route_by is None:
        if route_map or default is not None:
            raise ValueError("route_map= and default_teacher= apply with route_by=: name the batch field that "
                             "holds each row's teacher, e.g. route_by='teacher'")
        return
    if not isinstance(route_by, (str, int)) or isinstance(route_by, bool):
        raise TypeError(f"route_by must be a batch field name or a tuple position, got {route_by!r}")
    if len(services) < 2:
        raise ValueError(f"route_by= sends each row to its own teacher service, but this reader has {len(services)} "
                         f"({list(services)}): give several, teachers={{'math': 'host:port', 'code': 'host:port'}} "
                         "or service=['math', 'code'] with registry=")
    for key, service in route_map.items():
        if service not in services:
            raise ValueError(f"route_map maps {key!r} to {service!r}, which is not one of this reader's services "
                             f"{list(services)}")
    if default is not None and default not in services:
        raise ValueError(f"default_teacher={default!r} is not one of this reader's services {list(services)}")


class Routed(Protocol):
    """A batch whose rows go to several services, as a batch's jobs (`distill.batches.Job`) know it
    (`distill.routing_rows.RoutedBatch`): the batch's own job, and each part's completion."""

    batch: Any  # the batch's own job; each part is one service's rows of it

    def part_done(self, part: Any, delivery: Any) -> None: ...

    def merge(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class RouteGroup:
    """One service's rows of a batch: their positions (ascending) among the rows sent, their inputs,
    and their tokens (the attention mask's sum, else rows times the token ids' padded width, else rows)."""

    service: str
    rows: np.ndarray
    fields: dict[str, FieldArray]
    tokens: int

    @property
    def size(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class RoutePlan:
    """A batch's rows by service (services with no row left out), in the reader's service order."""

    groups: tuple[RouteGroup, ...]


def _keys_of(batch: Any, route_by: str | int, size: int) -> np.ndarray | None:
    """The batch's route keys as a 1-D array, or None when the batch has no such field."""
    if isinstance(batch, Mapping):
        if route_by not in batch:
            return None
        value = batch[route_by]
    elif isinstance(batch, (tuple, list)) and isinstance(route_by, int):
        if not -len(batch) <= route_by < len(batch):
            return None
        value = batch[route_by]
    else:
        raise TypeError(f"route_by={route_by!r} names a field of a dict batch (or a position of a tuple); the loader "
                        f"yielded a {type(batch).__name__}")
    if hasattr(value, "detach"):  # a torch tensor (torch is not imported here: the flags need none)
        keys = value.detach().cpu().numpy().reshape(-1)
    elif isinstance(value, (str, bytes)):
        keys = np.full(size, value, dtype=object)
    else:
        keys = np.asarray(value if isinstance(value, np.ndarray) else list(value), dtype=None).reshape(-1)
    if len(keys) != size:
        raise TypeError(f"route_by field {route_by!r} holds {len(keys)} keys for a batch of {size} rows: it needs one "
                        "teacher key per row")
    if keys.dtype == object:  # None (missing) sorts with nothing: made "" like an empty key
        keys = np.where(np.equal(keys, _NONE), "", keys).astype(str)
    return keys


def _tokens(fields: Mapping[str, FieldArray], size: int) -> np.ndarray | int:
    """Tokens per row: the attention mask's sum (an array), else the same for every row: the padded
    width of the first integer (token id) input of two or more dimensions, else 1 (a row of
    features is one sample)."""
    mask = fields.get(_MASK)
    if mask is not None and mask.array.ndim >= 2:
        return mask.array.reshape(size, -1).astype(bool).sum(axis=1)
    widths = [f.array.shape[1] for f in fields.values() if f.array.ndim >= 2 and f.array.dtype.kind in "iu"]
    return int(widths[0]) if widths else 1


class RouteTable:
    """How a reader's route keys map to its services; thread-safe (it holds no state)."""

    def __init__(self, route_by: str | int, services: tuple[str, ...], route_map: Mapping[Any, str],
                 default: str | None) -> None:
        self.route_by = route_by
        self.services = services
        self._index = {s: i for i, s in enumerate(services)}
        self._map = {**{s: s for s in services}, **route_map}
        self._default = default
        # The keys compared with a batch's keys in one vectorised pass per key, by the kind of array
        # they match exactly (str keys against unicode, bytes against bytes, ints, not bools, against
        # ints); a row none of them names (an int written as a string, a missing key, one left to the
        # default) takes `_service_of`, once per distinct key.
        self._fast: dict[str, tuple[tuple[Any, int], ...]] = {
            kind: tuple((k, self._index[s]) for k, s in self._map.items() if type(k) is exact)
            for kind, exact in (("U", str), ("S", bytes), ("i", int), ("u", int))}

    def _service_of(self, key: Any) -> int:
        """The service index of one distinct key; -1 when it names none and there is no default."""
        key = key.item() if isinstance(key, np.generic) else key
        found = self._map.get(key)
        if found is None and isinstance(key, str) and key.lstrip("-").isdigit():
            found = self._map.get(int(key))  # ints and strings mixed in one list become strings
        if found is None:
            found = self._default
        return -1 if found is None else self._index[found]

    def _refuse(self, key: Any) -> RouteKeyError:
        key = key.item() if isinstance(key, np.generic) else key
        missing = key in ("", None)
        what = "rows with no teacher key" if missing else f"rows with teacher key {key!r}"
        known = tuple(self.services)
        aliases = [k for k in self._map if k not in self._index]
        return RouteKeyError(
            f"this batch has {what} in field {self.route_by!r}, which names none of the teachers {list(known)}"
            + (f" nor a key of route_map {aliases}" if aliases else "")
            + ": fix the batch's keys, add the key to route_map=, or pass default_teacher= (--distill_default_teacher) "
            "to send such rows to one teacher. Only this batch is lost.", key=None if missing else key, known=known)

    def which(self, batch: Any, size: int) -> np.ndarray:
        """Each row's service, as an index into `services`; RouteKeyError for a row that names none."""
        keys = _keys_of(batch, self.route_by, size)
        if keys is None:  # no route field at all: every row is missing its key
            if self._default is None:
                raise self._refuse("")
            return np.full(size, self._index[self._default], dtype=np.int64)
        which = np.full(size, -1, dtype=np.int64)
        for key, index in self._fast.get(keys.dtype.kind, ()):
            which[keys == key] = index
        unknown = which < 0
        if not unknown.any():
            return which
        distinct, inverse = np.unique(keys[unknown], return_inverse=True)  # the rest, one lookup per key
        per_key = np.array([self._service_of(k) for k in distinct], dtype=np.int64)
        if (per_key < 0).any():
            raise self._refuse(distinct[int(np.flatnonzero(per_key < 0)[0])])
        which[unknown] = per_key[inverse.reshape(-1)]
        return which

    def store_keys(self, keys: Any, which: np.ndarray) -> Any:
        """A batch's store keys (as the store reads them) prefixed with each row's service,
        "SERVICE:KEY": each stored row records its teacher, so a row routed to another teacher later
        is asked of that teacher, not served another's answer."""
        names = np.array([f"{s}:" for s in self.services])[which]
        if isinstance(keys, np.ndarray) and keys.dtype.kind in "iuU":
            combined: list[Any] = np.char.add(names, keys.astype(str)).tolist()
            return combined
        prefixes = [n.encode() for n in names.tolist()]  # bytes keys (content hashes) stay bytes
        return [p + (k if isinstance(k, bytes) else str(k).encode()) for p, k in zip(prefixes, keys, strict=True)]

    def plan(self, which: np.ndarray, fields: Mapping[str, FieldArray]) -> RoutePlan:
        """The rows of `fields` by service, `which` naming each row's (see `which`)."""
        n = len(which)
        tokens = _tokens(fields, n)
        order = np.argsort(which, kind="stable")
        counts = np.bincount(which, minlength=len(self.services))
        groups: list[RouteGroup] = []
        at = 0
        for i, count in enumerate(counts.tolist()):
            if not count:
                continue
            rows = order[at:at + count]
            at += count
            if count == n:  # every row to one teacher: its inputs as they are
                picked = dict(fields)
            else:
                picked = {name: FieldArray(np.take(f.array, rows, axis=0), f.datatype) for name, f in fields.items()}
            counted = tokens * count if isinstance(tokens, int) else int(tokens[rows].sum())
            groups.append(RouteGroup(self.services[i], rows, picked, counted))
        return RoutePlan(tuple(groups))
