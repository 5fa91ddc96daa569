"""Verify a (pruned) checkpoint directory, structurally and, given the source, byte for byte.

    python -m reap_tools verify DIR [--source SRC_DIR] [--selection reap_selection.json] [--workers 8]

Structure: every shard's header parses, its tensors tile the data section exactly (no gap, no
overlap, byte counts = dtype x shape) and the file size is 8 + header_len + data end; the index's
total_size is the sum of tensor bytes, every weight_map file exists and holds the tensors the map
says, and no shard tensor is missing from the map. Config: the model's own checks (KimiK3Config)
accept config.json; every layer 0..num_hidden_layers-1 has tensors; dense layers have no
block_sparse_moe; each MoE layer has gate.weight [E, H], gate.e_score_correction_bias [E] and
exactly experts 0..E-1 with w1/w3 [I, L] and w2 [L, I] as (weight_packed U8 [out, in/2],
weight_scale U8 [out, in/group]) under MXFP4, else (weight [out, in]), E per layer from
num_experts / num_experts_per_layer.

Files: everything AutoTokenizer and AutoModelForCausalLM (trust_remote_code) need is there and usable
(`release_files.load_problems`): config.json's auto_map and the modules it names with their relative imports,
tokenizer_config.json's auto_map and its modules, tiktoken.model and generation_config.json.

Source (optional): with the selection (the embedded reap_selection.json unless given), the
sha256 of every kept expert tensor equals the source expert's, gate rows / bias equal the sliced
source, and every other tensor equals the source tensor of the same name.

Exit status 0 when everything holds, 1 otherwise; one summary line on stdout, errors (naming the
tensor and file) on stderr. `verify_checkpoint` returns the same as a VerifyResult.
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .checkpoint import (
    CONFIG_NAME, INDEX_NAME, SELECTION_NAME, SINGLE_NAME, CheckpointError, ShardHeader, TensorInfo,
    experts_per_layer, human, load_tensors, quantization_config, read_config, read_header,
    read_index, scan_moe, sha256_ranges, text_config,
)
from kimi_k3_loading import FLOAT_DTYPES, check_structure as check_against_config, read_safetensors_headers

from .cli import ArgumentParser, describe, int_at_least
from .model_config import model_text_config
from .prune import SelectionError, load_selection, validate_selection
from .release_files import load_problems

PRINT_ERRORS = 50
MAX_MISSING_EXPERTS = 8  # missing experts of a layer named one by one past the last one present


@dataclass
class VerifyResult:
    """Outcome of verify_checkpoint: ok when errors is empty; stats for the summary line."""

    path: Path
    errors: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        s = self.stats
        parts = [f"{s.get('shards', 0)} shards, {s.get('tensors', 0)} tensors, {human(s.get('bytes', 0))}"]
        if "moe_layers" in s:
            parts.append(f"{s['moe_layers']} MoE layers x {s['experts']} experts ({s['format']})")
        if "hashed" in s:
            parts.append(f"{s['hashed']} tensors sha256-equal to source")
        if self.ok:
            return f"OK {self.path}: " + "; ".join(parts)
        more = f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        return f"FAILED {self.path}: {len(self.errors)} errors; first: {self.errors[0]}{more}"


def _check_shard(h: ShardHeader, errors: list[str]) -> None:
    """Tensors tile [data_start, file end) exactly and byte counts match dtype x shape."""
    pos = h.data_start
    for t in sorted(h.tensors.values(), key=lambda t: (t.start, t.end)):
        want = t.expected_nbytes()
        if want is None:
            errors.append(f"{h.path.name}: tensor {t.name}: unknown dtype {t.dtype}")
        elif want != t.nbytes:
            errors.append(f"{h.path.name}: tensor {t.name}: {t.nbytes} bytes, {t.dtype} {list(t.shape)} needs {want}")
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else f"leaves a gap of {t.start - pos} bytes"
            errors.append(f"{h.path.name}: tensor {t.name} {what}")
        pos = max(pos, t.end)
    size = h.path.stat().st_size
    if size != h.data_end:
        errors.append(f"{h.path.name}: file is {size} bytes, header says 8 + {h.header_len} + data = {h.data_end}")


def check_structure(path: Path, errors: list[str], stats: dict) -> dict[str, TensorInfo]:
    """Shard headers, sizes and the index; returns the tensors found (name -> where)."""
    index = None
    try:
        index = read_index(path)
    except CheckpointError as e:
        errors.append(str(e))
        return {}
    if index is None:
        if not (path / SINGLE_NAME).exists():
            errors.append(f"{path}: no {INDEX_NAME} and no {SINGLE_NAME}")
            return {}
        files = [SINGLE_NAME]
    else:
        files = sorted(set(index["weight_map"].values()))
        for extra in sorted({p.name for p in path.glob("*.safetensors")} - set(files)):
            errors.append(f"{extra}: shard file not referenced by {INDEX_NAME}")
    found: dict[str, TensorInfo] = {}
    for name in files:
        if not (path / name).is_file():
            errors.append(f"{name}: listed in {INDEX_NAME} but missing")
            continue
        try:
            h = read_header(path / name)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        _check_shard(h, errors)
        for t in h.tensors.values():
            if t.name in found:
                errors.append(f"tensor {t.name}: in both {found[t.name].file.name} and {name}")
            found[t.name] = t
    stats.update(shards=len(files), tensors=len(found), bytes=sum(t.nbytes for t in found.values()))
    if index is not None:
        total = (index.get("metadata") or {}).get("total_size")
        if total != stats["bytes"]:
            errors.append(f"{INDEX_NAME}: total_size is {total}, tensors hold {stats['bytes']} bytes")
        for name, file in index["weight_map"].items():
            t = found.get(name)
            if t is None:
                if (path / file).is_file():
                    errors.append(f"tensor {name}: weight_map says {file}, not in any shard")
            elif t.file.name != file:
                errors.append(f"tensor {name}: weight_map says {file}, it is in {t.file.name}")
        for name in sorted(set(found) - set(index["weight_map"])):
            errors.append(f"tensor {name}: in {found[name].file.name} but missing from weight_map")
    return found


def expected_expert_tensors(config: dict) -> dict[str, tuple[set[str], tuple[int, ...]]]:
    """suffix -> (allowed dtypes, shape) of one routed expert, from text_config and quantization_config."""
    tc = text_config(config)
    inter = int(tc["moe_intermediate_size"])
    latent = int(tc.get("routed_expert_hidden_size") or tc["hidden_size"])
    shapes = {"w1": (inter, latent), "w3": (inter, latent), "w2": (latent, inter)}
    q = quantization_config(config)
    if not (q and "mxfp4" in str(q.get("format", ""))):
        return {f"{w}.weight": (FLOAT_DTYPES, s) for w, s in shapes.items()}
    group = 32
    for g in (q.get("config_groups") or {}).values():
        group = int((g.get("weights") or {}).get("group_size") or group)
    out = {}
    for w, (rows, cols) in shapes.items():
        out[f"{w}.weight_packed"] = ({"U8"}, (rows, cols // 2))
        out[f"{w}.weight_scale"] = ({"U8"}, (rows, cols // group))
    return out


def check_config(path: Path, tensors: dict[str, TensorInfo], errors: list[str], stats: dict) -> dict | None:
    """Layer coverage and block_sparse_moe names/shapes as the config implies; returns the config."""
    try:
        config = read_config(path)
        tc = text_config(config)
        n_layers, hidden = int(tc["num_hidden_layers"]), int(tc["hidden_size"])
        counts = experts_per_layer(tc)
        per_expert = expected_expert_tensors(config)
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        errors.append(f"{CONFIG_NAME}: {e!r}")
        return None
    try:
        model_text_config(config)
    except CheckpointError as e:
        errors.append(str(e))
    if tc.get("num_experts_per_layer") is not None and counts and int(tc["num_experts"]) != max(counts.values()):
        errors.append(f"{CONFIG_NAME}: num_experts is {tc['num_experts']}, the largest of num_experts_per_layer "
                      f"is {max(counts.values())}")
    try:
        moe = scan_moe(tensors)
    except CheckpointError as e:
        errors.append(str(e))
        return config
    prefixes = {layer.prefix.rsplit(".", 3)[0] + "." for layer in moe.values()} or {"model.layers."}
    for prefix in prefixes:
        present = {int(m[1]) for n in tensors if (m := re.match(re.escape(prefix) + r"(\d+)\.", n))}
        for i in sorted(set(range(n_layers)) - present):
            errors.append(f"layer {i}: no {prefix}{i}.* tensors")
        for i in sorted(i for i in present if i >= n_layers):
            errors.append(f"layer {i}: tensors present but num_hidden_layers is {n_layers}")
    for i in sorted(set(moe) - set(counts)):
        errors.append(f"{moe[i].prefix}*: layer {i} is not a MoE layer per the config")
    fmt = "MXFP4" if "w1.weight_packed" in per_expert else "dense"
    for i, n_experts in sorted(counts.items()):
        layer = moe.get(i)
        if layer is None:
            errors.append(f"layer {i}: MoE per the config, but has no block_sparse_moe tensors")
            continue
        router = (("gate.weight", layer.gate, (n_experts, hidden)), ("gate.e_score_correction_bias", layer.bias, (n_experts,)))
        for name, t, shape in router:
            if t is None:
                errors.append(f"tensor {layer.prefix}{name}: missing")
            elif t.shape != shape:
                errors.append(f"tensor {t.name}: shape {list(t.shape)}, config implies {list(shape)}")
        for e in sorted(set(layer.experts) - set(range(n_experts))):
            errors.append(f"tensor {layer.prefix}experts.{e}.*: expert id beyond num_experts {n_experts} ({CONFIG_NAME})")
        listed = min(n_experts, max(layer.experts, default=-1) + 1 + MAX_MISSING_EXPERTS)
        if listed < n_experts:  # a config claiming far more experts than the shards hold: one line, not millions
            errors.append(f"{layer.prefix}experts.{listed}..{n_experts - 1}: missing ({CONFIG_NAME} says "
                          f"{n_experts} experts)")
        for e in range(listed):
            have = layer.experts.get(e, {})
            for suffix, (dtypes, shape) in per_expert.items():
                t = have.get(suffix)
                if t is None:
                    errors.append(f"tensor {layer.prefix}experts.{e}.{suffix}: missing")
                elif t.shape != shape or t.dtype not in dtypes:
                    errors.append(f"tensor {t.name} ({t.file.name}): {t.dtype} {list(t.shape)}, config implies "
                                  f"{'/'.join(sorted(dtypes))} {list(shape)}")
            for suffix in sorted(set(have) - set(per_expert)):
                errors.append(f"tensor {have[suffix].name} ({have[suffix].file.name}): not implied by {CONFIG_NAME}")
    stats.update(moe_layers=len(counts), format=fmt)
    values = sorted(set(counts.values()))
    stats["experts"] = "-" if not values else str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"
    return config


def check_model_structure(path: Path, errors: list[str]) -> None:
    """The loader's own structural pass (`kimi_k3_loading.check_structure`: config sizes against the shard
    headers, its dtype rule, a sample of the MXFP4 scales for NaN), so that verify passes nothing the loader
    refuses. A config the model refuses is `check_config`'s to name."""
    try:
        text = model_text_config(read_config(path))
    except CheckpointError:
        return
    try:
        check_against_config(path, text, read_safetensors_headers(path))
    except (ValueError, OSError) as e:
        errors.append(str(e))


def check_loader_files(path: Path, errors: list[str]) -> None:
    """Each file the loaders need from `path` and could not use, named (see release_files.load_problems)."""
    errors.extend(f"{name}: {problem}" for name, problem in load_problems(path))


def check_against_source(path: Path, tensors: dict[str, TensorInfo], config: dict, source: Path,
                         selection: str | Path | dict | None, workers: int, progress: bool,
                         errors: list[str], stats: dict) -> None:
    """sha256 of each output tensor equals its source: kept experts, sliced router, the rest by name."""
    try:
        sel = load_selection(selection if selection is not None else path / SELECTION_NAME)
        src_config = read_config(source)
        src_tensors = load_tensors(source)
        src_moe = scan_moe(src_tensors)
        kept = validate_selection(sel, src_config, src_moe)
    except (CheckpointError, SelectionError) as e:
        errors.append(f"source {source}: {e}")
        return
    dst_counts = experts_per_layer(text_config(config))
    # (source tensor, its byte ranges that make up the output, output name, output shape)
    pairs: list[tuple[TensorInfo, list[tuple[Path, int, int]], str, tuple[int, ...]]] = []
    covered = set()
    for i, ids in kept.items():
        if dst_counts.get(i) != len(ids):
            errors.append(f"layer {i}: {CONFIG_NAME} says {dst_counts.get(i)} experts, the selection keeps {len(ids)}")
        layer = src_moe[i]
        for k, e in enumerate(ids):
            for suffix, s in layer.experts[e].items():
                pairs.append((s, [(s.file, s.start, s.end)], f"{layer.prefix}experts.{k}.{suffix}", s.shape))
        for s in (layer.gate, layer.bias):
            row = s.nbytes // s.shape[0]
            pairs.append((s, [(s.file, s.start + e * row, s.start + (e + 1) * row) for e in ids], s.name,
                          (len(ids), *s.shape[1:])))
            covered.add(s.name)
        covered.update(t.name for parts in layer.experts.values() for t in parts.values())
    pairs += [(s, [(s.file, s.start, s.end)], s.name, s.shape) for s in src_tensors.values() if s.name not in covered]
    for name in sorted(set(tensors) - {p[2] for p in pairs}):
        errors.append(f"tensor {name} ({tensors[name].file.name}): not produced from the source by the selection")
    jobs = []
    for s, ranges, name, shape in pairs:
        t = tensors.get(name)
        if t is None:
            errors.append(f"tensor {name}: missing (source {s.name} in {s.file.name})")
        elif t.dtype != s.dtype or t.shape != shape:
            errors.append(f"tensor {name} ({t.file.name}): {t.dtype} {list(t.shape)}, source implies "
                          f"{s.dtype} {list(shape)}")
        else:
            jobs.append((t, ranges, s))
    with tqdm(total=2 * sum(t.nbytes for t, _, _ in jobs), unit="B", unit_scale=True, desc="sha256",
              disable=not progress) as bar:
        def compare(job):
            """None when the tensor hashes equal to its source, else the error (a short or unreadable file included)."""
            t, ranges, s = job
            try:
                a, b = sha256_ranges([(t.file, t.start, t.end)]), sha256_ranges(ranges)
            except (CheckpointError, OSError) as e:
                return f"tensor {t.name}: cannot compare with source {s.name}: {describe(e)}"
            finally:
                bar.update(2 * t.nbytes)
            return None if a == b else f"tensor {t.name} ({t.file.name}): sha256 differs from source {s.name} ({s.file.name})"
        with ThreadPoolExecutor(max_workers=workers) as pool:
            mismatches = [m for m in pool.map(compare, jobs) if m]
    errors.extend(mismatches)
    stats["hashed"] = len(jobs) - len(mismatches)


def verify_checkpoint(path: str | Path, *, source: str | Path | None = None, selection: str | Path | dict | None = None,
                      workers: int | None = None, progress: bool = True) -> VerifyResult:
    """Run every check on checkpoint dir `path` (and against `source` when given); never raises on bad data."""
    result = VerifyResult(Path(path))
    if not result.path.is_dir():
        result.errors.append(f"{path}: not a directory")
        return result
    tensors = check_structure(result.path, result.errors, result.stats)
    if tensors and not result.errors:
        check_model_structure(result.path, result.errors)
    check_loader_files(result.path, result.errors)
    config = check_config(result.path, tensors, result.errors, result.stats) if tensors else None
    embedded = result.path / SELECTION_NAME
    if config is not None and source is None and (selection is not None or embedded.exists()):
        try:
            kept = load_selection(selection if selection is not None else embedded).get("layers") or {}
            counts = experts_per_layer(text_config(config))
            for key, ids in kept.items():
                if counts.get(int(key)) != len(ids):
                    result.errors.append(f"layer {key}: {CONFIG_NAME} says {counts.get(int(key))} experts, "
                                         f"the selection keeps {len(ids)}")
        except (CheckpointError, ValueError, TypeError) as e:
            result.errors.append(f"selection: {e}")
    if source is not None and config is not None:
        check_against_source(result.path, tensors, config, Path(source), selection,
                             min(8, os.cpu_count() or 1) if workers is None else workers, progress, result.errors,
                             result.stats)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m reap_tools verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="checkpoint dir to verify")
    ap.add_argument("--source", type=Path, help="source checkpoint the dir was pruned from (enables sha256 checks)")
    ap.add_argument("--selection", type=Path, help=f"selection to check against (default: the embedded {SELECTION_NAME})")
    ap.add_argument("--workers", type=int_at_least(1), help="hashing threads (default min(8, cpus))")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    r = verify_checkpoint(args.path, source=args.source, selection=args.selection, workers=args.workers,
                          progress=not args.no_progress)
    for e in r.errors[:PRINT_ERRORS]:
        print(f"error: {e}", file=sys.stderr)
    if len(r.errors) > PRINT_ERRORS:
        print(f"... {len(r.errors) - PRINT_ERRORS} more errors", file=sys.stderr)
    print(r.summary())
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
