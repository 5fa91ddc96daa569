"""One rank's share of Kimi K3 at TP8, timed on one GPU: the predicted 8-GPU decode TPOT (issue #19, simulation).

There is no 8-GPU machine, so this times what rank 0 of an 8-way tensor + expert parallel job runs, on one device,
and adds the cost of its collectives from a stated model (not measured):

  * real-width modules from the root config.json with random weights (`bench.common.build_layer`: MXFP4 packs of
    random bytes): a KDA + MoE layer, an MLA + MoE layer, layer 0 (KDA + dense MLP), and the head stage (embedding
    lookup, the output depth mix + final norm, the LM head). Each is timed whole first (the single-GPU reference of
    the same run), then sharded in place by `tensor_parallel.shard(module, TensorParallel(rank=0, size=8))` (12 of
    96 heads, 40 of 320 experts, 1/8 of the dense and shared MLPs and of the vocabulary) and timed again;
  * decode steps at batch 1 and 8 as `bench.layer` times them (4 block-bank rows, KDA state or a 2048-token MLA
    latent cache), replayed from CUDA graphs on CUDA, eager on the CPU (there only a dry run of the code path);
  * `tensor_parallel.all_reduce` is replaced by an identity that records each call (`AllReduceStandIn`; chosen over
    a process group of size 1, which would put a do-nothing NCCL call in the graph and still not time a real one):
    rank 0's partial sums stand for the sums over the ranks, same shapes, so every kernel after a collective runs as
    it would. Each recorded all-reduce then costs latency + 2(N-1)/N * bytes / bus bandwidth (ring), with public
    figures for NVLink H200 and PCIe RTX PRO 6000 (`ALL_REDUCE_MODELS`, sources there);
  * the busiest rank sets each MoE layer's step (every layer ends in all-reduces that wait for all ranks). Random
    hidden states through the real-width router give the distribution of experts hit per rank (max over the 8
    ranks) at batch 1 and 8; for the timed step the input (of a few candidates) whose busiest rank hits about that
    distribution's mean is taken, and the router's rows of that rank's experts are swapped with rank 0's, so rank 0
    is the busiest rank on it (the router is replicated and its weights random: a relabelling). The rank's experts
    call is also timed alone against the number of experts it hits;
then sums the model from config.json's layer kinds (1 dense + 68 KDA + 24 MLA + head): each per-rank time plus its
modelled all-reduces, next to the single-GPU extrapolation in bench/results/layer_h200.json, the same run's
full-width layers and the model card's SGLang TP8 figure (README.md).

    KIMI_K3_QUICK_TUNE=1 python3 -m bench.tp_sim --out bench/results/tp_sim_h200.json
    python -m bench.tp_sim --device cpu --quick --out /tmp/tp_sim_cpu.json   # tiny widths, reference paths
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
from torch import nn

import tensor_parallel
from bench import common
from bench.common import (CARD, RouteRecorder, build_layer, copy_bandwidth, decode_cache, expert_bytes, graph_of,
                          nbytes, non_expert_bytes, package_version, sync, time_ms, truncated)
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_dispatch import resolve_fast_paths
from modeling_kimi_k3 import KimiK3LanguageModel, KimiK3LatentMoE
from tensor_parallel import TensorParallel, check_tp_size, shard

TP = 8
BATCHES = (1, 8)
GOAL_TPOT_MS_B1 = 15.0  # issue #19: predicted TP8 TPOT at batch 1 on 8 x H200
BANK_ROWS = 4  # block-bank rows before a decoder layer, as bench.layer times it (a mid-depth layer)
MLA_CONTEXT = 2048  # cached latents behind an MLA layer's decode step, as bench.layer times it (--quick: 16)
SINGLE_GPU_RESULTS = os.path.join("bench", "results", "layer_h200.json")

# Public figures, none measured here. Each all-reduce of `bytes` costs latency + 2(N-1)/N * bytes / bus_bandwidth
# (nccl-tests' busbw convention, ring). The decode messages here are 14 KB to 2.6 MB, far below the sizes where busbw
# saturates, so the latency term dominates; the ranges give optimistic / pessimistic predictions.
ALL_REDUCE_MODELS = {
    "nvlink_h200": {
        "latency_us": 15.0,
        "latency_us_range": [5.0, 20.0],
        "bus_bandwidth_GBps": 370.0,
        "bus_bandwidth_GBps_range": [360.0, 480.0],
        "link": "NVLink 4 through NVSwitch, 900 GB/s bidirectional (450 GB/s each way) per GPU",
        "source": "Link: NVIDIA H200 Tensor Core GPU datasheet (NVLink 900 GB/s). Bus bandwidth: nccl-tests "
                  "all_reduce_perf on 8 x H100 SXM (the NVLink 4 / NVSwitch fabric of HGX H200), large messages: "
                  "ring 365-370 GB/s, NVLS ~480 GB/s (github.com/NVIDIA/nccl/issues/1455). Latency: NCCL's own "
                  "tuner model for ring + LL on one node, base 6.6 us + 2(N-1) = 14 steps x 0.6 us (NVLink) = 15.0 "
                  "us at N = 8 (NVIDIA/nccl src/graph/tuning.cc, commit 5067397); nccl-tests with CUDA graphs show "
                  "~6 us at 2 GPUs with NVLS (NVIDIA/nccl issue 1259) and ~2.3 us tuned with NCCL 2.27 symmetric "
                  "memory on 8 x H200 (NVIDIA/nccl issue 1940): range 5-20 us. Public figures, not measured here.",
    },
    "pcie_rtx6000": {
        "latency_us": 20.6,
        "latency_us_range": [20.0, 30.0],
        "bus_bandwidth_GBps": 40.0,
        "bus_bandwidth_GBps_range": [35.0, 50.0],
        "link": "PCIe 5.0 x16, no NVLink (RTX PRO 6000 Blackwell): 63 GB/s each way by the PCIe 5 spec",
        "source": "Link: NVIDIA RTX PRO 6000 Blackwell product specifications (PCIe 5.0 x16, no NVLink). Bus "
                  "bandwidth: nccl-tests busbw 35-45 GB/s on 8 x H100 PCIe without NVSwitch (docs.alayanew.com, "
                  "'NCCL-tests in practice', 2026-05-06), up to ~50 GB/s for the link itself. Latency: NCCL's tuner "
                  "model, ring + LL, base 6.6 us + 14 steps x 1.0 us (PCIe) = 20.6 us (NVIDIA/nccl "
                  "src/graph/tuning.cc, commit 5067397); more where the 8 GPUs span two CPU sockets: range 20-30 "
                  "us. Public figures, not measured here.",
    },
}
# The all-reduces of each module kind under tensor_parallel.py's plan (its call sites): what the recorded calls are
# checked against.
PLAN_ALL_REDUCES = {
    "kda_moe": ["self_attn.o_proj (columns split, _sum_output hook)", "block_sparse_moe.shared_experts.down_proj "
                "(_sum_output hook)", "block_sparse_moe expert-parallel fp32 latent sum (ExpertParallel.sum_pairs)"],
    "dense0": ["self_attn.o_proj (_sum_output hook)", "mlp.down_proj (_sum_output hook)"],
    "head": ["embed_tokens (VocabParallelEmbedding)", "lm_head logits, whole vocabulary (_gather_vocab hook)"],
}
PLAN_ALL_REDUCES["mla_moe"] = PLAN_ALL_REDUCES["kda_moe"]
# The prediction of each interconnect: the H200 per-rank times with that model's all-reduces.
PREDICTION_NAMES = {"nvlink_h200": "h200_nvlink", "pcie_rtx6000": "rtx6000_pcie"}
# Memory bandwidth (public spec figures) for a rough RTX PRO 6000 estimate: the H200 per-rank times scaled by the
# bandwidth ratio, decode being mostly bandwidth-bound. Only a sanity check against the card's measured figure.
MEMORY_BANDWIDTH_TBps = {"h200": 4.8, "rtx_pro_6000": 1.792}
MEMORY_BANDWIDTH_SOURCE = ("NVIDIA H200 datasheet (4.8 TB/s HBM3e); NVIDIA RTX PRO 6000 Blackwell specifications "
                           "(1,792 GB/s GDDR7)")
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
    """Stands in for `tensor_parallel.all_reduce` in this one process: returns its input unchanged and, inside
    `record`, notes each call's message (shape, dtype, bytes)."""

    def __init__(self):
        self.calls = None

    def __call__(self, x, group=None):
        if self.calls is not None:
            self.calls.append({"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                               "bytes": x.numel() * x.element_size()})
        return x

    def record(self, fn):
        """Run `fn()` and return the all-reduces it called."""
        self.calls = []
        try:
            fn()
            return self.calls
        finally:
            self.calls = None


STAND_IN = AllReduceStandIn()


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
    """Shard `module` in place for rank 0 of TP, then restack each MoE block's experts (its 40 now; the loader does
    the same after reading a shard)."""
    shard(module, TensorParallel(rank=0, size=TP))
    for m in module.modules():
        if isinstance(m, KimiK3LatentMoE):
            m.stack_experts()


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


def decode_step(text, layer, batch, seed, context):
    """A decode step of `layer` at `batch` (inputs and cache from `seed`, `context` cached MLA latents): (step,
    reset, state bytes)."""
    cache, reset, state_bytes = decode_cache(text, layer, batch, seed, context)
    gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
    bank = tuple(torch.randn(batch, 1, text.hidden_size, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
                 for _ in range(BANK_ROWS))
    partial = torch.randn(batch, 1, text.hidden_size, device=common.DEVICE, generator=gen, dtype=torch.bfloat16)
    return (lambda: layer(bank, partial, None, cache)[1]), reset, state_bytes


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
        step, reset, _ = decode_step(text, layer, batch, seed, context)
        hits = hits_per_rank(routing_of(layer, step, reset), per_rank, TP)
        if best is None or abs(max(hits) - target) < abs(max(best[1]) - target):
            best = (seed, hits)
    seed, hits = best
    busiest = hits.index(max(hits))
    swap_router_blocks(moe.gate, 0, busiest, per_rank)
    hits[0], hits[busiest] = hits[busiest], hits[0]
    return seed, hits


def measure_layer(text, layer, batch, seed, reps, copy_bw, context):
    """One decode step of `layer`: its all-reduces (one eager step), experts hit, bytes and floor, median ms."""
    step, reset, state_bytes = decode_step(text, layer, batch, seed, context)
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
    res["floor_ms"] = res["bytes"] / copy_bw * 1e3
    res.update(time_step(step, reset, reps))
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
    res.update(time_step(step, lambda: None, reps))
    return res


def experts_call(moe, z, ids, weights):
    """The block's routed-experts op as its forward dispatches it (the Triton kernels where the experts path is on),
    then the weighted pair sum."""
    ops = moe.dispatch.ops(z.device)
    return ops.pair_sum_norm(ops.routed_experts(moe, z, ids), weights, moe.routed_expert_norm, z.dtype)


def experts_call_sweep(moe, batch, reps, seed):
    """Median ms of the rank's experts call at `batch` tokens against the number of its experts hit (one pair
    each; the other pairs on other ranks' experts, id = count, as `ExpertParallel.local_ids` marks them)."""
    k, count = moe.gate.top_k, moe.num_experts
    device = common.DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(batch, moe.routed_expert_down_proj.out_features, device=device, generator=gen,
                    dtype=torch.bfloat16)
    weights = torch.full((batch, k), 1.0 / k, device=device)
    out = {}
    for hits in sorted({min(h, count, batch * k) for h in ((1, 2, 3, 4, 6, 8, 16) if batch == 1 else
                                                           (4, 8, 12, 16, 20, 24, 32, 40))}):
        ids = torch.full((batch, k), count, dtype=torch.int64, device=device)
        j = torch.arange(hits, device=device)
        ids[j % batch, j // batch] = j
        out[str(hits)] = time_step(lambda: experts_call(moe, z, ids, weights), lambda: None, reps)["ms"]
    return out


def all_reduce_ms(messages, model, latency_us=None, bandwidth_GBps=None):
    """Modelled ms of `messages` (recorded all-reduces) under one ALL_REDUCE_MODELS entry."""
    lat = model["latency_us"] if latency_us is None else latency_us
    bw = model["bus_bandwidth_GBps"] if bandwidth_GBps is None else bandwidth_GBps
    return sum(lat * 1e-3 + 2 * (TP - 1) / TP * m["bytes"] / (bw * 1e9) * 1e3 for m in messages)


def all_reduce_ms_range(messages, model):
    """(optimistic, pessimistic) modelled ms: lowest latency with highest bandwidth, and the reverse."""
    (lat_lo, lat_hi), (bw_lo, bw_hi) = model["latency_us_range"], model["bus_bandwidth_GBps_range"]
    return all_reduce_ms(messages, model, lat_lo, bw_hi), all_reduce_ms(messages, model, lat_hi, bw_lo)


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
    """TP8 TPOT: every layer and the head at its per-rank time plus its modelled all-reduces."""
    counts = results["config"]["layer_counts"]
    per_rank, full, messages = results["per_rank_layer_ms"], results["full_layer_ms"], results["all_reduces_per_layer"]
    parts = list(counts) + ["head"]
    missing = [p for p in parts if any(str(b) not in per_rank.get(p, {}) or str(b) not in full.get(p, {})
                                       for b in BATCHES)]
    if missing:
        return {"skipped": f"not measured: {missing}"}
    weight = dict(counts, head=1)
    ratio = MEMORY_BANDWIDTH_TBps["h200"] / MEMORY_BANDWIDTH_TBps["rtx_pro_6000"]
    tpot, tpot_range, comm, compute, full_tpot = {}, {}, {}, {}, {}
    for b in map(str, BATCHES):
        compute[b] = sum(weight[p] * per_rank[p][b] for p in parts)
        full_tpot[b] = sum(weight[p] * full[p][b] for p in parts)
        for net, model in ALL_REDUCE_MODELS.items():
            ms = sum(weight[p] * all_reduce_ms(messages[p][b]["messages"], model) for p in parts)
            lo, hi = (sum(weight[p] * all_reduce_ms_range(messages[p][b]["messages"], model)[i] for p in parts)
                      for i in (0, 1))
            comm.setdefault(net, {})[b] = ms
            name = PREDICTION_NAMES[net]
            tpot.setdefault(name, {})[b] = compute[b] + ms
            tpot_range.setdefault(name, {})[b] = [compute[b] + lo, compute[b] + hi]
        tpot.setdefault("rtx6000_pcie_memory_scaled", {})[b] = compute[b] * ratio + comm["pcie_rtx6000"][b]
    return {
        "tpot_ms": tpot,
        "tpot_ms_range": tpot_range,
        "tok_s": {name: {b: 1e3 / v for b, v in row.items()} for name, row in tpot.items()},
        "tok_s_aggregate": {name: {b: int(b) * 1e3 / v for b, v in row.items()} for name, row in tpot.items()},
        "per_rank_compute_ms": compute,
        "all_reduce_ms_per_token": comm,
        "all_reduces_per_token": {b: sum(weight[p] * len(messages[p][b]["messages"]) for p in parts)
                                  for b in map(str, BATCHES)},
        "same_run_full_width_tpot_ms": full_tpot,
        "speedup_vs_same_run_full_width": {b: full_tpot[b] / tpot["h200_nvlink"][b] for b in full_tpot},
        "notes": "tpot = sum over layers (count x (per-rank graph ms + modelled all-reduce ms)) + head. The "
                 "all-reduces are added serially (none overlapped, though the shared experts' one sits on a side "
                 "stream), and only GPU time counts: no host or scheduler time a serving engine adds per step, no "
                 "sampling. h200_nvlink and rtx6000_pcie both use the H200 per-rank times: rtx6000_pcie isolates the "
                 "interconnect; rtx6000_pcie_memory_scaled also scales the per-rank times by the memory bandwidth "
                 f"ratio {ratio:.2f} (MEMORY_BANDWIDTH_TBps: {MEMORY_BANDWIDTH_SOURCE}), a rough sanity check "
                 "against the card's measured figure only (other GPU, other kernels). same_run_full_width_tpot_ms: "
                 "the unsharded layers of this run summed the same way, what a device_map split over 8 GPUs runs "
                 "(one GPU at a time; its 7 hops left out).",
    }


def record_all_reduces(results, kind, batch, calls):
    """The all-reduces one step of rank 0's `kind` called, next to the plan's count for it."""
    results["all_reduces_per_layer"].setdefault(kind, {})[str(batch)] = {
        "count": len(calls), "plan": PLAN_ALL_REDUCES[kind], "matches_plan": len(calls) == len(PLAN_ALL_REDUCES[kind]),
        "messages": calls}


def run_layer(kind, index, text, args, results, save):
    """Whole, then rank 0's shard of, decoder layer `index`: decode steps at each batch (and, for the first MoE
    layer, the router's hit statistics and the rank's experts call against its hits)."""
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
        r = measure_layer(text, layer, b, seed=b, reps=args.reps, copy_bw=args.copy_bw, context=args.context)
        entry.setdefault("full", {})[str(b)] = r
        results["full_layer_ms"].setdefault(kind, {})[str(b)] = r["ms"]
        print(f"[{kind}] full b{b}: {r['ms']:.3f} ms ({r['mode']}), floor {r['floor_ms']:.3f}"
              + (f", experts hit {r['experts_hit']}" if moe is not None else ""), flush=True)
        save()
    shard_rank0(layer)
    for b in BATCHES:
        seed = b
        if moe is not None:
            target = round(hit["router_stats"][str(b)]["max_over_ranks"]["mean"])
            seed, _ = make_rank0_busiest(text, layer, b, target, range(100, 100 + args.candidates), args.context)
        r = measure_layer(text, layer, b, seed=seed, reps=args.reps, copy_bw=args.copy_bw, context=args.context)
        entry.setdefault("rank0_of_8", {})[str(b)] = r
        results["per_rank_layer_ms"].setdefault(kind, {})[str(b)] = r["ms"]
        record_all_reduces(results, kind, b, r["all_reduces"])
        if moe is not None:
            hit.setdefault("timed", {}).setdefault(kind, {})[str(b)] = {
                "target_max_over_ranks": target, "rank0_experts_hit": r["experts_hit"],
                "hits_per_rank": r["experts_hit_per_rank"], "input_seed": seed}
        print(f"[{kind}] rank 0 of {TP} b{b}: {r['ms']:.3f} ms ({r['mode']}), floor {r['floor_ms']:.3f}, "
              f"{len(r['all_reduces'])} all-reduces ({sum(m['bytes'] for m in r['all_reduces'])} B)"
              + (f", experts hit {r['experts_hit']} (per rank {r['experts_hit_per_rank']})" if moe is not None
                 else ""), flush=True)
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
            summary = results["per_rank_layer_ms" if sharded else "full_layer_ms"]
            summary.setdefault("head", {})[str(b)] = r["ms"]
            if sharded:
                record_all_reduces(results, "head", b, r["all_reduces"])
            print(f"[head] {name} b{b}: {r['ms']:.3f} ms ({r['mode']}), floor {r['floor_ms']:.3f}, "
                  f"{len(r['all_reduces'])} all-reduces", flush=True)
            save()


def print_summary(results):
    print(f"\n=== Kimi K3 at TP{TP}, one rank's share timed on {results['device']} ===")
    counts = results["config"]["layer_counts"]
    nan = float("nan")
    for kind in list(counts) + ["head"]:
        rank, full = results["per_rank_layer_ms"].get(kind, {}), results["full_layer_ms"].get(kind, {})
        row = " | ".join(f"b{b}: rank {rank.get(b, nan):.3f} ms vs whole {full.get(b, nan):.3f} ms "
                         f"({full.get(b, nan) / rank.get(b, nan):.1f}x)" for b in map(str, BATCHES))
        n = results["all_reduces_per_layer"].get(kind, {}).get("1", {}).get("count", "?")
        print(f"{kind:8s} x{counts.get(kind, 1):2d}: {row} | {n} all-reduces")
    stats = results["experts_hit_per_rank"].get("router_stats", {})
    for b, s in stats.items():
        print(f"experts hit per rank (random router), b{b}: mean {s['per_rank_mean']:.1f}, busiest rank mean "
              f"{s['max_over_ranks']['mean']:.1f} (p90 {s['max_over_ranks']['p90']:.0f}); all ranks "
              f"{s['distinct_experts_total_mean']:.1f} distinct")
    p = results.get("predicted", {})
    if "tpot_ms" in p:
        for name, row in p["tpot_ms"].items():
            rng = p["tpot_ms_range"].get(name, {})
            print(f"predicted TPOT {name:26s}: " + " | ".join(
                f"b{b} {v:.1f} ms ({p['tok_s'][name][b]:.1f} tok/s)"
                + (f" [{rng[b][0]:.1f}-{rng[b][1]:.1f}]" if b in rng else "") for b, v in row.items()))
        def ms(row):
            return " / ".join(f"{v:.2f}" if v is not None else "n/a" for v in (row or {}).values()) + " ms"

        comm = ", ".join(f"{net} {ms(row)}" for net, row in p["all_reduce_ms_per_token"].items())
        print(f"b1 / b8: per-rank compute {ms(p['per_rank_compute_ms'])}; modelled all-reduces a token "
              f"({p['all_reduces_per_token']['1']}): {comm}")
        ref = results["reference"]
        print(f"b1 / b8: this run's whole layers summed (device_map-like) {ms(p['same_run_full_width_tpot_ms'])}; "
              f"single-GPU extrapolation ({SINGLE_GPU_RESULTS}) {ms(ref['device_map_tpot_ms'])}; card (SGLang TP8, "
              f"8 x RTX 6000) {ref['card_sglang_tp8_tpot_ms']} ms at b1")
        print(f"goal: TP8 TPOT <= {GOAL_TPOT_MS_B1} ms at batch 1 on 8 x H200 -> "
              f"{'met' if results['goal_met'] else 'NOT met'} ({p['tpot_ms']['h200_nvlink']['1']:.1f} ms)"
              + (" [dry run: tiny widths]" if results["config"]["tiny_widths"] else ""))
    else:
        print(f"no prediction: {p.get('skipped')}")
    print(f"elapsed {results.get('elapsed_s', 0):.0f} s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "tp_sim_h200.json"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny widths and few repetitions: a dry run of the same code (e.g. on the CPU)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the remaining sections once past this")
    args = parser.parse_args(argv)
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
            "fast_paths": str(resolve_fast_paths({}, args.device)),
            "fla_quick_tune": quick_tune,
            "all_reduce_stand_in": "tensor_parallel.all_reduce monkeypatched to an identity that records each call "
                                   "(no NCCL, no process group): rank 0's partial sums stand for the reduced ones; "
                                   "each call's cost comes from all_reduce_model",
            "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                         "fla": package_version("fla-core")},
        },
        "per_rank_layer_ms": {}, "full_layer_ms": {},
        "experts_hit_per_rank": {"method": HIT_METHOD},
        "all_reduce_model": dict(ALL_REDUCE_MODELS, formula="t = latency + 2(N-1)/N * bytes / bus_bandwidth, N = 8",
                                 memory_bandwidth_TBps=MEMORY_BANDWIDTH_TBps),
        "all_reduces_per_layer": {},
        "reference": {"device_map_tpot_ms": single_gpu_reference(),
                      "device_map_source": f"{SINGLE_GPU_RESULTS} extrapolation.b1/b8.graph.tpot_ms: 93 layers + LM "
                                           "head from one layer of each kind on one H200, CUDA graphs; a device_map "
                                           "split runs the same layers one GPU at a time",
                      "card_sglang_tp8_tpot_ms": CARD["tpot_ms"],
                      "card_tok_s": CARD["tok_s"],
                      "card_source": f"README.md (model card): {CARD['setup']}"},
        "goal_tpot_ms_b1": GOAL_TPOT_MS_B1,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "layers": {},
    }

    def save():
        results["elapsed_s"] = time.time() - started
        common.write_json(args.out, results)

    args.copy_bw = copy_bandwidth(3 if args.quick else 10)
    results["copy_bandwidth_GBps"] = args.copy_bw / 1e9
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
    tpot = results["predicted"].get("tpot_ms")
    results["goal_met"] = tpot["h200_nvlink"]["1"] <= GOAL_TPOT_MS_B1 if tpot else None
    save()
    print_summary(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
