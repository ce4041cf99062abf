"""A teacher's answer for texts built in process, in the text contract's layout: the saved Llama of
`tests.tokenizer_models.save_text_teacher` run on its own tokenizer's ids, log_softmax, top-k, tail,
token log-probabilities, and `byte_spans` (with the vocabulary's pieces) for the spans. The
cross-tokenizer tests align against it as they would against a teacher-server's answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from teacher_server.text_spans import NO_SPAN, byte_spans
from teacher_server.vocab_pieces import vocab_pieces


class InProcessTextTeacher:
    """A saved `hf:DIR` text teacher loaded here; `answer(texts, k)` is what it would send."""

    def __init__(self, directory: Path):
        import transformers

        self.tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
        self.model.eval()
        self.pieces = vocab_pieces(self.tokenizer)

    def log_probs(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[B, T, V]`` log_softmax of the model on `ids`."""
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask if mask is not None else torch.ones_like(ids))
        return torch.log_softmax(out.logits.float(), dim=-1)

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=ids, attention_mask=mask).logits.float()

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, spans, mask) padded on the right, spans by `byte_spans` with the tokens' pieces."""
        encs = [self.tokenizer(t, return_offsets_mapping=True, return_special_tokens_mask=True) for t in texts]
        width = max(len(e["input_ids"]) for e in encs)
        pad = self.tokenizer.pad_token_id
        ids = np.full((len(texts), width), pad, dtype=np.int64)
        spans = np.full((len(texts), width, 2), NO_SPAN, dtype=np.int32)
        mask = np.zeros((len(texts), width), dtype=np.int8)
        for r, (text, e) in enumerate(zip(texts, encs, strict=True)):
            n = len(e["input_ids"])
            ids[r, :n] = e["input_ids"]
            spans[r, :n] = byte_spans(text, e["offset_mapping"], e["special_tokens_mask"],
                                      [self.pieces[i] for i in e["input_ids"]])
            mask[r, :n] = 1
        return torch.from_numpy(ids), torch.from_numpy(spans), torch.from_numpy(mask)

    def answer(self, texts: list[str], k: int, tail: bool = True) -> dict[str, torch.Tensor]:
        """TEXT_IDS, TEXT_SPANS, TEXT_MASK, LOGITS_TOPK_VALUES/_INDICES (/_TAIL) and LOGITS_TOKEN_LOGPROBS."""
        ids, spans, mask = self.encode(texts)
        logp = self.log_probs(ids, mask.long())
        values, indices = logp.topk(k, dim=-1)
        nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        token = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        has_next = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1) != 0
        out = {"TEXT_IDS": ids, "TEXT_SPANS": spans, "TEXT_MASK": mask, "LOGITS_TOPK_VALUES": values,
               "LOGITS_TOPK_INDICES": indices, "LOGITS_TOKEN_LOGPROBS": torch.where(has_next, token, 0.0)}
        if tail:
            out["LOGITS_TOPK_TAIL"] = (-torch.expm1(torch.logsumexp(values, dim=-1))).clamp_min(0.0)
        return out
