"""The teacher's own tokenizer, for the front ends that take text: vLLM's `/v1/completions` text
prompts (`teacher_server.vllm_routes`) and KServe text requests (`teacher_server.text_requests`).

An `hf:DIR` teacher whose directory holds tokenizer files has one; it is loaded once, off the event
loop, from the directory only (no download), and shared by every front end of the server. A fast
tokenizer is not reentrant, so every call into it is serialised here; callers run them on a worker
thread (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from teacher_server.hf_model import PREFIX as HF_PREFIX

__all__ = ["TOKENIZER_FILES", "Tokenizer"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding any of these has a tokenizer to load (`save_pretrained` writes them)."""


class Tokenizer:
    """The teacher's tokenizer, loaded once on first use when `hf:DIR` has one; `why_not` says
    what is missing otherwise. Calls into it are serialised (a fast tokenizer is not reentrant)."""

    def __init__(self, source: str) -> None:
        self._source = source
        self._loaded = False
        self._tokenizer: Any = None
        self.why_not = ""
        self._load_lock = asyncio.Lock()
        self._use = threading.Lock()

    async def get(self) -> Any:
        """The tokenizer, or None (then `why_not` is set)."""
        if not self._loaded:
            async with self._load_lock:
                if not self._loaded:
                    self._tokenizer, self.why_not = await asyncio.to_thread(self._load)
                    self._loaded = True
        return self._tokenizer

    def _load(self) -> tuple[Any, str]:
        if not self._source.startswith(HF_PREFIX):
            return None, f"the teacher ({self._source or 'this model'}) is not an hf: directory with a tokenizer"
        directory = Path(self._source[len(HF_PREFIX):]).expanduser()
        if not any((directory / f).is_file() for f in TOKENIZER_FILES):
            return None, (f"{directory} holds no tokenizer files (put the teacher's tokenizer there: "
                          "tokenizer.save_pretrained(DIR) writes tokenizer.json and tokenizer_config.json)")
        try:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # a tokenizer that does not load only costs text prompts
            log.warning("the tokenizer in %s does not load (%s); text prompts are refused", directory, e)
            return None, f"the tokenizer in {directory} does not load: {e}"
        log.info("tokenizer of %s loaded for text prompts and decoded tokens", directory)
        return tokenizer, ""

    def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        with self._use:
            ids: list[list[int]] = self._tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[list[int]]]:
        """Each text's ids (the tokenizer's specials added), character offsets and special-token
        marks, as `teacher_server.text_spans.byte_spans` takes them. A slow tokenizer has no
        offsets: ValueError saying to save a fast one."""
        with self._use:
            if not getattr(self._tokenizer, "is_fast", False):
                raise ValueError("the teacher's tokenizer is not a fast tokenizer, which text requests need for "
                                 "the tokens' offsets; save a fast one (tokenizer.json) in the teacher's directory")
            enc = self._tokenizer(list(texts), add_special_tokens=True, return_offsets_mapping=True,
                                  return_special_tokens_mask=True)
        return enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"]

    def pad_id(self) -> int | None:
        """The tokenizer's pad id, None when it has none."""
        pad = getattr(self._tokenizer, "pad_token_id", None)
        return None if pad is None else int(pad)

    def decode(self, ids: Sequence[int]) -> Mapping[int, str]:
        with self._use:
            texts = self._tokenizer.batch_decode([[i] for i in ids])
        return dict(zip(ids, texts, strict=True))

    def continuation(self, prompt: Sequence[int], token: int) -> str:
        """The text `token` adds after `prompt`, as vLLM's incremental detokenizer writes a generated
        token (a word-level tokenizer's space between words included), special tokens skipped."""
        with self._use:
            before = self._tokenizer.decode(list(prompt), skip_special_tokens=True)
            after = self._tokenizer.decode([*prompt, token], skip_special_tokens=True)
            if after.startswith(before):
                return str(after[len(before):])
            return str(self._tokenizer.decode([token], skip_special_tokens=True))
