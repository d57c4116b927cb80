"""The model's settings (:class:`ModelConfig`), without torch: the configuration loads them, and
a node's settings are checked before torch is imported (p2pdiloco.cli). The model itself:
:mod:`p2pdiloco.model`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig", "MAX_SIZES", "MAX_PARAMETERS"]

MAX_SIZES = {"vocab_size": 2**20, "block_size": 2**17, "n_layer": 1024, "n_head": 1024, "n_embd": 2**16}
MAX_PARAMETERS = 10**11  # the built-in GPT's: far beyond a volunteer node, so a typo fails at once


@dataclass(frozen=True)
class ModelConfig:
    """vocab_size: tokens (256 bytes); block_size: max context length in tokens; n_layer,
    n_head, n_embd: depth, heads, width; factory: "" for the built-in :class:`p2pdiloco.model.GPT`, else
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
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name, most in MAX_SIZES.items():
            if getattr(self, name) > most:
                raise ValueError(f"{name}: must be at most {most}, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: {self.n_embd} must be divisible by n_head ({self.n_head})")
        n = self.num_parameters
        if n is not None and n > MAX_PARAMETERS:
            raise ValueError(f"this GPT would have {n:,} parameters, more than {MAX_PARAMETERS:,}")

    @property
    def num_parameters(self) -> int | None:
        """Parameters of :class:`p2pdiloco.model.GPT` with this config (None with a ``factory``): embeddings
        (vocab_size + block_size)·n_embd, per block 12·n_embd² + 4·n_embd (attention 4·n_embd²,
        MLP 8·n_embd², two LayerNorms), the final LayerNorm 2·n_embd; the head is tied."""
        if self.factory:
            return None
        e = self.n_embd
        return (self.vocab_size + self.block_size) * e + self.n_layer * (12 * e * e + 4 * e) + 2 * e

    @property
    def num_tensors(self) -> int | None:
        """Parameter tensors of :class:`p2pdiloco.model.GPT` with this config (the head is tied to ``wte``):
        wte, wpe, ln_f weight and bias, and per block ln_1 (2), c_attn, attn c_proj, ln_2 (2),
        c_fc, mlp c_proj. Fragments hold whole tensors, so this bounds their number. With a
        ``factory``, only the built module knows: None."""
        if self.factory:
            return None
        return 4 + 8 * self.n_layer
