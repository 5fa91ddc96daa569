"""mxfp4_triton's kernels in Triton's CPU interpreter (explicit-dequant path): indexing, routing blocks, SiTU and
the per-token sum against a float64 reference on the same packs. Needs `triton` installed (skipped otherwise); the
`tl.dot_scaled` variant and the speed are checked on a GPU by tests/test_gpu_paths.py."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import torch
    import mxfp4_triton as mt
    from mxfp4 import dequantize_mxfp4
    from reap_tools.tiny import random_model, tiny_config

    torch.manual_seed(0)
    for latent, inner, experts, top_k, tokens in [(32, 32, 8, 2, 5), (64, 96, 6, 3, 7), (128, 64, 5, 2, 40),
                                                  (64, 64, 8, 3, 1)]:  # one token: unsorted pair blocks
        config = tiny_config(packed=True, routed_expert_hidden_size=latent, moe_intermediate_size=inner,
                             num_experts=experts, num_experts_per_token=top_k)
        moe = random_model(config, seed=1).language_model.model.layers[1].block_sparse_moe
        with torch.no_grad():
            for e in moe.experts:
                for lin in (e.w1, e.w2, e.w3):
                    lin.weight_packed.copy_(torch.randint(0, 256, lin.weight_packed.shape, dtype=torch.uint8))
                    lin.weight_scale.copy_(torch.randint(112, 124, lin.weight_scale.shape, dtype=torch.uint8))
        z = torch.randn(tokens, latent).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k)
        ref = torch.zeros(tokens, latent, dtype=torch.float64)
        for t in range(tokens):
            for s in range(top_k):
                ex = moe.experts[int(ids[t, s])]
                w1, w3, w2 = (dequantize_mxfp4(l.weight_packed, l.weight_scale, torch.float64)
                              for l in (ex.w1, ex.w3, ex.w2))
                g, u = w1 @ z[t].double(), w3 @ z[t].double()
                act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
                ref[t] += (w2 @ act) * float(weights[t, s])
        stack = mt.stack_experts(moe)
        assert moe.experts[1].w1.weight_packed.data_ptr() == stack.w1[1].data_ptr()
        assert mt.stack_experts(moe) is stack
        for name, conf in mt.CONFIGS.items():
            for atomic in (False, True):
                # float32 intermediates: the interpreter rounds to bf16 by truncation, so check exactness instead
                out = mt.run_experts(stack, z, ids, weights, experts, 4.0, 25.0, config=conf, dot_scaled=False,
                                     atomic=atomic, h_dtype=torch.float32)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-4, (latent, inner, name, atomic, err)
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
