"""Release-layout round trips, strict loading and bad checkpoints (issue: core model, points 1, 6 and 7)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from reap_tools.tiny import random_model, tiny_config, write_checkpoint

PROMPT = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11]])


def logits_of(model, ids=PROMPT):
    with torch.no_grad():
        return model(ids).logits


def test_round_trip_in_a_fresh_process(tmp_path):
    model = random_model(tiny_config(packed=True), seed=1)
    expected = logits_of(model)
    directory = write_checkpoint(str(tmp_path / "ckpt"), model=model)
    for name in ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "kda.py", "mxfp4.py", "config.json"):
        assert os.path.exists(os.path.join(directory, name)), name
    config = json.load(open(os.path.join(directory, "config.json")))
    assert set(config["auto_map"]) >= {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and "quantization_config" not in config
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert config["text_config"]["model_type"] == "kimi_linear"
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in keys
    assert "language_model.lm_head.weight" in keys
    assert not any(k.endswith("experts.0.w1.weight") for k in keys)

    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads({torch.get_num_threads()})  # same reduction order as the parent process
        model, info = AutoModelForCausalLM.from_pretrained({directory!r}, trust_remote_code=True,
                                                           output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        expert = model.language_model.model.layers[1].block_sparse_moe.experts[0].w1
        assert expert.weight_packed.dtype == torch.uint8 and expert.weight_scale.dtype == torch.uint8
        assert type(expert).__name__ == "MXFP4Linear" and not isinstance(expert, torch.nn.Linear)
        with torch.no_grad():
            torch.save(model(torch.tensor({PROMPT.tolist()})).logits, sys.argv[1])
        """
    )
    out = tmp_path / "logits.pt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=tmp_path)
    assert torch.equal(torch.load(out), expected)


def test_auto_model_loads_without_head(packed_checkpoint):
    model, info = AutoModel.from_pretrained(packed_checkpoint, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"]
    causal = AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)
    with torch.no_grad():
        hidden = model(PROMPT).last_hidden_state
        assert torch.equal(causal.language_model.lm_head(hidden), causal(PROMPT).logits)


def test_config_reads_the_release_file():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = AutoConfig.from_pretrained(root, trust_remote_code=True)
    text = config.text_config
    assert text.num_experts == 320 and text.max_position_embeddings == 131072
    assert config.experts_packed
    assert [i for i, t in enumerate(text.layer_types) if t == "mla"] == list(range(3, 92, 4)) + [92]


def _tensor_surgery(directory, edit):
    """Rewrite the single-file checkpoint with `edit(dict of tensors)` applied."""
    path = os.path.join(directory, "model.safetensors")
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    edit(tensors)
    save_file(tensors, path, metadata=metadata)


def test_missing_expert_scale_is_an_error_naming_it(packed_checkpoint):
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    _tensor_surgery(packed_checkpoint, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing: .*layers\.2\.block_sparse_moe\.experts\.3\.w2\.weight_scale"):
        AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)


def test_unexpected_tensor_is_an_error_naming_it(packed_checkpoint):
    name = "language_model.model.layers.2.block_sparse_moe.experts.99.w1.weight_packed"
    _tensor_surgery(packed_checkpoint, lambda t: t.__setitem__(name, torch.zeros(32, 16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"unexpected: .*experts\.99\.w1\.weight_packed"):
        AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)


def test_router_with_wrong_row_count_is_an_error_naming_it(packed_checkpoint):
    name = "language_model.model.layers.1.block_sparse_moe.gate.weight"
    _tensor_surgery(packed_checkpoint, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(Exception, match=r"layers\.1\.block_sparse_moe\.gate\.weight"):
        AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)


def test_truncated_shard_is_an_error_naming_the_file(tmp_path):
    directory = write_checkpoint(str(tmp_path / "sharded"), packed=True, max_shard_size="100KB")
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    shard = sorted(set(index["weight_map"].values()))[1]
    path = os.path.join(directory, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ValueError, match=shard):
        AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)


def test_device_map_auto_with_disk_offload_gives_the_same_logits(packed_checkpoint, tmp_path):
    reference = AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)
    offloaded = AutoModelForCausalLM.from_pretrained(
        packed_checkpoint,
        trust_remote_code=True,
        device_map="auto",
        max_memory={"cpu": "600KB"},
        offload_folder=str(tmp_path / "offload"),
    )
    placements = set(offloaded.hf_device_map.values())
    assert {"cpu", "disk"} <= placements, offloaded.hf_device_map
    assert torch.allclose(logits_of(offloaded), logits_of(reference), atol=1e-5, rtol=1e-5)
