"""A KDA decode step as one op (issue 44): `kda_decode_step`, the short convs, the delta rule and the gated norm of
one token onto a cache's states. The reference is those three ops in turn, bit for bit; the model runs it on every
decode step but a recording cache's (which runs the three with its recording between them), with the same logits;
the dispatch gives the one-kernel `fused_triton.kda_decode_step` under the `fused` path, which Triton's interpreter
checks against the reference (kernel alone, and the tiny model's decode logits).
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kda import kda_forward
from kimi_k3_dispatch import FastPaths, check_shapes, fused_kda_decode_step, fused_short_convs, resolve_ops
from modeling_kimi_k3 import (REFERENCE_OPS, KimiK3Cache, KimiK3RMSNorm, KimiK3ShortConv, KimiK3StaticCache,
                              gated_rms_norm, kda_decode_step, short_convs)
from reap_tools.tiny import random_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_case(batch, heads, dim, kernel=4, dtype=torch.bfloat16, lower_bound=-5.0, device="cpu", seed=0):
    """Random arguments of `kda_decode_step` (all but `in_place`) as the model passes them: q, k, v views of one
    wider projection row (a row stride past their width), g_raw and the gate logits [B, 1, heads, dim], fp32 A_log,
    dt_bias and state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    width = heads * dim
    rows = randn(batch, 1, 3 * width + 8).to(dtype)
    projected = tuple(rows[..., i * width : (i + 1) * width] for i in range(3))
    convs = [KimiK3ShortConv(width, kernel).to(device, dtype) for _ in range(3)]
    norm = KimiK3RMSNorm(dim, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        for conv in convs:
            conv.weight.copy_(randn(width, 1, kernel, scale=0.5))
        norm.weight.copy_(randn(dim).abs() + 0.5)
    histories = [randn(batch, width, kernel - 1).to(dtype) for _ in range(3)]
    return (projected, convs, histories, randn(batch, 1, heads, dim).to(dtype), randn(batch, 1, heads).to(dtype),
            randn(batch, 1, heads, dim, scale=2.0).to(dtype), randn(heads, scale=0.5), randn(width, scale=0.5),
            lower_bound, dim**-0.5, randn(batch, heads, dim, dim, scale=0.5), norm, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_reference_step_is_the_three_ops_in_turn(dtype):
    """`kda_decode_step` is `short_convs`, `kda_forward` (the recurrence for one token) and `gated_rms_norm`, the
    same bits; its inputs are left as they were."""
    args = step_case(2, 3, 16, dtype=dtype)
    projected, convs, histories, g_raw, beta_raw, gate, A_log, dt_bias, lower_bound, scale, state, norm, _ = args
    before = [t.clone() for t in (*histories, state)]
    with torch.no_grad():
        out, new_histories, new_state = kda_decode_step(*args, in_place=True)
        (q, k, v), want_histories = short_convs(projected, convs, histories)
        heads = g_raw.shape
        o, want_state = kda_forward(q.view(heads), k.view(heads), v.view(heads), g_raw, beta_raw, A_log, dt_bias,
                                    lower_bound, scale, state)
        want = gated_rms_norm(o, gate, norm, dtype)
    assert out.shape == g_raw.shape and out.dtype == dtype
    assert torch.equal(out, want) and torch.equal(new_state, want_state)
    assert all(torch.equal(a, b) for a, b in zip(new_histories, want_histories, strict=True))
    assert all(torch.equal(a, b) for a, b in zip((*histories, state), before))


@pytest.mark.parametrize("static", [False, True])
def test_decode_steps_take_the_step_and_a_recording_cache_the_three_ops(static):
    """Each KDA layer's one-token step onto a cache calls `kda_decode_step` once, a recording cache's (speculative
    decoding: it keeps the convolved inputs and the state before the token) never; the logits and the caches' states
    are the same bits either way, with a growing and with a static cache, two rows."""
    model = random_model(tiny_config(), seed=0)
    calls = []
    dispatch = model.dispatch
    dispatch.reference = dataclasses.replace(
        REFERENCE_OPS, kda_decode_step=lambda *a, **k: calls.append(1) or kda_decode_step(*a, **k))
    dispatch._resolved.clear()
    ids = torch.tensor([[5, 17, 9, 33, 2], [7, 7, 1, 30, 4]])

    def run(recording):
        cache = (KimiK3StaticCache(model.config, 2, 8, cuda_graph=False) if static
                 else KimiK3Cache(model.config))
        if recording:
            cache.activate_past_recording()
        with torch.no_grad():
            logits = [model(ids, cache=cache).logits]
            for token in ([[3], [8]], [[11], [2]]):
                logits.append(model(torch.tensor(token), cache=cache).logits)
        return logits, [t for layer in cache.layers for t in layer.tensors()]

    plain = run(recording=False)
    kda_layers = model.config.text_config.layer_types.count("kda")
    assert len(calls) == 2 * kda_layers
    calls.clear()
    recorded = run(recording=True)
    assert calls == []
    for a, b in zip(plain[0] + plain[1], recorded[0] + recorded[1], strict=True):
        assert torch.equal(a, b)


def test_the_fused_path_takes_the_kernel_and_other_tables_compose_their_own_parts():
    """Under `fused` the step is the one kernel; without it (or where the head width does not fit it) it is the
    table's own short convs, delta rule (fla's under `kda`) and gated norm. A head wider than the kernel takes is
    resolved to the reference under "auto" and an error under "on"."""
    fused = resolve_ops(FastPaths(fused=True), REFERENCE_OPS)
    assert fused.kda_decode_step.__wrapped__ is fused_kda_decode_step
    fla = resolve_ops(FastPaths(kda=True), REFERENCE_OPS)
    parts = fla.kda_decode_step.keywords["parts"]
    assert fla.kda_decode_step.func is kda_decode_step and parts.delta_rule is fla.delta_rule
    assert fla.delta_rule is not REFERENCE_OPS.delta_rule and parts.short_convs is short_convs
    narrow = resolve_ops(FastPaths(fused=True), REFERENCE_OPS, skipped={"kda_decode_step"})
    assert narrow.kda_decode_step.keywords["parts"].short_convs.__wrapped__ is fused_short_convs
    wide = tiny_config(linear_attn_config=dict(num_heads=2, head_dim=256, full_attn_layers=[3, 6],
                                               kda_layers=[1, 2, 4, 5])).text_config
    assert check_shapes({"fused": "auto"}, wide) == {"kda_decode_step"}
    with pytest.raises(ValueError, match="kda_decode_step"):
        check_shapes({"fused": "on"}, wide)


def run_in_interpreter(script):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from kimi_k3_dispatch import fused_kda_decode_step
    from modeling_kimi_k3 import kda_decode_step
    from test_kda_decode_step import step_case

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    # (batch, heads, head dim, conv kernel, dtype, lower bound): the release's head, several rows, small heads, a
    # kernel of 3 and the gate without a lower bound
    cases = [(1, 2, 128, 4, torch.bfloat16, -5.0), (3, 3, 16, 4, torch.float32, -5.0),
             (2, 2, 32, 3, torch.bfloat16, None), (2, 1, 64, 4, torch.float32, None)]
    for n, (batch, heads, dim, kernel, dtype, lower_bound) in enumerate(cases):
        for in_place in (False, True):
            args = step_case(batch, heads, dim, kernel, dtype, lower_bound, seed=n)
            histories, state = args[2], args[10]
            given = [t.clone() for t in (*histories, state)]
            with torch.no_grad():
                want, want_histories, want_state = kda_decode_step(*args)
                out, new_histories, new_state = fused_kda_decode_step(*args, in_place=in_place)
            case = (batch, heads, dim, kernel, dtype, lower_bound, in_place)
            assert out.shape == want.shape and out.dtype == dtype and new_state.dtype == torch.float32, case
            # fp32: rounding of the sums; bf16: q, k, v, the output, its norm and gate each rounded to bf16, which the
            # interpreter truncates (an ulp off for many values, where round to nearest leaves most equal): measured
            # 2-4x the reference's own distance from an fp32 computation, up to 1.7 % of the output's and 1.2 % of
            # the state's largest value
            tol_out, tol_state = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -5, 2 ** -5)
            assert rel(out, want) < tol_out, (case, rel(out, want))
            assert rel(new_state, want_state) < tol_state, (case, rel(new_state, want_state))
            assert all(torch.equal(a, b) for a, b in zip(new_histories, want_histories)), case
            written = list(new_histories) + [new_state]
            if in_place:  # the given buffers hold the new states
                assert all(a is b for a, b in zip(written, (*histories, state))), case
            else:  # the given ones are untouched
                assert all(torch.equal(a, b) for a, b in zip((*histories, state), given)), case
    print("ok")
    """
)


@needs_triton
def test_the_kernel_is_the_reference_step_in_the_triton_interpreter():
    run_in_interpreter(KERNEL_SCRIPT)


MODEL_SCRIPT = textwrap.dedent(
    """
    import torch
    import kimi_k3_dispatch
    from kimi_k3_dispatch import use_fast_paths
    from modeling_kimi_k3 import KimiK3Cache, KimiK3StaticCache
    from reap_tools.tiny import random_model, tiny_config

    model = random_model(tiny_config(), seed=0)
    launches = []
    kernel = kimi_k3_dispatch.triton_kda_decode_step
    kimi_k3_dispatch.triton_kda_decode_step = lambda *a, **k: launches.append(1) or kernel(*a, **k)
    ids = torch.tensor([[5, 17, 9, 33, 2], [7, 7, 1, 30, 4]])
    kda_layers = model.config.text_config.layer_types.count("kda")
    for static in (False, True):
        def run(fused):
            cache = (KimiK3StaticCache(model.config, 2, 8, cuda_graph=False) if static
                     else KimiK3Cache(model.config))
            with torch.no_grad(), use_fast_paths(model, fused=fused):
                model(ids, cache=cache)
                logits = [model(torch.tensor(token), cache=cache).logits for token in ([[3], [8]], [[11], [2]])]
            return logits, [t for layer in cache.layers for t in layer.tensors()]

        want, want_states = run("off")
        launches.clear()
        got, states = run("on")
        assert len(launches) == 2 * kda_layers, (static, len(launches))
        for a, b in zip(got + states, want + want_states, strict=True):
            err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            assert err < 1e-5, (static, err)
    print("ok")
    """
)


@needs_triton
def test_the_tiny_models_decode_logits_with_the_kernel_in_the_triton_interpreter():
    """Two decode steps of the tiny model (fp32) with every fused kernel, the KDA step's included, against the
    reference: logits and every cached state, growing and static cache."""
    run_in_interpreter(MODEL_SCRIPT)
