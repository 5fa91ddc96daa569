"""Kimi K3 text model (remote code): hybrid KDA / gated NoPE MLA decoder with Block Attention Residuals and LatentMoE.

Reads top to bottom as the architecture does: activations and norms, Block Attention Residuals, KDA (Kimi Delta
Attention), gated NoPE MLA, LatentMoE with MXFP4 routed experts, the decoder layer, the model and the causal-LM head.
Module names follow the release checkpoint (`language_model.model.layers.{i}...`), so it loads unchanged.

Every block's small ops are plain torch functions defined here (and `kda.kda_forward`): the reference, which runs
anywhere and is what the tests compare against. A block calls them through the `Ops` table its `FastPathDispatch`
resolves for the device (`kimi_k3_dispatch`), where a kernel with the same inputs and outputs may stand in for each.
The machinery lives beside this file: the caches (`kimi_k3_cache`), side streams and CUDA-graph decode
(`kimi_k3_runners`), checkpoint checks (`kimi_k3_loading`) and tensor parallel (`tensor_parallel`).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

try:
    from .configuration_kimi_k3 import KimiK3Config
    from .kda import kda_forward
    from .kimi_k3_cache import (KimiK3Cache, KimiK3DeltaCacheLayer, KimiK3StaticCache, check_mask,
                                generation_cache_key, given_cache, next_positions, output_with_cache)
    from .kimi_k3_dispatch import FastPathDispatch, FastPaths, Ops, use_fast_paths
    # transformers 4.57 copies a local folder's modules into its cache from this file's relative imports alone, not
    # theirs in turn: the kernel modules, which only the dispatch imports, are named here so that they travel too
    from .fused_triton import supported as _  # noqa: F401
    from .mxfp4_triton import supported as _  # noqa: F401, F811
    from .kimi_k3_loading import VISION_KEYS, check_loaded_scales, load_model, release_state_dict
    from .kimi_k3_runners import execution_device, kda_side_by_side, mla_side_by_side, moe_side_by_side
    from .mxfp4 import dequantize_mxfp4, dequantize_unchecked, quantize_mxfp4, stack_experts
    from .tensor_parallel import load_tensor_parallel
except ImportError:  # imported from the repository root rather than as transformers remote code
    from configuration_kimi_k3 import KimiK3Config
    from kda import kda_forward
    from kimi_k3_cache import (KimiK3Cache, KimiK3DeltaCacheLayer, KimiK3StaticCache, check_mask,
                               generation_cache_key, given_cache, next_positions, output_with_cache)
    from kimi_k3_dispatch import FastPathDispatch, FastPaths, Ops, use_fast_paths
    from kimi_k3_loading import VISION_KEYS, check_loaded_scales, load_model, release_state_dict
    from kimi_k3_runners import execution_device, kda_side_by_side, mla_side_by_side, moe_side_by_side
    from mxfp4 import dequantize_mxfp4, dequantize_unchecked, quantize_mxfp4, stack_experts
    from tensor_parallel import load_tensor_parallel

# Under transformers' own logger, so that its verbosity settings (`transformers.logging.set_verbosity_info()`) reach
# this remote code too, whose module lives outside the library (`transformers_modules.<repo>...`).
logger = logging.get_logger("transformers.kimi_k3")


def new_dispatch(config):
    """The dispatch of a block built on its own (a model shares one among all its blocks)."""
    return FastPathDispatch(REFERENCE_OPS, config)


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


def offloaded_by_hook(module):
    """Whether accelerate's hook on `module` loads its weights for its own forward (offload), which a merged matmul
    would bypass; its hooks on the blocks of a model spread over devices only move their inputs."""
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and getattr(hook, "offload", True)


class MergedProjections(nn.Module):
    """A block whose linear layers named in `merged` read the same input. `merge_projections` lays their weights out
    as consecutive row blocks of one buffer [sum of out_features, in_features], each parameter a view of its rows
    (the same names, `state_dict` and checkpoints, no extra memory), and `merged_outputs` then runs them as one
    matmul split into their outputs: one launch instead of one a projection, each output row the same dot products.

    The buffer serves while every weight is still a view of its rows: weights replaced since (tensor parallel's
    `shard`, `load_state_dict(assign=True)`, accelerate's offload hooks) take the projections one by one again, and
    `.to()` / `.cuda()`, which move or cast each parameter on its own, merge them again."""

    merged = ()
    _merged_weight = None  # the buffer, a plain attribute: not a parameter, so not in `state_dict`
    _merged_rows = ()

    def merge_projections(self):
        """Merge the `merged` projections' weights into one buffer on their device, in their dtype; nothing where
        they cannot share one (meta or offloaded weights, different devices or dtypes), and no copy where they do
        already."""
        if self.merged_weight() is not None:
            return
        linears = [getattr(self, name) for name in self.merged]
        weights = [linear.weight for linear in linears]
        if (any(w.is_meta for w in weights) or len({(w.device, w.dtype) for w in weights}) > 1
                or any(map(offloaded_by_hook, linears))):
            self._merged_weight = None
            return
        rows = tuple(w.shape[0] for w in weights)
        merged = torch.cat([w.detach() for w in weights])
        for linear, w, view in zip(linears, weights, merged.split(rows)):
            linear.weight = nn.Parameter(view, requires_grad=w.requires_grad)
        self._merged_weight, self._merged_rows = merged, rows

    def merged_weight(self):
        """The merged buffer while every `merged` weight is still a view of its rows; else None (and a buffer whose
        views were replaced is let go)."""
        merged = self._merged_weight
        if merged is None:
            return None
        start, row_bytes = merged.data_ptr(), merged.stride(0) * merged.element_size()
        for name, rows in zip(self.merged, self._merged_rows):
            w = getattr(self, name).weight
            if w.data_ptr() != start or w.device != merged.device or w.shape != (rows, merged.shape[1]):
                self._merged_weight = None
                return None
            start += rows * row_bytes
        return merged

    def merged_outputs(self, x, ops):
        """The `merged` projections' outputs for x from one matmul over their merged weight; None where that path is
        off (`FastPaths.merged_projections`: by default on CUDA only, and never while autograd records, whose
        gradients reach the parameters through their own forwards), where a hook waits on a projection's own
        forward, or where the weights are not merged."""
        if not ops.paths.merged_projections:
            return None
        linears = [getattr(self, name) for name in self.merged]
        hooked = any(m._forward_hooks or m._forward_pre_hooks or offloaded_by_hook(m) for m in linears)
        weight = None if hooked else self.merged_weight()
        return None if weight is None else F.linear(x, weight).split(self._merged_rows, dim=-1)

    def _apply(self, fn, *args, **kwargs):
        """`.to()` / `.cuda()` move or cast each projection on its own: merged ones are merged again after."""
        was_merged = self._merged_weight is not None
        super()._apply(fn, *args, **kwargs)
        if was_merged and self.merged_weight() is None:
            self.merge_projections()
        return self


def merge_block_projections(module):
    """`merge_projections` of every block in `module` (a model or a layer): what a load does once the weights are
    read (and sharded). Returns `module`."""
    for block in module.modules():
        if isinstance(block, MergedProjections):
            block.merge_projections()
    return module


class KimiK3MLP(MergedProjections):
    """SiTU-GLU MLP: the dense layer-0 MLP and the shared experts."""

    merged = ("gate_proj", "up_proj")

    def __init__(self, config, intermediate_size, dispatch=None):
        super().__init__()
        self.dispatch = dispatch or new_dispatch(config)
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x):
        ops = self.dispatch.ops(x.device, self.down_proj.weight.is_meta)
        gate, up = self.merged_outputs(x, ops) or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(ops.situ_glu(gate, up, self.beta, self.linear_beta))


# ----------------------------------------------------------------------------------------------------------------
# Block Attention Residuals
# ----------------------------------------------------------------------------------------------------------------


class BlockBank(tuple):
    """The block snapshots of Block Attention Residuals (row 0 the embeddings), a tuple that the fused depth mixes
    read as one stack [n, ...].

    In a decode step (one token a row, no autograd) its rows are views of one buffer [blocks, ...], allocated by the
    first block's opening (`opened`): the mixes read `buffer[:n]` with no copy, the layer that closes a block writes
    its partial sum straight into the next row (`close`), so the next opening copies nothing either, and a bank
    flattened into a plain tuple (a decode stage's output) finds its buffer again (`of`). Elsewhere the stack is
    made once per bank and kept: the mixes of a block's layers (two a layer) read one stack."""

    buffer = None

    @classmethod
    def of(cls, rows):
        """`rows` as a BlockBank: itself where it is one, else a new one, on its buffer again where the rows are the
        leading rows of a bank buffer, in order."""
        if isinstance(rows, BlockBank):
            return rows
        bank = cls(rows)
        base = bank[0]._base if bank else None
        if getattr(base, "_is_block_bank", False) and all(
                row._base is base and row.data_ptr() == base[i].data_ptr() and row.shape == base.shape[1:]
                for i, row in enumerate(bank)):
            bank.buffer = base
        return bank

    def stacked(self):
        if self.buffer is not None:
            return self.buffer[: len(self)]
        if getattr(self, "_stacked", None) is None:
            self._stacked = torch.stack(self)
        return self._stacked

    def _next_row(self, partial):
        """The buffer row the snapshot `partial` goes to, or None: no buffer, no room left, or another dtype/shape."""
        if self.buffer is None or len(self) == self.buffer.shape[0]:
            return None
        row = self.buffer[len(self)]
        return row if (row.dtype, row.shape, row.device) == (partial.dtype, partial.shape, partial.device) else None

    def opened(self, partial, blocks):
        """The bank with `partial` (the partial sum a block ends with) as its new last row. In a decode step the row
        is in the buffer (made here, `blocks` rows, by the first opening): copied there unless `close` wrote it."""
        bank = self
        if self.buffer is None and not self and partial.shape[1] == 1 and not torch.is_grad_enabled():
            buffer = partial.new_empty(blocks, *partial.shape)
            buffer._is_block_bank = True
            bank = BlockBank()._with(buffer)
        row = bank._next_row(partial)
        if row is None:
            return BlockBank(tuple(self) + (partial,))
        if row.data_ptr() != partial.data_ptr():
            row.copy_(partial)
        return BlockBank(tuple(self) + (row,))._with(bank.buffer)

    def close(self, partial, ffn):
        """`partial + ffn`, a block's last partial sum: written into the buffer row that the next block's opening
        takes, where the bank has one (a decode step's)."""
        row = None if torch.is_grad_enabled() else self._next_row(partial)
        if row is None or (ffn.dtype, ffn.shape) != (row.dtype, row.shape):
            return partial + ffn
        return torch.add(partial, ffn, out=row)

    def _with(self, buffer):
        self.buffer = buffer
        return self


def attn_res_mix(bank, partial, norm, proj, out_norm, key_mask=None, positions=None):
    """Softmax-weighted mix over depth of the sources `bank` (block snapshots) + `partial` (the current block's
    partial sum), `sum_j softmax_j(proj(norm(v_j))) v_j` in fp32, then `out_norm` of it (the RMSNorm of the sublayer
    that reads the mix). `proj(norm(v))` is `(v / rms(v)) . (norm.weight * proj.weight)`, the pseudo-query score.
    With `key_mask` [B, keys] (0 = padding) and the tokens' `positions` [T], padding tokens' rows are zeros (what a
    KDA layer reads of them)."""
    if not bank:
        out = out_norm(partial)
    else:
        stacked = torch.stack(list(bank) + [partial]).float()  # [n, B, T, H]
        weights = proj(norm(stacked)).softmax(dim=0).unsqueeze(-1)  # [n, B, T, 1]
        out = out_norm((weights * stacked).sum(0).to(partial.dtype))
    return out if key_mask is None else out.masked_fill(~key_mask[:, positions].bool()[..., None], 0.0)


def add_attn_res_mix(bank, partial, delta, norm, proj, out_norm):
    """The sublayer's output `delta` added to the current block's partial sum, then `attn_res_mix` over the bank and
    that sum: (partial + delta, the mix)."""
    partial = partial + delta
    return partial, attn_res_mix(bank, partial, norm, proj, out_norm)


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


def short_convs(projected, convs, conv_states, in_place=False, out_dtype=None):
    """q, k, v (`projected`) through their short convs `convs` from their histories `conv_states` (None: zeros):
    returns ((q, k, v), new histories). One `short_conv` over the concatenated channels (1/3 the ops); with weights
    offloaded by accelerate (its hooks load each conv's weight only for its own forward) each conv module on its
    own. `in_place` (a kernel may overwrite the histories) and `out_dtype` (the dtype a kernel may give the outputs
    in) are a kernel's liberties; the reference returns new tensors in the inputs' dtype."""
    if any(c.weight.device != projected[0].device for c in convs):
        return tuple(zip(*(c(y, s) for c, y, s in zip(convs, projected, conv_states or (None,) * 3))))
    widths = [c.out_channels for c in convs]
    qkv, qkv_state = short_conv(torch.cat(projected, dim=-1), torch.cat([c.weight for c in convs]),
                                None if conv_states is None else torch.cat(conv_states, dim=1))
    return qkv.split(widths, dim=-1), qkv_state.split(widths, dim=1)


def gated_rms_norm(o, gate_logits, norm, dtype):
    """KDA's per-head output `norm(o) * sigmoid(gate_logits)` in `dtype`, o rounded to it first."""
    return norm(o.to(dtype)) * torch.sigmoid(gate_logits)


def kda_decode_step(projected, convs, conv_states, g_raw, beta_raw, gate_logits, A_log, dt_bias, lower_bound, scale,
                    state, norm, dtype, in_place=False, parts=None):
    """One token of a KDA layer after its projections, onto a cache's states: q, k, v (`projected`, [B, 1, heads *
    D] each) through their short convs `convs` from the histories `conv_states`, the delta rule (`kda_forward`:
    gate, beta, L2 norms) from the fp32 recurrent `state` [B, heads, D, D] with `g_raw`, `gate_logits` [B, 1,
    heads, D] and `beta_raw` [B, 1, heads], then `gated_rms_norm` (`norm`) in `dtype`. Returns (the output [B, 1,
    heads, D], the new conv histories, the new state); `in_place` lets a kernel write the new states over the given
    ones (a static cache's buffers).

    Made of the `short_convs`, `delta_rule` and `gated_rms_norm` of `parts` (an `Ops` table, the references where
    None): a table without a kernel for the whole step runs it as its own kernels for the three."""
    parts = parts or REFERENCE_OPS
    (q, k, v), conv_states = parts.short_convs(projected, convs, conv_states, in_place)
    heads = g_raw.shape
    o, state = parts.delta_rule(q.view(heads), k.view(heads), v.view(heads), g_raw, beta_raw, A_log, dt_bias,
                                lower_bound, scale, state, in_place=in_place)
    return parts.gated_rms_norm(o, gate_logits, norm, dtype), conv_states, state


class KimiK3ShortConv(nn.Conv1d):
    """Causal depthwise convolution + SiLU (`short_conv`); with a cache it carries the last `kernel - 1` inputs."""

    def __init__(self, channels, kernel_size):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x, state=None):
        """x: [B, T, D]; state: [B, D, kernel-1] or None (zeros). Returns (y [B, T, D], new state)."""
        return short_conv(x, self.weight, state)


class KimiK3DeltaAttention(MergedProjections):
    """KDA layer: short convs on q/k/v, lower-bounded per-channel decay, delta rule, gated per-head RMSNorm output."""

    merged = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")

    def __init__(self, config, layer_idx, dispatch=None):
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.dispatch = dispatch or new_dispatch(config)
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
        ops = self.dispatch.ops(x.device, self.o_norm.weight.is_meta)
        merged = self.merged_outputs(x, ops)
        if merged is not None:  # every projection of x in one matmul: nothing left to run beside it
            q, k, v, g, f_a, b = merged
            return self.delta_rule(x, (q, k, v), self.gates(f_a, b, g), self.cache_layer(cache), ops)
        if ops.paths.side_streams:
            return kda_side_by_side(self, x, cache, ops)
        own = self.cache_layer(cache)
        gates = self.gate_inputs(x)
        return self.delta_rule(x, self.qkv(x), gates, own, ops)

    def cache_layer(self, cache):
        """This layer's share of `cache`; without one a scratch layer (zero state, dropped after the call)."""
        return cache.layers[self.layer_idx] if cache is not None else KimiK3DeltaCacheLayer()

    def gate_inputs(self, x):
        """What the delta rule's gates are made of: the decay's low-rank input [B, T, heads, dim], beta's input
        [B, T, heads] and the output gate's logits [B, T, heads, dim] (its sigmoid is taken in `gated_rms_norm`)."""
        return self.gates(self.f_a_proj(x), self.b_proj(x), self.g_proj(x))

    def gates(self, f_a, b, g):
        """`gate_inputs` from the outputs of x's projections f_a_proj, b_proj and g_proj."""
        heads = (*g.shape[:2], self.num_heads, self.head_dim)
        return self.f_b_proj(f_a).view(heads), b, g.view(heads)

    def qkv(self, x):
        """q, k, v projected, [B, T, heads * dim] each, before their short convs (which `delta_rule` runs)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def delta_rule(self, x, projected, gates, own, ops):
        """q, k, v (`projected`) through their short convs and the gated delta rule from `own`'s states (both
        written back to `own`), then the gated per-head RMSNorm and the output projection. A decode step is one
        `kda_decode_step`; other calls run the three in turn, and a cache that can roll back records between them."""
        g_raw, beta_raw, gate_logits = gates
        batch, length, _ = x.shape
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        constants = (self.A_log[: self.num_heads], self.dt_bias, self.lower_bound, self.head_dim**-0.5)
        if own.decode_step(length):
            o, conv_states, state = ops.kda_decode_step(projected, convs, own.conv_states, g_raw, beta_raw,
                                                        gate_logits, *constants, own.recurrent_state, self.o_norm,
                                                        x.dtype, own.in_place)
            own.update(conv_states, state)
            return self.o_proj(o.reshape(batch, length, -1))
        kept = own.recorded(length)  # a cache that can roll back keeps the conv inputs (before a kernel
        if kept:  # overwrites the histories in place) and the state before the tokens it records
            own.stage_conv(projected, self.q_conv1d.kernel_size[0])
        # where fla's chunked kernel takes q, k, v (in fp32, see kda.py) a conv kernel may store them in fp32 (the
        # same values), which spares a cast of each
        fp32 = torch.float32 if ops.paths.kda_prefill and length > 1 else None
        (q, k, v), conv_states = ops.short_convs(projected, convs, own.conv_states, own.in_place, fp32)
        heads = (batch, length, self.num_heads, self.head_dim)
        inputs = (q.view(heads), k.view(heads), v.view(heads), g_raw, beta_raw)
        o, state, *base = ops.delta_rule(*inputs, *constants, own.recurrent_state, in_place=own.in_place,
                                         **(dict(states_at=[length - kept]) if kept else {}))
        if kept:
            own.record(inputs, base[0][:, 0], self.replay(ops))
        own.update(conv_states, state)
        o = ops.gated_rms_norm(o, gate_logits, self.o_norm, x.dtype)
        return self.o_proj(o.reshape(batch, length, -1))

    def replay(self, ops):
        """This layer's delta rule over recorded inputs (q, k, v, g_raw, beta_raw) from a state: what a cache
        rolling back past rejected draft tokens recomputes its state with (`KimiK3DeltaCacheLayer.crop`)."""
        constants = (self.A_log[: self.num_heads], self.dt_bias, self.lower_bound, self.head_dim**-0.5)
        return lambda *inputs, initial_state: ops.delta_rule(*inputs, *constants, initial_state)


# ----------------------------------------------------------------------------------------------------------------
# Gated NoPE MLA
# ----------------------------------------------------------------------------------------------------------------


def causal_padding_mask(attention_mask, positions, keys):
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


def mla_keys(kv, latent, heads, nope_dim, latent_width):
    """MLA's per-head keys [B, keys, heads, nope_dim + rope]: each head's k_nope (the first nope_dim of its values
    in `kv` [B, keys, heads * (nope_dim + v)], kv_b_proj's output) beside the token's shared k_r (the values of
    `latent` [B, keys, latent_width + rope] after latent_width)."""
    batch, keys, _ = latent.shape
    k_nope = kv.view(batch, keys, heads, -1)[..., :nope_dim]
    k_r = latent[..., latent_width:].unsqueeze(2).expand(-1, -1, heads, -1)
    return torch.cat([k_nope, k_r], dim=-1)


def latent_keys(kv, norm, latent_width, buffer=None, positions=None):
    """MLA's compressed latent `[norm(c), k_r]` [B, T, C + R] of the tokens' `kv_a_proj_with_mqa` output
    `kv = [c, k_r]` (C = `latent_width`); with `buffer` (a static cache's [B, max_length, C + R]) it is written there
    at `positions` [T] and the whole buffer is returned."""
    c, k_r = kv.split([latent_width, kv.shape[-1] - latent_width], dim=-1)
    latent = torch.cat([norm(c), k_r], dim=-1)
    return latent if buffer is None else buffer.index_copy_(1, positions, latent)


def sigmoid_gated_heads(attn, gate):
    """MLA's gated output: the heads' outputs `attn` [B, heads, T, D] as [B, T, heads * D] times sigmoid(`gate`)."""
    batch, _, length, _ = attn.shape
    return attn.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate)


def latent_attention(q_latent, q_rope, latent, positions, key_mask, scale):
    """Attention in the latent space: the softmax-weighted latents [B, heads, Tq, C] for queries whose no-PE part
    `q_latent` [B, heads, Tq, C] is already mapped onto the latent through W_UK^T, `q_rope` [B, heads, Tq, rope],
    at absolute `positions` [Tq], over the keys `latent` [B, keys, C + rope] (`key_mask` [B, keys], 0 = padding, or
    None); softmax in fp32. Per-head K/V are never materialised."""
    batch, heads, queries, width = q_latent.shape
    c, k_r = latent.split([width, latent.shape[-1] - width], dim=-1)

    def per_key(x, y):  # [B, heads, Tq, d] x [B, keys, d]^T -> [B, heads, Tq, keys], one bmm over B
        return (x.flatten(1, 2) @ y.mT).view(batch, heads, queries, -1)

    scores = per_key(q_latent, c) + per_key(q_rope, k_r)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    mask = causal_padding_mask(key_mask, positions, latent.shape[1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(c.dtype)
    return (probs.flatten(1, 2) @ c).view(batch, heads, queries, -1)


class KimiK3MLAttention(MergedProjections):
    """Multi-head latent attention without rotary embeddings, with a sigmoid output gate.

    Only the compressed latent `[kv_a_layernorm(c), k_r]` (kv_lora_rank + qk_rope_head_dim values a token) is cached;
    per-head K/V are expanded from it with `kv_b_proj` at each call, or decode steps attend in the latent space.
    """

    # Absorbing kv_b_proj costs ~ (kv_lora_rank + rope) per query per key instead of expanding every cached key
    # to heads x (nope + v); it wins while the queries are few next to the keys, as in decode.
    ABSORB_MAX_QUERIES = 16

    def __init__(self, config, layer_idx, dispatch=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.dispatch = dispatch or new_dispatch(config)
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
        self.merged = ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")[: 3 if self.use_output_gate else 2]

    def forward(self, x, attention_mask=None, cache=None, positions=None):
        """x: [B, T, H]; attention_mask: [B, keys] over all cached and new tokens (0 = padding), or None;
        positions: [T] the new tokens' absolute positions (default: right after the cached ones)."""
        if positions is None:
            positions = next_positions(cache, x.shape[1], x.device)
        ops = self.dispatch.ops(x.device, self.kv_b_proj.weight.is_meta)
        merged = self.merged_outputs(x, ops)
        if ops.paths.side_streams:
            return mla_side_by_side(self, x, attention_mask, cache, positions, ops, merged)
        queries = self.queries(x, merged)
        return self.attend(queries, self.keys(x, cache, positions, merged), attention_mask, positions, ops)

    def queries(self, x, merged=None):
        """The per-head queries [B, heads, T, nope + rope] and the output gate's logits [B, T, heads * v] (None
        without one; its sigmoid is taken in `gated_output`). `merged`: the projections' outputs from
        `merged_outputs`, where it ran."""
        batch, length, _ = x.shape
        q_a = self.q_a_proj(x) if merged is None else merged[0]
        q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(batch, length, self.num_heads, -1).transpose(1, 2)
        if not self.use_output_gate:
            return q, None
        return q, self.g_proj(x) if merged is None else merged[2]

    def keys(self, x, cache, positions, merged=None):
        """The compressed latent `[kv_a_layernorm(c), k_r]` of these tokens, written to the cache; returns every
        key these queries may see [B, keys, kv_lora_rank + rope] and whether to attend in the latent space.
        `merged`: the projections' outputs from `merged_outputs`, where it ran."""
        length = x.shape[1]
        ops = self.dispatch.ops(x.device, self.kv_b_proj.weight.is_meta)
        kv = self.kv_a_proj_with_mqa(x) if merged is None else merged[1]
        layer = None if cache is None else cache.layers[self.layer_idx]
        buffer = None if layer is None else layer.buffer_for(kv)
        if buffer is not None:  # a static cache's, written in place
            latent = ops.latent_keys(kv, self.kv_a_layernorm, self.kv_lora_rank, buffer, positions)
        else:
            latent = latent_keys(kv, self.kv_a_layernorm, self.kv_lora_rank)
            if layer is not None:
                latent = layer.update(latent, positions)
        # Decode steps attend in the latent space; accelerate's offload hooks only load kv_b_proj's weight for its
        # own forward, so an offloaded (meta) weight takes the expanding path.
        absorb = (latent.shape[1] > length and length <= self.ABSORB_MAX_QUERIES
                  and not self.kv_b_proj.weight.is_meta)
        if cache is not None and not absorb:  # a static cache's unfilled tail holds no key of these queries
            latent = latent[:, : cache.get_seq_length() + length]
        return latent, absorb

    def attend(self, queries, keys, attention_mask, positions, ops):
        """Causal attention of `queries` (from `queries`) over `keys` (from `keys`), gated, then the output
        projection."""
        (q, gate_logits), (latent, absorb) = queries, keys
        if absorb:
            attn = self.attend_absorbed(q, latent, attention_mask, positions, ops)
        elif attention_mask is None and latent.shape[1] == q.shape[2]:  # a prompt on its own: plain causal attention
            attn = self.attend_expanded(q, latent, None, ops, causal=True)
        else:
            attn = self.attend_expanded(q, latent, causal_padding_mask(attention_mask, positions, latent.shape[1]),
                                        ops)
        if gate_logits is None:
            return self.o_proj(attn.transpose(1, 2).flatten(2))
        return self.o_proj(ops.sigmoid_gated_heads(attn, gate_logits))

    def attend_expanded(self, q, latent, mask, ops, causal=False):
        """Expand per-head K/V from the latent with kv_b_proj, then SDPA under `mask`, or with `causal` (queries and
        keys the same tokens) SDPA's own causal masking, which skips the masked blocks instead of computing them.
        q: [B, heads, Tq, nope + rope]."""
        batch, keys = latent.shape[:2]
        kv = self.kv_b_proj(latent[..., : self.kv_lora_rank])
        v = kv.view(batch, keys, self.num_heads, -1)[..., self.nope_dim :].transpose(1, 2)
        k = ops.mla_keys(kv, latent, self.num_heads, self.nope_dim, self.kv_lora_rank).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def attend_absorbed(self, q, latent, key_mask, positions, ops):
        """The same attention in the latent space (`latent_attention`): q_nope is mapped through W_UK^T onto the
        latent, the softmax-weighted latent through W_UV per head. One query a row (a decode step) goes through the
        `latent_attention` op, which may read only the keys up to the query's position."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        batch, heads, queries = q.shape[:3]

        def per_head(x, w):  # [B, heads, Tq, d] x [heads, d, e] -> [B, heads, Tq, e], one bmm over heads (a
            # broadcast matmul would first expand w to every batch row: ~100 MB a call at batch 8 and real width)
            out = x.transpose(0, 1).reshape(heads, batch * queries, -1) @ w
            return out.view(heads, batch, queries, -1).transpose(0, 1)

        attend = ops.latent_attention if queries == 1 else latent_attention
        weighted = attend(per_head(q_nope, w_uk), q_rope, latent, positions, key_mask, self.scale)
        return per_head(weighted, w_uv.mT)


# ----------------------------------------------------------------------------------------------------------------
# LatentMoE with MXFP4 routed experts
# ----------------------------------------------------------------------------------------------------------------


def router_logits(x, weight):
    """The router's fp32 logits `x W^T`."""
    return F.linear(x.float(), weight.float())


def router_topk(logits, bias, top_k, renormalize, scaling):
    """The bias-corrected ("noaux_tc") choice from fp32 logits [N, E]: the ids [N, k] of the top-k of
    `sigmoid(logits) + bias`, and their weights [N, k] fp32: the chosen sigmoid scores (not the biased ones),
    renormalised over the top-k where `renormalize`, times `scaling`."""
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class KimiK3Router(nn.Module):
    """Sigmoid router with the bias-corrected top-k choice, in fp32: tokens [N, H] -> (expert ids [N, k], the
    weights the expert outputs are multiplied by [N, k])."""

    def __init__(self, config, num_experts, dispatch=None):
        super().__init__()
        self.dispatch = dispatch or new_dispatch(config)
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x):
        ops = self.dispatch.ops(x.device, self.weight.is_meta)
        logits = ops.router_logits(x.reshape(-1, x.shape[-1]), self.weight)
        ids, weights = ops.router_topk(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
        return ids.view(*x.shape[:-1], -1), weights.view(*x.shape[:-1], -1)


class MXFP4Linear(nn.Module):
    """A bias-free linear layer whose weight stays packed as MXFP4 (compressed-tensors `mxfp4-pack-quantized`).

    `weight_packed` [out, in/2] and `weight_scale` [out, in/32] are uint8 parameters, loaded and saved as is; the
    weight is dequantized only for the call that uses it. Deliberately not an `nn.Linear`: transformers'
    compressed-tensors integration would otherwise decompress every such layer to bf16 at load. With `experts`, a
    stack of that many such layers (a leading [E] dimension); `row(e)` is layer e, a view.
    """

    def __init__(self, in_features, out_features, experts=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        lead = () if experts is None else (experts,)
        self.weight_packed = nn.Parameter(torch.zeros(*lead, out_features, in_features // 2, dtype=torch.uint8),
                                          requires_grad=False)
        self.weight_scale = nn.Parameter(torch.zeros(*lead, out_features, in_features // 32, dtype=torch.uint8),
                                         requires_grad=False)

    def forward(self, x):
        return F.linear(x, dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype=x.dtype))

    def row(self, e):
        """Layer e of a stack: a `MXFP4Linear` whose parameters are views of this one's (writes go through)."""
        linear = MXFP4Linear.__new__(MXFP4Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight_packed = nn.Parameter(self.weight_packed[e], requires_grad=False)
        linear.weight_scale = nn.Parameter(self.weight_scale[e], requires_grad=False)
        return linear

    @torch.no_grad()
    def pack_(self, weight):
        """Quantize a float weight [..., out, in] into this layer's packs (compressed-tensors' rounding)."""
        packed, scale = quantize_mxfp4(weight.reshape(-1, self.in_features))
        self.weight_packed.copy_(packed.view_as(self.weight_packed))
        self.weight_scale.copy_(scale.view_as(self.weight_scale))

    def extra_repr(self):
        lead = f"experts={self.weight_packed.shape[0]}, " if self.weight_packed.dim() == 3 else ""
        return f"{lead}in_features={self.in_features}, out_features={self.out_features}, format=mxfp4"


class KimiK3Expert(nn.Module):
    """One routed expert in the latent space: `w2(situ(w1 z, w3 z))`, L -> moe_intermediate -> L (float weights, or
    a view of one expert of a `KimiK3Experts` stack)."""

    def __init__(self, config, packed=False):
        super().__init__()
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        make = MXFP4Linear if packed else (lambda i, o: nn.Linear(i, o, bias=False))
        self.w1, self.w3, self.w2 = make(latent, inner), make(latent, inner), make(inner, latent)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, z):
        return self.w2(situ_glu(self.w1(z), self.w3(z), self.beta, self.linear_beta))

    def glu(self, h):
        """SiTU-GLU of w1 and w3 outputs side by side, h [..., 2*inner]: elementwise, so rows of several experts
        can go through one call."""
        inner = h.shape[-1] // 2
        return situ_glu(h[..., :inner], h[..., inner:], self.beta, self.linear_beta)


class KimiK3Experts(nn.Module):
    """A block's routed MXFP4 experts as one stack per projection: `w1`, `w3` [E, inner, L/2 | L/32] and `w2`
    [E, L, inner/2 | inner/32], which the reference and the expert kernels read (`mxfp4.ExpertStack`). The release
    stores expert e's packs as `experts.{e}.w1.weight_packed` ...; `kimi_k3_loading.stacked_key` maps those names
    onto (stack, e), for loading and `load_state_dict`, and `release_state_dict` back, for saving. `experts[e]` is
    expert e as a `KimiK3Expert` over views."""

    def __init__(self, config, num_experts):
        super().__init__()
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        self.w1, self.w3 = MXFP4Linear(latent, inner, num_experts), MXFP4Linear(latent, inner, num_experts)
        self.w2 = MXFP4Linear(inner, latent, num_experts)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self._register_load_state_dict_pre_hook(self._stack_release_keys)

    def __len__(self):
        return self.w1.weight_packed.shape[0]

    def __iter__(self):
        return (self[e] for e in range(len(self)))

    def __getitem__(self, e):
        if isinstance(e, slice):
            return self.select(range(len(self))[e])
        expert = KimiK3Expert.__new__(KimiK3Expert)
        nn.Module.__init__(expert)
        expert.w1, expert.w3, expert.w2 = (getattr(self, name).row(e) for name in ("w1", "w3", "w2"))
        expert.beta, expert.linear_beta = self.beta, self.linear_beta
        return expert

    def select(self, experts):
        """A stack of the given experts only (a contiguous range: views, no copy)."""
        chosen = KimiK3Experts.__new__(KimiK3Experts)
        nn.Module.__init__(chosen)
        for name in ("w1", "w3", "w2"):
            whole, part = getattr(self, name), MXFP4Linear.__new__(MXFP4Linear)
            nn.Module.__init__(part)
            part.in_features, part.out_features = whole.in_features, whole.out_features
            part.weight_packed = nn.Parameter(whole.weight_packed[experts.start : experts.stop], requires_grad=False)
            part.weight_scale = nn.Parameter(whole.weight_scale[experts.start : experts.stop], requires_grad=False)
            setattr(chosen, name, part)
        chosen.beta, chosen.linear_beta = self.beta, self.linear_beta
        chosen._register_load_state_dict_pre_hook(chosen._stack_release_keys)
        return chosen

    glu = KimiK3Expert.glu

    def _stack_release_keys(self, state_dict, prefix, *args):
        """`load_state_dict` with the release's per-expert names: each stack assembled from its experts' tensors."""
        for name in ("w1", "w3", "w2"):
            for attr in ("weight_packed", "weight_scale"):
                keys = [f"{prefix}{e}.{name}.{attr}" for e in range(len(self))]
                if keys[0] in state_dict:
                    state_dict[f"{prefix}{name}.{attr}"] = torch.stack(
                        [state_dict.pop(k) for k in keys if k in state_dict])


# Most dequantized expert weights (w1, w3 and w2, in the activation dtype) the reference holds at once.
DEQUANT_CHUNK_BYTES = 64 << 20


def routed_experts(moe, z, ids):
    """Each (token, slot)'s expert output `expert_{ids[:, k]}(z)`, unweighted, [N, k, L] in z's dtype, for the
    latents z [N, L] and the router's ids [N, k]. Pairs are sorted by expert so each expert runs once on one
    contiguous slice (`stacked_experts`, or each expert where the block has no stack on z's device). Pairs
    with id `moe.num_experts` (experts another rank holds) give rows of zeros."""
    top_k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=moe.num_experts + 1).tolist()
    foreign = counts.pop()
    order = order[: order.numel() - foreign]
    routed = z[order // top_k]
    stack = moe.stack_experts()
    if stack is not None and stack.w1.device == z.device:
        out = stacked_experts(stack, moe.experts, routed, counts)
    else:
        out = torch.cat([moe.experts[e](rows) for e, rows in enumerate(routed.split(counts)) if counts[e]]
                        or [routed[:0]])
    pairs = (torch.zeros if foreign else torch.empty)(ids.numel(), z.shape[-1], dtype=z.dtype, device=z.device)
    return pairs.index_copy_(0, order, out.to(z.dtype)).view(*ids.shape, z.shape[-1])


def stacked_experts(stack, experts, routed, counts):
    """`expert_e(rows)` for the rows `routed` [pairs, L], sorted by expert with `counts[e]` rows each, read from the
    block's `mxfp4.ExpertStack`: the per-expert loop's result from a few large ops instead of ~12 small ones per
    expert. Per chunk of the experts hit (at most `DEQUANT_CHUNK_BYTES` of dequantized weights): one dequantization
    of all their w1 and w3 packs and one of their w2 packs (after the first is used), each followed, where every
    expert has the same number of rows (a decode step), by a batched matmul over the chunk, else by a matmul per
    expert (and one SiTU-GLU call over all their rows). `experts` (the block's `KimiK3Experts`) gives the
    activation's constants."""
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
            act = experts.glu(rows.view(len(chunk), sizes[0], latent) @ w13.mT)
        else:
            act = experts.glu(torch.cat([x @ w13[i].mT for i, x in enumerate(rows.split(sizes))])).split(sizes)
        del w13  # before w2 is dequantized: the two are never held at once
        w2 = dequantize_unchecked(w2.flatten(0, 1), s2.flatten(0, 1), rows.dtype).view(len(chunk), latent, inner)
        out.append((act @ w2.mT).view(-1, latent) if uniform else torch.cat([a @ w2[i].mT for i, a in enumerate(act)]))
    if len(out) == 1:  # one chunk (all but very large batches): no copy
        return out[0]
    return torch.cat(out) if out else routed


def routed_expert_sum(moe, z, ids, weights, first):
    """A rank's share of `sum_k w_k expert_k(z)` under expert parallel, fp32 [N, 1, L]: the weighted sum over the
    (token, slot) pairs whose experts the block holds, experts `first` .. `first + moe.num_experts - 1` of the
    router's ids [N, k]; one all-reduce over the ranks completes it."""
    local = ids - first
    local = torch.where((local >= 0) & (local < moe.num_experts), local, moe.num_experts)
    pairs = routed_experts(moe, z, local)  # another rank's pairs: rows of zeros
    return (pairs.float() * weights.float().unsqueeze(-1)).sum(1, keepdim=True)


def pair_sum_norm(pairs, weights, norm, dtype):
    """`norm` of the per-(token, slot) expert outputs `pairs` [N, k, L] weighted by `weights` [N, k] in fp32 (None:
    `pairs` are weighted fp32 terms already) and summed over k, rounded to `dtype`: [N, L]."""
    terms = pairs.float() if weights is None else pairs.float() * weights.float().unsqueeze(-1)
    return norm(terms.sum(1).to(dtype))


class KimiK3LatentMoE(nn.Module):
    """LatentMoE: route on the full hidden state, run the chosen experts in a narrower latent space, sum, norm, lift.

    `out = up(norm(sum_k w_k expert_k(down(x)))) + shared_experts(x)`. Experts run only on the tokens routed to them.
    """

    def __init__(self, config, num_experts, packed, dispatch=None):
        super().__init__()
        self.num_experts = num_experts
        self.dispatch = dispatch or new_dispatch(config)
        self.gate = KimiK3Router(config, num_experts, self.dispatch)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
        self.experts = (KimiK3Experts(config, num_experts) if packed
                        else nn.ModuleList(KimiK3Expert(config) for _ in range(num_experts)))
        self.routed_expert_norm = (
            KimiK3RMSNorm(config.routed_expert_hidden_size, eps=config.rms_norm_eps)
            if config.latent_moe_use_norm
            else nn.Identity()
        )
        self.routed_expert_up_proj = nn.Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        self.shared_experts = KimiK3MLP(config, config.num_shared_experts * config.moe_intermediate_size,
                                        self.dispatch)
        self.expert_stack = None  # the `mxfp4.ExpertStack` of the MXFP4 experts' parameters; see stack_experts
        self.expert_parallel = None  # under tensor parallel, this rank's share of the experts (tensor_parallel.py)
        self.pairs_observer = None  # called with each forward's per-pair expert outputs (reap_tools' observer)

    def _expert_key(self):
        """Which parameters (the objects, which the stack keeps alive) and storage the stack was made of."""
        experts = self.experts
        return tuple((id(p), p.data_ptr()) for p in (experts.w1.weight_packed, experts.w3.weight_packed,
                                                     experts.w2.weight_packed))

    def stack_experts(self):
        """The `mxfp4.ExpertStack` the reference and the expert kernels read: the stacked parameters themselves (no
        copy) and their largest scale code, made again where the parameters were replaced or moved since
        (`load_state_dict(assign=True)`, `.to()`, accelerate's offload hooks). None for float experts and on the
        meta device."""
        experts = self.experts
        if not isinstance(experts, KimiK3Experts) or experts.w1.weight_packed.is_meta:
            self.expert_stack = None
        elif self.expert_stack is None or self.expert_stack.key != self._expert_key():
            self.expert_stack = stack_experts(experts)._replace(key=self._expert_key())
        return self.expert_stack

    def _apply(self, fn, *args, **kwargs):
        """`.to()` / `.cuda()` replace the stacks: their `ExpertStack` (which reads the largest scale code on the
        host) is made again now, never first inside a CUDA-graph capture."""
        super()._apply(fn, *args, **kwargs)
        self.stack_experts()
        return self

    def forward(self, x):
        ops = self.dispatch.ops(x.device, self.routed_expert_up_proj.weight.is_meta)
        if ops.paths.side_streams:
            return moe_side_by_side(self, x, ops)
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate(flat)
        y = self.latent_experts(self.routed_expert_down_proj(flat), ids, weights, ops)
        return (y + self.shared_experts(flat)).view(x.shape)

    def latent_experts(self, z, ids, weights, ops):
        """The routed half in the latent space: `up(norm(sum_k w_k expert_k(z)))` for the latents z [N, L]. Under
        expert parallel this rank sums its experts' weighted pairs and one all-reduce completes the sum."""
        ep = self.expert_parallel
        if ep is None:
            pairs = ops.routed_experts(self, z, ids)
            if self.pairs_observer is not None:
                self.pairs_observer(pairs)
        else:
            pairs, weights = ep.all_reduce(ops.routed_expert_sum(self, z, ids, weights, ep.first)), None
        return self.routed_expert_up_proj(ops.pair_sum_norm(pairs, weights, self.routed_expert_norm, z.dtype))


# The reference of every op a block calls through its dispatch (`kimi_k3_dispatch.Ops`): what runs where no fast
# path is taken, and what each kernel is a drop-in for.
REFERENCE_OPS = Ops(
    paths=FastPaths(), situ_glu=situ_glu, attn_res_mix=attn_res_mix, add_attn_res_mix=add_attn_res_mix,
    short_convs=short_convs, delta_rule=kda_forward, kda_decode_step=kda_decode_step,
    gated_rms_norm=gated_rms_norm, mla_keys=mla_keys, sigmoid_gated_heads=sigmoid_gated_heads,
    latent_keys=latent_keys, latent_attention=latent_attention, router_logits=router_logits, router_topk=router_topk,
    routed_experts=routed_experts, routed_expert_sum=routed_expert_sum, pair_sum_norm=pair_sum_norm,
)


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
        self.dispatch = dispatch = dispatch or new_dispatch(config)
        self.opens_block = layer_idx % config.attn_res_block_size == 0
        self.closes_block = (layer_idx + 1) % config.attn_res_block_size == 0
        self.bank_rows = -(-config.num_hidden_layers // config.attn_res_block_size)  # the openings of the model
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
            self.mlp = KimiK3MLP(config, config.intermediate_size, dispatch)

    def forward(self, bank, partial, attention_mask=None, cache=None, positions=None):
        """attention_mask: [B, keys] over cached and new tokens, or None; positions: [T] absolute positions of the
        new tokens (default: right after the cached ones)."""
        if positions is None:
            positions = next_positions(cache, partial.shape[1], partial.device)
        ops = self.dispatch.ops(partial.device, self.input_layernorm.weight.is_meta)
        bank = BlockBank.of(bank)
        delta = isinstance(self.self_attn, KimiK3DeltaAttention)
        # KDA's padding tokens read zeros: the mix writes them (the fused kernel reads the mask, no extra launches)
        padding = (attention_mask, positions) if delta and attention_mask is not None else ()
        h = ops.attn_res_mix(bank, partial, self.self_attention_res_norm, self.self_attention_res_proj,
                             self.input_layernorm, *padding)
        if self.opens_block:
            bank, partial = bank.opened(partial, self.bank_rows), None
        if delta:
            a = self.self_attn(h, None, cache)
        else:
            a = self.self_attn(h, attention_mask, cache, positions)
        if partial is None:
            partial = a
            h = ops.attn_res_mix(bank, partial, self.mlp_res_norm, self.mlp_res_proj, self.post_attention_layernorm)
        else:
            partial, h = ops.add_attn_res_mix(bank, partial, a, self.mlp_res_norm, self.mlp_res_proj,
                                              self.post_attention_layernorm)
        ffn = self.block_sparse_moe(h) if hasattr(self, "block_sparse_moe") else self.mlp(h)
        return bank, bank.close(partial, ffn) if self.closes_block else partial + ffn


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class KimiK3TextModel(nn.Module):
    """Embeddings, decoder layers, the output depth mix and final norm (the release's `language_model.model`)."""

    # Prompts longer than this run through the cache this many tokens at a time (the same outputs, activation memory
    # bounded by the chunk); None: in one piece. Set on the instance to change it.
    prefill_chunk_size = 8192

    def __init__(self, config, packed_experts, dispatch=None):
        super().__init__()
        self.config = config
        self.dispatch = dispatch = dispatch or new_dispatch(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KimiK3DecoderLayer(config, i, packed_experts, dispatch) for i in range(config.num_hidden_layers)
        )
        self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_attn_res_proj = KimiK3AttnResProj(config.hidden_size)
        self.norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)

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
            check_mask(attention_mask, length)
            positions = next_positions(None, length, device)
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
            cache.advance(length)
        return hidden, cache

    def output_mix(self, bank, partial):
        """The last depth mix over every block and the final norm: the decoder's output hidden states."""
        bank = BlockBank.of(tuple(s.to(partial.device) for s in bank))
        ops = self.dispatch.ops(partial.device, self.norm.weight.is_meta)
        return ops.attn_res_mix(bank, partial, self.output_attn_res_norm, self.output_attn_res_proj, self.norm)


class KimiK3LanguageModel(nn.Module):
    """The release's `language_model.` subtree: the decoder `model` and, for the causal LM, `lm_head`."""

    def __init__(self, config, with_head):
        super().__init__()
        text = config.text_config
        self.model = KimiK3TextModel(text, config.experts_packed, new_dispatch(config))
        if with_head:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


class KimiK3PreTrainedModel(PreTrainedModel):
    """Weight init, loading rules and generation hooks shared by `KimiK3Model` and `KimiK3ForCausalLM`.

    Loading is strict: a missing, unexpected or mis-shaped checkpoint tensor is an error naming it, and local
    safetensors files are checked (header, size) before transformers reads them (`kimi_k3_loading`).
    """

    config_class = KimiK3Config
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiK3DecoderLayer"]
    _keep_in_fp32_modules = ["A_log", "dt_bias", "e_score_correction_bias"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _keys_to_ignore_on_load_unexpected = list(VISION_KEYS)

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
        elif isinstance(module, MXFP4Linear) and not module.weight_packed.is_meta:
            module.pack_(torch.randn(*module.weight_packed.shape[:-1], module.in_features) * std)
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
        """Stack every MoE block's MXFP4 experts (`KimiK3LatentMoE.stack_experts`): done at construction and load."""
        for module in self.modules():
            if isinstance(module, KimiK3LatentMoE):
                module.stack_experts()

    def merge_projections(self):
        """Give each block's projections of one input one weight buffer (`MergedProjections`): done at load."""
        merge_block_projections(self)

    @property
    def dispatch(self):
        """The model's `FastPathDispatch`, which every block shares."""
        return self.language_model.model.dispatch

    @classmethod
    def _supports_default_dynamic_cache(cls):
        """The hybrid KDA/MLA state is not a DynamicCache; the model makes its own `KimiK3Cache`."""
        return False

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.model.embed_tokens = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, fast_paths=None, **kwargs):
        """The model from a local folder or the Hub, built once and read straight from the shards
        (`kimi_k3_loading.load_model`; under `tp_plan="auto"` this rank's shard, `tensor_parallel`), checked strictly
        first. `device_map`, `dtype`, `max_memory` and `offload_folder` work as in transformers. `fast_paths`
        ({"experts": "off", ...}: "auto" / "on" / "off" per path) chooses the implementations, resolved and logged
        once per device; an "on" path that cannot run here is an error. It is not written to the config."""
        if kwargs.get("tp_plan") is not None:  # under torchrun: this rank's shard only (tensor_parallel.py)
            return load_tensor_parallel(cls, pretrained_model_name_or_path, *args, fast_paths=fast_paths, **kwargs)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = load_model(cls, pretrained_model_name_or_path, args, kwargs, fast_paths)
        model.stack_experts()
        model.merge_projections()  # after accelerate's offload (if any), whose blocks keep theirs apart
        check_loaded_scales(model, pretrained_model_name_or_path)
        for device in {p.device for p in model.parameters()} - {torch.device("meta")}:
            model.dispatch.resolved(device)  # resolve (and log) the fast paths once per device
        return (model, info) if wants_info else model

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        """transformers' `save_pretrained`, in the release's layout: one tensor per routed expert
        (`kimi_k3_loading.release_state_dict`)."""
        state_dict = release_state_dict(self.state_dict() if state_dict is None else state_dict)
        return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)


class KimiK3Model(KimiK3PreTrainedModel):
    """The bare decoder (AutoModel): last hidden states, no LM head."""

    _keys_to_ignore_on_load_unexpected = [*VISION_KEYS, r"^language_model\.lm_head\."]

    def __init__(self, config):
        super().__init__(config)
        self.language_model = KimiK3LanguageModel(config, with_head=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, use_cache=None,
                return_dict=True, past_key_values=None, **kwargs):
        cache = given_cache(cache, past_key_values, kwargs)
        _reject_unsupported_outputs(kwargs)
        hidden, cache = self.language_model.model(input_ids, inputs_embeds, attention_mask, cache, bool(use_cache))
        return output_with_cache(BaseModelOutputWithPast, cache, last_hidden_state=hidden)


# The chat template's options that `KimiK3ForCausalLM.generate` takes (tokenization_kimi_k3.THINKING_OPTIONS).
_THINKING_OPTIONS = ("thinking", "enable_thinking", "thinking_effort", "reasoning_effort")


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

    def set_output_embeddings(self, value):
        self.language_model.lm_head = value

    def make_static_cache(self, batch_size, max_length, cuda_graph=True):
        """A `KimiK3StaticCache` for `generate(..., cache=cache)`: preallocated for `max_length` tokens (prompt +
        new) of `batch_size` rows; each one-token step is then replayed from CUDA graphs (one per GPU the model
        spans, where the `cuda_graphs` path is on)."""
        return KimiK3StaticCache(self.config, batch_size, max_length, cuda_graph)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """Assisted generation and prompt lookup (and this model's own `generate` as someone's assistant) roll the
        cache back past rejected draft tokens: they get a `KimiK3Cache` up front (transformers 5.x asks for one)
        that records what a rollback needs (`activate_past_recording`), wide enough for the draft size asked for."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        if generation_mode != GenerationMode.ASSISTED_GENERATION and not getattr(generation_config, "is_assistant",
                                                                                  False):
            return
        given = [model_kwargs.pop(k) for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None]
        cache = given[0] if given else None
        if cache is None and generation_config.use_cache is not False:
            cache = KimiK3Cache(self.config)
        if cache is not None:  # under the keyword the installed transformers' assisted decoding reads it from
            model_kwargs[generation_cache_key()] = cache
            drafts = (generation_config.prompt_lookup_num_tokens, generation_config.num_assistant_tokens)
            cache.activate_past_recording(recurrent_states_to_keep=max(int(d or 0) for d in drafts) + 1)

    def generate(self, *args, chat_template_kwargs=None, **kwargs):
        """`GenerationMixin.generate`, also taking the chat template's thinking options (`thinking=False`,
        `thinking_effort=...`, or transformers' `chat_template_kwargs={...}`).

        transformers' text-generation pipeline renders a chat with the template's defaults and hands any other
        keyword to generate, so `pipe(messages, thinking=False)` arrives here. The model then generates from the
        prompt re-rendered with them (`KimiK3Tokenizer.rerender_prompt`); the returned sequences are the prompt as
        given, the bridge (an empty think channel when thinking turns off) and the reply, so that the pipeline
        finds the reply where it cuts it and parses it as the prompt it holds says.
        """
        options = {name: kwargs.pop(name) for name in _THINKING_OPTIONS if name in kwargs}
        options.update(chat_template_kwargs or {})
        if not options:
            return super().generate(*args, **kwargs)
        if args:
            kwargs["inputs"], args = args[0], args[1:]
        key = "input_ids" if kwargs.get("input_ids") is not None else "inputs"
        prompts = kwargs.get(key)
        if not torch.is_tensor(prompts) or prompts.dim() != 2:
            raise ValueError(f"chat options {sorted(options)} need the chat prompt's ids as input_ids")
        mask = kwargs.get("attention_mask")
        tokenizer = self._chat_tokenizer()
        rendered, bridges = zip(*(tokenizer.rerender_prompt(row[mask[i].bool()] if mask is not None else row,
                                                            **options) for i, row in enumerate(prompts)))
        width, pad = max(map(len, rendered)), tokenizer.pad_token_id
        kwargs[key] = torch.tensor([[pad] * (width - len(r)) + r for r in rendered], device=prompts.device)
        kwargs["attention_mask"] = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rendered],
                                                device=prompts.device)
        out = super().generate(*args, **kwargs)
        sequences = out if torch.is_tensor(out) else out.sequences
        rows = sequences.shape[0] // prompts.shape[0]  # num_return_sequences
        given = prompts.repeat_interleave(rows, dim=0)
        bridge = torch.tensor(bridges, dtype=sequences.dtype, device=sequences.device)  # [rows, bridge length]
        whole = torch.cat([given, bridge.repeat_interleave(rows, dim=0), sequences[:, width:]], dim=1)
        if torch.is_tensor(out):
            return whole
        out.sequences = whole
        return out

    def _chat_tokenizer(self):
        """The checkpoint's own tokenizer, loaded once, for `generate`'s chat options (the model was loaded with its
        remote code, so the tokenizer's comes from the same place)."""
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            if not self.name_or_path:
                raise ValueError("chat options given to generate need the model's checkpoint folder to load its "
                                 "tokenizer; pass them to the template instead (tokenizer_encode_kwargs=...)")
            self._tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, trust_remote_code=True)
        return self._tokenizer

    def decode_stages(self):
        """A one-token decode step as [(device, stage, offloaded)] for the decode graph (`kimi_k3_runners`): each
        stage maps a tuple of tensors (the token ids; then the block bank and the partial sum; the hidden states;
        the logits) to the next, given the mask over every key, the new token's position (both on the stage's
        device) and the cache."""
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
        return [(execution_device(m), stage, any(p.is_meta for p in m.parameters())) for m, stage in modules]

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, return_dict=True, past_key_values=None, **kwargs):
        cache = given_cache(cache, past_key_values, kwargs)
        _reject_unsupported_outputs(kwargs)
        one_step = cache is not None and input_ids is not None and input_ids.shape[1] == 1 and (
            cache.get_seq_length() > 0)
        runner = cache.decode_runner(self) if one_step else None
        if runner is not None:
            logits = runner(cache, input_ids, attention_mask)  # CUDA-graph replays once warm
        else:
            hidden, cache = self.language_model.model(input_ids, inputs_embeds, attention_mask, cache, bool(use_cache))
            logits = self.language_model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            if attention_mask is not None:
                shifted = shifted.masked_fill(~attention_mask[:, 1:].bool().to(logits.device), -100)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), shifted.flatten(), ignore_index=-100)
        return output_with_cache(CausalLMOutputWithPast, cache, loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, inputs_embeds=None,
                                      use_cache=True, logits_to_keep=None, past_key_values=None, **kwargs):
        """Feed only the tokens the cache has not seen; prompt embeddings only on the first step."""
        cache = given_cache(cache, past_key_values, kwargs)
        seen = cache.get_seq_length() if cache is not None else 0
        if inputs_embeds is not None and seen == 0:
            inputs = {"inputs_embeds": inputs_embeds}
        else:
            inputs = {"input_ids": input_ids[:, seen:]}
        inputs.update(attention_mask=attention_mask, cache=cache, use_cache=use_cache)
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs


__all__ = ["KimiK3Model", "KimiK3ForCausalLM", "KimiK3PreTrainedModel", "KimiK3Cache", "KimiK3StaticCache",
           "use_fast_paths"]
