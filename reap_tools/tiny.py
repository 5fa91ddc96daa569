"""Tiny random Kimi K3 checkpoints in the release layout, for tests, benchmarks and first runs.

`write_checkpoint(dst, ...)` saves a model with `save_pretrained` and puts the remote-code files, `auto_map` and a
byte-level tokenizer (256 ranks, then the 256 reserved ids: 512, the tiny vocabulary) beside it, so
`AutoModelForCausalLM` and `AutoTokenizer.from_pretrained(dst, trust_remote_code=True)` load it like the real
release.
"""

import os
import shutil
import tempfile

from pathlib import Path

import safetensors
import safetensors.torch
import torch

from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import KimiK3ForCausalLM
from mxfp4 import mxfp4_quantization_config
from reap_tools.checkpoint import CONFIG_NAME, INDEX_NAME, load_tensors, read_json, write_json
from reap_tools.cli import ArgumentParser, fail
from reap_tools.release_layout import tiny_vision_config, to_release_layout, vision_tensors
from reap_tools.remote_code import AUTO_MAP, MODEL_CODE, copy_remote_code
from tokenization_kimi_k3 import VOCAB_FILE, write_rank_file, write_tokenizer_files


def tiny_text_config(**overrides):
    """A small text config with every architectural feature of the release: KDA and MLA layers (1-based lists),
    a dense layer 0, LatentMoE with shared experts, and more than one attention-residual block."""
    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=4096,
        linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5]),
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=511,
    )
    text.update(overrides)
    return text


def tiny_config(packed=True, **text_overrides):
    """Top-level config around `tiny_text_config`; with `packed` the routed experts are MXFP4."""
    text = tiny_text_config(**text_overrides)
    return KimiK3Config(
        text_config=text,
        quantization_config=mxfp4_quantization_config() if packed else None,
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        auto_map=dict(AUTO_MAP),
    )


def parent_text_config(**overrides):
    """`tiny_text_config` in the parent's layout at tiny widths: a dense layer 0, KDA layers with an MLA layer every
    fourth and the last two (1-based 4, 8, 9 of 9, as 4, 8, ..., 92, 93 of 93), attention-residual blocks of 3 (three
    block snapshots, the output mix over four sources) and 16 routed experts, top-4."""
    text = dict(num_hidden_layers=9, attn_res_block_size=3, num_experts=16, num_experts_per_token=4,
                linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[4, 8, 9],
                                        kda_layers=[1, 2, 3, 5, 6, 7]))
    text.update(overrides)
    return tiny_text_config(**text)


def write_parent_layout(dst, seed=0, max_shard_size="200KB", **text_overrides):
    """A parent-layout tiny checkpoint (`parent_text_config`) as the parent ships: MXFP4 experts under their
    per-expert names, several shards, the vision tower in a shard of its own."""
    return write_checkpoint(dst, packed=True, seed=seed, max_shard_size=max_shard_size, vision=True,
                            **parent_text_config(**text_overrides))


def random_model(config, seed=0):
    """A randomly initialised model in eval mode; the router bias gets small random values so it matters."""
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.05)
            elif name.endswith("_res_proj.weight"):
                param.normal_(0.0, 0.05)
    return model


def copy_model_code(dst):
    """Put the model's remote-code files next to a checkpoint."""
    copy_remote_code(dst, MODEL_CODE)


def write_checkpoint(dst, model=None, packed=True, seed=0, max_shard_size=None, vision=False, **text_overrides):
    """Save `model` (or a fresh random tiny one) in the parent's release layout at `dst`, atomically (temp dir +
    rename). With `vision`, small MoonViT tensors (`vision_tower.*`, `mm_projector.*`) go in a shard of their own,
    as in the parent."""
    if os.path.exists(dst):
        raise FileExistsError(f"{dst}: already exists")
    model = model if model is not None else random_model(tiny_config(packed, **text_overrides), seed)
    model.config.auto_map = dict(AUTO_MAP)
    parent = os.path.dirname(os.path.abspath(dst))
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **kwargs)
        config_path = os.path.join(tmp, CONFIG_NAME)
        vision_config = tiny_vision_config(model.config.text_config.hidden_size)
        write_json(Path(config_path), to_release_layout(read_json(Path(config_path)), vision_config))
        if vision:
            _add_vision_shard(tmp, vision_tensors(vision_config, seed))
        copy_model_code(tmp)
        write_rank_file({bytes([b]): b for b in range(256)}, os.path.join(tmp, VOCAB_FILE))
        write_tokenizer_files(tmp, os.path.join(tmp, VOCAB_FILE))
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _add_vision_shard(directory, tensors):
    """Write `tensors` as one more shard and list it in the index (made here when the folder had one file)."""
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index_path):
        index = read_json(Path(index_path))
    else:
        single = os.path.join(directory, "model.safetensors")
        os.rename(single, os.path.join(directory, "model-00001-of-00002.safetensors"))
        names = safetensors.safe_open(os.path.join(directory, "model-00001-of-00002.safetensors"), "pt").keys()
        index = {"metadata": {"total_size": 0}, "weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}
    shard = "model-vision.safetensors"
    safetensors.torch.save_file(tensors, os.path.join(directory, shard), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    write_json(Path(index_path), index)
    index["metadata"]["total_size"] = sum(t.nbytes for t in load_tensors(directory).values())
    write_json(Path(index_path), index)


def main(argv=None):
    parser = ArgumentParser(prog="python -m reap_tools tiny", description=__doc__.splitlines()[0])
    parser.add_argument("dst", help="output checkpoint directory (must not exist)")
    parser.add_argument("--bf16-experts", action="store_true", help="plain routed experts instead of MXFP4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200KB" to write several shards')
    args = parser.parse_args(argv)
    try:
        write_checkpoint(args.dst, packed=not args.bf16_experts, seed=args.seed, max_shard_size=args.max_shard_size)
    except (OSError, ValueError) as e:
        return fail("tiny", e)
    print(f"wrote {args.dst}")
    return 0
