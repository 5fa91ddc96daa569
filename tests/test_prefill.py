"""Long prompts: chunked prefill gives the one-piece outputs and cache, and a static cache's prefill attends only to
its filled keys (CPU, fp32, tiny random models)."""

import pytest
import torch

from kimi_k3_cache import KimiK3Cache, KimiK3LatentCacheLayer, KimiK3StaticCache
from reap_tools.tiny import random_model, tiny_config

PROMPT = torch.tensor([[7, 41, 300, 2, 99, 18, 5, 260, 33, 12, 71],
                       [511, 511, 511, 14, 9, 77, 120, 3, 48, 6, 250]])  # row 1 left-padded
MASK = (PROMPT != 511).long()


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(packed=True), seed=4).eval()


def prefill(model, chunk, static):
    """Logits of the whole prompt and 6 greedy tokens after it, with prompts cut into `chunk`-token pieces."""
    model.language_model.model.prefill_chunk_size = chunk
    try:
        cache = (KimiK3StaticCache(model.config, 2, 24, cuda_graph=False) if static
                 else KimiK3Cache(model.config.text_config))
        with torch.no_grad():
            logits = model(PROMPT, attention_mask=MASK, cache=cache, use_cache=True).logits
            tokens = model.generate(PROMPT, attention_mask=MASK, max_new_tokens=6, do_sample=False,
                                    pad_token_id=511, eos_token_id=None)
        return logits, tokens, cache
    finally:
        model.language_model.model.prefill_chunk_size = type(model.language_model.model).prefill_chunk_size


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunk", [4, 5])
def test_chunked_prefill_gives_the_one_piece_outputs_and_cache(model, chunk, static):
    whole_logits, whole_tokens, whole_cache = prefill(model, None, static)
    logits, tokens, cache = prefill(model, chunk, static)
    torch.testing.assert_close(logits, whole_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, whole_tokens)
    assert cache.get_seq_length() == whole_cache.get_seq_length() == PROMPT.shape[1]
    for got, want in zip(cache.layers, whole_cache.layers):
        assert len(got.tensors()) == len(want.tensors())
        for a, b in zip(got.tensors(), want.tensors()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunks_are_what_the_layers_see(model):
    """A prompt of 11 tokens in chunks of 4 reaches every layer as 4 + 4 + 3 tokens."""
    seen = []
    hook = model.language_model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(args[1].shape[1]))  # args: (bank, partial, ...)
    try:
        prefill(model, 4, static=False)
    finally:
        hook.remove()
    assert seen[:3] == [4, 4, 3] and set(seen[3:]) <= {1, 4, 3}


def test_a_static_cache_prefill_expands_only_the_filled_keys(model, monkeypatch):
    """With a 40-token static cache, a 22-token prompt's MLA layers (more queries than the absorbed path takes)
    expand 22 keys' latents, not 40."""
    prompt = torch.cat([PROMPT, PROMPT[:, -11:]], dim=1)
    expanded = []
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "kv_b_proj"):
            monkeypatch.setattr(attn.kv_b_proj, "forward",
                                lambda c, _f=attn.kv_b_proj.forward: expanded.append(c.shape[1]) or _f(c))
    model.language_model.model.prefill_chunk_size = None
    try:
        with torch.no_grad():
            model(prompt, attention_mask=(prompt != 511).long(), use_cache=True,
                  cache=KimiK3StaticCache(model.config, 2, 40, cuda_graph=False))
    finally:
        model.language_model.model.prefill_chunk_size = type(model.language_model.model).prefill_chunk_size
    assert expanded and set(expanded) == {prompt.shape[1]}


def test_a_growing_cache_writes_decode_steps_into_room_it_keeps():
    """An MLA layer's growing cache returns what concatenation would, keeps a prompt as given, copies its keys only
    when its room runs out (a quarter more than needed, at least 64 tokens), and starts anew after a reorder."""
    layer, prompt = KimiK3LatentCacheLayer(), torch.randn(2, 10, 8)
    assert layer.update(prompt, None) is prompt
    added, buffers = [], []
    for _ in range(300):
        added.append(torch.randn(2, 1 + len(added) % 3, 8))
        keys = layer.update(added[-1], None)
        buffers.append(layer._buffer)  # kept alive, so distinct buffers are distinct objects
        assert torch.equal(keys, torch.cat([prompt] + added, 1))
        assert keys.data_ptr() == layer._buffer.data_ptr() and layer.tensors()[0] is keys
    # 8 buffers for the 600 tokens after the prompt's (growing by 64 tokens, then by a quarter), the last a quarter
    # longer than it needs at most
    assert len({id(b) for b in buffers}) == 8 and 610 <= buffers[-1].shape[1] <= 610 * 5 // 4 + 64
    layer.reorder_cache(torch.tensor([1, 0]))
    step = torch.randn(2, 1, 8)
    assert torch.equal(layer.update(step, None), torch.cat([torch.cat([prompt] + added, 1)[[1, 0]], step], 1))
    layer.reset()
    assert not layer.tensors() and layer.update(prompt, None) is prompt
