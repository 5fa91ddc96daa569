"""prune + verify on tiny synthetic Kimi K3 checkpoints (MXFP4 expert layout, 3+ shards)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reap_tools.checkpoint import INDEX_NAME, PARTIAL_RE, SELECTION_NAME
from reap_tools.remote_code import AUTO_MAP
from reap_tools.prune import DELAY_ENV, SelectionError, prune_checkpoint
from reap_tools.verify import verify_checkpoint
from tokenization_kimi_k3 import write_tokenizer_files

ROOT = Path(__file__).resolve().parents[1]
RANK_FILE = ROOT / "tests" / "fixtures" / "tiktoken.model"
P = "language_model.model.layers."


def make_checkpoint(path: Path, *, layers: int = 4, experts: int = 8, top_k: int = 2, hidden: int = 64,
                    latent: int = 64, inter: int = 32, shards: int = 3, mxfp4: bool = True, seed: int = 0) -> Path:
    """A release-layout checkpoint: layer 0 dense, layers 1.. MoE, experts packed as MXFP4 (or bf16), with the
    tokenizer files, generation config and auto_map a release carries."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return torch.randn(*shape, generator=g).to(dtype)

    def scales(*shape):  # E8M0 codes of scales 2^-15 .. 2^0: no 0xFF, which is NaN and refused
        return torch.randint(112, 128, shape, generator=g, dtype=torch.uint8)

    t = {"language_model.model.embed_tokens.weight": rand(40, hidden),
         "language_model.model.norm.weight": rand(hidden),
         "language_model.lm_head.weight": rand(40, hidden)}
    for i in range(layers):
        p = f"{P}{i}."
        t[p + "input_layernorm.weight"] = rand(hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        t[p + "post_attention_layernorm.weight"] = rand(hidden)
        if i == 0:
            for name, shape in (("gate_proj", (96, hidden)), ("up_proj", (96, hidden)), ("down_proj", (hidden, 96))):
                t[f"{p}mlp.{name}.weight"] = rand(*shape)
            continue
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = rand(experts, hidden)
        t[m + "gate.e_score_correction_bias"] = rand(experts, dtype=torch.float32)
        t[m + "routed_expert_down_proj.weight"] = rand(latent, hidden)
        t[m + "routed_expert_norm.weight"] = rand(latent)
        t[m + "routed_expert_up_proj.weight"] = rand(hidden, latent)
        t[m + "shared_experts.down_proj.weight"] = rand(hidden, 2 * inter)
        for e in range(experts):
            for w, (rows, cols) in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter))):
                if mxfp4:
                    t[f"{m}experts.{e}.{w}.weight_packed"] = rand(rows, cols // 2, dtype=torch.uint8)
                    t[f"{m}experts.{e}.{w}.weight_scale"] = scales(rows, cols // 32)
                else:
                    t[f"{m}experts.{e}.{w}.weight"] = rand(rows, cols)
    path.mkdir(parents=True)
    names = list(t)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        save_file({n: t[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(x.numel() * x.element_size() for x in t.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"],
              "text_config": {"model_type": "kimi_linear", "num_hidden_layers": layers, "hidden_size": hidden,
                              "num_experts": experts, "num_experts_per_token": top_k, "first_k_dense_replace": 1,
                              "moe_layer_freq": 1, "moe_intermediate_size": inter,
                              "routed_expert_hidden_size": latent, "vocab_size": 40,
                              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}}
    if mxfp4:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}}}
    config["auto_map"] = dict(AUTO_MAP)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(path, RANK_FILE)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    (path / "modeling_kimi_k3.py").write_text("# remote code\n")
    (path / "extra").mkdir()
    (path / "extra" / "notes.txt").write_text("hello")
    return path


def selection(layers: dict[int, list[int]], **model) -> dict:
    return {"criterion": "reap", "model": model, "layers": {str(i): ids for i, ids in layers.items()}}


UNIFORM = {1: [0, 3, 5], 2: [1, 2, 7], 3: [4, 5, 6]}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("src") / "ckpt")


def read_all(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / INDEX_NAME).read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_prune_uniform_then_verify(src, tmp_path):
    dst = tmp_path / "pruned"
    r = prune_checkpoint(src, selection(UNIFORM), dst, max_shard_size="20KB", progress=False)
    assert len(r.shards) >= 3 and r.experts_per_layer == {1: 3, 2: 3, 3: 3}
    res = verify_checkpoint(dst, source=src, progress=False)
    assert res.ok, res.errors
    assert res.stats["hashed"] == r.num_tensors
    config = json.loads((dst / "config.json").read_text())
    assert config["text_config"]["num_experts"] == 3 and "num_experts_per_layer" not in config["text_config"]
    assert json.loads((dst / SELECTION_NAME).read_text())["layers"]["2"] == [1, 2, 7]
    assert (dst / "modeling_kimi_k3.py").exists() and (dst / "tokenizer_config.json").exists()
    assert not (dst / "extra").exists()  # folders are not release files
    assert not [p for p in tmp_path.iterdir() if PARTIAL_RE.match(p.name)]


def test_pruned_tensors_equal_source(src, tmp_path):
    """Read both sides with safetensors itself: kept experts renumbered, router rows sliced, rest equal."""
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    a, b = read_all(src), read_all(dst)
    expected = {}
    for name, x in a.items():
        if ".experts." not in name and ".gate." not in name:
            expected[name] = x
    for i, ids in UNIFORM.items():
        m = f"{P}{i}.block_sparse_moe."
        expected[m + "gate.weight"] = a[m + "gate.weight"][ids]
        expected[m + "gate.e_score_correction_bias"] = a[m + "gate.e_score_correction_bias"][ids]
        for k, e in enumerate(ids):
            for w in ("w1", "w2", "w3"):
                for kind in ("weight_packed", "weight_scale"):
                    expected[f"{m}experts.{k}.{w}.{kind}"] = a[f"{m}experts.{e}.{w}.{kind}"]
    assert set(b) == set(expected)
    for name, x in expected.items():
        assert b[name].dtype == x.dtype and torch.equal(b[name], x), name


def flip_byte(path: Path, tensor: str) -> None:
    index = json.loads((path / INDEX_NAME).read_text())
    file = path / index["weight_map"][tensor]
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(n))[tensor]["data_offsets"][0]
    with open(file, "r+b") as f:
        f.seek(8 + n + start)
        byte = f.read(1)
        f.seek(8 + n + start)
        f.write(bytes([byte[0] ^ 0x01]))


def test_flipped_byte_fails_naming_tensor(src, tmp_path):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    name = f"{P}2.block_sparse_moe.experts.1.w3.weight_packed"
    flip_byte(dst, name)
    assert verify_checkpoint(dst, progress=False).ok  # structure alone cannot see it
    res = verify_checkpoint(dst, source=src, progress=False)
    assert not res.ok and len(res.errors) == 1 and name in res.errors[0] and "sha256" in res.errors[0]
    assert name in res.summary()


def test_cli_verify_exit_status(src, tmp_path):
    dst = tmp_path / "pruned"
    cmd = [sys.executable, "-m", "reap_tools"]
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))
    run = subprocess.run(cmd + ["prune", str(src), str(dst), "--selection", str(sel), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ok = subprocess.run(cmd + ["verify", str(dst), "--source", str(src), "--no-progress"],
                        cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("OK ") and len(ok.stdout.splitlines()) == 1
    flip_byte(dst, f"{P}1.block_sparse_moe.gate.weight")
    bad = subprocess.run(cmd + ["verify", str(dst), "--source", str(src), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout.startswith("FAILED") and f"{P}1.block_sparse_moe.gate.weight" in bad.stderr


def test_non_uniform_selection(src, tmp_path):
    dst = tmp_path / "pruned"
    layers = {1: [0, 1], 2: [0, 2, 4, 6, 7], 3: [1, 3, 5]}
    r = prune_checkpoint(src, selection(layers), dst, progress=False)
    assert r.experts_per_layer == {1: 2, 2: 5, 3: 3}
    tc = json.loads((dst / "config.json").read_text())["text_config"]
    assert tc["num_experts"] == 5 and tc["num_experts_per_layer"] == [0, 2, 5, 3]
    res = verify_checkpoint(dst, source=src, progress=False)
    assert res.ok, res.errors
    assert res.stats["experts"] == "2..5"


def test_bf16_experts(tmp_path):
    src = make_checkpoint(tmp_path / "src", mxfp4=False, experts=6, layers=3)
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection({1: [1, 4], 2: [0, 5]}), dst, progress=False)
    res = verify_checkpoint(dst, source=src, progress=False)
    assert res.ok and res.stats["format"] == "dense", res.errors


@pytest.mark.parametrize("layers, model, message", [
    ({1: [0], 2: [0, 1], 3: [0, 1]}, {}, "fewer than top-k"),
    ({1: [0, 8], 2: [0, 1], 3: [0, 1]}, {}, "out of range"),
    ({1: [0, 1, 1], 2: [0, 1], 3: [0, 1]}, {}, "repeated"),
    ({1: [0, 1], 2: [0, 1]}, {}, "missing [3]"),
    ({1: [0, 1], 2: [0, 1], 3: [0, 1], 4: [0, 1]}, {}, "not MoE [4]"),
    (UNIFORM, {"num_experts": 896}, "num_experts=896"),
    (UNIFORM, {"num_hidden_layers": 93}, "num_hidden_layers=93"),
])
def test_bad_selection_rejected_before_writing(src, tmp_path, layers, model, message):
    dst = tmp_path / "pruned"
    with pytest.raises(SelectionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        prune_checkpoint(src, selection(layers, **model), dst, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_dst_refused(src, tmp_path):
    dst = tmp_path / "pruned"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


def start_slow_prune(src: Path, dst: Path, sel: Path) -> subprocess.Popen:
    env = dict(os.environ, **{DELAY_ENV: "0.05"})
    return subprocess.Popen([sys.executable, "-m", "reap_tools.prune", str(src), str(dst), "--selection", str(sel),
                             "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_partial(parent: Path, proc: subprocess.Popen) -> Path:
    deadline = time.time() + 30
    while time.time() < deadline:
        partials = [p for p in parent.iterdir() if PARTIAL_RE.match(p.name)]
        if partials and any(partials[0].glob("*.safetensors")):
            return partials[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("prune never started writing")


def test_killed_prune_leaves_no_dst_and_next_run_cleans(src, tmp_path):
    dst, sel = tmp_path / "pruned", tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))
    proc = start_slow_prune(src, dst, sel)
    partial = wait_for_partial(tmp_path, proc)
    proc.kill()
    proc.wait()
    assert not dst.exists()
    assert partial.name.startswith(".pruned.partial-")  # SIGKILL cannot clean up; clearly named
    prune_checkpoint(src, sel, dst, progress=False)
    assert not partial.exists() and verify_checkpoint(dst, source=src, progress=False).ok


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_terminated_prune_cleans_up(src, tmp_path, sig):
    dst, sel = tmp_path / "pruned", tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))
    proc = start_slow_prune(src, dst, sel)
    wait_for_partial(tmp_path, proc)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sel.json"]


def pruned_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, max_shard_size="20KB", progress=False)
    return dst


def test_verify_truncated_shard(src, tmp_path):
    dst = pruned_copy(src, tmp_path)
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    res = verify_checkpoint(dst, progress=False)
    assert not res.ok and any(shard.name in e and "file is" in e for e in res.errors)


def test_verify_index_problems(src, tmp_path):
    dst = pruned_copy(src, tmp_path)
    index = json.loads((dst / INDEX_NAME).read_text())
    dropped = f"{P}3.block_sparse_moe.experts.2.w2.weight_scale"
    moved = f"{P}1.input_layernorm.weight"
    del index["weight_map"][dropped]
    index["weight_map"][moved] = next(f for f in sorted(set(index["weight_map"].values()))
                                      if f != index["weight_map"][moved])
    index["metadata"]["total_size"] += 1
    (dst / INDEX_NAME).write_text(json.dumps(index))
    errors = "\n".join(verify_checkpoint(dst, progress=False).errors)
    assert f"tensor {dropped}: in" in errors and "missing from weight_map" in errors
    assert f"tensor {moved}: weight_map says" in errors
    assert "total_size" in errors


def test_verify_missing_shard_and_expert(src, tmp_path):
    dst = pruned_copy(src, tmp_path)
    index = json.loads((dst / INDEX_NAME).read_text())
    victim = index["weight_map"][f"{P}2.block_sparse_moe.experts.0.w1.weight_packed"]
    (dst / victim).unlink()
    errors = "\n".join(verify_checkpoint(dst, progress=False).errors)
    assert f"{victim}: listed in {INDEX_NAME} but missing" in errors
    assert f"tensor {P}2.block_sparse_moe.experts.0.w1.weight_packed: missing" in errors


def test_verify_config_mismatch(src, tmp_path):
    dst = pruned_copy(src, tmp_path)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["num_experts"] = 4
    (dst / "config.json").write_text(json.dumps(config))
    errors = "\n".join(verify_checkpoint(dst, progress=False).errors)
    assert f"tensor {P}1.block_sparse_moe.experts.3.w1.weight_packed: missing" in errors
    assert f"tensor {P}1.block_sparse_moe.gate.weight: shape [3, 64], config implies [4, 64]" in errors


def test_verify_selection_and_per_layer_counts_against_config(src, tmp_path):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection({1: [0, 1], 2: [0, 2, 4, 6, 7], 3: [1, 3, 5]}), dst, progress=False)
    other = selection({1: [0, 1, 2], 2: [0, 2, 4, 6, 7], 3: [1, 3, 5]})
    errors = verify_checkpoint(dst, selection=other, progress=False).errors
    assert errors == ["layer 1: config.json says 2 experts, the selection keeps 3"]
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["num_experts"] = 8
    (dst / "config.json").write_text(json.dumps(config))
    assert any("largest of num_experts_per_layer is 5" in e for e in verify_checkpoint(dst, progress=False).errors)
