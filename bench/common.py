"""What the speed benchmarks share: timers, floors, real-shape layer builders and results writing.

The benchmarks run as modules from the repository root (`python -m bench.layer ...`), where the model's modules
(`modeling_kimi_k3`, `kda`, `mxfp4_triton`, ...) import as they do for `pip install -e .`.

`DEVICE` is where the timers, floors and builders run: "cuda", or "cpu" for a dry run of a benchmark at tiny shapes
(`bench.layer --smoke`, `bench.tp_sim --device cpu`; host timers, no graphs). A benchmark sets it once, before it
builds anything.
"""

import json
import os
import statistics
import time
from importlib.metadata import version

import torch

import kda
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_dispatch import use_fast_paths
from modeling_kimi_k3 import KimiK3Cache, KimiK3DecoderLayer, KimiK3DeltaAttention, merge_block_projections
from reap_tools.tiny import random_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DEVICE = "cuda"
# The model card's serving figures (README.md), what the benchmarks print beside theirs.
CARD = {"tpot_ms": 38.8, "tok_s": 24.7, "tok_s_131k": 15.7, "prefill_tok_s": 1880,
        "setup": "8x RTX 6000, SGLang (model card)"}


# ---------------------------------------------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------------------------------------------


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Milliseconds of the `with` body (`.ms`): CUDA events on the GPU, the host clock on the CPU."""

    def __enter__(self):
        if DEVICE == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if DEVICE == "cuda":
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def time_ms(fn, reps, warmup=1, setup=None):
    """Median milliseconds of `fn()` over `reps` runs (`setup()` runs untimed before each)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        with Timer() as t:
            fn()
        times.append(t.ms)
    return statistics.median(times)


def graph_of(fn, reset):
    """CUDA graph of `fn()` (after two warm-up runs on a side stream); returns (graph, captured output)."""
    if DEVICE != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            reset()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    reset()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def quick_tune_from_env():
    """With `KIMI_K3_QUICK_TUNE=1`, cut fla's autotuners to one configuration each (`kda.quick_tune`), to spare
    device time; returns whether it did."""
    on = os.environ.get("KIMI_K3_QUICK_TUNE") == "1"
    if on:
        kda.quick_tune(1)
    return on


# ---------------------------------------------------------------------------------------------------------------
# Floors: what a step must move or compute, and the rates this device moves and computes at
# ---------------------------------------------------------------------------------------------------------------


def copy_bandwidth(reps):
    """Device-to-device copy bandwidth in bytes/s, read + write counted (2 GiB each way on a GPU)."""
    n = 1 << 31 if DEVICE == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), reps, warmup=2)
    return 2 * n / (ms * 1e-3)


def ceilings(quick):
    """The copy bandwidth and the bf16 matmul rate measured on this device (the floors' denominators)."""
    copy_bw = copy_bandwidth(5 if quick else 10)
    m = 8192 if DEVICE == "cuda" else 256
    x = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    ms = time_ms(lambda: x @ y, 5 if quick else 10, warmup=3)
    peak = 2 * m**3 / (ms * 1e-3)
    return {"copy_bandwidth_GBps": copy_bw / 1e9, "bf16_matmul_TFLOPs": peak / 1e12}


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(layer):
    """Bytes of one routed expert's MXFP4 packs and scales."""
    e = layer.block_sparse_moe.experts[0]
    return nbytes([p for lin in (e.w1, e.w3, e.w2) for p in (lin.weight_packed, lin.weight_scale)])


def non_expert_bytes(module):
    return nbytes([p for n, p in module.named_parameters() if ".experts." not in f".{n}"])


def layer_flops(layer, tokens):
    """Matmul FLOPs of a prefill of `tokens` tokens (batch 1), routed experts at top-k, plus the attention core."""
    text_linear = 0
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear) and ".experts." not in f".{name}.":
            text_linear += module.in_features * module.out_features
    flops = 2 * tokens * text_linear
    moe = getattr(layer, "block_sparse_moe", None)  # None: the dense layer 0
    if moe is not None:
        e = moe.experts[0]
        flops += 6 * tokens * moe.gate.top_k * e.w1.in_features * e.w1.out_features
    attn = layer.self_attn
    if isinstance(attn, KimiK3DeltaAttention):
        flops += 2 * tokens * attn.num_heads * (4 * attn.head_dim**2 + 2 * 64 * attn.head_dim)
    else:
        flops += 2 * (tokens * tokens / 2) * attn.num_heads * (attn.nope_dim + attn.rope_dim + attn.v_dim)
    return flops


# ---------------------------------------------------------------------------------------------------------------
# Real-shape builders (random weights)
# ---------------------------------------------------------------------------------------------------------------


def truncated(config, layers):
    """The release config cut to its first `layers` decoder layers (layer kinds and expert counts kept)."""
    d = config.to_dict()
    text = d["text_config"]
    text["num_hidden_layers"] = layers
    lac = text["linear_attn_config"]
    for key in ("full_attn_layers", "kda_layers"):
        lac[key] = [i for i in lac[key] if i <= layers]  # 1-based layer numbers
    return KimiK3Config(**d)


def fill_experts(moe):
    """Random MXFP4 packs (random bytes, scale codes 114..123) in the block's expert stacks (their `ExpertStack`
    made again after, for its largest scale code)."""
    stack = moe.stack_experts()
    for packed in (stack.w1, stack.w3, stack.w2):
        packed.random_(0, 256)
    for scale in (stack.s1, stack.s3, stack.s2):
        scale.random_(114, 124)
    moe.expert_stack = None
    moe.stack_experts()


def build_layer(text, index, seed):
    """Decoder layer `index` at the config's widths on `DEVICE`, bf16, random weights, experts stacked and
    projections merged as a load leaves them (the dense layer 0 the same way without the MoE parts)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            layer = KimiK3DecoderLayer(text, index, packed_experts=True)
    finally:
        torch.set_default_dtype(previous)
    layer.eval().requires_grad_(False)
    moe = getattr(layer, "block_sparse_moe", None)  # None: the dense layer 0
    with torch.no_grad():
        if moe is not None:
            moe.gate.weight.normal_(0.0, 0.02)
            moe.gate.e_score_correction_bias.zero_()
        for proj in (layer.self_attention_res_proj, layer.mlp_res_proj):
            proj.weight.normal_(0.0, 0.02)
        if moe is not None:
            fill_experts(moe)
    return merge_block_projections(layer)


def decode_cache(text, layer, batch, seed, context):
    """A cache for one decode step of `layer` at `batch`: random KDA state and conv histories, or `context` random
    MLA latents. Returns (cache, reset: puts that state back, bytes the step reads and writes of it)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    cache = KimiK3Cache(text)
    i = layer.layer_idx
    attn = layer.self_attn
    if isinstance(attn, KimiK3DeltaAttention):
        width = attn.num_heads * attn.head_dim
        conv = tuple(torch.randn(batch, width, 3, device=DEVICE, generator=gen, dtype=torch.bfloat16)
                     for _ in range(3))
        state = torch.randn(batch, attn.num_heads, attn.head_dim, attn.head_dim, device=DEVICE, generator=gen) * 0.02
        base = {"conv": conv, "state": state}

        def reset():
            cache.layers[i].update(base["conv"], base["state"])

        state_bytes = 2 * nbytes([state]) + 2 * nbytes(conv)
    else:
        latent = torch.randn(batch, context, attn.kv_lora_rank + attn.rope_dim, device=DEVICE, generator=gen,
                             dtype=torch.bfloat16)

        def reset():
            cache.layers[i].latent = latent
            cache.seen_tokens = context

        state_bytes = nbytes([latent]) + nbytes([latent[:, :1]])
    reset()
    return cache, reset, state_bytes


class RouteRecorder:
    """Records the expert ids the router picks (forward hook on the gate)."""

    def __init__(self, gate):
        self.ids = None
        self.handle = gate.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.ids = output[0].detach()

    def unique(self):
        return int(self.ids.unique().numel())


# ---------------------------------------------------------------------------------------------------------------
# Greedy decoding of a small bf16 model, fast paths against the reference (bench.greedy_gpu, tests/test_gpu_paths.py)
# ---------------------------------------------------------------------------------------------------------------


def small_model(device="cuda"):
    """A small random bf16 model at the release's KDA head shape (96 x 128), sharp logits, no EOS, its projections
    merged as a load leaves them."""
    config = tiny_config(packed=True, hidden_size=128, routed_expert_hidden_size=256, moe_intermediate_size=128,
                         num_experts=16, num_experts_per_token=4,
                         linear_attn_config=dict(num_heads=96, head_dim=128, full_attn_layers=[3, 6],
                                                 kda_layers=[1, 2, 4, 5]))
    model = random_model(config, seed=5)
    with torch.no_grad():
        model.language_model.lm_head.weight.mul_(30.0)  # sharper logits: fewer near-ties for greedy to flip on
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.pad_token_id
    return merge_block_projections(model.to(device, torch.bfloat16))


REFERENCE = dict.fromkeys(("experts", "kda", "kda_prefill", "fused", "side_streams", "cuda_graphs",
                           "merged_projections"), "off")


def teacher_forced(model, prompt, generated):
    """Run the reference paths (no cache) over `generated`; per generated token, its logit's shortfall below the
    reference's argmax in logit standard deviations (0 where the reference would have picked it too). Returns
    (share of steps at 0, mean shortfall, largest shortfall)."""
    with torch.no_grad(), use_fast_paths(model, **REFERENCE):
        logits = model(generated[:, :-1]).logits[:, prompt.shape[1] - 1:].float()
    chosen = generated[:, prompt.shape[1]:]
    gap = (logits.max(-1).values - logits.gather(-1, chosen[..., None])[..., 0]) / logits.std(-1)
    return float((gap == 0).float().mean()), gap.mean().item(), gap.max().item()


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


def write_json(path, data):
    """`data` as JSON at `path`, atomically (a temporary file beside it, then a rename); folders made as needed."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def package_version(dist):
    """The installed version of distribution `dist`, or None."""
    try:
        return version(dist)
    except Exception:
        return None
