"""Benchmarks against cuDNN, SDPA's FlashAttention-2 and FlexAttention: the standard suite
(`suite`) and the decode rows (`decode`). `fmha bench` drives them."""
