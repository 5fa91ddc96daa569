"""The real 320-expert config on the meta device: sizes from SPEC and 8-GPU placements with the cache of a 131k context, plus
configuration errors."""

import os

import pytest
import torch

from configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3StaticCache
from reap_tools.tiny import tiny_text_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec_parameter_count():
    """Logical parameters of KIMI-K3-CODER-REAP-320, written out from SPEC §1 (experts as out x in weights)."""
    H, V, L, I_moe, E = 7168, 163840, 3584, 3072, 320
    width = 96 * 128
    norms = 4 * H + 2 * H  # four RMSNorms and two pseudo-queries per layer
    kda = 3 * H * width + 3 * width * 4 + H * 128 + 128 * width + width + 128 + H * 96 + H * width + 128 + width * H
    mla = H * 1536 + 1536 + 1536 * 96 * 192 + H * 576 + 512 + 512 * 96 * 256 + H * width + width * H
    dense = 3 * H * 33792
    moe_dense_part = E * H + E + H * L + L + L * H + 3 * H * 2 * I_moe
    experts = E * 3 * L * I_moe
    layers = 69 * kda + 24 * mla + 93 * norms + dense + 92 * (moe_dense_part + experts)
    return 2 * V * H + 3 * H + layers, 92 * E * 3 * (I_moe * L // 2 + I_moe * L // 32)


@pytest.fixture(scope="module")
def meta_model():
    config = KimiK3Config.from_pretrained(ROOT)
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    return model.to(torch.bfloat16)


def test_parameter_and_mxfp4_byte_counts(meta_model):
    logical, packed_bytes = 0, 0
    for name, p in meta_model.named_parameters():
        if name.endswith("weight_packed"):
            logical += 2 * p.numel()
        if p.dtype == torch.uint8:
            packed_bytes += p.numel()
        else:
            logical += p.numel()
    expected_params, expected_bytes = spec_parameter_count()
    print(f"\nparameters {logical:,} ({logical / 1e12:.3f} T); MXFP4 expert bytes {packed_bytes:,}")
    assert packed_bytes == expected_bytes == 320 * 92 * 17_547_264
    assert logical == expected_params
    assert abs(logical / 1e12 - 1.03) < 0.01


def planned_device_map(model, max_memory):
    """The placement `from_pretrained(..., device_map="auto", max_memory=...)` computes: transformers' own planner
    (balanced over the GPUs), whose home moved in 5.x."""
    try:
        from transformers.integrations.accelerate import _get_device_map

        return _get_device_map(model, "auto", max_memory, None)
    except ImportError:
        from transformers.modeling_utils import _get_device_map

        return _get_device_map(model, "auto", max_memory, None, torch.bfloat16, None)


@pytest.mark.parametrize("gib", [94, 141])
def test_eight_gpu_placement_keeps_layers_whole_and_fits_131k_cache(meta_model, gib):
    """8 x 94 GiB (H100 NVL) and 8 x 141 GiB (H200): every decoder layer whole on one GPU, nothing on the CPU or
    disk, and beside each GPU's weights the static cache of its layers for 131,072 tokens of context (batch 1)."""
    device_map = planned_device_map(meta_model, {i: f"{gib}GiB" for i in range(8)})
    assert set(device_map.values()) <= set(range(8)), set(device_map.values())
    owner_of = {}
    for i in range(93):
        name = f"language_model.model.layers.{i}"
        owner = [k for k in device_map if name == k or name.startswith(k + ".")]
        assert len(owner) == 1, f"layer {i} has no single owner in the device map: {owner}"
        assert not any(k.startswith(name + ".") for k in device_map), f"layer {i} was split across entries"
        owner_of[i] = device_map[owner[0]]
    used = {d: 0 for d in range(8)}
    for name, p in meta_model.named_parameters():
        key = max((k for k in device_map if name == k or name.startswith(k + ".")), key=len)
        used[device_map[key]] += p.numel() * p.element_size()
    cache = KimiK3StaticCache.layer_bytes(meta_model.config, 1, 131072)
    for i, nbytes in enumerate(cache):
        used[owner_of[i]] += nbytes
    print(f"\n8 x {gib} GiB: GiB per GPU with the 131k cache " + " ".join(f"{b / 2**30:.1f}" for b in used.values()))
    assert max(used.values()) <= gib * 2**30
    assert sum(cache) == 69 * 96 * (3 * 128 * 3 * 2 + 128 * 128 * 4) + 24 * 131072 * 576 * 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[3, 7], kda_layers=[1, 2, 4, 5])),
         "outside 1..6"),
        (dict(linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[3], kda_layers=[1, 2, 4, 5])),
         "neither"),
        (dict(linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[3, 6], kda_layers=[1, 2, 3, 5])),
         "both"),
        (dict(num_experts_per_token=9), "larger than the 8 experts"),
        (dict(routed_expert_hidden_size=48), "groups of 32"),
        (dict(moe_intermediate_size=40), "groups of 32"),
        (dict(num_experts_per_layer=[0, 8, 8]), "entries"),
        (dict(num_experts_per_layer=[0, 8, 1, 8, 8, 8]), "larger than the 1 experts of layer 2"),
        (dict(hidden_act="silu"), "situ"),
        (dict(num_expert_group=2), "group"),
    ],
)
def test_bad_configs_raise_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        KimiK3TextConfig(**tiny_text_config(**overrides))


def test_bad_quantization_block_is_rejected():
    with pytest.raises(ValueError, match="mxfp4-pack-quantized"):
        KimiK3Config(text_config=tiny_text_config(),
                     quantization_config={"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
