"""Tensor + expert parallel Kimi K3 under torchrun: `from_pretrained(DIR, trust_remote_code=True, tp_plan="auto")`.

Every rank of a `torchrun --nproc-per-node N` job builds the model on the meta device, shards it with the plan below
(the module attributes such as `num_heads` become the rank's own counts) and reads only its own byte ranges from the
safetensors shards (`kimi_k3_loading.read_tensors`); the routed experts stay MXFP4-packed. The plan:

  * KDA and MLA split by heads (N divides both head counts): KDA's q/k/v projections and short convs, its gates
    (`f_b_proj`, `b_proj`, `g_proj`), `A_log` and `dt_bias` follow their heads; MLA's `q_b_proj`, `kv_b_proj` and
    `g_proj` too, while its low-rank `q_a_proj` / `kv_a_proj_with_mqa` and their norms stay whole, so the latent
    cache (per token, no heads) stays whole and KDA's recurrent state holds only the rank's heads;
  * `o_proj` split by its input columns, its partial outputs summed by one all-reduce;
  * routed experts by expert parallel: E / N consecutive experts a rank, the router replicated; each rank sums its
    experts' share of the (token, slot) pairs, weighted, in fp32 (`routed_expert_sum`: the expert kernels read the
    router's ids as they are) and one all-reduce completes the sum before `routed_expert_norm`;
  * the dense layer-0 MLP and the shared experts split by their intermediate size (gate/up by rows, down by
    columns + all-reduce);
  * the embedding and the LM head split by vocabulary (the logits whole on every rank);
  * Block Attention Residuals, every norm, the router and the latent down/up projections replicated.

All communication is `all_reduce` below, a plain `torch.distributed.all_reduce` (gloo on CPU, NCCL on GPU, where a
CUDA graph captures it), called from forward hooks and from the LatentMoE block's expert-parallel sum; the
reference blocks stay single-device math. The model's own load-time sharding serves every module (not
transformers' tensor-parallel styles, whose internals differ between 4.57 and 5.x and which cannot shard the
packed experts or the short convs); the README says more.
"""

import dataclasses
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from .kimi_k3_loading import (build_on_meta, check_checkpoint, check_loaded_scales, checkpoint_directory,
                                  load_generation_config, materialize, pieces_for, pop_load_kwargs,
                                  read_safetensors_headers, read_tensors, resolve_dtype)
except ImportError:  # imported from the repository root rather than as transformers remote code
    from kimi_k3_loading import (build_on_meta, check_checkpoint, check_loaded_scales, checkpoint_directory,
                                 load_generation_config, materialize, pieces_for, pop_load_kwargs,
                                 read_safetensors_headers, read_tensors, resolve_dtype)


def all_reduce(x, group=None):
    """Sum `x` over the ranks of `group`, in place: the one collective of a tensor-parallel forward."""
    dist.all_reduce(x, group=group)
    return x


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int
    group: object = None  # None: the default (world) group

    def share(self, n):
        """This rank's [start, stop) of n items split evenly."""
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step


class ExpertParallel:
    """This rank's routed experts of one LatentMoE block: global ids `first` .. `first + count - 1`."""

    def __init__(self, first, count, tp):
        self.first, self.count, self.tp = first, count, tp

    def all_reduce(self, partial):
        """The ranks' partial weighted latent sums (`routed_expert_sum`), summed in place."""
        return all_reduce(partial, self.tp.group)


class VocabParallelEmbedding(nn.Embedding):
    """Rows `first` .. `first + num_embeddings - 1` of the token embedding; ids of other ranks' rows look up zeros,
    and one all-reduce gives every rank the whole embedding (one rank contributes each row, so the sum is exact)."""

    def __init__(self, first, rows, tp):
        """`rows`: this rank's rows of the whole embedding's weight (on the meta device for a load)."""
        super().__init__(*rows.shape, _weight=rows, _freeze=True)
        self.first, self.tp = first, tp

    def forward(self, ids):
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return all_reduce(out, self.tp.group)

    def extra_repr(self):
        return f"{super().extra_repr()}, first={self.first}"


def _sum_output(group, module, args, output):
    """Forward hook of a projection split by its input columns: its partial outputs summed over the ranks."""
    return all_reduce(output, group)


def _gather_vocab(group, vocab, first, module, args, output):
    """Forward hook of the vocabulary-split LM head: this rank's logits in their place among zeros, summed over the
    ranks (exact: one rank writes each column), so every rank gets the whole logits."""
    full = output.new_zeros(*output.shape[:-1], vocab)
    full[..., first : first + output.shape[-1]] = output
    return all_reduce(full, group)


# ----------------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------------


def check_tp_size(text, size):
    """A clear error naming the first config field that `size` ranks cannot split evenly."""
    fields = {}
    if "mla" in text.layer_types:
        fields["num_attention_heads"] = text.num_attention_heads
    if "kda" in text.layer_types:
        fields["linear_attn_config.num_heads"] = text.linear_attn_config["num_heads"]
    moe_layers = [i for i in range(text.num_hidden_layers) if text.experts_in_layer(i)]
    if len(moe_layers) < text.num_hidden_layers:
        fields["intermediate_size"] = text.intermediate_size
    if moe_layers:
        fields["num_shared_experts * moe_intermediate_size"] = text.num_shared_experts * text.moe_intermediate_size
    for i in moe_layers:
        name = f"num_experts_per_layer[{i}]" if text.num_experts_per_layer is not None else "num_experts"
        fields.setdefault(name, text.experts_in_layer(i))
    fields["vocab_size"] = text.vocab_size
    for name, value in fields.items():
        if value % size:
            raise ValueError(f"Kimi K3 tensor parallel: {size} ranks do not divide {name} = {value}")


class _Plan:
    """Replaces parameters by this rank's slices and records where each comes from: local parameter name ->
    (checkpoint tensor name, index into it); a parameter not recorded is read whole. On the meta device (a load)
    the slices are shapes only, which the loader fills; on a real one (`bench/tp_sim.py`) they are copies."""

    def __init__(self, tp):
        self.tp = tp
        self.sources = {}

    def take(self, module, prefix, name, dim, start, stop):
        index = (slice(None),) * dim + (slice(start, stop),)
        setattr(module, name, nn.Parameter(getattr(module, name).detach()[index].clone(), requires_grad=False))
        self.sources[prefix + name] = (prefix + name, index)

    def rows(self, linear, prefix, start, stop):
        """Output features start..stop of a linear layer (its weight's rows), or of a depthwise short conv."""
        self.take(linear, prefix, "weight", 0, start, stop)
        if isinstance(linear, nn.Conv1d):
            linear.in_channels = linear.out_channels = linear.groups = stop - start
        else:
            linear.out_features = stop - start

    def columns(self, linear, prefix, start, stop):
        """Input features start..stop of a linear layer, its partial outputs summed over the ranks."""
        self.take(linear, prefix, "weight", 1, start, stop)
        linear.in_features = stop - start
        linear.register_forward_hook(functools.partial(_sum_output, self.tp.group))

    def delta_attention(self, attn, prefix):
        h0, h1 = self.tp.share(attn.num_heads)
        d = attn.head_dim
        for name in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "g_proj"):
            self.rows(getattr(attn, name), f"{prefix}{name}.", h0 * d, h1 * d)
        self.rows(attn.b_proj, f"{prefix}b_proj.", h0, h1)
        self.take(attn, prefix, "dt_bias", 0, h0 * d, h1 * d)
        self.take(attn, prefix, "A_log", 0, h0, h1)  # stored zero-padded; the local heads' values, unpadded
        self.columns(attn.o_proj, f"{prefix}o_proj.", h0 * d, h1 * d)
        attn.num_heads = h1 - h0

    def latent_attention(self, attn, prefix):
        h0, h1 = self.tp.share(attn.num_heads)
        q, kv, v = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim, attn.v_dim
        self.rows(attn.q_b_proj, f"{prefix}q_b_proj.", h0 * q, h1 * q)
        self.rows(attn.kv_b_proj, f"{prefix}kv_b_proj.", h0 * kv, h1 * kv)
        if attn.use_output_gate:
            self.rows(attn.g_proj, f"{prefix}g_proj.", h0 * v, h1 * v)
        self.columns(attn.o_proj, f"{prefix}o_proj.", h0 * v, h1 * v)
        attn.num_heads = h1 - h0

    def mlp(self, mlp, prefix):
        start, stop = self.tp.share(mlp.gate_proj.out_features)
        self.rows(mlp.gate_proj, f"{prefix}gate_proj.", start, stop)
        self.rows(mlp.up_proj, f"{prefix}up_proj.", start, stop)
        self.columns(mlp.down_proj, f"{prefix}down_proj.", start, stop)

    def latent_moe(self, moe, prefix):
        first, stop = self.tp.share(moe.num_experts)
        moe.experts = moe.experts.select(range(first, stop))
        for name, _ in moe.experts.named_parameters():
            self.sources[f"{prefix}experts.{name}"] = (f"{prefix}experts.{name}", (slice(first, stop),))
        moe.num_experts = stop - first
        moe.expert_parallel = ExpertParallel(first, stop - first, self.tp)

    def text_model(self, text, prefix):
        first, stop = self.tp.share(text.embed_tokens.num_embeddings)
        rows = text.embed_tokens.weight.detach()[first:stop].clone()
        text.embed_tokens = VocabParallelEmbedding(first, rows, self.tp)
        self.sources[f"{prefix}embed_tokens.weight"] = (f"{prefix}embed_tokens.weight", (slice(first, stop),))

    def language_model(self, language, prefix):
        head = getattr(language, "lm_head", None)
        if head is not None:
            vocab = head.out_features
            first, stop = self.tp.share(vocab)
            self.rows(head, f"{prefix}lm_head.", first, stop)
            head.register_forward_hook(functools.partial(_gather_vocab, self.tp.group, vocab, first))


# The plan's step for each module class of modeling_kimi_k3 (by name: that module imports this one).
_STEPS = {
    "KimiK3DeltaAttention": _Plan.delta_attention,
    "KimiK3MLAttention": _Plan.latent_attention,
    "KimiK3MLP": _Plan.mlp,
    "KimiK3LatentMoE": _Plan.latent_moe,
    "KimiK3TextModel": _Plan.text_model,
    "KimiK3LanguageModel": _Plan.language_model,
}


def shard(root, tp):
    """Shard `root` (a model or one decoder layer) for rank `tp.rank` of `tp.size`, in place; returns where each
    sharded parameter comes from (local name -> checkpoint name, index)."""
    plan = _Plan(tp)
    for name, module in list(root.named_modules()):
        step = _STEPS.get(type(module).__name__)
        if step is not None:
            step(plan, module, f"{name}." if name else "")
    return plan.sources


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def init_distributed():
    """The default process group, initialised from torchrun's environment where it is not yet (NCCL with the
    LOCAL_RANK GPU on a CUDA machine, gloo on the CPU); returns this rank's `TensorParallel` and device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("tp_plan='auto' loads one shard per process: run under torchrun "
                             "(torchrun --nproc-per-node N script.py), or initialise torch.distributed first")
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    backend = str(dist.get_backend())
    if "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return TensorParallel(dist.get_rank(), dist.get_world_size()), device


def load_tensor_parallel(cls, pretrained_model_name_or_path, *model_args, fast_paths=None, **kwargs):
    """`cls.from_pretrained(..., tp_plan="auto")`: this rank's shard of the model, on its device, in eval mode."""
    tp_plan = kwargs.pop("tp_plan")
    if tp_plan != "auto":
        raise ValueError(f"Kimi K3 supports tp_plan='auto' only (its own plan, tensor_parallel.py), got {tp_plan!r}")
    for name in ("device_map", "device_mesh", "quantization_config"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name} cannot be combined with tp_plan='auto' (each rank holds its shard on its device)")
    if model_args:
        raise TypeError("tp_plan='auto' takes no positional model arguments")
    tp_size = kwargs.pop("tp_size", None)
    wants_info = kwargs.pop("output_loading_info", False)
    dtype, config, hub = pop_load_kwargs(kwargs)
    if config is not None and kwargs:
        raise TypeError(f"from_pretrained(tp_plan='auto') got unexpected keyword arguments {sorted(kwargs)}")
    tp, device = init_distributed()
    if tp_size is not None and tp_size != tp.size:
        raise ValueError(f"tp_size={tp_size}, but torchrun started {tp.size} processes: run one process per rank")
    directory = checkpoint_directory(str(pretrained_model_name_or_path), hub)
    if not isinstance(config, cls.config_class):
        config = cls.config_class.from_pretrained(directory, **kwargs)
    check_tp_size(config.text_config, tp.size)
    headers = read_safetensors_headers(directory)
    dtype = resolve_dtype(dtype, config, headers)
    model = build_on_meta(cls, config, dtype)
    model.dispatch.request(fast_paths)
    check_checkpoint(model, directory, config, headers)
    sources = shard(model, tp)
    materialize(model, lambda name: device)
    read_tensors(directory, headers, pieces_for(model, sources), desc=f"Loading rank {tp.rank}'s weights")
    model.eval()
    model.tensor_parallel = tp
    model.stack_experts()
    model.merge_projections()  # this rank's slices of each projection, one buffer a block
    check_loaded_scales(model, directory)
    model.dispatch.resolved(device)  # resolve (and log) the fast paths
    load_generation_config(model, directory)
    info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return (model, info) if wants_info else model


__all__ = ["TensorParallel", "ExpertParallel", "all_reduce", "check_tp_size", "load_tensor_parallel", "shard"]
