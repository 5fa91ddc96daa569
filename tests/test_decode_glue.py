"""Decode-step glue (issue 44), CPU: the block bank of a decode step lives in one buffer that the depth mixes read
in place (no stack a mix, no copy at a block's opening but the first), through the decode graph's stages as through
the forward, with the same logits as the reference path; the fused depth-mix kernel reads such a bank in Triton's
interpreter as it reads a stack.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kimi_k3_dispatch
from kimi_k3_dispatch import FastPathDispatch, fused_add_attn_res_mix, fused_attn_res_mix
from modeling_kimi_k3 import REFERENCE_OPS, KimiK3AttnResProj, KimiK3RMSNorm, add_attn_res_mix, attn_res_mix
from reap_tools.tiny import random_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = torch.tensor([[5, 17, 99, 3, 250]])


def mix_kernel_stand_in(seen, masks):
    """A torch stand-in for `fused_triton.attn_res_mix` (the kernel's arguments) that records the stacked bank and
    the key mask it is given and computes the reference `attn_res_mix` from them: the same bits as the reference
    path."""
    def kernel(stacked, last, norm_weight, proj_weight, eps, out_weight, out_eps, key_mask=None, positions=None,
               delta=None):
        seen.append(stacked)
        masks.append(key_mask)
        hidden = last.shape[-1]
        norm, proj, out_norm = KimiK3RMSNorm(hidden, eps), KimiK3AttnResProj(hidden), KimiK3RMSNorm(hidden, out_eps)
        norm.weight.data, proj.weight.data, out_norm.weight.data = norm_weight, proj_weight[None], out_weight
        if delta is not None:
            return add_attn_res_mix(tuple(stacked.unbind(0)), last, delta, norm, proj, out_norm)
        return attn_res_mix(tuple(stacked.unbind(0)), last, norm, proj, out_norm, key_mask, positions)

    return kernel


def prefilled(model):
    """A static cache holding PROMPT."""
    cache = model.make_static_cache(1, PROMPT.shape[1] + 2)
    model(PROMPT, cache=cache, use_cache=True)
    return cache


def decode_through_stages(model, cache, token, attention_mask=None):
    """One decode step as the decode graph runs it, eagerly: `decode_stages` in turn on the mask and positions of the
    cache's `prepare` (each stage's output a plain tuple, as the graph's segments pass it)."""
    mask, positions = cache.prepare(attention_mask, token.shape[0], 1, token.device)
    state = (token,)
    for _, stage, _ in model.decode_stages():
        state = stage(state, mask, positions, cache)
    cache.advance(1)
    return state[0]


@pytest.mark.parametrize("through_stages", [True, False])
def test_a_decode_steps_bank_is_one_buffer_read_in_place(monkeypatch, through_stages):
    model = random_model(tiny_config(), seed=0).eval()
    layers = model.language_model.model.layers
    token = torch.tensor([[7]])
    with torch.no_grad():
        reference = model(token, cache=prefilled(model), use_cache=True).logits

        seen, masks = [], []
        fused_ops = dataclasses.replace(REFERENCE_OPS, attn_res_mix=fused_attn_res_mix,
                                        add_attn_res_mix=fused_add_attn_res_mix)
        monkeypatch.setattr(FastPathDispatch, "ops", lambda self, device, offloaded=False: fused_ops)
        monkeypatch.setattr(kimi_k3_dispatch, "triton_attn_res_mix", mix_kernel_stand_in(seen, masks))
        cache = prefilled(model)
        assert seen and all(s._base is None for s in seen), "a prompt's bank is stacked, not a decode buffer"
        seen.clear()
        closing = {}
        for i, layer in enumerate(layers):
            layer.register_forward_hook(lambda module, args, out, i=i: closing.update({i: out[1]}))
        if through_stages:
            logits = decode_through_stages(model, cache, token)
        else:
            logits = model(token, cache=cache, use_cache=True).logits
    assert torch.equal(logits, reference)

    buffer = seen[0]._base
    blocks = -(-len(layers) // model.config.text_config.attn_res_block_size)
    assert buffer is not None and buffer.shape == (blocks, 1, 1, model.config.text_config.hidden_size)
    assert all(s._base is buffer and s.data_ptr() == buffer.data_ptr() for s in seen), "every mix reads the buffer"
    rows, expected = 0, []
    for layer in layers:  # the mix before the attention reads the bank before the layer's opening, then after it
        expected += [rows] if rows else []
        rows += layer.opens_block
        expected.append(rows)
    assert [s.shape[0] for s in seen] == expected + [blocks]  # + the output mix
    size = model.config.text_config.attn_res_block_size
    closers = [i for i, layer in enumerate(layers[:-1]) if layer.closes_block]
    assert closers
    for i in closers:  # its partial sum is the next block's row as written there, not copied at the opening
        assert closing[i].data_ptr() == buffer[(i + 1) // size].data_ptr(), i


def test_a_prompt_and_a_training_step_keep_separate_rows():
    """Outside a decode step (several tokens a row, or autograd on) the bank is a tuple of the partial sums
    themselves, as the sequential observer and the backward rely on."""
    model = random_model(tiny_config(), seed=0).eval()
    banks = []
    model.language_model.model.layers[-1].register_forward_pre_hook(lambda module, args: banks.append(args[0]))
    with torch.no_grad():
        model(PROMPT)
    model(torch.tensor([[7]]))  # grad on
    assert [b.buffer for b in banks] == [None, None]


FUSED_BANK_SCRIPT = textwrap.dedent(
    """
    import torch
    from kimi_k3_dispatch import fused_attn_res_mix
    from modeling_kimi_k3 import BlockBank, KimiK3AttnResProj, KimiK3RMSNorm

    torch.manual_seed(0)
    for blocks, rows, batch, hidden, dtype in [(8, 3, 1, 96, torch.bfloat16), (4, 4, 3, 64, torch.float32),
                                               (5, 1, 2, 40, torch.float32)]:
        partial = torch.randn(batch, 1, hidden).to(dtype)
        bank = BlockBank()
        with torch.no_grad():
            for j in range(rows):
                bank = bank.opened(torch.randn(batch, 1, hidden).mul_(1 + j).to(dtype), blocks)
        assert bank.buffer.shape[0] == blocks and bank.stacked()._base is bank.buffer
        bank.buffer[rows:] = float("nan")  # rows past the bank's are never read
        norm, proj, out_norm = KimiK3RMSNorm(hidden), KimiK3AttnResProj(hidden), KimiK3RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            out_norm.weight.uniform_(0.5, 1.5)
            proj.weight.normal_(0.0, 0.2)
            out = fused_attn_res_mix(bank, partial, norm, proj, out_norm)  # the kernel, on buffer[:rows]
            stacked = fused_attn_res_mix(tuple(t.clone() for t in bank), partial, norm, proj, out_norm)
        assert torch.equal(out, stacked), (blocks, rows, dtype)  # as on a stack of the same rows
        v = torch.stack([*bank, partial]).double()
        normed = v * (v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt() * norm.weight.double()
        p = (normed @ proj.weight[0].double()).softmax(0).unsqueeze(-1)
        mixed = (p * v).sum(0).to(dtype).double()
        ref = mixed * (mixed.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * out_norm.weight.double()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: the mix's rounding, then the norm's, truncated
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert out.shape == partial.shape and err < tol, (blocks, rows, dtype, err)

    # padding tokens' rows zeroed from the key mask at the tokens' positions: a static cache's bool buffer at a
    # decode step, a user's int64 mask over a prompt
    for batch, tokens, keys, mask_dtype in [(2, 1, 9, torch.bool), (3, 4, 12, torch.int64)]:
        hidden, dtype = 64, torch.bfloat16
        bank = BlockBank(torch.randn(batch, tokens, hidden).to(dtype) for _ in range(2))
        partial = torch.randn(batch, tokens, hidden).to(dtype)
        key_mask = (torch.rand(batch, keys + 5) < 0.6).to(mask_dtype)[:, :keys]  # a column slice, as a chunk's
        positions = torch.arange(keys - tokens, keys)
        key_mask[0, positions[0]], key_mask[1, positions[-1]] = 0, 1  # both kinds of row for certain
        norm, proj, out_norm = KimiK3RMSNorm(hidden), KimiK3AttnResProj(hidden), KimiK3RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            proj.weight.normal_(0.0, 0.2)
            masked = fused_attn_res_mix(bank, partial, norm, proj, out_norm, key_mask, positions)
            plain = fused_attn_res_mix(bank, partial, norm, proj, out_norm)
        keep = key_mask[:, positions].bool()[..., None]
        assert torch.equal(masked, torch.where(keep, plain, torch.zeros_like(plain))), (batch, tokens, mask_dtype)
        assert not keep.all() and keep.any() and plain.abs().min() > 0
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_depth_mix_reads_a_bank_buffer_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", FUSED_BANK_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("padded", [False, True])
def test_kda_layers_take_the_padding_mask_in_the_depth_mix(monkeypatch, padded):
    """A KDA layer's padding tokens read zeros, written by the depth mix before it (the fused kernel reads the key
    mask and the positions in place): in a decode step through the decode graph's stages the mix gets the static
    cache's mask buffer itself (no index op), the attention no mask (no fill); the logits are the reference path's,
    with and without left padding."""
    model = random_model(tiny_config(), seed=0).eval()
    layers = model.language_model.model.layers
    prompt = torch.tensor([[5, 17, 99, 3, 250], [511, 511, 8, 40, 2]])
    mask = (prompt != 511).long() if padded else torch.ones_like(prompt)
    token = torch.tensor([[7], [9]])

    def step():
        cache = model.make_static_cache(2, prompt.shape[1] + 2)
        model(prompt, attention_mask=mask, cache=cache, use_cache=True)
        return cache

    with torch.no_grad():
        reference_cache = step()
        reference = model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                          cache=reference_cache, use_cache=True).logits
        seen, masks = [], []
        fused_ops = dataclasses.replace(REFERENCE_OPS, attn_res_mix=fused_attn_res_mix,
                                        add_attn_res_mix=fused_add_attn_res_mix)
        monkeypatch.setattr(FastPathDispatch, "ops", lambda self, device, offloaded=False: fused_ops)
        monkeypatch.setattr(kimi_k3_dispatch, "triton_attn_res_mix", mix_kernel_stand_in(seen, masks))
        cache = step()
        attention = []
        for layer in layers:
            layer.self_attn.register_forward_pre_hook(lambda module, args: attention.append(args[1]))
        masks.clear()
        logits = decode_through_stages(model, cache, token, torch.cat([mask, torch.ones_like(token)], 1))
    assert torch.equal(logits, reference)
    kinds = [layer.self_attn.__class__.__name__ for layer in layers]
    assert [a is None for a in attention] == [kind == "KimiK3DeltaAttention" for kind in kinds]
    # the first mix of a KDA layer (past layer 0's, whose bank is empty) gets the mask buffer, the others none
    expected = []
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        expected += [kind == "KimiK3DeltaAttention"] if i else []
        expected.append(False)
    assert [m is cache.mask for m in masks] == expected + [False]

