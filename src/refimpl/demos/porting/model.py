"""A GPT in nanoGPT's shape, small enough for a CPU: the model both of chapter 12's scripts train.

The same modules as nanoGPT's ``model.py`` (token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, tied input and output embeddings, dropout in three places),
with ``F.scaled_dot_product_attention`` (no mask buffer, so DDP has no buffers to broadcast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    """The model's shape; ``dropout`` is what makes every rank's RNG part of the state."""

    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.2
    bias: bool = False


class _SelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.n_head, self.dropout = c.n_head, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in self.c_attn(x).split(C, dim=2)
        )
        p = self.dropout if self.training else 0.0  # attention dropout draws too
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.resid_dropout(
            self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        )
        return out


class _Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = _SelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias),
            nn.GELU(),
            nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias),
            nn.Dropout(c.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """nanoGPT's GPT: ``model(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(c.vocab_size, c.n_embd),
                "wpe": nn.Embedding(c.block_size, c.n_embd),
                "drop": nn.Dropout(c.dropout),
                "h": nn.ModuleList([_Block(c) for _ in range(c.n_layer)]),
                "ln_f": nn.LayerNorm(c.n_embd, bias=c.bias),
            }
        )
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        # weight tying, as in nanoGPT
        self.transformer["wte"].weight = self.lm_head.weight
        # nanoGPT's init: it draws from the RNG
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * c.n_layer)
                    if name.endswith("proj.weight")
                    else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.transformer
        pos = torch.arange(idx.size(1), device=idx.device)
        x = t["drop"](t["wte"](idx) + t["wpe"](pos))
        for block in cast(nn.ModuleList, t["h"]):
            x = block(x)
        logits = self.lm_head(t["ln_f"](x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1)
        )

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices only (nanoGPT's two groups)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {
                "params": [p for p in params if p.dim() >= 2],
                "weight_decay": weight_decay,
            },
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
