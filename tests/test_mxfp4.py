"""mxfp4.py and `reap_tools quantize` against compressed-tensors, the format's reference.

(a) dequantize == the library's decompressor bit for bit; (b) quantize == the library's
compressor byte for byte; (c) the converter on a tiny sharded checkpoint; (d) bad input fails
naming the tensor/file and leaves nothing behind; (e) transformers' compressed-tensors loader
leaves every module alone under our quantization_config.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compressed_tensors.compressors import MXFP4PackedCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

import mxfp4
from reap_tools.quantize import main, quantize_checkpoint

SCHEME = QuantizationScheme.model_validate(
    mxfp4.mxfp4_quantization_config()["config_groups"]["group_0"]
)


def lib_quantize(weight):
    scale, _ = compute_dynamic_scales_and_zp(weight, SCHEME.weights, None)
    out = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, SCHEME)
    return out["weight_packed"], out["weight_scale"]


def lib_dequantize(packed, scale, dtype):
    if dtype == torch.bfloat16:  # the compressor itself; it always decompresses to bf16
        state = {"weight_packed": packed, "weight_scale": scale}
        return MXFP4PackedCompressor.decompress(state, SCHEME)["weight"]
    rows, cols = packed.shape
    values = unpack_fp4_from_uint8(packed, rows, cols * 2, dtype=dtype)
    return dequantize(values, decompress_mx_scale(scale).to(dtype), args=SCHEME.weights, dtype=dtype)


def same_bits(a, b):
    """Bitwise equality (tells -0 from +0, compares nan payloads)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


# (a) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_matches_library_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    packed[:2] = torch.arange(256, dtype=torch.uint8).reshape(2, 128)  # every byte, so every nibble
    scale = torch.randint(0, 256, (64, 8), dtype=torch.uint8, generator=g)
    scale[:2] = torch.tensor([0, 1, 2, 126, 127, 128, 254, 255], dtype=torch.uint8)
    ours = mxfp4.dequantize_mxfp4(packed, scale, dtype)
    assert ours.shape == (64, 256) and ours.dtype == dtype
    assert same_bits(ours, lib_dequantize(packed, scale, dtype))


def test_dequantize_layout():
    packed = torch.tensor([[0x21] * 16, [0xF8] * 16], dtype=torch.uint8)
    scale = torch.tensor([[128], [126]], dtype=torch.uint8)
    w = mxfp4.dequantize_mxfp4(packed, scale, torch.float32)
    assert w[0, :2].tolist() == [1.0, 2.0]  # low nibble (1 -> 0.5) first, times 2**1
    assert w[1, :2].tolist() == [-0.0, -3.0]  # code 8 is -0, code 15 is -6; times 2**-1
    assert torch.signbit(w[1, 0])


# (b) ------------------------------------------------------------------------------------------


def _edge_weights(dtype):
    """Rows of 32-wide groups that hit every rounding rule of the quantizer."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    just = [0.2499, 0.2501, 0.7499, 0.7501, 1.2499, 1.2501, 1.7499, 1.7501, 2.499, 2.501,
            3.499, 3.501, 4.999, 5.001, 5.999, 6.5]
    groups = [
        ties * 4,
        [-t for t in ties] * 4,
        just + [-x for x in just],
        [0.0] * 32,
        [-0.0] * 32,
        [-0.0] * 31 + [1.0],
        [-1e-3] * 31 + [6.0],  # negatives that round to zero keep their sign
        [7.0] + [3.5] * 31,  # amax mantissa exactly 1.75: the scale steps up
        [6.999] + [1.0] * 31,  # just below 1.75: values above 6 clip
        [2.0**127 * 1.7] + [1.0] * 31,  # largest group allowed
        [2.0**-126] * 16 + [1e-45] * 16,  # fp32 subnormals, scale code 0
        [1.0] + [1e-40] * 31,  # elements that underflow when divided by the scale
        [2.5e38] + [-1e-30] * 31,
        [4096.0] + [-(2.0**-130)] * 31,  # x / scale underflows bf16 but not fp32: sign lost
    ]
    w = torch.tensor(groups, dtype=torch.float32).reshape(1, -1)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_library_bytes(dtype):
    g = torch.Generator().manual_seed(1)
    weights = [_edge_weights(dtype), torch.zeros(4, 64, dtype=dtype)]
    for mag in (1e-38, 1e-20, 1e-3, 1.0, 1e3, 1e20, 1e37):
        weights.append((torch.randn(16, 128, generator=g) * mag).to(dtype))
    exps = torch.randint(-140, 120, (32, 8, 1), generator=g).float()  # a magnitude per group
    weights.append((torch.randn(32, 8, 32, generator=g) * torch.exp2(exps)).reshape(32, 256).to(dtype))
    # values exactly on E2M1 midpoints under random power-of-two scales
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(4)
    signs = torch.where(torch.rand(24, 32, generator=g) < 0.5, -1.0, 1.0)
    weights.append((mids * signs * torch.exp2(exps[:24, 0])).to(dtype))
    for w in weights:
        packed, scale = mxfp4.quantize_mxfp4(w)
        ref_packed, ref_scale = lib_quantize(w)
        assert packed.dtype == scale.dtype == torch.uint8
        assert torch.equal(scale, ref_scale), w
        assert torch.equal(packed, ref_packed), w


def test_quantize_values():
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    packed, scale = mxfp4.quantize_mxfp4(w)
    assert scale.tolist() == [[127]]
    assert mxfp4.dequantize_mxfp4(packed, scale, torch.float32)[0, :8].tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]  # ties to even


def test_roundtrip_is_exact_on_representable_values():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    packed[:, 0] = 0x77  # each group holds a 6, so its scale is recovered exactly
    packed[:, 16:] = packed[:, :48].clone()
    scale = torch.randint(20, 230, (8, 4), dtype=torch.uint8, generator=g)
    w = mxfp4.dequantize_mxfp4(packed, scale, torch.float32)
    p2, s2 = mxfp4.quantize_mxfp4(w)
    assert torch.equal(s2, scale)
    assert torch.equal(mxfp4.dequantize_mxfp4(p2, s2, torch.float32), w)


# (c) ------------------------------------------------------------------------------------------

H, L, INTER, EXPERTS = 64, 32, 96, 3
P = "language_model.model.layers"


def _tiny_checkpoint(root: Path, sharded=True) -> dict:
    g = torch.Generator().manual_seed(3)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    tensors = {
        "language_model.model.embed_tokens.weight": rnd(100, H),
        f"{P}.0.mlp.gate_proj.weight": rnd(INTER, H),
        f"{P}.0.mlp.down_proj.weight": rnd(H, INTER),
        f"{P}.0.self_attn.A_log": rnd(8, dtype=torch.float32),
        f"{P}.1.block_sparse_moe.gate.weight": rnd(EXPERTS, H),
        f"{P}.1.block_sparse_moe.gate.e_score_correction_bias": rnd(EXPERTS, dtype=torch.float32),
        f"{P}.1.block_sparse_moe.routed_expert_down_proj.weight": rnd(L, H),
        f"{P}.1.block_sparse_moe.routed_expert_up_proj.weight": rnd(H, L),
        f"{P}.1.block_sparse_moe.shared_experts.down_proj.weight": rnd(H, INTER),
        "language_model.lm_head.weight": rnd(100, H),
    }
    for e in range(EXPERTS):
        for w, shape in (("w1", (INTER, L)), ("w3", (INTER, L)), ("w2", (L, INTER))):
            tensors[f"{P}.1.block_sparse_moe.experts.{e}.{w}.weight"] = rnd(*shape)
    tensors[f"{P}.1.block_sparse_moe.experts.2.w2.weight"] = rnd(L, INTER, dtype=torch.float32)
    root.mkdir(parents=True)
    names = sorted(tensors)
    if sharded:
        parts = {"model-00001-of-00002.safetensors": names[::2],
                 "model-00002-of-00002.safetensors": names[1::2]}
        for shard, keys in parts.items():
            save_file({k: tensors[k] for k in keys}, str(root / shard), metadata={"format": "pt"})
        weight_map = {k: shard for shard, keys in parts.items() for k in keys}
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": {}}))
    (root / "generation_config.json").write_text('{"eos_token_id": 163586}')
    (root / "tokenizer_config.json").write_text("{}")
    (root / "modeling_kimi_k3.py").write_text("# remote code\n")
    return tensors


def _read_all(root: Path) -> dict:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("sharded", [True, False])
def test_converter(tmp_path, sharded):
    src, dst = tmp_path / "src", tmp_path / "out" / "dst"
    tensors = _tiny_checkpoint(src, sharded)
    summary = quantize_checkpoint(src, dst)
    assert summary["quantized"] == 3 * EXPERTS
    assert summary["copied"] == len(tensors) - 3 * EXPERTS
    got = _read_all(dst)
    for name, t in tensors.items():
        if ".experts." in name:
            base = name[: -len("weight")]
            ref = lib_quantize(t)
            assert torch.equal(got[base + "weight_packed"], ref[0]), name
            assert torch.equal(got[base + "weight_scale"], ref[1]), name
            assert name not in got
            ours = mxfp4.quantize_mxfp4(t)
            assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        else:
            assert got[name].dtype == t.dtype and same_bits(got[name], t), name
    assert len(got) == len(tensors) + 3 * EXPERTS
    files = sorted(p.name for p in dst.iterdir())
    if sharded:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(got)
        for name, shard in index["weight_map"].items():
            with safe_open(str(dst / shard), "pt") as f:
                assert name in f.keys()
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
        src_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        for name, shard in src_map.items():  # every tensor stays in its shard
            outs = [name[:-6] + "weight_packed", name[:-6] + "weight_scale"] if ".experts." in name else [name]
            assert {index["weight_map"][n] for n in outs} == {shard}, name
    else:
        assert "model.safetensors.index.json" not in files
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == mxfp4.mxfp4_quantization_config()
    assert config["text_config"] == {} and config["model_type"] == "kimi_k3"
    for name in ("generation_config.json", "tokenizer_config.json", "modeling_kimi_k3.py"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in dst.parent.iterdir()) == ["dst"]  # no temp dir left


def test_cli(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tiny_checkpoint(src, sharded=False)
    assert main([str(src), str(dst)]) == 0
    assert "9 expert weights quantized" in capsys.readouterr().out
    assert main([str(src), str(dst)]) == 1  # dst now exists
    assert "already exists" in capsys.readouterr().err


# (d) ------------------------------------------------------------------------------------------


def _rewrite(src: Path, name: str, value: torch.Tensor):
    """Replace one tensor of the sharded tiny checkpoint in place."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard))


EXPERT = f"{P}.1.block_sparse_moe.experts.1.w3.weight"


@pytest.mark.parametrize(
    "breakage, match",
    [
        (lambda src: (src / "config.json").unlink(), "missing config.json"),
        (lambda src: _rewrite(src, EXPERT, torch.zeros(INTER, 48, dtype=torch.bfloat16)),
         r"experts\.1\.w3\.weight has shape \[96, 48\]"),
        (lambda src: _rewrite(src, EXPERT, torch.full((INTER, L), float("nan"))),
         r"model-0000\d-of-00002.safetensors: .*experts\.1\.w3\.weight has non-finite"),
        (lambda src: _rewrite(src, EXPERT, torch.zeros(INTER, L, dtype=torch.float16)),
         r"experts\.1\.w3\.weight is F16"),
        (lambda src: (src / "model-00002-of-00002.safetensors").unlink(),
         "model-00002-of-00002.safetensors"),
        (lambda src: (src / "config.json").write_text('{"quantization_config": {"format": "x"}}'),
         "already has a quantization_config"),
    ],
)
def test_bad_input_names_the_problem_and_leaves_nothing(tmp_path, breakage, match):
    src, dst = tmp_path / "src", tmp_path / "out" / "dst"
    _tiny_checkpoint(src)
    breakage(src)
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(src, dst)
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_existing_dst_is_refused(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tiny_checkpoint(src)
    dst.mkdir()
    with pytest.raises(FileExistsError, match="dst"):
        quantize_checkpoint(src, dst)
    assert not any(dst.iterdir())


def test_reference_validation_errors():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_scale shape \(4, 2\).*\(4, 16\).*\(4, 1\)"):
        mxfp4.dequantize_mxfp4(packed, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed must be uint8, got torch.int8"):
        mxfp4.dequantize_mxfp4(packed.to(torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(4, 8\) means in_features=16"):
        mxfp4.dequantize_mxfp4(packed[:, :8], torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"shape \(4, 48\): in_features=48"):
        mxfp4.quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mxfp4.quantize_mxfp4(torch.zeros(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="overflow"):
        mxfp4.quantize_mxfp4(torch.full((1, 32), 3e38))


# (e) ------------------------------------------------------------------------------------------


def _loaded_toy(tmp_path, targets):
    """Save and reload a toy MoE block whose experts keep packed uint8 params, under our config
    with the given targets; returns (model, loading info, saved state dict)."""
    import torch.nn as nn
    from transformers import PretrainedConfig, PreTrainedModel

    class Packed(nn.Module):
        def __init__(self, out_f, in_f):
            super().__init__()
            self.weight_packed = nn.Parameter(torch.zeros(out_f, in_f // 2, dtype=torch.uint8), False)
            self.weight_scale = nn.Parameter(torch.zeros(out_f, in_f // 32, dtype=torch.uint8), False)

        def forward(self, x):
            return x @ mxfp4.dequantize_mxfp4(self.weight_packed, self.weight_scale, x.dtype).t()

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(H, EXPERTS, bias=False)
            self.routed_expert_down_proj = nn.Linear(H, L, bias=False)
            self.routed_expert_up_proj = nn.Linear(L, H, bias=False)
            self.experts = nn.ModuleList(nn.ModuleDict(
                {"w1": Packed(INTER, L), "w3": Packed(INTER, L), "w2": Packed(L, INTER)})
                for _ in range(EXPERTS))

        def forward(self, x):
            z = self.routed_expert_down_proj(x)
            y = sum(e["w2"](e["w1"](z) * e["w3"](z)) for e in self.experts)
            return self.routed_expert_up_proj(y) + self.gate(x).sum(-1, keepdim=True)

    class Toy(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.layers = nn.ModuleList([nn.ModuleDict({"block_sparse_moe": Moe()})])
            self.post_init()

        def _init_weights(self, module):
            pass

        def forward(self, x):
            return self.layers[0]["block_sparse_moe"](x)

    g = torch.Generator().manual_seed(4)
    state = {k: (torch.randint(120, 130, v.shape, dtype=torch.uint8, generator=g)
                 if v.dtype == torch.uint8 else torch.randn(v.shape, generator=g).to(torch.bfloat16))
             for k, v in Toy(PretrainedConfig()).state_dict().items()}
    qc = mxfp4.mxfp4_quantization_config()
    qc["config_groups"]["group_0"]["targets"] = targets
    path = tmp_path / "toy"
    PretrainedConfig(quantization_config=qc).save_pretrained(path)
    save_file(state, str(path / "model.safetensors"))
    model, info = Toy.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    return model, info, state


def test_transformers_loader_leaves_modules_alone(tmp_path):
    model, info, state = _loaded_toy(tmp_path, [mxfp4.EXPERT_TARGET])
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not [n for n, m in model.named_modules() if hasattr(m, "quantization_scheme")]
    model(torch.randn(2, H, dtype=torch.bfloat16))  # fires (and removes) the decompress hook
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_public_linear_target_would_break_bf16_linears(tmp_path):
    """Why EXPERT_TARGET: with the release's ["Linear"], every nn.Linear not in `ignore` is
    turned into a packed module, so the router and latent projections load as random."""
    _, info, _ = _loaded_toy(tmp_path, ["Linear"])
    assert "layers.0.block_sparse_moe.routed_expert_down_proj.weight" in info["unexpected_keys"]
    assert "layers.0.block_sparse_moe.gate.weight_packed" in info["missing_keys"]
