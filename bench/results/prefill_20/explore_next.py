"""Issue 20, fourth exploration (session of 2026-12-04), measurements only, for the next step: run from the
repository root on the committed tree; writes JSON to the path given.

  A. where a KDA + MoE and an MLA + MoE layer spend an 8192-token prompt now (torch profiler, CUDA time per kernel);
  B. the expert upcast (`mxfp4_triton._dequant_kernel`) at other bytes per program and warps than the shipped
     1024 / 4, on one 2 GiB chunk (32 experts' w1, [3072, 1792 B]);
  C. a later prompt chunk's MLA attention (8192 queries after 8192 cached keys) as two cuDNN calls merged by their
     log-sum-exp (the cached keys unmasked, the chunk's own causal) against the masked call the model makes.
"""

import json
import os
import sys
import time

import torch
from triton.testing import do_bench

ROOT = os.getcwd()
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import layer as bench_layer  # noqa: E402
import mxfp4_triton  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from modeling_kimi_k3 import KimiK3Cache  # noqa: E402

OUT = sys.argv[1]
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
started = time.time()


def save():
    results["elapsed_s"] = time.time() - started
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)


def part_a(text):
    from torch.profiler import ProfilerActivity, profile

    tokens = 8192
    for kind, index in (("kda", 1), ("mla", 3)):
        layer = bench_layer.build_layer(text, index, seed=index)
        gen = torch.Generator(device="cuda").manual_seed(0)
        bank = tuple(torch.randn(1, tokens, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
                     for _ in range(4))
        partial = torch.randn(1, tokens, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
        step = lambda: layer(bank, partial, None, KimiK3Cache(text))[1]  # noqa: E731
        with torch.no_grad():
            step()
            ms = bench_layer.time_ms(step, 5)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()),
                         key=lambda r: -r[1])
        results[f"profile_{kind}"] = {"ms": ms, "kernels_ms": [[k[:90], round(t, 3), n] for k, t, n in kernels[:25]]}
        print(kind, round(ms, 2), "ms", flush=True)
        for k, t, n in kernels[:25]:
            print(f"   {t:7.3f} ms {n:3d}x {k[:100]}", flush=True)
        save()
        del layer
        torch.cuda.empty_cache()


def part_b():
    gen = torch.Generator(device="cuda").manual_seed(1)
    experts, rows, half = 32, 3072, 1792
    packed = torch.randint(0, 256, (experts, rows, half), device="cuda", generator=gen, dtype=torch.uint8)
    codes = torch.randint(110, 130, (experts, rows, half // 16), device="cuda", generator=gen, dtype=torch.uint8)
    want = mxfp4_triton.dequantize(packed, codes)
    moved = packed.numel() + codes.numel() + want.numel() * 2
    entry = results["dequant_w1_chunk"] = {"GB_moved": moved / 1e9}
    for block in (512, 1024, 2048):
        for warps in (2, 4, 8):
            out = torch.empty_like(want)

            def run():
                mxfp4_triton._dequant_kernel[(experts * rows, -(-half // block))](
                    packed, codes, out.view(torch.int32), HALF=half, ROWS=rows, OUT_ROWS=rows, BLOCK=block,
                    num_warps=warps)

            run()
            ms = do_bench(run, warmup=10, rep=60, return_mode="median")
            entry[f"block{block}_warps{warps}"] = {"ms": ms, "TBps": moved / ms / 1e9,
                                                   "equal": bool(torch.equal(out, want))}
    print("B", {k: (round(v["ms"], 4), round(v["TBps"], 2)) for k, v in entry.items() if isinstance(v, dict)},
          flush=True)
    save()


def part_c():
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(2)
    heads, queries, past = 96, 8192, 8192
    keys = past + queries
    q = torch.randn(1, heads, queries, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, heads, keys, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, heads, keys, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = 192 ** -0.5
    mask = (torch.arange(keys, device="cuda")[None, :] <= torch.arange(past, keys, device="cuda")[:, None])[None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    entry = results["later_chunk_attention"] = {
        "mask_ms": do_bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                            warmup=5, rep=40, return_mode="median")}
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention

    def merged():
        o1, lse1 = cudnn(q, k[:, :, :past], v[:, :, :past], None, True, 0.0, False, False, scale=scale)[:2]
        o2, lse2 = cudnn(q, k[:, :, past:], v[:, :, past:], None, True, 0.0, True, False, scale=scale)[:2]
        lse1, lse2 = lse1.view(1, heads, queries, 1), lse2.view(1, heads, queries, 1)
        lse = torch.logaddexp(lse1, lse2)
        return (o1.float() * (lse1 - lse).exp() + o2.float() * (lse2 - lse).exp()).to(q.dtype)

    try:
        got = merged()
        entry["merged_ms"] = do_bench(merged, warmup=5, rep=40, return_mode="median")
        entry["merged_err"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    except Exception as err:
        entry["merged_error"] = repr(err)[:400]
    print("C", entry, flush=True)
    save()


text = KimiK3Config.from_pretrained(ROOT).text_config
for part in (lambda: part_a(text), part_b, part_c):
    try:
        part()
    except Exception as err:  # report and go on with the next part
        results.setdefault("errors", []).append(repr(err)[:500])
        print("failed:", repr(err)[:500], flush=True)
    torch.cuda.empty_cache()
    save()
print("done in", round(time.time() - started), "s")
