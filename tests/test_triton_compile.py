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
