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
# other unexpected tensor stays an error. Its dtypes are not this model's concern.
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


def check_checkpoint(model_class, directory, config, headers=None):
    """Compare a local checkpoint with `model_class(config)` before loading: first the cheap structural pass
    (`check_structure`, which needs no model), then every tensor name and shape against the model's state_dict on
    the meta device. Returns the headers read (`read_safetensors_headers`)."""
    found = read_safetensors_headers(directory) if headers is None else headers
    check_structure(directory, config, found)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()}
    mismatched = [f"{k} (checkpoint {list(found[k][2])}, model {list(s)})"
                  for k, s in expected.items() if k in found and found[k][2] != s]
    unexpected = sorted(set(found) - set(expected))
    raise_on_key_problems(directory, sorted(set(expected) - set(found)), unexpected, mismatched,
                          ignored=model_class._keys_to_ignore_on_load_unexpected)
    vision = [k for k in unexpected if _is_vision(k)]
    if vision:
        logger.warning(f"{directory}: skipping {len(vision)} vision-tower tensors (names matching "
                       f"{', '.join(VISION_KEYS)}): this model is text-only")
    return found


def raise_on_key_problems(source, missing, unexpected, mismatched, ignored=()):
    """One error naming the tensors at fault in `source`, unexpected ones matching a pattern of `ignored` aside."""
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored or ())]
    problems = {"missing": sorted(missing), "unexpected": sorted(unexpected), "mismatched": sorted(mismatched)}
    if any(problems.values()):
        detail = "; ".join(f"{kind}: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else "")
                           for kind, keys in problems.items() if keys)
        raise ValueError(f"{source}: checkpoint does not match the model ({detail})")


# The one dtype rule of the loader and `verify`: MXFP4 packs and their E8M0 scales are bytes (U8); every other
# tensor of this model is a float, stored as any dtype the model may be loaded in. A scale stored as BF16 or a router
# weight as I64 would otherwise be cast silently.
FLOAT_DTYPES = ("BF16", "F16", "F32")
PACKED_SUFFIXES = (".weight_packed", ".weight_scale")
# E8M0's NaN: no scale of a valid pack holds it, and one makes its whole group of 32 weights NaN.
E8M0_NAN = 0xFF
_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def accepted_dtypes(name):
    """The safetensors dtypes tensor `name` may be stored as."""
    return ("U8",) if name.endswith(PACKED_SUFFIXES) else FLOAT_DTYPES


def _is_vision(name):
    return any(re.search(p, name) for p in VISION_KEYS)


def check_structure(directory, config, headers):
    """The cheap structural pass of a checkpoint against its config, shared by the loader and `verify`, before
    anything large is allocated: the config's sizes against the shard headers (layers, experts a layer, hidden and
    latent widths, vocabulary), every tensor's dtype (`accepted_dtypes`), and a sample of the MXFP4 scales (each
    layer's first and last expert) for E8M0's NaN code. Its cost follows the headers, never the config's sizes, so a
    hostile config (10^7 experts) fails here in seconds. One error naming the fields, tensors and files at fault."""
    text = getattr(config, "text_config", config)
    problems = [f"wrong dtype: {k} in {file} ({dtype}, model expects {' or '.join(accepted_dtypes(k))})"
                for k, (file, dtype, _) in sorted(headers.items())
                if not _is_vision(k) and dtype not in accepted_dtypes(k)]
    problems += [f"config: {problem}" for problem in _size_problems(text, headers)]
    if not problems:
        problems += [f"NaN scale: {problem}" for problem in _nan_scales(directory, headers)]
    if problems:
        detail = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        raise ValueError(f"{directory}: checkpoint does not match the model ({detail})")


def _size_problems(text, headers):
    """The config's sizes that the shard headers contradict, each naming the config field and a tensor."""
    prefix = "language_model.model."

    def shape(name):
        return headers[name][2] if name in headers else None

    problems = []
    embed = shape(prefix + "embed_tokens.weight")
    if embed is not None and embed != (text.vocab_size, text.hidden_size):
        problems.append(f"vocab_size, hidden_size = {text.vocab_size}, {text.hidden_size}, but "
                        f"{prefix}embed_tokens.weight is {list(embed)}")
    layers = {int(m.group(1)) for k in headers if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != text.num_hidden_layers:
        problems.append(f"num_hidden_layers = {text.num_hidden_layers}, but the shards hold layers 0..{max(layers)}")
    experts = {}
    for k in headers:
        if m := _EXPERT.match(k):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    field = "num_experts_per_layer[{}]" if text.num_experts_per_layer is not None else "num_experts"
    for layer in sorted(layers):
        if layer >= text.num_hidden_layers:
            continue
        want, name = text.experts_in_layer(layer), f"{prefix}layers.{layer}.block_sparse_moe.gate.weight"
        router = shape(name)
        if router is not None and router != (want, text.hidden_size):  # the router sizes a layer's experts
            problems.append(f"{field.format(layer)}, hidden_size = {want}, {text.hidden_size} (layer {layer}), but "
                            f"{name} is {list(router)}")
        elif router is None and len(experts.get(layer, ())) != want:
            problems.append(f"{field.format(layer)} = {want} (layer {layer}), but the shards hold no router for it and "
                            f"{len(experts.get(layer, ()))} experts")
        packed = shape(f"{prefix}layers.{layer}.block_sparse_moe.experts.0.w1.weight_packed")
        if packed is not None and packed != (text.moe_intermediate_size, text.routed_expert_hidden_size // 2):
            problems.append(f"moe_intermediate_size, routed_expert_hidden_size = {text.moe_intermediate_size}, "
                            f"{text.routed_expert_hidden_size}, but layer {layer}'s experts.0.w1.weight_packed is "
                            f"{list(packed)}")
    return problems


def _nan_scales(directory, headers):
    """Scales holding E8M0's NaN code among each MoE layer's first and last expert."""
    sample = {}
    for k, (file, _, _) in headers.items():
        m = _EXPERT.match(k)
        if m and k.endswith(".weight_scale"):
            layer, expert = int(m.group(1)), int(m.group(2))
            sample.setdefault(layer, {}).setdefault(expert, []).append((file, k))
    reads = {}
    for by_expert in sample.values():
        for expert in {min(by_expert), max(by_expert)}:
            for file, k in by_expert[expert]:
                reads.setdefault(file, []).append(k)
    problems = []
    for file, keys in sorted(reads.items()):
        with safe_open(os.path.join(directory, file), "pt") as f:
            problems += [f"{k} in {file} holds E8M0 code 0xFF (NaN)" for k in sorted(keys)
                         if bool((f.get_tensor(k) == E8M0_NAN).any())]
    return problems


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


def check_loaded_scales(model, source):
    """After a load, every MXFP4 scale of the model against E8M0's NaN code (free: stacking the experts read each
    layer's largest code); one error naming the first tensor that holds it."""
    for name, module in model.named_modules():
        stack = getattr(module, "expert_stack", None)
        if stack is None or stack.max_scale_code != E8M0_NAN:
            continue
        for e, expert in enumerate(module.experts):
            for proj in ("w1", "w3", "w2"):
                if bool((getattr(expert, proj).weight_scale == E8M0_NAN).any()):
                    raise ValueError(f"{source}: {name}.experts.{e}.{proj}.weight_scale holds E8M0 code 0xFF (NaN)")
