"""A teacher's fingerprint: which model it computes with, as one short string (``fp-`` and 16 hex
digits of a sha256), computed once when the model is loaded.

Two replicas of a service are the same teacher exactly when their fingerprints are equal, so a
student pins one per run (``distill.fingerprints``) and ``distill check-teachers`` names a replica
that serves other weights. The digest covers:

* the weights: for a model loaded from files (``hf:DIR``, a TorchScript or ``.pt2`` file), those
  files' bytes; for any other (a ``module:factory``, a module handed in), the state_dict's tensors'
  bytes, dtype and shape, in name order;
* the config: the files of an ``hf:DIR`` include its ``config.json`` (and ``generation_config.json``);
  a factory's spec is the class of the module it built (module and qualified name: the code its
  forward runs, so two factories building one model give one fingerprint) and its ``--model-arg``
  values;
* the tokenizer files of an ``hf:DIR`` (``tokenizer.json``, ``tokenizer_config.json``, vocabularies);
* the compute dtype (``--compute-dtype``): the same weights computed in bf16 are another teacher.

Why files where the model came from files: the loaded weights are a function of those bytes and the
compute dtype, so their digest is equivalent, and reading files costs no device-to-host copy; the
files are hashed in parallel (hashlib releases the GIL) and were just read by the load, so they are
in the page cache when memory allows. Tensors are hashed from the device in chunks of
`CHUNK_BYTES`: only one chunk is ever on the host, never a second copy of the model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from teacher_server.hf_model import PREFIX as HF_PREFIX

if TYPE_CHECKING:
    from teacher_server.config import ServerConfig
    from teacher_server.model import LoadedModel

__all__ = ["CHUNK_BYTES", "DIGITS", "PREFIX", "compute", "fingerprint", "of_files", "of_model", "of_source"]

log = logging.getLogger(__name__)

PREFIX = "fp-"
DIGITS = 16  # hex digits of the sha256 kept: 64 bits, enough to tell a service's replicas apart
CHUNK_BYTES = 64 << 20  # the most of one tensor on the host at a time while hashing
_READ_BYTES = 8 << 20
_HASH_THREADS = 8

# The files of an hf:DIR that decide what it computes: weights, configs, tokenizers.
_HF_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".tiktoken"})
_HF_NAMES = frozenset({"merges.txt", "vocab.txt"})
# Model files loaded whole (teacher_server.model): their bytes are the weights and the graph.
_MODEL_FILE_SUFFIXES = frozenset({".pt2", ".pt", ".pth", ".ts", ".torchscript", ".jit"})


def _short(h: Any) -> str:
    return PREFIX + h.hexdigest()[:DIGITS]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def of_files(files: Iterable[tuple[str, Path]], compute_dtype: str) -> str:
    """The fingerprint of the model these files load, computed in `compute_dtype`: each file's name,
    size and sha256 (read in parallel), in name order."""
    named = sorted(files)
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(named))),
                            thread_name_prefix="fingerprint") as pool:
        digests = list(pool.map(_file_digest, [p for _, p in named]))
    h = hashlib.sha256(f"files;dtype={compute_dtype}\n".encode())
    for (name, path), digest in zip(named, digests, strict=True):
        h.update(f"{name}\0{path.stat().st_size}\0{digest}\n".encode())
    return _short(h)


def of_model(module: Any, spec: Mapping[str, Any], compute_dtype: str) -> str:
    """The fingerprint of a loaded module: its state_dict's tensors (name, dtype, shape, bytes, in
    name order, copied to the host `CHUNK_BYTES` at a time), its spec (its class and a factory's
    arguments) and `compute_dtype`. A callable without a state_dict is known by its spec alone."""
    h = hashlib.sha256(f"tensors;dtype={compute_dtype}\n".encode())
    h.update(json.dumps(dict(spec), sort_keys=True, default=str).encode() + b"\n")
    state_dict = getattr(module, "state_dict", None)
    tensors: dict[str, Any] = state_dict() if callable(state_dict) else {}
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                continue
            h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\n".encode())
            if t.is_quantized:
                t = t.int_repr()
            if t.layout is not torch.strided or t.is_meta or t.numel() == 0:
                continue
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, raw.numel(), CHUNK_BYTES):
                h.update(raw[start:start + CHUNK_BYTES].cpu().numpy().data)
    return _short(h)


def _source_files(source: str) -> list[tuple[str, Path]] | None:
    """The files `source` (what --model named) loads, when it names files; None for a factory."""
    if source.startswith(HF_PREFIX):
        directory = Path(source[len(HF_PREFIX):]).expanduser()
        return [(p.name, p) for p in directory.iterdir()
                if p.is_file() and (p.suffix in _HF_SUFFIXES or p.name in _HF_NAMES)]
    path = Path(source)
    if ":" not in source and path.suffix in _MODEL_FILE_SUFFIXES and path.is_file():
        return [(path.name, path)]
    return None


def of_source(source: str, compute_dtype: str) -> str | None:
    """The fingerprint of the model `source` (what --model names) loads in `compute_dtype`, from
    its files; None when it names no files (a factory: its module is hashed instead)."""
    files = _source_files(source)
    return of_files(files, compute_dtype) if files else None


def fingerprint(model: LoadedModel, source: str, compute_dtype: str,
                model_args: Mapping[str, Any] | None = None) -> str:
    """The fingerprint of `model`, loaded from `source` (blocking: reads files or tensors)."""
    module = model.module
    code = f"{type(module).__module__}.{type(module).__qualname__}"  # what its forward runs, whichever factory built it
    return of_source(source, compute_dtype) or of_model(module, {"class": code, "args": dict(model_args or {})},
                                                        compute_dtype)


async def compute(model: LoadedModel, config: ServerConfig) -> str:
    """The served model's fingerprint, computed off the event loop, and logged once."""
    fp = await asyncio.to_thread(fingerprint, model, config.model, config.compute_dtype, config.model_args)
    log.info("model %s fingerprint %s", config.name, fp)
    return fp
