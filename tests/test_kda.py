"""KDA numerics: chunked == recurrent == an independent float64 transcription of SPEC §2 (issue point 3)."""

import math

import pytest
import torch

from kda import chunk_kda, kda_gate, l2norm, recurrent_kda


def spec_kda_float64(q_raw, k_raw, v, g_raw, b_raw, A_log, dt_bias, lower_bound, initial_state=None):
    """SPEC §2 written out head by head with explicit matrices, in float64.

    Gate: g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias)); beta = sigmoid(b_raw);
    q, k <- x / sqrt(sum x^2 + 1e-6); q <- q / sqrt(K);
    S <- Diag(exp(g_t)) S ; S <- S + k_t (beta_t (v_t - S^T k_t))^T ; o_t = S^T q_t.
    """
    batch, length, heads, key_dim = q_raw.shape
    value_dim = v.shape[-1]
    out = torch.zeros(batch, length, heads, value_dim, dtype=torch.float64)
    final = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            S = (torch.zeros(key_dim, value_dim, dtype=torch.float64) if initial_state is None
                 else initial_state[b, h].double().clone())
            for t in range(length):
                x = g_raw[b, t, h].double() + dt_bias.double().view(heads, key_dim)[h]
                g = lower_bound * torch.sigmoid(math.exp(float(A_log[h])) * x)
                beta = torch.sigmoid(b_raw[b, t, h].double())
                qt = q_raw[b, t, h].double()
                kt = k_raw[b, t, h].double()
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) / math.sqrt(key_dim)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                S = torch.diag(torch.exp(g)) @ S
                S = S + torch.outer(kt, beta * (v[b, t, h].double() - S.T @ kt))
                out[b, t, h] = S.T @ qt
            final[b, h] = S
    return out, final


def random_inputs(batch, length, heads, key_dim, value_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q_raw=torch.randn(batch, length, heads, key_dim, generator=gen),
        k_raw=torch.randn(batch, length, heads, key_dim, generator=gen),
        v=torch.randn(batch, length, heads, value_dim, generator=gen),
        g_raw=torch.randn(batch, length, heads, key_dim, generator=gen) * 2,
        b_raw=torch.randn(batch, length, heads, generator=gen),
        A_log=torch.randn(heads, generator=gen) * 0.5,
        dt_bias=torch.randn(heads * key_dim, generator=gen),
    )


def ours(inputs, kernel, lower_bound=-5.0, initial_state=None, **kw):
    q = l2norm(inputs["q_raw"].float())
    k = l2norm(inputs["k_raw"].float())
    g = kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], lower_bound)
    beta = torch.sigmoid(inputs["b_raw"].float())
    scale = q.shape[-1] ** -0.5
    return kernel(q, k, inputs["v"].float(), g, beta, scale=scale, initial_state=initial_state, **kw)


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 150])
def test_chunked_and_recurrent_match_the_spec_recurrence(length):
    inputs = random_inputs(2, length, 3, 16, 8, seed=length)
    state0 = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(7)) * 0.1
    ref_out, ref_state = spec_kda_float64(**inputs, lower_bound=-5.0, initial_state=state0)
    for kernel, extra in ((recurrent_kda, {}), (chunk_kda, {"chunk_size": 64}), (chunk_kda, {"chunk_size": 16})):
        out, state = ours(inputs, kernel, initial_state=state0, **extra)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(state.double(), ref_state, atol=2e-5, rtol=1e-4)


def test_gate_is_bounded_and_matches_both_forms():
    inputs = random_inputs(1, 5, 2, 8, 4, seed=3)
    g = kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], -5.0)
    assert (g < 0).all() and (g > -5.0).all()
    x = inputs["g_raw"].double() + inputs["dt_bias"].double().view(2, 8)
    unbounded = kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], None)
    expected = -inputs["A_log"].double().exp().view(2, 1) * torch.nn.functional.softplus(x)
    torch.testing.assert_close(unbounded.double(), expected, atol=1e-6, rtol=1e-6)


def test_splitting_a_sequence_across_calls_carries_the_state():
    inputs = random_inputs(1, 40, 2, 8, 8, seed=11)
    whole, whole_state = ours(inputs, chunk_kda, chunk_size=16)
    first = {k: (v[:, :23] if v.dim() >= 3 else v) for k, v in inputs.items()}
    second = {k: (v[:, 23:] if v.dim() >= 3 else v) for k, v in inputs.items()}
    out1, state1 = ours(first, chunk_kda, chunk_size=16)
    out2, state2 = ours(second, recurrent_kda, initial_state=state1)
    torch.testing.assert_close(torch.cat([out1, out2], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state2, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_equals_conv1d_and_carries_its_state(dtype):
    """The tap-by-tap short convolution against `F.conv1d` + SiLU on the zero-padded history, whole and split."""
    import torch.nn.functional as F

    from modeling_kimi_k3 import KimiK3ShortConv

    torch.manual_seed(0)
    conv = KimiK3ShortConv(48, 4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, 11, 48).to(dtype)
    padded = F.pad(x.transpose(1, 2), (3, 0))
    ref = F.silu(F.conv1d(padded, conv.weight.to(dtype), groups=48)).transpose(1, 2)
    with torch.no_grad():
        whole, _ = conv(x)
        head, state = conv(x[:, :7])
        steps = [head]
        for t in range(7, 11):  # decode: one token at a time
            y, state = conv(x[:, t : t + 1], state)
            steps.append(y)
    assert whole.dtype == dtype and ref.abs().max() > 1.0
    torch.testing.assert_close(whole, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))
