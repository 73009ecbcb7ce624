"""The Hopper (sm90) Gluon kernels: warp-specialised forward and backward, the fp8 forward's
V^T scratch, and the float8 KV-cache decode. Loaded only on CUDA."""
