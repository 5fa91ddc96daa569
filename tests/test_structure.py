"""The structural pass every load runs before allocating anything large (`kimi_k3_loading.check_structure`): the
config's sizes against the shard headers, one dtype rule, a sample of the MXFP4 scales for E8M0's NaN code; and the
full scale check after a load. A hostile config fails in seconds under a 4 GB address-space cap, naming the field."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_k3_loading import accepted_dtypes, check_structure, read_safetensors_headers
from modeling_kimi_k3 import KimiK3ForCausalLM
from reap_tools.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]
EXPERT = "language_model.model.layers.{}.block_sparse_moe.experts.{}.{}"


def edit_config(folder, **text):
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["text_config"].update(text)
    path.write_text(json.dumps(config))


def edit_tensors(folder, edit):
    path = Path(folder) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


def test_the_dtype_rule():
    assert accepted_dtypes(EXPERT.format(1, 3, "w2.weight_scale")) == ("U8",)
    assert accepted_dtypes(EXPERT.format(1, 3, "w1.weight_packed")) == ("U8",)
    assert accepted_dtypes("language_model.model.layers.2.block_sparse_moe.gate.weight") == ("BF16", "F16", "F32")


@pytest.mark.parametrize("text, message", [
    ({"num_experts": 6}, r"config: num_experts, hidden_size = 6, 64 \(layer 1\), but "
                         r"language_model\.model\.layers\.1\.block_sparse_moe\.gate\.weight is \[8, 64\]"),
    ({"num_hidden_layers": 7, "linear_attn_config": dict(num_heads=4, head_dim=16, full_attn_layers=[3, 6, 7],
                                                         kda_layers=[1, 2, 4, 5])},
     r"config: num_hidden_layers = 7, but the shards hold layers 0\.\.5"),
    ({"vocab_size": 1024}, r"config: vocab_size, hidden_size = 1024, 64, but .*embed_tokens\.weight is \[512, 64\]"),
])
def test_config_sizes_the_shards_contradict_are_refused_naming_the_field(packed_checkpoint, text, message):
    edit_config(packed_checkpoint, **text)
    with pytest.raises(ValueError, match=message):
        KimiK3ForCausalLM.from_pretrained(packed_checkpoint)


def test_a_sampled_nan_scale_is_refused_before_the_load(packed_checkpoint):
    name = EXPERT.format(1, 7, "w3.weight_scale")  # layer 1's last expert: in the sample
    edit_tensors(packed_checkpoint, lambda t: t[name].view(-1)[5:6].fill_(0xFF))
    config = tiny_config(packed=True)
    with pytest.raises(ValueError, match=rf"NaN scale: {name} in model\.safetensors holds E8M0 code 0xFF"):
        check_structure(packed_checkpoint, config, read_safetensors_headers(packed_checkpoint))


def test_a_nan_scale_outside_the_sample_is_refused_after_the_load(packed_checkpoint):
    name = EXPERT.format(2, 3, "w2.weight_scale")  # not the first or last expert: found by the full check
    edit_tensors(packed_checkpoint, lambda t: t[name].view(-1)[0:1].fill_(0xFF))
    check_structure(packed_checkpoint, tiny_config(packed=True), read_safetensors_headers(packed_checkpoint))
    with pytest.raises(ValueError, match=rf"{name} holds E8M0 code 0xFF \(NaN\)"):
        KimiK3ForCausalLM.from_pretrained(packed_checkpoint)


HOSTILE = textwrap.dedent(
    """
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    start = time.perf_counter()
    from transformers import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    except ValueError as err:
        print(f"REFUSED {time.perf_counter() - start:.1f} s: {err}")
    """
)


def test_a_hostile_expert_count_is_refused_in_seconds_under_a_memory_cap(packed_checkpoint):
    """10^7 experts in the config, tensors for 8: refused from the headers, under a 4 GB address-space cap, before
    any model is built (building one was 10 GB of RSS after 13 minutes)."""
    edit_config(packed_checkpoint, num_experts=10**7)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HOSTILE, packed_checkpoint], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    print(f"hostile num_experts: subprocess {time.perf_counter() - start:.1f} s; {done.stdout.strip()[:120]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout and "config: num_experts, hidden_size = 10000000, 64 (layer 1)" in done.stdout


def test_verify_refuses_what_the_loader_refuses(packed_checkpoint):
    """One rule for both: a router stored as I64 and a NaN scale fail `verify` (and so `upload`) as they fail a load."""
    from reap_tools import upload
    from reap_tools.verify import verify_checkpoint

    router = "language_model.model.layers.2.block_sparse_moe.gate.weight"
    scale = EXPERT.format(1, 0, "w1.weight_scale")
    assert verify_checkpoint(packed_checkpoint, progress=False).errors == []
    edit_tensors(packed_checkpoint, lambda t: t.__setitem__(router, t[router].to(torch.int64)))
    errors = verify_checkpoint(packed_checkpoint, progress=False).errors
    assert any(f"wrong dtype: {router} in model.safetensors (I64, model expects BF16 or F16 or F32)" in e
               for e in errors), errors
    assert upload.main([packed_checkpoint, "org/model", "--dry-run", "--no-progress"]) == 1
    with pytest.raises(ValueError, match=f"wrong dtype: {router}"):
        KimiK3ForCausalLM.from_pretrained(packed_checkpoint)
    edit_tensors(packed_checkpoint, lambda t: (t.__setitem__(router, t[router].float()),
                                               t[scale].view(-1)[3:4].fill_(0xFF)))
    errors = verify_checkpoint(packed_checkpoint, progress=False).errors
    assert any(f"NaN scale: {scale} in model.safetensors holds E8M0 code 0xFF" in e for e in errors), errors


def test_verify_refuses_a_hostile_expert_count_in_seconds_under_a_memory_cap(packed_checkpoint):
    """verify reached 16 GB on a config claiming 10^7 experts; the shared pass refuses it from the headers first."""
    edit_config(packed_checkpoint, num_experts=10**7)
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
              "from reap_tools.verify import main; sys.exit(main(sys.argv[1:]))")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script, packed_checkpoint, "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    print(f"verify, hostile num_experts: {time.perf_counter() - start:.1f} s, exit {done.returncode}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "config: num_experts, hidden_size = 10000000, 64 (layer 1)" in done.stderr
