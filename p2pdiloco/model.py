"""A small nanoGPT-style decoder-only transformer over bytes (vocab 256).

Pre-LayerNorm blocks, causal ``F.scaled_dot_product_attention``, GELU MLP (4x), learned
position embeddings, LM head tied to the token embedding (after Karpathy's nanoGPT / GPT-2).
Linear layers have no bias (nanoGPT's ``bias=False``): the attention key bias is invariant
under softmax, so its gradient is pure rounding noise, which Adam would amplify into drift.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from p2pdiloco.model_config import ModelConfig

__all__ = ["ModelConfig", "GPT", "build_model"]

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hd]
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx)``: idx int64 [B, T] with T <= block_size and values in
    [0, vocab_size) -> logits fp32 [B, T, vocab_size]. Weights are drawn from the global torch
    RNG; use ``build_model`` for a seeded, reproducible model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: no separate head parameter
        for name, p in self.named_parameters():  # GPT-2 init (nanoGPT)
            std = _init_std(name, p, cfg)
            if std == 0.0:
                nn.init.zeros_(p)
            elif std is not None:
                nn.init.normal_(p, mean=0.0, std=std)

    def embedding_names(self) -> tuple[str, ...]:
        """Names of the token and position embedding parameters (the head is tied to wte)."""
        return ("wte.weight", "wpe.weight")

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.wte(idx) + self.wpe(pos)  # [B, T, C]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, V]


def _init_std(name: str, p: Tensor, cfg: ModelConfig) -> float | None:
    """GPT-2's initial standard deviation of parameter ``name`` (nanoGPT): 0 for biases, 0.02
    for matrices, scaled by 1/sqrt(2 n_layer) for residual projections; None: keep the
    module's own init (LayerNorm weights, ones)."""
    if name.endswith("bias"):
        return 0.0
    if p.dim() >= 2:
        return 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    return None


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model of ``cfg``: the factory's module when ``cfg.factory`` is set
    (:func:`p2pdiloco.factory.build_factory_model`: same start on every CPU too, and
    ValueError naming model.factory when it cannot be built), else a GPT with weights drawn
    from ``seed`` alone: identical on every node for the same seed,
    whatever its CPU (invariant I8, docs/architecture.md). The draws come from NumPy's PCG64
    generator (``standard_normal``, float64, scaled, then rounded once to fp32), not from
    torch's ``normal_``, whose vectorised kernels (avx2, avx512) give other values than its
    default one. The caller's global RNG states are left untouched."""
    if cfg.factory:
        from p2pdiloco.factory import build_factory_model  # noqa: PLC0415  (imports the factory)

        return build_factory_model(cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # in model order: the same draws everywhere
            std = _init_std(name, p, cfg)
            if std:
                p.copy_(torch.from_numpy((rng.standard_normal(tuple(p.shape)) * std).astype(np.float32)))
    return model
