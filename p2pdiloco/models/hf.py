"""transformers' GPT-2 as a p2pdiloco model: ``model.factory = "p2pdiloco.models.hf:gpt2"``.

Needs the ``transformers`` library, which p2pdiloco does not depend on: without it, importing
this module fails, and a node configured with it refuses to start in one line (``model.factory:
cannot import 'p2pdiloco.models.hf': ModuleNotFoundError: No module named 'transformers'``).
Install it (``pip install transformers``) on every node of the run.
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel

from p2pdiloco.model import ModelConfig

__all__ = ["gpt2"]


def gpt2(cfg: ModelConfig) -> GPT2LMHeadModel:
    """``GPT2LMHeadModel(GPT2Config(...))`` sized by ``cfg``: vocab_size, n_positions =
    block_size, n_layer, n_head, n_embd; no dropout (the learner's inner steps are the only
    noise a merge has to average), head tied to the token embedding, no key/value cache. Its
    forward returns a ``CausalLMOutputWithCrossAttentions``, whose ``.logits`` [B, T,
    vocab_size] p2pdiloco.factory.FactoryModel hands on."""
    config = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, use_cache=False)
    return GPT2LMHeadModel(config)
