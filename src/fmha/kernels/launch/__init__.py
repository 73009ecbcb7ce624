"""How kernels are loaded and launched: compiled and interpreted copies of the kernel
families (`loader`), launch argument helpers (`args`), the launch-plan caches (`cache`,
`plan_tables`) and the guard against a damaged Triton cache (`jit_cache`)."""
