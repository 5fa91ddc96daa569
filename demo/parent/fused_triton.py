"""Triton kernels that fuse a decode step's chains of small ops into one launch each (CUDA; optional fast path).

At decode every op of the model touches a few KiB, so a step's time goes to launching ~2,000 kernels rather than to
moving bytes. Each kernel here replaces one such chain with the same fp32 math:

  * `attn_res_mix`: the Block Attention Residuals depth mix `sum_j softmax_j(proj(norm(v_j))) v_j` over stacked
    sources (torch: ~12 kernels; here 1, after the stack).

The model calls these only for CUDA tensors where `available()`; everywhere else, and as the reference the tests
compare against, it runs its own torch code. Sums run in another order than torch's, so results agree to fp32
rounding, then to one bf16 ulp after the final cast.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the model uses its torch code
    triton = None
    tl = None

# Set to False (or KIMI_K3_FUSED=0) to run the model's torch code instead; benchmarks and tests compare the two.
ENABLED = os.environ.get("KIMI_K3_FUSED", "1") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(x):
    """True where the fused kernels would run for tensor `x`."""
    return ENABLED and triton is not None and (x.is_cuda or _INTERPRET)


if triton is not None:

    @triton.jit
    def _attn_res_mix_kernel(src_ptr, norm_w_ptr, proj_w_ptr, out_ptr, n, rows, eps, H: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per row (token): two passes over its n sources [n, rows, H]: first each source's sum of
        squares and its dot with norm_w * proj_w (the score is that dot / rms), then the softmax-weighted sum."""
        row = tl.program_id(0).to(tl.int64)
        offs_n = tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        base = src_ptr + offs_n[:, None].to(tl.int64) * rows * H + row * H  # [BLOCK_N, 1]
        squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dots = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < H
            v = tl.load(base + offs_h[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
            w = (tl.load(norm_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
                 * tl.load(proj_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32))
            squares += tl.sum(v * v, axis=1)
            dots += tl.sum(v * w[None, :], axis=1)
        scores = tl.where(n_mask, dots / tl.sqrt(squares / H + eps), float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        p = p / tl.sum(p, axis=0)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < H
            v = tl.load(base + offs_h[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
            mixed = tl.sum(v * p[:, None], axis=0)
            tl.store(out_ptr + row * H + offs_h, mixed.to(out_ptr.dtype.element_ty), mask=h_mask)


def attn_res_mix(stacked, norm_weight, proj_weight, eps):
    """`sum_j softmax_j((v_j / rms(v_j)) . (norm_weight * proj_weight)) v_j` over dim 0 of `stacked` [n, ..., H],
    in fp32, returned in stacked's dtype with shape [..., H]."""
    stacked = stacked.contiguous()
    n, hidden = stacked.shape[0], stacked.shape[-1]
    rows = stacked[0].numel() // hidden
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    block_n = triton.next_power_of_2(n)
    block_h = min(triton.next_power_of_2(hidden), max(64, 4096 // block_n))
    _attn_res_mix_kernel[(rows,)](stacked, norm_weight, proj_weight, out, n, rows, float(eps), H=hidden,
                                  BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4)
    return out
