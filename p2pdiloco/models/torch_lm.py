"""A decoder-only language model from plain torch layers: ``model.factory =
"p2pdiloco.models.torch_lm:decoder_lm"``.

Token and learned position embeddings (N(0, 0.02²), as GPT-2), ``n_layer`` pre-LayerNorm
``nn.TransformerEncoderLayer`` blocks (``n_head`` heads, GELU MLP 4 × ``n_embd`` wide, biases,
no dropout) run with a causal mask, a final LayerNorm and an untied output layer. Parameters:
about 12·n_layer·n_embd² + (2·vocab_size + block_size)·n_embd; n_layer 8, n_embd 512 at
vocab 256 and block 128: 25.4M (sizes from :class:`p2pdiloco.model.ModelConfig`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from p2pdiloco.model import ModelConfig

__all__ = ["DecoderLM", "decoder_lm"]


class DecoderLM(nn.Module):
    """``forward(idx)``: idx int64 [B, T], T <= block_size, values in [0, vocab_size) ->
    logits fp32 [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.n_embd, cfg.n_head, dim_feedforward=4 * cfg.n_embd, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        mask = torch.triu(torch.full((cfg.block_size, cfg.block_size), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)  # [block, block]: 0 on and below the diagonal
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # [B, T, C]
        mask = self.mask[:T, :T]
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))  # [B, T, V]


def decoder_lm(cfg: ModelConfig) -> DecoderLM:
    """The factory: a :class:`DecoderLM` sized by ``cfg`` (vocab_size, block_size, n_layer,
    n_head, n_embd)."""
    return DecoderLM(cfg)
