"""Fast-path dispatch: which implementation each block of the model calls, resolved once per device.

Every block calls its small ops through an `Ops` table. Its fields are named after reference functions of the model
(pure torch, in `modeling_kimi_k3` and `kda`), and each field holds either that reference or a kernel with the same
inputs and outputs (`fused_triton`, `mxfp4_triton`, fla-core through `kda.kda_forward`). `FastPathDispatch.ops(device)`
resolves the table once per device from the requested `fast_paths` ("auto" / "on" / "off" per path, see
`configuration_kimi_k3.FAST_PATH_DEFAULTS`): "auto" takes a kernel where it can run on that device and for the
config's shapes, "on" requires it (an error at load naming the path and the config field), "off" takes the reference.
So no call site tests whether a kernel ran: what the table holds is what runs.
"""

import contextlib
import dataclasses
import functools
import os

import torch
from transformers.utils import logging

try:
    from .configuration_kimi_k3 import check_fast_paths
    from .fused_triton import MAX_ROW_WIDTH, supported as fused_supported
    from .fused_triton import attn_res_mix as triton_attn_res_mix, gated_rms_norm as triton_gated_rms_norm
    from .fused_triton import latent_attention as triton_latent_attention, latent_keys as triton_latent_keys
    from .fused_triton import mla_keys as triton_mla_keys
    from .fused_triton import pair_sum_norm as triton_pair_sum_norm, router_topk as triton_router_topk
    from .fused_triton import short_conv as triton_short_conv, sigmoid_gated_heads as triton_sigmoid_gated_heads
    from .fused_triton import MAX_KDA_HEAD_DIM, kda_decode_step as triton_kda_decode_step
    from .kda import kda_forward, supported as fla_supported
    from .mxfp4_triton import (routed_expert_sum as triton_routed_expert_sum, routed_experts as triton_routed_experts,
                               situ_glu as triton_situ_glu)
    from .mxfp4_triton import supported as experts_supported
except ImportError:  # imported from the repository root rather than as transformers remote code
    from configuration_kimi_k3 import check_fast_paths
    from fused_triton import MAX_ROW_WIDTH, supported as fused_supported
    from fused_triton import attn_res_mix as triton_attn_res_mix, gated_rms_norm as triton_gated_rms_norm
    from fused_triton import latent_attention as triton_latent_attention, latent_keys as triton_latent_keys
    from fused_triton import mla_keys as triton_mla_keys
    from fused_triton import pair_sum_norm as triton_pair_sum_norm, router_topk as triton_router_topk
    from fused_triton import short_conv as triton_short_conv, sigmoid_gated_heads as triton_sigmoid_gated_heads
    from fused_triton import MAX_KDA_HEAD_DIM, kda_decode_step as triton_kda_decode_step
    from kda import kda_forward, supported as fla_supported
    from mxfp4_triton import (routed_expert_sum as triton_routed_expert_sum, routed_experts as triton_routed_experts,
                              situ_glu as triton_situ_glu)
    from mxfp4_triton import supported as experts_supported

logger = logging.get_logger("transformers.kimi_k3")


@dataclasses.dataclass(frozen=True)
class FastPaths:
    """Which optional implementation the blocks on one device take (True) instead of their reference (False). The
    default, all False, is the pure-torch reference."""

    experts: bool = False
    kda: bool = False
    kda_prefill: bool = False
    fused: bool = False
    side_streams: bool = False
    cuda_graphs: bool = False
    merged_projections: bool = False

    def __str__(self):
        return ", ".join(f"{f.name}={'on' if getattr(self, f.name) else 'off'}" for f in dataclasses.fields(self))

    def with_backward(self):
        """The paths that autograd can differentiate: fla's chunked KDA kernel (where either KDA path is on) and
        the references. The other kernels, side streams and graphs have no backward; taken while autograd records,
        they would silently cut the gradient to everything before them."""
        return FastPaths(kda_prefill=self.kda or self.kda_prefill)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The functions the blocks call for one device: each field is the reference function of that name or a kernel
    that is a drop-in for it. `paths` are the fast paths they were resolved from."""

    paths: FastPaths
    situ_glu: callable
    attn_res_mix: callable
    add_attn_res_mix: callable
    short_convs: callable
    delta_rule: callable
    kda_decode_step: callable
    gated_rms_norm: callable
    mla_keys: callable
    latent_keys: callable
    sigmoid_gated_heads: callable
    latent_attention: callable
    router_logits: callable
    router_topk: callable
    routed_experts: callable
    routed_expert_sum: callable
    pair_sum_norm: callable


def _power_of_two(n):
    return n > 0 and not n & (n - 1)


def _text(config):
    return getattr(config, "text_config", config)


def _experts_packed(config):
    return getattr(config, "experts_packed", True)


def shape_limits(config):
    """The shapes each kernel can run, checked against the config at resolve time: [(path, op, config field, its
    value, whether the kernel takes it, what it needs)]. (MXFP4 experts' sizes are multiples of 32, which the
    expert kernels need, by the config's own check.)"""
    text = _text(config)
    lac = text.linear_attn_config
    widest = MAX_ROW_WIDTH
    return [
        ("fused", "attn_res_mix", "hidden_size", text.hidden_size, text.hidden_size <= widest, f"<= {widest}"),
        ("fused", "pair_sum_norm", "routed_expert_hidden_size", text.routed_expert_hidden_size,
         text.routed_expert_hidden_size <= widest, f"<= {widest}"),
        ("fused", "latent_keys", "kv_lora_rank + qk_rope_head_dim", text.kv_lora_rank + text.qk_rope_head_dim,
         text.kv_lora_rank + text.qk_rope_head_dim <= widest, f"<= {widest}"),
        ("fused", "gated_rms_norm", "linear_attn_config.head_dim", lac["head_dim"], _power_of_two(lac["head_dim"]),
         "a power of two"),
        ("fused", "kda_decode_step", "linear_attn_config.head_dim", lac["head_dim"],
         _power_of_two(lac["head_dim"]) and lac["head_dim"] <= MAX_KDA_HEAD_DIM,
         f"a power of two up to {MAX_KDA_HEAD_DIM}"),
        ("fused", "router_topk", "num_experts_per_token", text.num_experts_per_token,
         _power_of_two(text.num_experts_per_token), "a power of two"),
        ("experts", "routed_experts", "quantization_config", "packed" if _experts_packed(config) else "float",
         _experts_packed(config), "MXFP4-packed experts"),
    ]


def check_shapes(requested, config):
    """Raise where a path requested "on" has a kernel that cannot run the config's shapes, naming the path, the
    kernel and the config field; returns the ops that fall back to their reference under "auto"."""
    choices = check_fast_paths(requested)
    skipped = set()
    for path, op, field, value, fits, needs in shape_limits(config):
        if fits or choices[path] == "off":
            continue
        if choices[path] == "on":
            raise ValueError(f"fast_paths[{path!r}] is 'on', but its kernel for {op} cannot run {field} = {value} "
                             f"(needs {needs})")
        skipped.add(op)
    return skipped


def _device_unsupported(path, device):
    """Why `path` cannot run for tensors on `device`, or None where it can."""
    if path == "experts":
        return None if experts_supported(device) else "needs triton and a CUDA device"
    if path == "fused":
        return None if fused_supported(device) else "needs triton and a CUDA device (or Triton's CPU interpreter)"
    if path in ("kda", "kda_prefill"):
        return None if fla_supported(device) else "needs fla-core and a CUDA device"
    if path == "merged_projections":
        return None
    return None if device.type == "cuda" else "needs a CUDA device"


def _taken_by_auto(path, device):
    """Whether "auto" takes a path that can run on `device`: every path, but the merged projections on CUDA only,
    where one matmul instead of several pays (a decode step is bound by its launches); on the CPU the separate
    matmuls stay, the reference that tests compare with (an fp32 matmul of several rows may round differently)."""
    return path != "merged_projections" or device.type == "cuda"


def requested_with_environment(requested):
    """`requested` with `KIMI_K3_FAST_PATHS` ("kda=off,fused=on") on top, for benchmarks; the one place it is read."""
    choices = dict(requested or {})
    for item in filter(None, os.environ.get("KIMI_K3_FAST_PATHS", "").split(",")):
        path, _, choice = item.partition("=")
        choices[path.strip()] = choice.strip()
    return check_fast_paths(choices)


def resolve_fast_paths(requested, device):
    """The `FastPaths` for tensors on `device`: "auto" takes a path where it can run there (`_taken_by_auto`), "on"
    requires it (an error naming the path and why not), "off" takes the reference."""
    device = torch.device(device)
    chosen = {}
    for path, choice in requested_with_environment(requested).items():
        why = _device_unsupported(path, device) if choice != "off" else None
        if choice == "on" and why:
            raise ValueError(f"fast_paths[{path!r}] is 'on', but it {why} (tensors on {device})")
        chosen[path] = why is None and (choice == "on" or choice == "auto" and _taken_by_auto(path, device))
    return FastPaths(**chosen)


def on_input_device(kernel):
    """`kernel` run under the CUDA device of its first tensor argument.

    Triton and fla kernels launch on the *current* CUDA device, not their tensors' one; with a model spread over
    GPUs by `device_map`, accelerate's hooks move a layer's inputs to its GPU but leave the current device at cuda:0,
    so an unguarded launch would read another GPU's memory. Every kernel entry of an `Ops` table is wrapped here."""

    @functools.wraps(kernel)
    def launch(*args, **kwargs):
        device = next((t.device for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
                       if isinstance(t, torch.Tensor)), None)
        if device is None or device.type != "cuda":
            return kernel(*args, **kwargs)
        with torch.cuda.device(device):
            return kernel(*args, **kwargs)

    return launch


# ----------------------------------------------------------------------------------------------------------------
# The kernels, each under the signature of the reference function it stands in for
# ----------------------------------------------------------------------------------------------------------------


def fused_attn_res_mix(bank, partial, norm, proj, out_norm, key_mask=None, positions=None):
    """`modeling_kimi_k3.attn_res_mix` as one kernel over the stacked bank (`fused_triton.attn_res_mix`), the
    padding tokens' rows zeroed in it."""
    if not bank:
        out = out_norm(partial)
        return out if key_mask is None else out.masked_fill(~key_mask[:, positions].bool()[..., None], 0.0)
    stacked = bank.stacked() if hasattr(bank, "stacked") else torch.stack(tuple(bank))
    return triton_attn_res_mix(stacked, partial, norm.weight, proj.weight[0], norm.variance_epsilon, out_norm.weight,
                               out_norm.variance_epsilon, key_mask, positions)


def fused_add_attn_res_mix(bank, partial, delta, norm, proj, out_norm):
    """`modeling_kimi_k3.add_attn_res_mix` as the one depth-mix kernel, which adds `delta` to the partial sum as it
    reads it and writes the sum out."""
    if not bank:
        partial = partial + delta
        return partial, out_norm(partial)
    stacked = bank.stacked() if hasattr(bank, "stacked") else torch.stack(tuple(bank))
    return triton_attn_res_mix(stacked, partial, norm.weight, proj.weight[0], norm.variance_epsilon, out_norm.weight,
                               out_norm.variance_epsilon, delta=delta)


def fused_short_convs(projected, convs, conv_states, in_place, out_dtype=None):
    """`modeling_kimi_k3.short_convs` as one kernel a conv (`fused_triton.short_conv`); `in_place` overwrites the
    given histories (a static cache's buffers), `out_dtype` is the dtype of the outputs."""
    return triton_short_conv(projected, [c.weight for c in convs], conv_states, in_place, out_dtype)


def fused_kda_decode_step(projected, convs, conv_states, g_raw, beta_raw, gate_logits, A_log, dt_bias, lower_bound,
                          scale, state, norm, dtype, in_place=False):
    """`modeling_kimi_k3.kda_decode_step` as one kernel (`fused_triton.kda_decode_step`): the short convs, the
    delta rule (in place of fla's recurrent kernel, whatever the `kda` path says) and the gated norm."""
    return triton_kda_decode_step(projected, [c.weight for c in convs], conv_states, g_raw, beta_raw, gate_logits,
                                  A_log, dt_bias, lower_bound, scale, state, norm.weight, norm.variance_epsilon,
                                  dtype, in_place)


def fused_gated_rms_norm(o, gate_logits, norm, dtype):
    """`modeling_kimi_k3.gated_rms_norm` as one kernel (`fused_triton.gated_rms_norm`)."""
    return triton_gated_rms_norm(o, gate_logits, norm.weight, norm.variance_epsilon, dtype)


def fused_latent_keys(kv, norm, latent_width, buffer, positions):
    """`modeling_kimi_k3.latent_keys` into a static cache's buffer as one kernel (`fused_triton.latent_keys`: the
    norm, the concatenation and the write)."""
    return triton_latent_keys(kv, norm.weight, norm.variance_epsilon, latent_width, buffer, positions)


def fused_latent_attention(q_latent, q_rope, latent, positions, key_mask, scale):
    """`modeling_kimi_k3.latent_attention` for one query a row (`fused_triton.latent_attention`): one pass over the
    keys up to the query's position, which it reads from device memory."""
    return triton_latent_attention(q_latent[:, :, 0], q_rope[:, :, 0], latent, positions[:1], key_mask,
                                   scale).unsqueeze(2)


def fused_pair_sum_norm(pairs, weights, norm, dtype):
    """`modeling_kimi_k3.pair_sum_norm` as one kernel (`fused_triton.pair_sum_norm`)."""
    weight, eps = (norm.weight, norm.variance_epsilon) if hasattr(norm, "variance_epsilon") else (None, 0.0)
    return triton_pair_sum_norm(pairs, weights, weight, eps, dtype)


def fp32_router_logits(x, weight):
    """`modeling_kimi_k3.router_logits` straight from the stored dtype: the same fp32 products and sums, without an
    fp32 copy of the weight a call."""
    if not x.is_cuda or x.dtype != weight.dtype or weight.dtype == torch.float32:
        return torch.nn.functional.linear(x.float(), weight.float())
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


def fla_delta_rule(chunked, recurrent):
    """`kda.kda_forward` on fla-core's chunked kernel for prompts (`chunked`) and its recurrent kernel for the rest
    (`recurrent`), the reference where neither is taken."""

    def delta_rule(q, *args, **kwargs):
        kernel = "chunk" if chunked and q.shape[1] > 1 else "recurrent" if recurrent else None
        return kda_forward(q, *args, kernel=kernel, **kwargs)

    return delta_rule


def resolve_ops(paths, reference, skipped=()):
    """The `Ops` of `paths`: `reference` (the table of reference functions) with each entry whose path is on and
    whose kernel fits the config (not in `skipped`) replaced by that kernel."""
    kernels = {}
    if paths.fused:
        kernels.update(situ_glu=triton_situ_glu, attn_res_mix=fused_attn_res_mix,
                       add_attn_res_mix=fused_add_attn_res_mix, short_convs=fused_short_convs,
                       kda_decode_step=fused_kda_decode_step,
                       gated_rms_norm=fused_gated_rms_norm, mla_keys=triton_mla_keys,
                       sigmoid_gated_heads=triton_sigmoid_gated_heads, latent_attention=fused_latent_attention,
                       latent_keys=fused_latent_keys,
                       router_logits=fp32_router_logits, router_topk=triton_router_topk,
                       pair_sum_norm=fused_pair_sum_norm)
    if paths.experts:
        kernels.update(routed_experts=triton_routed_experts, routed_expert_sum=triton_routed_expert_sum)
    kernels = {name: on_input_device(fn) for name, fn in kernels.items() if name not in skipped}
    if paths.kda or paths.kda_prefill:
        kernels["delta_rule"] = on_input_device(fla_delta_rule(paths.kda_prefill, paths.kda))
    table = dataclasses.replace(reference, paths=paths, **kernels)
    if "kda_decode_step" in kernels:
        return table
    # without its one kernel a KDA decode step is the table's own short convs, delta rule and gated norm
    return dataclasses.replace(table, kda_decode_step=functools.partial(reference.kda_decode_step, parts=table))


class FastPathDispatch:
    """The fast paths of one model's blocks, shared by all of them: `ops(device)` resolves the table once per device
    (logged in one line), and again after the request changes.

    The request is, from the bottom up: the config's `fast_paths` where a user saved them there, the load-time
    keyword (`from_pretrained(..., fast_paths={...})`, set by `request`), and `use_fast_paths`' overrides."""

    def __init__(self, reference, config):
        self.reference, self.config = reference, config
        self.at_load = {}
        self.overrides = {}
        self._requested = None
        self._skipped = set()
        self._resolved = {}

    def request(self, fast_paths):
        """Take `fast_paths` (a partial dict) as the load-time choice; an "on" path whose kernel cannot run the
        config's shapes is an error here (`refresh` checks the whole request)."""
        self.at_load = dict(fast_paths or {})
        self.refresh()

    def set(self, **choices):
        """Override some paths ("auto" / "on" / "off", or True / False) from now on."""
        self.overrides.update(choices)
        self.refresh()

    def refresh(self):
        """Re-read the request (the config's `fast_paths` may have been edited); read once per model call."""
        requested = {**(getattr(self.config, "fast_paths", None) or {}), **self.at_load, **self.overrides}
        if requested != self._requested:
            self._skipped = check_shapes(requested_with_environment(requested), self.config)
            self._requested, self._resolved = requested, {}

    def resolved(self, device):
        """The `Ops` for tensors on `device`."""
        ops = self._resolved.get(device)
        if ops is None:
            if self._requested is None:
                self.refresh()
            paths = resolve_fast_paths(self._requested, device)
            ops = self._resolved[device] = resolve_ops(paths, self.reference, self._skipped)
            skipped = f" (reference for {', '.join(sorted(self._skipped))}: shapes)" if self._skipped else ""
            logger.info(f"Kimi K3 fast paths on {device}: {paths}{skipped}")
        return ops

    def ops(self, device, offloaded=False):
        """What a block calls for tensors on `device`: the resolved table, or while autograd records (training) only
        its kernels with a backward; the reference for a block whose weights accelerate offloads (its hooks load a
        module's weights only for that module's own forward, which a kernel bypasses)."""
        if offloaded:
            return self.reference
        ops = self.resolved(device)
        if not torch.is_grad_enabled() or ops.paths == ops.paths.with_backward():
            return ops
        key = (device, "backward")
        if key not in self._resolved:
            self._resolved[key] = resolve_ops(ops.paths.with_backward(), self.reference)
        return self._resolved[key]


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
