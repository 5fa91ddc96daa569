"""SASS instructions per weight element in the main loop of the MXFP4 expert kernels, compiled for Hopper (sm90)
on this machine: no GPU needed (Triton's front end, ptxas and nvdisasm all run on the host).

The expert kernels at decode wait on instructions (the E2M1 -> bf16 upcast), not on memory, so this count is a
cheap proxy to compare upcasts and tiles before spending device time; `bench.layer` on a GPU is the measurement.
Prints, per configuration, the instructions in the kernel's longest loop divided by the weight elements one thread
handles per iteration, and the most frequent opcodes.

    python -m bench.kernel_sass                  # the decode and prefill defaults, lop3 and dot_scaled
    python -m bench.kernel_sass --bm 16 --bn 32 --bk 128 --warps 2 --upcast dot_scaled
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import mxfp4_triton

SM90 = GPUTarget("cuda", 90, 32)
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def compile_kernel(kernel, upcast, bm, bn, bk, warps, stages):
    """One expert kernel at the release's shapes (latent 3584, inner 3072, 320 experts), pointers and strides
    marked 16-divisible as Triton's launcher would."""
    common = {"rows_ptr": "*i32", "block_expert_ptr": "*i32", "num_pairs": "i32", "top_k": "i32"}
    consts = {"E": 320, "BM": bm, "BN": bn, "BK": bk, "UPCAST": mxfp4_triton._UPCAST_CODES[upcast],
              "F32_DOT": False, "FAST_MATH": upcast == "dot_scaled", "ACT": tl.bfloat16, "PAIRS": False}
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
    divisible = [n for n, kind in signature.items() if kind.startswith("*") or n.startswith("stride")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs), target=SM90,
                          options={"num_warps": warps, "num_stages": stages})


def loop_opcodes(cubin):
    """Opcode counts of the longest backward-branch loop in the disassembled cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    start, end = max(((labels[m.group(1)], i) for i, line in enumerate(lines)
                      for m in [re.search(r"BRA `\((\.L_x_\d+)\)", line)] if m and m.group(1) in labels
                      and labels[m.group(1)] < i), key=lambda span: span[1] - span[0])
    ops = collections.Counter()
    for line in lines[start:end + 1]:
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upcast", choices=["lop3", "dot_scaled"], action="append")
    parser.add_argument("--bm", type=int)
    parser.add_argument("--bn", type=int)
    parser.add_argument("--bk", type=int)
    parser.add_argument("--warps", type=int)
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args(argv)
    if args.bm:
        tiles = {"custom": (args.bm, args.bn, args.bk, args.warps)}
    else:
        tiles = {name: (c["BM"],) + tuple(c["w13"][i] for i in (0, 1, 2))
                 for name, c in mxfp4_triton.CONFIGS.items()}
    for name, (bm, bn, bk, warps) in tiles.items():
        for upcast in args.upcast or ["lop3", "dot_scaled"]:
            for kernel, matrices in (("w13", 2), ("w2", 1)):
                ops = loop_opcodes(compile_kernel(kernel, upcast, bm, bn, bk, warps, args.stages).asm["cubin"])
                per_thread = matrices * bn * bk / (32 * warps)  # weight elements a thread upcasts per iteration
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
                print(f"{name:8s} {upcast:10s} {kernel:3s} BM {bm:3d} BN {bn:3d} BK {bk:3d} {warps} warps: "
                      f"{sum(ops.values()) / per_thread:.2f} instructions per element ({top})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
