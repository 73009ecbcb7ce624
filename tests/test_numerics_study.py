"""`fmha numerics` (fmha.testing.numerics_study): the fp16/bf16 study, on tiny CPU problems."""

import json

import numpy as np
import pytest

from fmha import cli, reference
from fmha.testing import numerics_study

TINY = dict(batch=1, nhead_q=4, nhead_k=2, seqlen_q=24, seqlen_k=40, hdim_q=32, causal=True, device="cpu")
TINY_FLAGS = ["--device", "cpu", "-b", "1", "--nhead-q", "2", "--seqlen-q", "16", "--seqlen-k", "24",
              "--hdim-q", "16", "--causal"]


@pytest.fixture(scope="module")
def study():
    return numerics_study.run_study(**TINY, seed=1)


def test_study_passes_on_a_small_causal_gqa_problem(study):
    assert study["ok"] is True
    assert study["problem"] == {"batch": 1, "nhead_q": 4, "nhead_k": 2, "seqlen_q": 24, "seqlen_k": 40,
                                "hdim_q": 32, "hdim_v": 32, "causal": True}
    assert set(study["dtypes"]) == {"fp16", "bf16"}
    for dtype, tol in (("fp16", 1.6e-2), ("bf16", 2.0e-2)):
        entry = study["dtypes"][dtype]
        assert entry["ok"] and entry["tolerance"] == tol
        for name in ("o", "dq", "dk", "dv"):
            check = entry["checks"][name]
            assert check["ok"] and check["mismatches"] == 0 and check["rtol"] == check["atol"] == tol
            assert check["max_abs"] > 0 and 0 < check["relative"] < tol and check["worst"] <= 1
    for name in ("o", "dq", "dk", "dv"):
        assert study["fp16_vs_bf16"][name]["max_abs"] > 0


def test_bf16_quantization_error_is_larger_than_fp16s(study):
    fp16, bf16 = study["dtypes"]["fp16"]["quantization"], study["dtypes"]["bf16"]["quantization"]
    for name in ("q", "k", "v", "do"):
        assert 0 < fp16[name]["max_abs"] < bf16[name]["max_abs"]
        assert 0 < fp16[name]["relative"] < bf16[name]["relative"]
        # round to nearest: at most half a unit in the last place of values ~N(0, 1)
        assert fp16[name]["relative"] < 2.0**-11 and bf16[name]["relative"] < 2.0**-8


def test_ck_tolerances():
    assert numerics_study.ck_tolerance("fp16", 256, 256) == 1.6e-2
    assert numerics_study.ck_tolerance("bf16", 128, 128) == 2.0e-2
    assert numerics_study.ck_tolerance("bf16", 64, 192) == 3.2e-2
    with pytest.raises(ValueError, match="fp32"):
        numerics_study.ck_tolerance("fp32", 64, 64)


def test_checker_is_cks_allclose_and_fails_a_corrupted_gradient():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 3, 8, 16))
    tol = 2.0e-2
    close = ref + 0.5 * tol * (1 + np.abs(ref)) * rng.choice([-1, 1], ref.shape)
    assert numerics_study.check_allclose("dq", "bf16", close, ref, tol).ok
    corrupted = close.copy()
    corrupted[1, 2, 3, 4] = ref[1, 2, 3, 4] + 1.1 * tol * (1 + abs(ref[1, 2, 3, 4]))
    check = numerics_study.check_allclose("dq", "bf16", corrupted, ref, tol)
    assert not check.ok and check.mismatches == 1 and check.worst > 1
    assert check.relative == reference.relative_error(corrupted, ref)
    nan = close.copy()
    nan[0, 0, 0, 0] = np.nan
    assert not numerics_study.check_allclose("dq", "bf16", nan, ref, tol).ok


def test_cli_json_parses_and_a_corrupted_reference_gradient_fails(capsys, monkeypatch):
    code = cli.main(["numerics", *TINY_FLAGS, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] is True and data["device"] == "cpu"
    assert "atol + rtol * |ref|" in data["check"]

    original = reference.attention_bwd

    def corrupted(*args, **kwargs):
        grads = original(*args, **kwargs)
        grads["dk"] = grads["dk"] + 0.1  # more than atol everywhere near zero
        return grads

    monkeypatch.setattr(reference, "attention_bwd", corrupted)
    code = cli.main(["numerics", *TINY_FLAGS])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "FAIL" in out and "(a) input quantization" in out and "fp16 vs bf16" in out
    assert "|x - ref| <= atol + rtol * |ref|" in out


def test_bad_problems_are_refused(capsys):
    with pytest.raises(ValueError, match="nhead_q=3 is not a multiple of nhead_k=2"):
        numerics_study.run_study(batch=1, nhead_q=3, nhead_k=2, seqlen_q=8, hdim_q=16, device="cpu")
    assert cli.main(["numerics", "--device", "cpu", "--nhead-q", "3", "--nhead-k", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err
