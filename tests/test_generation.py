"""Generation with the hybrid cache: cached == uncached, padding-invariant, prefill + decode == one forward; the
static (preallocated, graph-capturable) cache gives the same tokens as the growing one."""

import pytest
import torch

from modeling_kimi_k3 import KimiK3StaticCache
from reap_tools.tiny import random_model, tiny_config


def cache_of(output):
    """The cache a forward returned, under the name the installed transformers gives it."""
    return output["cache"] if "cache" in output.keys() else output["past_key_values"]


@pytest.fixture(scope="module")
def model():
    model = random_model(tiny_config(packed=True), seed=3)
    model.generation_config.eos_token_id = None  # run every step; the tiny model emits anything
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def test_greedy_with_cache_equals_argmax_without_cache(model):
    prompt = torch.tensor([[11, 200, 37, 5, 91, 14, 3]])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=32, do_sample=False)
        ids = prompt
        for _ in range(32):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


def test_use_cache_false_generates_the_same(model):
    prompt = torch.tensor([[9, 8, 7, 6, 5]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_equals_each_prompt_alone(model):
    prompts = [[4, 8, 15, 16, 23, 42, 99, 100, 7], [300, 2, 17], [55, 66, 77, 88, 10]]
    pad = model.config.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        batch_logits = model(ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            alone = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)
            assert batched[row, width:].tolist() == alone[0, len(p):].tolist()
            alone_logits = model(torch.tensor([p])).logits[0]
            torch.testing.assert_close(batch_logits[row, width - len(p):], alone_logits, atol=1e-5, rtol=1e-4)


def test_prefill_then_decode_equals_one_forward(model):
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]])
    with torch.no_grad():
        full = model(ids).logits
        prefill = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=cache_of(prefill), use_cache=True).logits
        torch.testing.assert_close(step[:, 0], full[:, -1], atol=1e-5, rtol=1e-4)
        first = model(ids[:, :6], use_cache=True)
        rest = model(ids[:, 6:], cache=cache_of(first), use_cache=True).logits
        torch.testing.assert_close(rest, full[:, 6:], atol=1e-5, rtol=1e-4)


def test_sampling_and_beam_search(model):
    prompt = torch.tensor([[21, 22, 23, 24]])
    with torch.no_grad():
        torch.manual_seed(0)
        a = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.0, top_p=0.95)
        torch.manual_seed(0)
        b = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.0, top_p=0.95)
        assert a.shape == (1, 12) and torch.equal(a, b)
        beams = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False)
        beams_uncached = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(beams, beams_uncached)


def test_packed_experts_equal_their_dequantized_bf16_twin():
    packed = random_model(tiny_config(packed=True), seed=5)
    plain = random_model(tiny_config(packed=False), seed=5)
    from kimi_k3_loading import release_state_dict
    from mxfp4 import dequantize_mxfp4

    state = release_state_dict(packed.state_dict())  # one [out, in/2] pack per expert, as the float twin names them

    converted = {}
    for name, tensor in state.items():
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            converted[base] = dequantize_mxfp4(tensor, state[base + "_scale"], dtype=torch.float32)
        elif not name.endswith(".weight_scale"):
            converted[name] = tensor
    plain.load_state_dict(converted, strict=True)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)


def test_latent_absorbed_mla_equals_expanded_attention():
    from modeling_kimi_k3 import KimiK3MLAttention, causal_padding_mask

    config = tiny_config(packed=False).text_config
    torch.manual_seed(0)
    attention = KimiK3MLAttention(config, layer_idx=2).double()
    for p in attention.parameters():
        p.data.normal_(0, 0.2)
    batch, queries, keys = 2, 3, 11
    q = torch.randn(batch, config.num_attention_heads, queries, 12, dtype=torch.float64)
    latent = torch.randn(batch, keys, config.kv_lora_rank + config.qk_rope_head_dim, dtype=torch.float64)
    padding = torch.ones(batch, keys, dtype=torch.long)
    padding[1, :4] = 0
    positions = torch.arange(keys - queries, keys)
    mask, ops = causal_padding_mask(padding, positions, keys), attention.dispatch.ops(q.device)
    torch.testing.assert_close(attention.attend_absorbed(q, latent, padding, positions, ops),
                               attention.attend_expanded(q, latent, mask, ops), atol=1e-10, rtol=1e-10)


def test_static_cache_generates_what_the_growing_cache_does(model):
    prompts = [[4, 8, 15, 16, 23, 42, 99], [300, 2, 17]]
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (7 - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (7 - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        growing = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        cache = model.make_static_cache(batch_size=2, max_length=24)
        static = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=cache)
        full = model(growing, attention_mask=torch.cat([mask, torch.ones(2, 12, dtype=mask.dtype)], 1)).logits
    assert torch.equal(static, growing)
    assert cache.get_seq_length() == 7 + 11  # the last token is returned, not fed back
    assert cache.layers[2].latent.shape == (2, 24, model.config.text_config.kv_lora_rank +
                                            model.config.text_config.qk_rope_head_dim)
    # the step logits read back from the static buffers agree with one uncached forward over the same tokens
    cache = KimiK3StaticCache(model.config, batch_size=2, max_length=24)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step = model(growing[:, 7:8], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                     past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(step[:, 0], full[:, 7], atol=1e-5, rtol=1e-4)


def test_static_cache_reset_serves_a_new_prompt(model):
    first, second = torch.tensor([[4, 8, 15, 16, 23]]), torch.tensor([[300, 2, 17, 9, 41, 7, 7]])
    with torch.no_grad():
        cache = model.make_static_cache(batch_size=1, max_length=20)
        model.generate(first, max_new_tokens=10, do_sample=False, cache=cache)
        cache.reset()
        reused = model.generate(second, max_new_tokens=10, do_sample=False, cache=cache)
        fresh = model.generate(second, max_new_tokens=10, do_sample=False)
    assert torch.equal(reused, fresh)


def test_static_cache_beam_search_and_limits(model):
    prompt = torch.tensor([[21, 22, 23, 24]])
    with torch.no_grad():
        beams = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False)
        cache = KimiK3StaticCache(model.config, batch_size=3, max_length=10)
        static = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, cache=cache)
        assert torch.equal(static, beams)
        with pytest.raises(ValueError, match="holds 4 tokens; this call needs 5"):
            model(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=KimiK3StaticCache(model.config, 1, 4),
                  use_cache=True)
        with pytest.raises(ValueError, match="for batch 2"):
            model(prompt, past_key_values=KimiK3StaticCache(model.config, 2, 8), use_cache=True)
