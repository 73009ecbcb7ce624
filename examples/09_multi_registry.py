"""Example 09: several registries and dispatchers side by side; profiles; merging.

    python examples/09_multi_registry.py

Profiles (CK's "receipts") are named subsets of the registry: flash_fwd (forward only),
flash_bwd, pytorch (what autograd training needs), inference (forward + KV cache), fp32.
Each registry can sit behind its own Dispatcher. A forward-only registry cannot serve a
backward (NoKernelError says why); merging it with flash_bwd can. Every run is checked.
"""

import torch

import fmha

from _common import done, grads_checked, header, qkv, run_checked, sizes

header("Example 09: multiple registries")
base = fmha.default_registry()
for name in ("flash_fwd", "flash_bwd", "pytorch", "inference", "fp32"):
    r = base.profile(name)
    print(f"  profile {name:<10} {len(r):>3} configs  {r.statistics()['by_family']}")

fwd_only = base.profile("flash_fwd")
training = fwd_only.merged(base.profile("flash_bwd"), name="fwd+bwd")
gen = torch.Generator().manual_seed(9)
q, k, v = qkv(*sizes((1, 2, 2, 40, 40, 32), (2, 16, 16, 2048, 2048, 128)), gen=gen)

fmha.set_dispatcher(fmha.Dispatcher(fwd_only))
try:
    run_checked("forward through flash_fwd", q, k, v, causal=True)
    try:
        fmha.attention(q.requires_grad_(), k, v, causal=True).sum().backward()
    except fmha.NoKernelError as e:
        print(f"  backward through flash_fwd refused, as expected: {str(e).splitlines()[0]}")
    else:
        raise AssertionError("a forward-only registry ran a backward")
    q = q.detach()
    fmha.set_dispatcher(fmha.Dispatcher(training))
    print(f"  merged registry {training.name!r}: {len(training)} configs")
    grads_checked("forward + backward through the merged registry", q, k, v, causal=True)
finally:
    fmha.set_dispatcher(None)

# Two dispatchers, each asked directly (no global state): which config each would use.
problem = fmha.problem_of(q, k, v, causal=True)
for label, reg in (("inference", base.profile("inference")), ("pytorch", base.profile("pytorch"))):
    config, why = fmha.Dispatcher(reg).select(problem)
    print(f"  {label:<9} dispatcher -> {config.name} ({why})")
done()
