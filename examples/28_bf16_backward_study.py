"""Example 28: the fp16 / bf16 backward numerics study (CK's bf16 backward example).

    python examples/28_bf16_backward_study.py        # also: fmha numerics [--device cuda]

For one problem in float64, each of fp16 and bf16: (a) the error of rounding the inputs;
(b) the kernels' own error, forward and backward, against fmha.reference on the rounded
inputs, judged by CK's allclose tolerance; (c) fp16 against bf16. bf16's errors are about
8x fp16's: 8 bits of mantissa instead of 11, in the inputs and in P, which the kernels
round to the input dtype before the second matmul (as FlashAttention does).
"""

from fmha.testing import numerics_study

from _common import DEVICE, done, header, sizes

header("Example 28: fp16 vs bf16 backward study")
size = sizes(dict(batch=1, nhead_q=2, seqlen_q=48, hdim_q=32), dict(batch=2, nhead_q=8, seqlen_q=1024, hdim_q=128))
for causal in (False, True):
    result = numerics_study.run_study(**size, causal=causal, device=DEVICE, seed=28)
    print(f"  causal={causal}: problem {result['problem']}")
    for dtype, entry in result["dtypes"].items():
        quant = max(v["relative"] for v in entry["quantization"].values())
        print(f"    {dtype}: tolerance {entry['tolerance']}, input rounding (relative) {quant:.1e}")
        for name, c in entry["checks"].items():
            print(f"      {name}: max |x - ref| {c['max_abs']:.2e}  {'ok' if c['ok'] else 'FAIL'}")
    ratio = {o: result["fp16_vs_bf16"][o]["max_abs"] for o in ("o", "dq", "dk", "dv")}
    print("    |fp16 - bf16| max: " + ", ".join(f"{o} {x:.1e}" for o, x in ratio.items()))
    if not result["ok"]:
        raise AssertionError(f"numerics study failed (causal={causal})")
done()
