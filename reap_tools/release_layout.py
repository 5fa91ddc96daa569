"""The parent's published layout (moonshotai/Kimi-K3 `config.json`), for configs and checkpoints this repo writes.

The parent's top level is the multimodal `KimiK3ForConditionalGeneration` with the text model under `text_config`,
a MoonViT `vision_config` and `media_placeholder_token_id`; its compressed-tensors block sits inside `text_config`
with `targets ["Linear"]`. Its weights hold the vision tower (`vision_tower.*`, `mm_projector.*`) beside the
`language_model.*` text tensors. `tests/fixtures/parent_config.json` is the parent's config itself.
"""

from __future__ import annotations

import copy

import torch

from configuration_kimi_k3 import RELEASE_ARCHITECTURE

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# The media placeholder's offset from [BOS] among the reserved specials (163605 - 163584 in the parent).
MEDIA_PLACEHOLDER_OFFSET = 21
IGNORE = (
    r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", r"re:.*lm_head.*",
    r"re:.*vision_tower.*", r"re:.*mm_projector.*",
)


def is_vision_tensor(name: str) -> bool:
    """A tensor of the MoonViT tower or its projector (not part of the text model)."""
    return name.startswith(VISION_PREFIXES)


def release_quantization_config() -> dict:
    """The parent's compressed-tensors block, key for key (MXFP4: 4-bit float groups of 32, E8M0 uint8 scales)."""
    return {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None,
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def tiny_vision_config(text_hidden_size: int) -> dict:
    """A MoonViT `vision_config` with the parent's keys at toy size (2 blocks of width 32)."""
    return {
        "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "init_pos_emb_height": 4, "init_pos_emb_time": 4,
        "init_pos_emb_width": 4, "linear_bias": False, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mlp_type": "mlp2", "mm_hidden_size": 32, "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm",
        "patch_embed_proj_bias": False, "patch_size": 2, "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "qkv_hidden_size": 48, "text_hidden_size": text_hidden_size, "vt_hidden_size": 32,
        "vt_intermediate_size": 64, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2,
    }


def vision_tensors(vision_config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random BF16 vision-tower tensors under the parent's names and shape rules, sized by `vision_config`."""
    g = torch.Generator().manual_seed(seed)
    w, inner, qkv = vision_config["vt_hidden_size"], vision_config["vt_intermediate_size"], vision_config["qkv_hidden_size"]
    merged = w * vision_config["merge_kernel_size"][0] * vision_config["merge_kernel_size"][1]
    p, text = vision_config["patch_size"], vision_config["text_hidden_size"]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (w, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (vision_config["init_pos_emb_height"],
                                                    vision_config["init_pos_emb_width"], w),
        "vision_tower.encoder.final_layernorm.weight": (w,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.2.weight": (text, merged),
        "mm_projector.post_norm.weight": (text,),
    }
    for b in range(vision_config["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{b}."
        shapes.update({block + "wqkv.weight": (3 * qkv, w), block + "wo.weight": (w, qkv),
                       block + "mlp.fc0.weight": (inner, w), block + "mlp.fc1.weight": (w, inner),
                       block + "norm0.weight": (w,), block + "norm1.weight": (w,)})
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in sorted(shapes.items())}


def to_release_layout(config: dict, vision_config: dict | None = None) -> dict:
    """`config` (a config.json dict) rewritten to the parent's structure: its architecture name, the
    compressed-tensors block inside `text_config` in the parent's form, `media_placeholder_token_id`, and
    `vision_config` (given, or the one already there). Keys the parent does not have are left as they are."""
    config = copy.deepcopy(config)
    text = config.setdefault("text_config", {})
    config["architectures"] = [RELEASE_ARCHITECTURE]
    if config.pop("quantization_config", None) or text.get("quantization_config"):
        text["quantization_config"] = release_quantization_config()  # the one format the model runs (MXFP4)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))  # engines read it here
    bos = config.get("bos_token_id", text.get("bos_token_id"))
    config.setdefault("media_placeholder_token_id", bos + MEDIA_PLACEHOLDER_OFFSET)
    config.setdefault("ignore_index", -100)
    config.setdefault("image_placeholder", "<|kimi_image_placeholder|>")
    if vision_config is not None:
        config["vision_config"] = vision_config
    if "vision_config" not in config:
        raise ValueError("config.json: no vision_config (the release layout needs one; pass vision_config=)")
    return config
