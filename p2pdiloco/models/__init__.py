"""Example model factories for ``model.factory`` (p2pdiloco.factory; docs/operating.md, "Your own model").

- ``p2pdiloco.models.torch_lm:decoder_lm``: a decoder-only LM from plain torch layers
  (``nn.TransformerEncoderLayer`` with a causal mask), sized by the config; no extra library.
- ``p2pdiloco.models.hf:gpt2``: transformers' ``GPT2LMHeadModel`` from a ``GPT2Config`` sized by
  the config; ``p2pdiloco.models.hf:llama``: ``LlamaForCausalLM`` from a ``LlamaConfig`` likewise;
  importable only where ``transformers`` is installed (the ``hf`` extra; not a dependency).
"""
