"""The CPU decode path's shortcuts give the bits of the plain formulas they replace."""

import pytest
import torch

from modeling_kimi_k3 import KimiK3RMSNorm


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 1, 1, 256), (2, 5, 4, 64), (7, 7168)])
def test_rms_norm_fp32_on_cpu_equals_the_explicit_formula(shape):
    g = torch.Generator().manual_seed(len(shape))
    norm = KimiK3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
        x = torch.randn(shape, generator=g) * 30
        ref = x * x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() * norm.weight
        assert torch.equal(norm(x), ref)
