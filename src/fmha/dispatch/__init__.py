"""Which kernels exist and which one serves a problem: configs (`KernelConfig` =
signature + algorithm), the `Registry` of stock configs, the `Dispatcher` that plans a call,
the tuning database, and the precompile command. Depends on `fmha.problem` and, for
building, on `fmha.kernels`; nothing here imports the public API."""
