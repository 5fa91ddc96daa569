"""The model's own loader (`kimi_k3_loading`): stacked expert parameters read straight from the release layout.

Every loaded tensor is compared bit for bit with safetensors' own reading of the shards (the independent reference),
through the key map in both directions; `save_pretrained` writes the release layout back byte for byte; the reader's
coalescing, row blocks, tensor-parallel slices and threads give the same bytes at any chunk size; the full release
config builds on the meta device as ~3,000 parameters, not 179,100.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kimi_k3_loading as loading
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_loading import (build_on_meta, materialize, pieces_for, read_safetensors_headers, read_tensors,
                             release_key, release_shapes, release_state_dict, stacked_key)
from modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM
from reap_tools.tiny import parent_text_config, tiny_config, write_checkpoint
from tensor_parallel import TensorParallel, shard

ROOT = Path(__file__).resolve().parents[1]


def shard_tensors(folder):
    """name -> tensor of every safetensors file in `folder`, read by safetensors itself."""
    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update((k, f.get_tensor(k)) for k in f.keys())
    return tensors


def assert_same_bytes(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def parent_layout(tmp_path_factory):
    """A multi-shard parent-layout checkpoint: dense layer 0, KDA and MLA layers, 16 MXFP4 experts a MoE layer."""
    return write_checkpoint(str(tmp_path_factory.mktemp("loader") / "parent"), packed=True, seed=3,
                            max_shard_size="200KB", **parent_text_config())


def test_key_map_both_ways():
    assert stacked_key("language_model.model.layers.3.block_sparse_moe.experts.17.w2.weight_scale") == (
        "language_model.model.layers.3.block_sparse_moe.experts.w2.weight_scale", 17)
    assert stacked_key("language_model.model.layers.3.self_attn.o_proj.weight") == (
        "language_model.model.layers.3.self_attn.o_proj.weight", None)
    assert release_key("a.experts.w1.weight_packed", 5) == "a.experts.5.w1.weight_packed"


def test_loaded_parameters_equal_the_shards_bit_for_bit(parent_layout):
    want = shard_tensors(parent_layout)
    model = KimiK3ForCausalLM.from_pretrained(parent_layout, dtype=torch.float32)
    got = release_state_dict(model.state_dict())
    text = {k: v for k, v in want.items() if not k.startswith(("vision_tower.", "mm_projector."))}
    assert set(got) == set(text)
    for name, tensor in text.items():
        assert_same_bytes(got[name], tensor, name)
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts, KimiK3Experts) and len(experts) == 16
    assert experts.w1.weight_packed.shape == (16, *text[release_key(
        "language_model.model.layers.1.block_sparse_moe.experts.w1.weight_packed", 0)].shape)


def test_bf16_load_is_the_shards_cast(parent_layout):
    want = shard_tensors(parent_layout)
    model = KimiK3ForCausalLM.from_pretrained(parent_layout, dtype=torch.bfloat16)
    for name, tensor in release_state_dict(model.state_dict()).items():
        expected = want[name] if not want[name].is_floating_point() or name.endswith(
            ("A_log", "dt_bias", "e_score_correction_bias")) else want[name].to(torch.bfloat16)
        assert_same_bytes(tensor, expected, name)


def test_the_demo_loads_bit_for_bit():
    folder = ROOT / "demo" / "reap40"
    want = shard_tensors(folder)
    model = KimiK3ForCausalLM.from_pretrained(str(folder), dtype="auto")
    got = release_state_dict(model.state_dict())
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert_same_bytes(got[name], tensor, name)


def test_save_pretrained_writes_the_release_layout_byte_for_byte(parent_layout, tmp_path):
    model = KimiK3ForCausalLM.from_pretrained(parent_layout, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved", max_shard_size="300KB")
    want = {k: v for k, v in shard_tensors(parent_layout).items()
            if not k.startswith(("vision_tower.", "mm_projector."))}
    got = shard_tensors(tmp_path / "saved")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert_same_bytes(got[name], tensor, name)
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert_same_bytes(a, b, name)


def test_load_state_dict_takes_the_release_names(parent_layout):
    model = KimiK3ForCausalLM.from_pretrained(parent_layout, dtype=torch.float32)
    fresh = KimiK3ForCausalLM(model.config)
    fresh.load_state_dict(release_state_dict({k: v.clone() for k, v in model.state_dict().items()}), strict=True)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert_same_bytes(a, b, name)


@pytest.mark.parametrize("chunk", [1 << 10, 7 << 10, 64 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_reader_gives_the_same_bytes_at_any_chunk_size(parent_layout, monkeypatch, chunk, threads):
    """Runs split and coalesced differently (row blocks of a tensor larger than a chunk included), bf16 casts
    through the staging buffer: the same parameters."""
    monkeypatch.setattr(loading, "CHUNK_BYTES", chunk)
    config = KimiK3Config.from_pretrained(parent_layout)
    headers = read_safetensors_headers(parent_layout)
    want = shard_tensors(parent_layout)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_on_meta(KimiK3ForCausalLM, config, dtype)
        materialize(model, lambda name: "cpu")
        nbytes = read_tensors(parent_layout, headers, pieces_for(model), threads=threads)
        assert nbytes == sum(v.numel() * v.element_size() for k, v in want.items()
                             if not k.startswith(("vision_tower.", "mm_projector.")))
        for name, tensor in release_state_dict(model.state_dict()).items():
            assert torch.equal(tensor, want[name].to(tensor.dtype)), name


@pytest.mark.parametrize("rank", [0, 3])
def test_a_tensor_parallel_rank_reads_its_own_slices(parent_layout, monkeypatch, rank):
    """Rows read as byte ranges, columns (strided on disk) read whole and sliced: each equals the slice of the
    whole tensor that the plan names."""
    monkeypatch.setattr(loading, "CHUNK_BYTES", 3 << 10)
    config = KimiK3Config.from_pretrained(parent_layout)
    headers = read_safetensors_headers(parent_layout)
    want = shard_tensors(parent_layout)
    model = build_on_meta(KimiK3ForCausalLM, config, torch.float32)
    sources = shard(model, TensorParallel(rank, 4))
    materialize(model, lambda name: "cpu")
    read_tensors(parent_layout, headers, pieces_for(model, sources), threads=2)
    sliced = [name for name, (_, index) in sources.items() if index]
    assert any(".o_proj." in n for n in sliced) and any(".experts." in n for n in sliced)
    for name, param in model.named_parameters():
        key, index = sources.get(name, (name, ()))
        if loading.is_stacked(key):
            first = index[0].start
            rows = [want[release_key(key, first + e)] for e in range(param.shape[0])]
            expected = torch.stack(rows)
        else:
            expected = want[key][index]
        assert torch.equal(param, expected.to(param.dtype)), name


def test_a_shard_cut_short_after_the_check_is_an_error_naming_it(parent_layout, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(parent_layout, folder)
    headers = read_safetensors_headers(folder)
    entry = max(headers.values(), key=lambda e: e.stop)
    os.truncate(folder / entry.file, entry.stop - 10)
    config = KimiK3Config.from_pretrained(folder)
    model = build_on_meta(KimiK3ForCausalLM, config, torch.float32)
    materialize(model, lambda name: "cpu")
    with pytest.raises(ValueError, match=rf"{entry.file}.*truncated"):
        read_tensors(str(folder), headers, pieces_for(model))
    with pytest.raises(ValueError, match=rf"{entry.file}.*truncated"):
        KimiK3ForCausalLM.from_pretrained(folder)


def test_the_full_release_config_builds_as_a_few_thousand_parameters():
    """What the loader materialises one by one: the stacks, not 176,640 per-expert tensors."""
    model = build_on_meta(KimiK3ForCausalLM, KimiK3Config.from_pretrained(ROOT), torch.bfloat16)
    shapes = release_shapes(model)
    assert len(shapes) == 179_100
    assert len(list(model.parameters())) < 3_100
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == sum(
        torch.Size(s).numel() * (1 if k.endswith((".weight_packed", ".weight_scale")) else
                                 4 if k.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else 2)
        for k, s in shapes.items())


def test_unexpected_keyword_is_an_error(parent_layout):
    with pytest.raises(TypeError, match="not_a_keyword"):
        KimiK3ForCausalLM.from_pretrained(parent_layout, not_a_keyword=1)


def test_tiny_config_keeps_its_float_experts_unstacked(tmp_path):
    folder = write_checkpoint(str(tmp_path / "float"), packed=False, seed=1)
    want = shard_tensors(folder)
    model = KimiK3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(model.language_model.model.layers[1].block_sparse_moe.experts, torch.nn.ModuleList)
    got = model.state_dict()
    for name, tensor in want.items():
        assert_same_bytes(got[name], tensor, name)
    assert tiny_config(packed=False).experts_packed is False


def test_a_tensor_after_an_odd_byte_count_is_read_through_an_aligned_copy(tmp_path):
    """safetensors' own writer orders tensors by dtype size, so each starts aligned; another writer's file may put a
    bf16 tensor at an odd offset, which the staging path cannot view in place."""
    import json

    odd, floats = torch.arange(7, dtype=torch.uint8), torch.randn(3, 5).to(torch.bfloat16)
    header = {"a": {"dtype": "U8", "shape": [7], "data_offsets": [0, 7]},
              "b": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [7, 37]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (tmp_path / "odd.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + odd.numpy().tobytes()
                                               + floats.view(torch.uint8).numpy().tobytes())
    headers = read_safetensors_headers(tmp_path)
    assert headers["b"].start % 2 == 1
    got_a, got_b = torch.empty(7, dtype=torch.uint8), torch.empty(3, 5, dtype=torch.float32)
    read_tensors(str(tmp_path), headers, [loading.Piece("a", None, None, got_a), loading.Piece("b", None, None, got_b)])
    assert torch.equal(got_a, odd) and torch.equal(got_b, floats.float())
