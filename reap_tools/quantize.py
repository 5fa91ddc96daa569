"""`python -m reap_tools quantize SRC DST`: a bf16/fp32 release checkpoint -> the MXFP4 checkpoint.

Every routed expert weight `...block_sparse_moe.experts.{e}.w{1,2,3}.weight` becomes
`.weight_packed` + `.weight_scale`, computed by compressed-tensors' own MXFP4 compressor (the
format's reference, so serving engines read exactly what they expect); every other tensor is
copied byte for byte. config.json gains the top-level `quantization_config`; other files are
copied. Shards are written one tensor at a time straight into the safetensors layout, so memory
stays at about one expert weight, and into a temporary directory next to DST that is renamed
to DST only when everything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

import mxfp4

from .checkpoint import copy_range, encode_header, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
EXPERT_WEIGHT = re.compile(r"(^|\.)block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
_QUANTIZABLE = {"BF16", "F32"}


def _scheme():
    """The compressed-tensors scheme of the config we write, so packs and config cannot disagree."""
    from compressed_tensors.quantization import QuantizationScheme

    group = mxfp4.mxfp4_quantization_config()["config_groups"]["group_0"]
    return QuantizationScheme.model_validate(group)


def _library_compress(weight: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 bytes from compressed-tensors: its group qparams, then its compressor."""
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scale, _ = compute_dynamic_scales_and_zp(weight, scheme.weights, None)
    out = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"]


def _source_shards(src: Path) -> tuple[list[str], dict | None]:
    """Shard file names in SRC and its index (None for a single model.safetensors)."""
    index_path = src / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a valid index ({e!r})") from None
        shards = list(dict.fromkeys(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard or not (src / shard).is_file():
                raise ValueError(f"{index_path}: shard {shard!r} is not a file in {src}")
        return shards, index
    if (src / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    raise ValueError(f"{src}: no {INDEX_NAME} and no {SINGLE_NAME}")


def _plan_shard(path: Path, index: dict | None) -> tuple[int, list, list[tuple], dict | None]:
    """Check one source shard and lay out its output.

    Returns (data start, source (name, info) in file order, output (name, dtype, shape, nbytes)
    in the same order, the shard's __metadata__).
    """
    shard = read_header(path)
    entries = sorted(shard.tensors.values(), key=lambda t: t.start)
    if index is not None:
        listed = {k for k, v in index["weight_map"].items() if v == path.name}
        if listed != set(shard.tensors):
            extra = sorted(set(shard.tensors) - listed)[:3]
            missing = sorted(listed - set(shard.tensors))[:3]
            raise ValueError(
                f"{path}: tensors disagree with {INDEX_NAME} (in shard only: {extra}, "
                f"in index only: {missing})"
            )
    out: list[tuple] = []
    for info in entries:
        name, dtype, shape = info.name, info.dtype, list(info.shape)
        if name.endswith((".weight_packed", ".weight_scale")):
            raise ValueError(f"{path}: tensor {name} is already quantized; SRC must be bf16/fp32")
        if not EXPERT_WEIGHT.search(name):
            out.append((name, dtype, shape, info.nbytes))
            continue
        if dtype not in _QUANTIZABLE:
            raise ValueError(f"{path}: expert tensor {name} is {dtype}; expected BF16 or F32")
        if len(shape) != 2 or shape[1] % mxfp4.GROUP_SIZE:
            raise ValueError(
                f"{path}: expert tensor {name} has shape {shape}; need 2-D [out, in] with in "
                f"a multiple of {mxfp4.GROUP_SIZE}"
            )
        rows, cols = shape
        base = name[: -len("weight")]
        out.append((base + "weight_packed", "U8", [rows, cols // 2], rows * cols // 2))
        out.append((base + "weight_scale", "U8", [rows, cols // 32], rows * cols // 32))
    return entries, out, shard.metadata or None


def _write_shard(src_path: Path, dst_path: Path, index: dict | None, scheme) -> tuple[dict, int, int]:
    """Write one output shard; return (name -> nbytes, experts quantized, tensors copied)."""
    entries, out, metadata = _plan_shard(src_path, index)
    sizes = {name: nbytes for name, _, _, nbytes in out}
    quantized = copied = 0
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst, safe_open(
        str(src_path), "pt"
    ) as tensors:
        dst.write(encode_header(out, metadata))
        for info in entries:
            name = info.name
            if not EXPERT_WEIGHT.search(name):
                dst.flush()
                copy_range(src.fileno(), dst.fileno(), info.start, info.nbytes)
                copied += 1
                continue
            weight = tensors.get_tensor(name)
            mxfp4.check_weight(weight, f"{src_path.name}: {name}")
            for t, suffix in zip(_library_compress(weight, scheme), ("weight_packed", "weight_scale")):
                key = name[: -len("weight")] + suffix
                if t.dtype != torch.uint8 or t.numel() != sizes[key]:
                    raise RuntimeError(f"compressed-tensors gave {key} as {t.dtype} {tuple(t.shape)}")
                dst.write(t.contiguous().numpy().tobytes())
            quantized += 1
        dst.flush()
        os.fsync(dst.fileno())
    return sizes, quantized, copied


def _has_quantization_config(config: dict) -> bool:
    """Whether config.json already declares a quantization (top level or inside text_config)."""
    text = config.get("text_config")
    return bool(config.get("quantization_config")) or (
        isinstance(text, dict) and bool(text.get("quantization_config"))
    )


def quantize_checkpoint(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> dict:
    """Convert the bf16/fp32 checkpoint in SRC_DIR to the MXFP4 checkpoint DST_DIR (must not exist).

    Returns counts: {"shards", "quantized", "copied"}. Raises ValueError naming the file or
    tensor for bad input, FileExistsError if DST_DIR exists; on any error nothing is left at
    DST_DIR and the temporary directory is removed.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not src.is_dir():
        raise ValueError(f"{src}: not a directory")
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; refusing to overwrite it")
    config_path = src / CONFIG_NAME
    if not config_path.is_file():
        raise ValueError(f"{src}: missing {CONFIG_NAME}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if _has_quantization_config(config):
        raise ValueError(f"{config_path}: already has a quantization_config; SRC must be bf16/fp32")
    shards, index = _source_shards(src)
    for shard in shards:
        _plan_shard(src / shard, index)  # every input problem surfaces before any work is done
    scheme = _scheme()

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        weight_map, total, quantized, copied = {}, 0, 0, 0
        for shard in shards:
            sizes, q, c = _write_shard(src / shard, tmp / shard, index, scheme)
            weight_map.update(dict.fromkeys(sizes, shard))
            total += sum(sizes.values())
            quantized, copied = quantized + q, copied + c
        if index is not None:
            metadata = {**index.get("metadata", {}), "total_size": total}
            new_index = {**index, "metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(new_index, indent=2) + "\n")
        config["quantization_config"] = mxfp4.mxfp4_quantization_config()
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        skip = set(shards) | {INDEX_NAME, CONFIG_NAME}
        for entry in src.iterdir():
            if entry.name in skip or entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        if dst.exists():
            raise FileExistsError(f"{dst} appeared while converting; refusing to overwrite it")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"shards": len(shards), "quantized": quantized, "copied": copied}


def main(argv: list[str] | None = None) -> int:
    """CLI: `quantize SRC DST`; exit 1 with a one-line error for bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m reap_tools quantize",
        description="Quantize the routed experts of a bf16/fp32 Kimi K3 checkpoint to MXFP4 "
        "(compressed-tensors mxfp4-pack-quantized); copy everything else unchanged.",
    )
    parser.add_argument("src", help="source checkpoint directory (bf16 or fp32 safetensors)")
    parser.add_argument("dst", help="output directory; must not exist")
    args = parser.parse_args(argv)
    try:
        summary = quantize_checkpoint(args.src, args.dst)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.dst}: {summary['quantized']} expert weights quantized, "
        f"{summary['copied']} tensors copied, {summary['shards']} shard(s)"
    )
    return 0
