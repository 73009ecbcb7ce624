"""Integrations of fmha with other libraries (import the submodule you need)."""
