"""Prefill and long-context decode on one H200, from one real-width layer of each kind (as `bench/layer.py`).

  * layer prefill: a KDA + MoE, an MLA + MoE and the dense layer 0, random weights at the release's shapes, default
    fast paths, a prompt of 2048 / 8192 / 32768 tokens fed as the model feeds it (chunks of
    `KimiK3TextModel.prefill_chunk_size` through a cache); tokens/s beside the layer's floor (max of matmul FLOPs /
    the bf16 rate and bytes / copy bandwidth, both measured in this run);
  * whole-model prefill, extrapolated: layer 0 + 68 KDA + 24 MLA layers;
  * a 131,072-token prompt through one layer of each kind (chunked), with the peak GPU memory it took;
  * decode TPOT by context: one-token CUDA-graph steps of the KDA layer and of the MLA layer over a cache of 2048 /
    32768 / 131072 latents (a static cache sized to the context), extrapolated to 69 KDA + 24 MLA layers + LM head.

    python bench/prefill.py --out bench/results/prefill_h200.json [--quick] [--baseline]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fused_triton  # noqa: E402
import kda  # noqa: E402
import mxfp4_triton  # noqa: E402
import layer as bench_layer  # noqa: E402  (bench/layer.py: layer builder, decode benchmark, floors, timers)
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from modeling_kimi_k3 import KimiK3Cache, KimiK3TextModel  # noqa: E402

CARD = {"prefill_tok_s": 1880, "tpot_ms_32k": 38.8, "tok_s_131k": 15.7, "setup": "8x RTX 6000, SGLang (model card)"}
KDA_MOE_LAYERS, MLA_MOE_LAYERS = 68, 24  # and the dense layer 0 (KDA)
PREFILL_LENGTHS, LONG_PROMPT, CONTEXTS = (2048, 8192, 32768), 131072, (2048, 32768, 131072)


def prefill_ms(text, layer, tokens, reps, seed):
    """Median ms of a `tokens`-token prompt through `layer`, chunked as the model chunks it, and the peak GPU memory
    (bytes above what was allocated before) of one run."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, chunk = text.hidden_size, KimiK3TextModel.prefill_chunk_size
    bank = tuple(torch.randn(1, tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    partial = torch.randn(1, tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)

    def run():
        cache = KimiK3Cache(text)
        for start in range(0, tokens, chunk):
            part = tuple(b[:, start:start + chunk] for b in bank)
            layer(part, partial[:, start:start + chunk], None, cache)
            cache.seen_tokens += min(chunk, tokens - start)

    with torch.no_grad():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times), peak


def floor_ms(layer, tokens, ceil):
    flops = bench_layer.layer_flops(layer, tokens)
    moe = getattr(layer, "block_sparse_moe", None)
    weights = bench_layer.non_expert_bytes(layer) + (moe.num_experts * bench_layer.expert_bytes(layer) if moe else 0)
    return max(flops / (ceil["bf16_matmul_TFLOPs"] * 1e12), weights / (ceil["copy_bandwidth_GBps"] * 1e9)) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "prefill_h200.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--baseline", action="store_true",
                        help="the paths before issue 20's changes, for a side-by-side run: prompts through fla's "
                             "recurrent KDA kernel, the routed experts through the fused MXFP4 kernels at every "
                             "size, one latent-attention configuration for every cache size")
    args = parser.parse_args()
    if args.baseline:
        os.environ["KIMI_K3_FAST_PATHS"] = "kda_prefill=off"
        mxfp4_triton.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT = float("inf")
        fused_triton.LATENT_CONFIGS = dict.fromkeys(("short", "long"), (32, 32, 8, 3, 256))
    if os.environ.get("KIMI_K3_QUICK_TUNE") == "1":
        kda.quick_tune(1)
    started = time.time()
    reps = 2 if args.quick else 5
    text = KimiK3Config.from_pretrained(ROOT).text_config
    ceil = bench_layer.ceilings(args.quick)
    result = {"device": torch.cuda.get_device_name(), "baseline": args.baseline, "ceilings": ceil, "card": CARD,
              "prefill_chunk_size": KimiK3TextModel.prefill_chunk_size, "layer_prefill_tok_s": {},
              "layer_prefill_fraction_of_floor": {}, "floor": {"layer_prefill_ms": {}}, "long_prompt": {}}

    def save():
        result["elapsed_s"] = time.time() - started
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)

    layers, layer_ms = {"kda": 1, "mla": 3, "dense0": 0}, {}
    for kind, index in layers.items():
        layer = bench_layer.build_layer(text, index, seed=index) if kind != "dense0" else build_dense(text)
        layer_ms[kind] = {}
        for tokens in PREFILL_LENGTHS + ((LONG_PROMPT,) if kind != "dense0" else ()):
            try:
                ms, peak = prefill_ms(text, layer, tokens, 1 if tokens > 32768 else reps, seed=tokens)
            except torch.OutOfMemoryError as err:  # recorded, not fatal: the other figures still come back
                result.setdefault("long_prompt" if tokens == LONG_PROMPT else "errors", {})[kind] = repr(err)[:300]
                print(f"{kind} prefill {tokens}: {err!r}"[:300], flush=True)
                torch.cuda.empty_cache()
                continue
            floor = floor_ms(layer, tokens, ceil)
            if tokens == LONG_PROMPT:
                result["long_prompt"][kind] = {"tokens": tokens, "ms": ms, "tok_s": tokens / ms * 1e3,
                                               "peak_gpu_memory_GiB": peak / 2**30}
            else:
                layer_ms[kind][str(tokens)] = ms
                result["layer_prefill_tok_s"].setdefault(kind, {})[str(tokens)] = tokens / ms * 1e3
                result["layer_prefill_fraction_of_floor"].setdefault(kind, {})[str(tokens)] = floor / ms
                result["floor"]["layer_prefill_ms"].setdefault(kind, {})[str(tokens)] = floor
            print(f"{kind} prefill {tokens}: {ms:.1f} ms = {tokens / ms * 1e3:,.0f} tok/s ({floor / ms:.0%} of floor "
                  f"{floor:.1f} ms), peak {peak / 2**30:.1f} GiB", flush=True)
            save()
        if kind == "kda":
            kda_layer = layer
        elif kind == "mla":
            mla_layer = layer
        else:
            del layer
    counts = {"dense0": 1, "kda": KDA_MOE_LAYERS, "mla": MLA_MOE_LAYERS}
    lengths = [t for t in layer_ms["kda"] if all(t in layer_ms[k] for k in counts)]
    result["model_prefill_tok_s"] = {t: int(t) / sum(n * layer_ms[k][t] for k, n in counts.items()) * 1e3
                                     for t in lengths}
    result["floor"]["model_prefill_tok_s"] = {
        t: int(t) / sum(n * result["floor"]["layer_prefill_ms"][k][t] for k, n in counts.items()) * 1e3
        for t in lengths}
    print("model prefill tok/s:", {t: round(v) for t, v in result["model_prefill_tok_s"].items()}, flush=True)
    save()

    head_ms, _ = bench_layer.lm_head_ms(text, 20, 1)
    bench_layer.DEVICE = "cuda"
    kda_step = bench_layer.bench_decode(text, kda_layer, 1, ceil, 20, seed=1)
    result["tpot_ms_by_context"], result["floor"]["tpot_ms_by_context"], result["mla_decode_ms_by_context"] = {}, {}, {}
    for context in CONTEXTS:
        bench_layer.CONTEXT = context  # the latents cached behind the MLA layer's decode step
        mla_step = bench_layer.bench_decode(text, mla_layer, 1, ceil, 20, seed=3)
        result["mla_decode_ms_by_context"][str(context)] = mla_step["fast_graph_ms"]
        tpot = (KDA_MOE_LAYERS + 1) * kda_step["fast_graph_ms"] + MLA_MOE_LAYERS * mla_step["fast_graph_ms"] + head_ms
        floor = (KDA_MOE_LAYERS + 1) * kda_step["floor_ms"] + MLA_MOE_LAYERS * mla_step["floor_ms"]
        result["tpot_ms_by_context"][str(context)] = tpot
        result["floor"]["tpot_ms_by_context"][str(context)] = floor
        print(f"context {context}: MLA layer step {mla_step['fast_graph_ms']:.3f} ms, TPOT {tpot:.1f} ms "
              f"({1e3 / tpot:.1f} tok/s), floor {floor:.1f} ms", flush=True)
        save()
    ratio = result["tpot_ms_by_context"]["131072"] / result["tpot_ms_by_context"]["2048"]
    result["tpot_131k_over_2k"] = ratio
    print(f"TPOT at 131072 / at 2048: {ratio:.3f} (target <= 1.1)")
    save()


def build_dense(text):
    """The dense layer 0 (KDA + MLP) at the release's shapes, random bf16 weights."""
    from modeling_kimi_k3 import KimiK3DecoderLayer

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = KimiK3DecoderLayer(text, 0, packed_experts=True).to(torch.bfloat16)
    with torch.no_grad():
        for proj in (layer.self_attention_res_proj, layer.mlp_res_proj):
            proj.weight.normal_(0.0, 0.02)
    return layer.eval().requires_grad_(False)


if __name__ == "__main__":
    main()
