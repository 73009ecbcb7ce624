"""fmha as a transformers attention backend: tiny random models, fmha against SDPA/eager.

Nothing is downloaded: models are built from configs with random weights, in float32 on
the CPU (fmha's kernels run through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extras")

import fmha.integrations.transformers as fmha_hf  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def registered():
    fmha_hf.register()


def tiny(model_cls, config_cls, implementation="sdpa", **extra):
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation=implementation, dtype=torch.float32)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return tiny(LlamaForCausalLM, LlamaConfig).eval()


def logits(model, implementation, ids, mask=None):
    model.set_attn_implementation(implementation)
    return model(ids, attention_mask=mask).logits


def test_register_adds_fmha_to_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface._global_mapping["fmha"] is fmha_hf.attention_forward
    assert "fmha" in AttentionMaskInterface._global_mapping


def test_llama_logits_match_sdpa_without_a_mask(llama):
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = logits(llama, "sdpa", ids), logits(llama, "fmha", ids)
    assert llama.config._attn_implementation == "fmha"
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_llama_logits_match_sdpa_with_left_and_right_padding(llama):
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    with torch.no_grad():
        ref, ours = logits(llama, "sdpa", ids, mask), logits(llama, "fmha", ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], ref[keep], atol=2e-5, rtol=1e-4)
    # padding changes the answer: the mask really reached the kernels
    unpadded = logits(llama, "fmha", ids).detach()
    assert (unpadded[2, :7] - ours[2, :7]).abs().max() < 1e-5  # right padding: causal rows unaffected
    assert (unpadded[1, 4:] - ours[1, 4:]).abs().max() > 1e-3  # left padding: later rows lose keys


def test_llama_training_step_gradients_match_sdpa(llama):
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    llama.train()
    try:
        grads = {}
        for implementation in ("sdpa", "fmha"):
            llama.zero_grad()
            llama.set_attn_implementation(implementation)
            loss = llama(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            loss.backward()
            grads[implementation] = (loss.detach(), {n: p.grad.clone() for n, p in llama.named_parameters()})
    finally:
        llama.eval()
        llama.zero_grad()
    torch.testing.assert_close(grads["fmha"][0], grads["sdpa"][0], atol=1e-5, rtol=1e-5)
    for name, g in grads["sdpa"][1].items():
        torch.testing.assert_close(grads["fmha"][1][name], g, atol=5e-5, rtol=1e-3, msg=name)


def test_llama_greedy_generation_matches_sdpa(llama):
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    out = {}
    for implementation in ("sdpa", "fmha"):
        llama.set_attn_implementation(implementation)
        out[implementation] = llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                             pad_token_id=0)
    assert torch.equal(out["fmha"], out["sdpa"])


def test_mistral_sliding_window_matches_sdpa():
    from transformers import MistralConfig, MistralForCausalLM
    model = tiny(MistralForCausalLM, MistralConfig, sliding_window=4).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, ours = logits(model, "sdpa", ids), logits(model, "fmha", ids)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_gemma2_softcap_matches_eager():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model = tiny(Gemma2ForCausalLM, Gemma2Config, implementation="eager", head_dim=16, attn_logit_softcapping=2.0,
                 final_logit_softcapping=None, sliding_window=5, query_pre_attn_scalar=16).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref, ours = logits(model, "eager", ids), logits(model, "fmha", ids)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(sq=5, sk=5):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(1, 4, sq, 16, generator=g), torch.randn(1, 2, sk, 16, generator=g),
            torch.randn(1, 2, sk, 16, generator=g))


def test_sink_logits_s_aux_are_passed_as_sinks():
    from fmha import reference
    q, k, v = _qkv()
    sinks = torch.randn(4)
    out, weights = fmha_hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, s_aux=sinks)
    assert weights is None and out.shape == (1, 5, 4, 16)
    ref, _ = reference.attention_fwd(q.double().numpy(), k.double().numpy(), v.double().numpy(), scale=0.25,
                                     causal=True, sinks=sinks.double().numpy())
    torch.testing.assert_close(out.transpose(1, 2).double(), torch.from_numpy(ref), atol=1e-5, rtol=1e-5)


def test_masks_that_cannot_be_mapped_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention_mask has shape"):
        fmha_hf.attention_forward(_Module(), q, k, v, torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="BlockMask"):
        fmha_hf.attention_forward(_Module(), q, k, v, object())
    with pytest.raises(TypeError, match="attention_mask.dtype"):
        fmha_hf.attention_forward(_Module(), q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="head_mask"):
        fmha_hf.attention_forward(_Module(), q, k, v, None, head_mask=torch.ones(4))


def test_sliding_window_without_a_mask_matches_transformers_mask():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function
    module = _Module()
    for sq, sk, offset in ((6, 6, 0), (1, 9, 8)):  # prefill, then a decode step at position 8
        q, k, v = _qkv(sq, sk)
        mask = sdpa_mask(batch_size=1, q_length=sq, kv_length=sk, q_offset=offset,
                         mask_function=sliding_window_causal_mask_function(3), allow_is_causal_skip=False)
        with_mask, _ = fmha_hf.attention_forward(module, q, k, v, mask)
        without, _ = fmha_hf.attention_forward(module, q, k, v, None, sliding_window=3)
        torch.testing.assert_close(without, with_mask, atol=1e-6, rtol=1e-5)
    non_causal = _Module()
    non_causal.is_causal = False
    with pytest.raises(NotImplementedError, match="non-causal"):
        fmha_hf.attention_forward(non_causal, *_qkv(), None, sliding_window=3)


def test_every_attention_layer_runs_through_fmha(llama, monkeypatch):
    import fmha
    calls = []
    real = fmha.api.attention
    monkeypatch.setattr(fmha.api, "attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits(llama, "fmha", ids)
    assert len(calls) == llama.config.num_hidden_layers and all(c["causal"] for c in calls)
