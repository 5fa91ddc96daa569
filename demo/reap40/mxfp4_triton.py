"""Triton kernels for the MXFP4 routed experts of a `KimiK3LatentMoE` block (CUDA; optional fast path).

The packed bytes are read as stored (compressed-tensors `mxfp4-pack-quantized`, see `mxfp4.py`): per expert
w1/w3 `weight_packed` [I, L/2] (element 2j in the low nibble), `weight_scale` [I, L/32] (E8M0), w2 [L, I/2] and
[L, I/32]. Nothing is dequantized to memory.

Two grouped kernels over (token, expert) pairs sorted by expert, `BM` pairs of one expert per program:
  * `_w13_kernel`: `h = situ(w1 z, w3 z)` (SiTU-GLU in fp32 on the fp32 accumulators), stored bf16 per pair;
  * `_w2_kernel`: `y_pair = weight * bf16(w2 h)`, stored fp32 per pair (or added atomically per token);
the caller sums the k pairs of each token in fp32, as the reference does. For a single token the pairs need no
sort: one block per pair, its expert read straight from the router's ids. One launch pattern serves decode (BM=8:
the MMA pads the few tokens, the weight rows are its wide side) and prefill (BM=128).

The matrix step (`UPCAST`) turns the nibbles into bf16 MMA operands in registers (Hopper has no FP4 MMA):
  * "lop3" (the default): an inline-PTX bit trick, one byte permute and per bf16 pair two shifts and two masked
    merges, whose output reads as E2M1 * 2^-126; the 2^126 and the E8M0 scale are one bf16 factor per element
    (one multiply per pair). Its operands come out as the low nibbles and the high nibbles of each byte, so the
    K order is permuted to match: per group of 32, the 16 even elements, then the 16 odd ones (the activation is
    reordered once per call, h is stored in that order by the w13 kernel). About a fifth fewer instructions in
    the kernels' main loops than with tl.dot_scaled (`bench/kernel_sass.py`), and instructions are what these
    kernels wait on (bench/results/layer_h200.md);
  * "dot_scaled": `tl.dot_scaled(x, None, "bf16", w, scale, "e2m1")`, Triton's own upcast (also the fallback for
    layers with scale codes above LOP3_MAX_SCALE_CODE);
  * "manual": an explicit fp32 dequant, then `tl.dot` (what the Triton interpreter runs on CPU in the tests).
Routing metadata is built with torch ops only (no host sync), so a decode step can be graph-captured.

A block whose `experts` fast path is on calls `routed_experts`, a drop-in for the block's reference
`modeling_kimi_k3.routed_experts` (the dispatch resolves it only for shapes it runs: sizes multiples of 32, packed
experts). Both read the packs from the block's `mxfp4.ExpertStack`.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the model uses the reference path
    triton = None
    tl = None

# Kernel configurations: decode (few pairs) and prefill (many). Each entry: BM, and BN, BK, num_warps, num_stages
# for the w13 and the w2 kernel (BM must agree between the two: they share the routing metadata); optional keys
# "upcast", "atomic", "fast_math" override the module defaults below for that regime.
# The defaults are the fastest correct variants of bench/layer.py's sweeps on an H200 (bench/results/layer_h200.*):
# at decode lop3 with blocks of 8 pairs, 4-warp programs of 64 rows and BK 256 took 1.73x / 1.50x the bytes floor
# at batch 1 / 8 (blocks of 16 pairs: 2.04x / 1.82x; tl.dot_scaled's best: 2.5-2.7x / 2.3x), and at prefill lop3
# reached 35 % of the bf16 rate at 8k tokens (dot_scaled 31 %); tl.dot_scaled beat the older inline-PTX upcasts and
# the CUDA-core kernels.
CONFIGS = {
    "decode": dict(BM=8, w13=(64, 256, 4, 3), w2=(64, 256, 4, 3), upcast="lop3"),
    "prefill": dict(BM=128, w13=(128, 128, 8, 3), w2=(128, 128, 8, 3), upcast="lop3"),
}
# Pairs per expert (on average) at or below which the decode configuration is used.
DECODE_MAX_PAIRS_PER_EXPERT = 4
# Pairs per expert (on average) from which a prompt's experts are upcast once and run as grouped bf16 GEMMs
# (`run_experts_upcast_once`, SM90+), and the most bf16 weights that path holds at once.
UPCAST_ONCE_MIN_PAIRS_PER_EXPERT = 256
UPCAST_ONCE_CHUNK_BYTES = 2 << 30
# True: the w2 kernel adds weight * y into an fp32 [N, L] buffer atomically (one pass, order not fixed);
# False: it stores per-pair rows and torch sums them (deterministic).
ATOMIC_COMBINE = False
# The upcast used where a CONFIGS entry names none (see the module docstring for the options). FAST_MATH is
# dot_scaled's `fast_math` flag, which drops Triton's special-value handling in its upcast (as we understand it, the
# NaN of E8M0 code 255, which no pack from mxfp4.quantize_mxfp4 holds); CONFIGS entries override both.
UPCAST = "lop3"
FAST_MATH = False
_UPCAST_CODES = {"dot_scaled": 0, "manual": 1, "lop3": 2}
# The "lop3" kernels fold the E8M0 scale and the 2^126 of their bit trick into one bf16 factor 2^(code - 1), a
# normal bf16 number for codes up to LOP3_MAX_SCALE_CODE; layers with larger codes (scales above 2) use dot_scaled.
LOP3_MAX_SCALE_CODE = 128

# Under TRITON_INTERPRET=1 (CPU, numpy) the manual path multiplies in fp32: the interpreter's bf16 dot is unusable.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_TL_DTYPES = {} if tl is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def supported(device):
    """True where these kernels can run for activations on `device`."""
    return triton is not None and torch.device(device).type == "cuda"


def lop3_applies(stack):
    """Whether every E8M0 scale code of `stack` is at most LOP3_MAX_SCALE_CODE, so the lop3 upcast applies."""
    return stack.max_scale_code <= LOP3_MAX_SCALE_CODE


# ----------------------------------------------------------------------------------------------------------------
# Routing metadata (torch only, no host sync)
# ----------------------------------------------------------------------------------------------------------------


def max_blocks(num_pairs, num_experts, block_m):
    """Upper bound on sum_e ceil(count_e / BM): a static grid size."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def local_ids(ids, first, count):
    """Router ids [N, k] -> the index among experts `first` .. `first + count - 1`, `count` for the others (experts
    another rank holds)."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, count)


def align_blocks(ids, num_experts, block_m):
    """Sort the flat (token, slot) pairs by expert into blocks of `block_m` rows of one expert each.

    Returns `rows` [max_blocks * BM] int32 (flat pair index t*k + slot; `num_pairs` marks padding) and
    `block_expert` [max_blocks] int32 (the expert of each block; `num_experts` marks a block with no work). Pairs
    with id `num_experts` (experts another rank holds, under expert parallel) land in such blocks: no work.
    """
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    block_start = block_end - blocks
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[sorted_expert]
    slot = block_start[sorted_expert] * block_m + rank
    total = max_blocks(pairs, num_experts + 1, block_m)
    rows = torch.full((total * block_m,), pairs, dtype=torch.int32, device=device)
    rows[slot] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(total, device=device), right=True)
    return rows, block_expert.to(torch.int32).clamp_(max=num_experts)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _e2m1(nib):
        """E2M1 nibble (int32, 0..15) -> its value in fp32: sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
        m = nib & 7
        # m >= 2: exponent field e = m >> 1 >= 1, mantissa bit m & 1 -> bits of 2^(e-1) * (1 + (m&1)/2)
        bits = (m << 22) + (126 << 23)
        mag = tl.where(m < 2, m.to(tl.float32) * 0.5, bits.to(tl.float32, bitcast=True))
        return tl.where((nib & 8) != 0, -mag, mag)

    @triton.jit
    def _e2m1x4_lop3(packed):
        """uint8 bytes -> (low nibbles, high nibbles) as bf16 holding E2M1 * 2^-126: each nibble's bits go straight
        into bf16 fields (sign -> bit 15, the three magnitude bits -> bits 6..8, which reads as E2M1 * 2^-126, code 1
        as a subnormal); the caller's one multiply by 2^126 * scale makes them exact. One byte permute turns
        b0 b1 b2 b3 into b0 b2 b1 b3, so that each output pair (bytes j, j + 1) sits 16 bits apart; then each bf16
        pair is two shifts and two masked merges of that one word."""
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t, a, b;
            prmt.b32 t, $4, $4, 0x3120;
            shl.b32 a, t, 6;
            and.b32 a, a, 0x01C001C0;
            shl.b32 b, t, 12;
            and.b32 b, b, 0x80008000;
            or.b32 $0, a, b;
            shr.b32 a, t, 2;
            and.b32 a, a, 0x01C001C0;
            shl.b32 b, t, 4;
            and.b32 b, b, 0x80008000;
            or.b32 $1, a, b;
            shl.b32 a, t, 2;
            and.b32 a, a, 0x01C001C0;
            shl.b32 b, t, 8;
            and.b32 b, b, 0x80008000;
            or.b32 $2, a, b;
            shr.b32 a, t, 6;
            and.b32 a, a, 0x01C001C0;
            mov.b32 b, t;
            and.b32 b, b, 0x80008000;
            or.b32 $3, a, b;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )

    @triton.jit
    def _mx_tile_dot(acc, x_row, x_mask, w_col, s_col, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
                     F32_DOT: tl.constexpr, FAST_MATH: tl.constexpr):
        """acc += x @ dequant(w) for one K tile starting at the given pointers. UPCAST 0: tl.dot_scaled (Triton
        upcasts e2m1 itself) and 1: fp32 dequant arithmetic then tl.dot (the path the interpreter runs), both with
        acc [BM, BN], x_row [BM, 1] -> x[token, k0], w_col / s_col [1, BN] -> packed[n, k0/2] / scale[n, k0/32];
        2: lop3, with the operands swapped (acc [BN, BM], x_row [1, BM], w_col / s_col [BN, 1]) and x in the
        permuted K order (see the module docstring)."""
        if UPCAST == 0:
            x = tl.load(x_row + tl.arange(0, BK)[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_col + tl.arange(0, BK // 2)[:, None])  # [BK/2, BN], packed along K
            s = tl.load(tl.reshape(s_col, (BN, 1)) + tl.arange(0, BK // 32)[None, :])  # [BN, BK/32]
            acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc, fast_math=FAST_MATH)
        elif UPCAST == 1:
            offs = 2 * tl.arange(0, BK // 2)
            x_even = tl.load(x_row + offs[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_row + offs[None, :] + 1, mask=x_mask, other=0.0)
            j = tl.arange(0, BK // 2)[:, None]
            w = tl.load(w_col + j).to(tl.int32)
            scale = tl.exp2(tl.load(s_col + j // 16).to(tl.float32) - 127.0)  # [BK/2, BN], one per byte
            w_lo = _e2m1(w & 15) * scale
            w_hi = _e2m1(w >> 4) * scale
            if F32_DOT:  # the interpreter's bf16 dot is not usable; these fp32 products are exact anyway
                acc = tl.dot(x_even.to(tl.float32), w_lo, acc, input_precision="ieee")
                acc = tl.dot(x_odd.to(tl.float32), w_hi, acc, input_precision="ieee")
            else:
                acc = tl.dot(x_even.to(tl.bfloat16), w_lo.to(tl.bfloat16), acc)
                acc = tl.dot(x_odd.to(tl.bfloat16), w_hi.to(tl.bfloat16), acc)
        else:  # 2, "lop3": acc [BN, BM] += dequant(w) [BN, BK] @ x^T [BK, BM] (the weight rows are the MMA's wide
            # side), the scale folded into one factor per element, K permuted
            j = tl.arange(0, BK // 2)
            w = tl.load(w_col + j[None, :])  # [BN, BK/2]: byte j holds elements 2j (low nibble) and 2j + 1
            s = tl.load(s_col + tl.arange(0, BK // 32)[None, :])  # [BN, BK/32]
            factor = ((s.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)  # 2^(s - 127) * 2^126
            factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
            w_lo, w_hi = _e2m1x4_lop3(w)
            x_off = (j // 16 * 32 + j % 16)[:, None]  # per group of 32: the low nibbles' elements, then the high ones'
            x_lo = tl.load(x_row + x_off, mask=x_mask, other=0.0)  # [BK/2, BM]
            x_hi = tl.load(x_row + 16 + x_off, mask=x_mask, other=0.0)
            acc = tl.dot(w_lo * factor, x_lo, acc)
            acc = tl.dot(w_hi * factor, x_hi, acc)
        return acc

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _situ(g, u, BETA: tl.constexpr, LINEAR_BETA: tl.constexpr):
        """SiTU-GLU of fp32 gate and up values: `beta*tanh(g/beta) * sigmoid(g) * linear_beta*tanh(u/linear_beta)`."""
        return (BETA * _tanh(g / BETA)) * tl.sigmoid(g) * (LINEAR_BETA * _tanh(u / LINEAR_BETA))

    @triton.jit
    def _block_rows(rows_ptr, pid_m, num_pairs, BM: tl.constexpr, PAIRS: tl.constexpr):
        """The flat (token, slot) pair of each of a block's BM rows (`num_pairs`: padding). PAIRS: one block per
        pair, in order (its expert read straight from the router's ids); else from `align_blocks`' rows."""
        if PAIRS:  # in the rows' own integer type (the router's int64 ids), as the other branch returns
            return tl.where(tl.arange(0, BM) == 0, pid_m, num_pairs).to(rows_ptr.dtype.element_ty)
        return tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))

    @triton.jit(do_not_specialize=["num_pairs", "top_k", "first"])
    def _w13_kernel(z_ptr, rows_ptr, block_expert_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                    num_pairs, top_k, first, stride_z, stride_h, K: tl.constexpr, N: tl.constexpr,
                    E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    BETA: tl.constexpr, LINEAR_BETA: tl.constexpr, UPCAST: tl.constexpr,
                    F32_DOT: tl.constexpr, FAST_MATH: tl.constexpr, ACT: tl.constexpr, PAIRS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m) - first
        if (expert < 0) | (expert >= E):  # another rank's expert, or a block with no work
            return
        rows = _block_rows(rows_ptr, pid_m, num_pairs, BM, PAIRS)
        valid = rows < num_pairs
        token = tl.where(valid, rows // top_k, 0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        expert = expert.to(tl.int64)
        K2 = K // 2
        KG = K // 32
        if UPCAST == 2:
            x_row = z_ptr + token[None, :] * stride_z  # [1, BM]
            w_col = expert * N * K2 + offs_n[:, None] * K2  # [BN, 1]
            s_col = expert * N * KG + offs_n[:, None] * KG
            acc1 = tl.zeros((BN, BM), dtype=tl.float32)
            acc3 = tl.zeros((BN, BM), dtype=tl.float32)
            x_mask = valid[None, :]
        else:
            x_row = z_ptr + token[:, None] * stride_z  # [BM, 1]
            w_col = expert * N * K2 + offs_n[None, :] * K2  # [1, BN]
            s_col = expert * N * KG + offs_n[None, :] * KG
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            x_mask = valid[:, None]
        for k0 in range(0, K, BK):
            acc1 = _mx_tile_dot(acc1, x_row + k0, x_mask, w1_ptr + w_col + k0 // 2, s1_ptr + s_col + k0 // 32,
                                BN, BK, UPCAST, F32_DOT, FAST_MATH)
            acc3 = _mx_tile_dot(acc3, x_row + k0, x_mask, w3_ptr + w_col + k0 // 2, s3_ptr + s_col + k0 // 32,
                                BN, BK, UPCAST, F32_DOT, FAST_MATH)
        act = _situ(acc1, acc3, BETA, LINEAR_BETA).to(ACT)
        if UPCAST == 2:  # stored in the w2 kernel's K order (see run_experts)
            offs_n = offs_n // 32 * 32 + offs_n % 2 * 16 + offs_n % 32 // 2
            h_ptrs = h_ptr + rows.to(tl.int64)[None, :] * stride_h + offs_n[:, None]
        else:
            h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs_n[None, :]
        tl.store(h_ptrs, act, mask=x_mask)

    @triton.jit(do_not_specialize=["num_pairs", "top_k", "first"])
    def _w2_kernel(h_ptr, rows_ptr, block_expert_ptr, w2_ptr, s2_ptr, weight_ptr, y_ptr,
                   num_pairs, top_k, first, stride_h, stride_y, K: tl.constexpr, N: tl.constexpr,
                   E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   UPCAST: tl.constexpr, ATOMIC: tl.constexpr, F32_DOT: tl.constexpr, FAST_MATH: tl.constexpr,
                   ACT: tl.constexpr, PAIRS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m) - first
        if (expert < 0) | (expert >= E):  # another rank's expert, or a block with no work
            return
        rows = _block_rows(rows_ptr, pid_m, num_pairs, BM, PAIRS)
        valid = rows < num_pairs
        row64 = tl.where(valid, rows, 0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        expert = expert.to(tl.int64)
        K2 = K // 2
        KG = K // 32
        if UPCAST == 2:
            x_row = h_ptr + row64[None, :] * stride_h
            w_col = expert * N * K2 + offs_n[:, None] * K2
            s_col = expert * N * KG + offs_n[:, None] * KG
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            x_mask = valid[None, :]
        else:
            x_row = h_ptr + row64[:, None] * stride_h
            w_col = expert * N * K2 + offs_n[None, :] * K2
            s_col = expert * N * KG + offs_n[None, :] * KG
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            x_mask = valid[:, None]
        for k0 in range(0, K, BK):
            acc = _mx_tile_dot(acc, x_row + k0, x_mask, w2_ptr + w_col + k0 // 2, s2_ptr + s_col + k0 // 32,
                               BN, BK, UPCAST, F32_DOT, FAST_MATH)
        # the reference rounds each expert's output to the activation dtype (before weighting it in fp32)
        out = acc.to(ACT)
        if ATOMIC:
            weight = tl.load(weight_ptr + row64, mask=valid, other=0.0)
            token = row64 // top_k
            if UPCAST == 2:
                tl.atomic_add(y_ptr + token[None, :] * stride_y + offs_n[:, None],
                              out.to(tl.float32) * weight[None, :], mask=x_mask, sem="relaxed")
            else:
                tl.atomic_add(y_ptr + token[:, None] * stride_y + offs_n[None, :],
                              out.to(tl.float32) * weight[:, None], mask=x_mask, sem="relaxed")
        elif UPCAST == 2:  # per pair, unweighted: the block weights and sums a token's slots
            tl.store(y_ptr + row64[None, :] * stride_y + offs_n[:, None], out, mask=x_mask)
        else:
            tl.store(y_ptr + row64[:, None] * stride_y + offs_n[None, :], out, mask=x_mask)


    @triton.jit
    def _bf16_bits(magnitude, sign):
        """The 16 bits of bf16(fp32 `magnitude`) as int32, sign bit set where `sign` != 0 (so -0 stays -0)."""
        bits = magnitude.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return tl.where(sign != 0, bits | 0x8000, bits)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, out_ptr, HALF: tl.constexpr, ROWS: tl.constexpr, OUT_ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
        """One program per (pack row, BLOCK bytes): bf16 values E2M1 * 2^(code - 127), the reference's (exact: the
        fp32 product of a 2-bit significand and a power of two is a bf16 number), each byte's two values stored as
        one int32 word (element 2j in the low half). Row r of a stack of experts with ROWS rows each lands in row
        (r // ROWS) * OUT_ROWS + r % ROWS of the output, so w1 and w3 can fill the two halves of one buffer."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < HALF
        packed = tl.load(w_ptr + row * HALF + j, mask=mask, other=0).to(tl.int32)
        code = tl.load(s_ptr + row * (HALF // 16) + j // 16, mask=mask, other=127).to(tl.int32)
        scale = tl.where(code == 0, 0x400000, code << 23).to(tl.float32, bitcast=True)  # code 0: 2^-127, subnormal
        lo = _bf16_bits(_e2m1(packed & 7) * scale, packed & 8)
        hi = _bf16_bits(_e2m1((packed >> 4) & 7) * scale, packed & 128)
        out_row = row // ROWS * OUT_ROWS + row % ROWS
        tl.store(out_ptr + out_row * HALF + j, lo | (hi << 16), mask=mask)

    @triton.jit
    def _situ_glu_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, INNER: tl.constexpr, BETA: tl.constexpr,
                         LINEAR_BETA: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (row, BLOCK columns): SiTU-GLU of a row's gate and up values in fp32, rounded."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INNER
        g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        act = _situ(g, u, BETA, LINEAR_BETA)
        tl.store(out_ptr + row * INNER + offs, act.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["pairs", "first", "total"])
    def _align_blocks_kernel(ids_ptr, ends_ptr, rows_ptr, block_expert_ptr, pairs, first, total,
                             E: tl.constexpr, BM: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr):
        """`align_blocks` of up to BLOCK_P pairs in one program (a decode step's routing metadata in one launch), the
        router's ids taken as they are (experts `first` .. `first + E - 1` this block's, the rest bucket E):
        (1) each bucket's blocks, cumulated into ends[0..E] (global scratch); (2) each pair's slot, its bucket's
        first block times BM plus its rank among the bucket's earlier pairs; every row padding (`pairs`), then
        the pairs' rows; (3) each block's expert, the buckets whose blocks end at or before it, at most E."""
        offs_p = tl.arange(0, BLOCK_P)
        in_p = offs_p < pairs
        local = tl.load(ids_ptr + offs_p, mask=in_p, other=0).to(tl.int32) - first
        e = tl.where((local >= 0) & (local < E), local, E)
        carry = tl.sum(tl.zeros((CHUNK,), dtype=tl.int32), axis=0)  # blocks of the buckets before the chunk
        for e0 in range(0, E + 1, CHUNK):  # (1)
            offs_e = e0 + tl.arange(0, CHUNK)
            count = tl.sum(((e[None, :] == offs_e[:, None]) & in_p[None, :]).to(tl.int32), axis=1)
            ends = carry + tl.cumsum((count + BM - 1) // BM, axis=0)
            tl.store(ends_ptr + offs_e, ends, mask=offs_e <= E)
            carry = tl.max(tl.where(offs_e <= E, ends, 0), axis=0)
        same = (e[:, None] == e[None, :]) & in_p[None, :]  # (2) [pair, other pair]
        rank = tl.sum((same & (offs_p[None, :] < offs_p[:, None])).to(tl.int32), axis=1)
        count = tl.sum(same.to(tl.int32), axis=1)
        tl.debug_barrier()  # ends written by all threads
        start = tl.load(ends_ptr + e, mask=in_p, other=0) - (count + BM - 1) // BM
        s0 = 0
        while s0 < total * BM:
            offs_s = s0 + tl.arange(0, CHUNK)
            tl.store(rows_ptr + offs_s, tl.full((CHUNK,), 0, tl.int32) + pairs, mask=offs_s < total * BM)
            s0 += CHUNK
        tl.debug_barrier()  # the padding before the pairs' rows over it
        tl.store(rows_ptr + start * BM + rank, offs_p, mask=in_p)
        b0 = 0
        while b0 < total:  # (3)
            offs_b = b0 + tl.arange(0, CHUNK)
            expert = tl.zeros((CHUNK,), dtype=tl.int32)
            for e0 in range(0, E + 1, CHUNK):
                offs_e = e0 + tl.arange(0, CHUNK)
                ends = tl.load(ends_ptr + offs_e, mask=offs_e <= E, other=2**30)
                expert += tl.sum((ends[None, :] <= offs_b[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + offs_b, tl.minimum(expert, E), mask=offs_b < total)
            b0 += CHUNK

    @triton.jit
    def _expert_inputs_kernel(z_ptr, x_ptr, y_ptr, stride_z, L: tl.constexpr, PERMUTE: tl.constexpr,
                              ZERO: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (row, BLOCK columns) of the expert kernels' inputs: the latents as bf16, in the lop3 K
        order where PERMUTE (per group of 32: the 16 even elements, then the 16 odd), and with ZERO the row of the
        fp32 sum the w2 kernel adds into, zeroed."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < L
        src = offs // 32 * 32 + offs % 16 * 2 + offs % 32 // 16 if PERMUTE else offs
        tl.store(x_ptr + row * L + offs, tl.load(z_ptr + row * stride_z + src, mask=mask).to(tl.bfloat16), mask=mask)
        if ZERO:
            tl.store(y_ptr + row * L + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)

    @triton.jit
    def _scatter_rows_kernel(src_ptr, index_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (row, BLOCK columns): row i of src copied to row index[i] of out (the same bits)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < WIDTH
        dest = tl.load(index_ptr + row).to(tl.int64)
        tl.store(out_ptr + dest * WIDTH + offs, tl.load(src_ptr + row * WIDTH + offs, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

# Most (token, slot) pairs whose blocks `_align_blocks_kernel` sorts in its one program (a decode step's: 16 tokens
# at top-16); more take the torch `align_blocks`.
ALIGN_KERNEL_MAX_PAIRS = 256


def align_blocks_fused(ids, num_experts, block_m, first=None):
    """`align_blocks(local_ids(ids, first, num_experts), num_experts, block_m)` (`first` None: the ids are local
    already) in one kernel launch, for up to ALIGN_KERNEL_MAX_PAIRS pairs: the same rows and blocks, bit for bit."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    total = max_blocks(pairs, num_experts + 1, block_m)
    rows = torch.empty(total * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(total, dtype=torch.int32, device=ids.device)
    ends = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    _align_blocks_kernel[(1,)](flat, ends, rows, block_expert, pairs, first or 0, total, E=num_experts, BM=block_m,
                               BLOCK_P=max(16, triton.next_power_of_2(pairs)), CHUNK=128, num_warps=8)
    return rows, block_expert


def _fit(block, size):
    """Largest power-of-two block <= `block` dividing `size` (sizes here are multiples of 32)."""
    while block > 32 and size % block:
        block //= 2
    return block


def pick_config(num_pairs, num_experts):
    return CONFIGS["decode" if num_pairs <= DECODE_MAX_PAIRS_PER_EXPERT * num_experts else "prefill"]


def run_experts(stack, z, ids, weights, num_experts, beta, linear_beta, config=None, upcast=None, atomic=None,
                h_dtype=None, fast_math=None, dot_scaled=None, first=None):
    """fp32 [N, L]: sum_k weights[:, k] * expert_{ids[:, k]}(z) over the stacked packs. z: [N, L]. With `weights`
    None each (token, slot)'s expert output on its own, [N, k, L] in `h_dtype`, unweighted (the caller weights and
    sums them, `fused_triton.pair_sum_norm`; no atomic combine).

    `first`: the ids are the router's, of which the stack holds experts `first` .. `first + num_experts - 1` (a
    rank's share under expert parallel); None: the stack's own indices, `num_experts` for another rank's expert.
    Pairs routed elsewhere do no work and add nothing to the weighted sum (their per-pair rows are not written).

    The intermediate activation (and each expert's output before weighting) is rounded to `h_dtype`, by default
    the activation dtype, as the reference does; the tests pass float32 to check the indexing exactly.
    `dot_scaled=True/False` is shorthand for upcast="dot_scaled"/"manual"."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    latent, inner = stack.latent, stack.inner
    shared = first is not None  # some pairs may be another rank's: their rows stay zero where torch sums them
    config = config or pick_config(pairs, num_experts)
    if upcast is None:
        upcast = ("dot_scaled" if dot_scaled else "manual") if dot_scaled is not None else config.get("upcast", UPCAST)
    if _INTERPRET:
        upcast = "manual"  # neither tl.dot_scaled nor inline PTX runs in the interpreter
    if upcast == "lop3" and not lop3_applies(stack):
        upcast = "dot_scaled"  # a scale code above LOP3_MAX_SCALE_CODE
    mode = _UPCAST_CODES[upcast]
    fast_math = config.get("fast_math", FAST_MATH) if fast_math is None else fast_math
    atomic = config.get("atomic", ATOMIC_COMBINE) if atomic is None else atomic
    atomic = atomic and weights is not None
    block_m = config["BM"]
    act = h_dtype or torch.bfloat16  # what the reference rounds the intermediate and each expert's output to
    # the kernels take bf16 activations (dot_scaled's "bf16" operand); the lop3 kernels in their K order
    x, y = expert_inputs(z, permute=mode == 2, zero_sum=atomic)
    pairs_mode = tokens == 1  # a single token's top-k experts are distinct: one block per pair, no sort
    if pairs_mode:  # the kernels subtract `first` from the router's ids themselves
        rows = block_expert = ids.reshape(-1)
    elif pairs <= ALIGN_KERNEL_MAX_PAIRS:
        rows, block_expert = align_blocks_fused(ids, num_experts, block_m, first)
        first = None
    else:
        local = ids if first is None else local_ids(ids, first, num_experts)
        rows, block_expert = align_blocks(local, num_experts, block_m)
        first = None
    first = first or 0
    blocks = block_expert.numel()
    h = torch.empty(pairs, inner, dtype=act, device=x.device)
    bn, bk, warps, stages = config["w13"]
    bn, bk = _fit(bn, inner), _fit(bk, latent)
    _w13_kernel[(blocks, inner // bn)](
        x, rows, block_expert, stack.w1, stack.s1, stack.w3, stack.s3, h,
        pairs, top_k, first, x.stride(0), h.stride(0), K=latent, N=inner,
        E=num_experts, BM=block_m, BN=bn, BK=bk, BETA=float(beta), LINEAR_BETA=float(linear_beta),
        UPCAST=mode, F32_DOT=_INTERPRET, FAST_MATH=fast_math, ACT=_TL_DTYPES[act], PAIRS=pairs_mode,
        num_warps=warps, num_stages=stages,
    )
    if not atomic:
        y = (torch.zeros if shared and weights is not None else torch.empty)(pairs, latent, dtype=act, device=x.device)
    flat_weights = y if weights is None else weights.reshape(-1).float().contiguous()  # y: a pointer never read
    bn, bk, warps, stages = config["w2"]
    bn, bk = _fit(bn, latent), _fit(bk, inner)
    _w2_kernel[(blocks, latent // bn)](
        h, rows, block_expert, stack.w2, stack.s2, flat_weights, y,
        pairs, top_k, first, h.stride(0), y.stride(0), K=inner, N=latent,
        E=num_experts, BM=block_m, BN=bn, BK=bk, UPCAST=mode, ATOMIC=atomic, F32_DOT=_INTERPRET, FAST_MATH=fast_math,
        ACT=_TL_DTYPES[act], PAIRS=pairs_mode, num_warps=warps, num_stages=stages,
    )
    if atomic:
        return y
    y = y.view(tokens, top_k, latent)
    return y if weights is None else (y.float() * flat_weights.view(tokens, top_k, 1)).sum(1)


def expert_inputs(z, permute, zero_sum):
    """The expert kernels' inputs from the latents z [N, L], in one launch where any work is needed: (bf16 z, in the
    lop3 K order with `permute`: per group of 32 the 16 elements of low nibbles, then the 16 of high ones; with
    `zero_sum` a zeroed fp32 [N, L] for the w2 kernel's weighted sum, else None)."""
    tokens, latent = z.shape
    if not permute and not zero_sum and z.dtype == torch.bfloat16 and z.stride(-1) == 1:
        return z, None
    z = z if z.stride(-1) == 1 else z.contiguous()
    x = torch.empty(tokens, latent, dtype=torch.bfloat16, device=z.device)
    y = torch.empty(tokens, latent, dtype=torch.float32, device=z.device) if zero_sum else x  # x: not written
    block = min(1024, triton.next_power_of_2(latent))
    _expert_inputs_kernel[(tokens, triton.cdiv(latent, block))](z, x, y, z.stride(0), L=latent, PERMUTE=permute,
                                                                ZERO=zero_sum, BLOCK=block, num_warps=4)
    return x, (y if zero_sum else None)


def dequantize(packed, scale, out=None, out_rows=None):
    """bf16 values of MXFP4 packs [..., R, K/2] with E8M0 codes [..., R, K/32], as `mxfp4.dequantize_unchecked`
    computes them (bit for bit). `out` [..., out_rows, K] (a view whose rows are contiguous, e.g. one half of a
    [E, 2 * inner, L] buffer) receives pack row r of group g at its row r of group g; default a new [..., R, K]."""
    rows, half = packed.shape[-2:]
    if out is None:
        out = torch.empty(*packed.shape[:-1], 2 * half, dtype=torch.bfloat16, device=packed.device)
    out_rows = out.shape[-2] if out_rows is None else out_rows
    # a release row (1792 or 1536 bytes) a one-warp program: w1 3.18, w2 3.27 TB/s against 3.07 / 2.69 at 2 warps
    # (bench/results/prefill_20/explore_call6.json; 1024-byte blocks were slower, explore_call4)
    block = min(2048, triton.next_power_of_2(half))
    _dequant_kernel[(packed.numel() // half, triton.cdiv(half, block))](
        packed, scale, out.view(torch.int32), HALF=half, ROWS=rows, OUT_ROWS=out_rows, BLOCK=block, num_warps=1)
    return out


def situ_glu(gate, up, beta, linear_beta):
    """SiTU-GLU of gate and up values [..., inner] (the model's `situ_glu`: fp32, rounded to gate's dtype), in one
    pass; each may be a view with its own row stride (e.g. the two halves of rows [w1 z, w3 z])."""
    shape, inner = gate.shape, gate.shape[-1]
    gate, up = gate.reshape(-1, inner), up.reshape(-1, inner)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    rows = gate.shape[0]
    out = torch.empty(rows, inner, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(inner))
    if rows:
        _situ_glu_kernel[(rows, triton.cdiv(inner, block))](
            gate, up, out, gate.stride(0), up.stride(0), INNER=inner, BETA=float(beta), LINEAR_BETA=float(linear_beta),
            BLOCK=block, num_warps=4)
    return out.view(shape)


def scatter_rows(src, index, out):
    """`out[index[i]] = src[i]` for the rows of src [R, W] (out [*, W], both contiguous): what `out.index_copy_(0,
    index, src)` does, at the copy rate (torch's index kernel moved ~1.25 TB/s on an H100 for the experts' 7 KB
    rows, bench/results/prefill_20/profile_8k_h100.log)."""
    rows, width = src.shape
    block = min(2048, triton.next_power_of_2(width))
    if rows:
        _scatter_rows_kernel[(rows, triton.cdiv(width, block))](src, index, out, WIDTH=width, BLOCK=block, num_warps=4)
    return out


def run_experts_upcast_once(stack, z, ids, num_experts, beta, linear_beta, chunk_bytes=None):
    """Each (token, slot)'s expert output `expert_{ids[:, k]}(z)`, bf16 [N, k, L], unweighted, for prompts: each expert's packs
    are upcast to bf16 once per call (`dequantize`, a chunk of experts at a time, at most `chunk_bytes` of bf16
    weights), then every expert runs on its own rows in one grouped bf16 GEMM per projection (`torch._grouped_mm`,
    the pairs sorted by expert), the upcast's cost shared by all of an expert's tokens. The numerics are the
    reference's (`KimiK3LatentMoE.packed_experts`): bf16 matmul outputs, SiTU-GLU in fp32, each expert's output
    rounded to bf16 (the block weights it in fp32). Pairs with id `num_experts` (another rank's) give zero rows.
    One host read of the per-expert counts (the chunks' row ranges): not for CUDA-graph capture."""
    tokens, top_k = ids.shape
    latent, inner = stack.latent, stack.inner
    chunk_bytes = UPCAST_ONCE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
    x = z.to(torch.bfloat16)[order // top_k]
    fill = torch.zeros if counts.pop() else torch.empty  # every pair is written unless some are another rank's
    outputs = fill(tokens * top_k, latent, dtype=torch.bfloat16, device=z.device)
    step = max(1, chunk_bytes // (3 * latent * inner * 2))
    w13 = torch.empty(min(step, num_experts), 2 * inner, latent, dtype=torch.bfloat16, device=z.device)
    w2 = torch.empty(min(step, num_experts), latent, inner, dtype=torch.bfloat16, device=z.device)
    start = 0
    for first in range(0, num_experts, step):
        sizes = counts[first : first + step]
        rows = sum(sizes)
        if not rows:
            continue
        group = slice(first, first + len(sizes))
        dequantize(stack.w1[group], stack.s1[group], w13[: len(sizes), :inner], out_rows=2 * inner)
        dequantize(stack.w3[group], stack.s3[group], w13[: len(sizes), inner:], out_rows=2 * inner)
        dequantize(stack.w2[group], stack.s2[group], w2[: len(sizes)])
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=z.device, dtype=torch.int32)
        h = torch._grouped_mm(x[start : start + rows], w13[: len(sizes)].transpose(1, 2), offs=ends)
        act = situ_glu(h[:, :inner], h[:, inner:], beta, linear_beta)
        out = torch._grouped_mm(act, w2[: len(sizes)].transpose(1, 2), offs=ends)
        scatter_rows(out, order[start : start + rows], outputs)  # back to the (token, slot) order
        start += rows
    return outputs.view(tokens, top_k, latent)


def _stack_on(moe, device, caller):
    stack = moe.stack_experts()
    if stack is None or stack.w1.device != device:
        raise ValueError(f"mxfp4_triton.{caller}: the experts of a {moe.num_experts}-expert block are not stacked "
                         f"on {device}")
    return stack


def routed_experts(moe, z, ids):
    """`modeling_kimi_k3.routed_experts` through the Triton kernels: each (token, slot)'s expert output, unweighted,
    [N, k, L] in bf16 (z's dtype there), rows of pairs with id `num_experts` (another rank's) unwritten."""
    stack = _stack_on(moe, z.device, "routed_experts")
    expert = moe.experts
    if upcast_once_pays(ids.numel(), moe.num_experts, z.device):
        pairs = run_experts_upcast_once(stack, z, ids, moe.num_experts, expert.beta, expert.linear_beta)
    else:
        pairs = run_experts(stack, z, ids, None, moe.num_experts, expert.beta, expert.linear_beta)
    return pairs.to(z.dtype)  # the kernels compute in bf16: a no-op for the model's bf16 activations


def routed_expert_sum(moe, z, ids, weights, first):
    """`modeling_kimi_k3.routed_expert_sum` through the Triton kernels: the w2 kernel adds each of the rank's
    pairs, weighted in fp32, into the token's row (at decode, with the router's ids as they are: no id remap, no
    per-pair rows, no separate sum); a prompt's grouped-GEMM path sums its per-pair rows in torch."""
    stack = _stack_on(moe, z.device, "routed_expert_sum")
    expert = moe.experts
    if upcast_once_pays(ids.numel(), moe.num_experts, z.device):
        pairs = run_experts_upcast_once(stack, z, local_ids(ids, first, moe.num_experts), moe.num_experts,
                                        expert.beta, expert.linear_beta)
        return (pairs.to(z.dtype).float() * weights.float().unsqueeze(-1)).sum(1, keepdim=True)
    return run_experts(stack, z, ids, weights, moe.num_experts, expert.beta, expert.linear_beta, atomic=True,
                       first=first).unsqueeze(1)


def upcast_once_pays(pairs, num_experts, device):
    """Whether a call of `pairs` (token, expert) pairs takes `run_experts_upcast_once`: enough pairs per expert, a
    GPU with torch's grouped GEMM (SM90+), and no CUDA graph being captured (that path reads counts on the host)."""
    return (pairs >= UPCAST_ONCE_MIN_PAIRS_PER_EXPERT * num_experts and hasattr(torch, "_grouped_mm")
            and torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and not torch.cuda.is_current_stream_capturing())
