"""Issue 20, third exploration (session of 2026-12-04): the kernels this session changed, beside the versions before
it (the previous commit's `fused_triton.py` / `mxfp4_triton.py`, copied by the caller into the git-ignored .old/),
on the H200 at the release's shapes. Run from the repository root; writes JSON to the path given.

  A. the depth mix (`attn_res_mix`) at a prompt's 8192 rows and at decode's 1 / 8, 5 and 9 sources: old kernel,
     new kernel at 4 / 8 / 16 warps, the torch reference; error against float64;
  B. the upcast of one 2 GiB chunk of experts (32 x w1 [3072, 1792 B], 32 x w2 [3584, 1536 B]): old kernel, new
     kernel at several tiles; bit-equality with the old;
  C. MLA prompt attention (96 heads, q/k 192, v 128, bf16): SDPA under the explicit boolean mask (the code before)
     against `is_causal` per backend, for a first chunk (8192 x 8192) and a later one (8192 x 16384, lower-right);
  D. latent attention at decode over one static buffer of 131,073 latents, the query at 2,048 / 32,768 / 131,072:
     old kernel, new kernel (for / while loop) and configurations; error against the torch absorbed form.

It ran (explore_call3.*) on this session's working tree before the kernels settled: the knobs it sets
(`fused_triton.ATTN_RES_MIX_WARPS`, `LATENT_CONFIGS`, `LATENT_LOOP_WHILE`, `mxfp4_triton.DEQUANT_TILE`) and the
one-stack `attn_res_mix` are gone since (the tiled upcast lost and was dropped; the others became
`LATENT_CONFIG`, two builds of the split kernel, and a depth mix over the bank's stack and the partial sum). Kept
as the record of those figures, not to be run again.
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

ROOT = os.getcwd()
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, ".old"))
import fused_triton  # noqa: E402
import mxfp4_triton  # noqa: E402
import old_fused_triton  # noqa: E402
import old_mxfp4_triton  # noqa: E402

OUT = sys.argv[1]
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
started = time.time()


def save():
    results["elapsed_s"] = time.time() - started
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def part_a():
    res = results.setdefault("attn_res_mix", {})
    hidden = 7168
    gen = torch.Generator(device="cuda").manual_seed(0)
    norm_w = torch.rand(hidden, device="cuda", generator=gen) + 0.5
    proj_w = torch.randn(hidden, device="cuda", generator=gen) * 0.05
    out_w = torch.rand(hidden, device="cuda", generator=gen) + 0.5
    for rows, n in ((8192, 5), (8192, 9), (1, 5), (8, 5), (1, 9)):
        stacked = torch.randn(n, rows, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = stacked.double()
        normed = v * (v.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * norm_w.double()
        p = (normed @ proj_w.double()).softmax(0).unsqueeze(-1)
        mixed = (p * v).sum(0).to(torch.bfloat16).double()
        ref = mixed * (mixed.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * out_w.double()
        key = f"rows{rows}_n{n}"
        entry = res[key] = {}
        old = lambda: old_fused_triton.attn_res_mix(stacked, norm_w, proj_w, 1e-5, out_w, 1e-5)  # noqa: E731
        entry["old_ms"] = bench(old)
        entry["old_err"] = float((old().double() - ref).abs().max() / ref.abs().max())
        for warps in (4, 8, 16):
            fused_triton.ATTN_RES_MIX_WARPS = warps
            new = lambda: fused_triton.attn_res_mix(stacked, norm_w, proj_w, 1e-5, out_w, 1e-5)  # noqa: E731
            entry[f"new_w{warps}_ms"] = bench(new)
            entry[f"new_w{warps}_err"] = float((new().double() - ref).abs().max() / ref.abs().max())
        fused_triton.ATTN_RES_MIX_WARPS = 8
        entry["bytes_read_GB"] = stacked.numel() * 2 / 1e9
        entry["stack_copy_ms"] = bench(lambda: torch.stack(list(stacked)))
        print("A", key, {k: round(v, 4) for k, v in entry.items()}, flush=True)
        save()


def part_b():
    res = results.setdefault("dequant", {})
    gen = torch.Generator(device="cuda").manual_seed(1)
    experts, inner, latent = 32, 3072, 3584
    for name, rows, half in (("w1", inner, latent // 2), ("w2", latent, inner // 2)):
        packed = torch.randint(0, 256, (experts, rows, half), device="cuda", generator=gen, dtype=torch.uint8)
        codes = torch.randint(110, 130, (experts, rows, half // 16), device="cuda", generator=gen, dtype=torch.uint8)
        want = old_mxfp4_triton.dequantize(packed, codes)
        moved = packed.numel() + codes.numel() + want.numel() * 2
        entry = res[name] = {"GB_moved": moved / 1e9}
        entry["old_ms"] = bench(lambda: old_mxfp4_triton.dequantize(packed, codes, want))
        for tile in ((16, 256, 4), (8, 256, 4), (32, 256, 8), (16, 512, 8), (8, 512, 4), (64, 128, 8), (4, 256, 2),
                     (32, 128, 4)):
            mxfp4_triton.DEQUANT_TILE = tile
            got = mxfp4_triton.dequantize(packed, codes)
            ms = bench(lambda: mxfp4_triton.dequantize(packed, codes, got))
            entry["tile" + "_".join(map(str, tile))] = {"ms": ms, "TBps": moved / ms / 1e9,
                                                        "equal": bool(torch.equal(got, want))}
        # the w13 layout: w1 into the first half of a [E, 2 * inner, L] buffer
        if name == "w1":
            both = torch.empty(experts, 2 * inner, latent, dtype=torch.bfloat16, device="cuda")
            mxfp4_triton.DEQUANT_TILE = (16, 256, 4)
            mxfp4_triton.dequantize(packed, codes, both[:, inner:], out_rows=2 * inner)
            entry["half_layout_equal"] = bool(torch.equal(both[:, inner:], want))
        print("B", name, entry, flush=True)
        save()
    mxfp4_triton.DEQUANT_TILE = (16, 256, 4)


def part_c():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    res = results.setdefault("mla_sdpa", {})
    gen = torch.Generator(device="cuda").manual_seed(2)
    heads, queries = 96, 8192
    for keys in (8192, 16384):
        q = torch.randn(1, heads, queries, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(1, heads, keys, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(1, heads, keys, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        scale = 192 ** -0.5
        q_pos = torch.arange(keys - queries, keys, device="cuda")[:, None]
        mask = (torch.arange(keys, device="cuda")[None, :] <= q_pos)[None, None]
        flops = 2 * heads * (192 + 128) * (queries * keys - queries * (queries - 1) / 2)
        entry = res[f"{queries}x{keys}"] = {"TFLOP": flops / 1e12}
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        entry["mask_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))

        def record(name, fn, pad=False):
            try:
                out = fn()
                if pad:
                    out = out[..., :128]
                ms = bench(fn)
                entry[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9,
                               "err": float((out.float() - ref.float()).abs().max() / ref.float().abs().max())}
            except Exception as err:  # a backend refusing these shapes
                entry[name] = repr(err)[:200]

        v_pad = F.pad(v, (0, 64))
        if keys == queries:
            record("causal_default", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
                def run(backend=backend, value=v):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, value, is_causal=True, scale=scale)
                record(f"causal_{backend.name}", run)
            record("causal_FLASH_v_padded",
                   lambda: _with(SDPBackend.FLASH_ATTENTION, q, k, v_pad, scale, True), pad=True)
        else:
            bias = causal_lower_right(queries, keys)
            record("lower_right_default", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                                                 scale=scale))
            record("lower_right_FLASH_v_padded",
                   lambda: _with(SDPBackend.FLASH_ATTENTION, q, k, v_pad, scale, bias), pad=True)
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                def run(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                record(f"mask_{backend.name}", run)
        print("C", queries, keys, entry, flush=True)
        save()
        del q, k, v, v_pad, mask, ref
        torch.cuda.empty_cache()


def _with(backend, q, k, v, scale, causal):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        if causal is True:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale)


def part_d():
    res = results.setdefault("latent_attention", {})
    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, width, c = 96, 576, 512
    buffer = 131073
    latent = torch.randn(1, buffer, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(1, heads, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    mask = torch.ones(1, buffer, dtype=torch.bool, device="cuda")
    scale = 0.07
    configs = {"current_long": fused_triton.LATENT_CONFIGS["long"], "current_short": fused_triton.LATENT_CONFIGS["short"],
               "64_64_8_2_256": (64, 64, 8, 2, 256), "64_32_8_3_512": (64, 32, 8, 3, 512),
               "32_64_4_2_528": (32, 64, 4, 2, 528), "64_32_4_3_256": (64, 32, 4, 3, 256),
               "32_32_4_3_1056": (32, 32, 4, 3, 1056), "64_16_4_4_512": (64, 16, 4, 4, 512)}
    for position in (2048, 32768, 131072):
        pos = torch.tensor([position], device="cuda")
        keys = latent[:, : position + 1].float()
        s = torch.einsum("bhd,bkd->bhk", q.float(), keys) * scale
        ref = torch.einsum("bhk,bkc->bhc", s.softmax(-1), keys[..., :c])
        entry = res[str(position)] = {"floor_ms": (position + 1) * width * 2 / 4.25e9}

        def record(name, fn):
            try:
                out = fn()
                entry[name] = {"ms": bench(fn), "err": float((out.float() - ref).abs().max() / ref.abs().max())}
            except Exception as err:
                entry[name] = repr(err)[:300]

        record("old", lambda: old_fused_triton.latent_attention(q, latent, pos, mask, scale, c))
        record("old_2k_buffer" if position == 2048 else "old_own_buffer",
               lambda: old_fused_triton.latent_attention(q, latent[:, : position + 1], pos, mask, scale, c))
        saved = dict(fused_triton.LATENT_CONFIGS)
        for loop_while in (False, True):
            fused_triton.LATENT_LOOP_WHILE = loop_while
            for name, config in configs.items():
                fused_triton.LATENT_CONFIGS["long"] = fused_triton.LATENT_CONFIGS["short"] = config
                record(f"new_{'while' if loop_while else 'for'}_{name}",
                       lambda: fused_triton.latent_attention(q, latent, pos, mask, scale, c))
            fused_triton.LATENT_CONFIGS.update(saved)
        fused_triton.LATENT_LOOP_WHILE = False
        record("new_own_buffer", lambda: fused_triton.latent_attention(q, latent[:, : position + 1], pos, mask, scale,
                                                                       c))
        print("D", position, {k: (round(v["ms"], 4) if isinstance(v, dict) else v) for k, v in entry.items()
                              if k != "floor_ms"}, flush=True)
        save()


for part in (part_a, part_b, part_c, part_d):
    try:
        part()
    except Exception as err:  # report and go on with the next part
        results.setdefault("errors", {})[part.__name__] = repr(err)[:500]
        print(part.__name__, "failed:", repr(err)[:500], flush=True)
    torch.cuda.empty_cache()
    save()
print("done in", round(time.time() - started), "s")
