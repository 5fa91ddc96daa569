"""Triton kernels that fuse a decode step's chains of small ops into one launch each (CUDA; optional fast path).

At decode every op of the model touches a few KiB, so a step's time goes to launching ~2,000 kernels rather than to
moving bytes. Each kernel here replaces one such chain with the same fp32 math:

  * `attn_res_mix`: the Block Attention Residuals depth mix `sum_j softmax_j(proj(norm(v_j))) v_j` over the block
    bank (stacked once a block, see the model's `BlockBank`) and the current partial sum, and the RMSNorm of the
    sublayer that reads it (torch: a stack and ~13 kernels; here 1), after attention also adding the attention's
    output to the partial sum as it reads it;
  * `short_conv`: KDA's causal depthwise convolutions + SiLU of q, k and v with their conv histories (torch: ~15
    kernels with the concatenations and copies; here 1), writing a static cache's history buffers in place;
  * `router_topk`: the MoE router after its GEMM: sigmoid, the bias-corrected top-k, the chosen scores gathered,
    renormalised and scaled (torch: ~8 kernels; here 1);
  * `pair_sum_norm`: the LatentMoE's sum of its per-(token, slot) expert outputs, rounded to the activation dtype,
    and the RMSNorm after it (torch: 3 kernels; here 1);
  * `gated_rms_norm`: KDA's per-head output norm times its sigmoid gate (torch: a cast, the norm, the sigmoid and
    the product, 4 kernels; here 1; at a prompt, fla's fp32 output is read once instead of four passes);
  * `kda_decode_step`: a whole KDA decode step after the projections, one program a (row, head): the short convs,
    the gate, beta, L2 norms, the delta rule on the fp32 state (read once, written once, in place) and the gated
    output norm (the three conv kernels, fla's zeroed output and recurrent kernel, and the gated norm: 6 launches;
    here 1);
  * `mla_keys`, `sigmoid_gated_heads`: at an MLA prompt, the per-head keys SDPA reads (each head's k_nope beside
    the shared k_r: a copy at the copy bandwidth where torch's concatenation of an expanded k_r ran at a fifth of
    it) and the output gate applied while the heads' outputs are put back in token order (torch: 3 kernels);
  * `latent_keys`: MLA's latent of the new tokens, its first part RMS-normed, written into a static cache's buffer
    at their positions (torch: the norm, a concatenation and an index copy; here 1);
  * `latent_attention`: MLA's one-query attention in the latent space, split over the cached keys (flash
    decoding: each program an online softmax over its keys, one more kernel combining them), reading only the keys
    up to the query's position, which it takes from device memory, so a static cache's unfilled tail costs nothing
    and a CUDA graph stays valid as the context grows (torch: ~8 kernels over every cached slot).

The model calls these where its `fused` fast path is on (on CUDA, where triton imports, by default); everywhere
else, and as the reference the tests compare against, it runs its own torch code. Sums run in another order than torch's, so results agree to fp32
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

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# The widest row a one-program-a-row kernel here takes (the depth mix, the pair sum + norm).
MAX_ROW_WIDTH = 16384


def _refuse(kernel, what):
    raise ValueError(f"fused_triton.{kernel}: {what} (the dispatch resolves shapes it cannot run to the reference)")


def supported(device):
    """True where these kernels can run for tensors on `device` (CUDA, or any device in Triton's interpreter)."""
    return triton is not None and (torch.device(device).type == "cuda" or _INTERPRET)


if triton is not None:

    @triton.jit
    def _attn_res_mix_kernel(bank_ptr, last_ptr, delta_ptr, sum_ptr, norm_w_ptr, proj_w_ptr, out_w_ptr, out_ptr, rows,
                             eps, out_eps, mask_ptr, pos_ptr, tokens, mask_stride, N: tl.constexpr, H: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, MASKED: tl.constexpr,
                             HAS_DELTA: tl.constexpr):
        """One program per row (token) over its N sources, the first N - 1 from the stacked bank [N - 1, rows, H]
        and the last from [rows, H], a whole source row per load (BLOCK_H >= H): first each source's score, its dot
        with norm_w * proj_w over its rms; then, reading the same rows again (from L2: the program read them just
        before), the softmax-weighted sum in source order, fp32, rounded to the output dtype; then its RMSNorm
        (weight out_w). Sums over H happen once per source, not once per tile. With MASKED, row b * tokens + t is
        zeros where the key mask (rows mask_stride apart) holds 0 at the token's position pos[t] (a padding token).
        With HAS_DELTA the last source is last + delta (rounded to last's dtype, as a torch add is), also stored to
        sum_ptr."""
        row = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        offs_n = tl.arange(0, BLOCK_N)
        w = (tl.load(norm_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
             * tl.load(proj_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32))
        last = tl.load(last_ptr + row * H + offs_h, mask=h_mask, other=0.0)
        if HAS_DELTA:
            last = (last.to(tl.float32) + tl.load(delta_ptr + row * H + offs_h, mask=h_mask, other=0.0).to(
                tl.float32)).to(last.dtype)
            tl.store(sum_ptr + row * H + offs_h, last, mask=h_mask)
        last = last.to(tl.float32)
        scores = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        for j in range(N - 1):
            v = tl.load(bank_ptr + (j * rows + row) * H + offs_h, mask=h_mask, other=0.0).to(tl.float32)
            score = tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
            scores = tl.where(offs_n == j, score, scores)
        score = tl.sum(last * w, axis=0) / tl.sqrt(tl.sum(last * last, axis=0) / H + eps)
        scores = tl.where(offs_n == N - 1, score, scores)
        p = tl.exp(scores - tl.max(scores, axis=0))
        p = p / tl.sum(p, axis=0)
        mixed = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(N - 1):
            v = tl.load(bank_ptr + (j * rows + row) * H + offs_h, mask=h_mask, other=0.0).to(tl.float32)
            mixed += v * tl.sum(tl.where(offs_n == j, p, 0.0), axis=0)
        mixed += last * tl.sum(tl.where(offs_n == N - 1, p, 0.0), axis=0)
        mixed = mixed.to(out_ptr.dtype.element_ty).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(mixed * mixed, axis=0) / H + out_eps)
        out_w = tl.load(out_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        out = mixed * rstd * out_w
        if MASKED:
            position = tl.load(pos_ptr + row % tokens)
            out = tl.where(tl.load(mask_ptr + (row // tokens) * mask_stride + position) != 0, out, 0.0)
        tl.store(out_ptr + row * H + offs_h, out.to(out_ptr.dtype.element_ty), mask=h_mask)

    @triton.jit
    def _short_conv_kernel(x_ptr, w_ptr, state_ptr, y_ptr, new_state_ptr, T, D, stride_xb, stride_xt, stride_yb,
                           stride_yt, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr):
        """One program per (row, BLOCK_T tokens, BLOCK_D channels) of one conv: y[t] = silu(sum_j w_j in[t + j])
        over in = [state (K-1 inputs), x] per channel, summed in fp32 and rounded to x's dtype before and after the
        SiLU (as the torch code does), then stored in y's dtype. The programs of the first token block also write
        the new state, the last K-1 inputs (BLOCK_T >= K-1, so no other program reads the old state: it may be the
        same buffer)."""
        b = tl.program_id(0).to(tl.int64)
        t0 = tl.program_id(1) * BLOCK_T
        offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        state_row = state_ptr + b * D * (K - 1) + offs_d * (K - 1)  # [BLOCK_D]: this row's history per channel
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for j in tl.static_range(K):
            s = offs_t + j - (K - 1)  # input index; < 0 reads the history
            from_x = tl.load(x_ptr + b * stride_xb + s[:, None] * stride_xt + offs_d[None, :],
                             mask=(s[:, None] >= 0) & t_mask[:, None] & d_mask[None, :], other=0.0)
            from_state = tl.load(state_row[None, :] + (s[:, None] + K - 1),
                                 mask=(s[:, None] < 0) & t_mask[:, None] & d_mask[None, :], other=0.0)
            tap = tl.where(s[:, None] >= 0, from_x.to(tl.float32), from_state.to(tl.float32))
            w = tl.load(w_ptr + offs_d * K + j, mask=d_mask, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
            acc += tap * w[None, :]
        y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + b * stride_yb + offs_t[:, None] * stride_yt + offs_d[None, :], y,
                 mask=t_mask[:, None] & d_mask[None, :])
        if t0 == 0:  # the new history: inputs T-(K-1) .. T-1 of [state, x]
            offs_i = tl.arange(0, BLOCK_S)
            i_mask = (offs_i < K - 1)[:, None] & d_mask[None, :]
            src = (T + offs_i - (K - 1))[:, None]
            last_x = tl.load(x_ptr + b * stride_xb + src * stride_xt + offs_d[None, :], mask=i_mask & (src >= 0),
                             other=0.0)
            last_state = tl.load(state_row[None, :] + (src + K - 1), mask=i_mask & (src < 0), other=0.0)
            new = tl.where(src >= 0, last_x.to(tl.float32), last_state.to(tl.float32))
            tl.store(new_state_ptr + b * D * (K - 1) + offs_d[None, :] * (K - 1) + offs_i[:, None],
                     new.to(new_state_ptr.dtype.element_ty), mask=i_mask)

    @triton.jit
    def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, scaling, K: tl.constexpr,
                            BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
        """One row: top-K of sigmoid(logit) + bias, by one tl.topk over int64 keys (the biased score's bits made
        order-preserving, above the inverted expert index, so ties go to the lower index), then the chosen
        unbiased scores, renormalised (+1e-20) and scaled."""
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        logit = tl.load(logits_ptr + row * E + e, mask=valid, other=0.0)
        biased = tl.sigmoid(logit) + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        bits = biased.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        ordered = tl.where(valid, ordered, -2147483648)
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
        top = tl.topk(key, K)  # [K], descending
        ids = BLOCK_E - 1 - (top & 0xFFFFFFFF)
        weights = tl.sigmoid(tl.load(logits_ptr + row * E + ids))
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        slots = tl.arange(0, K)
        tl.store(ids_ptr + row * K + slots, ids)
        tl.store(weights_ptr + row * K + slots, weights * scaling)

    @triton.jit
    def _pair_sum_norm_kernel(pairs_ptr, weights_ptr, w_ptr, out_ptr, L, eps, K: tl.constexpr, BLOCK_L: tl.constexpr,
                              WEIGHTED: tl.constexpr, NORM: tl.constexpr):
        """One row: sum_j fp32(pairs[row, j, :]) (times weights[row, j] in fp32 where WEIGHTED) in slot order,
        rounded to the output dtype, then its RMSNorm."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_L)
        mask = offs < L
        acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
        for j in range(K):
            term = tl.load(pairs_ptr + (row * K + j) * L + offs, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                term = term * tl.load(weights_ptr + row * K + j)
            acc += term
        y = acc.to(out_ptr.dtype.element_ty)
        if NORM:
            r = y.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / L + eps)
            y = (r * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * L + offs, y, mask=mask)


    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, rows, eps, D: tl.constexpr, BLOCK_R: tl.constexpr):
        """BLOCK_R rows of D values a program: x rounded to the output dtype, its RMSNorm in fp32 times the weight,
        rounded; sigmoid(g) in fp32, rounded; their product, rounded (the torch code's roundings)."""
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs = row[:, None] * D + tl.arange(0, D)[None, :]
        mask = (row < rows)[:, None]
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
        y = (x * rstd[:, None] * w[None, :]).to(dtype).to(tl.float32)
        gate = tl.sigmoid(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + offs, (y * gate).to(dtype), mask=mask)

    @triton.jit
    def _mla_keys_kernel(kv_ptr, latent_ptr, out_ptr, keys, H, stride_lb, stride_lt, KV: tl.constexpr,
                         NOPE: tl.constexpr, ROPE: tl.constexpr, C: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """One token's keys for BLOCK_H heads: each head's k_nope (the first NOPE of its KV values) and then the
        token's shared k_r (the latent's ROPE values after its first C), copied."""
        n = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = (offs_h < H)[:, None]
        nope, rope = offs_d < NOPE, (offs_d >= NOPE) & (offs_d < NOPE + ROPE)
        k_nope = tl.load(kv_ptr + (n * H + offs_h[:, None]) * KV + offs_d[None, :], mask=h_mask & nope[None, :])
        row = latent_ptr + (n // keys) * stride_lb + (n % keys) * stride_lt + C
        k_r = tl.load(row + offs_d - NOPE, mask=rope)
        k = tl.where(nope[None, :], k_nope, k_r[None, :])
        tl.store(out_ptr + (n * H + offs_h[:, None]) * (NOPE + ROPE) + offs_d[None, :], k,
                 mask=h_mask & (offs_d < NOPE + ROPE)[None, :])

    @triton.jit
    def _latent_keys_kernel(kv_ptr, w_ptr, buf_ptr, pos_ptr, stride_kb, stride_kt, stride_bb, stride_bt, eps,
                            C: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (row, token): the token's kv_a output [c, k_r] (W values) with c RMS-normed (fp32, weight
        w, rounded to the input dtype), written to the row's buffer at the token's position."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        in_c, in_w = offs < C, offs < W
        row = tl.load(kv_ptr + b * stride_kb + t * stride_kt + offs, mask=in_w, other=0.0)
        x = tl.where(in_c, row.to(tl.float32), 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
        normed = (x * rstd * tl.load(w_ptr + offs, mask=in_c, other=0.0).to(tl.float32)).to(row.dtype)
        position = tl.load(pos_ptr + t).to(tl.int64)
        tl.store(buf_ptr + b * stride_bb + position * stride_bt + offs, tl.where(in_c, normed, row), mask=in_w)

    @triton.jit
    def _sigmoid_gated_heads_kernel(attn_ptr, g_ptr, out_ptr, T, H, stride_ab, stride_ah, stride_at, stride_gb,
                                    stride_gt, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token's outputs of BLOCK_H heads, read from the attention's [B, heads, T, D] layout and written in
        the token's row of [B, T, heads * D], times sigmoid(g) (g's rows `stride_gb` / `stride_gt` apart; in fp32,
        rounded to g's dtype, as torch.sigmoid does), the product rounded."""
        n = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < H)[:, None] & (offs_d < D)[None, :]
        a = tl.load(attn_ptr + (n // T) * stride_ab + (n % T) * stride_at + offs_h[:, None] * stride_ah
                    + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        row = (n * H + offs_h[:, None]) * D + offs_d[None, :]
        g = tl.load(g_ptr + (n // T) * stride_gb + (n % T) * stride_gt + offs_h[:, None] * D + offs_d[None, :],
                    mask=mask, other=0.0)
        gate = tl.sigmoid(g.to(tl.float32)).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + row, (a * gate).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _latent_split_keys(pos_ptr, NS, STEP: tl.constexpr):
        """Keys per split: the keys up to the query's position (read from device memory) shared by the NS
        splits, in multiples of STEP, so every context keeps all splits busy and a graph replays at any."""
        return tl.cdiv(tl.cdiv(tl.load(pos_ptr).to(tl.int32) + 1, NS), STEP) * STEP

    @triton.jit
    def _latent_keys_step(q_c, q_r, row_keys, row_valid, n0, end, q_pos, scale, m, l, acc, C, R, offs_c, offs_r,
                          c_mask, r_mask, BLOCK_N: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr):
        """One online-softmax step over keys n0 .. n0 + BLOCK_N - 1 (those from `end` on are masked: not read):
        returns the updated running max m, sum of p l and weighted latent sum acc."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k_row = row_keys + offs_n[:, None].to(tl.int64) * (C + R)
        k_c = tl.load(k_row + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        k_r = tl.load(k_row + C + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if IEEE:
            s = (tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
                 + tl.dot(q_r, tl.trans(k_r), input_precision="ieee"))
        else:
            s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        valid = n_mask
        if HAS_VALID:
            valid = valid & ((tl.load(row_valid + offs_n, mask=n_mask, other=0) != 0) | (offs_n == q_pos))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        return m_new, l, acc

    @triton.jit
    def _latent_attention_split_kernel(qc_ptr, qr_ptr, kv_ptr, valid_ptr, pos_ptr, acc_ptr, ml_ptr, H, C, R, NS,
                                       stride_qcb, stride_qch, stride_qrb, stride_qrh, stride_kb, stride_vb, scale,
                                       BLOCK_H: tl.constexpr,
                                       BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                                       HAS_VALID: tl.constexpr, IEEE: tl.constexpr, STEP: tl.constexpr,
                                       PIPELINED: tl.constexpr, PLAIN_MAX_KEYS: tl.constexpr):
        """One program per (row, split, BLOCK_H heads): the online softmax of the heads' scores q_c . c_j +
        q_r . r_j over the split's share of the keys j <= the query's position (and, with HAS_VALID, not padding,
        or the query's own), accumulating sum_j p_j c_j; stores that unnormalised sum, the running max and the sum
        of p (fp32). Splits wholly past the query's position return at once. Two builds share the work by the keys
        a split walks (multiples of STEP): PIPELINED, Triton's software-pipelined loop, takes splits of more than
        PLAIN_MAX_KEYS, the other a plain loop the rest (see LATENT_CONFIG); each returns at once on the other's."""
        b = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        q_pos = tl.load(pos_ptr).to(tl.int32)
        keys = _latent_split_keys(pos_ptr, NS, STEP)
        start = split * keys
        if start > q_pos:
            return
        if PIPELINED:
            if keys <= PLAIN_MAX_KEYS:
                return
        elif keys > PLAIN_MAX_KEYS:
            return
        end = tl.minimum(start + keys, q_pos + 1)
        offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
        c_mask, r_mask = offs_c < C, offs_r < R
        q_c = tl.load(qc_ptr + b * stride_qcb + offs_h[:, None] * stride_qch + offs_c[None, :],
                      mask=h_mask[:, None] & c_mask[None, :], other=0.0)
        q_r = tl.load(qr_ptr + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                      mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
        row_keys, row_valid = kv_ptr + b * stride_kb, valid_ptr + b * stride_vb
        if PIPELINED:
            for n0 in range(start, end, BLOCK_N):
                m, l, acc = _latent_keys_step(q_c, q_r, row_keys, row_valid, n0, end, q_pos, scale, m, l, acc, C, R,
                                              offs_c, offs_r, c_mask, r_mask, BLOCK_N, HAS_VALID, IEEE)
        else:  # also what Triton's interpreter runs: it has no `range` over run-time bounds
            n0 = start
            while n0 < end:
                m, l, acc = _latent_keys_step(q_c, q_r, row_keys, row_valid, n0, end, q_pos, scale, m, l, acc, C, R,
                                              offs_c, offs_r, c_mask, r_mask, BLOCK_N, HAS_VALID, IEEE)
                n0 += BLOCK_N
        part = (b * NS + split) * H + offs_h
        tl.store(acc_ptr + part[:, None] * C + offs_c[None, :], acc, mask=h_mask[:, None] & c_mask[None, :])
        tl.store(ml_ptr + part * 2, m, mask=h_mask)
        tl.store(ml_ptr + part * 2 + 1, l, mask=h_mask)

    @triton.jit
    def _latent_attention_combine_kernel(acc_ptr, ml_ptr, pos_ptr, out_ptr, H, C, NS, STEP: tl.constexpr,
                                         BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """One program per (row, head, BLOCK_C latent columns): the splits' partial sums rescaled to their common
        max and divided by the total sum of p; only the splits the query's position reached are read."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < C
        active = tl.cdiv(tl.load(pos_ptr).to(tl.int32) + 1, _latent_split_keys(pos_ptr, NS, STEP))
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < active
        part = (b * NS + offs_s) * H + h
        m = tl.load(ml_ptr + part * 2, mask=s_mask, other=-1e30)
        l = tl.load(ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
        w = tl.where(s_mask, tl.exp(m - tl.max(m, axis=0)), 0.0)
        acc = tl.load(acc_ptr + part[:, None] * C + offs_c[None, :], mask=s_mask[:, None] & c_mask[None, :],
                      other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + (b * H + h) * C + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _conv_step(x_row, w_ptr, hist_row, hist_out_row, channels, K: tl.constexpr):
        """One token's causal conv + SiLU over `channels` of one row: sum_j w_j in_j over in = [the K-1 inputs of
        the history, x] in fp32 (history and weight in x's dtype first), rounded to x's dtype before and after the
        SiLU, as `short_conv` does; returned in fp32. The history moves on by one input (x), written to hist_out_row
        after every tap was read (it may be the same buffer: each value is read and written by the same thread)."""
        x = tl.load(x_row + channels)
        acc = tl.zeros(channels.shape, dtype=tl.float32)
        for j in tl.static_range(K - 1):
            tap = tl.load(hist_row + channels * (K - 1) + j).to(x.dtype)
            acc += tap.to(tl.float32) * tl.load(w_ptr + channels * K + j).to(x.dtype).to(tl.float32)
            if j > 0:
                tl.store(hist_out_row + channels * (K - 1) + j - 1, tap.to(hist_out_row.dtype.element_ty))
        acc += x.to(tl.float32) * tl.load(w_ptr + channels * K + K - 1).to(x.dtype).to(tl.float32)
        tl.store(hist_out_row + channels * (K - 1) + K - 2, x.to(hist_out_row.dtype.element_ty))
        y = acc.to(x.dtype).to(tl.float32)
        return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)

    @triton.jit
    def _kda_decode_step_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v, q_w_ptr, k_w_ptr, v_w_ptr,
                                q_hist_ptr, k_hist_ptr, v_hist_ptr, q_hist_out_ptr, k_hist_out_ptr, v_hist_out_ptr,
                                g_ptr, beta_ptr, gate_ptr, stride_g, stride_beta, stride_gate, a_log_ptr, dt_bias_ptr,
                                state_ptr, state_out_ptr, norm_w_ptr, out_ptr, H, lower_bound, scale, eps,
                                D: tl.constexpr, K: tl.constexpr, LOWER_BOUND: tl.constexpr):
        """One program per (row, head): the head's short convs of q, k, v (histories [B, H * D, K-1], moved on in
        place), q and k L2-normed (q scaled), the decay `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` (with
        LOWER_BOUND, else `-exp(A_log) * softplus(g + dt_bias)`) and beta = sigmoid(b), one delta-rule step of the
        head's fp32 state [D, D] (read once, written once), its output o = S^T q, then o rounded to the output dtype,
        its RMSNorm times the weight and times sigmoid(gate), each rounded as `gated_rms_norm` rounds. The program
        owns its head's channels of every history and its state: no other program reads what it overwrites."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, D)
        channels = h * D + offs
        hist = b * H * D * (K - 1)
        q = _conv_step(q_ptr + b * stride_q, q_w_ptr, q_hist_ptr + hist, q_hist_out_ptr + hist, channels, K)
        k = _conv_step(k_ptr + b * stride_k, k_w_ptr, k_hist_ptr + hist, k_hist_out_ptr + hist, channels, K)
        v = _conv_step(v_ptr + b * stride_v, v_w_ptr, v_hist_ptr + hist, v_hist_out_ptr + hist, channels, K)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        x = (tl.load(g_ptr + b * stride_g + channels).to(tl.float32)
             + tl.load(dt_bias_ptr + channels).to(tl.float32))
        a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        if LOWER_BOUND:
            g = lower_bound * tl.sigmoid(a * x)
        else:  # softplus as torch's: x itself above 20
            g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        beta = tl.sigmoid(tl.load(beta_ptr + b * stride_beta + h).to(tl.float32))
        tile = (b * H + h) * D * D + offs[:, None] * D + offs[None, :]
        s = tl.load(state_ptr + tile) * tl.exp(g)[:, None]
        delta = beta * (v - tl.sum(k[:, None] * s, axis=0))
        s += k[:, None] * delta[None, :]
        tl.store(state_out_ptr + tile, s)
        dtype = out_ptr.dtype.element_ty
        o = tl.sum(q[:, None] * s, axis=0).to(dtype).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)
        y = (o * rstd * tl.load(norm_w_ptr + offs).to(tl.float32)).to(dtype).to(tl.float32)
        gate = tl.sigmoid(tl.load(gate_ptr + b * stride_gate + channels).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + b * H * D + channels, (y * gate).to(dtype))


# latent_attention's programs: heads per program, warps, the programs aimed at (batch x splits x head groups), the
# most keys a split walks in a plain loop, and per build (keys per inner step, pipeline stages): the plain loop for
# short splits, the pipelined one for long (its start-up costs more than a split of one or two steps takes). The
# fastest of a sweep on the H200 at the release's MLA shape (96 heads, 512 + 64 latent, bf16, batch 1) over one
# static cache of 131,073 latents with the query at 2,048 / 32,768 / 131,072 (bench/results/prefill_20/
# explore_call3.json): the plain loop alone 0.026 / 0.127 / 0.365 ms (32 keys a step), the pipelined one alone
# 0.098 / 0.116 / 0.235 ms (64 keys, 2 stages); the kernel before (splits fixed by the cache size): 0.229 / 0.232 /
# 0.236 ms.
LATENT_CONFIG = dict(heads=64, warps=8, programs=256, plain_max_keys=256, plain=(32, 3), pipelined=(64, 2))


def latent_attention(q_latent, q_rope, latent, position, key_mask, scale):
    """One query's attention over cached latents: `q_latent` [B, H, C] (the absorbed no-position part, against the
    latent's first C values) and `q_rope` [B, H, R] (against its last R), each with its last dim contiguous (no copy
    into one query), `latent` [B, keys, C + R], `position` a one-element device tensor (the query's absolute
    position: keys after it are not read), `key_mask` [B, >= keys] (0 = padding; None: none) or None. Returns
    softmax_j(scale * q . latent_j) . latent_j[:C] as [B, H, C] in q_latent's dtype."""
    batch, heads, latent_width = q_latent.shape
    keys, rope = latent.shape[1], q_rope.shape[-1]
    q_latent, q_rope = (q if q.stride(-1) == 1 else q.contiguous() for q in (q_latent, q_rope))
    if latent.stride(-1) != 1 or latent.stride(-2) != latent.shape[-1]:  # rows may be apart (a growing cache's view)
        latent = latent.contiguous()
    if key_mask is not None and key_mask.stride(-1) != 1:
        key_mask = key_mask.contiguous()
    config = LATENT_CONFIG
    block_h, step = config["heads"], max(config["plain"][0], config["pipelined"][0])
    groups = triton.cdiv(heads, block_h)
    splits = max(1, min(config["programs"] // (batch * groups), triton.cdiv(keys, step)))
    acc = torch.empty(batch, splits, heads, latent_width, dtype=torch.float32, device=q_latent.device)
    ml = torch.empty(batch, splits, heads, 2, dtype=torch.float32, device=q_latent.device)
    valid = key_mask if key_mask is not None else position
    block_c, block_r = triton.next_power_of_2(latent_width), max(16, triton.next_power_of_2(rope))
    # the interpreter has no `range` over run-time bounds: there the plain loop takes every split
    builds = (False,) if _INTERPRET else (False, True)
    for pipelined in builds:
        block_n, stages = config["pipelined" if pipelined else "plain"]
        _latent_attention_split_kernel[(batch, splits, groups)](
            q_latent, q_rope, latent, valid, position, acc, ml, heads, latent_width, rope, splits, q_latent.stride(0),
            q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), latent.stride(0),
            valid.stride(0) if key_mask is not None else 0, float(scale), BLOCK_H=block_h, BLOCK_N=block_n,
            BLOCK_C=block_c, BLOCK_R=block_r, HAS_VALID=key_mask is not None, IEEE=q_latent.dtype == torch.float32,
            STEP=step, PIPELINED=pipelined, PLAIN_MAX_KEYS=2**30 if _INTERPRET else config["plain_max_keys"],
            num_warps=config["warps"] if block_c >= 256 else 4, num_stages=stages)
    out = torch.empty(batch, heads, latent_width, dtype=q_latent.dtype, device=q_latent.device)
    combine_c = min(block_c, 64)
    _latent_attention_combine_kernel[(batch, heads, triton.cdiv(latent_width, combine_c))](
        acc, ml, position, out, heads, latent_width, splits, STEP=step, BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_C=combine_c, num_warps=4)
    return out


def pair_sum_norm(pairs, weights, weight, eps, dtype):
    """RMSNorm (`weight`, `eps`; None: no norm) of the expert outputs `pairs` [N, k, L] (any float dtype) weighted
    by `weights` [N, k] in fp32 (None: `pairs` are weighted fp32 terms already) and summed over k, rounded to
    `dtype`; returned as [N, L] in `dtype`. L is at most MAX_ROW_WIDTH."""
    rows, top_k, width = pairs.shape
    block = triton.next_power_of_2(width)
    if block > MAX_ROW_WIDTH:
        _refuse("pair_sum_norm", f"rows of {width} values are wider than {MAX_ROW_WIDTH}")
    pairs = pairs.contiguous()
    weights = pairs if weights is None else weights.float().contiguous()  # pairs: a pointer never read
    out = torch.empty(rows, width, dtype=dtype, device=pairs.device)
    _pair_sum_norm_kernel[(rows,)](pairs, weights, pairs if weight is None else weight, out, width, float(eps),
                                   K=top_k, BLOCK_L=block, WEIGHTED=weights is not pairs, NORM=weight is not None,
                                   num_warps=4 if block <= 4096 else 8)
    return out


def gated_rms_norm(x, gate, weight, eps, dtype):
    """`RMSNorm(x in dtype) * sigmoid(gate)` over the last dim D (a power of two), x and gate [..., D] (x in any
    float dtype, gate in `dtype`), returned in `dtype`."""
    width = x.shape[-1]
    if width & (width - 1):
        _refuse("gated_rms_norm", f"head width {width} is not a power of two")
    shape = x.shape
    x, gate = x.reshape(-1, width).contiguous(), gate.reshape(-1, width).contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, width, dtype=dtype, device=x.device)
    block_r = max(1, 4096 // width)
    if rows:
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_r),)](x, gate, weight, out, rows, float(eps), D=width,
                                                              BLOCK_R=block_r, num_warps=4)
    return out.view(shape)


def mla_keys(kv, latent, heads, nope_dim, latent_width):
    """MLA's per-head keys for SDPA, [B, keys, heads, nope_dim + rope]: each head's k_nope (the first nope_dim of
    its values in `kv` [B, keys, heads * (nope_dim + v)], kv_b_proj's output) beside the token's k_r (the values of
    `latent` [B, keys, latent_width + rope] after latent_width), copied. torch: a concatenation with k_r expanded
    over the heads, which ran at a fifth of the copy bandwidth (0.71 ms for an 8k prompt on an H100)."""
    batch, keys, width = latent.shape
    rope = width - latent_width
    kv = kv.contiguous()
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    out = torch.empty(batch, keys, heads, nope_dim + rope, dtype=kv.dtype, device=kv.device)
    block_h = 16
    if batch * keys:
        _mla_keys_kernel[(batch * keys, triton.cdiv(heads, block_h))](
            kv, latent, out, keys, heads, latent.stride(0), latent.stride(1), KV=kv.shape[-1] // heads, NOPE=nope_dim,
            ROPE=rope, C=latent_width, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(nope_dim + rope), num_warps=4)
    return out


def latent_keys(kv, weight, eps, latent_width, buffer, positions):
    """MLA's latent `[rms_norm(c) * weight, k_r]` of `kv = [c, k_r]` [B, T, W] (c: the first `latent_width` values),
    written into `buffer` [B, max_length, W] at `positions` [T] (a static cache's); returns the buffer. W is at most
    MAX_ROW_WIDTH."""
    batch, tokens, width = kv.shape
    block = triton.next_power_of_2(width)
    if block > MAX_ROW_WIDTH:
        _refuse("latent_keys", f"rows of {width} values are wider than {MAX_ROW_WIDTH}")
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    _latent_keys_kernel[(batch, tokens)](kv, weight, buffer, positions, kv.stride(0), kv.stride(1), buffer.stride(0),
                                         buffer.stride(1), float(eps), C=latent_width, W=width, BLOCK=block,
                                         num_warps=4)
    return buffer


def sigmoid_gated_heads(attn, gate):
    """MLA's gated output: the heads' outputs `attn` [B, heads, T, D] (any strides) as [B, T, heads * D] times
    sigmoid(`gate`) [B, T, heads * D] (its rows may lie apart: a slice of a wider projection's output), in attn's
    dtype with the torch code's roundings (torch: the transposing copy, the sigmoid and the product, 3 kernels; here
    1)."""
    batch, heads, length, width = attn.shape
    if attn.stride(-1) != 1:
        attn = attn.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(batch, length, heads * width, dtype=attn.dtype, device=attn.device)
    block_d = triton.next_power_of_2(width)
    block_h = max(1, min(triton.next_power_of_2(heads), 2048 // block_d))
    if batch * length:
        _sigmoid_gated_heads_kernel[(batch * length, triton.cdiv(heads, block_h))](
            attn, gate, out, length, heads, attn.stride(0), attn.stride(1), attn.stride(2), gate.stride(0),
            gate.stride(1), D=width, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


def router_topk(logits, bias, top_k, renormalize, scaling):
    """`KimiK3Router`'s choice from its fp32 logits [N, E]: (ids [N, k] int64, weights [N, k] fp32), slots in
    descending order of the biased score (the bias read in its own dtype, added in fp32). top_k must be a power of
    two (tl.topk)."""
    if top_k & (top_k - 1):
        _refuse("router_topk", f"top_k = {top_k} is not a power of two")
    logits = logits.contiguous()
    rows, experts = logits.shape
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    block_e = triton.next_power_of_2(max(experts, top_k))
    _router_topk_kernel[(rows,)](logits, bias.contiguous(), ids, weights, experts, float(scaling), K=top_k,
                                 BLOCK_E=block_e, RENORMALIZE=bool(renormalize), num_warps=4)
    return ids, weights


def attn_res_mix(bank, last, norm_weight, proj_weight, eps, out_weight, out_eps, key_mask=None, positions=None,
                 delta=None):
    """RMSNorm (weight `out_weight`, eps `out_eps`) of `sum_j softmax_j((v_j / rms(v_j)) . (norm_weight *
    proj_weight)) v_j` over the sources v_j: the stacked `bank` [n - 1, ..., H], then `last` [..., H]; in fp32, the
    mix rounded to last's dtype before the norm (as the torch code does), returned in that dtype with last's shape.
    With `key_mask` [B, keys] (0 = padding) and `positions` [T] for last [B, T, H], the rows of padding tokens
    (key_mask[b, positions[t]] == 0) are zeros, read from the mask in place (no index or fill kernels). With `delta`
    (last's shape) the last source is `last + delta` instead, and (that sum, the mix) is returned. H is at most
    MAX_ROW_WIDTH."""
    hidden = last.shape[-1]
    block_h = triton.next_power_of_2(hidden)
    if block_h > MAX_ROW_WIDTH:
        _refuse("attn_res_mix", f"rows of {hidden} values are wider than {MAX_ROW_WIDTH}")
    n = bank.shape[0] + 1
    bank, last = bank.contiguous(), last.contiguous()
    rows = last.numel() // hidden
    out = torch.empty_like(last)
    if delta is not None:
        delta, total = delta.contiguous(), torch.empty_like(last)
    masked = key_mask is not None
    if masked:  # a prompt chunk's mask is a column slice: read in place through its row stride
        key_mask = key_mask if key_mask.stride(-1) == 1 else key_mask.contiguous()
        key_mask = key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else key_mask
        mask_args = (key_mask, positions.contiguous(), last.shape[-2], key_mask.stride(0))
    else:
        mask_args = (last, last, 1, 0)  # not read
    sum_args = (last, last) if delta is None else (delta, total)  # not read / written without a delta
    _attn_res_mix_kernel[(rows,)](bank, last, *sum_args, norm_weight, proj_weight, out_weight, out, rows, float(eps),
                                  float(out_eps), *mask_args, N=n, H=hidden, BLOCK_N=triton.next_power_of_2(n),
                                  BLOCK_H=block_h, MASKED=masked, HAS_DELTA=delta is not None, num_warps=8)
    return out if delta is None else (total, out)


def short_conv(inputs, weights, states=None, in_place=False, out_dtype=None):
    """Causal depthwise convolution + SiLU of each x in `inputs` [B, T, D_i] with its weight [D_i, 1, K] and history
    [B, D_i, K-1] (None: zeros). Returns (outputs [B, T, D_i] in x's dtype, then cast to `out_dtype` where given,
    new histories [B, D_i, K-1] in the history's dtype, x's without one). `in_place` writes the new histories over
    the given (contiguous) ones, a static cache's buffers, and returns those."""
    outputs, new_states = [], []
    for i, (x, weight) in enumerate(zip(inputs, weights)):
        batch, length, channels = x.shape
        kernel = weight.shape[-1]
        state = None if states is None else states[i]
        overwrite = in_place and state is not None and state.is_contiguous()
        if state is None:
            state = x.new_zeros(batch, channels, kernel - 1)
        x, state = x.contiguous(), state.contiguous()
        y = torch.empty(batch, length, channels, dtype=out_dtype or x.dtype, device=x.device)
        new = state if overwrite else torch.empty_like(state)
        block_s = triton.next_power_of_2(kernel - 1)  # the history's length, padded
        block_t = max(4, min(16, triton.next_power_of_2(length)), block_s)
        block_d = 256
        grid = (batch, triton.cdiv(length, block_t), triton.cdiv(channels, block_d))
        _short_conv_kernel[grid](x, weight, state, y, new, length, channels, x.stride(0), x.stride(1), y.stride(0),
                                 y.stride(1), K=kernel, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_S=block_s,
                                 num_warps=4)
        outputs.append(y)
        new_states.append(new)
    return outputs, new_states


# The widest KDA head the one-kernel decode step takes: one program holds its head's fp32 state [D, D] in registers.
MAX_KDA_HEAD_DIM = 128


def kda_decode_step(projected, conv_weights, conv_states, g_raw, beta_raw, gate_logits, A_log, dt_bias, lower_bound,
                    scale, state, norm_weight, eps, dtype, in_place=False):
    """One token of a KDA layer after its projections, in one launch of one program per (row, head): the short
    convs + SiLU of q, k, v (`projected` [B, 1, heads * D], rows may lie apart as views of a wider projection; conv
    weights [heads * D, 1, K]; histories `conv_states` [B, heads * D, K-1]), the delta rule with its gate, beta and
    L2 norms (`g_raw`, `gate_logits` [B, 1, heads, D], `beta_raw` [B, 1, heads], `A_log` [heads], `dt_bias`
    [heads * D], `lower_bound` or None, the fp32 `state` [B, heads, D, D]) and the output's RMSNorm (`norm_weight`,
    `eps`) times sigmoid(gate_logits), in `dtype`. D is a power of two up to MAX_KDA_HEAD_DIM, K at least 2.

    Returns (out [B, 1, heads, D] in `dtype`, the new histories, the new fp32 state). `in_place` writes them over
    the given (contiguous) ones, a static cache's buffers, and returns those."""
    batch, _, heads, width = g_raw.shape
    kernel = conv_weights[0].shape[-1]
    if width & (width - 1) or width > MAX_KDA_HEAD_DIM:
        _refuse("kda_decode_step", f"head width {width} is not a power of two up to {MAX_KDA_HEAD_DIM}")
    if kernel < 2:
        _refuse("kda_decode_step", f"conv kernel size {kernel} has no history")
    rows = [t.reshape(batch, -1) for t in (*projected, g_raw, beta_raw, gate_logits)]
    q, k, v, g_raw, beta_raw, gate_logits = (t if t.stride(-1) == 1 else t.contiguous() for t in rows)
    histories = [h if h.is_contiguous() else h.contiguous() for h in conv_states]
    new_histories = [h if in_place and h is given else torch.empty_like(h)
                     for h, given in zip(histories, conv_states)]
    owned = in_place and state.dtype == torch.float32 and state.is_contiguous()
    state_in = state if owned else state.float().contiguous()
    new_state = state if owned else torch.empty_like(state_in)
    out = torch.empty(batch, 1, heads, width, dtype=dtype, device=q.device)
    _kda_decode_step_kernel[(batch, heads)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), *(w.contiguous() for w in conv_weights), *histories,
        *new_histories, g_raw, beta_raw, gate_logits, g_raw.stride(0), beta_raw.stride(0), gate_logits.stride(0),
        A_log.contiguous(), dt_bias.contiguous(), state_in, new_state, norm_weight, out, heads,
        float(lower_bound or 0.0), float(scale), float(eps), D=width, K=kernel, LOWER_BOUND=lower_bound is not None,
        num_warps=8 if width >= 128 else 4)
    return out, new_histories, new_state
