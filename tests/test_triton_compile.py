"""fused_triton's kernels compile for Hopper (sm90) without a GPU: Triton's front end, its passes and ptxas run on
the host, so type errors that the CPU interpreter lets through (tests/test_triton_interpreter.py) fail here, not
on the device. Needs `triton` installed (skipped otherwise)."""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fused_triton  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def compile_for_sm90(fn, signature, constexprs):
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90)
    assert ".entry" in kernel.asm["ptx"]


@pytest.mark.parametrize("block_t", [4, 16])
def test_short_conv_kernel_compiles(block_t):
    pointers = {name: "*bf16" for name in ("x_ptr", "w_ptr", "state_ptr", "y_ptr", "new_state_ptr")}
    scalars = {name: "i32" for name in ("T", "D", "stride_xb", "stride_xt", "stride_yb", "stride_yt")}
    consts = {"K": 4, "BLOCK_T": block_t, "BLOCK_D": 256, "BLOCK_S": 4}
    compile_for_sm90(fused_triton._short_conv_kernel, {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")},
                     consts)


@pytest.mark.parametrize("block_n", [4, 16])
def test_attn_res_mix_kernel_compiles(block_n):
    pointers = {name: "*bf16" for name in ("src_ptr", "norm_w_ptr", "proj_w_ptr", "out_w_ptr", "out_ptr")}
    scalars = {"n": "i32", "rows": "i32", "eps": "fp32", "out_eps": "fp32"}
    consts = {"H": 7168, "BLOCK_N": block_n, "BLOCK_H": 8192 // block_n}
    compile_for_sm90(fused_triton._attn_res_mix_kernel, {**pointers, **scalars, **dict.fromkeys(consts, "constexpr")},
                     consts)


def test_router_topk_kernel_compiles():
    consts = {"K": 16, "BLOCK_E": 512, "RENORMALIZE": True}
    signature = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "E": "i32",
                 "scaling": "fp32", **dict.fromkeys(consts, "constexpr")}
    compile_for_sm90(fused_triton._router_topk_kernel, signature, consts)


@pytest.mark.parametrize("norm", [True, False])
def test_pair_sum_norm_kernel_compiles(norm):
    consts = {"K": 16, "BLOCK_L": 4096, "NORM": norm}
    signature = {"pairs_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "L": "i32", "eps": "fp32",
                 **dict.fromkeys(consts, "constexpr")}
    compile_for_sm90(fused_triton._pair_sum_norm_kernel, signature, consts)


def _divisible(fn, signature):
    """What Triton's launcher would specialize here: pointers and strides known to be multiples of 16."""
    names = [n for n, kind in signature.items() if kind.startswith("*") or n.startswith("stride")]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


@pytest.mark.parametrize("kernel", ["w13", "w2"])
def test_mxfp4_lop3_kernels_compile(kernel):
    """The "lop3" expert kernels (inline-PTX E2M1 -> bf16 bit trick) at the release's shapes."""
    import mxfp4_triton
    tl = triton.language
    common = {"rows_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "top_k": "i32"}
    consts = {"E": 320, "BM": 8, "BN": 64, "BK": 256, "UPCAST": mxfp4_triton._UPCAST_CODES["lop3"], "F32_DOT": False,
              "FAST_MATH": True,
              "ACT": tl.bfloat16, "PAIRS": True}
    if kernel == "w13":
        fn = mxfp4_triton._w13_kernel
        signature = {"z_ptr": "*bf16", "w1_ptr": "*u8", "s1_ptr": "*u8", "w3_ptr": "*u8", "s3_ptr": "*u8",
                     "h_ptr": "*bf16", "stride_z": "i32", "stride_h": "i32", **common}
        consts.update(K=3584, N=3072, BETA=4.0, LINEAR_BETA=25.0)
    else:
        fn = mxfp4_triton._w2_kernel
        signature = {"h_ptr": "*bf16", "w2_ptr": "*u8", "s2_ptr": "*u8", "weight_ptr": "*fp32", "y_ptr": "*fp32",
                     "stride_h": "i32", "stride_y": "i32", **common}
        consts.update(K=3072, N=3584, ATOMIC=False)
    signature = {**signature, **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts,
                                        attrs=_divisible(fn, signature)), target=SM90, options={"num_warps": 4})
    assert "0x01C001C0" in compiled.asm["ptx"]
