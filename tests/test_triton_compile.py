"""Every Triton kernel the model launches compiles for Hopper (sm90) without a GPU, with the argument types and
constexprs its real call site passes.

The dispatch code runs on CPU tensors at the release's widths (the model's own blocks calling their `Ops` table, every
fast path resolved as on unless a call switches it off, so the table holds the `mxfp4_triton` and `fused_triton`
kernels) with each kernel's launch replaced
by a recorder. Triton's
own binder then turns each recorded call into the signature, constexprs and alignment attributes that a launch on
the GPU would compile (as `JITFunction.run` does), and Triton's front end, passes and ptxas run on the host. So a
dtype or constexpr mismatch between a call site and a kernel (an int64 pointer where the kernel was only ever
compiled for int32, a branch returning another type) fails here, in CI, and not first on the device.

Needs `triton` installed (the test extra pins it: the binder and `_pack_args` are Triton internals)."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import fused_triton  # noqa: E402
import kimi_k3_dispatch  # noqa: E402
import mxfp4_triton  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3_dispatch import FastPaths, use_fast_paths  # noqa: E402
from modeling_kimi_k3 import (BlockBank, KimiK3AttnResProj, KimiK3Cache, KimiK3DeltaAttention,  # noqa: E402
                              KimiK3LatentMoE, KimiK3MLAttention, KimiK3RMSNorm, KimiK3ShortConv,
                              KimiK3StaticCache, new_dispatch)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90 = GPUTarget("cuda", 90, 32)
MODULES = (mxfp4_triton, fused_triton)
EXPERTS = 32  # of the release's 320: the kernels' types do not depend on it, the CPU stacks' size does


def launched_kernels():
    """(module, name) of every kernel a host function of these modules launches (jit helpers excluded)."""
    return [(m, n) for m in MODULES for n, v in vars(m).items() if isinstance(v, JITFunction) and n.endswith("_kernel")]


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` keeps the call instead of launching it."""

    def __init__(self, name, kernel, calls):
        self.name, self.kernel, self.calls = name, kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, self.kernel, args, kwargs))


def sm90_compile(kernel, args, kwargs):
    """Compile `kernel` for sm90 as a launch with these arguments would: Triton's binder gives the signature
    (pointer dtypes, i32/i64 by value), the constexprs and the divisibility attributes."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return signature, triton.compile(source, target=SM90, options=options.__dict__)


def release_text_config():
    return KimiK3Config.from_pretrained(ROOT).text_config


def real_moe(text):
    """One LatentMoE block at the release's widths in bf16 (with EXPERTS experts), weights arbitrary but finite."""
    with torch.device("meta"):
        moe = KimiK3LatentMoE(text, EXPERTS, packed=True)
    moe = moe.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.dtype == torch.uint8:
                p.fill_(127 if name.endswith("weight_scale") else 0x21)
            else:
                p.normal_(0, 0.02)
    return moe.to(torch.bfloat16)


@pytest.fixture(scope="module")
def recorded():
    """Every kernel launch of the model's fast paths at decode and prefill, recorded: {key: (name, kernel, args,
    kwargs)} with one entry per distinct specialization."""
    calls = []
    patch = pytest.MonkeyPatch()
    try:
        for module, name in launched_kernels():
            patch.setattr(module, name, Recorder(name, getattr(module, name), calls))
        patch.setattr(kimi_k3_dispatch, "resolve_fast_paths", every_path_unless_off)
        # the prompt path's rule without its SM90 check, and its grouped GEMMs (torch's, not Triton's) skipped
        patch.setattr(mxfp4_triton, "upcast_once_pays",
                      lambda pairs, experts, device: pairs >= mxfp4_triton.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT * experts)
        patch.setattr(torch, "_grouped_mm", lambda a, b, offs: torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype))
        text = release_text_config()
        torch.manual_seed(0)
        with torch.no_grad():
            record_moe(text)
            record_attn_res_mix(text)
            record_short_convs(text)
            record_kda_decode_step(text)
            record_latent_attention(text)
    finally:
        patch.undo()
    unique = {}
    for name, kernel, args, kwargs in calls:
        key = (name,) + tuple(_describe(a) for a in args) + tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))
        unique.setdefault(key, (name, kernel, args, kwargs))
    return unique


def every_path_unless_off(requested, device):
    """Stands in for `resolve_fast_paths` on CPU: every path on, unless the request says "off"."""
    return FastPaths(**{f: (requested or {}).get(f) != "off" for f in FastPaths.__dataclass_fields__})


def _describe(value):
    return (str(value.dtype), value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor) else repr(value)


def record_moe(text):
    """Router top-k, the expert kernels (one token: per-pair blocks; a few: aligned decode blocks; many: prefill
    blocks; each with the lop3 upcast and, for a layer with large scales, tl.dot_scaled; a prompt: the upcast-once
    path's kernels) and the pair sum + norm (of the experts' outputs, and of expert parallel's weighted sum), each
    reached from the block's own code."""
    moe = real_moe(text)
    for tokens in (1, 3, 64, 512):  # 512: 256 pairs an expert, the upcast-once path
        flat = torch.randn(tokens, text.hidden_size).to(torch.bfloat16)
        moe.gate(flat)  # recorded: the fused top-k (its outputs are not written)
        with use_fast_paths(moe, fused="off"):
            ids, weights = moe.gate(flat)  # real ids for the expert dispatch, from the torch router
        z = moe.routed_expert_down_proj(flat)
        for lop3 in (True, False):
            scale = moe.experts[0].w1.weight_scale
            scale[0, 0] = 127 if lop3 else 200  # a scale code above LOP3_MAX_SCALE_CODE sends a layer to dot_scaled
            moe.expert_stack = None
            assert mxfp4_triton.lop3_applies(moe.stack_experts()) is lop3
            ops = moe.dispatch.ops(z.device)
            pairs = ops.routed_experts(moe, z, ids)
            assert pairs.shape == (*ids.shape, text.routed_expert_hidden_size) and pairs.dtype == torch.bfloat16
        ops.pair_sum_norm(pairs, weights, moe.routed_expert_norm, z.dtype)  # the experts' bf16 outputs, weighted
        ops.pair_sum_norm(torch.randn(tokens, 1, text.routed_expert_hidden_size), None, moe.routed_expert_norm,
                          z.dtype)  # expert parallel's weighted sum


def record_attn_res_mix(text):
    """The depth mix + norm over as few and as many sources as the release's blocks give, also adding the
    sublayer's output to the last; before a KDA layer with the padding mask a decode step passes (a static cache's
    bool buffer, its position) and a prompt's (int64)."""
    norm, out_norm = KimiK3RMSNorm(text.hidden_size, text.rms_norm_eps), KimiK3RMSNorm(text.hidden_size)
    proj = KimiK3AttnResProj(text.hidden_size)
    blocks = -(-text.num_hidden_layers // text.attn_res_block_size)
    for module in (norm, out_norm, proj):
        module.to(torch.bfloat16)
    ops = new_dispatch(text).ops(torch.device("cpu"))
    for sources, tokens in ((2, 1), (blocks + 1, 1), (blocks + 1, 16)):
        bank = BlockBank(torch.randn(1, tokens, text.hidden_size).to(torch.bfloat16) for _ in range(sources - 1))
        ops.attn_res_mix(bank, torch.randn(1, tokens, text.hidden_size).to(torch.bfloat16), norm, proj, out_norm)
        ops.add_attn_res_mix(bank, *torch.randn(2, 1, tokens, text.hidden_size).to(torch.bfloat16), norm, proj,
                             out_norm)
    cache = KimiK3StaticCache(text, batch_size=1, max_length=32, cuda_graph=False)
    for tokens, user_mask in ((16, torch.ones(1, 16, dtype=torch.long)), (1, None)):
        key_mask, positions = cache.prepare(user_mask, 1, tokens, torch.device("cpu"))
        bank = BlockBank(torch.randn(1, tokens, text.hidden_size).to(torch.bfloat16) for _ in range(2))
        ops.attn_res_mix(bank, torch.randn(1, tokens, text.hidden_size).to(torch.bfloat16), norm, proj, out_norm,
                         user_mask if user_mask is not None else key_mask, positions)
        cache.advance(tokens)


def record_short_convs(text):
    """KDA's short convs at prefill (no history), and at decode with a growing and with a static cache's state; its
    output norm times the gate at prefill and decode."""
    with torch.device("meta"):
        attn = KimiK3DeltaAttention(text, layer_idx=0)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(attn, name, getattr(attn, name).to_empty(device="cpu").to(torch.bfloat16))
    width = attn.num_heads * attn.head_dim

    def projected(tokens):
        return tuple(torch.randn(1, tokens, width).to(torch.bfloat16) for _ in range(3))

    ops, convs = attn.dispatch.ops(torch.device("cpu")), (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    ops.short_convs(projected(7), convs, None, False, torch.float32)  # for fla's chunked KDA
    _, histories = ops.short_convs(projected(7), convs, None, False)
    ops.short_convs(projected(1), convs, histories, False)
    cache = KimiK3StaticCache(text, batch_size=1, max_length=16, cuda_graph=False)
    layer = cache.layers[0]
    layer.update(histories, torch.zeros(1, attn.num_heads, attn.head_dim, attn.head_dim))
    ops.short_convs(projected(1), convs, layer.conv_states, layer.in_place)
    attn.o_norm = attn.o_norm.to_empty(device="cpu").to(torch.bfloat16)
    heads = (1, 7, attn.num_heads, attn.head_dim)  # a prompt's fp32 output (fla's chunked kernel), a decode step's bf16
    ops.gated_rms_norm(torch.randn(heads), torch.randn(heads).to(torch.bfloat16), attn.o_norm, torch.bfloat16)
    ops.gated_rms_norm(torch.randn(heads[:1] + (1,) + heads[2:]).to(torch.bfloat16),
                       torch.randn(heads[:1] + (1,) + heads[2:]).to(torch.bfloat16), attn.o_norm, torch.bfloat16)


def record_kda_decode_step(text):
    """A KDA layer's decode step from the block's own code after its projections (`delta_rule`), whole and as a
    TP8 rank (12 heads): onto a static cache's states (written in place) and a growing cache's, one row and four,
    q, k, v as the projections give them."""
    for heads in (text.linear_attn_config["num_heads"], text.linear_attn_config["num_heads"] // 8):
        with torch.device("meta"):
            attn = KimiK3DeltaAttention(text, layer_idx=0)
        attn.num_heads = heads
        width = heads * attn.head_dim
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(attn, name, KimiK3ShortConv(width, attn.q_conv1d.kernel_size[0]).to(torch.bfloat16))
        attn.o_norm = attn.o_norm.to_empty(device="cpu").to(torch.bfloat16)
        attn.A_log = torch.nn.Parameter(torch.zeros(heads))
        attn.dt_bias = torch.nn.Parameter(torch.zeros(width))
        attn.o_proj = torch.nn.Identity()
        ops = attn.dispatch.ops(torch.device("cpu"))
        for batch in (1, 4):
            x = torch.randn(batch, 1, text.hidden_size).to(torch.bfloat16)
            projected = tuple(torch.randn(batch, 1, width).to(torch.bfloat16) for _ in range(3))
            gates = (torch.randn(batch, 1, heads, attn.head_dim).to(torch.bfloat16),
                     torch.randn(batch, 1, heads).to(torch.bfloat16),
                     torch.randn(batch, 1, heads, attn.head_dim).to(torch.bfloat16))
            histories = tuple(torch.zeros(batch, width, 3, dtype=torch.bfloat16) for _ in range(3))
            state = torch.zeros(batch, heads, attn.head_dim, attn.head_dim)
            for cache in (KimiK3StaticCache(text, batch_size=batch, max_length=16, cuda_graph=False),
                          KimiK3Cache(text)):
                own = cache.layers[0]
                own.update(histories, state)
                assert own.decode_step(1)
                attn.delta_rule(x, projected, gates, own, ops)


def record_latent_attention(text):
    """MLA from the block's own code: a prompt (its per-head keys and its gated output) and the one-query attention
    of a decode step into a static cache (its mask buffer, a tail past the query) and into a growing cache with and
    without a padding mask."""
    with torch.device("meta"):
        attn = KimiK3MLAttention(text, layer_idx=3)
    attn = attn.to_empty(device="cpu").to(torch.bfloat16)
    for module in attn.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.normal_(0.0, 0.02)
    attn(torch.randn(1, 7, text.hidden_size).to(torch.bfloat16))
    x = torch.randn(1, 1, text.hidden_size).to(torch.bfloat16)
    static = KimiK3StaticCache(text, batch_size=1, max_length=64, cuda_graph=False)
    mask, positions = static.prepare(None, 1, 1, "cpu")
    static.advance(1)
    attn(x, mask, static, positions + 9)
    growing = KimiK3Cache(text)
    growing.layers[3].update(torch.randn(1, 9, text.kv_lora_rank + text.qk_rope_head_dim).to(torch.bfloat16),
                             torch.arange(9))
    growing.advance(9)
    attn(x, None, growing)
    attn(x, torch.ones(1, 10, dtype=torch.long), growing)


def test_every_launched_kernel_is_recorded(recorded):
    assert {name for name, *_ in recorded.values()} == {name for _, name in launched_kernels()}


def test_every_expert_specialization_is_recorded(recorded):
    """Per-pair and aligned blocks at decode, prefill blocks, each upcast the model selects."""
    seen = {(name, kwargs["PAIRS"], kwargs["BM"], kwargs["UPCAST"]) for name, _, _, kwargs in recorded.values()
            if name in ("_w13_kernel", "_w2_kernel")}
    lop3, dot_scaled = mxfp4_triton._UPCAST_CODES["lop3"], mxfp4_triton._UPCAST_CODES["dot_scaled"]
    decode, prefill = mxfp4_triton.CONFIGS["decode"]["BM"], mxfp4_triton.CONFIGS["prefill"]["BM"]
    for name in ("_w13_kernel", "_w2_kernel"):
        for upcast in (lop3, dot_scaled):
            assert {(name, True, decode, upcast), (name, False, decode, upcast), (name, False, prefill, upcast)} <= seen


@pytest.fixture(scope="module")
def compiled(recorded):
    return {key: sm90_compile(kernel, args, kwargs) for key, (name, kernel, args, kwargs) in recorded.items()}


def test_recorded_launches_compile_for_sm90(recorded, compiled):
    for key, (name, _, _, kwargs) in recorded.items():
        signature, kernel = compiled[key]
        assert ".entry" in kernel.asm["ptx"], name
        if kwargs.get("UPCAST") == mxfp4_triton._UPCAST_CODES["lop3"]:
            assert "0x01C001C0" in kernel.asm["ptx"], "the lop3 upcast's inline PTX is missing"


def test_the_router_ids_reach_the_per_pair_expert_kernels_as_int64(recorded, compiled):
    """The single-token path reads the router's ids as its rows: the signature the kernel is compiled for must be
    the router's int64 (the batch-1 decode regression: _block_rows returned int32 on one branch, int64 on the
    other)."""
    per_pair = [compiled[key][0] for key, (name, _, _, kwargs) in recorded.items()
                if name == "_w13_kernel" and kwargs["PAIRS"]]
    assert per_pair and all(signature["rows_ptr"] == "*i64" for signature in per_pair)


def test_the_kda_decode_step_compiles_for_the_release_head(recorded, compiled):
    """One program a (row, head) of the release's 128-wide heads: its fp32 state read and written through fp32
    pointers, the bf16 projections, histories and output as the block passes them."""
    found = [(kwargs, compiled[key][0]) for key, (name, _, _, kwargs) in recorded.items()
             if name == "_kda_decode_step_kernel"]
    assert found and all(kwargs["D"] == 128 and kwargs["LOWER_BOUND"] for kwargs, _ in found)
    for _, signature in found:
        assert signature["state_ptr"] == signature["state_out_ptr"] == "*fp32"
        assert {signature[p] for p in ("q_ptr", "v_ptr", "q_hist_ptr", "k_hist_out_ptr", "g_ptr", "out_ptr")} == {
            "*bf16"}


def test_the_depth_mix_compiles_with_the_key_masks_of_both_call_sites(recorded, compiled):
    """Before a KDA layer the mix reads the padding mask itself: a static cache's bool buffer (as bytes) at a decode
    step, a user's int64 mask at a prompt, with int64 positions; and without a mask elsewhere."""
    signatures = {(kwargs["MASKED"], compiled[key][0]["mask_ptr"], compiled[key][0]["pos_ptr"])
                  for key, (name, _, _, kwargs) in recorded.items() if name == "_attn_res_mix_kernel"}
    assert {s for s in signatures if s[0]} == {(True, "*u8", "*i64"), (True, "*i64", "*i64")}
    assert any(not s[0] for s in signatures)
