"""The parent's published layout end to end (issue 16): the root config.json against the parent's, key by key;
a tiny checkpoint in the parent's exact structure, MoonViT tensors included, loading text-only through `auto_map`;
prune keeping the layout and the vision tensors byte for byte.

`tests/fixtures/parent_config.json` is moonshotai/Kimi-K3's `config.json` as published (transformers 4.56.2 wrote
it: the nested `text_config` carries every generic PretrainedConfig key). It was taken from a stored verbatim dump
of the release's config.json, and agrees with the defaults and the checks of SGLang 0.5.23
(`srt/configs/kimi_k3.py`: `KimiK3VisionConfig`, `media_placeholder_token_id` 163605) and with SPEC.md §1.
"""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from reap_tools.checkpoint import INDEX_NAME, read_config
from reap_tools.prune import prune_checkpoint
from reap_tools.release_layout import is_vision_tensor
from reap_tools.tiny import MODEL_CODE, random_model, tiny_config, write_checkpoint
from reap_tools.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PARENT = json.loads((ROOT / "tests" / "fixtures" / "parent_config.json").read_text())

# Every way this checkpoint's config.json may differ from the parent's: (path, parent value, ours, why).
ALLOWED = {
    ("auto_map", "AutoModel"): ("modeling_kimi_k3.KimiK3ForConditionalGeneration", "modeling_kimi_k3.KimiK3Model",
                                "this repo's bare decoder"),
    ("auto_map", "AutoModelForCausalLM"): ("modeling_kimi_k3.KimiK3ForConditionalGeneration",
                                           "modeling_kimi_k3.KimiK3ForCausalLM", "this repo's text LM"),
    ("text_config", "num_experts"): (896, 320, "the prune: 320 routed experts per MoE layer"),
    ("text_config", "max_position_embeddings"): (1048576, 131072, "the context this checkpoint declares"),
    ("text_config", "auto_map"): (PARENT["text_config"]["auto_map"], None,
                                  "points at modeling_kimi_linear.py, which this repo does not ship"),
}
MISSING = object()


def differences(a, b, path=()):
    """{path: (a's value, b's value)} over nested dicts; a key absent on one side reads as None."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in sorted(set(a) | set(b)):
            out.update(differences(a.get(key, MISSING), b.get(key, MISSING), path + (key,)))
        return out
    if a is MISSING or b is MISSING or a != b or type(a) is not type(b):
        return {path: (None if a is MISSING else a, None if b is MISSING else b)}
    return {}


def test_root_config_is_the_parents_but_for_the_listed_keys():
    ours = json.loads((ROOT / "config.json").read_text())
    found = differences(PARENT, ours)
    assert {k: v for k, v in found.items()} == {k: v[:2] for k, v in ALLOWED.items()}
    assert ours["architectures"] == ["KimiK3ForConditionalGeneration"] and ours["model_type"] == "kimi_k3"
    text = ours["text_config"]
    assert text["model_type"] == "kimi_linear" and "quantization_config" not in ours
    group = text["quantization_config"]["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["weights"]["observer"] == "minmax"
    assert group["weights"]["group_size"] == 32 and group["weights"]["scale_dtype"] == "torch.uint8"
    assert ours["media_placeholder_token_id"] == 163605 and ours["vision_config"]["vt_num_hidden_layers"] == 27


def test_root_config_reads_and_writes_the_release_layout():
    from configuration_kimi_k3 import KimiK3Config

    config = KimiK3Config.from_pretrained(str(ROOT))
    assert config.text_config.num_experts == 320 and config.experts_packed
    assert config.expert_quantization["config_groups"]["group_0"]["targets"] == ["Linear"]
    written = config.to_dict()
    assert written["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert "quantization_config" not in written
    assert written["text_config"]["quantization_config"] == config.expert_quantization
    assert written["vision_config"] == PARENT["vision_config"] and written["media_placeholder_token_id"] == 163605


def remote_copy(directory, tmp_path, name):
    """A copy of a checkpoint with the root .py files beside it, loaded only through its auto_map."""
    dst = tmp_path / name
    shutil.copytree(directory, dst)
    for code in MODEL_CODE:
        shutil.copyfile(ROOT / code, dst / code)
    return dst


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same tiny model written twice in the release layout: with the vision tower and without."""
    root = tmp_path_factory.mktemp("release")
    model = random_model(tiny_config(packed=True), seed=3)
    plain = write_checkpoint(str(root / "plain"), model=model)
    vision = write_checkpoint(str(root / "vision"), model=model, vision=True)
    return Path(plain), Path(vision)


def test_tiny_checkpoint_has_the_parents_structure(pair):
    _, vision = pair
    config = read_config(vision)
    assert config["architectures"] == PARENT["architectures"] and config["model_type"] == "kimi_k3"
    assert set(config) >= set(PARENT) and "quantization_config" not in config
    assert set(config["vision_config"]) == set(PARENT["vision_config"]) - {"_attn_implementation"}
    assert config["text_config"]["quantization_config"] == PARENT["text_config"]["quantization_config"]
    names = set(json.loads((vision / INDEX_NAME).read_text())["weight_map"])
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}


def test_vision_tower_is_skipped_by_name_and_said_once(pair, tmp_path):
    plain, vision = (remote_copy(p, tmp_path, p.name) for p in pair)
    handler = Records()
    logger = logging.getLogger("transformers.kimi_k3")
    logger.addHandler(handler)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(vision, trust_remote_code=True, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert type(model).__name__ == "KimiK3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    said = [m for m in handler.messages if "vision-tower" in m]
    assert len(said) == 1 and "skipping 18 vision-tower tensors" in said[0] and r"^mm_projector\." in said[0], said
    reference = AutoModelForCausalLM.from_pretrained(plain, trust_remote_code=True)
    ids = torch.tensor([[1, 5, 9, 77, 300, 2, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_hub_load_checks_the_snapshot_and_says_the_skip_once(pair, tmp_path):
    """A repository id read from the hub cache (offline) is checked as a folder is: the vision tower is skipped with
    one log line, and a tensor the model does not know is an error naming it."""
    _, vision = pair
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--kimi--tiny-vision"
    snapshot = remote_copy(vision, repo / "snapshots", commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    handler = Records()
    logger = logging.getLogger("transformers.kimi_k3")
    logger.addHandler(handler)
    try:
        model = AutoModelForCausalLM.from_pretrained("kimi/tiny-vision", cache_dir=tmp_path / "hub",
                                                     trust_remote_code=True)
    finally:
        logger.removeHandler(handler)
    assert type(model).__name__ == "KimiK3ForCausalLM"
    said = [m for m in handler.messages if "vision-tower" in m]
    assert len(said) == 1 and "skipping 18 vision-tower tensors" in said[0] and commit in said[0], said
    from safetensors.torch import load_file, save_file

    shard = sorted(snapshot.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["language_model.model.layers.0.stray.weight"] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.stray\.weight"):
        AutoModelForCausalLM.from_pretrained("kimi/tiny-vision", cache_dir=tmp_path / "hub", trust_remote_code=True)


def test_any_other_unexpected_tensor_is_still_an_error(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = remote_copy(pair[1], tmp_path, "extra")
    shard = directory / "model-vision.safetensors"
    tensors = load_file(str(shard))
    tensors["audio_tower.proj.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((directory / INDEX_NAME).read_text())
    index["weight_map"]["audio_tower.proj.weight"] = shard.name
    (directory / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unexpected: audio_tower\.proj\.weight"):
        AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)


def sha256_of(directory, names):
    index = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    out = {}
    for name in names:
        with safe_open(str(directory / index[name]), "pt") as f:
            out[name] = hashlib.sha256(f.get_tensor(name).view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def test_prune_keeps_the_layout_and_the_vision_tensors(pair, tmp_path):
    _, src = pair
    layers = {i: [0, 2, 5] for i in range(1, 6)}
    selection = {"criterion": "reap", "model": {}, "layers": {str(i): ids for i, ids in layers.items()}}
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection, dst, progress=False)
    before, after = read_config(src), read_config(dst)
    assert differences(before, after) == {("text_config", "num_experts"): (8, 3)}
    vision = sorted(n for n in json.loads((src / INDEX_NAME).read_text())["weight_map"] if is_vision_tensor(n))
    assert len(vision) == 18 and sha256_of(src, vision) == sha256_of(dst, vision)
    result = verify_checkpoint(dst, source=src, progress=False)
    assert result.ok, result.errors
    model = AutoModelForCausalLM.from_pretrained(remote_copy(dst, tmp_path, "pruned-remote"), trust_remote_code=True)
    assert model.config.text_config.num_experts == 3


def test_verify_source_checks_the_vision_tensors(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = pair
    dst = tmp_path / "pruned"
    selection = {"criterion": "reap", "model": {}, "layers": {str(i): [1, 3] for i in range(1, 6)}}
    prune_checkpoint(src, selection, dst, progress=False)
    shard = next(p for p in dst.glob("*.safetensors") if "mm_projector.proj.0.weight" in safe_open(str(p), "pt").keys())
    tensors = load_file(str(shard))
    tensors["mm_projector.proj.0.weight"] = tensors["mm_projector.proj.0.weight"] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    result = verify_checkpoint(dst, source=src, progress=False)
    assert not result.ok and any("mm_projector.proj.0.weight" in e and "sha256" in e for e in result.errors)
