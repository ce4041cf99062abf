"""Hugging Face teachers: `--model hf:DIR` serves a `transformers` model saved with
`save_pretrained` in a local directory.

Only the directory is read (`local_files_only=True`, no remote code): a teacher never reaches a
hub at run time. A causal LM and a sequence classifier are served; the teacher declares its own
tensors, so no --input/--output flags are needed:

    INPUT_IDS       INT64 [-1]       token ids, per sequence (padded with the pad token id)
    ATTENTION_MASK  INT64 [-1]       1 for real tokens, 0 for padding (the padding mask)
    LOGITS          FP32  [-1, V]    next-token logits per position (causal LM), or
                    FP32  [C]        class logits (sequence classification)

A causal LM declares INPUT_IDS padded (with `pad_token_id`, else 0: the mask hides it) and LOGITS
per position, so requests of different lengths share a batch, padded on the right, and each gets
its own positions back; with right padding and the mask, a causal model's outputs at the real
positions do not change. A sequence classifier finds its last real token through `pad_token_id`,
so it is declared padded only when its config has one; without, only equal lengths are batched.

The inputs reach `forward` by keyword and the logits are taken from the output object. With
`--compute-dtype BF16/FP16` the weights are loaded in that dtype (half the memory of fp32; the
usual way to run a large LM on a GPU); LOGITS is still declared FP32 and the output transforms
(log-softmax, top-k) compute in fp32 on the device. `transformers` is the optional `llm` extra.

INPUT_IDS declares the vocabulary (the embedding's rows) and the context (max_position_embeddings)
as its limits: a request with an id or a length beyond them is refused as invalid before it joins
a batch. A causal LM also offers its forward pass split at the output projection (`head_split`),
so that a request for top-k or scores only never has its `[B, T, V]` logits built whole
(`teacher_server.outputs`); the output transform `SCORE_IDS` / `token_logprobs` read INPUT_IDS.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from teacher_server.scoring import HeadSplit
from teacher_server.spec import ModelIO

PREFIX = "hf:"
CAUSAL_LM = "causal-lm"
SEQUENCE_CLASSIFICATION = "sequence-classification"


class HFLoadError(RuntimeError):
    """The directory does not hold a servable transformers model; the message says why."""


class HFTeacher(nn.Module):
    """A transformers model behind the positional (INPUT_IDS, ATTENTION_MASK) -> LOGITS contract of
    a teacher, with its `io_spec` declared from the model's config."""

    def __init__(self, model: nn.Module, kind: str, width: int, pad_token_id: int | None = None, *,
                 vocab_size: int | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self.width = width
        # A causal LM's real positions attend only to earlier positions, so in a right-padded batch
        # (every row real up to its length) the attention mask changes nothing they compute: the
        # instance may pass None (`teacher_server.instance.unmasked`), which spares transformers'
        # reading of the mask on the host (a device synchronisation twice a forward pass on CUDA)
        # and lets attention use its causal kernels.
        self.causal_mask_only = kind == CAUSAL_LM
        self._split_checked: bool | None = None
        if kind == CAUSAL_LM:
            pad = 0 if pad_token_id is None else pad_token_id
            inputs = [f"INPUT_IDS:INT64:-1:pad={pad}", "ATTENTION_MASK:INT64:-1:mask"]
            out = f"LOGITS:FP32:-1,{width}:per_position"
        elif pad_token_id is not None:
            inputs = [f"INPUT_IDS:INT64:-1:pad={pad_token_id}", "ATTENTION_MASK:INT64:-1:mask"]
            out = f"LOGITS:FP32:{width}"
        else:
            inputs, out = ["INPUT_IDS:INT64:-1", "ATTENTION_MASK:INT64:-1"], f"LOGITS:FP32:{width}"
        io = ModelIO.parse(inputs, [out])
        # Token ids index the embedding and positions the rotary/learned position table: both are
        # checked per request (validation.check_limits) instead of failing a whole batch on the device.
        ids = replace(io.inputs[0], max_value=vocab_size, max_length=max_positions)
        self.io_spec = ModelIO((ids, *io.inputs[1:]), io.outputs, io.attention_mask)

    def head_split(self) -> HeadSplit | None:
        """The forward pass as final hidden states and output projection (`scoring.HeadSplit`), for a
        causal LM whose logits are exactly `lm_head(decoder(...).last_hidden_state)`; checked once
        on a short sequence (a model that scales or caps its logits after the projection is served
        whole)."""
        if self.kind != CAUSAL_LM:
            return None
        if self._split_checked is None:
            self._split_checked = self._check_split()
        if not self._split_checked:
            return None
        return HeadSplit("LOGITS", self.hidden, self.head)

    def _check_split(self) -> bool:
        model: Any = self.model
        decoder = getattr(model, "get_decoder", lambda: None)()
        head = model.get_output_embeddings()
        if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
            return False
        device = next(self.model.parameters()).device
        ids = torch.arange(1, 5, device=device).unsqueeze(0) % self.width
        mask = torch.ones_like(ids)
        try:
            with torch.inference_mode():
                whole = self.forward(ids, mask).float()
                split = self.head(self.hidden(ids, mask)[0]).float()
        except (RuntimeError, TypeError, AttributeError, ValueError):
            return False
        tol = 1e-4 if next(self.model.parameters()).dtype == torch.float32 else 3e-2  # bf16/fp16 kernels round
        return whole.shape == split.shape and bool(torch.allclose(whole, split, atol=tol, rtol=tol))

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
        """The final hidden states `[B, T, H]` (after the decoder's last norm), in place of LOGITS."""
        model: Any = self.model
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return [out.last_hidden_state]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection of rows of hidden states: `[n, H]` -> `[n, V]` logits."""
        model: Any = self.model
        out: torch.Tensor = model.get_output_embeddings()(hidden)
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.kind == CAUSAL_LM:
            kwargs["use_cache"] = False  # one forward pass per batch: a KV cache would only cost memory
        logits: torch.Tensor = self.model(**kwargs).logits
        return logits


def is_hf_source(source: str) -> bool:
    return source.startswith(PREFIX)


def _kind(config: Any) -> str:
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return SEQUENCE_CLASSIFICATION
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return CAUSAL_LM
    raise HFLoadError(
        f"architectures {archs or 'none'} in config.json: teacher-server serves a causal LM (*ForCausalLM) "
        "or a sequence classifier (*ForSequenceClassification); save one of those with save_pretrained")


def load_hf_teacher(source: str, device: torch.device, dtype: torch.dtype) -> HFTeacher:
    """Load `hf:DIR` from the local directory only, in `dtype`, onto `device`, in eval mode."""
    directory = Path(source[len(PREFIX):]).expanduser()
    if not (directory / "config.json").is_file():
        raise HFLoadError(f"--model {source}: {directory} has no config.json; pass a directory written by "
                          "save_pretrained (models are never downloaded at run time)")
    try:
        import transformers
    except ImportError as e:
        raise HFLoadError(f"--model {source} needs transformers: pip install 'distill-mesh[llm]' ({e})") from e
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise HFLoadError(f"--model {source}: cannot read its config: {e}") from e
    kind = _kind(config)
    auto = (transformers.AutoModelForCausalLM if kind == CAUSAL_LM
            else transformers.AutoModelForSequenceClassification)
    try:
        model = auto.from_pretrained(str(directory), local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise HFLoadError(f"--model {source}: cannot load its weights: {e}") from e
    if kind == CAUSAL_LM:
        head = model.get_output_embeddings()
        width = int(getattr(head, "out_features", 0) or config.vocab_size)
    else:
        width = int(config.num_labels)
    pad = getattr(config, "pad_token_id", None)
    embeddings = model.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    teacher = HFTeacher(model, kind, width, None if pad is None else int(pad),
                        vocab_size=None if vocab is None else int(vocab),
                        max_positions=None if positions is None else int(positions)).to(device)
    teacher.eval()
    teacher.head_split()  # checked here, on the loading thread, not when the server builds its instances
    return teacher
