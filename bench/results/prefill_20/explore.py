"""Issue 20 exploration, as run on the H200 from the repository root (then named scratch_explore.py): KDA chunk drift, latent attention sweep, MoE prefill upcast-once, layer profile. Results: explore_call*.json."""
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]
OUT = os.environ.get("OUT", "/tmp")
RES = {}
T0 = time.time()


def save():
    RES["elapsed"] = time.time() - T0
    json.dump(RES, open(os.path.join(OUT, "explore.json"), "w"), indent=1, default=str)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


import kda  # noqa: E402
import modeling_kimi_k3 as M  # noqa: E402

kda.quick_tune(1)


def part_a():
    import test_gpu_paths as T
    model = T.small_model()
    out = {}
    orig = M.kda_forward
    for name, length in (("p10", 10), ("p512", 512)):
        torch.manual_seed(1)
        prompt = (torch.tensor([[11, 200, 37, 5, 91, 14, 3, 77, 123, 42]], device="cuda") if length == 10
                  else torch.randint(0, 250, (1, length), device="cuda"))
        captured = []

        def capture(*args, **kw):
            captured.append((args, kw))
            return orig(*args, **kw)

        M.kda_forward = capture
        with torch.no_grad(), M.use_fast_paths(model, **T.REFERENCE):
            model(prompt)
        M.kda_forward = orig
        rows = []
        for args, kw in captured:
            q, k, v, g_raw, beta_raw, A_log, dt_bias, lb, scale, init = args
            with torch.no_grad():
                g64 = kda.kda_gate(g_raw.double(), A_log.double(), dt_bias.double(), lb)
                truth_o, truth_s = kda.recurrent_kda(kda.l2norm(q.double()), kda.l2norm(k.double()), v.double(), g64,
                                                     torch.sigmoid(beta_raw.double()), scale)
                row = {"g_mean": float(g64.mean()), "g_min": float(g64.min()), "g_max": float(g64.max()),
                       "bf16_rounding_o": rel(truth_o.bfloat16(), truth_o)}
                variants = {
                    "torch": lambda: orig(q, k, v, g_raw, beta_raw, A_log, dt_bias, lb, scale, None, kernel=None),
                    "fla_recurrent": lambda: orig(q, k, v, g_raw, beta_raw, A_log, dt_bias, lb, scale, None,
                                                  kernel="recurrent"),
                    "fla_chunk_bf16": lambda: orig(q, k, v, g_raw, beta_raw, A_log, dt_bias, lb, scale, None,
                                                   kernel="chunk"),
                    "fla_chunk_bf16_nosafe": lambda: orig(q, k, v, g_raw, beta_raw, A_log, dt_bias, lb, scale, None,
                                                          kernel="chunk", safe_gate=False),
                    "fla_chunk_fp32": lambda: orig(q.float(), k.float(), v.float(), g_raw.float(), beta_raw.float(),
                                                   A_log, dt_bias, lb, scale, None, kernel="chunk"),
                    "fla_chunk_fp32_gate": lambda: orig(q, k, v, g_raw.float(), beta_raw, A_log, dt_bias, lb,
                                                        scale, None, kernel="chunk"),
                }
                for vname, fn in variants.items():
                    try:
                        o, s = fn()
                        row[vname] = {"o": rel(o, truth_o), "s": rel(s, truth_s)}
                    except Exception as e:
                        row[vname] = repr(e)[:300]
            rows.append(row)
        out[name] = rows
        print(name, json.dumps(rows[0])[:600], flush=True)
    RES["a_layers"] = out
    save()

    # greedy teacher-forced
    def fp32_chunk(*args, **kw):
        if kw.get("kernel") == "chunk":
            args = tuple(a.float() if i < 5 else a for i, a in enumerate(args))
        return orig(*args, **kw)

    greedy = {}
    for pname, plen in (("p10", 10), ("p300", 300)):
        torch.manual_seed(2)
        prompt = (torch.tensor([[11, 200, 37, 5, 91, 14, 3, 77, 123, 42]], device="cuda") if plen == 10
                  else torch.randint(0, 250, (1, plen), device="cuda"))
        for vname, (choices, patch) in {
            "reference": (dict(kda=False, kda_prefill=False), None),
            "fla_decode": (dict(kda=True, kda_prefill=False), None),
            "fla_prefill_bf16": (dict(kda=False, kda_prefill=True), None),
            "fla_prefill_fp32": (dict(kda=False, kda_prefill=True), fp32_chunk),
            "fla_both_bf16": (dict(kda=True, kda_prefill=True), None),
            "fla_both_fp32": (dict(kda=True, kda_prefill=True), fp32_chunk),
        }.items():
            try:
                if patch:
                    M.kda_forward = patch
                with torch.no_grad(), M.use_fast_paths(model, **choices):
                    fast = model.generate(prompt, max_new_tokens=64, do_sample=False)
                M.kda_forward = orig
                greedy[f"{pname}/{vname}"] = T.teacher_forced(model, prompt, fast)
            except Exception as e:
                M.kda_forward = orig
                greedy[f"{pname}/{vname}"] = repr(e)[:300]
            print(pname, vname, greedy[f"{pname}/{vname}"], flush=True)
    RES["a_greedy"] = greedy
    save()


def part_b():
    import triton
    import fused_triton as F
    heads, C, R = 96, 512, 64
    out = {}
    for ctx in (2048, 131072):
        keys = ctx + 256
        q = torch.randn(1, heads, C + R, device="cuda").bfloat16()
        latent = torch.randn(1, keys, C + R, device="cuda").bfloat16()
        pos = torch.tensor([ctx - 1], device="cuda")
        s = (q.float() @ latent[:, :ctx].float().mT) * 0.05
        ref = torch.softmax(s, -1) @ latent[:, :ctx, :C].float()
        row = {}
        base = F.latent_attention(q, latent, pos, None, 0.05, C)
        row["default"] = {"err": rel(base, ref)}

        def run(bh, bn, sw, warps, stages):
            groups = triton.cdiv(heads, bh)
            split = max(bn, triton.next_power_of_2(triton.cdiv(keys, max(1, sw // groups))))
            splits = triton.cdiv(keys, split)
            acc = torch.empty(1, splits, heads, C, dtype=torch.float32, device="cuda")
            ml = torch.empty(1, splits, heads, 2, dtype=torch.float32, device="cuda")
            o = torch.empty(1, heads, C, dtype=q.dtype, device="cuda")

            def go():
                F._latent_attention_split_kernel[(1, splits, groups)](
                    q, latent, pos, pos, acc, ml, heads, C, R, splits, q.stride(0), latent.stride(0), 0, 0.05,
                    SPLIT=split, BLOCK_H=bh, BLOCK_N=bn, BLOCK_C=512, BLOCK_R=64, HAS_VALID=False, IEEE=False,
                    num_warps=warps, num_stages=stages)
                F._latent_attention_combine_kernel[(1, heads, C // 64)](
                    acc, ml, pos, o, heads, C, split, splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_C=64,
                    num_warps=4)
                return o
            return go

        def timeit(fn, reps=50):
            fn(); torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record(); b.synchronize()
            return a.elapsed_time(b) / reps

        row["default"]["ms"] = timeit(lambda: F.latent_attention(q, latent, pos, None, 0.05, C))
        for bh, bn in ((32, 32), (32, 64), (64, 32), (16, 64), (64, 16)):
            for sw in (256, 1056):
                for warps, stages in ((4, 2), (8, 2), (8, 3)):
                    key = f"h{bh}_n{bn}_s{sw}_w{warps}_st{stages}"
                    try:
                        fn = run(bh, bn, sw, warps, stages)
                        o = fn()
                        row[key] = {"err": rel(o, ref), "ms": timeit(fn)}
                    except Exception as e:
                        row[key] = {"error": repr(e)[:200]}
        best = min((k for k in row if "ms" in row[k] and row[k].get("err", 1) < 2e-2), key=lambda k: row[k]["ms"])
        row["best"] = best
        row["bytes_floor_ms"] = ctx * (C + R) * 2 / 4.2e12 * 1e3
        out[str(ctx)] = row
        print(ctx, "default", row["default"], "best", best, row[best], flush=True)
        RES["b_latent"] = out
        save()


def part_c():
    import layer as L
    from configuration_kimi_k3 import KimiK3Config
    import mxfp4_triton as mt
    text = KimiK3Config.from_pretrained(ROOT).text_config
    layer = L.build_layer(text, 1, 0)
    moe = layer.block_sparse_moe
    stack = moe.stack_experts()
    out = {}
    for tokens in (2048, 4096, 8192, 16384):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
        with torch.no_grad():
            ids, weights = moe.gate(x)
            z = moe.routed_expert_down_proj(x)
            flops = 6 * ids.numel() * stack.latent * stack.inner
            row = {"pairs": ids.numel()}
            triton_run = lambda: mt.run_experts(stack, z, ids, weights, moe.num_experts, 4.0, 25.0, per_pair=True)  # noqa
            up_run = lambda: mt.run_experts_upcast_once(stack, z, ids, weights, moe.num_experts, 4.0, 25.0)  # noqa
            a = triton_run().sum(1)
            b = up_run().sum(1)
            if tokens <= 2048:
                ref = moe.routed_experts(z, ids, weights)
                row["triton_err"], row["upcast_err"] = rel(a, ref), rel(b, ref)
            row["upcast_vs_triton"] = rel(b, a)
            row["triton_ms"] = L.time_ms(triton_run, 5)
            row["upcast_ms"] = L.time_ms(up_run, 5)
            for name in ("triton", "upcast"):
                row[name + "_TFLOPs"] = flops / row[name + "_ms"] * 1e-9
            # parts
            w = torch.empty(32, 2 * stack.inner, stack.latent, dtype=torch.bfloat16, device="cuda")
            row["dequant32_w1_ms"] = L.time_ms(lambda: mt.dequantize(stack.w1[:32], stack.s1[:32], w[:, :stack.inner],
                                                                     out_rows=2 * stack.inner), 5)
            row["dequant32_w1_GBps"] = (stack.w1[:32].numel() * 5 + stack.s1[:32].numel()) / row["dequant32_w1_ms"] * 1e-6
            row["deq_exact"] = bool(torch.equal(
                mt.dequantize(stack.w1[:2], stack.s1[:2]).view(torch.int16),
                torch.stack([M.dequantize_unchecked(stack.w1[i], stack.s1[i], torch.bfloat16) for i in range(2)]).view(torch.int16)))
        out[str(tokens)] = row
        print(tokens, row, flush=True)
        RES["c_moe"] = out
        save()
        del a, b
    # exactness over all codes
    codes = torch.arange(256, device="cuda", dtype=torch.uint8).repeat_interleave(1).view(1, 256, 1).expand(1, 256, 4).contiguous()
    packed = torch.randint(0, 256, (1, 256, 64), device="cuda", dtype=torch.uint8)
    packed[0, :, :16] = torch.arange(256, device="cuda", dtype=torch.uint8)[:, None]
    got = mt.dequantize(packed, codes)
    ref = M.dequantize_unchecked(packed[0], codes[0], torch.bfloat16)
    same = (got[0].view(torch.int16) == ref.view(torch.int16)) | (got[0].isnan() & ref.isnan())
    RES["c_all_codes_exact"] = bool(same.all())
    RES["c_all_codes_mismatch_codes"] = sorted(set(torch.nonzero(~same)[:, 0].tolist()))[:40]
    print("all codes exact", RES["c_all_codes_exact"], RES["c_all_codes_mismatch_codes"], flush=True)
    save()
    return text


def part_e():
    heads, dim, tokens = 96, 128, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g_raw = (torch.randn(1, tokens, heads, dim, device="cuda", generator=gen).bfloat16() for _ in range(4))
    beta = torch.randn(1, tokens, heads, device="cuda", generator=gen).bfloat16()
    A_log = torch.randn(heads, device="cuda", generator=gen) * 0.5
    dt = torch.randn(heads * dim, device="cuda", generator=gen)
    import layer as L
    out = {}
    orig_forward = kda.kda_forward
    for name, kernel in (("recurrent", "recurrent"), ("chunk_fp32", "chunk")):
        fn = lambda: orig_forward(q, k, v, g_raw, beta, A_log, dt, -5.0, dim ** -0.5, kernel=kernel)  # noqa
        fn()
        out[name] = L.time_ms(fn, 10)
    RES["e_kda_core_8k_ms"] = out
    print("kda core 8k", out, flush=True)
    save()


def part_d(text):
    import layer as L
    import mxfp4_triton as mt
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for kind, index in (("kda", 1), ("mla", 3)):
        layer = L.build_layer(text, index, 0)
        tokens = 8192
        gen = torch.Generator(device="cuda").manual_seed(0)
        bank = tuple(torch.randn(1, tokens, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
                     for _ in range(4))
        partial = torch.randn(1, tokens, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
        step = lambda: layer(bank, partial, None, M.KimiK3Cache(text))[1]  # noqa
        for variant in ("default", "new"):
            mt.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT = 256 if variant == "new" else 10**9
            layer.dispatch.set(kda_prefill="on" if variant == "new" else "off")
            with torch.no_grad():
                o = step()
                ms = L.time_ms(step, 5)
                if variant == "default":
                    ref_o = o
                err = rel(o, ref_o)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step(); torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
            out[f"{kind}/{variant}"] = {"ms": ms, "tok_s": tokens / ms * 1e3, "err_vs_default": err}
            print(kind, variant, out[f"{kind}/{variant}"], flush=True)
            print(table, flush=True)
        layer.dispatch.set(kda_prefill="off")
        mt.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT = 256
        del layer
        torch.cuda.empty_cache()
    RES["d_layers"] = out
    save()


if __name__ == "__main__":
    parts = os.environ.get("PARTS", "a,b,c,d").split(",")
    text = None
    for p in parts:
        try:
            t = time.time()
            if p == "a":
                part_a()
            elif p == "b":
                part_b()
            elif p == "c":
                text = part_c()
            elif p == "e":
                part_e()
            elif p == "d":
                if text is None:
                    from configuration_kimi_k3 import KimiK3Config
                    text = KimiK3Config.from_pretrained(ROOT).text_config
                part_d(text)
            print(f"part {p} done in {time.time() - t:.0f}s", flush=True)
        except Exception:
            traceback.print_exc()
        save()
