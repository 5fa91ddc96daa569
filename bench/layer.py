"""One Kimi K3 decoder layer at the release's real shapes on one GPU: fast paths vs the torch reference.

Builds `KimiK3DecoderLayer(config.text_config, i, packed_experts=True)` from the root `config.json` (hidden 7168,
96 KDA heads x 128 or 96 MLA heads, 320 MXFP4 experts 3584 <-> 3072, top-16, 2 shared experts), random weights
(MXFP4 packs: random bytes, scale codes 114..123), for one KDA+MoE layer (index 1) and one MLA+MoE layer (index 3),
and measures:
  * decode step latency at batch 1 and 8 (fast eager, fast CUDA-graph replay, reference eager), next to the
    bandwidth floor = bytes the step must read and write / device-to-device copy bandwidth measured in this run
    (weights of the layer with only the routed experts actually chosen, KDA state or MLA latent cache);
  * the MoE block alone at decode (the issue's 1.5x / 2x targets) and its expert GEMMs at 8k prefill against the
    bf16 matmul rate measured in this run;
  * prefill tokens/s at 2k and 8k (fast and reference), next to max(bytes floor, FLOP floor);
  * a sweep of the MXFP4 kernel configurations;
then extrapolates to 93 layers (69 KDA + 24 MLA, layer 0's dense MLP counted as a MoE layer) plus the LM head and
prints the implied single-stream TPOT beside the model card's (38.8 ms TPOT, 24.7 tok/s, 8x RTX 6000, SGLang).

Usage: python -m bench.layer --out results.json [--quick] [--budget-s 240]. CUDA only. The reference path is the
model's own code with its experts, kda and fused fast paths switched off (the layer's `dispatch`): experts are
dequantized per call, KDA runs the pure-torch chunked / recurrent forms.
"""

import argparse
import os
import sys
import time
import traceback

import torch

if "--smoke" in sys.argv:  # the Triton kernels run in the interpreter on CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kda  # noqa: E402
import mxfp4_triton  # noqa: E402
from bench import common  # noqa: E402
from bench.common import (CARD, RouteRecorder, Timer, build_layer, ceilings, decode_cache, expert_bytes,  # noqa: E402
                          graph_of, layer_flops, nbytes, non_expert_bytes, package_version, sync, time_ms)
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3_dispatch import resolve_fast_paths, use_fast_paths  # noqa: E402
from modeling_kimi_k3 import KimiK3Cache  # noqa: E402

KDA_LAYERS, MLA_LAYERS = 69, 24
CONTEXT = 2048  # cached tokens behind each decode step (--smoke: 16)


def set_fast(layer, on):
    """The layer's expert, KDA and fused-op fast paths at their defaults (on) or off (its reference code)."""
    layer.dispatch.set(**dict.fromkeys(("experts", "kda", "fused"), "auto" if on else "off"))


def one_stream(layer, capture, reps, side_out):
    """Milliseconds a replay of `capture()`'s graph takes with the layer's side streams off (everything queued on
    one stream, in order), and whether its output equals `side_out`, the same step's with them on."""
    with use_fast_paths(layer, side_streams="off"):
        graph, out = capture()
        graph.replay()
        sync()
        return time_ms(graph.replay, reps), bool(torch.equal(out, side_out))


def bench_decode(text, layer, batch, ceil, reps, seed, context=CONTEXT):
    """One decode step of `layer` at `batch` (`context` cached MLA latents): reference eager, fast eager, fast graph
    (side streams on and off), and its MoE block alone, each beside its bytes floor."""
    hidden, device = text.hidden_size, common.DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    bank = tuple(torch.randn(batch, 1, hidden, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(4))
    partial = torch.randn(batch, 1, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    cache, reset, state_bytes = decode_cache(text, layer, batch, seed, context)
    recorder = RouteRecorder(layer.block_sparse_moe.gate)
    moe = layer.block_sparse_moe
    moe_in = torch.randn(batch, 1, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    res = {"batch": batch}
    try:
        with torch.no_grad():
            step = lambda: layer(bank, partial, None, cache)[1]  # noqa: E731
            set_fast(layer, False)
            reset()
            ref_out = step()
            res["reference_eager_ms"] = time_ms(step, max(2, reps // 8), setup=reset)
            set_fast(layer, True)
            reset()
            fast_out = step()
            unique = recorder.unique()
            res["unique_experts"] = unique
            diff = (fast_out.float() - ref_out.float()).norm()
            res["fast_vs_reference_rel_err"] = float(diff / ref_out.float().norm())
            res["fast_eager_ms"] = time_ms(step, reps, setup=reset)
            floor_bytes = non_expert_bytes(layer) + unique * expert_bytes(layer) + state_bytes
            res["floor_bytes"] = floor_bytes
            res["floor_ms"] = floor_bytes / (ceil["copy_bandwidth_GBps"] * 1e9) * 1e3
            try:
                graph, out = graph_of(step, reset)
                graph.replay()
                sync()
                res["graph_vs_eager_max_abs_diff"] = float((out.float() - fast_out.float()).abs().max())
                res["fast_graph_ms"] = time_ms(graph.replay, reps)
                res["graph_fraction_of_floor"] = res["floor_ms"] / res["fast_graph_ms"]
                del graph
                res["fast_graph_one_stream_ms"], same = one_stream(layer, lambda: graph_of(step, reset), reps, out)
                res["one_stream_output_identical"] = same
            except Exception as err:  # report, keep going
                res["graph_error"] = repr(err)[:500]
            # the MoE block alone
            moe_step = lambda: moe(moe_in)  # noqa: E731
            moe_step()
            unique = recorder.unique()
            moe_floor = non_expert_bytes(moe) + unique * expert_bytes(layer)
            res["moe"] = {"unique_experts": unique, "floor_bytes": moe_floor,
                          "floor_ms": moe_floor / (ceil["copy_bandwidth_GBps"] * 1e9) * 1e3,
                          "fast_eager_ms": time_ms(moe_step, reps)}
            try:
                graph, out = graph_of(moe_step, lambda: None)
                res["moe"]["fast_graph_ms"] = time_ms(graph.replay, reps)
                del graph
                capture = lambda: graph_of(moe_step, lambda: None)  # noqa: E731
                res["moe"]["fast_graph_one_stream_ms"], same = one_stream(layer, capture, reps, out)
                res["moe"]["one_stream_output_identical"] = same
            except Exception as err:
                res["moe"]["graph_error"] = repr(err)[:500]
            set_fast(layer, False)
            res["moe"]["reference_eager_ms"] = time_ms(moe_step, max(2, reps // 8))
            set_fast(layer, True)
            best = res["moe"].get("fast_graph_ms", res["moe"]["fast_eager_ms"])
            res["moe"]["x_floor"] = best / res["moe"]["floor_ms"]
    finally:
        set_fast(layer, True)
        recorder.handle.remove()
    return res


def bench_prefill(text, layer, tokens, ceil, reps, seed, with_reference=True):
    hidden, device = text.hidden_size, common.DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    bank = tuple(torch.randn(1, tokens, hidden, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(4))
    partial = torch.randn(1, tokens, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    res = {"tokens": tokens}
    flops = layer_flops(layer, tokens)
    floor_bytes = non_expert_bytes(layer) + layer.block_sparse_moe.num_experts * expert_bytes(layer)
    res["flop_floor_ms"] = flops / (ceil["bf16_matmul_TFLOPs"] * 1e12) * 1e3
    res["bytes_floor_ms"] = floor_bytes / (ceil["copy_bandwidth_GBps"] * 1e9) * 1e3
    res["floor_ms"] = max(res["flop_floor_ms"], res["bytes_floor_ms"])
    with torch.no_grad():
        step = lambda: layer(bank, partial, None, KimiK3Cache(text))[1]  # noqa: E731
        set_fast(layer, True)
        fast_out = step()
        res["fast_ms"] = time_ms(step, reps)
        res["fast_tok_s"] = tokens / (res["fast_ms"] * 1e-3)
        res["fast_fraction_of_floor"] = res["floor_ms"] / res["fast_ms"]
        if with_reference:
            set_fast(layer, False)
            try:
                with Timer() as t:
                    ref_out = step()  # one timed run: the reference is slow and has no compile step to warm up
                res["reference_ms"] = t.ms
                res["reference_tok_s"] = tokens / (res["reference_ms"] * 1e-3)
                res["fast_vs_reference_rel_err"] = float(
                    (fast_out.float() - ref_out.float()).norm() / ref_out.float().norm())
                del ref_out
            finally:
                set_fast(layer, True)
    return res


def routed_inputs(text, moe, tokens, seed):
    """The routed experts' inputs for `tokens` random hidden states through the block's router and latent
    projection: (expert stacks, latents z, expert ids, weights)."""
    gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
    x = torch.randn(tokens, text.hidden_size, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
    with torch.no_grad():
        ids, weights = moe.gate(x)
        z = moe.routed_expert_down_proj(x)
    return moe.stack_experts(), z, ids, weights


def bench_expert_gemms(text, layer, tokens, ceil, reps, seed, configs=None):
    """The two MXFP4 kernels alone at `tokens` tokens with the layer's routing; TFLOP/s vs the bf16 rate."""
    moe = layer.block_sparse_moe
    stack, z, ids, weights = routed_inputs(text, moe, tokens, seed)
    e = moe.experts[0]
    flops = 6 * ids.numel() * e.w1.in_features * e.w1.out_features
    out = {"tokens": tokens, "pairs": ids.numel(), "flops": flops}
    align_cfg = mxfp4_triton.pick_config(ids.numel(), moe.num_experts)
    out["align_ms"] = time_ms(lambda: mxfp4_triton.align_blocks(ids, moe.num_experts, align_cfg["BM"]), reps)
    if ids.numel() <= mxfp4_triton.ALIGN_KERNEL_MAX_PAIRS:  # what run_experts takes at such sizes
        out["align_kernel_ms"] = time_ms(lambda: mxfp4_triton.align_blocks_fused(ids, moe.num_experts,
                                                                                 align_cfg["BM"]), reps)
    variants = configs or {"default": None}
    ref = reference_routed(moe, z, ids, weights) if configs else None
    for name, cfg in variants.items():
        try:
            run = lambda: mxfp4_triton.run_experts(stack, z, ids, weights, moe.num_experts, 4.0, 25.0,  # noqa
                                                   config=cfg)
            got = run()
            ms = time_ms(run, reps)
            out[name] = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12,
                         "fraction_of_bf16_peak": flops / (ms * 1e-3) / (ceil["bf16_matmul_TFLOPs"] * 1e12)}
            if ref is not None:
                out[name]["rel_err"] = float((got - ref).norm() / ref.norm())
            del got
        except Exception as err:
            out[name] = {"error": repr(err)[:400]}
    return out


def sweep_decode(text, layer, batch, ceil, reps, seed, configs):
    """MXFP4 kernels alone at decode (batch tokens, top-16) per configuration, against their bytes floor."""
    moe = layer.block_sparse_moe
    stack, z, ids, weights = routed_inputs(text, moe, batch, seed)
    unique = int(ids.unique().numel())
    floor_ms = unique * expert_bytes(layer) / (ceil["copy_bandwidth_GBps"] * 1e9) * 1e3
    out = {"batch": batch, "unique_experts": unique, "floor_ms": floor_ms}
    ref = reference_routed(moe, z, ids, weights)
    for name, cfg in configs.items():
        try:
            run = lambda: mxfp4_triton.run_experts(stack, z, ids, weights, moe.num_experts, 4.0, 25.0,  # noqa
                                                   config=cfg)
            got = run()
            rel_err = float((got - ref).norm() / ref.norm())
            if common.DEVICE == "cuda":
                graph, _ = graph_of(run, lambda: None)
                ms = time_ms(graph.replay, reps)
                del graph
            else:
                ms = time_ms(run, reps)
            out[name] = {"graph_ms": ms, "x_floor": ms / floor_ms, "rel_err": rel_err}
            if common.DEVICE == "cuda" and batch == 1:  # the same launch with all 16 pairs on one expert, whose
                # 16.5 MB stay in L2: how long the kernels take when DRAM bandwidth is not what they wait for
                same = torch.zeros_like(ids)
                graph, _ = graph_of(lambda: mxfp4_triton.run_experts(stack, z, same, weights, moe.num_experts, 4.0,
                                                                     25.0, config=cfg), lambda: None)
                out[name]["one_expert_L2_graph_ms"] = time_ms(graph.replay, reps)
                del graph
        except Exception as err:
            out[name] = {"error": repr(err)[:400]}
    return out


def _cfg(bm, w13, w2, upcast, atomic=False, fast_math=False):
    return dict(BM=bm, w13=w13, w2=w2, upcast=upcast, atomic=atomic, fast_math=fast_math)


# Swept on the H200 (bench/results/layer_h200.md), the rest dropped over the sessions: inline-PTX and fp32-dequant
# upcasts, fp16 operands via E4M3, CUDA-core GEMV kernels, other tiles. Decode: blocks of 8 or 16 pairs.
DECODE_VARIANTS = {
    "dot_scaled_fastmath_w2_s3": _cfg(16, (32, 128, 2, 3), (32, 128, 2, 3), "dot_scaled", fast_math=True),
    "lop3_w2_bk256": _cfg(16, (32, 256, 2, 3), (32, 256, 2, 3), "lop3"),
    "lop3_bm8_w2_bk256": _cfg(8, (32, 256, 2, 3), (32, 256, 2, 3), "lop3"),
    "lop3_bm8_w2_bk256_s4": _cfg(8, (32, 256, 2, 4), (32, 256, 2, 4), "lop3"),
    "lop3_bm8_w1_bn16_bk256": _cfg(8, (16, 256, 1, 3), (16, 256, 1, 3), "lop3"),
    "lop3_bm8_w4_bn64_bk256": _cfg(8, (64, 256, 4, 3), (64, 256, 4, 3), "lop3"),
    "lop3_bm4_w2_bk256": _cfg(4, (32, 256, 2, 3), (32, 256, 2, 3), "lop3"),
}
PREFILL_VARIANTS = {
    "dot_scaled_bm128_fastmath": _cfg(128, (128, 128, 8, 3), (128, 128, 8, 3), "dot_scaled", fast_math=True),
    "dot_scaled_bm128_atomic": _cfg(128, (128, 128, 8, 3), (128, 128, 8, 3), "dot_scaled", atomic=True),
    "lop3_bm128": _cfg(128, (128, 128, 8, 3), (128, 128, 8, 3), "lop3"),
    "lop3_bm128_bk64": _cfg(128, (128, 64, 8, 3), (128, 64, 8, 3), "lop3"),
}


def reference_routed(moe, z, ids, weights):
    """The model's own routed-expert loop (experts dequantized per call), fp32 [N, L]."""
    y = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    with torch.no_grad():
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, token, moe.experts[e](z[token]).float() * weights[token, slot, None])
    return y


def choose(sweep, key, tolerance=2e-2):
    """The fastest variant of a sweep whose output matched the reference."""
    good = {k: v for k, v in sweep.items() if isinstance(v, dict) and key in v and v.get("rel_err", 1) < tolerance}
    return min(good, key=lambda k: good[k][key]) if good else None


def bench_kda_core(tokens, reps, seed):
    """fla chunk_kda at the release's head shape, safe_gate on and off, against the fp32 torch reference."""
    device = common.DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, dim = 96, 128
    q, k, v, g_raw = (torch.randn(1, tokens, heads, dim, device=device, generator=gen).to(torch.bfloat16)
                      for _ in range(4))
    beta_raw = torch.randn(1, tokens, heads, device=device, generator=gen).to(torch.bfloat16)
    A_log = torch.randn(heads, device=device, generator=gen) * 0.5
    dt_bias = torch.randn(heads * dim, device=device, generator=gen)
    out = {"tokens": tokens}
    with torch.no_grad():
        g = kda.kda_gate(g_raw, A_log, dt_bias, -5.0)
        with Timer() as t:
            ref_o, ref_s = kda.chunk_kda(kda.l2norm(q.float()), kda.l2norm(k.float()), v.float(), g,
                                         torch.sigmoid(beta_raw.float()), scale=dim**-0.5)
        out["reference_ms"] = t.ms
        for safe in (True, False):
            run = lambda: kda.kda_forward(q, k, v, g_raw, beta_raw, A_log, dt_bias, -5.0,  # noqa: E731
                                          dim**-0.5, kernel="chunk", safe_gate=safe)
            o, state = run()
            out["safe_gate" if safe else "no_safe_gate"] = {
                "ms": time_ms(run, reps), "o_rel_err": float((o.float() - ref_o).norm() / ref_o.norm()),
                "state_rel_err": float((state - ref_s).norm() / ref_s.norm())}
    return out


def lm_head_ms(text, reps, batch):
    w = torch.randn(text.vocab_size, text.hidden_size, device=common.DEVICE, dtype=torch.bfloat16) * 0.02
    x = torch.randn(batch, text.hidden_size, device=common.DEVICE, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.nn.functional.linear(x, w), reps, warmup=3)
    return ms, nbytes([w])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "layer_h200.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="skip sections once past this")
    parser.add_argument("--sections", default="sweep,psweep,kda,decode,prefill",
                        help="comma list: sweep / psweep (MXFP4 kernel variants at decode / prefill; the fastest "
                             "correct one is then used), "
                             "kda (fla chunk_kda safe_gate on/off), decode, prefill")
    parser.add_argument("--variants", default=None,
                        help="comma list of DECODE_VARIANTS / PREFILL_VARIANTS names to sweep (default: all)")
    parser.add_argument("--no-prefill-reference", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="dry run on CPU at tiny shapes (reference path; kernels in the Triton interpreter)")
    args = parser.parse_args(argv)
    context = CONTEXT
    if args.smoke:
        common.DEVICE, context = "cpu", 16
    elif not torch.cuda.is_available():
        print("bench.layer needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    started = time.time()
    sections = set(args.sections.split(","))
    if args.variants:
        keep = set(args.variants.split(","))
        for variants in (DECODE_VARIANTS, PREFILL_VARIANTS):
            for name in set(variants) - keep:
                del variants[name]
    reps = 3 if args.smoke else 10 if args.quick else 30
    quick_tune = common.quick_tune_from_env()
    import triton

    results = {
        "device": torch.cuda.get_device_name(0) if common.DEVICE == "cuda" else "cpu (smoke run)",
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "fla": package_version("fla-core"), "transformers": package_version("transformers")},
        "fast_paths": {"resolved": str(resolve_fast_paths({}, common.DEVICE)),
                       "mxfp4_configs": mxfp4_triton.CONFIGS, "upcast": mxfp4_triton.UPCAST,
                       "atomic_combine": mxfp4_triton.ATOMIC_COMBINE,
                       "fla_quick_tune": quick_tune},
        "context_tokens_for_decode": context,
        "card": CARD,
        "layers": {},
    }

    def save():
        results["elapsed_s"] = time.time() - started
        common.write_json(args.out, results)

    def over_budget():
        return time.time() - started > args.budget_s

    ceil = ceilings(args.quick)
    results["ceilings"] = ceil
    print(f"ceilings: copy {ceil['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} "
          f"TFLOP/s", flush=True)
    save()
    if args.smoke:
        from reap_tools.tiny import tiny_config

        text = tiny_config(packed=True, routed_expert_hidden_size=64, moe_intermediate_size=64, num_experts=16,
                           num_experts_per_token=4).text_config
        layer_indices, prefill_lengths = (("kda", 1), ("mla", 2)), (16, 40)
    else:
        text = KimiK3Config.from_pretrained(common.ROOT).text_config
        layer_indices, prefill_lengths = (("kda", 1), ("mla", 3)), (2048, 8192)
    for kind, index in layer_indices:
        if over_budget():
            results["layers"][kind] = {"skipped": "time budget"}
            break
        entry = results["layers"].setdefault(kind, {"layer_idx": index})
        try:
            t0 = time.time()
            layer = build_layer(text, index, seed=index)
            entry["build_s"] = time.time() - t0
            entry["non_expert_bytes"] = non_expert_bytes(layer)
            entry["expert_bytes_each"] = expert_bytes(layer)
            if kind == "kda" and "sweep" in sections and not over_budget():
                for batch in (1, 8):
                    r = sweep_decode(text, layer, batch, ceil, reps, seed=11 + batch, configs=DECODE_VARIANTS)
                    results[f"mxfp4_decode_sweep_b{batch}"] = r
                    print(f"decode sweep b{batch}:", {k: (round(v["graph_ms"], 4), round(v["rel_err"], 4))
                                                      if isinstance(v, dict) and "graph_ms" in v else v
                                                      for k, v in r.items()}, flush=True)
                    save()
                totals = {}
                for name in DECODE_VARIANTS:
                    rows = [results[f"mxfp4_decode_sweep_b{b}"].get(name, {}) for b in (1, 8)]
                    if all("graph_ms" in r and r["rel_err"] < 2e-2 for r in rows):
                        totals[name] = sum(r["x_floor"] for r in rows)
                if totals:
                    best = min(totals, key=totals.get)
                    results["chosen_decode_config"] = {"name": best, **DECODE_VARIANTS[best]}  # reported, not applied
                save()
            if kind == "kda" and "psweep" in sections and not over_budget():
                r = bench_expert_gemms(text, layer, prefill_lengths[-1], ceil, max(3, reps // 5), seed=7,
                                       configs=PREFILL_VARIANTS)
                results["mxfp4_prefill_sweep"] = r
                print("prefill sweep:", {k: (round(v["TFLOPs"], 1), round(v.get("rel_err", -1), 4))
                                         if isinstance(v, dict) and "TFLOPs" in v else v for k, v in r.items()},
                      flush=True)
                best = choose(r, "ms")
                if best:
                    results["chosen_prefill_config"] = {"name": best, **PREFILL_VARIANTS[best]}
                results["fast_paths"]["mxfp4_configs_used"] = mxfp4_triton.CONFIGS
                save()
            if kind == "kda" and "kda" in sections and not over_budget():
                r = bench_kda_core(prefill_lengths[-1], max(3, reps // 5), seed=5)
                results["kda_core"] = r
                print("kda core:", r, flush=True)
                save()
            if "decode" in sections:
                for batch in (1, 8):
                    if over_budget():
                        break
                    r = bench_decode(text, layer, batch, ceil, reps, seed=batch, context=context)
                    entry[f"decode_b{batch}"] = r
                    print(f"[{kind}] decode b{batch}: fast {r.get('fast_graph_ms', float('nan')):.3f} ms graph / "
                          f"{r['fast_eager_ms']:.3f} eager, floor {r['floor_ms']:.3f}, "
                          f"ref {r['reference_eager_ms']:.2f};"
                          f" moe {r['moe'].get('fast_graph_ms', float('nan')):.3f} vs floor {r['moe']['floor_ms']:.3f}"
                          f" ({r['moe']['x_floor']:.2f}x)", flush=True)
                    save()
            if "prefill" in sections:
                for tokens in prefill_lengths:
                    if over_budget():
                        break
                    r = bench_prefill(text, layer, tokens, ceil, max(3, reps // 10), seed=tokens,
                                      with_reference=not args.no_prefill_reference)
                    entry[f"prefill_{tokens}"] = r
                    print(f"[{kind}] prefill {tokens}: fast {r['fast_tok_s']:.0f} tok/s ({r['fast_ms']:.1f} ms, floor "
                          f"{r['floor_ms']:.1f}), ref {r.get('reference_tok_s', float('nan')):.0f} tok/s", flush=True)
                    save()
            if kind == "kda" and not over_budget():
                r = bench_expert_gemms(text, layer, prefill_lengths[-1], ceil, max(3, reps // 5), seed=7)
                results["expert_gemms_8k"] = r
                print("expert GEMMs 8k (chosen config):", {k: (round(v["TFLOPs"], 1) if isinstance(v, dict) and
                                                                "TFLOPs" in v else v) for k, v in r.items()},
                      flush=True)
                save()
            del layer
        except Exception:
            entry["error"] = traceback.format_exc()[-3000:]
            print(f"[{kind}] FAILED:\n{entry['error']}", flush=True)
        torch.cuda.empty_cache()
        save()
    try:
        for batch in (1, 8):
            ms, b = lm_head_ms(text, reps, batch)
            results[f"lm_head_b{batch}"] = {"ms": ms, "floor_ms": b / (ceil["copy_bandwidth_GBps"] * 1e9) * 1e3}
    except Exception as err:
        results["lm_head_error"] = repr(err)
    results["extrapolation"] = extrapolate(results)
    save()
    print_summary(results)
    return 0


def extrapolate(results):
    """93 layers (69 KDA + 24 MLA) + LM head, batch 1 and 8, from the per-layer decode steps."""
    layers = results["layers"]
    out = {}
    for batch in (1, 8):
        kda, mla = layers.get("kda", {}).get(f"decode_b{batch}"), layers.get("mla", {}).get(f"decode_b{batch}")
        head = results.get(f"lm_head_b{batch}")
        if not (kda and mla and head):
            continue
        row = {}
        for label, key in (("graph", "fast_graph_ms"), ("eager", "fast_eager_ms"), ("reference", "reference_eager_ms"),
                           ("floor", "floor_ms")):
            if key in kda and key in mla:
                head_ms = head["floor_ms"] if label == "floor" else head["ms"]
                tpot = KDA_LAYERS * kda[key] + MLA_LAYERS * mla[key] + head_ms
                row[label] = {"tpot_ms": tpot, "tok_s_per_stream": 1e3 / tpot}
        out[f"b{batch}"] = row
    return out


def print_summary(results):
    print("\n=== one layer, one H200 ===")
    for kind, entry in results["layers"].items():
        for key, r in entry.items():
            if key.startswith("decode_b"):
                print(f"{kind} {key}: graph {r.get('fast_graph_ms', float('nan')):.3f} ms | eager "
                      f"{r['fast_eager_ms']:.3f} | reference {r['reference_eager_ms']:.2f} | floor {r['floor_ms']:.3f}"
                      f" ({r.get('graph_fraction_of_floor', float('nan')):.0%} of floor)"
                      f" | experts {r['unique_experts']}"
                      f" | moe {r['moe'].get('fast_graph_ms', float('nan')):.3f} vs {r['moe']['floor_ms']:.3f}"
                      f" = {r['moe']['x_floor']:.2f}x floor"
                      f" | one stream: layer {r.get('fast_graph_one_stream_ms', float('nan')):.3f} ms, moe "
                      f"{r['moe'].get('fast_graph_one_stream_ms', float('nan')):.3f} ms (same output: "
                      f"{r.get('one_stream_output_identical')}/{r['moe'].get('one_stream_output_identical')})")
            elif key.startswith("prefill_"):
                print(f"{kind} {key}: fast {r['fast_tok_s']:.0f} tok/s ({r['fast_fraction_of_floor']:.0%} of floor"
                      f" {r['floor_ms']:.1f} ms) | reference {r.get('reference_tok_s', float('nan')):.0f} tok/s")
    for batch in (1, 8):
        sweep = results.get(f"mxfp4_decode_sweep_b{batch}")
        if sweep:
            print(f"MXFP4 routed experts alone, decode b{batch} ({sweep['unique_experts']} experts, floor "
                  f"{sweep['floor_ms']:.3f} ms), CUDA graph:")
            for name, v in sweep.items():
                if isinstance(v, dict):
                    l2 = (f"; all pairs on one expert (L2-resident) {v['one_expert_L2_graph_ms']:.3f} ms"
                          if "one_expert_L2_graph_ms" in v else "")
                    print(f"   {name}: " + (f"{v['graph_ms']:.3f} ms = {v['x_floor']:.2f}x floor, rel err "
                                            f"{v['rel_err']:.1e}{l2}" if "graph_ms" in v
                                            else v.get("error", "")[:200]))
    sweep = results.get("mxfp4_prefill_sweep")
    if sweep:
        print(f"MXFP4 routed experts alone, prefill {sweep['tokens']} tokens ({sweep['pairs']} pairs):")
        for name, v in sweep.items():
            if isinstance(v, dict):
                print(f"   {name}: " + (f"{v['ms']:.2f} ms = {v['TFLOPs']:.0f} TFLOP/s = "
                                        f"{v['fraction_of_bf16_peak']:.0%}"
                                        f" of bf16, rel err {v.get('rel_err', float('nan')):.1e}" if "ms" in v
                                        else v.get("error", "")[:200]))
    for key in ("chosen_decode_config", "chosen_prefill_config", "kda_core"):
        if key in results:
            print(f"{key}: {results[key]}")
    g = results.get("expert_gemms_8k")
    if g:
        for name, v in g.items():
            if isinstance(v, dict) and "TFLOPs" in v:
                print(f"expert GEMMs 8k {name}: {v['TFLOPs']:.0f} TFLOP/s = {v['fraction_of_bf16_peak']:.0%} of bf16")
    for batch, row in results.get("extrapolation", {}).items():
        parts = " | ".join(f"{k} {v['tpot_ms']:.1f} ms ({v['tok_s_per_stream']:.1f} tok/s)" for k, v in row.items())
        print(f"93 layers + lm_head, {batch}: {parts} | card: {CARD['tpot_ms']} ms ({CARD['tok_s']} tok/s), "
              f"{CARD['setup']}")
    print(f"elapsed {results.get('elapsed_s', 0):.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
