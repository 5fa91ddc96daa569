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


def test_decode_mask_is_dropped_only_where_it_hides_nothing():
    from modeling_kimi_k3 import KimiK3MLAttention, causal_padding_mask
    from reap_tools.tiny import tiny_config

    assert causal_padding_mask(None, torch.tensor([6]), 7) is None
    assert causal_padding_mask(None, torch.tensor([6]), 9) is not None  # a static cache's unused tail
    assert causal_padding_mask(None, torch.tensor([5, 6]), 7) is not None
    assert causal_padding_mask(torch.ones(1, 7, dtype=torch.long), torch.tensor([6]), 7) is not None
    config = tiny_config(packed=False).text_config
    torch.manual_seed(0)
    attention = KimiK3MLAttention(config, layer_idx=2)
    q = torch.randn(2, config.num_attention_heads, 1, config.qk_nope_head_dim + config.qk_rope_head_dim)
    latent = torch.randn(2, 7, config.kv_lora_rank + config.qk_rope_head_dim)
    ops, position = attention.dispatch.ops(q.device), torch.tensor([6])
    with torch.no_grad():  # no padding mask (none built) against an all-ones one (a mask that hides nothing)
        assert torch.equal(attention.attend_absorbed(q, latent, None, position, ops),
                           attention.attend_absorbed(q, latent, torch.ones(2, 7, dtype=torch.long), position, ops))
