"""Train the small Kimi K3 demo checkpoint (issue 5) and package it as `demo/parent/`.

    python -m demo_build.train_demo bench --data data [--batches 8,16,32] [--moe stock,grouped]  # GPU: tokens/s
    python -m demo_build.train_demo kda-bench [--device cuda] [--batch 64]                         # KDA fwd+bwd alone
    python -m demo_build.train_demo train --data data --out OUT [--seconds 480] [--batch 32]       # GPU: train
    python -m demo_build.train_demo package OUT --data data [--dst demo/parent]                    # CPU: release dir
    python -m demo_build.train_demo sync-code [demo/parent]                                        # CPU: code files

The corpus comes from `demo_build.prepare_corpus` (uint16 token ids + tiktoken.model in data/: the stdlib and the
Python docs, with their held-out splits) and `demo_build.package_corpus` (more training code: the sources of installed
packages, kept apart from the held-out files). The recipe of the shipped demo/parent (issue 21), in two stages:
the earlier parent (two H200 calls, 1610 steps, 52.8 M tokens; demo_build/results/train_demo_112/train_call{1,2}.log),
then one H100 call that went on from it (784 steps, 51.4 M tokens; demo_build/results/train_demo_init/):

    python -m demo_build.prepare_corpus                              # CPU, ~50 s; data/ is git-ignored
    python -m demo_build.package_corpus --max-mb 14                  # where the packages are installed (GPU image)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python -m demo_build.train_demo train --out OUT --seconds 455 --batch 64 --state STATE   # stage 1: one H200
    python -m demo_build.train_demo train --out OUT --seconds 515 --batch 64 --resume STATE      # call 2, same machine
    python -m demo_build.train_demo package OUT                      # CPU -> demo/parent
    python -m demo_build.train_demo train --out OUT2 --seconds 450 --batch 128 --kda wy --stdlib-share 0.5 \
        --init demo/parent                                           # stage 2: one H100 call
    python -m demo_build.train_demo package OUT2                     # CPU -> demo/parent (the old one removed)
    python -m demo_build.eval_demo                                   # CPU: held-out perplexity, completions

(OUT/train_log.json, with the run's step count, tokens and speed, is copied into the demo directory.)

Shape (`demo_config`): the parent's ratios at toy size. hidden 256, 8 layers, every 4th MLA (1-based
full_attn_layers [4, 8]), attn_res_block_size 4 (two blocks), layer 0 dense (intermediate 1216 ~ 4.7 H), 112 routed
experts top-8 in a latent of 128 (= H / 2) with moe_intermediate 128, 2 shared experts, KDA and MLA with 4 heads
(KDA head_dim 64; MLA nope 64 / rope 32 / v 64, q_lora 96, kv_lora 64), vocab = BPE ranks + 256 K3 specials.
112 = 896 / 8, so the card's cut (896 -> 320) is exactly 112 -> 40.

Training runs the model's own bf16-expert mode (config without quantization_config): bf16 parameters (A_log,
dt_bias and the router bias stay fp32, as the model keeps them), fp32 master weights in a fused AdamW, one sequence
length (512), 85 % of each batch from Python source and 15 % from prose; the code windows start anywhere in the
standard library + package code, or with `--stdlib-share S` a share S of them in the standard library (the held-out
code's domain; `demo_build.domain_anneal` measured that going on with package code alone raised the held-out code's
perplexity while the standard library's lowered it). Autograd runs the torch KDA (`--kda
torch`, the default), its batched form `wy_chunk_kda` (`--kda wy`: the same values, without the reference's
pairwise-decay tensors, which were most of a step on the H200; there 150 k tokens/s at batch 128 against
the torch KDA's 67 k at 64, demo_build/results/train_demo_wy/) or fla's chunked kernel (`--kda
fla`; the model's dispatch gives training only paths with a backward). `--shape` trains another size of the same
design (a JSON object over DEMO_SHAPE); `--init DIR` starts from a packaged demo checkpoint instead of a random init
(every tensor must match; the schedule starts again with its warmup). The router bias gets no gradient (noaux_tc); it is updated after each step by the aux-loss-free rule
(bias += u * sign(mean load - expert load)). The learning rate warms up over 40 steps, then the step time is
measured and the run is sized to `--seconds`: warmup-stable-decay (`lr_at`), with `--state` saving a resumable state
at the decay's start and `--resume` continuing it. `--moe grouped` swaps, for training only, the expert loop of
`KimiK3LatentMoE.forward` for grouped matmuls over stacked expert weights (same math, same parameters;
`tests/test_demo.py` checks it against the stock forward); the shipped checkpoint runs the stock model code.

`train` writes into OUT: config.json (bf16 experts), weights-NN.safetensors (the state dict in pieces under 15 MiB,
the routed experts packed as MXFP4) and train_log.json. `package` rebuilds the model from them (experts unpacked),
saves it with save_pretrained, converts the routed experts to MXFP4 with `python -m reap_tools quantize`
(compressed-tensors' compressor), and adds the tokenizer files and the remote-code files (copies of the root ones,
`reap_tools.remote_code.sync_remote_code`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import kda
import mxfp4
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_dispatch import use_fast_paths
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3LatentMoE, KimiK3Router
from reap_tools.quantize import EXPERT_WEIGHT
from reap_tools.remote_code import copy_remote_code, sync_remote_code
from reap_tools.tiny import AUTO_MAP

ROOT = Path(__file__).resolve().parents[1]
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
NUM_SPECIALS = 256
SEQ_LEN = 512
CODE_SHARE = 0.85
PART_BYTES = 15 << 20
# The demo's decoding (its generation_config.json): greedy with the repetition penalty that parsed best on the
# development headers of demo_build.tune_decoding (demo_build/results/tune_decoding.json: 27 of 50 with the newline,
# 26 of 50 typed without it and healed, against 20 and 18 without a penalty).
DEMO_DECODING = dict(do_sample=False, repetition_penalty=1.3)

DEMO_SHAPE = dict(
    hidden_size=256,
    intermediate_size=1216,
    num_hidden_layers=8,
    num_experts=112,
    num_experts_per_token=8,
    num_shared_experts=2,
    moe_intermediate_size=128,
    routed_expert_hidden_size=128,
    attn_res_block_size=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    linear_attn_config=dict(
        num_heads=4,
        head_dim=64,
        short_conv_kernel_size=4,
        use_full_rank_gate=True,
        gate_lower_bound=-5.0,
        full_attn_layers=[4, 8],
        kda_layers=[1, 2, 3, 5, 6, 7],
    ),
    max_position_embeddings=131072,
    first_k_dense_replace=1,
    initializer_range=0.02,
)


# ---------------------------------------------------------------------------------------------------------------
# Config and remote code
# ---------------------------------------------------------------------------------------------------------------


def demo_config(num_ranks: int, shape: str | None = None) -> KimiK3Config:
    """The demo's config for a vocabulary of `num_ranks` BPE ranks (+ 256 specials), routed experts in bf16;
    `shape`, a JSON object (`--shape`), overrides DEMO_SHAPE's keys to train another size of the same design."""
    ids = dict(bos_token_id=num_ranks, eos_token_id=num_ranks + 2, pad_token_id=num_ranks + NUM_SPECIALS - 1)
    overrides = json.loads(shape) if shape else {}
    unknown = sorted(set(overrides) - set(DEMO_SHAPE))
    if unknown:
        raise SystemExit(f"--shape: keys {unknown} are not in DEMO_SHAPE ({', '.join(DEMO_SHAPE)})")
    text = dict(DEMO_SHAPE, **overrides, vocab_size=num_ranks + NUM_SPECIALS, **ids)
    return KimiK3Config(text_config=text, quantization_config=None, auto_map=dict(AUTO_MAP), **ids)


# ---------------------------------------------------------------------------------------------------------------
# Training-only grouped MoE (same math as KimiK3LatentMoE.forward)
# ---------------------------------------------------------------------------------------------------------------


GROUP_ROWS = 16  # each expert's rows start on a multiple of 16 in the grouped buffer (what grouped GEMMs align to)


def grouped_moe_forward(self, x):
    """`KimiK3LatentMoE.forward` with the per-expert loop replaced by one grouped matmul per projection.

    The (token, slot) pairs are sorted by expert into a buffer where each expert's rows start on a multiple of
    GROUP_ROWS (zero rows between), and `torch._grouped_mm` runs every expert on its own rows: w1 and w3 as one
    [E, 2 * inner, L] stack, then w2. The buffer's size depends on the shapes only (pairs + E * GROUP_ROWS; the last
    expert's group runs to its end over zero rows), so the host never waits for the routing and no expert's load
    pads the others. Each pair's output is weighted and summed back in fp32 as the stock loop does (`index_add_`
    of `expert(z) * weight`); zero rows never reach the output.
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ids, weights = self.gate(flat)
    z = self.routed_expert_down_proj(flat)
    n, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=self.num_experts)
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    rows = n * k + self.num_experts * GROUP_ROWS
    ends = torch.cumsum(padded, 0)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - packed start, per expert
    dest = torch.arange(n * k, device=x.device) + shift[flat_ids[order]]
    offsets = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)
    token = order // k
    buf = z.new_zeros(rows, z.shape[-1]).index_copy(0, dest, z[token])
    w13 = torch.cat([torch.stack([e.w1.weight for e in self.experts]),
                     torch.stack([e.w3.weight for e in self.experts])], dim=1)  # [E, 2 * inner, L]
    w2 = torch.stack([e.w2.weight for e in self.experts])  # [E, L, inner]
    act = self.experts[0].glu(torch._grouped_mm(buf, w13.transpose(1, 2), offs=offsets))
    out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)[dest]
    y = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    y.index_add_(0, token, out.float() * weights.reshape(-1)[order, None])
    y = self.routed_expert_up_proj(self.routed_expert_norm(y.to(z.dtype)))
    return (y + self.shared_experts(flat)).view(shape)


def use_moe(kind: str):
    """Select the LatentMoE forward used for training: 'stock' (the model file's) or 'grouped'."""
    if not hasattr(KimiK3LatentMoE, "_stock_forward"):
        KimiK3LatentMoE._stock_forward = KimiK3LatentMoE.forward
    KimiK3LatentMoE.forward = grouped_moe_forward if kind == "grouped" else KimiK3LatentMoE._stock_forward


# ---------------------------------------------------------------------------------------------------------------
# Training-only KDA (same math as kda.chunk_kda)
# ---------------------------------------------------------------------------------------------------------------


WY_CHUNK = 16  # tokens per chunk: WY_CHUNK * |gate_lower_bound| <= 80 keeps e^{+-G} inside fp32's normal range


def wy_chunk_kda(q, k, v, g, beta, scale, initial_state=None):
    """`kda.chunk_kda` for training: the same chunked WY/UT form, its pairwise decays factored and every chunk's
    intra-chunk work batched.

    The reference builds e^{G_t - G_s} for every pair of a chunk and key channel (a [C, C, K] tensor a chunk) and
    loops over chunks; under autograd those tensors and their elementwise backward were most of a training step.
    Here A[t, s] = (k_t e^{G_t}) . (k_s e^{-G_s}) is one matmul, exact in real arithmetic and safe in fp32 while
    |G| <= 80 within a chunk (the gate is bounded below by `gate_lower_bound`, so chunks of WY_CHUNK tokens keep
    every factor a normal number). The unit lower-triangular solves give each chunk's WY factors W = M^-1 (beta
    K e^G) and U = M^-1 (beta V) at once; only the state is carried chunk to chunk (Delta_n = U_n - W_n S_n), and
    the outputs (Q e^G) S_n + B_n Delta_n are again one batched matmul. A ragged tail is padded with k = v = beta = 0,
    g = 0 (tokens that leave the state as it is) and cut from the output.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, length, heads, key_dim = k.shape
    pad = -length % WY_CHUNK
    q, k, v, g, beta = (F.pad(t.to(dtype), (0, 0) * (t.ndim - 2) + (0, pad)) for t in (q, k, v, g, beta))
    chunks = (length + pad) // WY_CHUNK

    def split(t):  # [B, T, H, ...] -> [B, H, N, C, ...]
        return t.transpose(1, 2).reshape(batch, heads, chunks, WY_CHUNK, *t.shape[3:])

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    cum = g.cumsum(dim=3)
    grow, shrink = cum.exp(), (-cum).exp()
    k_grow, k_shrink, q_grow = k * grow, k * shrink, q * scale * grow
    strict = torch.ones(WY_CHUNK, WY_CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    a = (k_grow @ k_shrink.transpose(-1, -2)).masked_fill(~strict, 0)
    b = (q_grow @ k_shrink.transpose(-1, -2)).masked_fill(~(strict | torch.eye(WY_CHUNK, dtype=torch.bool,
                                                                                device=q.device)), 0)
    system = torch.eye(WY_CHUNK, dtype=dtype, device=q.device) + beta.unsqueeze(-1) * a
    w = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * k_grow, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    last = cum[:, :, :, -1:]
    k_to_end = (k * (last - cum).exp()).transpose(-1, -2)  # [B, H, N, K, C]
    end_decay = last.transpose(-1, -2).exp()  # [B, H, N, K, 1]
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    states, deltas = [], []
    for n in range(chunks):
        delta = u[:, :, n] - w[:, :, n] @ state
        states.append(state)
        deltas.append(delta)
        state = end_decay[:, :, n] * state + k_to_end[:, :, n] @ delta
    out = q_grow @ torch.stack(states, dim=2) + b @ torch.stack(deltas, dim=2)  # [B, H, N, C, V]
    out = out.reshape(batch, heads, chunks * WY_CHUNK, -1)[:, :, :length].transpose(1, 2)
    return out, state


@contextlib.contextmanager
def wy_kda(model):
    """Run the model's torch KDA as `wy_chunk_kda` inside the block (fla's kernels off, as for "torch")."""
    bound = model.config.get_text_config().linear_attn_config.get("gate_lower_bound")
    if bound is None or WY_CHUNK * -bound > 80:
        raise ValueError(f"--kda wy needs gate_lower_bound >= {-80 / WY_CHUNK} (e^-G of a chunk in fp32's range), "
                         f"the config has {bound}")
    stock = kda.chunk_kda

    def chunk(q, k, v, g, beta, scale, initial_state=None, chunk_size=None, states_at=None):
        if states_at:
            raise ValueError("--kda wy returns no states at chosen positions (a rolling-back cache is for generate)")
        # its own chunk size: the caller's suits the reference
        return wy_chunk_kda(q, k, v, g, beta, scale, initial_state)

    kda.chunk_kda = chunk
    try:
        with use_fast_paths(model, kda="off", kda_prefill="off"):
            yield
    finally:
        kda.chunk_kda = stock


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def load_corpus(data: Path, device) -> dict:
    """The splits of `demo_build.prepare_corpus`; the train code also holds `demo_build.package_corpus`'s files where
    that ran, after the standard library's (`stdlib_tokens` of them: where `sample_batch`'s stdlib share draws)."""
    arrays = {name: np.load(data / f"{name}.npy") for name in ("train_code", "train_prose", "val_code", "val_prose")}
    stdlib = len(arrays["train_code"])
    packages = data / "train_code_packages.npy"
    if packages.is_file():
        arrays["train_code"] = np.concatenate([arrays["train_code"], np.load(packages)])
    corpus = {name: torch.from_numpy(a.astype(np.int64)).to(device) for name, a in arrays.items()}
    corpus["stdlib_tokens"] = stdlib
    return corpus


def sample_batch(corpus, batch: int, generator, seq_len=SEQ_LEN, stdlib_share=None) -> torch.Tensor:
    """`batch` random windows: round(CODE_SHARE * batch) from code, the rest from prose. The code windows start
    anywhere in the train code, or with `stdlib_share` that share of them (rounded) in the standard library's part
    (the domain of the held-out code) and the rest in the packages' part."""
    n_code = round(CODE_SHARE * batch)
    code, stdlib = corpus["train_code"], corpus["stdlib_tokens"]
    if stdlib_share is None:
        pools = [("train code", code, 0, code.numel(), n_code)]
    else:
        n_stdlib = round(stdlib_share * n_code)
        pools = [("the standard library's train code", code, 0, stdlib, n_stdlib),
                 ("the packages' train code (demo_build.package_corpus's output)", code, stdlib, code.numel(),
                  n_code - n_stdlib)]
    pools.append(("train prose", corpus["train_prose"], 0, corpus["train_prose"].numel(), batch - n_code))
    rows = []
    for name, data, low, high, n in pools:
        if n == 0:
            continue
        if high - low <= seq_len:
            raise SystemExit(f"{name}: no window of {seq_len} tokens ({high - low} tokens in --data)")
        starts = torch.randint(low, high - seq_len, (n,), generator=generator, device="cpu").to(data.device)
        rows.append(data[starts[:, None] + torch.arange(seq_len, device=data.device)])
    return torch.cat(rows)


def fixed_windows(data: torch.Tensor, count: int, seq_len=SEQ_LEN) -> torch.Tensor:
    """`count` non-overlapping windows spread evenly over `data` (deterministic)."""
    count = min(count, data.numel() // seq_len)
    step = (data.numel() - seq_len) // max(1, count - 1)
    starts = torch.arange(count, device=data.device) * step
    return data[starts[:, None] + torch.arange(seq_len, device=data.device)]


# ---------------------------------------------------------------------------------------------------------------
# Model, optimizer, balancing
# ---------------------------------------------------------------------------------------------------------------


def build(config, device, seed=0):
    """The model in bf16 (fp32 for FP32_PARAMS) and fp32 master copies of the trained parameters."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = KimiK3ForCausalLM(config)
    model.train()
    for name, param in model.named_parameters():
        if not name.endswith(FP32_PARAMS):
            param.data = param.data.to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if not n.endswith("e_score_correction_bias")]
    masters = [p.detach().float().clone() for _, p in named]
    decay = [m for (n, p), m in zip(named, masters) if p.ndim == 2 and "_res_proj" not in n]
    no_decay = [m for (n, p), m in zip(named, masters) if not (p.ndim == 2 and "_res_proj" not in n)]
    return model, named, masters, decay, no_decay


class Balancer:
    """Aux-loss-free balancing of the noaux_tc router: records each router's choices, nudges its bias."""

    def __init__(self, model, rate=1e-3):
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, KimiK3Router)]
        self.counts = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            if module.training:
                c = torch.bincount(output[0].reshape(-1), minlength=module.weight.shape[0])
                self.counts[i] = c if self.counts[i] is None else self.counts[i] + c

        return hook

    @torch.no_grad()
    def step(self):
        """Apply one bias update; returns max/mean expert load over the layers (1.0 = perfectly balanced)."""
        worst = 0.0
        for router, c in zip(self.routers, self.counts):
            if c is None:
                continue
            c = c.float()
            router.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
            worst = max(worst, float(c.max() / c.mean()))
        self.counts = [None] * len(self.routers)
        return worst


def lr_at(step, total, peak, warmup=40, decay=0.25):
    """Warmup-stable-decay: linear warmup over `warmup` steps, `peak` until the last `decay` share of `total`
    steps, then linear to 0. The state at the start of the decay is a complete run's state mid-flight: `train
    --resume` continues it at the peak rate (a later, longer decay), so a run can span two device calls."""
    start = decay_start(total, decay)
    if step < warmup:
        return peak * (step + 1) / warmup
    if step < start:
        return peak
    return peak * (total - step) / max(1, total - start)


def decay_start(total, decay=0.25):
    return total - int(decay * total)


def train_step(model, named, masters, optimizer, balancer, batch_ids, micro, lr):
    """One optimizer step over `batch_ids` in micro-batches: bf16 gradients into the fp32 masters (one foreach
    copy; a parameter with no gradient gets zeros), clip to norm 1, fused AdamW, masters back into the bf16
    parameters, then the router biases' balancing update."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = 0.0
    chunks = batch_ids.split(micro)
    for chunk in chunks:
        loss = model(chunk, labels=chunk).loss / len(chunks)
        loss.backward()
        total += float(loss.detach())
    with torch.no_grad():
        params = [p for _, p in named]
        for p, m in zip(params, masters):
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
        for p in params:
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        torch._foreach_copy_(params, masters)
    load = balancer.step()
    return total, float(norm), load


@torch.no_grad()
def eval_loss(model, windows, micro=16):
    model.eval()
    losses = [float(model(w, labels=w).loss) for w in windows.split(micro)]
    model.train()
    return sum(losses) / len(losses)


def save_parts(model, out: Path):
    """The state dict as weights-NN.safetensors files of at most PART_BYTES each (tensors in name order), each routed
    expert weight as its MXFP4 `weight_packed` + `weight_scale` (the release's format, a quarter of bf16's bytes:
    what makes a run's weights small enough to bring back from the GPU machine); `package` unpacks them."""
    from safetensors.torch import save_file

    for old in out.glob("weights-*.safetensors"):
        old.unlink()
    state = {}
    for name, tensor in model.state_dict().items():
        if EXPERT_WEIGHT.search(name):
            packed, scale = mxfp4.quantize_mxfp4(tensor.detach())
            stem = name[: -len("weight")]
            state[stem + "weight_packed"], state[stem + "weight_scale"] = packed.cpu(), scale.cpu()
        else:
            state[name] = tensor.detach().contiguous().cpu()
    parts, current, size = [], {}, 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > PART_BYTES:
            parts.append(current)
            current, size = {}, 0
        current[name] = state[name]
        size += nbytes
    parts.append(current)
    for i, part in enumerate(parts):
        save_file(part, str(out / f"weights-{i:02d}.safetensors"))
    return len(parts)


# ---------------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------------


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def _num_ranks(data: Path) -> int:
    from tokenization_kimi_k3 import load_rank_file

    return len(load_rank_file(data / "tiktoken.model"))


def cmd_bench(args):
    """Tokens/s and peak memory of a full training step (fwd + bwd + AdamW) per batch size and MoE variant."""
    device = args.device
    data = Path(args.data)
    corpus = load_corpus(data, device)
    config = demo_config(_num_ranks(data), args.shape)
    results = []
    for kind in args.moe.split(","):
        use_moe(kind)
        model, named, masters, decay, no_decay = build(config, device)
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0}],
                                      lr=1e-3, betas=(0.9, 0.95), fused=device == "cuda")
        balancer = Balancer(model)
        gen = torch.Generator().manual_seed(0)
        with kda_paths(model, args.kda):
            for batch in map(int, args.batches.split(",")):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    times = []
                    for i in range(args.steps):
                        ids = sample_batch(corpus, batch, gen)
                        _sync(device)
                        t0 = time.perf_counter()
                        loss, _, _ = train_step(model, named, masters, optimizer, balancer, ids, batch, 1e-3)
                        _sync(device)
                        times.append(time.perf_counter() - t0)
                    step = sorted(times[1:])[len(times[1:]) // 2]
                    row = dict(moe=kind, kda=args.kda, batch=batch, step_s=round(step, 4), tok_s=round(batch * SEQ_LEN / step),
                               peak_gib=round(_peak_gib(device), 1), loss=round(loss, 3))
                except torch.OutOfMemoryError:
                    row = dict(moe=kind, batch=batch, oom=True)
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                results.append(row)
                if args.profile and "tok_s" in row:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        train_step(model, named, masters, optimizer, balancer, sample_batch(corpus, batch, gen),
                                   batch, 1e-3)
                        _sync(device)
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
        del model, masters, optimizer
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench.json").write_text(json.dumps(results, indent=1))
    return 0


def cmd_kda_bench(args):
    """Forward + backward of the KDA core alone at the demo's training shape (fp32, as the model runs it): the torch
    reference at chunks of 16 and 64 (what it takes on a CPU and on CUDA) against `wy_chunk_kda`, the same inputs in
    one process; the median of `--steps` after a warmup, and each one's ratio to the reference at 64."""
    device, (batch, heads, dim) = args.device, (args.batch, 4, 64)
    gen = torch.Generator().manual_seed(0)
    q, k = (kda.l2norm(torch.randn(batch, SEQ_LEN, heads, dim, generator=gen)) for _ in range(2))
    v = torch.randn(batch, SEQ_LEN, heads, dim, generator=gen)
    g = -5.0 * torch.sigmoid(3 * torch.randn(batch, SEQ_LEN, heads, dim, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, SEQ_LEN, heads, generator=gen))
    inputs = [t.to(device).requires_grad_() for t in (q, k, v, g, beta)]
    variants = {"reference_chunk16": lambda *x: kda.chunk_kda(*x, scale=dim**-0.5, chunk_size=16),
                "reference_chunk64": lambda *x: kda.chunk_kda(*x, scale=dim**-0.5, chunk_size=64),
                "wy": lambda *x: wy_chunk_kda(*x, scale=dim**-0.5)}
    row = dict(device=torch.cuda.get_device_name() if device == "cuda" else device, batch=batch, seq=SEQ_LEN,
               heads=heads, head_dim=dim)
    for name, fn in variants.items():
        times = []
        for _ in range(args.steps + 1):
            _sync(device)
            t0 = time.perf_counter()
            out, _ = fn(*inputs)
            out.sum().backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
        row[f"{name}_ms"] = round(1e3 * sorted(times[1:])[len(times[1:]) // 2], 2)
    for name in variants:
        row[f"{name}_vs_chunk64"] = round(row[f"{name}_ms"] / row["reference_chunk64_ms"], 3)
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


def kda_paths(model, kind):
    """The KDA that autograd runs through: "torch" (the reference, nothing to compile), "wy" (`wy_chunk_kda`, the
    reference's math without its pairwise-decay tensors) or "fla" (fla's chunked kernel, which compiles and
    autotunes its forward and backward on the first step: 241 s on the H200,
    demo_build/results/train_demo_112/train.log, more than its speed gives back in a 10-minute run)."""
    if kind == "wy":
        return wy_kda(model)
    return use_fast_paths(model, kda="off", kda_prefill="off") if kind == "torch" else contextlib.nullcontext()


def unpack_experts(state: dict) -> dict:
    """Each `weight_packed` + `weight_scale` pair of `state` replaced, in place, by its dequantized `weight`."""
    for name in [n for n in state if n.endswith(".weight_packed")]:
        stem = name[: -len("weight_packed")]
        state[stem + "weight"] = mxfp4.dequantize_mxfp4(state.pop(name), state.pop(stem + "weight_scale"))
    return state


def load_init(model, masters, named, path: Path):
    """`train --init`: start from a packaged demo checkpoint (its MXFP4 experts unpacked) instead of a random
    init; every tensor of the model must be there and nothing else. The fp32 masters start from the loaded values."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--init {path}: no *.safetensors there")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    try:
        model.load_state_dict(unpack_experts(state), strict=True)  # names missing, stray and mis-shaped tensors
    except RuntimeError as error:
        raise SystemExit(f"--init {path}: {error}") from None
    with torch.no_grad():
        for (_, param), master in zip(named, masters):
            master.copy_(param.float())


def save_state(path: Path, model, masters, optimizer, gen, log, step, tokens, micro):
    """Everything `train --resume` needs to continue this run (written to a temporary name, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(dict(model=model.state_dict(), masters=masters, optimizer=optimizer.state_dict(),
                    generator=gen.get_state(), log=log, step=step, tokens=tokens, micro=micro), tmp)
    os.replace(tmp, path)


def cmd_train(args):
    started = time.time()
    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = True
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    use_moe(args.moe)
    corpus = load_corpus(data, device)
    config = demo_config(_num_ranks(data), args.shape)
    model, named, masters, decay, no_decay = build(config, device, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"params {n_params / 1e6:.2f}M ({n_experts / 1e6:.2f}M routed experts); moe={args.moe}; kda={args.kda}; "
          f"batch={args.batch} x {SEQ_LEN}; budget {args.seconds}s", flush=True)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    balancer = Balancer(model, rate=args.bias_rate)
    gen = torch.Generator().manual_seed(args.seed)
    val = {name: fixed_windows(corpus[name], args.val_windows) for name in ("val_code", "val_prose")}
    config.save_pretrained(out)  # config.json, bf16 experts (no quantization_config)
    options = {k: v for k, v in vars(args).items() if k != "func"}
    log = dict(args=options, params=n_params, routed_expert_params=n_experts, seq_len=SEQ_LEN, steps=[], val=[])
    step, tokens, micro = 0, 0, args.micro or args.batch
    if args.init:
        if args.resume:
            raise SystemExit("--init starts a run, --resume continues one: give one of them")
        load_init(model, masters, named, Path(args.init))
        log["init_val"] = {name: round(eval_loss(model, w), 4) for name, w in val.items()}
        print(f"initialised from {args.init}: val {log['init_val']}", flush=True)
    if args.resume:
        state = torch.load(args.resume, map_location=device, weights_only=False)
        if state["log"]["args"].get("shape") != args.shape:
            raise SystemExit(f"--resume {args.resume}: the state was trained with --shape "
                             f"{state['log']['args'].get('shape')!r}, this call asks for {args.shape!r}")
        model.load_state_dict(state["model"])
        for m, saved in zip(masters, state["masters"]):
            m.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"].cpu())
        step, tokens, micro, log = state["step"], state["tokens"], state["micro"], state["log"]
        log.setdefault("resumed", []).append(dict(step=step, args=options))
        print(f"resumed {args.resume} at step {step} ({tokens} tokens)", flush=True)

    def write_log(**extra):
        log.update(extra)
        (out / "train_log.json").write_text(json.dumps(log, indent=1))

    total_steps = args.max_steps or 10**9
    first, t_train, last_save, calib_from = step, time.time(), time.time(), None
    seconds_before = log.get("train_seconds_at_state", 0.0)  # a resumed run's training time before its state
    with kda_paths(model, args.kda):
        while step < total_steps:
            lr = lr_at(step, total_steps if total_steps < 10**9 else 10**6, args.lr)
            if args.state and total_steps < 10**9 and step == decay_start(total_steps):
                log["train_seconds_at_state"] = seconds_before + time.time() - t_train
                save_state(Path(args.state), model, masters, optimizer, gen, log, step, tokens, micro)
                print(f"state at the decay's start (step {step}) -> {args.state}", flush=True)
            ids = sample_batch(corpus, args.batch, gen, stdlib_share=args.stdlib_share)
            try:
                loss, norm, load = train_step(model, named, masters, optimizer, balancer, ids, micro, lr)
            except torch.OutOfMemoryError:  # a micro-batch too big for the memory left: accumulate instead
                model.zero_grad(set_to_none=True)
                balancer.counts = [None] * len(balancer.routers)
                torch.cuda.empty_cache()
                if micro == 1:
                    raise
                micro = max(1, micro // 2)
                print(f"out of memory at step {step + 1}: micro-batch {micro} from now on", flush=True)
                log.setdefault("oom_at_steps", []).append(step + 1)
                continue
            step += 1
            tokens += ids.numel()
            elapsed = time.time() - t_train
            if step == first + 5:
                _sync(device)
                calib_from = (step, time.time())
            if step == first + 25 and not args.max_steps:
                _sync(device)
                per_step = (time.time() - calib_from[1]) / (step - calib_from[0])
                left = args.seconds - (time.time() - started)
                total_steps = step + max(1, int(left / per_step * 0.97))
                print(f"step time {per_step:.3f}s -> {total_steps} steps in total, decay from step "
                      f"{decay_start(total_steps)}", flush=True)
                log["step_time_s"] = per_step
                log["total_steps"] = total_steps
            log["steps"].append(dict(step=step, loss=round(loss, 4), lr=lr, grad_norm=round(norm, 3),
                                     max_load=round(load, 2), t=round(elapsed, 1)))
            if step % args.log_every == 0 or step == first + 1:
                print(f"step {step} loss {loss:.4f} lr {lr:.2e} gnorm {norm:.2f} max/mean load {load:.2f} "
                      f"{(step - first) * ids.numel() / elapsed:.0f} tok/s {elapsed:.0f}s mem {_peak_gib(device):.1f}G",
                      flush=True)
            if step % args.eval_every == 0:
                v = {name: eval_loss(model, w) for name, w in val.items()}
                log["val"].append(dict(step=step, **{k: round(x, 4) for k, x in v.items()}))
                print(f"  val {v}", flush=True)
            if time.time() - last_save > args.save_every:
                save_parts(model, out)
                write_log(tokens=tokens, train_seconds=time.time() - t_train, finished=False)
                last_save = time.time()
            if time.time() - started > args.seconds + 30:  # hard stop if the estimate was off
                break
        _sync(device)
        train_seconds = time.time() - t_train
        v = {name: eval_loss(model, w) for name, w in val.items()}
    log["val"].append(dict(step=step, **{k: round(x, 4) for k, x in v.items()}))
    recent = [s["loss"] for s in log["steps"][-20:]]
    parts = save_parts(model, out)
    write_log(tokens=tokens, train_seconds=seconds_before + train_seconds,
              tokens_per_second=(step - first) * args.batch * SEQ_LEN / train_seconds, final_steps=step,
              final_train_loss=sum(recent) / len(recent), final_val=v, finished=True, parts=parts,
              peak_gib=_peak_gib(device), device=torch.cuda.get_device_name() if device == "cuda" else device,
              torch=torch.__version__, wall_seconds=time.time() - started)
    print(f"done: {step} steps, {tokens} tokens, this call {train_seconds:.0f}s ({log['tokens_per_second']:.0f} tok/s);"
          f" train loss (last 20) {sum(recent) / len(recent):.4f}; val {v}; {parts} weight parts", flush=True)
    return 0


def cmd_package(args):
    """OUT of `train` -> the release-layout MXFP4 demo directory `--dst`."""
    from safetensors.torch import load_file

    from tokenization_kimi_k3 import write_tokenizer_files

    src, data, dst = Path(args.src), Path(args.data), Path(args.dst)
    if dst.exists():
        raise SystemExit(f"{dst} exists; remove it first")
    config = KimiK3Config.from_pretrained(src)
    if config.experts_packed or config.text_config.vocab_size != _num_ranks(data) + NUM_SPECIALS:
        raise SystemExit(f"{src}/config.json: expected bf16 experts and the vocabulary of {data}/tiktoken.model")
    state = {}
    for part in sorted(src.glob("weights-*.safetensors")):
        state.update(load_file(str(part)))
    unpack_experts(state)
    model = KimiK3ForCausalLM(config)
    for name, param in model.named_parameters():
        if not name.endswith(FP32_PARAMS):
            param.data = param.data.to(torch.bfloat16)
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and expected[name].dtype != tensor.dtype:
            raise SystemExit(f"{name}: trained as {tensor.dtype}, model keeps {expected[name].dtype}")
    model.load_state_dict(state, strict=True)
    model.config.auto_map = dict(AUTO_MAP)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=dst.parent))
    try:
        bf16 = tmp / "bf16"
        model.save_pretrained(bf16)
        generation = json.loads((bf16 / "generation_config.json").read_text())
        generation.update(DEMO_DECODING, _from_model_config=False)
        (bf16 / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_tokenizer_files(bf16, data / "tiktoken.model")
        copy_remote_code(bf16)
        shutil.copyfile(ROOT / "chat_template.jinja", bf16 / "chat_template.jinja")
        log = src / "train_log.json"
        if log.is_file():
            shutil.copyfile(log, bf16 / "train_log.json")
        subprocess.run([sys.executable, "-m", "reap_tools", "quantize", str(bf16), str(tmp / "mxfp4")], cwd=ROOT,
                       check=True)
        release_config(tmp / "mxfp4" / "config.json", config.text_config.hidden_size)
        if args.keep_bf16:
            keep = Path(args.keep_bf16)
            if keep.exists():
                shutil.rmtree(keep)
            shutil.copytree(bf16, keep)
        os.chmod(tmp / "mxfp4", 0o755)
        os.rename(tmp / "mxfp4", dst)
        sync_remote_code(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in dst.iterdir())
    print(f"wrote {dst} ({size / 1e6:.1f} MB)")
    return 0


def release_config(path: Path, hidden_size: int):
    """Rewrite config.json in the parent's layout (`reap_tools.release_layout.to_release_layout`: the
    compressed-tensors block inside text_config, a small vision_config, the media placeholder), without a
    `fast_paths` that only repeats the defaults."""
    from configuration_kimi_k3 import check_fast_paths
    from reap_tools.release_layout import tiny_vision_config, to_release_layout

    config = to_release_layout(json.loads(path.read_text()), tiny_vision_config(hidden_size))
    if config.get("fast_paths") == check_fast_paths({}):
        del config["fast_paths"]
    path.write_text(json.dumps(config, indent=2) + "\n")


def cmd_sync_code(args):
    """Refresh a demo directory after the root's tokenizer changed: tokenizer_config.json (chat template, specials)
    is rewritten for its own tiktoken.model, and chat_template.jinja and the remote-code files are copied from the
    root (tests/test_demo.py fails while a copy differs)."""
    from tokenization_kimi_k3 import write_tokenizer_files

    dst = Path(args.dst)
    write_tokenizer_files(dst, dst / "tiktoken.model")
    shutil.copyfile(ROOT / "chat_template.jinja", dst / "chat_template.jinja")
    names = sync_remote_code(dst)
    print(f"rewrote tokenizer_config.json, copied chat_template.jinja and {', '.join(names)} into {dst}")
    return 0


def share(text: str) -> float:
    """argparse type: a fraction in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1")
    return value


SHAPE_HELP = 'JSON overriding DEMO_SHAPE, e.g. \'{"hidden_size": 384}\' (train: the same on --resume)'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench")
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--batches", default="8,16,32")
    p.add_argument("--moe", default="grouped")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kda", choices=("torch", "wy", "fla"), default="torch")
    p.add_argument("--profile", action="store_true", help="print the top CUDA ops of one step per batch size")
    p.add_argument("--shape", default=None, help=SHAPE_HELP)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("kda-bench")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the row here as JSON")
    p.set_defaults(func=cmd_kda_bench)
    p = sub.add_parser("train")
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=480, help="wall-clock budget from start to the last step")
    p.add_argument("--max-steps", type=int, default=0, help="fixed step count instead of the time budget")
    p.add_argument("--batch", type=int, default=32, help="sequences of 512 tokens per optimizer step")
    p.add_argument("--micro", type=int, default=0, help="micro-batch (gradient accumulation); default = batch")
    p.add_argument("--moe", choices=("stock", "grouped"), default="grouped")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=float, default=150)
    p.add_argument("--kda", choices=("torch", "wy", "fla"), default="torch", help="KDA under autograd: the "
                   "torch reference, its batched form wy_chunk_kda, or fla's chunked kernel")
    p.add_argument("--shape", default=None, help=SHAPE_HELP)
    p.add_argument("--state", default=None, help="write the resumable state here at the decay's start")
    p.add_argument("--resume", default=None, help="continue from a --state file")
    p.add_argument("--init", default=None, help="start from this packaged demo checkpoint (e.g. demo/parent)")
    p.add_argument("--stdlib-share", type=share, default=None,
                   help="share of the code windows drawn from the standard library (the held-out code's domain; "
                   "default: from all train code alike, ~12 %% with the package corpus). A call that resumes may "
                   "give another share, e.g. a larger one for the decay")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("package")
    p.add_argument("src", help="the OUT folder of `train`")
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--dst", default=str(ROOT / "demo" / "parent"))
    p.add_argument("--keep-bf16", default=None, help="also keep the bf16 checkpoint here")
    p.set_defaults(func=cmd_package)
    p = sub.add_parser("sync-code")
    p.add_argument("dst", nargs="?", default=str(ROOT / "demo" / "parent"))
    p.set_defaults(func=cmd_sync_code)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
