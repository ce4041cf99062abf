"""The bytes each vocabulary entry of a tokenizer stands for in text (its *piece*).

Two tokenizers can only be compared by what their tokens mean as text: GOLD's matched-vocabulary
divergence pairs the entries of a teacher's and a student's vocabulary whose pieces are equal, and
a tokenization whose pieces add up to its text's bytes gets exact byte spans
(`teacher_server.text_spans`). A token string is not its piece: a byte-level BPE writes bytes as
printable stand-ins (`Ġ` for a space), SentencePiece-style vocabularies write a space as `▁` and
bytes as `<0xNN>`, WordPiece marks a word's continuation with `##`.

`vocab_pieces(tokenizer)` reads the tokenizer's decoder from its own serialised form and maps every
entry accordingly. An added token (special or not: BOS, EOS, padding, chat markers) stands for its
own text, which is what its literal occurrence in an input means; where the tokenizer adds one
itself, the span rule gives it no bytes whatever its piece. A decoder it does not know leaves each
entry's string as its piece, encoded as UTF-8.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """The byte-level alphabet: the printable stand-in of each byte (GPT-2's table), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _byte_level(token: str) -> bytes | None:
    table = _byte_level_table()
    try:
        return bytes(table[c] for c in token)
    except KeyError:  # an added token outside the byte alphabet: its own text
        return token.encode("utf-8")


def _byte_fallback(token: str) -> bytes | None:
    """`<0xNN>` is the byte NN (SentencePiece's byte fallback)."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return None


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for d in decoder.get("decoders", []) for step in _decoder_steps(d)]
    return [decoder]


def _piece_function(decoder: dict[str, Any] | None) -> Callable[[str], bytes | None]:
    """How one entry's string becomes its bytes, from the tokenizer's decoder."""
    steps = _decoder_steps(decoder)
    kinds = {s.get("type") for s in steps}
    if "ByteLevel" in kinds:
        return _byte_level
    replacements: list[tuple[str, str]] = []
    for s in steps:
        if s.get("type") == "Metaspace":
            replacements.append((s.get("replacement", "▁"), " "))
        elif s.get("type") == "Replace":
            pattern = s.get("pattern", {})
            if isinstance(pattern, dict) and "String" in pattern:
                replacements.append((pattern["String"], s.get("content", "")))
        elif s.get("type") == "WordPiece":
            prefix = s.get("prefix", "##")
            replacements.append(("\0wordpiece", prefix))
    fallback = "ByteFallback" in kinds

    def piece(token: str) -> bytes | None:
        if fallback:
            byte = _byte_fallback(token)
            if byte is not None:
                return byte
        for old, new in replacements:
            if old == "\0wordpiece":  # a continuation loses its prefix; a word start gains a space
                token = token[len(new):] if token.startswith(new) else " " + token
            else:
                token = token.replace(old, new)
        return token.encode("utf-8")

    return piece


def vocab_pieces(tokenizer: Any) -> list[bytes | None]:
    """The piece of every id of `tokenizer` (a `transformers` fast tokenizer or a `tokenizers.Tokenizer`),
    indexed by id; None for ids no entry has."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    config = json.loads(backend.to_str())
    piece = _piece_function(config.get("decoder"))
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    added = {t["id"]: t["content"] for t in config.get("added_tokens", [])}
    size = max(vocab.values(), default=-1) + 1
    pieces: list[bytes | None] = [None] * size
    for token, i in vocab.items():
        pieces[i] = added[i].encode("utf-8") if i in added else piece(token)
    return pieces
