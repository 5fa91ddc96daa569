"""Kimi Delta Attention (KDA) core in pure torch: the reference path, which runs on any device.

Per head, with key/value state S (K x V), decay g_t (log-space, per key channel) and step size beta_t:

    S <- Diag(exp(g_t)) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = S^T q_t

`recurrent_kda` runs this step by step (decode); `chunk_kda` computes the same thing a chunk at a time in the
WY/UT form (prefill). Both take q, k already L2-normalised and apply `scale` to q, as fla's
`naive_recurrent_kda` does; math runs in float32 (float64 inputs stay float64).

`kda_forward` is what the model calls: fla-core's Triton kernels on CUDA where the caller asks for one and they
import (see the notes above `_load`), else this reference. fla is imported lazily, so this module needs only torch.
"""


import torch
import torch.nn.functional as F


def kda_gate(g_raw, A_log, dt_bias, lower_bound):
    """Log-decay per head and key channel.

    With a lower bound (Kimi K3): `lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))`, in (lower_bound, 0).
    Without (Kimi Linear): `-exp(A_log[h]) * softplus(g_raw + dt_bias)`.
    g_raw: [..., H, K]; A_log: [H]; dt_bias: [H * K].
    """
    heads, head_dim = g_raw.shape[-2:]
    x = g_raw.float() + dt_bias.float().view(heads, head_dim)
    a = A_log.float().exp().view(heads, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x, eps=1e-6):
    """`x / sqrt(sum(x^2) + eps)` over the last dim (fla's convention: eps inside the root, not a clamp)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _checked_positions(states_at, length):
    """`states_at` as a list of ints in [0, length], or None."""
    if states_at is None:
        return None
    positions = [int(p) for p in states_at]
    if any(not 0 <= p <= length for p in positions):
        raise ValueError(f"states_at: positions must lie in [0, {length}] (tokens seen), got {positions}")
    return positions


def recurrent_kda(q, k, v, g, beta, scale, initial_state=None, states_at=None):
    """Step-by-step KDA. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]. Returns (o [B,T,H,V], S [B,H,K,V]),
    and with `states_at` (positions p in [0, T]) also the states after the first p tokens [B, n, H, K, V]."""
    dtype = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    batch, length, heads, key_dim = k.shape
    positions = _checked_positions(states_at, length)
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outputs, kept = [], {0: state}
    for t in range(length):  # x^T S as a batched [1, K] @ [K, V] matmul: einsum's bmm with less Python per step
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - (k_t.unsqueeze(-2) @ state).squeeze(-2))
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(((q[:, t] * scale).unsqueeze(-2) @ state).squeeze(-2))
        if positions is not None and t + 1 in positions:
            kept[t + 1] = state
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, v.shape[-1])
    if positions is None:
        return o, state
    return o, state, torch.stack([kept[p] for p in positions], dim=1)


def chunk_kda(q, k, v, g, beta, scale, initial_state=None, chunk_size=16, states_at=None):
    """Chunked KDA, exact in real arithmetic to `recurrent_kda`; any length (the last chunk may be short). With
    `states_at` (positions p in [0, T]) it also returns the states after the first p tokens [B, n, H, K, V], as
    `recurrent_kda` does: a state inside a chunk is its start state decayed to p plus the corrections up to p,
    `e^{G_p} * S0 + (K[:p] * e^{G_p - G[:p]})^T Delta[:p]`, from the chunk's own factors (no second pass).

    Within a chunk starting from state S0, with G_t the cumulative log-decay up to t, the corrections
    delta_t = beta_t (v_t - (D_t S_{t-1})^T k_t) solve the unit lower-triangular system
    (I + diag(beta) A) Delta = diag(beta) (V - (K * e^G) S0),  A[t, s] = k_t . (e^{G_t - G_s} * k_s) for s < t,
    then O = (Q * e^G) S0 + B Delta with B[t, s] = q_t . (e^{G_t - G_s} * k_s) for s <= t, and the chunk's final
    state is e^{G_C} * S0 + (K * e^{G_C - G})^T Delta. Only decay differences with s <= t are used: g <= 0 (a
    log-decay), so G never increases along t and every such exponent is <= 0; nothing overflows. The others are
    clamped to e^0 (exp of the -inf a mask would put there runs ~2.5x slower on CPU) and cut from A and B by tril:
    the masked form's result, bit for bit where compared (CPU). The pairwise decays cost C x C x K a chunk: chunks
    of 16 keep them in cache on a CPU (measured ~10x faster than 64 on the demo's shapes).
    """
    dtype = _compute_dtype(q)
    q, k, v, g, beta = (t.to(dtype).transpose(1, 2) for t in (q, k, v, g, beta))  # [B, H, T, ...]
    batch, heads, length, key_dim = k.shape
    positions = _checked_positions(states_at, length)
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    q = q * scale
    outputs, kept = [], {0: state}
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        q_c, k_c, v_c, b_c = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        cum = g[:, :, start:end].cumsum(dim=2)  # [B, H, C, K]
        size = end - start
        diff = (cum.unsqueeze(3) - cum.unsqueeze(2)).clamp_(max=0).exp_()  # [B, H, C, C, K], valid for s <= t
        a = torch.einsum("bhtk,bhtsk,bhsk->bhts", k_c, diff, k_c).tril(-1)
        b = torch.einsum("bhtk,bhtsk,bhsk->bhts", q_c, diff, k_c).tril_()  # in place: keeps einsum's strides (and bits)
        decay = cum.exp()
        rhs = b_c.unsqueeze(-1) * (v_c - (k_c * decay) @ state)
        system = torch.eye(size, dtype=dtype, device=q.device) + b_c.unsqueeze(-1) * a
        delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append((q_c * decay) @ state + b @ delta)
        inside = sorted({p - start - 1 for p in positions or () if start < p < end})
        if inside:  # states after token j of the chunk: (k_s e^{G_j - G_s})_{s <= j} weighs delta_s
            j = torch.tensor(inside, device=q.device)
            weights = (diff[:, :, j] * k_c.unsqueeze(2)).masked_fill_(
                torch.arange(size, device=q.device)[:, None] > j[:, None, None], 0)  # [B, H, n, C, K]: s <= j
            states = decay[:, :, j].unsqueeze(-1) * state.unsqueeze(2) + torch.einsum(
                "bhjsk,bhsv->bhjkv", weights, delta)
            kept.update({start + 1 + i: states[:, :, n] for n, i in enumerate(inside)})
        last = cum[:, :, -1:]
        state = last.transpose(2, 3).exp() * state + (k_c * (last - cum).exp()).transpose(2, 3) @ delta
        kept[end] = state
    o = torch.cat(outputs, dim=2).transpose(1, 2) if outputs else v.transpose(1, 2).new_zeros(
        batch, 0, heads, v.shape[-1])
    if positions is None:
        return o, state
    return o, state, torch.stack([kept[p] for p in positions], dim=1)


# ------------------------------------------------------------------------------------------------------------------
# fla-core dispatch (CUDA)
# ------------------------------------------------------------------------------------------------------------------

# fla-core's kernels are used where the model's fast paths say so (`kernel=` here). Its recurrent kernel keeps the
# state in fp32, token by token: it runs the decode steps. Its chunked kernel runs prompts (`kda_prefill`). That
# kernel casts its intermediates (the WY factors w and u, the chunk states) to its inputs' dtype for its matmuls, so
# with the model's bf16 q, k, v each chunk's state picks up bf16 rounding: against a float64 recomputation on the
# release's head shape (96 x 128, H200), state 3.3e-3 and output 4.1e-3, where rounding the true output to bf16
# alone gives 1.7e-3; that made the small GPU test model's greedy tokens stray (the reference's argmax at 83 % of
# 64 steps after a 10-token prompt). Fed fp32 q, k, v the same kernel gives state 1.1e-3 and output 1.8e-3, and
# 98 % agreement, as the recurrent kernel and the reference give (bench/results/prefill_20/). The gate was never the
# cause: fla's in-kernel gate is the model's (lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) in fp32), and an
# fp32 gate input alone changes nothing. So prompts go through the chunked kernel in fp32.

_fla = None


def _load():
    """fla's KDA prefill and decode entry points, or None where fla-core (or its Triton) cannot be imported. The
    decode one is fla's forward function under `fused_recurrent_kda`, which can also update the state in place."""
    global _fla
    if _fla is None:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_recurrent

            _fla = (fla_chunk, fla_recurrent)
        except Exception:  # ImportError, or fla refusing the platform
            _fla = False
    return _fla or None


def supported(device):
    """True where fla's kernels can run for tensors on `device` (CUDA, fla-core importable)."""
    return torch.device(device).type == "cuda" and _load() is not None


def kda_forward(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound, scale, initial_state=None, in_place=False,
                kernel=None, safe_gate=True, states_at=None):
    """KDA core. q, k, g_raw: [B, T, H, K]; v: [B, T, H, V]; beta_raw: [B, T, H] (logits); A_log: [H];
    dt_bias: [H * K]; initial_state: [B, H, K, V] fp32 or None. `kernel` picks fla-core's kernel for this call where
    it loads: "recurrent" (token by token, fp32 state; `in_place` lets it write the new state over `initial_state`,
    a static cache's buffer) or "chunk" (chunked prefill; `safe_gate` lets it use fla's safe gate, 16-row
    tensor-core sub-chunks valid for gates bounded in [lower_bound, 0) with lower_bound >= -5, wherever the bound
    allows). Otherwise the reference runs: `recurrent_kda` for one token with a state, else `chunk_kda`, and always
    returns a new state.

    `states_at` (positions p in [0, T]) asks also for the states after the first p tokens, a third result
    [B, n, H, K, V] fp32 (what a cache keeps to roll back past rejected draft tokens): the reference computes them
    inside its pass; fla's kernels return only final states, so their call is split at those positions.

    Returns (o [B, T, H, V] in v's dtype on the fla path, fp32 on the reference path; state [B, H, K, V] fp32).
    """
    kernels = _load() if kernel is not None and q.is_cuda else None
    if kernels is None:
        g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(beta_raw.float())
        inputs = (l2norm(q.float()), l2norm(k.float()), v.float(), g, beta)
        if q.shape[1] == 1 and initial_state is not None:
            return recurrent_kda(*inputs, scale=scale, initial_state=initial_state, states_at=states_at)
        # 16-token chunks suit a CPU's caches; on a GPU fewer, larger chunks mean fewer kernel launches
        return chunk_kda(*inputs, scale=scale, initial_state=initial_state, chunk_size=64 if q.is_cuda else 16,
                         states_at=states_at)
    if kernel not in ("recurrent", "chunk"):
        raise ValueError(f"kda_forward: kernel must be 'recurrent', 'chunk' or None, got {kernel!r}")
    if states_at is not None:
        return _split_at(q, k, v, g_raw, beta_raw, initial_state, _checked_positions(states_at, q.shape[1]),
                         lambda *part, initial_state, in_place: kda_forward(
                             *part, A_log, dt_bias, lower_bound, scale, initial_state, in_place, kernel, safe_gate),
                         in_place)
    fla_chunk, fla_recurrent = kernels
    # the chunked kernel runs its matmuls in its inputs' dtype, the WY factors and the state included: fp32 inputs
    # keep its error at the bf16 rounding of the output (see the notes above `_load`)
    dtype = torch.float32 if kernel == "chunk" else v.dtype
    q, k, g_raw, beta_raw = (t.to(dtype).contiguous() for t in (q, k, g_raw, beta_raw))
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    common = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        A_log=A_log.float().contiguous(),
        dt_bias=dt_bias.float().contiguous(),
        lower_bound=lower_bound,
    )
    if kernel == "recurrent":
        in_place = in_place and initial_state is not None
        o, state = fla_recurrent(q, k, v.contiguous(), g_raw, beta_raw, inplace_final_state=in_place, **common)
    else:
        safe = safe_gate and lower_bound is not None and -5 <= lower_bound < 0
        o, state = fla_chunk(q, k, v.to(dtype).contiguous(), g_raw, beta_raw, safe_gate=safe, **common)
    return o, state


def _split_at(q, k, v, g_raw, beta_raw, initial_state, positions, run, in_place):
    """`run` (a kernel call returning (o, final state)) over the pieces of the sequence between `positions`, each
    piece from the state the previous one left: (o, state, the states at `positions`)."""
    batch, length, heads, key_dim = q.shape
    state = (torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float32, device=q.device)
             if initial_state is None else initial_state)
    kept, outputs, start = {0: state.clone() if in_place else state}, [], 0
    for end in sorted(set(positions) | {length}):
        if end > start:
            o, state = run(*(t[:, start:end] for t in (q, k, v, g_raw, beta_raw)), initial_state=state,
                           in_place=in_place)
            outputs.append(o)
            kept[end] = state.clone() if in_place and end < length else state
        start = end
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, v.shape[-1])
    return o, state, torch.stack([kept[p] for p in positions], dim=1)


def quick_tune(max_configs=1):
    """Keep at most `max_configs` of each fla autotuner's configurations (preferring 4 warps), so a first call
    compiles a handful of kernels instead of autotuning ~100 variants. For benchmarks and tests on a rationed GPU;
    a server would rather let fla tune once. Returns how many autotuners were trimmed."""
    if _load() is None:
        return 0
    import sys

    from triton.runtime.autotuner import Autotuner

    trimmed, seen = 0, set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla."):
            continue
        for value in list(vars(module).values()):
            node, depth = value, 0
            while node is not None and depth < 6:
                if isinstance(node, Autotuner) and id(node) not in seen:
                    seen.add(id(node))
                    if len(node.configs) > max_configs:
                        ranked = sorted(node.configs, key=lambda c: (c.num_warps != 4, c.num_stages != 2))
                        node.configs = ranked[:max_configs]
                        trimmed += 1
                node, depth = getattr(node, "fn", None), depth + 1
    return trimmed
