"""The Triton kernels in Triton's CPU interpreter, against float64 references: mxfp4_triton's (explicit-dequant path:
indexing, routing blocks, SiTU and the per-token sum on the same packs) and fused_triton's depth mix, short convs and
latent attention. Needs `triton`
installed (skipped otherwise); `tl.dot_scaled` and the speed are checked on a GPU by tests/test_gpu_paths.py."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A LatentMoE with random MXFP4 bytes under sane scale codes, for the scripts below (each runs in its own process).
RANDOM_MOE = textwrap.dedent(
    """
    def random_moe(latent, inner, experts, top_k, dtype=None):
        \"\"\"Layer 1's LatentMoE of a tiny model: its MXFP4 packs random bytes (all 16 codes) under scale codes
        112..123.\"\"\"
        config = tiny_config(packed=True, routed_expert_hidden_size=latent, moe_intermediate_size=inner,
                             num_experts=experts, num_experts_per_token=top_k)
        moe = random_model(config, seed=1).language_model.model.layers[1].block_sparse_moe.to(dtype)
        with torch.no_grad():
            for e in moe.experts:
                for lin in (e.w1, e.w2, e.w3):
                    lin.weight_packed.copy_(torch.randint(0, 256, lin.weight_packed.shape, dtype=torch.uint8))
                    lin.weight_scale.copy_(torch.randint(112, 124, lin.weight_scale.shape, dtype=torch.uint8))
        return moe
    """
)


MXFP4_SCRIPT = textwrap.dedent(
    """
    import copy
    import torch
    import mxfp4_triton as mt
    from modeling_kimi_k3 import routed_expert_sum
    from mxfp4 import dequantize_mxfp4
    from reap_tools.tiny import random_model, tiny_config
    from tensor_parallel import TensorParallel, shard

    torch.manual_seed(0)
    for latent, inner, experts, top_k, tokens in [(32, 32, 8, 2, 5), (64, 96, 6, 3, 7), (128, 64, 5, 2, 40),
                                                  (64, 64, 8, 3, 1)]:  # one token: unsorted pair blocks
        moe = random_moe(latent, inner, experts, top_k)
        z = torch.randn(tokens, latent).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k)
        ref = torch.zeros(tokens, latent, dtype=torch.float64)
        for t in range(tokens):
            for s in range(top_k):
                ex = moe.experts[int(ids[t, s])]
                w1, w3, w2 = (dequantize_mxfp4(l.weight_packed, l.weight_scale, torch.float64)
                              for l in (ex.w1, ex.w3, ex.w2))
                g, u = w1 @ z[t].double(), w3 @ z[t].double()
                act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
                ref[t] += (w2 @ act) * float(weights[t, s])
        stack = moe.stack_experts()
        assert moe.experts[1].w1.weight_packed.data_ptr() == stack.w1[1].data_ptr()
        assert moe.stack_experts() is stack
        for name, conf in mt.CONFIGS.items():
            for atomic in (False, True):
                # float32 intermediates: the interpreter rounds to bf16 by truncation, so check exactness instead
                out = mt.run_experts(stack, z, ids, weights, experts, 4.0, 25.0, config=conf, dot_scaled=False,
                                     atomic=atomic, h_dtype=torch.float32)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-4, (latent, inner, name, atomic, err)
            # per pair (no weights): each expert's own output, which the block weights and sums
            outputs = mt.run_experts(stack, z, ids, None, experts, 4.0, 25.0, config=conf, dot_scaled=False,
                                     h_dtype=torch.float32)
            err = (((outputs.double() * weights.double()[..., None]).sum(1) - ref).norm() / ref.norm()).item()
            assert outputs.shape == (*ids.shape, latent) and err < 1e-4, (latent, inner, name, "per pair", err)
        # expert parallel: two ranks' stacks of consecutive experts, given the router's ids as they are, each sum
        # their own pairs; the two sums add up to the whole (one pair a block at one token, sorted blocks else)
        half = experts // 2
        for name, conf in mt.CONFIGS.items():
            shares = []
            for first, stop in ((0, half), (half, experts)):
                share = stack._replace(**{k: getattr(stack, k)[first:stop]
                                          for k in ("w1", "s1", "w3", "s3", "w2", "s2")})
                shares.append(mt.run_experts(share, z, ids, weights, stop - first, 4.0, 25.0, config=conf,
                                             dot_scaled=False, atomic=True, h_dtype=torch.float32, first=first))
            err = ((shares[0].double() + shares[1].double() - ref).norm() / ref.norm()).item()
            assert err < 1e-4, (latent, inner, name, "expert parallel", err)
            mine = (ids >= half) & (ids < experts)
            alone = (ref - mt.run_experts(stack, z, torch.where(mine, ids, experts), weights, experts, 4.0, 25.0,
                                          config=conf, dot_scaled=False, atomic=True, h_dtype=torch.float32).double())
            err = ((shares[0].double() - alone).norm() / alone.norm().clamp(min=1e-30)).item()
            assert err < 1e-4, (latent, inner, name, "rank 0's share", err)
        # the expert kernels' inputs in one launch: bf16 latents (lop3's K order) and the zeroed fp32 sum
        for permute in (False, True):
            x, y = mt.expert_inputs(z.float(), permute, zero_sum=True)
            want = z.view(tokens, latent // 32, 16, 2).transpose(2, 3).reshape(tokens, latent) if permute else z
            assert torch.equal(x, want) and torch.equal(y, torch.zeros(tokens, latent)), ("inputs", permute)
        # a decode step's routing metadata in one kernel: align_blocks' rows and blocks, bit for bit, with the
        # router's ids as they are under expert parallel too
        for first in (None, 0, half):  # None: ids of the block's own experts, `half` for the others'
            given = torch.where(ids < half, ids, half) if first is None else ids
            want = mt.align_blocks(mt.local_ids(ids, first or 0, half), half, 8)
            got = mt.align_blocks_fused(given, half, 8, first)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), ("align", tokens, first)
        # the dispatch's op on rank 1 of a sharded block, against the reference op (bf16 rounding, truncated)
        block = copy.deepcopy(moe)
        shard(block, TensorParallel(1, 2))
        first = block.expert_parallel.first
        got = mt.routed_expert_sum(block, z, ids, weights, first)
        want = routed_expert_sum(block, z, ids, weights, first)
        assert got.shape == want.shape == (tokens, 1, latent)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    print("ok")
    """
)


UPCAST_ONCE_SCRIPT = textwrap.dedent(
    """
    import torch
    import mxfp4_triton as mt
    from modeling_kimi_k3 import routed_experts, situ_glu
    from mxfp4 import dequantize_unchecked
    from reap_tools.tiny import random_model, tiny_config

    torch.manual_seed(0)
    # the upcast, bit for bit: every byte under every scale code from 2 (E8M0 255 is inf: nan where it meets a
    # zero); the interpreter flushes the subnormal products of codes 0 and 1, which tests/test_gpu_paths.py covers
    packed = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(2, 254, 256).contiguous()
    codes = torch.arange(2, 256, dtype=torch.uint8).view(1, 254, 1).expand(2, 254, 16).contiguous()
    want = torch.stack([dequantize_unchecked(packed[e], codes[e], torch.bfloat16) for e in range(2)])
    halves = torch.zeros(2, 508, 512, dtype=torch.bfloat16)
    mt.dequantize(packed, codes, halves[:, 254:], out_rows=508)  # the second half of a [E, 2 * rows, K] buffer
    for got in (mt.dequantize(packed, codes), halves[:, 254:]):
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all()), int((~same).sum())
    h = torch.randn(7, 80).to(torch.bfloat16)
    want = situ_glu(h[:, :40], h[:, 40:], 4.0, 25.0).float()
    diff = (mt.situ_glu(h[:, :40], h[:, 40:], 4.0, 25.0).float() - want).abs()
    assert bool((diff <= want.abs() * 2 ** -7 + 1e-6).all()), diff.max()  # a bf16 ulp (the interpreter truncates)
    gate, up = torch.randn(2, 3, 48).to(torch.bfloat16), torch.randn(2, 3, 48).to(torch.bfloat16)  # an MLP's
    want = situ_glu(gate, up, 4.0, 25.0).float()
    got = mt.situ_glu(gate, up, 4.0, 25.0)
    assert got.shape == gate.shape and bool(((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all())
    # the rows of a chunk's outputs back to (token, slot) order, bit for bit as index_copy_ puts them
    src, index = torch.randn(5, 40).to(torch.bfloat16), torch.tensor([7, 0, 3, 9, 4])
    want = torch.zeros(10, 40, dtype=torch.bfloat16).index_copy_(0, index, src)
    got = mt.scatter_rows(src, index, torch.zeros(10, 40, dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the experts against the reference's packed experts, one chunk and chunks of 2 experts, with another rank's pairs
    latent, inner, experts, top_k, tokens = 64, 96, 6, 3, 40
    moe = random_moe(latent, inner, experts, top_k, torch.bfloat16)
    stack = moe.stack_experts()
    z = torch.randn(tokens, latent).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts + 1)[:top_k] for _ in range(tokens)])  # id 6: another rank's expert
    ref = routed_experts(moe, z, ids).float()
    for chunk in (None, 3 * latent * inner * 2 * 2):
        outputs = mt.run_experts_upcast_once(stack, z, ids, experts, 4.0, 25.0, chunk_bytes=chunk)
        assert outputs.shape == (tokens, top_k, latent) and bool((outputs[ids == experts] == 0).all())
        err = ((outputs.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err  # bf16 rounding of SiTU's output, truncated by the interpreter
    print("ok")
    """
)


FUSED_SCRIPT = textwrap.dedent(
    """
    import torch
    import fused_triton
    from kimi_k3_dispatch import fused_add_attn_res_mix, fused_attn_res_mix
    from modeling_kimi_k3 import KimiK3AttnResProj, KimiK3RMSNorm, short_conv

    torch.manual_seed(0)
    assert fused_triton.supported("cpu")
    for n, shape, dtype in [(2, (1, 1, 96), torch.float32), (3, (2, 5, 200), torch.float32),
                            (9, (1, 3, 64), torch.bfloat16), (17, (1, 1, 40), torch.float32)]:
        hidden = shape[-1]
        sources = [torch.randn(shape).mul_(1 + j).to(dtype) for j in range(n)]
        norm, proj, out_norm = KimiK3RMSNorm(hidden), KimiK3AttnResProj(hidden), KimiK3RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            out_norm.weight.uniform_(0.5, 1.5)
            proj.weight.normal_(0.0, 0.2)
            out = fused_attn_res_mix(sources[:-1], sources[-1], norm, proj, out_norm)  # the kernel
        v = torch.stack(sources).double()
        normed = v * (v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt() * norm.weight.double()
        p = (normed @ proj.weight[0].double()).softmax(0).unsqueeze(-1)
        mixed = (p * v).sum(0).to(dtype).double()  # the mix is rounded to the activation dtype before the norm
        ref = mixed * (mixed.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * out_norm.weight.double()
        assert out.shape == shape and out.dtype == dtype, (out.shape, out.dtype)
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bf16: one ulp (the interpreter truncates)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, ("mix", n, shape, dtype, err)
        # the sublayer's output added to the last source as the kernel reads it: the sum as torch's add gives it (in
        # bf16 to an ulp: the interpreter truncates), the mix the same as over that sum
        delta = torch.randn(shape).to(dtype)
        with torch.no_grad():
            total, added = fused_add_attn_res_mix(sources[:-1], sources[-1], delta, norm, proj, out_norm)
            over_sum = fused_attn_res_mix(sources[:-1], total, norm, proj, out_norm)
        want = sources[-1] + delta
        if dtype == torch.float32:
            assert torch.equal(total, want), ("sum", n, shape)
        else:
            assert bool(((total.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()), ("sum", n)
        assert torch.equal(added, over_sum), ("mix after the add", n, shape, dtype)

    for batch, length, widths, with_state, dtype in [(1, 1, (64, 64, 32), True, torch.float32),
                                                     (2, 7, (96, 40, 300), False, torch.float32),
                                                     (2, 2, (64, 64, 64), True, torch.float32),
                                                     (1, 37, (128, 8, 8), True, torch.bfloat16)]:
        inputs = [torch.randn(batch, length, d).to(dtype) for d in widths]
        weights = [torch.randn(d, 1, 4).to(dtype) for d in widths]
        states = [torch.randn(batch, d, 3).to(dtype) for d in widths] if with_state else None
        refs = [short_conv(x, w, None if states is None else s) for x, w, s in
                zip(inputs, weights, states or (None,) * 3)]
        given = None if states is None else [s.clone() for s in states]
        outs, news = fused_triton.short_conv(inputs, weights, given, in_place=True)
        for (ref_y, ref_s), y, s in zip(refs, outs, news):
            tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: two roundings, each truncated here
            err = ((y.double() - ref_y.double()).abs().max() / ref_y.double().abs().max()).item()
            assert y.shape == ref_y.shape and err < tol, ("conv", batch, length, with_state, err)
            assert torch.equal(s, ref_s), ("conv state", batch, length, with_state)
        if given is not None:
            assert all(s is g for s, g in zip(news, given)), "in_place did not return the given histories"
        outs32, _ = fused_triton.short_conv(inputs, weights, states, out_dtype=torch.float32)
        assert all(torch.equal(y32, y.float()) for y32, y in zip(outs32, outs)), "fp32 outputs: other values"

    # the router's top-k: the biased scores' order (ties to the lower index, as a stable sort), unbiased weights
    for rows, experts, k, renorm, bias_dtype in [(1, 320, 16, True, torch.float32), (5, 20, 4, True, torch.float32),
                                                 (3, 8, 8, False, torch.float32), (2, 300, 2, True, torch.bfloat16)]:
        logits, bias = torch.randn(rows, experts) * 3, (torch.randn(experts) * 0.1).to(bias_dtype)
        if rows > 1:  # a row whose first half ties (zero bias there), its second half far below
            bias[: experts // 2] = 0.0
            logits[1, : experts // 2], logits[1, experts // 2 :] = 0.5, -10.0
        ids, weights = fused_triton.router_topk(logits, bias, k, renorm, 2.5)
        scores = logits.sigmoid()
        ref_ids = torch.sort(scores + bias.float(), dim=-1, descending=True, stable=True).indices[:, :k]
        ref_weights = scores.gather(-1, ref_ids)
        if renorm:
            ref_weights = ref_weights / (ref_weights.sum(-1, keepdim=True) + 1e-20)
        assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids), ("router ids", rows, experts, k)
        assert torch.allclose(weights, ref_weights * 2.5, rtol=1e-6, atol=0), ("router weights", rows, experts, k)

    # the LatentMoE's weighted sum over slots (of bf16 expert outputs, or of fp32 terms weighted already), rounded
    # to the activation dtype, and its RMSNorm (or none)
    for rows, k, width, with_norm, weighted in [(1, 16, 200, True, True), (3, 4, 64, True, False),
                                                (2, 2, 96, False, True), (2, 1, 64, False, False)]:
        pairs = torch.randn(rows, k, width).to(torch.bfloat16 if weighted else torch.float32)
        weights = torch.rand(rows, k) if weighted else None
        weight = torch.rand(width) + 0.5 if with_norm else None
        out = fused_triton.pair_sum_norm(pairs, weights, weight, 1e-5, torch.float32)
        ref = (pairs.double() * weights.double()[..., None] if weighted else pairs.double()).sum(1)
        if with_norm:
            ref = ref * (ref.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight.double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert out.shape == (rows, width) and err < 1e-6, ("pair sum", rows, k, width, err)

    # KDA's output norm times its sigmoid gate, from fp32 (a prompt's fla output) and bf16, against the torch ops
    for shape, x_dtype, dtype in [((2, 3, 4, 64), torch.float32, torch.bfloat16), ((1, 1, 2, 32), torch.bfloat16,
                                  torch.bfloat16), ((1, 5, 3, 16), torch.float32, torch.float32)]:
        norm = KimiK3RMSNorm(shape[-1]).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x, gate = torch.randn(shape).to(x_dtype), torch.randn(shape).mul_(3).to(dtype)
        out = fused_triton.gated_rms_norm(x, gate, norm.weight, norm.variance_epsilon, dtype)
        ref = (norm(x.to(dtype)) * torch.sigmoid(gate)).double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: roundings truncated here
        assert out.shape == shape and out.dtype == dtype and err < tol, ("gated norm", shape, err)
    try:
        fused_triton.gated_rms_norm(torch.zeros(1, 48), torch.zeros(1, 48), torch.ones(48), 1e-5, torch.float32)
        raise AssertionError("a head width that is not a power of two ran")
    except ValueError as err:
        assert "not a power of two" in str(err)

    # MLA's per-head keys: k_nope from kv_b_proj's output beside the latent's k_r, bit for bit the concatenation,
    # from a latent whose rows are apart (a cache's view) and heads not a multiple of the program's 16
    for batch, keys, heads, nope, v, c, rope, dtype in [(2, 5, 3, 8, 4, 16, 4, torch.float32),
                                                        (1, 3, 18, 16, 8, 32, 8, torch.bfloat16)]:
        latent = torch.randn(batch, keys + 2, c + rope).to(dtype)[:, :keys]
        kv = torch.randn(batch, keys, heads * (nope + v)).to(dtype)
        k_nope = kv.view(batch, keys, heads, -1)[..., :nope]
        ref = torch.cat([k_nope, latent[..., c:].unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
        assert torch.equal(fused_triton.mla_keys(kv, latent, heads, nope, c), ref), ("mla keys", heads, dtype)

    # MLA's latent (kv_a output, c RMS-normed) written into a static cache's buffer at the tokens' positions, against
    # the reference's norm, concatenation and index_copy_
    from modeling_kimi_k3 import KimiK3RMSNorm, latent_keys
    for batch, tokens, c, rope, dtype in [(2, 3, 32, 8, torch.float32), (1, 1, 64, 16, torch.bfloat16)]:
        norm = KimiK3RMSNorm(c, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        kv = torch.randn(batch, tokens, c + rope).mul_(3).to(dtype)
        positions = torch.tensor([5, 2, 7][:tokens])
        got = fused_triton.latent_keys(kv, norm.weight, 1e-6, c, torch.zeros(batch, 9, c + rope, dtype=dtype),
                                       positions)
        with torch.no_grad():
            want = latent_keys(kv, norm, c, torch.zeros(batch, 9, c + rope, dtype=dtype), positions)
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bf16: an ulp (the interpreter truncates)
        assert torch.equal(got[..., c:], want[..., c:]) and ((got - want).abs() <= want.abs() * tol + 1e-7).all(), (
            "latent keys", batch, tokens, dtype)

    # MLA's output gate over the heads' outputs put back in token order, against the torch ops
    for batch, heads, length, width, dtype in [(2, 3, 5, 16, torch.float32), (1, 40, 2, 8, torch.bfloat16)]:
        attn = torch.randn(batch, length, heads, width).to(dtype).transpose(1, 2)  # SDPA's strides
        gate = torch.randn(batch, length, 5 + heads * width).mul_(3).to(dtype)[..., 5:]  # rows apart, as merged
        out = fused_triton.sigmoid_gated_heads(attn, gate)
        ref = attn.transpose(1, 2).reshape(batch, length, -1).double() * torch.sigmoid(gate.double())  # exact
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: two roundings (sigmoid, product), truncated here
        assert out.shape == ref.shape and out.dtype == dtype and err < tol, ("gated heads", heads, err)

    # in the model: a static cache's prefill + decode steps with the fused kernels vs the torch code
    from modeling_kimi_k3 import KimiK3StaticCache, use_fast_paths
    from reap_tools.tiny import random_model, tiny_config

    model = random_model(tiny_config(packed=False), seed=3)
    prompt = torch.tensor([[5, 17, 9, 33, 2, 8]])
    runs = {}
    for fused in (True, False):
        cache = KimiK3StaticCache(model.config, batch_size=1, max_length=12, cuda_graph=False)
        with torch.no_grad(), use_fast_paths(model, fused=fused):
            logits = [model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]]
            for token in (4, 21, 7):
                logits.append(model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1])
        runs[fused] = torch.cat(logits)
    err = ((runs[True] - runs[False]).abs().max() / runs[False].abs().max()).item()
    assert err < 1e-5, ("model", err)
    print("ok")
    """
)


LATENT_SCRIPT = textwrap.dedent(
    """
    import torch
    import fused_triton

    def reference(q, latent, position, key_mask, scale, width):
        keys = latent.shape[1]
        scores = torch.einsum("bhw,bkw->bhk", q.double(), latent.double()) * scale
        j = torch.arange(keys)
        visible = (j <= position)[None, :].expand(q.shape[0], keys)
        if key_mask is not None:
            visible = visible & (key_mask[:, :keys].bool() | (j == position)[None, :])
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        return torch.einsum("bhk,bkc->bhc", probs, latent[..., :width].double())

    torch.manual_seed(0)
    # (rows, heads, latent width, rope width, cached slots, the query's position, padding mask): a static cache's
    # unfilled tail (position well before the last slot), heads not a multiple of the program's 32, many splits
    for rows, heads, width, rope, keys, position, padded in [(2, 4, 16, 4, 40, 30, True), (1, 5, 32, 8, 7, 6, False),
                                                             (2, 40, 64, 16, 300, 299, True),
                                                             (1, 3, 16, 4, 1000, 3, False)]:
        q = torch.randn(rows, heads, width + rope)
        latent = torch.randn(rows, keys + 5, width + rope)[:, :keys]  # a growing cache's keys: the rows are apart
        key_mask = torch.rand(rows, keys + 2) > 0.3 if padded else None
        got = fused_triton.latent_attention(q[..., :width], q[..., width:], latent, torch.tensor([position]),
                                            key_mask, 0.1)
        err = (got.double() - reference(q, latent, position, key_mask, 0.1, width)).abs().max().item()
        assert got.shape == (rows, heads, width) and err < 1e-5, (rows, heads, keys, position, err)
    print("ok")
    """
)


SAME_INTERMEDIATE_SCRIPT = textwrap.dedent(
    """
    import torch
    import mxfp4_triton as mt
    from modeling_kimi_k3 import REFERENCE_OPS, pair_sum_norm, routed_experts
    from kimi_k3_dispatch import FastPaths, resolve_ops
    from reap_tools.tiny import random_model, tiny_config

    torch.manual_seed(0)
    kernels = resolve_ops(FastPaths(experts=True, fused=True), REFERENCE_OPS)
    assert kernels.routed_experts is not routed_experts and kernels.pair_sum_norm is not pair_sum_norm
    moe = random_moe(64, 96, 6, 2, torch.bfloat16)
    for tokens in (1, 5):  # one token: per-pair blocks; several: sorted blocks
        z = torch.randn(tokens, 64).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(7)[:2] for _ in range(tokens)])  # id 6: another rank's expert
        weights = torch.rand(tokens, 2)
        with torch.no_grad():
            ref, got = routed_experts(moe, z, ids), kernels.routed_experts(moe, z, ids)
            mine = ids < 6
            # the same intermediate: each (token, slot)'s unweighted expert output, [N, k, L] in z's dtype
            assert got.shape == ref.shape == (tokens, 2, 64) and got.dtype == ref.dtype == torch.bfloat16
            err = ((got.float() - ref.float())[mine].norm() / ref.float()[mine].norm()).item()
            assert err < 1e-2, ("pairs", tokens, err)  # bf16 rounding of SiTU's output, truncated here
            # and the same next step: weighted in fp32, summed over k, normed, through either op
            pairs = torch.where(mine[..., None], ref, 0)
            a = pair_sum_norm(pairs, weights, moe.routed_expert_norm, torch.bfloat16)
            b = kernels.pair_sum_norm(pairs, weights, moe.routed_expert_norm, torch.bfloat16)
            assert a.shape == b.shape == (tokens, 64) and ((a.float() - b.float()).abs().max() / a.abs().max()) < 2**-6
    print("ok")
    """
)


def with_random_moe(script):
    """`script` with `random_moe` (RANDOM_MOE) defined after its imports."""
    anchor = "from reap_tools.tiny import random_model, tiny_config\n"
    assert anchor in script
    return script.replace(anchor, anchor + RANDOM_MOE, 1)


def run_in_interpreter(script):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_mxfp4_kernels_in_the_triton_interpreter():
    run_in_interpreter(with_random_moe(MXFP4_SCRIPT))


@needs_triton
def test_upcast_once_experts_in_the_triton_interpreter():
    """mxfp4_triton's prompt path: the upcast kernel bit for bit, SiTU-GLU, the grouped GEMMs over sorted pairs,
    the scatter of their outputs back to (token, slot) order."""
    run_in_interpreter(with_random_moe(UPCAST_ONCE_SCRIPT))


@needs_triton
def test_both_moe_paths_produce_the_same_intermediate():
    """The reference `routed_experts` and the expert kernels (its drop-in) give the same per-(token, slot) outputs,
    which either `pair_sum_norm` then weights, sums and norms."""
    run_in_interpreter(with_random_moe(SAME_INTERMEDIATE_SCRIPT))


@needs_triton
def test_fused_depth_mix_in_the_triton_interpreter():
    run_in_interpreter(FUSED_SCRIPT)


@needs_triton
def test_latent_attention_in_the_triton_interpreter():
    """fused_triton.latent_attention (MLA's one-query attention, split over the keys) against float64."""
    run_in_interpreter(LATENT_SCRIPT)
