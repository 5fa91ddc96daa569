"""One rank's share of Kimi K3 at TP8, timed on one GPU: the predicted 8-GPU decode TPOT (issues #19, #44).

There is no 8-GPU machine, so this times what rank 0 of an 8-way tensor + expert parallel job runs, on one device,
with its collectives as delay kernels of a modelled length (not measured):

  * real-width modules from the root config.json with random weights (`bench.common.build_layer`: MXFP4 packs of
    random bytes): a KDA + MoE layer, an MLA + MoE layer, layer 0 (KDA + dense MLP), and the head stage (embedding
    lookup, the output depth mix + final norm, the LM head). Each is timed whole first (the single-GPU reference of
    the same run), then sharded in place by `tensor_parallel.shard(module, TensorParallel(rank=0, size=8))` (12 of
    96 heads, 40 of 320 experts, 1/8 of the dense and shared MLPs and of the vocabulary) and timed again;
  * a decode step as the decode graph runs it (variant "decode"): a `KimiK3StaticCache` holding the layer's random
    state after `MLA_CONTEXT` tokens (KDA state and conv histories, or that many MLA latents), the mask and
    positions its `prepare` makes, and the layer's stage of `KimiK3ForCausalLM.decode_stages` (the block bank a plain
    tuple of `BANK_ROWS` rows); other variants (`VARIANTS`) are timed beside it in the same run, at batch 1 and 8,
    each replayed from a CUDA graph (eager on the CPU, a dry run of the code path only);
  * `tensor_parallel.all_reduce` is replaced by a stand-in (`AllReduceStandIn`) that records each call and, on CUDA,
    enqueues a `torch.cuda._sleep` kernel of the modelled length (latency + ring bytes term, `all_reduce_us`,
    calibrated to µs on this GPU) on the current stream: each collective sits at its stream position inside the
    captured graph (the shared experts' on their side stream), so overlap and serialisation are in the graph time.
    Rank 0's partial sums stand for the sums over the ranks (same shapes), so every kernel after a collective runs
    as it would. Every step is timed with all-reduces of 0 (compute only), 6 (a one-shot all-reduce in the graph)
    and 15 µs (NCCL's ring + LL model);
  * the kernels a step launches, counted by `torch.profiler` over graph replays (the delay kernels apart);
  * the busiest rank sets each MoE layer's step (every layer ends in all-reduces that wait for all ranks). Random
    hidden states through the real-width router give the distribution of experts hit per rank (max over the 8
    ranks) at batch 1 and 8; for the timed step the input (of a few candidates) whose busiest rank hits about that
    distribution's mean is taken, and the router's rows of that rank's experts are swapped with rank 0's, so rank 0
    is the busiest rank on it (the router is replicated and its weights random: a relabelling). The rank's experts
    call is also timed alone against the number of experts it hits;
then sums the model from config.json's layer kinds (1 dense + 68 KDA + 24 MLA + head): the predicted TPOT at batch
1 and the aggregate tokens/s of 8 sequences, per variant and all-reduce length, next to the same run's full-width
layers, the single-GPU extrapolation in bench/results/layer_h200.json and the model card's SGLang TP8 figure.

    KIMI_K3_QUICK_TUNE=1 python3 -m bench.tp_sim --out bench/results/tp_sim_h200.json
    python -m bench.tp_sim --device cpu --quick --out /tmp/tp_sim_cpu.json   # tiny widths, reference paths
"""

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

import torch
from torch import nn

import tensor_parallel
from bench import common
from bench.common import (CARD, RouteRecorder, build_layer, copy_bandwidth, decode_cache, expert_bytes, graph_of,
                          nbytes, non_expert_bytes, package_version, sync, time_ms, truncated)
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_dispatch import resolve_fast_paths, use_fast_paths
from modeling_kimi_k3 import (KimiK3DeltaAttention, KimiK3ForCausalLM, KimiK3LanguageModel, KimiK3LatentMoE,
                              KimiK3StaticCache, merge_block_projections)
from tensor_parallel import TensorParallel, check_tp_size, shard

TP = 8
BATCHES = (1, 8)
# Issue #44's goals, on 8 x H200: TP8 TPOT at batch 1 by all-reduce length (µs), and 8 sequences' aggregate tok/s.
GOAL_TPOT_MS_B1 = {"6": 10.0, "15": 12.0}
GOAL_TOK_S_B8 = 450.0
AR_LATENCIES_US = (0.0, 6.0, 15.0)  # all-reduce lengths each step is timed with: none, one-shot, NCCL ring + LL
COUNTED_AT_US = 6.0  # the graph whose kernels are counted
BANK_ROWS = 4  # block-bank rows before a decoder layer, as bench.layer times it (a mid-depth layer)
MLA_CONTEXT = 2048  # cached latents behind an MLA layer's decode step, as bench.layer times it (--quick: 16)
SINGLE_GPU_RESULTS = os.path.join("bench", "results", "layer_h200.json")
# The steps timed side by side (`make_step`): "decode" first, the reference of the others.
VARIANTS = {
    "decode": "what the decode graph runs: KimiK3StaticCache, the mask and positions its prepare makes, the layer's "
              "stage of KimiK3ForCausalLM.decode_stages (bank a plain tuple)",
    "no_mask": "the same step with mask None: what a step without padding launches where the host drops the mask",
    "growing_cache": "the earlier tp_sim step: a growing KimiK3Cache (bench.common.decode_cache), mask None, "
                     "positions from the cache",
    "one_stream": "the decode step with the side_streams path off: every kernel and all-reduce on one stream, what "
                  "the second stream's overlap saves",
}

# Public figures, none measured here. Each all-reduce of `bytes` costs latency + 2(N-1)/N * bytes / bus_bandwidth
# (nccl-tests' busbw convention, ring). The decode messages are 14 KB to 320 KB, far below the sizes where busbw
# saturates, so the latency term dominates; it is the variable timed (AR_LATENCIES_US).
ALL_REDUCE_MODEL = {
    "bus_bandwidth_GBps": 370.0,
    "link": "NVLink 4 through NVSwitch, 900 GB/s bidirectional (450 GB/s each way) per GPU",
    "source": "Link: NVIDIA H200 Tensor Core GPU datasheet (NVLink 900 GB/s). Bus bandwidth: nccl-tests "
              "all_reduce_perf on 8 x H100 SXM (the NVLink 4 / NVSwitch fabric of HGX H200), large messages: ring "
              "365-370 GB/s (github.com/NVIDIA/nccl/issues/1455). Latency 15 us: NCCL's own tuner model for ring + "
              "LL on one node, base 6.6 us + 2(N-1) = 14 steps x 0.6 us (NVLink) at N = 8 (NVIDIA/nccl "
              "src/graph/tuning.cc, commit 5067397). 6 us: a one-shot all-reduce of 14-43 KB over P2P in a graph "
              "(SGLang's custom all-reduce 5.7-7.8 us at 4-32 KB on 8 x H100, sgl-project/sglang PR 2904; NCCL 2.27 "
              "symmetric-memory kernels ~2-5 us, NVIDIA/nccl issue 1940). Public figures, not measured here.",
}
# The all-reduces of each module kind under tensor_parallel.py's plan (its call sites): what the recorded calls are
# checked against.
PLAN_ALL_REDUCES = {
    "kda_moe": ["self_attn.o_proj (columns split, _sum_output hook)", "block_sparse_moe.shared_experts.down_proj "
                "(_sum_output hook)", "block_sparse_moe expert-parallel fp32 latent sum (ExpertParallel.all_reduce)"],
    "dense0": ["self_attn.o_proj (_sum_output hook)", "mlp.down_proj (_sum_output hook)"],
    "head": ["embed_tokens (VocabParallelEmbedding)", "lm_head logits, whole vocabulary (_gather_vocab hook)"],
}
PLAN_ALL_REDUCES["mla_moe"] = PLAN_ALL_REDUCES["kda_moe"]
# Widths for --quick (a dry run of the same code at tiny shapes: every TP8 split still even).
TINY_TEXT = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, routed_expert_hidden_size=64,
                 num_experts=32, num_experts_per_token=4, num_attention_heads=16, num_key_value_heads=16,
                 q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 vocab_size=4096)
TINY_LINEAR_ATTN = dict(num_heads=16, head_dim=16)
HIT_METHOD = (
    "Random hidden states x ~ N(0, 1) (the router reads post-norm states of about unit RMS) through the real-width "
    "router of the KDA + MoE layer built here (gate.weight N(0, 0.02), correction bias 0, top-k noaux_tc as the model "
    "runs it); per trial the distinct experts each rank holds among the chosen ones, then the max over the ranks. "
    "This is NOT the trained router's distribution: random weights spread tokens nearly uniformly and independently, "
    "while a trained router has hot experts (more imbalance, a busier busiest rank) and correlated choices within a "
    "batch (fewer distinct experts at batch 8). Better, not done here: the release checkpoint's router weights "
    "(gate.weight and e_score_correction_bias, ~4.6 MB a layer, readable alone with safe_open) on hidden states of "
    "real text; the demo checkpoints' routers are trained but tiny (56 experts, top-4, hidden 256), so their "
    "statistics would not transfer to 320 experts x 7168.")


class AllReduceStandIn:
    """Stands in for `tensor_parallel.all_reduce` in this one process: returns its input unchanged; with
    `latency_us` set and a CUDA input, first enqueues a `torch.cuda._sleep` kernel of the call's modelled length
    (`all_reduce_us`) on the current stream, where the collective would run; inside `record`, notes each call's
    message (shape, dtype, bytes)."""

    def __init__(self):
        self.calls = None
        self.latency_us = 0.0
        self.cycles_per_us = None  # set by `calibrate`

    def __call__(self, x, group=None):
        size = x.numel() * x.element_size()
        if self.calls is not None:
            self.calls.append({"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."), "bytes": size})
        if self.latency_us and x.is_cuda:
            torch.cuda._sleep(max(1, round(all_reduce_us(size, self.latency_us) * self.cycles_per_us)))
        return x

    def record(self, fn):
        """Run `fn()` and return the all-reduces it called."""
        self.calls = []
        try:
            fn()
            return self.calls
        finally:
            self.calls = None

    def calibrate(self):
        """Cycles a µs of `torch.cuda._sleep` on this GPU: the slope between two lengths, timed with events (the
        launch cost cancels); then the length one modelled 6 µs delay replays at from a graph of it alone."""
        def us(cycles):
            return time_ms(lambda: torch.cuda._sleep(cycles), 10, warmup=3) * 1e3

        short, long = 100_000, 1_000_000
        self.cycles_per_us = (long - short) / (us(long) - us(short))
        self.latency_us = 6.0
        try:
            graph, _ = graph_of(lambda: self(torch.empty(0, device="cuda")), lambda: None)
            replayed_us = time_ms(graph.replay, 20, warmup=3) * 1e3
        finally:
            self.latency_us = 0.0
        return {"cycles_per_us": self.cycles_per_us, "graph_of_one_6us_delay_us": replayed_us}


STAND_IN = AllReduceStandIn()


def all_reduce_us(size, latency_us):
    """Modelled µs of an all-reduce of `size` bytes over TP ranks: latency + the ring's bytes term."""
    return latency_us + 2 * (TP - 1) / TP * size / (ALL_REDUCE_MODEL["bus_bandwidth_GBps"] * 1e3)


def load_config(tiny):
    """The release config (root config.json), or the same with tiny widths."""
    config = KimiK3Config.from_pretrained(common.ROOT)
    if not tiny:
        return config
    d = config.to_dict()
    d["text_config"].update(TINY_TEXT)
    d["text_config"]["linear_attn_config"].update(TINY_LINEAR_ATTN)
    return KimiK3Config(**d)


def layer_kinds(text):
    """Each decoder layer's kind: "dense0" (dense MLP), "kda_moe" or "mla_moe"."""
    return ["dense0" if not text.experts_in_layer(i) else f"{text.layer_types[i]}_moe"
            for i in range(text.num_hidden_layers)]


def build_head(config, seed):
    """The release's `language_model` without decoder layers: embedding, output mix + norm, LM head; random weights."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            language = KimiK3LanguageModel(truncated(config, 1), with_head=True)
    finally:
        torch.set_default_dtype(previous)
    language.model.layers = nn.ModuleList()
    language.to_empty(device=common.DEVICE)
    language.eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in language.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return language


def shard_rank0(module):
    """Shard `module` in place for rank 0 of TP, then restack each MoE block's experts (its 40 now) and merge each
    block's projections again (its slices), as the loader does after reading a shard."""
    shard(module, TensorParallel(rank=0, size=TP))
    for m in module.modules():
        if isinstance(m, KimiK3LatentMoE):
            m.stack_experts()
    merge_block_projections(module)


def time_step(fn, reset, reps):
    """Median ms of `fn()`: replays of its CUDA graph on CUDA, eager calls (each after `reset()`) elsewhere."""
    if common.DEVICE == "cuda":
        graph, _ = graph_of(fn, reset)
        graph.replay()
        sync()
        ms = time_ms(graph.replay, reps)
        del graph
        return {"ms": ms, "mode": "cuda_graph"}
    reset()
    fn()
    return {"ms": time_ms(fn, reps, setup=reset), "mode": "eager"}


def kernels_per_replay(graph, replays):
    """The kernels one replay of `graph` launches, from `torch.profiler` over `replays` replays (CUPTI sees the
    kernels a graph launches): {"kernels": count without the all-reduce delays, "all_reduce_delays": their count,
    "memsets_copies": memset / memcpy nodes, "by_name": kernels by name}."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if not names:
        raise RuntimeError("the profiler recorded no kernels of the graph replays")
    delays = sum(n for name, n in names.items() if "spin_kernel" in name)
    copies = sum(n for name, n in names.items() if name.startswith(("Memset", "Memcpy")))
    kernels = {name: n / replays for name, n in names.most_common()
               if "spin_kernel" not in name and not name.startswith(("Memset", "Memcpy"))}
    return {"kernels": sum(kernels.values()), "all_reduce_delays": delays / replays,
            "memsets_copies": copies / replays, "by_name": kernels}


# Leaf aten ops that launch no kernel on CUDA (views, metadata, allocation): left out of the CPU count.
NO_KERNEL_OPS = {"aten::" + name for name in (
    "empty", "empty_strided", "empty_like", "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "t",
    "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "detach", "alias",
    "split", "split_with_sizes", "unbind", "chunk", "narrow", "flatten", "unflatten", "view_as", "lift_fresh",
    "resolve_conj", "resolve_neg", "contiguous", "to", "numpy_T", "mT", "diagonal", "result_type", "item",
    "_local_scalar_dense", "is_nonzero", "broadcast_tensors")}


def ops_per_step(fn, reset):
    """On the CPU, the kernels a step would launch, counted as the leaf aten ops of one eager `fn()` (the profiler's
    ops without children) other than NO_KERNEL_OPS: a proxy for the CUDA count (the CPU runs the reference ops,
    not the Triton kernels), which shows ops added or removed by a change."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = collections.Counter(e.name for e in prof.events()
                                if not e.cpu_children and e.name.startswith("aten::") and e.name not in NO_KERNEL_OPS)
    return {"kernels": sum(names.values()), "memsets_copies": 0, "by_name": dict(names.most_common()),
            "method": "CPU: leaf aten ops but views, metadata and allocation (a proxy for CUDA kernels)"}


def time_all_reduce_lengths(fn, reset, reps, latencies=AR_LATENCIES_US, counted_at=COUNTED_AT_US):
    """Median ms of `fn()` with its all-reduces as delays of each of AR_LATENCIES_US (CUDA graph replays) and the
    kernels of a replay at `counted_at`. On the CPU one eager timing, to which each length's modelled all-reduces
    are added serially (a dry run of the code path)."""
    key = "{:g}".format
    if common.DEVICE != "cuda":
        calls = STAND_IN.record(fn)
        reset()
        ms = time_ms(fn, reps, setup=reset)
        return {"mode": "eager + modelled all-reduces added serially",
                "kernels": dict(ops_per_step(fn, reset), all_reduce_delays=len(calls)),
                "ms": {key(lat): ms + sum(all_reduce_us(c["bytes"], lat) for c in calls) * 1e-3 if lat else ms
                       for lat in latencies}}
    out = {"mode": "cuda_graph, all-reduces as in-graph delays", "ms": {}, "kernels": None}
    for lat in latencies:
        STAND_IN.latency_us = lat
        try:
            graph, _ = graph_of(fn, reset)
        finally:
            STAND_IN.latency_us = 0.0
        graph.replay()
        sync()
        out["ms"][key(lat)] = time_ms(graph.replay, reps)
        if lat == counted_at:
            try:
                out["kernels"] = kernels_per_replay(graph, 5)
            except Exception as err:  # the profiler is a diagnostic: its failure leaves the timings standing
                out["kernels"] = {"error": repr(err)[:300]}
        del graph
    return out


def hits_per_rank(ids, experts_per_rank, ranks):
    """Distinct experts among router ids (global) that each of `ranks` ranks holds, experts_per_rank each."""
    return torch.bincount(ids.unique() // experts_per_rank, minlength=ranks).tolist()


def router_hit_stats(gate, hidden, batch, trials, seed):
    """Experts hit per rank over `trials` random batches of `batch` tokens through `gate` (see HIT_METHOD)."""
    experts, k = gate.weight.shape[0], gate.top_k
    per_rank = experts // TP
    gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
    x = torch.randn(trials * batch, hidden, device=common.DEVICE, generator=gen, dtype=gate.weight.dtype)
    ids = gate(x)[0].view(trials, batch * k)
    distinct = torch.zeros(trials, experts, device=ids.device).scatter_(1, ids, 1.0)
    per = distinct.view(trials, TP, per_rank).sum(-1)  # [trials, ranks]
    ones = torch.ones(ids.shape, device=ids.device)
    pairs = torch.zeros(trials, TP, device=ids.device).scatter_add_(1, ids // per_rank, ones)
    busiest = per.max(1).values.cpu()
    return {"trials": trials, "top_k": k, "experts_per_rank": per_rank,
            "distinct_experts_total_mean": float(distinct.sum(1).mean()),
            "per_rank_mean": float(per.mean()),
            "max_over_ranks": {"mean": float(busiest.mean()), "median": float(busiest.median()),
                               "p90": float(busiest.quantile(0.9)), "max": float(busiest.max())},
            "pairs_max_over_ranks_mean": float(pairs.max(1).values.mean())}


def swap_router_blocks(gate, a, b, per_rank):
    """Swap the router rows (weight and correction bias) of rank a's and rank b's experts."""
    if a == b:
        return
    with torch.no_grad():
        for p in (gate.weight, gate.e_score_correction_bias):
            rows_a, rows_b = slice(a * per_rank, (a + 1) * per_rank), slice(b * per_rank, (b + 1) * per_rank)
            saved = p[rows_a].clone()
            p[rows_a] = p[rows_b]
            p[rows_b] = saved


def decode_stage(layer):
    """The layer's stage of `KimiK3ForCausalLM.decode_stages`, what the decode graph runs for it: taken from that
    method on a one-layer stand-in model, so that the timed call is the graph's own."""
    text = SimpleNamespace(embed_tokens=layer, layers=[layer], norm=layer, output_mix=None)
    stages = KimiK3ForCausalLM.decode_stages(SimpleNamespace(language_model=SimpleNamespace(model=text,
                                                                                            lm_head=layer)))
    return stages[1][1]


def static_cache(text, layer, batch, seed, context):
    """A `KimiK3StaticCache` of `context` + 1 tokens after `context` of them, holding `layer`'s random state (KDA:
    recurrent state and conv histories; MLA: `context` latents). Returns (cache, reset: puts the KDA state back
    (an MLA step writes only its own slot), bytes the step reads and writes of it)."""
    gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
    cache = KimiK3StaticCache(text, batch, context + 1)
    own, attn = cache.layers[layer.layer_idx], layer.self_attn
    if isinstance(attn, KimiK3DeltaAttention):
        width = attn.num_heads * attn.head_dim
        conv = tuple(torch.randn(batch, width, 3, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
                     for _ in range(3))
        state = torch.randn(batch, attn.num_heads, attn.head_dim, attn.head_dim, device=common.DEVICE,
                            generator=gen) * 0.02
        own.update(conv, state)  # allocates the static buffers; later calls copy into them

        def reset():
            own.update(conv, state)

        state_bytes = 2 * nbytes([state]) + 2 * nbytes(conv)
    else:
        own.latent = torch.randn(batch, context + 1, attn.kv_lora_rank + attn.rope_dim, device=common.DEVICE,
                                 generator=gen, dtype=torch.bfloat16)

        def reset():
            pass

        state_bytes = nbytes([own.latent])
    cache.seen_tokens = context
    return cache, reset, state_bytes


def make_step(variant, text, layer, batch, seed, context):
    """One decode step of `layer` at `batch` as VARIANTS[variant] runs it (inputs and cache from `seed`, after
    `context` tokens): (step, reset, bytes of cache state it reads and writes). "one_stream" is the decode step,
    which `measure_layer` times with the side streams off."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {list(VARIANTS)}")
    gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
    bank = tuple(torch.randn(batch, 1, text.hidden_size, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
                 for _ in range(BANK_ROWS))
    partial = torch.randn(batch, 1, text.hidden_size, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
    if variant == "growing_cache":
        cache, reset, state_bytes = decode_cache(text, layer, batch, seed, context)
        return (lambda: layer(bank, partial, None, cache)[1]), reset, state_bytes
    cache, reset, state_bytes = static_cache(text, layer, batch, seed, context)
    mask, positions = cache.prepare(None, batch, 1, common.DEVICE)
    if variant == "no_mask":
        mask = None
    stage = decode_stage(layer)
    return (lambda: stage((*bank, partial), mask, positions, cache)[-1]), reset, state_bytes


def routing_of(layer, step, reset):
    """Global expert ids the layer's router picks in one eager `step()`."""
    recorder = RouteRecorder(layer.block_sparse_moe.gate)
    try:
        reset()
        step()
        return recorder.ids
    finally:
        recorder.handle.remove()


def make_rank0_busiest(text, layer, batch, target, seeds, context):
    """Of the inputs from `seeds`, the one whose busiest rank hits closest to `target` experts; the router rows of
    that rank's experts are swapped with rank 0's so that rank 0 is the busiest on it. Returns (seed, hits a rank)."""
    moe = layer.block_sparse_moe
    per_rank = moe.num_experts
    best = None
    for seed in seeds:
        step, reset, _ = make_step("decode", text, layer, batch, seed, context)
        hits = hits_per_rank(routing_of(layer, step, reset), per_rank, TP)
        if best is None or abs(max(hits) - target) < abs(max(best[1]) - target):
            best = (seed, hits)
    seed, hits = best
    busiest = hits.index(max(hits))
    swap_router_blocks(moe.gate, 0, busiest, per_rank)
    hits[0], hits[busiest] = hits[busiest], hits[0]
    return seed, hits


def measure_layer(text, layer, batch, seed, args, variants, latencies=AR_LATENCIES_US):
    """One decode step of `layer` in each of `variants`: its all-reduces (one eager step), experts hit, bytes and
    floor, then per variant the median ms at each all-reduce length and the kernels a replay launches."""
    step, reset, state_bytes = make_step("decode", text, layer, batch, seed, args.context)
    res = {"input_seed": seed}
    param_bytes = non_expert_bytes(layer)
    moe = getattr(layer, "block_sparse_moe", None)
    if moe is not None:
        ranks = moe.gate.weight.shape[0] // moe.num_experts  # 1 for a whole layer
        hits = hits_per_rank(routing_of(layer, step, reset), moe.num_experts, ranks)
        res["experts_hit"], res["experts_hit_per_rank"] = hits[0], hits
        param_bytes += hits[0] * expert_bytes(layer)
    reset()
    res["all_reduces"] = STAND_IN.record(step)
    res["bytes"] = param_bytes + state_bytes
    res["floor_ms"] = res["bytes"] / args.copy_bw * 1e3
    res["variants"] = {}
    counted_at = COUNTED_AT_US if COUNTED_AT_US in latencies else latencies[0]
    for variant in variants:
        switched = use_fast_paths(layer, side_streams="off") if variant == "one_stream" else contextlib.nullcontext()
        with switched:
            step, reset, _ = make_step(variant, text, layer, batch, seed, args.context)
            res["variants"][variant] = time_all_reduce_lengths(step, reset, args.reps, latencies, counted_at)
    return res


def measure_head(language, text, batch, reps, copy_bw):
    """The head stage at `batch`: next token's embedding, output mix over every block + norm, LM head."""
    device = common.DEVICE
    gen = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(0, text.vocab_size, (batch, 1), device=device, generator=gen)
    blocks = len(range(0, text.num_hidden_layers, text.attn_res_block_size))
    bank = tuple(torch.randn(batch, 1, text.hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
                 for _ in range(blocks))
    partial = torch.randn(batch, 1, text.hidden_size, device=device, generator=gen, dtype=torch.bfloat16)
    model = language.model

    def step():
        return model.embed_tokens(ids), language.lm_head(model.output_mix(bank, partial))

    res = {"all_reduces": STAND_IN.record(step)}
    others = [p for n, p in language.named_parameters() if not n.startswith("model.embed_tokens.")]
    res["bytes"] = nbytes(others) + batch * text.hidden_size * 2  # + the embedding rows looked up
    res["floor_ms"] = res["bytes"] / copy_bw * 1e3
    res.update(time_all_reduce_lengths(step, lambda: None, reps))
    return res


def experts_call(moe, z, ids, weights):
    """The rank's routed experts as its decode step runs them: the weighted fp32 sum over its experts' pairs
    (`routed_expert_sum`, the router's ids as they are), then the latent norm (the all-reduce between left out)."""
    ops = moe.dispatch.ops(z.device)
    partial = ops.routed_expert_sum(moe, z, ids, weights, moe.expert_parallel.first)
    return ops.pair_sum_norm(partial, None, moe.routed_expert_norm, z.dtype)


def experts_call_sweep(moe, batch, reps, seed):
    """Median ms of the rank's experts call at `batch` tokens against the number of its experts hit (one pair
    each; the other pairs on other ranks' experts)."""
    k, count, first = moe.gate.top_k, moe.num_experts, moe.expert_parallel.first
    device = common.DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(batch, moe.routed_expert_down_proj.out_features, device=device, generator=gen,
                    dtype=torch.bfloat16)
    weights = torch.full((batch, k), 1.0 / k, device=device)
    out = {}
    for hits in sorted({min(h, count, batch * k) for h in ((1, 2, 3, 4, 6, 8, 16) if batch == 1 else
                                                           (4, 8, 12, 16, 20, 24, 32, 40))}):
        foreign = (first + count) % (TP * count)  # the first expert of the next rank
        ids = torch.full((batch, k), foreign, dtype=torch.int64, device=device)
        j = torch.arange(hits, device=device)
        ids[j % batch, j // batch] = first + j
        out[str(hits)] = time_step(lambda: experts_call(moe, z, ids, weights), lambda: None, reps)["ms"]
    return out


def single_gpu_reference():
    """The single-GPU decode TPOT extrapolated from one layer of each kind (bench.layer's H200 run)."""
    path = os.path.join(common.ROOT, SINGLE_GPU_RESULTS)
    try:
        with open(path) as f:
            extrapolation = json.load(f)["extrapolation"]
        return {str(b): extrapolation[f"b{b}"]["graph"]["tpot_ms"] for b in BATCHES}
    except (OSError, KeyError, ValueError):
        return None


def predict(results):
    """TP8 TPOT per variant and all-reduce length: every layer and the head at its per-rank step time, the
    all-reduces inside it; the aggregate tokens/s of the largest batch's sequences."""
    counts, variants = results["config"]["layer_counts"], results["config"]["variants"]
    per_rank, full = results["per_rank_layer_ms"], results["full_layer_ms"]
    parts = list(counts) + ["head"]
    weight = dict(counts, head=1)
    batches = [str(b) for b in BATCHES]
    missing = [p for p in parts if any(b not in per_rank.get(p, {}) or b not in full.get(p, {}) for b in batches)]
    if missing:
        return {"skipped": f"not measured: {missing}"}

    def ms(part, b, variant, lat):  # the head runs the same in every variant
        row = per_rank[part][b]
        return row.get(variant, row["decode"])[lat]

    by_variant = {}
    for variant in variants:
        for lat in ("{:g}".format(x) for x in AR_LATENCIES_US):
            tpot = {b: sum(weight[p] * ms(p, b, variant, lat) for p in parts) for b in batches}
            by_variant.setdefault(variant, {})[lat] = {
                "tpot_ms": tpot, "tok_s_b1": 1e3 / tpot["1"],
                "aggregate_tok_s": {b: int(b) * 1e3 / v for b, v in tpot.items()}}
    messages = results["all_reduces_per_layer"]
    return {
        "by_variant": by_variant,
        "all_reduces_per_token": {b: sum(weight[p] * len(messages[p][b]["messages"]) for p in parts)
                                  for b in batches},
        "same_run_full_width_tpot_ms": {b: sum(weight[p] * full[p][b] for p in parts) for b in batches},
        "notes": "tpot = sum over layer kinds (count x rank 0's graph-replayed step, all-reduces inside as delay "
                 "kernels of the given µs) + head; keys of each variant: the all-reduce µs (0 = compute only). "
                 "Only GPU time counts: no host or scheduler time a serving engine adds per step, no sampling, no "
                 "rank skew. same_run_full_width_tpot_ms: the unsharded layers of this run summed the same way, "
                 "what a device_map split over 8 GPUs runs (one GPU at a time; its 7 hops left out).",
    }


def record_all_reduces(results, kind, batch, calls):
    """The all-reduces one step of rank 0's `kind` called, next to the plan's count for it."""
    results["all_reduces_per_layer"].setdefault(kind, {})[str(batch)] = {
        "count": len(calls), "plan": PLAN_ALL_REDUCES[kind], "matches_plan": len(calls) == len(PLAN_ALL_REDUCES[kind]),
        "messages": calls}


def record_timings(results, kind, batch, timings):
    """A rank's timings of `kind` at `batch` ({variant: time_all_reduce_lengths' result}) into the summaries."""
    b = str(batch)
    results["per_rank_layer_ms"].setdefault(kind, {})[b] = {v: t["ms"] for v, t in timings.items()}
    results["kernels_per_layer"].setdefault(kind, {})[b] = {
        v: {k: n for k, n in (t["kernels"] or {}).items() if k != "by_name"} or None for v, t in timings.items()}


def describe(ms, kernels):
    """'0.275 / 0.293 / 0.320 ms, 46 kernels + 3 ARs' for one variant's timings."""
    times = " / ".join(f"{v:.3f}" for v in ms.values())
    if not kernels:
        return f"{times} ms"
    if "error" in kernels:
        return f"{times} ms (kernels: {kernels['error'][:60]})"
    return f"{times} ms, {kernels['kernels']:.0f} kernels + {kernels['all_reduce_delays']:.0f} ARs"


def run_layer(kind, index, text, args, results, save):
    """Whole, then rank 0's shard of, decoder layer `index`: decode steps at each batch in each variant (and, for
    the first MoE layer, the router's hit statistics and the rank's experts call against its hits)."""
    entry = results["layers"].setdefault(kind, {"layer_idx": index})
    t0 = time.time()
    layer = build_layer(text, index, seed=index)
    entry["build_s"] = time.time() - t0
    moe = getattr(layer, "block_sparse_moe", None)
    hit = results["experts_hit_per_rank"]
    if moe is not None and "router_stats" not in hit:
        hit["router_stats"] = {str(b): router_hit_stats(moe.gate, text.hidden_size, b, args.trials, seed=17 + b)
                               for b in BATCHES}
        hit["router_stats_layer"] = kind
    for b in BATCHES:
        r = measure_layer(text, layer, b, seed=b, args=args, variants=["decode"], latencies=(0.0,))
        entry.setdefault("full", {})[str(b)] = r
        decode = r["variants"]["decode"]
        results["full_layer_ms"].setdefault(kind, {})[str(b)] = decode["ms"]["0"]
        results["full_kernels_per_layer"].setdefault(kind, {})[str(b)] = {
            k: n for k, n in (decode["kernels"] or {}).items() if k != "by_name"} or None
        print(f"[{kind}] full b{b}: {describe(decode['ms'], decode['kernels'])} ({decode['mode']}), floor "
              f"{r['floor_ms']:.3f}" + (f", experts hit {r['experts_hit']}" if moe is not None else ""), flush=True)
        save()
    shard_rank0(layer)
    for b in BATCHES:
        seed = b
        if moe is not None:
            target = round(hit["router_stats"][str(b)]["max_over_ranks"]["mean"])
            seed, _ = make_rank0_busiest(text, layer, b, target, range(100, 100 + args.candidates), args.context)
        r = measure_layer(text, layer, b, seed=seed, args=args, variants=args.variants)
        entry.setdefault("rank0_of_8", {})[str(b)] = r
        record_timings(results, kind, b, r["variants"])
        record_all_reduces(results, kind, b, r["all_reduces"])
        if moe is not None:
            hit.setdefault("timed", {}).setdefault(kind, {})[str(b)] = {
                "target_max_over_ranks": target, "rank0_experts_hit": r["experts_hit"],
                "hits_per_rank": r["experts_hit_per_rank"], "input_seed": seed}
        print(f"[{kind}] rank 0 of {TP} b{b}, floor {r['floor_ms']:.3f} ms, {len(r['all_reduces'])} all-reduces "
              f"({sum(m['bytes'] for m in r['all_reduces'])} B)"
              + (f", experts hit {r['experts_hit']} (per rank {r['experts_hit_per_rank']})" if moe is not None
                 else ""), flush=True)
        for variant, t in r["variants"].items():
            print(f"    {variant:14s} AR {'/'.join(t['ms'])} µs: {describe(t['ms'], t['kernels'])}", flush=True)
        save()
    if moe is not None and "experts_call_ms" not in hit:
        hit["experts_call_ms"] = {str(b): experts_call_sweep(moe, b, args.reps, seed=31 + b) for b in BATCHES}
        hit["experts_call_layer"] = f"{kind}, rank 0 of {TP} ({moe.num_experts} experts)"
        print(f"[{kind}] rank 0 experts call, ms by experts hit: {hit['experts_call_ms']}", flush=True)
        save()


def run_head(config, args, results, save):
    """The head stage whole, then rank 0's vocabulary shard of it."""
    text = config.text_config
    language = build_head(config, seed=5)
    entry = results["layers"].setdefault("head", {})
    for name, sharded in (("full", False), ("rank0_of_8", True)):
        if sharded:
            shard_rank0(language)
        for b in BATCHES:
            r = measure_head(language, text, b, args.reps, args.copy_bw)
            entry.setdefault(name, {})[str(b)] = r
            if sharded:
                record_timings(results, "head", b, {"decode": r})
                record_all_reduces(results, "head", b, r["all_reduces"])
            else:
                results["full_layer_ms"].setdefault("head", {})[str(b)] = r["ms"]["0"]
            print(f"[head] {name} b{b}: {describe(r['ms'], r['kernels'])} ({r['mode']}), floor "
                  f"{r['floor_ms']:.3f}, {len(r['all_reduces'])} all-reduces", flush=True)
            save()


def print_summary(results):
    print(f"\n=== Kimi K3 at TP{TP}, one rank's share timed on {results['device']} ===")
    lengths = "/".join("{:g}".format(x) for x in AR_LATENCIES_US)
    print(f"rank 0's step, ms with all-reduces of {lengths} µs in the graph; kernels a replay launches")
    counts = results["config"]["layer_counts"]
    for kind in list(counts) + ["head"]:
        for b, row in results["per_rank_layer_ms"].get(kind, {}).items():
            kernels = results["kernels_per_layer"].get(kind, {}).get(b, {})
            full = results["full_layer_ms"].get(kind, {}).get(b)
            whole = results["full_kernels_per_layer"].get(kind, {}).get(b)
            print(f"{kind:8s} x{counts.get(kind, 1):2d} b{b}: whole {full:.3f} ms"
                  + (f" ({whole['kernels']:.0f} kernels)" if whole and "kernels" in whole else ""))
            for variant, ms in row.items():
                print(f"    {variant:14s} {describe(ms, kernels.get(variant))}")
    stats = results["experts_hit_per_rank"].get("router_stats", {})
    for b, s in stats.items():
        print(f"experts hit per rank (random router), b{b}: mean {s['per_rank_mean']:.1f}, busiest rank mean "
              f"{s['max_over_ranks']['mean']:.1f} (p90 {s['max_over_ranks']['p90']:.0f}); all ranks "
              f"{s['distinct_experts_total_mean']:.1f} distinct")
    p = results.get("predicted", {})
    if "by_variant" not in p:
        print(f"no prediction: {p.get('skipped')}")
        print(f"elapsed {results.get('elapsed_s', 0):.0f} s")
        return
    big = str(BATCHES[-1])
    print(f"predicted TP{TP} ({p['all_reduces_per_token']['1']} all-reduces a token at b1):")
    for variant, by_lat in p["by_variant"].items():
        for lat, row in by_lat.items():
            print(f"    {variant:14s} AR {lat:>2s} µs: TPOT b1 {row['tpot_ms']['1']:.2f} ms ({row['tok_s_b1']:.1f} "
                  f"tok/s), b{big} {row['tpot_ms'][big]:.2f} ms = {row['aggregate_tok_s'][big]:.0f} tok/s "
                  f"aggregate")
    full = p["same_run_full_width_tpot_ms"]
    ref = results["reference"]
    print(f"this run's whole layers summed (device_map-like): b1 {full['1']:.2f} ms, b{big} {full[big]:.2f} ms; "
          f"single-GPU extrapolation ({SINGLE_GPU_RESULTS}): {ref['device_map_tpot_ms']}; card (SGLang TP8, "
          f"8 x RTX 6000) {ref['card_sglang_tp8_tpot_ms']} ms at b1")
    for lat, goal in GOAL_TPOT_MS_B1.items():
        row = p["by_variant"]["decode"][lat]
        print(f"goal (issue #44, 8 x H200): TPOT b1 <= {goal} ms at AR {lat} µs: "
              f"{'met' if row['tpot_ms']['1'] <= goal else 'NOT met'} ({row['tpot_ms']['1']:.2f} ms); "
              f">= {GOAL_TOK_S_B8:.0f} tok/s at b{big}: "
              f"{'met' if row['aggregate_tok_s'][big] >= GOAL_TOK_S_B8 else 'NOT met'} "
              f"({row['aggregate_tok_s'][big]:.0f})" + (" [dry run: tiny widths]" if results["config"]["tiny_widths"]
                                                         else ""))
    print(f"elapsed {results.get('elapsed_s', 0):.0f} s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "tp_sim_h200.json"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny widths and few repetitions: a dry run of the same code (e.g. on the CPU)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated steps to time side by side, 'decode' first: {', '.join(VARIANTS)}")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining sections once past this")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    if args.variants[0] != "decode" or not set(args.variants) <= set(VARIANTS):
        parser.error(f"--variants: 'decode' first, then any of {list(VARIANTS)}; got {args.variants}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for a dry run", file=sys.stderr)
        return 2
    started = time.time()
    common.DEVICE = args.device  # where bench.common's timers and builders run
    args.context = 16 if args.quick else MLA_CONTEXT
    args.reps = 5 if args.quick else 50
    args.trials = 64 if args.quick else 512
    args.candidates = 4 if args.quick else 12
    quick_tune = common.quick_tune_from_env()
    tensor_parallel.all_reduce = STAND_IN  # every collective of a sharded module goes through this name
    config = load_config(tiny=args.quick)
    text = config.text_config
    check_tp_size(text, TP)
    kinds = layer_kinds(text)
    counts = {k: kinds.count(k) for k in ("dense0", "kda_moe", "mla_moe")}
    timed = {k: kinds.index(k) for k in ("kda_moe", "mla_moe", "dense0")}
    results = {
        "config": {
            "tp": TP, "batches": list(BATCHES), "tiny_widths": args.quick, "hidden_size": text.hidden_size,
            "kda_heads": text.linear_attn_config["num_heads"], "mla_heads": text.num_attention_heads,
            "heads_per_rank": text.linear_attn_config["num_heads"] // TP, "experts": text.num_experts,
            "experts_per_rank": text.num_experts // TP, "top_k": text.num_experts_per_token,
            "vocab_size": text.vocab_size, "layer_counts": counts, "timed_layer_idx": timed,
            "bank_rows": BANK_ROWS, "mla_context_tokens": args.context, "reps": args.reps,
            "variants": args.variants, "variant_descriptions": {v: VARIANTS[v] for v in args.variants},
            "all_reduce_us": list(AR_LATENCIES_US), "kernels_counted_at_all_reduce_us": COUNTED_AT_US,
            "fast_paths": str(resolve_fast_paths({}, args.device)),
            "fla_quick_tune": quick_tune,
            "all_reduce_stand_in": "tensor_parallel.all_reduce monkeypatched to an identity that records each call "
                                   "and enqueues a torch.cuda._sleep kernel of the modelled length on the current "
                                   "stream (no NCCL, no process group): rank 0's partial sums stand for the reduced "
                                   "ones",
            "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                         "fla": package_version("fla-core")},
        },
        "per_rank_layer_ms": {}, "full_layer_ms": {}, "kernels_per_layer": {}, "full_kernels_per_layer": {},
        "experts_hit_per_rank": {"method": HIT_METHOD},
        "all_reduce_model": dict(ALL_REDUCE_MODEL, formula="t = latency + 2(N-1)/N * bytes / bus_bandwidth, N = 8"),
        "all_reduces_per_layer": {},
        "reference": {"device_map_tpot_ms": single_gpu_reference(),
                      "device_map_source": f"{SINGLE_GPU_RESULTS} extrapolation.b1/b8.graph.tpot_ms: 93 layers + LM "
                                           "head from one layer of each kind on one H200, CUDA graphs; a device_map "
                                           "split runs the same layers one GPU at a time",
                      "card_sglang_tp8_tpot_ms": CARD["tpot_ms"],
                      "card_tok_s": CARD["tok_s"],
                      "card_source": f"README.md (model card): {CARD['setup']}"},
        "goals": {"tpot_ms_b1_by_all_reduce_us": GOAL_TPOT_MS_B1, "aggregate_tok_s_b8": GOAL_TOK_S_B8},
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "layers": {},
    }

    def save():
        results["elapsed_s"] = time.time() - started
        common.write_json(args.out, results)

    args.copy_bw = copy_bandwidth(3 if args.quick else 10)
    results["copy_bandwidth_GBps"] = args.copy_bw / 1e9
    if args.device == "cuda":
        results["delay_kernel"] = STAND_IN.calibrate()
        print(f"delay kernel: {results['delay_kernel']}", flush=True)
    save()
    sections = [(kind, lambda kind=kind: run_layer(kind, timed[kind], text, args, results, save)) for kind in timed]
    sections.append(("head", lambda: run_head(config, args, results, save)))
    with torch.no_grad():
        for name, section in sections:
            if time.time() - started > args.budget_s:
                results["layers"].setdefault(name, {})["skipped"] = "time budget"
                continue
            try:
                section()
            except Exception:
                results["layers"].setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
                print(f"[{name}] FAILED:\n{results['layers'][name]['error']}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            save()
    results["predicted"] = predict(results)
    by_variant = results["predicted"].get("by_variant")
    results["goal_met"] = None if by_variant is None else {
        lat: by_variant["decode"][lat]["tpot_ms"]["1"] <= goal for lat, goal in GOAL_TPOT_MS_B1.items()}
    save()
    print_summary(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
