"""Prefill and long-context decode on one H200, from one real-width layer of each kind (as `bench.layer`).

  * layer prefill: a KDA + MoE, an MLA + MoE and the dense layer 0, random weights at the release's shapes, default
    fast paths, a prompt of 2048 / 8192 / 32768 tokens fed as the model feeds it (chunks of
    `KimiK3TextModel.prefill_chunk_size` through a cache); tokens/s beside the layer's floor (max of matmul FLOPs /
    the bf16 rate and bytes / copy bandwidth, both measured in this run);
  * whole-model prefill, extrapolated: layer 0 + 68 KDA + 24 MLA layers;
  * a 131,072-token prompt through one layer of each kind (chunked), with the peak GPU memory it took;
  * decode TPOT by context: one-token CUDA-graph steps of the KDA layer and of the MLA layer at 2048 / 32768 /
    131072 cached latents, extrapolated to 69 KDA + 24 MLA layers + LM head: the MLA step on one static cache sized
    for the longest context, one graph replayed at each (`mla_steps_by_context`; what `generate` with
    `make_static_cache` runs), and beside it on a `KimiK3Cache` of each context at a step that regrows its buffer
    (the cache set to that context before each step: the costliest step, one in ~T/4 as the cache grows;
    `bench.cache_growth` times the appends in between).

    python -m bench.prefill --out bench/results/prefill_h200.json [--quick] [--baseline]
"""

import argparse
import os
import time

import torch

import mxfp4_triton
from bench import common
from bench.common import (CARD, build_layer, ceilings, expert_bytes, graph_of, layer_flops, non_expert_bytes,
                          time_ms)
from bench.layer import bench_decode, lm_head_ms
from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import BlockBank, KimiK3Cache, KimiK3StaticCache, KimiK3TextModel

KDA_MOE_LAYERS, MLA_MOE_LAYERS = 68, 24  # and the dense layer 0 (KDA)
PREFILL_LENGTHS, LONG_PROMPT, CONTEXTS = (2048, 8192, 32768), 131072, (2048, 32768, 131072)


def prefill_ms(text, layer, tokens, reps, seed):
    """Median ms of a `tokens`-token prompt through `layer`, chunked as the model chunks it, and the peak GPU memory
    (bytes above what was allocated before) of one run."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, chunk = text.hidden_size, KimiK3TextModel.prefill_chunk_size
    bank = tuple(torch.randn(1, tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    partial = torch.randn(1, tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)

    def run():  # a chunk's bank is stacked once for both of the layer's depth mixes (in the model: once a block)
        cache = KimiK3Cache(text)
        for start in range(0, tokens, chunk):
            part = BlockBank(b[:, start:start + chunk] for b in bank)
            layer(part, partial[:, start:start + chunk], None, cache)
            cache.advance(min(chunk, tokens - start))

    with torch.no_grad():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ms = time_ms(run, reps, warmup=0)
    return ms, peak


def floor_ms(layer, tokens, ceil):
    flops = layer_flops(layer, tokens)
    moe = getattr(layer, "block_sparse_moe", None)
    weights = non_expert_bytes(layer) + (moe.num_experts * expert_bytes(layer) if moe else 0)
    return max(flops / (ceil["bf16_matmul_TFLOPs"] * 1e12), weights / (ceil["copy_bandwidth_GBps"] * 1e9)) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "prefill_h200.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--baseline", action="store_true",
                        help="some paths before issue 20's changes, for a side-by-side run: prompts through fla's "
                             "recurrent KDA kernel, the routed experts through the fused MXFP4 kernels at every "
                             "size")
    args = parser.parse_args()
    if args.baseline:
        os.environ["KIMI_K3_FAST_PATHS"] = "kda_prefill=off"
        mxfp4_triton.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT = float("inf")
    common.quick_tune_from_env()
    started = time.time()
    reps = 2 if args.quick else 5
    text = KimiK3Config.from_pretrained(common.ROOT).text_config
    ceil = ceilings(args.quick)
    result = {"device": torch.cuda.get_device_name(), "baseline": args.baseline, "ceilings": ceil, "card": CARD,
              "prefill_chunk_size": KimiK3TextModel.prefill_chunk_size, "layer_prefill_tok_s": {},
              "layer_prefill_fraction_of_floor": {}, "floor": {"layer_prefill_ms": {}}, "long_prompt": {}}

    def save():
        result["elapsed_s"] = time.time() - started
        common.write_json(args.out, result)

    layers, layer_ms = {"kda": 1, "mla": 3, "dense0": 0}, {}
    for kind, index in layers.items():
        layer = build_layer(text, index, seed=index)
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

    head_ms, _ = lm_head_ms(text, 20, 1)
    kda_step = bench_decode(text, kda_layer, 1, ceil, 20, seed=1)
    static = mla_steps_by_context(text, mla_layer, CONTEXTS, 20, seed=3)
    result["tpot_ms_by_context"], result["floor"]["tpot_ms_by_context"], result["mla_decode_ms_by_context"] = {}, {}, {}
    result["tpot_ms_by_context_dynamic_cache"], result["mla_decode_ms_by_context_dynamic_cache"] = {}, {}
    for context in CONTEXTS:
        # `context` latents cached behind the MLA layer's decode step, on a KimiK3Cache regrown each step
        mla_step = bench_decode(text, mla_layer, 1, ceil, 20, seed=3, context=context)
        per_layer = {"": static[context], "_dynamic_cache": mla_step["fast_graph_ms"]}
        for suffix, mla_ms in per_layer.items():
            result["mla_decode_ms_by_context" + suffix][str(context)] = mla_ms
            tpot = (KDA_MOE_LAYERS + 1) * kda_step["fast_graph_ms"] + MLA_MOE_LAYERS * mla_ms + head_ms
            result["tpot_ms_by_context" + suffix][str(context)] = tpot
        floor = (KDA_MOE_LAYERS + 1) * kda_step["floor_ms"] + MLA_MOE_LAYERS * mla_step["floor_ms"]
        result["floor"]["tpot_ms_by_context"][str(context)] = floor
        tpot = result["tpot_ms_by_context"][str(context)]
        print(f"context {context}: MLA layer step {static[context]:.3f} ms (static cache, one graph; "
              f"{mla_step['fast_graph_ms']:.3f} ms on a concatenated cache), TPOT {tpot:.1f} ms ({1e3 / tpot:.1f} "
              f"tok/s), floor {floor:.1f} ms", flush=True)
        save()
    for suffix in ("", "_dynamic_cache"):
        by_context = result["tpot_ms_by_context" + suffix]
        result["tpot_131k_over_2k" + suffix] = by_context["131072"] / by_context["2048"]
    print(f"TPOT at 131072 / at 2048: {result['tpot_131k_over_2k']:.3f} (target <= 1.1; on a concatenated cache "
          f"{result['tpot_131k_over_2k_dynamic_cache']:.3f})")
    save()


def mla_steps_by_context(text, layer, contexts, reps, seed):
    """Median ms of the MLA layer's one-token decode step (batch 1) at each context, as `generate` runs it on a
    `KimiK3StaticCache`: one cache sized for the longest context (its latents random), one CUDA graph captured at
    the first context, then replayed at each with the position and mask written into the cache's device buffers,
    as the decode runner does: the graph stays valid as the context grows, and a step reads only the filled part."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, attn = text.hidden_size, layer.self_attn
    bank = tuple(torch.randn(1, 1, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    partial = torch.randn(1, 1, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = KimiK3StaticCache(text, 1, max(contexts) + 1)
    cache.layers[layer.layer_idx].latent = torch.randn(1, max(contexts) + 1, attn.kv_lora_rank + attn.rope_dim,
                                                       device="cuda", generator=gen, dtype=torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.long, device="cuda")

    def at(context):
        cache.seen_tokens = context
        mask, position = cache.prepare(None, 1, 1, "cuda")  # writes the cache's position and mask buffers
        positions.copy_(position)
        return mask

    mask = at(contexts[0])
    with torch.no_grad():
        graph, _ = graph_of(lambda: layer(bank, partial, mask, cache, positions)[1], lambda: None)
        steps = {}
        for context in contexts:
            at(context)
            steps[context] = time_ms(graph.replay, reps)
    return steps


if __name__ == "__main__":
    main()
