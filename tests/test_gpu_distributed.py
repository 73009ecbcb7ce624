"""Ring attention on two GPUs of one host over NCCL (`pytest -m gpu2`), bf16 at realistic sizes.

Two processes (one per GPU) run `fmha.distributed.ring_attention` forward and backward on
their slices; the gathered output, LSE and gradients are checked against single-GPU
`fmha.attention` on the full sequence with the 2x rule of fmha.testing.numerics: the truth is
single-GPU fmha on the same (bf16-rounded) inputs in fp32 (exact fp32 dots), the baseline
single-GPU fmha in bf16. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are
set in every process before init_process_group).
"""

import secrets

import pytest

from ring_testing import compare, spawn

pytestmark = pytest.mark.gpu2


def case(seqlen, *, causal=True, zigzag=True, window=(-1, -1), nhead_q=16, nhead_k=16, layout="bhsd",
         softcap=0.0, sinks=False, dlse=False, alibi=False):
    return dict(world=2, dtype="bfloat16", layout=layout, causal=causal, zigzag=zigzag, window=window, alibi=alibi,
                nhead_q=nhead_q, nhead_k=nhead_k, head_dim=128, seqlen=seqlen, batch=1, softcap=softcap,
                sinks=sinks, dlse=dlse)


CASES = {
    "causal_zigzag_32k": case(32768),
    "causal_zigzag_gqa_16_4_bshd_16k": case(16384, nhead_k=4, layout="bshd", dlse=True),
    "full_sinks_softcap_16k": case(16384, causal=False, zigzag=False, softcap=30.0, sinks=True),
    "causal_contiguous_gqa_16k": case(16384, zigzag=False, nhead_k=8),
    "sliding_window_zigzag_16k": case(16384, window=(3000, 0)),
    "causal_alibi_zigzag_gqa_8k": case(8192, nhead_k=8, alibi=True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = secrets.randbits(30)
    cases = list(CASES.values())
    gathered = spawn(2, cases, seed, str(tmp_path_factory.mktemp("ring_gpu")), backend="nccl",
                     truth_dtype="float32")
    return seed, {name: compare(c, ring, truth, single)
                  for name, c, (ring, single, truth) in zip(CASES, cases, gathered, strict=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_ring_on_two_gpus_matches_single_gpu(results, name):
    seed, comparisons = results
    print(f"seed={seed}")
    for c in comparisons[name]:
        print(c)
    bad = [str(c) for c in comparisons[name] if not c.ok]
    assert not bad, f"{name} (seed {seed}): " + "; ".join(bad)
