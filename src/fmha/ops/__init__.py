"""The attention ops beneath the public API: argument preparation, the custom ops and their
autograd, call plans, and the ring-attention building blocks. Above `fmha.dispatch` and
`fmha.kernels`; imported by the public modules only."""
