"""Wire codecs of pseudo-gradients and states: fp32/bf16/int8/int4, and sparse top-k (docs/architecture.md)."""
