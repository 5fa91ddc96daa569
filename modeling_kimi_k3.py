"""Kimi K3 text model (remote code): hybrid KDA / gated NoPE MLA decoder with Block Attention Residuals and LatentMoE.

Reads top to bottom as the architecture does: the fast-path dispatch, activations and norms, Block Attention
Residuals, KDA, MLA, LatentMoE with MXFP4 routed experts, the decoder layer, the cache, the runners around the layers
(side streams, CUDA-graph decode), the model and the causal-LM head. Module names follow the release checkpoint
(`language_model.model.layers.{i}...`) so it loads unchanged. Every block's torch code is its reference, which runs
anywhere and is what the tests compare against. The optional fast paths (`config.fast_paths`: fla-core's KDA kernels
in `kda.py`, the MXFP4 expert kernels in `mxfp4_triton.py`, the fused small-op kernels in `fused_triton.py`, side
streams, CUDA graphs) are resolved once per device by `resolve_fast_paths`; a block calls a kernel in place of one
of its reference functions where its resolved `FastPaths` say so, and runs as its side-stream variant (in the runners'
section) where `side_streams` is on."""

import contextlib
import dataclasses
import functools
import json
import os
import re

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

try:
    from .configuration_kimi_k3 import KimiK3Config, check_fast_paths
    from .fused_triton import attn_res_mix as fused_attn_res_mix, supported as fused_supported
    from .fused_triton import pair_sum_norm as fused_pair_sum_norm, router_topk as fused_router_topk
    from .fused_triton import latent_attention as fused_latent_attention, short_conv as fused_short_conv
    from .fused_triton import gated_rms_norm as fused_gated_rms_norm, mla_keys as fused_mla_keys
    from .fused_triton import sigmoid_gated_heads as fused_sigmoid_gated_heads
    from .kda import kda_forward, supported as fla_supported
    from .mxfp4 import dequantize_mxfp4, dequantize_unchecked, quantize_mxfp4
    from .mxfp4_triton import routed_experts as triton_routed_experts, stack_experts as stack_expert_packs
    from .mxfp4_triton import situ_glu as fused_situ_glu, supported as experts_kernel_supported
    from .tensor_parallel import load_tensor_parallel
except ImportError:  # imported from the repository root rather than as transformers remote code
    from configuration_kimi_k3 import KimiK3Config, check_fast_paths
    from fused_triton import attn_res_mix as fused_attn_res_mix, supported as fused_supported
    from fused_triton import pair_sum_norm as fused_pair_sum_norm, router_topk as fused_router_topk
    from fused_triton import latent_attention as fused_latent_attention, short_conv as fused_short_conv
    from fused_triton import gated_rms_norm as fused_gated_rms_norm, mla_keys as fused_mla_keys
    from fused_triton import sigmoid_gated_heads as fused_sigmoid_gated_heads
    from kda import kda_forward, supported as fla_supported
    from mxfp4 import dequantize_mxfp4, dequantize_unchecked, quantize_mxfp4
    from mxfp4_triton import routed_experts as triton_routed_experts, stack_experts as stack_expert_packs
    from mxfp4_triton import situ_glu as fused_situ_glu, supported as experts_kernel_supported
    from tensor_parallel import load_tensor_parallel

# Under transformers' own logger, so that its verbosity settings (`transformers.logging.set_verbosity_info()`) reach
# this remote code too, whose module lives outside the library (`transformers_modules.<repo>...`).
logger = logging.get_logger("transformers.kimi_k3")

# ----------------------------------------------------------------------------------------------------------------
# Fast paths
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FastPaths:
    """Which optional implementation the blocks on one device take (True) instead of their reference (False); the
    paths are `configuration_kimi_k3.FAST_PATH_DEFAULTS`'. The default, all False, is the pure-torch reference."""

    experts: bool = False
    kda: bool = False
    kda_prefill: bool = False
    fused: bool = False
    side_streams: bool = False
    cuda_graphs: bool = False

    def __str__(self):
        return ", ".join(f"{f.name}={'on' if getattr(self, f.name) else 'off'}" for f in dataclasses.fields(self))

    def with_backward(self):
        """The paths that autograd can differentiate: fla's chunked KDA kernel (where either KDA path is on) and
        the references. The Triton experts and fused small ops, fla's recurrent kernel, side streams and graphs
        have no backward; taken while autograd records, they would silently cut the gradient to everything
        before them."""
        return FastPaths(kda_prefill=self.kda or self.kda_prefill)


def _fast_path_unsupported(path, device):
    """Why `path` cannot run for tensors on `device`, or None where it can."""
    if path == "experts":
        return None if experts_kernel_supported(device) else "needs triton and a CUDA device"
    if path == "fused":
        return None if fused_supported(device) else "needs triton and a CUDA device (or Triton's CPU interpreter)"
    if path in ("kda", "kda_prefill"):
        return None if fla_supported(device) else "needs fla-core and a CUDA device"
    return None if device.type == "cuda" else "needs a CUDA device"


def resolve_fast_paths(requested, device):
    """The `FastPaths` for tensors on `device`: "auto" takes a path where it can run, "on" requires it (an error
    naming the path and why not), "off" takes the reference. `KIMI_K3_FAST_PATHS` ("kda=off,fused=on") overrides
    the config, for benchmarks; this is the one place it is read."""
    choices = dict(requested or {})
    for item in filter(None, os.environ.get("KIMI_K3_FAST_PATHS", "").split(",")):
        path, _, choice = item.partition("=")
        choices[path.strip()] = choice.strip()
    choices = check_fast_paths(choices)
    device = torch.device(device)
    chosen = {}
    for path, choice in choices.items():
        why = _fast_path_unsupported(path, device) if choice != "off" else None
        if choice == "on" and why:
            raise ValueError(f"fast_paths[{path!r}] is 'on', but it {why} (tensors on {device})")
        chosen[path] = choice != "off" and why is None
    return FastPaths(**chosen)


class FastPathDispatch:
    """The fast paths of one model's blocks: `at(device)` resolves them once per device, and again after the
    request changes (the config's `fast_paths`, read once per model call by `refresh`, and `use_fast_paths`'
    overrides); each resolution is logged in one line. Blocks built on their own get one of their own (defaults)."""

    def __init__(self, config=None):
        self.config = config
        self.overrides = {}
        self._requested = None
        self._resolved = {}

    def set(self, **choices):
        """Override some paths ("auto" / "on" / "off", or True / False) from now on."""
        self.overrides.update(choices)
        self.refresh()

    def refresh(self):
        requested = {**(getattr(self.config, "fast_paths", None) or {}), **self.overrides}
        if requested != self._requested:
            self._requested, self._resolved = requested, {}

    def resolved(self, device):
        """The paths chosen for tensors on `device` (what the decode runner plans its graphs with)."""
        fast = self._resolved.get(device)
        if fast is None:
            if self._requested is None:
                self.refresh()
            fast = self._resolved[device] = resolve_fast_paths(self._requested, device)
            logger.info(f"Kimi K3 fast paths on {device}: {fast}")
        return fast

    def at(self, device):
        """The paths a block takes for tensors on `device`: the resolved ones, or while autograd records
        (training) only those of them with a backward."""
        fast = self.resolved(device)
        return fast.with_backward() if torch.is_grad_enabled() else fast


@contextlib.contextmanager
def use_fast_paths(module, **choices):
    """Run `module` (a model or a block) with some fast paths switched ("auto" / "on" / "off", or True / False),
    then restore the previous choices: how tests and benchmarks compare a path with the reference."""
    dispatches = {id(d): d for m in module.modules() if isinstance(d := getattr(m, "dispatch", None),
                                                                   FastPathDispatch)}
    saved = [(d, dict(d.overrides)) for d in dispatches.values()]
    try:
        for d, _ in saved:
            d.set(**choices)
        yield
    finally:
        for d, overrides in saved:
            d.overrides = overrides
            d.refresh()


def on_input_device(kernel):
    """`kernel` (a fast-path entry point) run under the CUDA device of its first tensor argument.

    Triton and fla kernels launch on the *current* CUDA device, not their tensors' one; with a model spread over
    GPUs by `device_map`, accelerate's hooks move a layer's inputs to its GPU but leave the current device at cuda:0,
    so an unguarded launch would read another GPU's memory. This is the one guard: every entry point below is
    wrapped once, here, where the model imports it."""

    @functools.wraps(kernel)
    def launch(*args, **kwargs):
        device = next((t.device for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
                       if isinstance(t, torch.Tensor)), None)
        if device is None or device.type != "cuda":
            return kernel(*args, **kwargs)
        with torch.cuda.device(device):
            return kernel(*args, **kwargs)

    return launch


(fused_attn_res_mix, fused_gated_rms_norm, fused_latent_attention, fused_mla_keys, fused_short_conv,
 fused_sigmoid_gated_heads, fused_pair_sum_norm, fused_router_topk, fused_situ_glu, kda_forward,
 triton_routed_experts) = map(on_input_device, (
    fused_attn_res_mix, fused_gated_rms_norm, fused_latent_attention, fused_mla_keys, fused_short_conv,
    fused_sigmoid_gated_heads, fused_pair_sum_norm, fused_router_topk, fused_situ_glu, kda_forward,
    triton_routed_experts))


# ----------------------------------------------------------------------------------------------------------------
# Activations and norms
# ----------------------------------------------------------------------------------------------------------------


def situ_glu(gate, up, beta, linear_beta):
    """SiTU-GLU in fp32: `beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta)`."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return act.to(gate.dtype)


class KimiK3RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back to the input dtype (on CUDA one fused kernel, which does the same).

    fp32 on CPU goes through `F.rms_norm` too: there it is a composite of the very ops below (the same bits, tested)
    with less Python per call; a bf16 input would be rounded before the weight multiply there, so it stays below.
    """

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        cpu_fp32 = hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
        if (hidden_states.is_cuda or cpu_fp32) and hidden_states.dtype == self.weight.dtype:
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
        x = hidden_states.float()
        x = x * x.pow(2).mean(-1, keepdim=True).add_(self.variance_epsilon).rsqrt_()  # in place on fresh tensors only
        return x.mul_(self.weight.float()).to(hidden_states.dtype)


class KimiK3MLP(nn.Module):
    """SiTU-GLU MLP: the dense layer-0 MLP and the shared experts."""

    def __init__(self, config, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x, fused=False):
        """With `fused` (the `fused` fast path) the GLU is one kernel (`mxfp4_triton.situ_glu`, the same fp32 math)
        instead of a dozen elementwise ops."""
        glu = fused_situ_glu if fused else situ_glu
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


# ----------------------------------------------------------------------------------------------------------------
# Block Attention Residuals
# ----------------------------------------------------------------------------------------------------------------


class BlockBank(tuple):
    """The block snapshots of Block Attention Residuals (row 0 the embeddings), a tuple that also keeps the stack of
    its entries once made: the fused depth mixes of a block's layers (two a layer) then read one stack instead of
    copying the bank at every mix."""

    def stacked(self):
        if getattr(self, "_stacked", None) is None:
            self._stacked = torch.stack(self)
        return self._stacked


def attn_res_mix(bank, partial, norm, proj, out_norm, fused=False):
    """Softmax-weighted mix over depth of the sources `bank` (block snapshots) + `partial` (the current block's
    partial sum), `sum_j softmax_j(proj(norm(v_j))) v_j` in fp32, then `out_norm` of it (the RMSNorm of the sublayer
    that reads the mix).

    `proj(norm(v))` is `(v / rms(v)) . (norm.weight * proj.weight)`, the pseudo-query score of Block Attention
    Residuals. With `fused` (the `fused` fast path) one kernel (`fused_triton.attn_res_mix`) does both over the
    stacked bank and the partial sum, without calling the norm modules.
    """
    if not bank:
        return out_norm(partial)
    # accelerate's offload hooks load a module's weights only for its own forward, which the kernel bypasses
    if fused and all(m.weight.device == partial.device for m in (norm, proj, out_norm)):
        stacked = bank.stacked() if isinstance(bank, BlockBank) else torch.stack(tuple(bank))
        mixed = fused_attn_res_mix(stacked, partial, norm.weight, proj.weight[0], norm.variance_epsilon,
                                   out_norm.weight, out_norm.variance_epsilon)
        if mixed is not None:  # None: rows too wide for the kernel
            return mixed
    stacked = torch.stack(list(bank) + [partial]).float()  # [n, B, T, H]
    weights = proj(norm(stacked)).softmax(dim=0).unsqueeze(-1)  # [n, B, T, 1]
    return out_norm((weights * stacked).sum(0).to(partial.dtype))


class KimiK3AttnResProj(nn.Module):
    """Pseudo-query of one attention-residual mix (weight [1, H]): an fp32 score per source."""

    def __init__(self, hidden_size):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))

    def forward(self, x):
        return x.float() @ self.weight[0].float()


# ----------------------------------------------------------------------------------------------------------------
# KDA (Kimi Delta Attention)
# ----------------------------------------------------------------------------------------------------------------


def _padded(n, multiple):
    return -(-n // multiple) * multiple


def short_conv(x, weight, state=None):
    """Causal depthwise convolution + SiLU. x: [B, T, D]; weight: [D, 1, kernel]; state: [B, D, kernel-1] (the
    inputs before x) or None (zeros). Returns (y [B, T, D], new state).

    Summed tap by tap, in fp32 with one fused multiply-add per tap, rounded to x's dtype once: the same bits as
    `F.conv1d` on CPU (oneDNN accumulates so), at a fraction of its per-call cost, which dominates at decode.
    Each channel is computed on its own, so convolutions over concatenated channels give each one's bits.
    """
    x = x.transpose(1, 2)
    kernel = weight.shape[-1]
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], kernel - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)
    taps, weight = full.float(), weight[:, 0].to(x.dtype).float()
    length = x.shape[-1]
    y = taps[..., :length] * weight[:, :1]
    for j in range(1, kernel):
        y.addcmul_(taps[..., j : j + length], weight[:, j : j + 1])
    return F.silu(y.to(x.dtype)).transpose(1, 2), full[..., full.shape[-1] - state.shape[-1] :]


class KimiK3ShortConv(nn.Conv1d):
    """Causal depthwise convolution + SiLU (`short_conv`); with a cache it carries the last `kernel - 1` inputs."""

    def __init__(self, channels, kernel_size):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x, state=None):
        """x: [B, T, D]; state: [B, D, kernel-1] or None (zeros). Returns (y [B, T, D], new state)."""
        return short_conv(x, self.weight, state)


class KimiK3DeltaAttention(nn.Module):
    """KDA layer: short convs on q/k/v, lower-bounded per-channel decay, delta rule, gated per-head RMSNorm output."""

    def __init__(self, config, layer_idx, dispatch=None):
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.dispatch = dispatch or FastPathDispatch()
        self.num_heads, self.head_dim = lac["num_heads"], lac["head_dim"]
        self.lower_bound = lac["gate_lower_bound"]
        width = self.num_heads * self.head_dim
        kernel = lac["short_conv_kernel_size"]
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.q_conv1d = KimiK3ShortConv(width, kernel)
        self.k_conv1d = KimiK3ShortConv(width, kernel)
        self.v_conv1d = KimiK3ShortConv(width, kernel)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        # The release stores A_log zero-padded to a multiple of 128 (96 heads -> [128]); only the first heads count.
        self.A_log = nn.Parameter(torch.zeros(_padded(self.num_heads, 128), dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden, width, bias=False)
        self.o_norm = KimiK3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x, attention_mask=None, cache=None):
        """x: [B, T, H]; attention_mask: [B, T] for these tokens (0 = padding), or None."""
        if attention_mask is not None:
            x = x.masked_fill(~attention_mask.bool()[..., None], 0.0)  # padding leaves state and conv history at 0
        fast = self.dispatch.at(x.device)
        if fast.side_streams:
            return kda_side_by_side(self, x, cache, fast)
        own = self.cache_layer(cache)
        gates = self.gate_inputs(x)
        return self.delta_rule(x, self.qkv(x, own, fast), gates, own, fast)

    def cache_layer(self, cache):
        """This layer's share of `cache`; without one a scratch layer (zero state, dropped after the call)."""
        return cache.layers[self.layer_idx] if cache is not None else KimiK3DeltaCacheLayer()

    def gate_inputs(self, x):
        """What the delta rule's gates are made of: the decay's low-rank input [B, T, heads, dim], beta's input
        [B, T, heads] and the output gate's logits [B, T, heads, dim] (its sigmoid is taken in `gated_norm`)."""
        heads = (*x.shape[:2], self.num_heads, self.head_dim)
        return self.f_b_proj(self.f_a_proj(x)).view(heads), self.b_proj(x), self.g_proj(x).view(heads)

    def qkv(self, x, own, fast):
        """q, k, v projected and through their short convs (histories from the cache layer `own`); returns
        ((q, k, v), the new conv histories). Where fla's chunked kernel takes them (in fp32, see kda.py), the fused
        convs store them in fp32 (the same values), which spares a cast of each."""
        projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        fp32 = torch.float32 if fast.kda_prefill and x.shape[1] > 1 else None
        return self.short_convs(projected, own.conv_states, own.in_place, fast.fused, fp32)

    def delta_rule(self, x, qkv, gates, own, fast):
        """The gated delta rule over the convolved q, k, v from `own`'s recurrent state (both states written back
        to `own`), then the gated per-head RMSNorm and the output projection."""
        (q, k, v), conv_states = qkv
        g_raw, beta_raw, gate_logits = gates
        batch, length, _ = x.shape
        heads = (batch, length, self.num_heads, self.head_dim)
        # fla-core's chunked kernel for prompts where kda_prefill is on (and for training: it has a backward), else
        # its recurrent kernel where kda is on (decode steps and prompts alike), else the pure-torch reference
        kernel = "chunk" if fast.kda_prefill and length > 1 else "recurrent" if fast.kda else None
        o, state = kda_forward(q.view(heads), k.view(heads), v.view(heads), g_raw, beta_raw,
                               self.A_log[: self.num_heads], self.dt_bias, self.lower_bound, self.head_dim**-0.5,
                               own.recurrent_state, in_place=own.in_place, kernel=kernel)
        own.update(conv_states, state)
        return self.o_proj(self.gated_norm(o, gate_logits, x.dtype, fast.fused).reshape(batch, length, -1))

    def gated_norm(self, o, gate_logits, dtype, fused=False):
        """The per-head output `o_norm(o) * sigmoid(gate)` in `dtype`, o rounded to it first: with `fused` one
        kernel (`fused_triton.gated_rms_norm`, the same roundings), else the torch ops."""
        norm = self.o_norm
        if fused and norm.weight.device == o.device:  # not offloaded (see attn_res_mix)
            out = fused_gated_rms_norm(o, gate_logits, norm.weight, norm.variance_epsilon, dtype)
            if out is not None:
                return out
        return norm(o.to(dtype)) * torch.sigmoid(gate_logits)

    def short_convs(self, projected, conv_states, in_place, fused=False, fused_dtype=None):
        """q, k, v through their short convs: returns ((q, k, v), new conv histories). With `fused` one kernel a
        conv (`in_place`: the histories are overwritten, as a static cache wants; outputs cast to `fused_dtype` where
        given); else one `short_conv` over the
        concatenated channels (1/3 the ops), or, with weights offloaded by accelerate (its hooks load each conv's
        weight only for its own forward), each conv module on its own."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if not all(c.weight.device == projected[0].device for c in convs):
            return zip(*(c(y, s) for c, y, s in zip(convs, projected, conv_states or (None,) * 3)))
        if fused:
            return fused_short_conv(projected, [c.weight for c in convs], conv_states, in_place, fused_dtype)
        widths = [c.out_channels for c in convs]
        qkv, qkv_state = short_conv(torch.cat(projected, dim=-1), torch.cat([c.weight for c in convs]),
                                    None if conv_states is None else torch.cat(conv_states, dim=1))
        return qkv.split(widths, dim=-1), qkv_state.split(widths, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Gated NoPE MLA
# ----------------------------------------------------------------------------------------------------------------


class KimiK3MLAttention(nn.Module):
    """Multi-head latent attention without rotary embeddings, with a sigmoid output gate.

    Only the compressed latent `[kv_a_layernorm(c), k_r]` (kv_lora_rank + qk_rope_head_dim values a token) is cached;
    per-head K/V are expanded from it with `kv_b_proj` at each call.
    """

    def __init__(self, config, layer_idx, dispatch=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.dispatch = dispatch or FastPathDispatch()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        hidden = config.hidden_size
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_layernorm = KimiK3RMSNorm(config.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = nn.Linear(hidden, self.num_heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=False)

    def forward(self, x, attention_mask=None, cache=None, positions=None):
        """x: [B, T, H]; attention_mask: [B, keys] over all cached and new tokens (0 = padding), or None;
        positions: [T] the new tokens' absolute positions (default: right after the cached ones)."""
        if positions is None:
            positions = _next_positions(cache, x.shape[1], x.device)
        fast = self.dispatch.at(x.device)
        if fast.side_streams:
            return mla_side_by_side(self, x, attention_mask, cache, positions, fast)
        queries = self.queries(x)
        return self.attend(queries, self.keys(x, cache, positions), attention_mask, positions, fast)

    def queries(self, x):
        """The per-head queries [B, heads, T, nope + rope] and the output gate's logits [B, T, heads * v] (None
        without one; its sigmoid is taken in `gated_output`)."""
        batch, length, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, length, self.num_heads, -1).transpose(1, 2)
        return q, self.g_proj(x) if self.use_output_gate else None

    def keys(self, x, cache, positions):
        """The compressed latent `[kv_a_layernorm(c), k_r]` of these tokens, written to the cache; returns every
        key these queries may see [B, keys, kv_lora_rank + rope] and whether to attend in the latent space."""
        length = x.shape[1]
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_r], dim=-1)
        if cache is not None:
            latent = cache.layers[self.layer_idx].update(latent, positions)
        # Decode steps attend in the latent space; accelerate's offload hooks only load kv_b_proj's weight for its
        # own forward, so an offloaded (meta) weight takes the expanding path.
        absorb = (latent.shape[1] > length and length <= self.ABSORB_MAX_QUERIES
                  and self.kv_b_proj.weight.device.type != "meta")
        if cache is not None and not absorb:  # a static cache's unfilled tail holds no key of these queries
            latent = latent[:, : cache.get_seq_length() + length]
        return latent, absorb

    def attend(self, queries, keys, attention_mask, positions, fast):
        """Causal attention of `queries` (from `queries`) over `keys` (from `keys`), gated, then the output
        projection."""
        (q, gate_logits), (latent, absorb) = queries, keys
        length = q.shape[2]
        if absorb and length == 1 and fast.fused:  # one pass over the keys up to the query (fused_triton)
            attn = self.attend_absorbed(q, latent, key_mask=attention_mask, position=positions)
        elif attention_mask is None and latent.shape[1] == length:  # a prompt on its own: plain causal attention
            attn = self.attend_expanded(q, latent, None, causal=True, fused=fast.fused)
        else:
            mask = _causal_padding_mask(attention_mask, positions, latent.shape[1])
            attn = (self.attend_absorbed(q, latent, mask) if absorb
                    else self.attend_expanded(q, latent, mask, fused=fast.fused))
        return self.o_proj(self.gated_output(attn, gate_logits, fast.fused))

    def gated_output(self, attn, gate_logits, fused=False):
        """The heads' outputs [B, heads, T, v] as [B, T, heads * v], times sigmoid(gate_logits) where there is an
        output gate: with `fused` one kernel (`fused_triton.sigmoid_gated_heads`, the same roundings), else the
        torch ops."""
        if fused and gate_logits is not None:
            return fused_sigmoid_gated_heads(attn, gate_logits)
        batch, _, length, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(batch, length, -1)
        return attn if gate_logits is None else attn * torch.sigmoid(gate_logits)

    # Absorbing kv_b_proj costs ~ (kv_lora_rank + rope) per query per key instead of expanding every cached key
    # to heads x (nope + v); it wins while the queries are few next to the keys, as in decode.
    ABSORB_MAX_QUERIES = 16

    def attend_expanded(self, q, latent, mask, causal=False, fused=False):
        """Reference: expand per-head K/V from the latent with kv_b_proj, then SDPA under `mask`, or with `causal`
        (queries and keys the same tokens) SDPA's own causal masking, which skips the masked blocks instead of
        computing them. q: [B, heads, Tq, 192]. Each head's key is its k_nope beside the shared k_r: with `fused`
        copied by one kernel (`fused_triton.mla_keys`), else concatenated."""
        batch, keys = latent.shape[:2]
        c, k_r = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c)
        per_head = kv.view(batch, keys, self.num_heads, -1).transpose(1, 2)
        v = per_head[..., self.nope_dim :]
        if fused:
            k = fused_mla_keys(kv, latent, self.num_heads, self.nope_dim, self.kv_lora_rank).transpose(1, 2)
        else:
            k = torch.cat([per_head[..., : self.nope_dim], k_r.unsqueeze(1).expand(-1, self.num_heads, -1, -1)], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def attend_absorbed(self, q, latent, mask=None, key_mask=None, position=None):
        """Same attention in the latent space: q_nope is mapped through W_UK^T onto the latent, the softmax-weighted
        latent is mapped through W_UV per head; per-head K/V are never materialised. Given the query's `position`
        (one query; `key_mask` the padding mask or None) instead of `mask`, the weighted latent comes from
        `fused_triton.latent_attention`."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_r = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        batch, heads, queries = q.shape[:3]

        def per_key(x, y):  # [B, heads, Tq, d] x [B, keys, d]^T -> [B, heads, Tq, keys], one bmm over B
            return (x.flatten(1, 2) @ y.mT).view(batch, heads, queries, -1)

        def per_head(x, w):  # [B, heads, Tq, d] x [heads, d, e] -> [B, heads, Tq, e], one bmm over heads (a
            # broadcast matmul would first expand w to every batch row: ~100 MB a call at batch 8 and real width)
            out = x.transpose(0, 1).reshape(heads, batch * queries, -1) @ w
            return out.view(heads, batch, queries, -1).transpose(0, 1)

        # matmuls rather than einsums: the same products with less Python and fewer permutes (~5 us less each at a
        # CPU decode step); equal up to the bmms' summation order (bitwise at the CPU benchmark's decode shapes)
        q_latent = per_head(q_nope, w_uk)
        if position is not None:
            weighted = fused_latent_attention(torch.cat([q_latent, q_rope], dim=-1)[:, :, 0], latent, position[:1],
                                              key_mask, self.scale, self.kv_lora_rank)
            return per_head(weighted.unsqueeze(2), w_uv.mT)
        scores = per_key(q_latent, c) + per_key(q_rope, k_r)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1).to(c.dtype)
        return per_head((probs.flatten(1, 2) @ c).view(batch, heads, queries, -1), w_uv.mT)


def _next_positions(cache, length, device):
    """Absolute positions of `length` new tokens: right after the ones `cache` has seen (from 0 without one)."""
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + length, device=device)


def _causal_padding_mask(attention_mask, positions, keys):
    """Boolean [B or 1, 1, Tq, keys] for queries at absolute `positions` over keys 0..keys-1: causal, padding keys
    hidden; each query also sees itself so no row is empty. Key slots past the queries (a static cache's unused
    tail) fall under the causal part.

    None where it would hide nothing: one query at the last key without padding (a decode step with a growing
    cache), checked only for positions on the CPU, where reading one is free; attention then runs unmasked."""
    if attention_mask is None and positions.shape == (1,) and positions.device.type == "cpu" and (
            int(positions[0]) == keys - 1):
        return None
    q_pos = positions[:, None]
    k_pos = torch.arange(keys, device=positions.device)[None, :]
    mask = k_pos <= q_pos
    if attention_mask is not None:
        valid = attention_mask.bool()[:, None, :keys]
        mask = mask & (valid | (k_pos == q_pos))
    else:
        mask = mask[None]
    return mask.unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------------
# LatentMoE with MXFP4 routed experts
# ----------------------------------------------------------------------------------------------------------------


class KimiK3Router(nn.Module):
    """Sigmoid router with the bias-corrected ("noaux_tc") top-k choice, in fp32.

    Returns the chosen expert ids [N, k] and the weights the expert outputs are multiplied by [N, k]: the chosen
    sigmoid scores (not the biased ones), renormalised over the top-k, times `routed_scaling_factor`.
    """

    def __init__(self, config, num_experts, dispatch=None):
        super().__init__()
        self.dispatch = dispatch or FastPathDispatch()
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x):
        fast = self.dispatch.at(x.device)
        if fast.fused and x.is_cuda and x.dtype == self.weight.dtype != torch.float32:
            # the same fp32 products and sums straight from the stored dtype: no fp32 copy of the weight a call
            logits = torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t(), out_dtype=torch.float32)
            logits = logits.view(*x.shape[:-1], -1)
        else:
            logits = F.linear(x.float(), self.weight.float())
        if logits.dim() == 2 and fast.fused:
            chosen = fused_router_topk(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
            if chosen is not None:
                return chosen
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class MXFP4Linear(nn.Module):
    """A bias-free linear layer whose weight stays packed as MXFP4 (compressed-tensors `mxfp4-pack-quantized`).

    `weight_packed` [out, in/2] and `weight_scale` [out, in/32] are uint8 parameters, loaded and saved as is; the
    weight is dequantized only for the call that uses it. Deliberately not an `nn.Linear`: transformers'
    compressed-tensors integration would otherwise decompress every such layer to bf16 at load.
    """

    def __init__(self, in_features, out_features):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_packed = nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.uint8),
                                          requires_grad=False)
        self.weight_scale = nn.Parameter(torch.zeros(out_features, in_features // 32, dtype=torch.uint8),
                                         requires_grad=False)

    def forward(self, x):
        return F.linear(x, dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype=x.dtype))

    @torch.no_grad()
    def pack_(self, weight):
        """Quantize a float weight [out, in] into this layer's packs (compressed-tensors' rounding)."""
        packed, scale = quantize_mxfp4(weight)
        self.weight_packed.copy_(packed)
        self.weight_scale.copy_(scale)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, format=mxfp4"


class KimiK3Expert(nn.Module):
    """One routed expert in the latent space: `w2(situ(w1 z, w3 z))`, L -> moe_intermediate -> L."""

    def __init__(self, config, packed):
        super().__init__()
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        make = MXFP4Linear if packed else (lambda i, o: nn.Linear(i, o, bias=False))
        self.w1, self.w3, self.w2 = make(latent, inner), make(latent, inner), make(inner, latent)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, z):
        return self.w2(situ_glu(self.w1(z), self.w3(z), self.beta, self.linear_beta))

    def gated(self, z, w13):
        """`situ(w1 z, w3 z)` on given weights w13 [..., 2*inner, L] (w1's rows, then w3's); with a leading expert
        dimension on both it runs one batched matmul."""
        return self.glu(z @ w13.mT)

    def glu(self, h):
        """SiTU-GLU of w1 and w3 outputs side by side, h [..., 2*inner]: elementwise, so rows of several experts
        can go through one call."""
        inner = h.shape[-1] // 2
        return situ_glu(h[..., :inner], h[..., inner:], self.beta, self.linear_beta)


# Most dequantized expert weights (w1, w3 and w2, in the activation dtype) the CPU/reference path holds at once.
DEQUANT_CHUNK_BYTES = 64 << 20


class KimiK3LatentMoE(nn.Module):
    """LatentMoE: route on the full hidden state, run the chosen experts in a narrower latent space, sum, norm, lift.

    `out = up(norm(sum_k w_k expert_k(down(x)))) + shared_experts(x)`. Experts run only on the tokens routed to them.
    """

    def __init__(self, config, num_experts, packed, dispatch=None):
        super().__init__()
        self.num_experts = num_experts
        self.dispatch = dispatch or FastPathDispatch()
        self.gate = KimiK3Router(config, num_experts, self.dispatch)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
        self.experts = nn.ModuleList(KimiK3Expert(config, packed) for _ in range(num_experts))
        self.routed_expert_norm = (
            KimiK3RMSNorm(config.routed_expert_hidden_size, eps=config.rms_norm_eps)
            if config.latent_moe_use_norm
            else nn.Identity()
        )
        self.routed_expert_up_proj = nn.Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        self.shared_experts = KimiK3MLP(config, config.num_shared_experts * config.moe_intermediate_size)
        self.expert_stack = None  # the MXFP4 experts' packs stacked [E, ...]; see stack_experts
        self.expert_parallel = None  # under tensor parallel, this rank's share of the experts (tensor_parallel.py)

    def _expert_key(self):
        first, last = self.experts[0], self.experts[-1]
        return (len(self.experts),) + tuple(p.data_ptr() for p in (first.w1.weight_packed, last.w2.weight_scale))

    def stack_experts(self):
        """Stack the MXFP4 experts' packs into one [E, ...] tensor per weight (`mxfp4_triton.stack_experts`; the
        per-expert parameters become views of them, so nothing is held twice), which the batched reference and the
        expert kernels read. Called at load (`post_init`, `from_pretrained`) and after a move (`_apply`), never by
        a forward; a no-op where the stack is current. None for float experts and for experts not all on one real
        device (e.g. offloaded by accelerate): those run the per-expert loop."""
        first = self.experts[0].w1
        if not isinstance(first, MXFP4Linear) or first.weight_packed.device.type == "meta":
            self.expert_stack = None
        elif self.expert_stack is None or self.expert_stack.key != self._expert_key():
            self.expert_stack = stack_expert_packs(self.experts)
            if self.expert_stack is not None:
                self.expert_stack = self.expert_stack._replace(key=self._expert_key())
        return self.expert_stack

    def stack_on(self, device):
        """The expert stack where it is current and on `device`, else None (the caller runs the per-expert loop):
        a stack left behind by parameters replaced since (`load_state_dict(assign=True)`) is never read."""
        stack = self.expert_stack
        if stack is None or stack.w1.device != device or stack.key != self._expert_key():
            return None
        return stack

    def _apply(self, fn, *args, **kwargs):
        """`.to()` / `.cuda()` move each expert parameter on its own: stack them again where they were stacked."""
        super()._apply(fn, *args, **kwargs)
        if self.expert_stack is not None:
            self.stack_experts()
        return self

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        fast = self.dispatch.at(x.device)
        if fast.side_streams:
            return moe_side_by_side(self, x, fast)
        ids, weights = self.gate(flat)
        y = self.latent_experts(self.routed_expert_down_proj(flat), ids, weights, fast)
        return (y + self.shared_experts(flat, fast.fused)).view(x.shape)

    def latent_experts(self, z, ids, weights, fast):
        """The routed half in the latent space: `up(norm(sum_k w_k expert_k(z)))` for the latents z [N, L], on the
        MXFP4 expert kernels where the `experts` path is on (else the reference `routed_experts`)."""
        ep = self.expert_parallel  # this rank runs its experts' pairs; one all-reduce sums the latent
        if ep is not None:
            ids = ep.local_ids(ids)
        pairs = triton_routed_experts(self, z, ids) if fast.experts else None  # None: n/a here
        if pairs is None:
            y = self.routed_experts(z, ids, weights)
            y = self.routed_expert_norm((y if ep is None else ep.sum(y)).to(z.dtype))
        else:
            if ep is not None:
                pairs, weights = ep.sum_pairs(pairs, weights, ids), None
            y = self.normed_sum(pairs, weights, z.dtype, fast.fused)
        return self.routed_expert_up_proj(y)

    def normed_sum(self, pairs, weights, dtype, fused=False):
        """`routed_expert_norm` of the per-(token, slot) expert outputs [N, k, L] weighted by `weights` [N, k] in fp32
        (None: `pairs` are weighted fp32 terms already) and summed over k, rounded to `dtype`: with `fused` one
        kernel (`fused_triton.pair_sum_norm`), else the torch ops."""
        norm = self.routed_expert_norm
        on_device = getattr(norm, "weight", pairs).device == pairs.device  # not offloaded (see attn_res_mix)
        if fused and on_device and isinstance(norm, (KimiK3RMSNorm, nn.Identity)):
            weight, eps = (norm.weight, norm.variance_epsilon) if isinstance(norm, KimiK3RMSNorm) else (None, 0.0)
            out = fused_pair_sum_norm(pairs, weights, weight, eps, dtype)
            if out is not None:
                return out
        terms = pairs.float() if weights is None else pairs.float() * weights.float().unsqueeze(-1)
        return norm(terms.sum(1).to(dtype))

    def routed_experts(self, z, ids, weights):
        """Reference expert sum `sum_k w_k expert_k(z)` in fp32: (token, slot) pairs are sorted by expert so each
        expert runs once on one contiguous slice, and the weighted outputs are scattered back in a single add. Pairs
        with id `num_experts` (experts another rank holds, under expert parallel) sort last and are left out."""
        top_k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts + 1).tolist()
        order = order[: order.numel() - counts.pop()]
        token = order // top_k
        routed = z[token]
        out = self.packed_experts(routed, counts)
        if out is None:
            out = torch.empty(routed.shape, dtype=torch.float32, device=z.device)
            start = 0
            for e, count in enumerate(counts):
                if count:
                    out[start : start + count] = self.experts[e](routed[start : start + count]).float()
                    start += count
        out *= weights.flatten()[order, None]
        return torch.zeros(z.shape, dtype=torch.float32, device=z.device).index_add_(0, token, out)

    def packed_experts(self, routed, counts):
        """`expert_e(rows)` in fp32 for MXFP4 experts, `routed` [pairs, L] sorted by expert with `counts[e]` rows
        each: the per-expert loop's result from a few large ops instead of ~12 small ones per expert. None where the
        experts are not stacked on `routed`'s device (float experts, or offloaded by accelerate, whose hooks load
        them only for the expert's own forward): the caller then runs the loop.

        The packs are read from the layer's expert stack (`stack_experts`). Per chunk of the experts hit (at most `DEQUANT_CHUNK_BYTES` of dequantized weights):
        one dequantization of all their w1 and w3 packs and one of their w2 packs (after the first is used), each
        followed, where every expert has the same number of rows (a decode step), by a batched matmul over the
        chunk, else by a matmul per expert (and one SiTU-GLU call over all their rows).
        """
        first, stack = self.experts[0], self.stack_on(routed.device)
        if stack is None:
            return None
        latent, inner = stack.latent, stack.inner
        hit = [e for e, count in enumerate(counts) if count]
        step = max(1, DEQUANT_CHUNK_BYTES // (3 * latent * inner * routed.element_size()))
        out, start = [], 0
        for chunk in (hit[i : i + step] for i in range(0, len(hit), step)):
            sizes = [counts[e] for e in chunk]
            rows = routed[start : start + sum(sizes)]
            start += sum(sizes)
            index = torch.tensor(chunk, device=routed.device)
            w1, s1, w3, s3, w2, s2 = (t.index_select(0, index) for t in stack[:6])
            uniform = min(sizes) == max(sizes)
            w13 = dequantize_unchecked(torch.cat([w1, w3], 1).flatten(0, 1), torch.cat([s1, s3], 1).flatten(0, 1),
                                       rows.dtype).view(len(chunk), 2 * inner, latent)
            if uniform:
                act = first.gated(rows.view(len(chunk), sizes[0], latent), w13)
            else:
                act = first.glu(torch.cat([x @ w13[i].mT for i, x in enumerate(rows.split(sizes))])).split(sizes)
            del w13  # before w2 is dequantized: the two are never held at once
            w2 = dequantize_unchecked(w2.flatten(0, 1), s2.flatten(0, 1), rows.dtype).view(len(chunk), latent, inner)
            y = (act @ w2.mT).view(-1, latent) if uniform else torch.cat([a @ w2[i].mT for i, a in enumerate(act)])
            out.append(y.float())
        if len(out) == 1:  # one chunk (all but very large batches): no copy
            return out[0]
        return torch.cat(out) if out else torch.empty(routed.shape, dtype=torch.float32, device=routed.device)


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------------------


class KimiK3DecoderLayer(nn.Module):
    """Attention (KDA or MLA) then MLP (dense) or LatentMoE, each reading a depth mix of the block bank.

    State between layers is `(bank, partial)`: the block snapshots (row 0 the embeddings) and the current block's
    partial sum of sublayer outputs (None right after a block boundary).
    """

    def __init__(self, config, layer_idx, packed_experts, dispatch=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.dispatch = dispatch = dispatch or FastPathDispatch()
        self.opens_block = layer_idx % config.attn_res_block_size == 0
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = KimiK3RMSNorm(hidden, eps)
        self.post_attention_layernorm = KimiK3RMSNorm(hidden, eps)
        self.self_attention_res_norm = KimiK3RMSNorm(hidden, eps)
        self.self_attention_res_proj = KimiK3AttnResProj(hidden)
        self.mlp_res_norm = KimiK3RMSNorm(hidden, eps)
        self.mlp_res_proj = KimiK3AttnResProj(hidden)
        attention = KimiK3DeltaAttention if config.layer_types[layer_idx] == "kda" else KimiK3MLAttention
        self.self_attn = attention(config, layer_idx, dispatch)
        experts = config.experts_in_layer(layer_idx)
        if experts:
            self.block_sparse_moe = KimiK3LatentMoE(config, experts, packed_experts, dispatch)
        else:
            self.mlp = KimiK3MLP(config, config.intermediate_size)

    def forward(self, bank, partial, attention_mask=None, cache=None, positions=None):
        """attention_mask: [B, keys] over cached and new tokens, or None; positions: [T] absolute positions of the
        new tokens (default: right after the cached ones)."""
        if positions is None:
            positions = _next_positions(cache, partial.shape[1], partial.device)
        fused = self.dispatch.at(partial.device).fused
        h = attn_res_mix(bank, partial, self.self_attention_res_norm, self.self_attention_res_proj,
                         self.input_layernorm, fused)
        if self.opens_block:
            bank, partial = BlockBank(tuple(bank) + (partial,)), None
        if isinstance(self.self_attn, KimiK3DeltaAttention):
            token_mask = attention_mask[:, positions] if attention_mask is not None else None
            a = self.self_attn(h, token_mask, cache)
        else:
            a = self.self_attn(h, attention_mask, cache, positions)
        partial = a if partial is None else partial + a
        h = attn_res_mix(bank, partial, self.mlp_res_norm, self.mlp_res_proj, self.post_attention_layernorm, fused)
        ffn = self.block_sparse_moe(h) if hasattr(self, "block_sparse_moe") else self.mlp(h, fused)
        return (bank if isinstance(bank, tuple) else tuple(bank)), partial + ffn


# ----------------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------------


class KimiK3CacheLayer:
    """One decoder layer's share of the cache, answering what transformers' `Cache` asks of its layers (reset,
    beam reordering, batch selection, crop) over the state tensors named in `_fields` (a tuple field holds several).
    Tensors are created on the layer's own device by the layer's first call."""

    is_compileable = False
    is_sliding = False
    is_croppable = False  # a KDA state cannot be rolled back, so no layer offers it
    supports_early_init = False
    in_place = False  # whether kernels may overwrite the state tensors they are given
    _fields = ()

    def __init__(self):
        self._clear()

    def _clear(self):
        for name in self._fields:
            setattr(self, name, None)

    def tensors(self):
        """Every allocated state tensor."""
        values = [getattr(self, name) for name in self._fields]
        return [t for v in values if v is not None for t in (v if isinstance(v, tuple) else (v,))]

    def _map(self, fn):
        for name in self._fields:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(map(fn, value)) if isinstance(value, tuple) else fn(value))

    def reorder_cache(self, beam_idx):
        """Select batch rows (beam search)."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        self._clear()

    def crop(self, tokens_to_remove):
        if tokens_to_remove:
            raise ValueError("The Kimi K3 cache cannot drop tokens: its KDA layers keep a recurrent state, not one "
                             "entry per token")


class KimiK3DeltaCacheLayer(KimiK3CacheLayer):
    """A KDA layer's state: the q, k and v short-conv histories and the fp32 recurrent state."""

    _fields = ("conv_states", "recurrent_state")

    def update(self, conv_states, recurrent_state):
        self.conv_states, self.recurrent_state = tuple(conv_states), recurrent_state


class KimiK3LatentCacheLayer(KimiK3CacheLayer):
    """An MLA layer's compressed latents [B, T, kv_lora_rank + qk_rope_head_dim]: `latent` is the filled front of a
    buffer with room to grow, so a decode step writes its own token where concatenation would copy every cached one
    (at 131k cached tokens that copy was 0.7 ms of a 53 ms step over 24 layers). When full, the buffer is replaced by
    one a quarter longer than needed (a copy every ~T/4 tokens: amortised O(1) a token)."""

    _fields = ("latent",)
    _buffer = None  # the storage `latent` is the front of, where it still is (a reorder or reset makes a new one)

    def update(self, latent, positions):
        """Append the new tokens' latents; returns all of this layer's keys [B, keys, width]."""
        if self.latent is None:  # a prompt's latents are kept as they come; the first step makes room
            self.latent = self._buffer = latent
            return latent
        cached, total = self.latent.shape[1], self.latent.shape[1] + latent.shape[1]
        buffer = self._buffer
        if not (buffer is not None and buffer.data_ptr() == self.latent.data_ptr()
                and buffer.stride() == self.latent.stride() and buffer.shape[1] >= total):
            buffer = self.latent.new_empty(self.latent.shape[0], total + max(64, total // 4), self.latent.shape[2])
            buffer[:, :cached] = self.latent
            self._buffer = buffer
        buffer[:, cached:total] = latent
        self.latent = buffer[:, :total]
        return self.latent


class KimiK3Cache(Cache):
    """Hybrid generation cache: transformers' `Cache` over one `KimiK3DeltaCacheLayer` per KDA layer and one
    `KimiK3LatentCacheLayer` per MLA layer, plus the count of tokens seen. Layers reach their share as
    `cache.layers[layer_idx]` and call its `update`; the decoder checks each call's mask through `prepare`."""

    delta_layer, latent_layer = KimiK3DeltaCacheLayer, KimiK3LatentCacheLayer

    def __init__(self, config):
        config = getattr(config, "text_config", config)
        super().__init__(layers=[self.delta_layer() if kind == "kda" else self.latent_layer()
                                 for kind in config.layer_types])
        self.seen_tokens = 0

    is_compileable = False
    is_croppable = False

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_max_length(self, layer_idx=None):
        """Tokens the cache can hold, -1 for no limit (the name of transformers 5.x)."""
        return -1

    def get_max_cache_shape(self, layer_idx=0):
        """`get_max_length` under the name of transformers 4.57."""
        return self.get_max_length()

    @property
    def max_cache_len(self):
        return self.get_max_length()

    @property
    def batch_size(self):
        """Rows of the cached states, -1 before the first call."""
        return next((t.shape[0] for layer in self.layers for t in layer.tensors()), -1)

    @property
    def max_batch_size(self):
        """`batch_size` under the name of transformers 4.57."""
        return self.batch_size

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.seen_tokens + query_length, 0

    def reset(self):
        super().reset()
        self.seen_tokens = 0

    def prepare(self, attention_mask, batch, length, device):
        """Check a call's mask and return (mask over every key, absolute positions [length] of the new tokens)."""
        _check_mask(attention_mask, self.seen_tokens + length)
        return attention_mask, _next_positions(self, length, device)


def _check_mask(attention_mask, expected):
    if attention_mask is not None and attention_mask.shape[-1] != expected:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens, expected cached + new = {expected}")


class KimiK3StaticCacheLayer(KimiK3CacheLayer):
    """A layer's state in buffers that keep their addresses: the first call allocates them, later calls, beam
    reordering and `reset` write into them."""

    in_place = True

    def __init__(self, rows, max_length):
        super().__init__()
        self.rows, self.max_length = rows, max_length

    def reorder_cache(self, beam_idx):
        for t in self.tensors():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        raise ValueError("A KimiK3StaticCache keeps its batch size; make one for the expanded batch")

    def reset(self):
        """Zeroed states are what a first call starts from."""
        for t in self.tensors():
            t.zero_()


class KimiK3StaticDeltaCacheLayer(KimiK3StaticCacheLayer, KimiK3DeltaCacheLayer):
    def update(self, conv_states, recurrent_state):
        if self.recurrent_state is None:
            super().update(tuple(c.clone() for c in conv_states), recurrent_state.clone())
            return
        for buffer, new in zip(self.conv_states + (self.recurrent_state,), tuple(conv_states) + (recurrent_state,)):
            if new is not buffer:  # fla's decode kernel and the fused short conv already wrote into their buffers
                buffer.copy_(new)


class KimiK3StaticLatentCacheLayer(KimiK3StaticCacheLayer, KimiK3LatentCacheLayer):
    def update(self, latent, positions):
        """Write the new latents at their positions; returns the whole [B, max_length, width] buffer (the unused
        tail is masked as future keys)."""
        if self.latent is None:
            self.latent = latent.new_zeros(self.rows, self.max_length, latent.shape[-1])
        return self.latent.index_copy_(1, positions, latent)


class KimiK3StaticCache(KimiK3Cache):
    """Preallocated cache for up to `max_length` tokens of `batch_size` rows, updated in place, so that a decode
    step reads and writes the same addresses every time and can be replayed as a CUDA graph.

    The attention mask and the position counter live in device buffers too. With `cuda_graph=True` and the
    `cuda_graphs` fast path on, `KimiK3ForCausalLM` replays each one-token step from CUDA graphs, one per run of
    layers on one GPU (`KimiK3DecodeGraph`). Each layer's buffers are allocated on that layer's device by its first
    call. Pass it to `generate(..., cache=cache)`; `reset()` readies it, graph and all, for the
    next prompt (as transformers' StaticCache.reset).
    """

    def __init__(self, config, batch_size, max_length, cuda_graph=True):
        self.rows, self.max_length, self.cuda_graph = batch_size, max_length, cuda_graph
        super().__init__(config)
        self.mask = None  # [B, max_length] bool: 1 = a real token
        self.position = None  # long scalar: tokens cached before the current call
        self.decode_graph = None  # a KimiK3DecodeGraph, made by the model's first one-token step with graphs on

    @staticmethod
    def layer_bytes(config, batch_size, max_length, dtype=torch.bfloat16):
        """Bytes each decoder layer's share takes, for planning a `device_map` (the cache of a layer lives on that
        layer's device): a KDA layer's q/k/v conv histories (activation dtype) and fp32 recurrent state, whatever
        the length; an MLA layer's latents for `max_length` tokens."""
        config = getattr(config, "text_config", config)
        lac, item = config.linear_attn_config, torch.finfo(dtype).bits // 8
        width = lac["num_heads"] * lac["head_dim"]
        kda = batch_size * (3 * width * (lac["short_conv_kernel_size"] - 1) * item
                            + lac["num_heads"] * lac["head_dim"] ** 2 * 4)
        mla = batch_size * max_length * (config.kv_lora_rank + config.qk_rope_head_dim) * item
        return [kda if kind == "kda" else mla for kind in config.layer_types]

    def delta_layer(self):
        return KimiK3StaticDeltaCacheLayer(self.rows, self.max_length)

    def latent_layer(self):
        return KimiK3StaticLatentCacheLayer(self.rows, self.max_length)

    def get_max_length(self, layer_idx=None):
        return self.max_length

    @property
    def batch_size(self):
        return self.rows

    def prepare(self, attention_mask, batch, length, device):
        end = self.seen_tokens + length
        if end > self.max_length:
            raise ValueError(f"KimiK3StaticCache holds {self.max_length} tokens; this call needs {end}")
        _check_mask(attention_mask, end)
        if batch != self.rows:
            raise ValueError(f"KimiK3StaticCache is for batch {self.rows}, this call has {batch} rows")
        if self.mask is None:
            self.mask = torch.ones(self.rows, self.max_length, dtype=torch.bool, device=device)
            self.position = torch.zeros((), dtype=torch.long, device=device)
        self._write_inputs(attention_mask, end)
        return self.mask, self.position + torch.arange(length, device=device)

    def _write_inputs(self, attention_mask, end):
        self.position.fill_(self.seen_tokens)
        if attention_mask is None:
            self.mask[:, :end] = True
        else:
            self.mask[:, :end].copy_(attention_mask)

    def reorder_cache(self, beam_idx):
        """Select batch rows (beam search), in place."""
        super().reorder_cache(beam_idx)
        if self.mask is not None:
            self.mask.copy_(self.mask.index_select(0, beam_idx.to(self.mask.device)))


# ----------------------------------------------------------------------------------------------------------------
# Runners around the layers: side streams, CUDA-graph decode
# ----------------------------------------------------------------------------------------------------------------


# Where the `side_streams` path is on, the KDA, MLA and MoE blocks run as the variants below instead of their
# reference forwards: the same parts in the same order, but the work the main path does not need until later (the
# attention gates and query path, the MoE's router and shared experts) is queued on a second CUDA stream, so it
# overlaps the main path's chain of small kernels instead of queueing behind it; a CUDA graph captured over a decode
# step keeps both branches. The results are the same bits: the same kernels on the same inputs.
_side_streams = {}


class SideBranch:
    """`with branch:` queues its work on a second stream of x's CUDA device, after everything queued so far;
    `branch.join()` makes the main stream wait for that work (not for side work queued after it). In place (a
    no-op) for tensors off CUDA.

    No `record_stream` is needed as long as the caller joins before it returns: the branch's inputs are then still
    referenced while it runs, and memory it allocated and the caller frees is reused by later side-stream work only
    after a later fork, i.e. after every main-stream read queued before it.
    """

    def __init__(self, x):
        self.main = torch.cuda.current_stream(x.device) if x.is_cuda else None
        if self.main is not None and x.device not in _side_streams:
            _side_streams[x.device] = torch.cuda.Stream(x.device)
        self.side = _side_streams[x.device] if self.main is not None else None
        self._context = None
        self._done = None

    def __enter__(self):
        if self.side is not None:
            self.side.wait_stream(self.main)
            self._context = torch.cuda.stream(self.side)
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            self._done = torch.cuda.Event()
            self._done.record(self.side)
            self._context.__exit__(*exc)
            self._context = None
        return False

    def join(self):
        if self._done is not None:
            self.main.wait_event(self._done)


def kda_side_by_side(attn, x, cache, fast):
    """`KimiK3DeltaAttention.forward` (after masking) with the gate inputs beside the q/k/v projections and convs."""
    own = attn.cache_layer(cache)
    branch = SideBranch(x)
    with branch:
        gates = attn.gate_inputs(x)
    qkv = attn.qkv(x, own, fast)
    branch.join()
    return attn.delta_rule(x, qkv, gates, own, fast)


def mla_side_by_side(attn, x, attention_mask, cache, positions, fast):
    """`KimiK3MLAttention.forward` with the query path and output gate beside the latent's path through the cache."""
    branch = SideBranch(x)
    with branch:
        queries = attn.queries(x)
    keys = attn.keys(x, cache, positions)
    branch.join()
    return attn.attend(queries, keys, attention_mask, positions, fast)


def moe_side_by_side(moe, x, fast):
    """`KimiK3LatentMoE.forward` with the router beside the down projection, and the shared experts beside the
    routed experts."""
    flat = x.reshape(-1, x.shape[-1])
    routing, shared_branch = SideBranch(flat), SideBranch(flat)
    with routing:
        ids, weights = moe.gate(flat)
    with shared_branch:
        shared = moe.shared_experts(flat, fast.fused)
    z = moe.routed_expert_down_proj(flat)
    routing.join()
    y = moe.latent_experts(z, ids, weights, fast)
    shared_branch.join()
    return (y + shared).view(x.shape)


def execution_device(module):
    """Where `module` computes: accelerate's hook's device where it has one (its weights may be offloaded), else that
    of its first parameter."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


@dataclasses.dataclass
class DecodeSegment:
    """Consecutive decode stages on one device: captured as one CUDA graph (`graph`, replayed on copies of its inputs
    into `inputs`, its results in `outputs`), or run eagerly where `why_eager` says why not."""

    device: torch.device
    stages: list
    why_eager: str = None
    inputs: tuple = None
    mask: torch.Tensor = None
    positions: torch.Tensor = None
    graph: torch.cuda.CUDAGraph = None
    outputs: tuple = None

    def run(self, state, mask, positions, cache):
        for stage in self.stages:
            state = stage(state, mask, positions, cache)
        return state


class KimiK3DecodeGraph:
    """One-token decode steps of a `KimiK3ForCausalLM` on a `KimiK3StaticCache`, replayed from CUDA graphs.

    The step is cut into stages (the embedding, each decoder layer, the output depth mix + norm, the head);
    consecutive stages on one CUDA device form a segment, one graph, so a model on one GPU is one graph and a model
    spread over GPUs by `device_map` one graph per contiguous run of layers on each, replayed in order with the hops
    (copies of a segment's results onto the next device) between them. Segments on the CPU, with weights offloaded
    by accelerate (its hooks load them at each call: not capturable) or with the `cuda_graphs` path off on their
    device run eagerly, logged once. The first step runs eagerly (it warms up kernels and libraries and gives each
    segment's input shapes), the second captures, the rest replay; a segment that cannot be captured warns once and
    runs eagerly. It lives on its cache (`cache.decode_graph`), so a `reset()` cache reuses the captured graphs.
    """

    def __init__(self, model):
        self.model = model
        self.segments = []
        for device, stage, offloaded in model.decode_stages():
            if device.type != "cuda":
                why = "not on a CUDA device"
            elif offloaded:
                why = "weights offloaded by accelerate (loaded at each call)"
            elif not model.language_model.model.dispatch.resolved(device).cuda_graphs:
                why = "the cuda_graphs fast path is off there"
            else:
                why = None
            if not self.segments or (self.segments[-1].device, self.segments[-1].why_eager) != (device, why):
                self.segments.append(DecodeSegment(device, [], why))
            self.segments[-1].stages.append(stage)
        self.steps = 0
        eager = [f"{s.device} ({s.why_eager})" for s in self.segments if s.why_eager]
        if eager and self.enabled:
            logger.info(f"Kimi K3 decode graphs: {len(self.segments)} segments, run eagerly on {'; '.join(eager)}")

    @property
    def enabled(self):
        """Whether any segment is (to be) captured with the `cuda_graphs` path on on its device now."""
        dispatch = self.model.language_model.model.dispatch
        return any(s.why_eager is None and dispatch.resolved(s.device).cuda_graphs for s in self.segments)

    @property
    def captured(self):
        """Whether any segment runs from a captured graph."""
        return any(s.graph is not None for s in self.segments)

    def __call__(self, cache, input_ids, attention_mask):
        """Logits [B, 1, vocab] of one new token per row."""
        self.model.language_model.model.dispatch.refresh()
        if cache.seen_tokens == 0:
            raise ValueError("KimiK3DecodeGraph runs decode steps: prefill the cache first")
        mask, positions = cache.prepare(attention_mask, input_ids.shape[0], 1, input_ids.device)
        if self.steps == 1:
            self._capture(cache)
        state = (input_ids,)
        for segment in self.segments:
            state = tuple(t.to(segment.device) for t in state)  # the hop onto this segment's device
            if segment.graph is None:
                if self.steps == 0 and segment.why_eager is None:
                    segment.inputs = tuple(t.clone() for t in state)  # the shapes (and values) to capture on
                state = segment.run(state, mask.to(segment.device), positions.to(segment.device), cache)
                continue
            for buffer, value in zip(segment.inputs + (segment.mask, segment.positions), state + (mask, positions)):
                buffer.copy_(value)
            with torch.cuda.device(segment.device):
                segment.graph.replay()
            state = segment.outputs
        self.steps += 1
        cache.seen_tokens += 1
        return state[0].clone() if self.segments[-1].graph is not None else state[0]

    def _capture(self, cache):
        seen = cache.seen_tokens
        for segment in self.segments:
            if segment.why_eager:
                continue
            segment.mask = cache.mask.to(segment.device, copy=True)
            segment.positions = torch.zeros(1, dtype=torch.long, device=segment.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.device(segment.device), torch.cuda.graph(graph):
                    outputs = segment.run(segment.inputs, segment.mask, segment.positions, cache)
            except RuntimeError as err:  # e.g. a host sync in a path without a CUDA kernel (reference experts)
                logger.warning(f"Kimi K3: decode segment on {segment.device} not capturable as a CUDA graph, running "
                               f"it eagerly ({err})")
                segment.why_eager = "capture failed"
            else:
                segment.graph, segment.outputs = graph, outputs
            finally:
                cache.seen_tokens = seen  # capturing ran the Python side of the stages without running them


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class KimiK3TextModel(nn.Module):
    """Embeddings, decoder layers, the output depth mix and final norm (the release's `language_model.model`)."""

    def __init__(self, config, packed_experts, dispatch=None):
        super().__init__()
        self.config = config
        self.dispatch = dispatch = dispatch or FastPathDispatch()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KimiK3DecoderLayer(config, i, packed_experts, dispatch) for i in range(config.num_hidden_layers)
        )
        self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_attn_res_proj = KimiK3AttnResProj(config.hidden_size)
        self.norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)

    # Prompts longer than this run through the cache this many tokens at a time (the same outputs, activation memory
    # bounded by the chunk); None: in one piece. Set on the instance to change it.
    prefill_chunk_size = 8192

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, cache=None, use_cache=False):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        self.dispatch.refresh()
        if use_cache and cache is None:
            cache = KimiK3Cache(self.config)
        chunk = self.prefill_chunk_size
        if cache is not None and chunk and inputs_embeds.shape[1] > chunk:
            past, hidden = cache.get_seq_length(), []
            for start in range(0, inputs_embeds.shape[1], chunk):
                part = inputs_embeds[:, start : start + chunk]
                mask = None if attention_mask is None else attention_mask[:, : past + start + part.shape[1]]
                hidden.append(self.run_layers(part, mask, cache)[0])
            return torch.cat(hidden, dim=1), cache
        return self.run_layers(inputs_embeds, attention_mask, cache)

    def run_layers(self, inputs_embeds, attention_mask, cache):
        """The decoder over embedded tokens that follow the cache's (all of them at once); returns (hidden, cache)."""
        length, device = inputs_embeds.shape[1], inputs_embeds.device
        if cache is not None:
            attention_mask, positions = cache.prepare(attention_mask, inputs_embeds.shape[0], length, device)
        else:
            _check_mask(attention_mask, length)
            positions = _next_positions(None, length, device)
        if (attention_mask is not None and (attention_mask.device.type == "cpu" or length > 1)
                and bool(attention_mask.all())):
            # no padding: the same outputs without each layer's masking ops, and MLA prompts take SDPA's causal
            # kernels; one host read a prompt (free on the CPU; skipped for a GPU's decode steps)
            attention_mask = None
        bank, partial = (), inputs_embeds
        for layer in self.layers:
            bank, partial = layer(bank, partial, attention_mask, cache, positions)
        hidden = self.output_mix(bank, partial)
        if cache is not None:
            cache.seen_tokens += inputs_embeds.shape[1]
        return hidden, cache

    def output_mix(self, bank, partial):
        """The last depth mix over every block and the final norm: the decoder's output hidden states."""
        bank = tuple(s.to(partial.device) for s in bank)
        return attn_res_mix(bank, partial, self.output_attn_res_norm, self.output_attn_res_proj, self.norm,
                            self.dispatch.at(partial.device).fused)


class KimiK3LanguageModel(nn.Module):
    """The release's `language_model.` subtree: the decoder `model` and, for the causal LM, `lm_head`."""

    def __init__(self, config, with_head):
        super().__init__()
        text = config.text_config
        self.model = KimiK3TextModel(text, config.experts_packed, FastPathDispatch(config))
        if with_head:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


class KimiK3PreTrainedModel(PreTrainedModel):
    """Weight init, loading rules and generation hooks shared by `KimiK3Model` and `KimiK3ForCausalLM`.

    Loading is strict: a missing, unexpected or mis-shaped checkpoint tensor is an error naming it, and local
    safetensors files are checked (header, size) before transformers reads them.
    """

    config_class = KimiK3Config
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiK3DecoderLayer"]
    _keep_in_fp32_modules = ["A_log", "dt_bias", "e_score_correction_bias"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _is_stateful = True
    # The release's MoonViT vision tower: a text-only load skips it on purpose (check_checkpoint says so once);
    # any other unexpected tensor stays an error.
    _vision_keys = (r"^vision_tower\.", r"^mm_projector\.")
    _keys_to_ignore_on_load_unexpected = list(_vision_keys)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.text_config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, KimiK3AttnResProj):  # zero pseudo-query: every mix starts as a uniform average
            module.weight.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, KimiK3RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK3ShortConv):
            nn.init.kaiming_uniform_(module.weight, a=5**0.5)
        elif isinstance(module, KimiK3Router):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, MXFP4Linear) and module.weight_packed.device.type != "meta":
            module.pack_(torch.randn(module.out_features, module.in_features) * std)
        elif isinstance(module, KimiK3DeltaAttention):
            module.A_log.zero_()
            # decay per step drawn log-uniformly in [1e-3, 1e-1] of the lower bound's range at zero input
            bound = abs(module.lower_bound or 1.0)
            rate = torch.empty_like(module.dt_bias).uniform_(-6.9, -2.3).exp()
            if module.lower_bound is None:
                module.dt_bias.copy_(rate + torch.log(-torch.expm1(-rate)))
            else:
                p = (rate / bound).clamp(max=0.5)
                module.dt_bias.copy_(torch.log(p / (1 - p)))

    def post_init(self):
        super().post_init()
        self.stack_experts()

    def stack_experts(self):
        """Stack every MoE block's MXFP4 experts (`KimiK3LatentMoE.stack_experts`): done at construction and load;
        call it again after replacing expert parameters by hand."""
        for module in self.modules():
            if isinstance(module, KimiK3LatentMoE):
                module.stack_experts()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        """The hybrid KDA/MLA state is not a DynamicCache; the model makes its own `KimiK3Cache`."""
        return False

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.model.embed_tokens = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if kwargs.get("tp_plan") is not None:  # under torchrun: this rank's shard only (tensor_parallel.py)
            return load_tensor_parallel(cls, pretrained_model_name_or_path, *args, **kwargs)
        wants_info = kwargs.pop("output_loading_info", False)
        path = cls.checkpoint_directory(str(pretrained_model_name_or_path), kwargs)
        config = kwargs.get("config")
        if not isinstance(config, KimiK3Config):
            config = KimiK3Config.from_pretrained(path)
        cls.check_checkpoint(path, config)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        model.stack_experts()  # the loaded packs replaced the ones stacked at construction
        for device in {p.device for p in model.parameters()} - {torch.device("meta")}:
            model.language_model.model.dispatch.resolved(device)  # resolve (and log) the fast paths once per device
        cls._raise_on_key_problems(
            path, info.get("missing_keys", []), info.get("unexpected_keys", []),
            [str(m) for m in info.get("mismatched_keys", [])],
        )
        return (model, info) if wants_info else model

    @staticmethod
    def checkpoint_directory(path, kwargs):
        """The local folder of checkpoint `path`: the folder itself, or the snapshot of the hub repository `path`
        (its config and safetensors files, fetched or found in the cache as `from_pretrained` would, under the hub
        options among its `kwargs`), so that a hub load is checked as strictly as a local one."""
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
                                          "token") if kwargs.get(k) is not None}
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **hub)
        return os.path.join(path, kwargs.get("subfolder") or "")

    @classmethod
    def check_checkpoint(cls, directory, config):
        """Compare a local checkpoint's tensor names, shapes and dtypes with what `config` implies, before loading.

        The model's state_dict on the meta device gives the expected tensors: a uint8 one (MXFP4 bytes and scales)
        must be stored as U8, an integer one as its own dtype, a float one as BF16, F16 or F32 (any dtype the model
        may be loaded in). A scale stored as BF16 or a router weight as I64 would otherwise be cast silently.
        Returns the headers read (`read_safetensors_headers`).
        """
        found = read_safetensors_headers(directory)
        with torch.device("meta"):
            expected = {k: (tuple(v.shape), v.dtype) for k, v in cls(config).state_dict().items()}
        mismatched = [f"{k} (checkpoint {list(found[k][2])}, model {list(s)})"
                      for k, (s, _) in expected.items() if k in found and found[k][2] != s]
        wrong_dtype = []
        for k, (_, dtype) in expected.items():
            accepted = _SAFETENSORS_FLOATS if dtype.is_floating_point else (_SAFETENSORS_DTYPES.get(dtype, str(dtype)),)
            if k in found and found[k][1] not in accepted:
                wrong_dtype.append(f"{k} in {found[k][0]} ({found[k][1]}, model expects {' or '.join(accepted)})")
        unexpected = sorted(set(found) - set(expected))
        cls._raise_on_key_problems(directory, sorted(set(expected) - set(found)), unexpected, mismatched, wrong_dtype)
        vision = [k for k in unexpected if any(re.search(p, k) for p in cls._vision_keys)]
        if vision:
            logger.warning(f"{directory}: skipping {len(vision)} vision-tower tensors (names matching "
                           f"{', '.join(cls._vision_keys)}): this model is text-only")
        return found

    @classmethod
    def _raise_on_key_problems(cls, source, missing, unexpected, mismatched, wrong_dtype=()):
        ignored = cls._keys_to_ignore_on_load_unexpected or []
        unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored)]
        problems = {"missing": sorted(missing), "unexpected": sorted(unexpected), "mismatched": sorted(mismatched),
                    "wrong dtype": sorted(wrong_dtype)}
        if any(problems.values()):
            detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else "")
                               for kind, keys in problems.items() if keys)
            raise ValueError(f"{source}: checkpoint does not match the model ({detail})")


# safetensors dtype names: those a float parameter may be stored as, and the one an integer tensor must have.
_SAFETENSORS_FLOATS = ("BF16", "F16", "F32")
_SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
                       torch.int64: "I64", torch.bool: "BOOL"}


def read_safetensors_headers(directory):
    """Tensor name -> (file name, safetensors dtype, shape) over a checkpoint's safetensors files, failing early
    (naming the file) on a malformed index, a missing shard, a truncated file or a corrupt header, and on a tensor
    stored somewhere other than the index says."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{index_path}: not a JSON object ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: no \"weight_map\" object of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    found = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: listed in model.safetensors.index.json but missing")
        try:  # safetensors checks the header and that the file holds every byte it promises
            with safe_open(path, "pt") as f:
                slices = {key: f.get_slice(key) for key in f.keys()}
                entries = {key: (t.get_dtype(), tuple(t.get_shape())) for key, t in slices.items()}
        except Exception as err:  # safetensors' own error types differ between releases
            raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({err})") from None
        for key, (dtype, shape) in entries.items():
            if weight_map is not None and weight_map.get(key) != name:
                raise ValueError(f"{path}: holds {key}, which model.safetensors.index.json places in "
                                 f"{weight_map.get(key)}")
            found[key] = (name, dtype, shape)
    return found


class KimiK3Model(KimiK3PreTrainedModel):
    """The bare decoder (AutoModel): last hidden states, no LM head."""

    _keys_to_ignore_on_load_unexpected = [*KimiK3PreTrainedModel._vision_keys, r"^language_model\.lm_head\."]

    def __init__(self, config):
        super().__init__(config)
        self.language_model = KimiK3LanguageModel(config, with_head=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, use_cache=None,
                return_dict=True, past_key_values=None, **kwargs):
        cache = _given_cache(cache, past_key_values, kwargs)
        _reject_unsupported_outputs(kwargs)
        hidden, cache = self.language_model.model(input_ids, inputs_embeds, attention_mask, cache, bool(use_cache))
        return _output_with_cache(BaseModelOutputWithPast, cache, last_hidden_state=hidden)


def _given_cache(cache, past_key_values, kwargs):
    """The cache a call was given: transformers passes it as `cache` from 5.24 and as `past_key_values` before, and
    a user may write either. A cache under any other keyword is an error rather than a call that silently runs
    uncached, as is a cache of another type (the hybrid KDA/MLA state needs a `KimiK3Cache`)."""
    if past_key_values is not None:
        if cache is not None and cache is not past_key_values:
            raise ValueError("Got both `cache` and `past_key_values`; pass the cache once")
        cache = past_key_values
    stray = sorted(name for name, value in kwargs.items() if isinstance(value, Cache))
    if stray:
        raise TypeError(f"Got a cache as {stray}: pass it as `cache` (or `past_key_values`)")
    if cache is not None and not isinstance(cache, KimiK3Cache):
        raise TypeError(f"Kimi K3 needs a KimiK3Cache (KDA states beside MLA latents), got {type(cache).__name__}; "
                        "leave the cache to the model or use `make_static_cache`")
    return cache


def _output_with_cache(output_class, cache, **fields):
    """`output_class(**fields)` with the cache under the field name the installed transformers gives it (`cache` from
    5.24, `past_key_values` before), so that `generate` reads it back and nothing warns."""
    names = {f.name for f in dataclasses.fields(output_class)}
    return output_class(**fields, **{"cache" if "cache" in names else "past_key_values": cache})


def _reject_unsupported_outputs(kwargs):
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise ValueError(f"{name}=True is not supported by the Kimi K3 remote code")


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    """Kimi K3 causal LM: the decoder plus `lm_head`; `generate()` greedy, sampling and beam search."""

    def __init__(self, config):
        super().__init__(config)
        self.language_model = KimiK3LanguageModel(config, with_head=True)
        self.post_init()

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def make_static_cache(self, batch_size, max_length, cuda_graph=True):
        """A `KimiK3StaticCache` for `generate(..., cache=cache)`: preallocated for `max_length` tokens (prompt +
        new) of `batch_size` rows; each one-token step is then replayed from CUDA graphs (one per GPU the model
        spans, where the `cuda_graphs` path is on)."""
        return KimiK3StaticCache(self.config, batch_size, max_length, cuda_graph)

    def set_output_embeddings(self, value):
        self.language_model.lm_head = value

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        """Refuse assisted decoding up front: it rolls the cache back past rejected draft tokens, which a recurrent
        KDA state cannot do (transformers up to 5.24 refused it for stateful models; 5.25 no longer does)."""
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(f"assisted generation is not supported by {type(self).__name__}: its KDA layers keep a "
                             "recurrent state that cannot be rolled back past rejected draft tokens")
        return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def decode_stages(self):
        """A one-token decode step as [(device, stage, offloaded)] for `KimiK3DecodeGraph`: each stage maps a tuple
        of tensors (the token ids; then the block bank and the partial sum; the hidden states; the logits) to the
        next, given the mask over every key, the new token's position (both on the stage's device) and the cache."""
        text, head = self.language_model.model, self.language_model.lm_head

        def embed(state, mask, positions, cache):
            return (text.embed_tokens(state[0]),)

        def layer_stage(layer):
            def stage(state, mask, positions, cache):
                bank, partial = layer(state[:-1], state[-1], mask, cache, positions)
                return (*bank, partial)
            return stage

        def output(state, mask, positions, cache):
            return (text.output_mix(state[:-1], state[-1]),)

        def logits(state, mask, positions, cache):
            return (head(state[0]),)

        modules = [(text.embed_tokens, embed), *((layer, layer_stage(layer)) for layer in text.layers),
                   (text.norm, output), (head, logits)]
        return [(execution_device(m), stage, any(p.device.type == "meta" for p in m.parameters()))
                for m, stage in modules]

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, return_dict=True, past_key_values=None, **kwargs):
        cache = _given_cache(cache, past_key_values, kwargs)
        _reject_unsupported_outputs(kwargs)

        def step(ids, mask):
            nonlocal cache  # created by the decoder when use_cache is set and none was passed
            hidden, cache = self.language_model.model(ids, inputs_embeds, mask, cache, bool(use_cache))
            return self.language_model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)

        graphs = None
        if (isinstance(cache, KimiK3StaticCache) and cache.cuda_graph and input_ids is not None
                and input_ids.shape[1] == 1 and cache.seen_tokens > 0):
            if cache.decode_graph is None or cache.decode_graph.model is not self:
                cache.decode_graph = KimiK3DecodeGraph(self)
            graphs = cache.decode_graph if cache.decode_graph.enabled else None
        if graphs is not None:
            logits = graphs(cache, input_ids, attention_mask)  # CUDA-graph replays once warm
        else:
            logits = step(input_ids, attention_mask)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            if attention_mask is not None:
                shifted = shifted.masked_fill(~attention_mask[:, 1:].bool().to(logits.device), -100)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), shifted.flatten(), ignore_index=-100)
        return _output_with_cache(CausalLMOutputWithPast, cache, loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, inputs_embeds=None,
                                      use_cache=True, logits_to_keep=None, past_key_values=None, **kwargs):
        """Feed only the tokens the cache has not seen; prompt embeddings only on the first step."""
        cache = _given_cache(cache, past_key_values, kwargs)
        seen = cache.get_seq_length() if cache is not None else 0
        if inputs_embeds is not None and seen == 0:
            inputs = {"inputs_embeds": inputs_embeds}
        else:
            inputs = {"input_ids": input_ids[:, seen:]}
        inputs.update(attention_mask=attention_mask, cache=cache, use_cache=use_cache)
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs


__all__ = ["KimiK3Model", "KimiK3ForCausalLM", "KimiK3PreTrainedModel", "KimiK3Cache", "KimiK3StaticCache"]
