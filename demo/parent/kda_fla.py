"""KDA on CUDA through fla-core's Triton kernels (optional fast path), with the pure-torch reference as fallback.

`kda_forward` takes what the KDA layer has before its gate/beta/norm epilogue — the conv outputs q, k (not yet
L2-normalised), v, the raw gate `f_b_proj(f_a_proj x)`, the raw beta logits `b_proj x` — and returns the attention
output and the new recurrent state. On CUDA with fla-core importable it calls `fla.ops.kda.chunk_kda` (prefill)
or `fused_recurrent_kda` (decode) with the gate, the L2 norms and the beta sigmoid fused into the kernels
(`use_gate_in_kernel`, `use_qk_l2norm_in_kernel`, `use_beta_sigmoid_in_kernel`; with Kimi K3's lower bound also
`lower_bound` and `safe_gate`); otherwise it computes the same epilogue in torch and calls `kda.chunk_kda` /
`kda.recurrent_kda`. fla's gate with a lower bound is `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` and its
L2 norm `x / sqrt(sum x^2 + 1e-6)`, as in `kda.kda_gate` / `kda.l2norm` (SPEC §2).
"""

try:
    from .kda import chunk_kda, kda_gate, l2norm, recurrent_kda
except ImportError:  # imported from the repository root rather than as transformers remote code
    from kda import chunk_kda, kda_gate, l2norm, recurrent_kda

import os

import torch

# Opt-in (KIMI_K3_FLA_KDA=1) until it is understood why, inside a whole bf16 model, this path's logits differ from the
# reference by ~25 % relative (the reference in bf16 vs fp32: ~5 %), although the kernels alone match the reference
# within bf16 tolerance (tests/test_gpu_paths.py). Benchmarks and tests set it directly to compare the two paths.
ENABLED = os.environ.get("KIMI_K3_FLA_KDA", "0") == "1"
# fla's `safe_gate` (16-row tensor-core sub-chunks, valid for gates bounded in [lower_bound, 0) with lower_bound
# >= -5): None uses it whenever the bound allows; False never.
SAFE_GATE = None

_fla = None


def _load():
    """fla's two KDA entry points, or None where fla-core (or its Triton) cannot be imported."""
    global _fla
    if _fla is None:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent

            _fla = (fla_chunk, fla_recurrent)
        except Exception:  # ImportError, or fla refusing the platform
            _fla = False
    return _fla or None


def available(device=None):
    """True where the fla kernels would be used for tensors on `device`."""
    if not ENABLED or not torch.cuda.is_available():
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    return _load() is not None


def kda_forward(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound, scale, initial_state=None, decode=False):
    """KDA core. q, k, g_raw: [B, T, H, K]; v: [B, T, H, V]; beta_raw: [B, T, H] (logits); A_log: [H];
    dt_bias: [H * K]; initial_state: [B, H, K, V] fp32 or None. `decode` selects the step-by-step kernel.

    Returns (o [B, T, H, V] in v's dtype on the fla path, fp32 on the reference path; state [B, H, K, V] fp32).
    """
    kernels = _load() if (q.is_cuda and available()) else None
    if kernels is None:
        g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(beta_raw.float())
        kernel = recurrent_kda if decode else chunk_kda
        return kernel(l2norm(q.float()), l2norm(k.float()), v.float(), g, beta, scale=scale,
                      initial_state=initial_state)
    fla_chunk, fla_recurrent = kernels
    dtype = v.dtype
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
    if decode:
        o, state = fla_recurrent(q, k, v.contiguous(), g_raw, beta_raw, **common)
    else:
        safe = SAFE_GATE is not False and lower_bound is not None and -5 <= lower_bound < 0
        o, state = fla_chunk(q, k, v.contiguous(), g_raw, beta_raw, safe_gate=safe, **common)
    return o, state


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
