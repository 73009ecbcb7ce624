"""The portable Triton kernels (every GPU, and CPU tensors through the interpreter): the
forward, the backward stages, dropout masks and the KV-cache family. `common` holds the
stage functions (score, mask, softmax) the kernel bodies compose."""
