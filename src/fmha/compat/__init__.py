"""Drop-in signatures of other attention libraries, backed by fmha's kernels."""
