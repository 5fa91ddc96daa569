"""Speculative decoding (issue 50): KDA states at chosen positions against a float64 recurrence; a cache rolled back
(`crop`) equals a fresh run to that length, growing and static; greedy prompt lookup and assisted generation equal
plain greedy token for token in fp32, on tiny KDA + MLA configs and on the demo checkpoint. tests/run.sh runs this
file under each supported transformers line (4.57 crops to an absolute length, 5.x by a negative count)."""

from pathlib import Path

import pytest
import torch

import kda
import kimi_k3_cache
from kda import chunk_kda, kda_forward, recurrent_kda
from kimi_k3_cache import KimiK3Cache, KimiK3StaticCache
from reap_tools.tiny import random_model, tiny_config

ROOT = Path(__file__).resolve().parents[1]
EOS = 510  # a reserved id the tiny models never favour (4.57's prompt lookup needs an EOS id)


def kda_inputs(length, heads=3, key_dim=16, value_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, length, heads, key_dim, generator=gen, dtype=torch.float64),
                                          dim=-1) for _ in range(2))
    v = torch.randn(1, length, heads, value_dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, length, heads, key_dim, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(1, length, heads, generator=gen, dtype=torch.float64)
    state = torch.randn(1, heads, key_dim, value_dim, generator=gen, dtype=torch.float64) * 0.1
    return (q, k, v, g, beta), state


@pytest.mark.parametrize("kernel, chunk", [(recurrent_kda, None), (chunk_kda, 16), (chunk_kda, 64)])
def test_states_at_chosen_positions_equal_the_recurrence_stopped_there(kernel, chunk):
    """Positions at 0, inside chunks, on chunk boundaries and at the end, in any order, against the step-by-step
    recurrence run to each position alone (float64)."""
    inputs, state0 = kda_inputs(37)
    positions = [37, 0, 5, 16, 17, 31, 1]
    extra = {} if chunk is None else {"chunk_size": chunk}
    o, final, states = kernel(*inputs, 0.25, initial_state=state0, states_at=positions, **extra)
    assert states.shape == (1, len(positions), 3, 16, 8)
    for i, p in enumerate(positions):
        _, expected = recurrent_kda(*(t[:, :p] for t in inputs), 0.25, initial_state=state0)
        torch.testing.assert_close(states[:, i], expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final, states[:, 0])
    with pytest.raises(ValueError, match=r"states_at: positions must lie in \[0, 37\]"):
        kernel(*inputs, 0.25, initial_state=state0, states_at=[38], **extra)


def test_split_calls_return_the_states_one_pass_computes():
    """fla's kernels return final states only; `kda_forward` splits their call at the positions asked for. The
    splitting (`kda._split_at`) run here over the reference gives the reference's single-pass results."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g_raw = (torch.randn(1, 20, 2, 8, generator=gen) for _ in range(4))
    beta_raw = torch.randn(1, 20, 2, generator=gen)
    constants = (torch.randn(2, generator=gen) * 0.3, torch.randn(16, generator=gen), -5.0, 8**-0.5)
    state0 = torch.randn(1, 2, 8, 8, generator=gen) * 0.1
    positions = [0, 7, 20, 3]
    o, final, states = kda_forward(q, k, v, g_raw, beta_raw, *constants, state0, states_at=positions)
    split = kda._split_at(q, k, v, g_raw, beta_raw, state0, positions,
                          lambda *part, initial_state, in_place: kda_forward(*part, *constants, initial_state),
                          in_place=True)
    for ours, theirs in zip(split, (o, final, states)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    model = random_model(tiny_config(packed=True), seed=3)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def layer_states(cache, length):
    """Every layer's state after `length` tokens: KDA conv histories and recurrent state, MLA latents."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_state"):
            out.extend([*layer.conv_states, layer.recurrent_state])
        else:
            out.append(layer.latent[:, :length])
    return out


def new_cache(model, kind):
    if kind == "static":
        return KimiK3StaticCache(model.config, 1, 64, cuda_graph=False)
    return KimiK3Cache(model.config)


@pytest.mark.parametrize("kind", ["growing", "static"])
def test_crop_equals_a_fresh_run_to_that_length(model, kind):
    """Prompt, then 5 draft tokens in one call and 3 more one at a time; rolled back to various lengths, every
    layer's state and the next logits equal those of a cache that only ever saw the kept tokens."""
    ids = torch.tensor([[11, 200, 37, 5, 91, 14, 3, 9, 8, 7, 6, 5, 4, 3, 2, 1, 40]])
    prompt = 6
    with torch.no_grad():
        for kept in (prompt, prompt + 1, prompt + 4, prompt + 7, prompt + 8):
            cache = new_cache(model, kind)
            cache.activate_past_recording()
            model(ids[:, :prompt], cache=cache, use_cache=True)
            model(ids[:, prompt : prompt + 5], cache=cache, use_cache=True)
            for t in range(prompt + 5, prompt + 8):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
            seen = cache.get_seq_length()
            cache.crop(kept - seen if kept < seen else kept)  # a count to remove (< 0), or the length to keep
            assert cache.get_seq_length() == kept
            fresh = new_cache(model, kind)
            model(ids[:, :kept], cache=fresh, use_cache=True)
            for ours, theirs in zip(layer_states(cache, kept), layer_states(fresh, kept)):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
            step = model(ids[:, kept : kept + 1], cache=cache, use_cache=True).logits
            expected = model(ids[:, kept : kept + 1], cache=fresh, use_cache=True).logits
            torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-4)


def test_rollback_after_more_tokens_than_the_window(model):
    """A prompt longer than the rollback window, then more single-token steps than the window without a crop (an
    assistant drafting): the oldest recorded tokens are replayed into the base as the window slides."""
    window = kimi_k3_cache.DEFAULT_ROLLBACK_WINDOW
    ids = torch.randint(0, 500, (1, 2 * window + 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = KimiK3Cache(model.config)
        cache.activate_past_recording()
        model(ids[:, : window + 10], cache=cache, use_cache=True)
        for t in range(window + 10, ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=f"can roll back {window} tokens here, not {window + 1}"):
            cache.crop(-(window + 1))
        cache.crop(-window)
        kept = ids.shape[1] - window
        fresh = KimiK3Cache(model.config)
        model(ids[:, :kept], cache=fresh, use_cache=True)
        for ours, theirs in zip(layer_states(cache, kept), layer_states(fresh, kept)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_crop_conventions_and_clear_errors(model):
    ids = torch.arange(1, 12)[None]
    with torch.no_grad():
        cache = KimiK3Cache(model.config)
        model(ids, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="can roll back 0 tokens here, not 2"):
            cache.crop(-2)  # not recording: nothing kept to roll back with
        cache = KimiK3Cache(model.config)
        cache.activate_past_recording(recurrent_states_to_keep=4)
        assert cache.rollback_window == kimi_k3_cache.DEFAULT_ROLLBACK_WINDOW
        model(ids, cache=cache, use_cache=True)
        cache.crop(9)  # a positive value is the length to keep (transformers 4.x)
        assert cache.get_seq_length() == 9
        with pytest.raises(ValueError, match="can roll back 0 tokens here"):
            cache.crop(-1)  # a crop ends the span: what it kept is final
        model(ids[:, :3], cache=cache, use_cache=True)
        if kimi_k3_cache._CROP_ZERO_EMPTIES:  # 4.x: "to 0 tokens", past the 3 recorded since the last crop
            with pytest.raises(ValueError, match="can roll back 3 tokens here, not 12"):
                cache.crop(0)
        else:  # 5.x: "by 0 tokens"
            cache.crop(0)
            assert cache.get_seq_length() == 12


def spied(model):
    """Record the number of tokens of each forward call and each rollback's size."""
    calls, crops = [], []
    forward, crop = model.forward, KimiK3Cache.crop

    def spy_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(ids.shape[1])
        return forward(*args, **kwargs)

    def spy_crop(self, max_length):
        before = self.seen_tokens
        crop(self, max_length)
        crops.append(before - self.seen_tokens)

    model.forward = spy_forward
    return calls, crops, spy_crop


@pytest.mark.parametrize("mode", ["lookup", "lookup_static", "assistant", "self_assistant"])
def test_greedy_speculation_equals_plain_greedy(model, mode, monkeypatch):
    """A prompt that repeats itself, so lookup drafts are partly accepted and partly rolled back."""
    prompt = torch.tensor([[11, 200, 37, 5, 91, 14, 3, 11, 200, 37, 5, 91, 14, 3, 7, 8, 11, 200]])
    new = 30
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=new, do_sample=False)
        kwargs = dict(prompt_lookup_num_tokens=5)
        if mode == "lookup_static":
            kwargs["cache"] = model.make_static_cache(1, prompt.shape[1] + new + 8)
        elif mode == "assistant":
            assistant = random_model(tiny_config(packed=True), seed=4)
            assistant.generation_config.eos_token_id = EOS
            assistant.generation_config.pad_token_id = model.config.pad_token_id
            kwargs = dict(assistant_model=assistant)
        elif mode == "self_assistant":
            kwargs = dict(assistant_model=model)
        calls, crops, spy_crop = spied(model)
        monkeypatch.setattr(KimiK3Cache, "crop", spy_crop)
        try:
            speculative = model.generate(prompt, max_new_tokens=new, do_sample=False, **kwargs)
        finally:
            del model.forward
    assert speculative.tolist() == plain.tolist()
    if mode != "self_assistant":
        assert any(n > 0 for n in crops), "no draft token was rejected: the rollback went untested"
    assert any(n > 1 for n in calls[1:]), "no multi-token verification step"


def test_demo_prompt_lookup_equals_plain_greedy():
    """The trained demo in fp32 (root code, demo weights) on an editing prompt: the same tokens in fewer forwards."""
    from transformers import AutoTokenizer

    from modeling_kimi_k3 import KimiK3ForCausalLM

    demo = ROOT / "demo" / "reap40"
    model = KimiK3ForCausalLM.from_pretrained(str(demo), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(demo), trust_remote_code=True)
    text = ("def total(values):\n    result = 0\n    for v in values:\n        result += v\n    return result\n\n"
            "# the same function, the variable renamed to acc\ndef total(values):\n    acc")
    prompt = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=32, do_sample=False)
        calls, _, _ = spied(model)
        lookup = model.generate(prompt, max_new_tokens=32, do_sample=False, prompt_lookup_num_tokens=8)
    assert lookup.tolist() == plain.tolist()
    assert len(calls) < 32, f"{len(calls)} forwards for 32 tokens: no draft was accepted"
    # the model's own generate re-renders a chat prompt for thinking=False, prompt lookup or not
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=False)
    chat = torch.tensor([chat])
    with torch.no_grad():
        plain = model.generate(chat, max_new_tokens=12, do_sample=False, thinking=False)
        lookup = model.generate(chat, max_new_tokens=12, do_sample=False, thinking=False, prompt_lookup_num_tokens=8)
    assert lookup.tolist() == plain.tolist()


def test_sampled_prompt_lookup_runs_and_keeps_its_length(model):
    """Sampling with drafts uses transformers' own acceptance rule on the target's logits: it runs through the
    rollbacks and returns the tokens asked for."""
    prompt = torch.tensor([[11, 200, 37, 5, 91, 14, 3, 11, 200, 37, 5, 91, 14, 3]])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=True,
                             prompt_lookup_num_tokens=4)
    assert out.shape == (1, prompt.shape[1] + 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fla's KDA kernels, fused kernels)")
@pytest.mark.parametrize("kind", ["growing", "static"])
def test_cuda_fast_paths_roll_back_and_speculate_like_greedy(kind):
    """On CUDA with the fast paths the model resolves (fla's chunked and recurrent KDA kernels, whose calls are
    split at the recorded position, the fused short convs writing the static cache in place): a rolled-back cache
    equals a fresh one and greedy prompt lookup equals plain greedy, in fp32."""
    model = random_model(tiny_config(packed=True, linear_attn_config=dict(
        num_heads=4, head_dim=64, full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5])), seed=3).cuda()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = model.config.pad_token_id
    ids = torch.tensor([[11, 200, 37, 5, 91, 14, 3, 9, 8, 7, 6, 5, 4, 3, 2, 1, 40]], device="cuda")
    with torch.no_grad():
        cache = new_cache(model, kind)
        cache.activate_past_recording()
        model(ids[:, :6], cache=cache, use_cache=True)
        model(ids[:, 6:11], cache=cache, use_cache=True)
        cache.crop(-3)
        fresh = new_cache(model, kind)
        model(ids[:, :8], cache=fresh, use_cache=True)
        for ours, theirs in zip(layer_states(cache, 8), layer_states(fresh, 8)):
            torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-4, rtol=1e-3)
        prompt = ids.repeat(1, 2)
        extra = {"cache": model.make_static_cache(1, prompt.shape[1] + 40)} if kind == "static" else {}
        plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
        lookup = model.generate(prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=5, **extra)
    assert lookup.tolist() == plain.tolist()
