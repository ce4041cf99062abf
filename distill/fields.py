"""The user's loader, from the reader's side: pulling its batches on a thread of their own, and
finding the teacher inputs inside whatever it yields.

A batch may be a tensor, a tuple/list, or a dict (a torch DataLoader yields all three). The
`inputs` option says which fields go to the teacher and under which teacher input name:
`["INPUT"]` sends field "INPUT" as input "INPUT"; `{"INPUT": "image"}` sends field "image";
`{"INPUT": 0}` sends position 0 of a tuple; a bare tensor batch is sent whole. Fields become
C-contiguous CPU numpy arrays without copying when they already are.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protos.kserve import DATATYPES, datatype_of

InputSpec = str | Sequence[str] | Mapping[str, str | int]

_NUMPY_TO_WIRE = {d.numpy_dtype: d.name for d in DATATYPES.values() if d.name != "BF16"}


@dataclass(frozen=True)
class FieldArray:
    """One teacher input of one batch: a contiguous array and its wire datatype."""

    array: np.ndarray
    datatype: str

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape[1:])


def normalize_inputs(inputs: InputSpec) -> dict[str, str | int]:
    """`inputs` as teacher input name -> batch field (key or position)."""
    if isinstance(inputs, str):
        return {inputs: inputs}
    if isinstance(inputs, Mapping):
        if not inputs:
            raise ValueError("inputs is empty: name at least one batch field to send to the teachers")
        for name, field in inputs.items():
            if not isinstance(name, str) or not isinstance(field, (str, int)):
                raise TypeError(f"inputs maps teacher input names to batch keys or positions; got {name!r}: {field!r}")
        return dict(inputs)
    names = list(inputs)
    if not names:
        raise ValueError("inputs is empty: name at least one batch field to send to the teachers")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"inputs {names!r}: a list names fields that are also the teacher's input names; for tuple "
            "batches map names to positions, e.g. inputs={'INPUT': 0}"
        )
    return {n: n for n in names}


def _pick(batch: Any, name: str, field: str | int, single: bool) -> Any:
    if isinstance(batch, Mapping):
        if field not in batch:
            raise TypeError(f"teacher input {name!r}: the batch has no key {field!r} (keys: {list(batch)})")
        return batch[field]
    if isinstance(batch, (tuple, list)):
        if not isinstance(field, int):
            raise TypeError(
                f"teacher input {name!r}: the batch is a {type(batch).__name__}, so its field must be a "
                f"position; use inputs={{{name!r}: 0}} (got {field!r})"
            )
        if not -len(batch) <= field < len(batch):
            raise TypeError(f"teacher input {name!r}: position {field} is outside a batch of {len(batch)} fields")
        return batch[field]
    if isinstance(batch, (torch.Tensor, np.ndarray)) and single:
        return batch
    raise TypeError(
        f"cannot take teacher input {name!r} from a batch of type {type(batch).__name__}; the loader must "
        "yield tensors, tuples or dicts of tensors"
    )


def _as_array(value: Any, name: str) -> FieldArray:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dt = datatype_of(t.dtype)
        arr = t.view(torch.int16).numpy() if t.dtype is torch.bfloat16 else t.numpy()
        return FieldArray(arr, dt.name)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        wire = _NUMPY_TO_WIRE.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if wire is None or arr.dtype.byteorder == ">":
            raise TypeError(f"teacher input {name!r}: numpy dtype {arr.dtype} has no KServe v2 datatype")
        return FieldArray(arr, wire)
    raise TypeError(
        f"teacher input {name!r} is a {type(value).__name__}; the reader sends torch tensors or numpy arrays "
        "whose first dimension is the batch"
    )


def extract_inputs(batch: Any, inputs: Mapping[str, str | int]) -> tuple[int, dict[str, FieldArray]]:
    """(batch size, teacher input name -> FieldArray), or TypeError naming the field and the problem."""
    single = len(inputs) == 1
    out: dict[str, FieldArray] = {}
    size: int | None = None
    for name, field in inputs.items():
        fa = _as_array(_pick(batch, name, field, single), name)
        if fa.array.ndim == 0:
            raise TypeError(f"teacher input {name!r} is a scalar; it needs a batch dimension first")
        n = fa.array.shape[0]
        if size is not None and n != size:
            raise TypeError(f"teacher input {name!r} has {n} rows but the other inputs have {size}")
        size = n
        out[name] = fa
    assert size is not None
    if size == 0:
        raise TypeError("the loader yielded an empty batch (0 rows); teachers cannot answer it")
    return size, out


class LoaderThread:
    """Pulls batches from the user's loader on a daemon thread, so a blocking loader never blocks the
    event loop and never keeps the interpreter from exiting."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="distill-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # delivered to the awaiting coroutine
                _deliver(loop, _set_exception, fut, e)
            else:
                _deliver(loop, _set_result, fut, result)

        self._jobs.put(run)
        return fut

    def close(self) -> None:
        self._jobs.put(None)


def _deliver(loop: asyncio.AbstractEventLoop, setter: Callable[[asyncio.Future[Any], Any], None],
             fut: asyncio.Future[Any], value: Any) -> None:
    """Hand a loader result to the loop; if the reader closed meanwhile, nobody waits for it."""
    try:
        loop.call_soon_threadsafe(setter, fut, value)
    except RuntimeError:  # the event loop is closed
        pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
