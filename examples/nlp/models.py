"""The NLP teacher (a small transformer encoder) and student (a one-layer CNN over word embeddings).

The teacher attends over the whole sentence with positions, so it can tell the agent from the
patient whatever the voice; the student sees only 3-word windows, max-pooled, and has to learn
which windows matter from a small labelled set. The teacher's soft outputs say, for every
sentence, how plausible each (agent, patient) pair is, which is far more than one label says.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.nlp.data import MAX_LEN, NUM_CLASSES, PAD, VOCAB
from teacher_server.spec import ModelIO

IO = ModelIO.parse(inputs=[f"TOKENS:INT64:{MAX_LEN}"], outputs=[f"LOGITS:FP32:{NUM_CLASSES}"])
"""On the wire: 16 token ids in, 20 logits out (served whole, or as top-k)."""


class TransformerTeacher(nn.Module):
    """Token + learned position embeddings, ``layers`` pre-norm encoder layers, masked mean pooling."""

    io_spec = IO

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim, padding_idx=PAD)
        self.position = nn.Parameter(torch.zeros(1, MAX_LEN, dim))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Padding is attended to (it is one fixed embedding, harmless here) but excluded from the
        # pooled mean; no attention mask keeps the graph simple to export.
        h = self.encoder(self.embed(tokens) + self.position[:, : tokens.shape[1]])
        keep = (tokens != PAD).unsqueeze(-1).to(h.dtype)
        pooled = (self.norm(h) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        out: torch.Tensor = self.head(pooled)
        return out


class CNNStudent(nn.Module):
    """Embedding(16) → Conv1d(width 3, ``channels``) → ReLU → max over time → Linear(20)."""

    def __init__(self, dim: int = 16, channels: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim, padding_idx=PAD)
        self.conv = nn.Conv1d(dim, channels, kernel_size=3, padding=1)
        self.head = nn.Linear(channels, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(self.embed(tokens).transpose(1, 2)))
        out: torch.Tensor = self.head(h.max(dim=2).values)
        return out


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
