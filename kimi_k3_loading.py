"""Loading checks for Kimi K3 checkpoints: every tensor name, shape and dtype is compared with the model before
transformers reads a byte, so a missing, unexpected, mis-shaped or wrongly typed tensor, a truncated shard or a corrupt
header is an error naming the tensor and the file, never a silent random init or cast."""

import json
import os
import re

import torch
from safetensors import safe_open
from transformers.utils import logging

logger = logging.get_logger("transformers.kimi_k3")

# The release's MoonViT vision tower: a text-only load skips it on purpose (`check_checkpoint` says so once); any
# other unexpected tensor stays an error.
VISION_KEYS = (r"^vision_tower\.", r"^mm_projector\.")


def checkpoint_directory(path, kwargs):
    """The local folder of checkpoint `path`: the folder itself, or the snapshot of the hub repository `path` (its
    config and safetensors files, fetched or found in the cache as `from_pretrained` would, under the hub options
    among its `kwargs`), so that a hub load is checked as strictly as a local one."""
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
                                      "token") if kwargs.get(k) is not None}
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **hub)
    return os.path.join(path, kwargs.get("subfolder") or "")


def check_checkpoint(model_class, directory, config):
    """Compare a local checkpoint's tensor names, shapes and dtypes with what `model_class(config)` holds, before
    loading; returns the headers read (`read_safetensors_headers`).

    The model's state_dict on the meta device gives the expected tensors: a uint8 one (MXFP4 bytes and scales)
    must be stored as U8, an integer one as its own dtype, a float one as BF16, F16 or F32 (any dtype the model
    may be loaded in). A scale stored as BF16 or a router weight as I64 would otherwise be cast silently.
    """
    found = read_safetensors_headers(directory)
    with torch.device("meta"):
        expected = {k: (tuple(v.shape), v.dtype) for k, v in model_class(config).state_dict().items()}
    mismatched = [f"{k} (checkpoint {list(found[k][2])}, model {list(s)})"
                  for k, (s, _) in expected.items() if k in found and found[k][2] != s]
    wrong_dtype = []
    for k, (_, dtype) in expected.items():
        accepted = _SAFETENSORS_FLOATS if dtype.is_floating_point else (_SAFETENSORS_DTYPES.get(dtype, str(dtype)),)
        if k in found and found[k][1] not in accepted:
            wrong_dtype.append(f"{k} in {found[k][0]} ({found[k][1]}, model expects {' or '.join(accepted)})")
    unexpected = sorted(set(found) - set(expected))
    raise_on_key_problems(directory, sorted(set(expected) - set(found)), unexpected, mismatched, wrong_dtype,
                          ignored=model_class._keys_to_ignore_on_load_unexpected)
    vision = [k for k in unexpected if any(re.search(p, k) for p in VISION_KEYS)]
    if vision:
        logger.warning(f"{directory}: skipping {len(vision)} vision-tower tensors (names matching "
                       f"{', '.join(VISION_KEYS)}): this model is text-only")
    return found


def raise_on_key_problems(source, missing, unexpected, mismatched, wrong_dtype=(), ignored=()):
    """One error naming the tensors at fault in `source`, unexpected ones matching a pattern of `ignored` aside."""
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored or ())]
    problems = {"missing": sorted(missing), "unexpected": sorted(unexpected), "mismatched": sorted(mismatched),
                "wrong dtype": sorted(wrong_dtype)}
    if any(problems.values()):
        detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else "")
                           for kind, keys in problems.items() if keys)
        raise ValueError(f"{source}: checkpoint does not match the model ({detail})")


# safetensors dtype names: those a float parameter may be stored as, and the one an integer tensor must have.
_SAFETENSORS_FLOATS = ("BF16", "F16", "F32")
_SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
                       torch.int64: "I64", torch.bool: "BOOL"}


def read_safetensors_headers(directory):
    """Tensor name -> (file name, safetensors dtype, shape) over a checkpoint's safetensors files, failing early
    (naming the file) on a malformed index, a missing shard, a truncated file or a corrupt header, and on a tensor
    stored somewhere other than the index says."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{index_path}: not a JSON object ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: no \"weight_map\" object of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    found = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: listed in model.safetensors.index.json but missing")
        try:  # safetensors checks the header and that the file holds every byte it promises
            with safe_open(path, "pt") as f:
                slices = {key: f.get_slice(key) for key in f.keys()}
                entries = {key: (t.get_dtype(), tuple(t.get_shape())) for key, t in slices.items()}
        except Exception as err:  # safetensors' own error types differ between releases
            raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({err})") from None
        for key, (dtype, shape) in entries.items():
            if weight_map is not None and weight_map.get(key) != name:
                raise ValueError(f"{path}: holds {key}, which model.safetensors.index.json places in "
                                 f"{weight_map.get(key)}")
            found[key] = (name, dtype, shape)
    return found
