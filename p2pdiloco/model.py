"""A small nanoGPT-style decoder-only transformer over bytes (vocab 256).

Pre-LayerNorm blocks, causal ``F.scaled_dot_product_attention``, GELU MLP (4x), learned
position embeddings, LM head tied to the token embedding (after Karpathy's nanoGPT / GPT-2).
Linear layers have no bias (nanoGPT's ``bias=False``): the attention key bias is invariant
under softmax, so its gradient is pure rounding noise, which Adam would amplify into drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ModelConfig", "GPT", "build_model"]

MAX_SIZES = {"vocab_size": 2**20, "block_size": 2**17, "n_layer": 1024, "n_head": 1024, "n_embd": 2**16}
MAX_PARAMETERS = 10**11  # the built-in GPT's: far beyond a volunteer node, so a typo fails at once


@dataclass(frozen=True)
class ModelConfig:
    """vocab_size: tokens (256 bytes); block_size: max context length in tokens; n_layer,
    n_head, n_embd: depth, heads, width; factory: "" for the built-in :class:`GPT`, else
    ``"package.module:function"``, called as ``function(cfg) -> torch.nn.Module`` with this
    whole config (p2pdiloco.factory; the sizes above are passed on for it to follow).
    Raises ValueError unless all sizes are >= 1 and within ``MAX_SIZES``, n_embd % n_head == 0
    and, for the built-in GPT, its parameter count is at most ``MAX_PARAMETERS``."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    factory: str = ""

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"all model dimensions must be >= 1: {self}")
        for name, most in MAX_SIZES.items():
            if getattr(self, name) > most:
                raise ValueError(f"{name} must be at most {most}, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        n = self.num_parameters
        if n is not None and n > MAX_PARAMETERS:
            raise ValueError(f"this GPT would have {n:,} parameters, more than {MAX_PARAMETERS:,}")

    @property
    def num_parameters(self) -> int | None:
        """Parameters of :class:`GPT` with this config (None with a ``factory``): embeddings
        (vocab_size + block_size)·n_embd, per block 12·n_embd² + 4·n_embd (attention 4·n_embd²,
        MLP 8·n_embd², two LayerNorms), the final LayerNorm 2·n_embd; the head is tied."""
        if self.factory:
            return None
        e = self.n_embd
        return (self.vocab_size + self.block_size) * e + self.n_layer * (12 * e * e + 4 * e) + 2 * e

    @property
    def num_tensors(self) -> int | None:
        """Parameter tensors of :class:`GPT` with this config (the head is tied to ``wte``):
        wte, wpe, ln_f weight and bias, and per block ln_1 (2), c_attn, attn c_proj, ln_2 (2),
        c_fc, mlp c_proj. Fragments hold whole tensors, so this bounds their number. With a
        ``factory``, only the built module knows: None."""
        if self.factory:
            return None
        return 4 + 8 * self.n_layer


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
