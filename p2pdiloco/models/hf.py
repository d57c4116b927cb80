"""transformers models as p2pdiloco models: ``model.factory = "p2pdiloco.models.hf:gpt2"`` (GPT-2)
or ``"p2pdiloco.models.hf:llama"`` (a Llama-style decoder: RMSNorm, rotary positions, SwiGLU).

Both are built from a config sized by the run's ``[model]`` settings with random weights (no
download from the Hugging Face hub); :func:`p2pdiloco.factory.build_factory_model` redraws them
from the run's seed, so every node starts from identical bits (invariant I8). ``p2pdiloco model
export`` writes such a model in Hugging Face's layout as well (``hf/``: config.json and
model.safetensors, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads).

Needs the ``transformers`` library, which p2pdiloco does not depend on: without it, importing
this module fails, and a node configured with it refuses to start in one line (``model.factory:
cannot import 'p2pdiloco.models.hf': ModuleNotFoundError: No module named 'transformers'``).
Install it (``pip install transformers``) on every node of the run.
"""

from __future__ import annotations

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from p2pdiloco.model import ModelConfig

__all__ = ["gpt2", "llama"]


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


def llama(cfg: ModelConfig) -> LlamaForCausalLM:
    """``LlamaForCausalLM(LlamaConfig(...))`` sized by ``cfg`` (arXiv 2302.13971): vocab_size,
    hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = num_key_value_heads
    = n_head, max_position_embeddings = block_size, intermediate_size = 8/3 x n_embd rounded up
    to a multiple of 8 (the paper's SwiGLU width); no dropout, no attention or MLP biases, head
    not tied to the embedding (as Llama), no key/value cache. Its forward returns a
    ``CausalLMOutputWithPast``, whose ``.logits`` [B, T, vocab_size] (fp32)
    p2pdiloco.factory.FactoryModel hands on."""
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=-(-8 * cfg.n_embd // 24) * 8,
                         num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                         num_key_value_heads=cfg.n_head, max_position_embeddings=cfg.block_size,
                         attention_dropout=0.0, attention_bias=False, mlp_bias=False,
                         tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)
