"""Triton kernels, one module per kernel family. Import them through `loader.family_module`."""
