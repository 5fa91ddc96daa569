"""Prune routed experts out of a checkpoint by a REAP selection, streaming raw bytes.

    python -m reap_tools prune SRC_DIR DST_DIR --selection reap_selection.json [--max-shard-size 5GB]

Kept experts keep ascending original order and are renumbered 0..N-1 per layer; their tensors
(MXFP4 `weight_packed`/`weight_scale`, or bf16 `weight`) are copied byte for byte, never decoded.
`gate.weight` rows and `gate.e_score_correction_bias` entries are sliced with the same ids, every
other tensor is copied unchanged. The output gets new shards + model.safetensors.index.json, a
config.json with `num_experts` (the max count) and, for non-uniform selections,
`num_experts_per_layer` (0 for dense layers), the source's other release files (tokenizer, README, licence: the
allow-list in release_files.py, read through links to files of their own name or to the hub cache's blobs;
dotfiles, folders, loops and links to files of other names are never copied, and what was left out is listed on
stderr), this package's remote code and the selection itself as reap_selection.json.

The output must load: a source without a file AutoTokenizer or AutoModelForCausalLM needs (tokenizer_config.json,
tiktoken.model, generation_config.json: `release_files.load_problems`) is refused before anything is written, and
the finished output is checked the same way before it is published. An output folder inside the source is refused.

Why raw byte ranges: bit-exactness by construction, kernel-side copies (copy_file_range) at disk
speed, and a peak memory of headers only — not one tensor, not one shard. The output is written to
a `.<dst>.partial-<pid>` sibling and renamed into place only when complete and fsynced.
The selection is validated against the checkpoint before anything is written.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .checkpoint import (
    CONFIG_NAME, INDEX_NAME, SELECTION_NAME, CheckpointError, MoeLayer, TensorInfo,
    atomic_output_dir, copy_range, encode_header, experts_per_layer, human, load_tensors,
    parse_size, read_config, read_json, scan_moe, shard_names, text_config, write_json,
)
from .cli import ArgumentParser, fail
from .model_config import model_text_config
from .release_files import LOAD_FILES, load_problems, release_files
from .remote_code import REMOTE_CODE, copy_remote_code

DEFAULT_MAX_SHARD = "5GB"
# Seconds to sleep after each tensor; only for tests that interrupt a prune mid-way.
DELAY_ENV = "REAP_PRUNE_TEST_DELAY_S"
# Files prune writes itself rather than copying from the source.
WRITTEN_NAMES = {INDEX_NAME, CONFIG_NAME, SELECTION_NAME}


class SelectionError(ValueError):
    """A selection does not fit the checkpoint it is applied to."""


@dataclass(slots=True)
class OutTensor:
    """One output tensor: its new name/shape and the source byte ranges that make it up."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[Path, int, int]]

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.pieces)


@dataclass
class PruneResult:
    dst: Path
    shards: list[str]
    num_tensors: int
    total_size: int
    experts_per_layer: dict[int, int]
    skipped: list[tuple[str, str]]  # (source file name, why it was not copied)


def load_selection(selection: str | Path | dict) -> dict:
    """A selection dict from a reap_selection.json path (or a copy of a dict)."""
    if isinstance(selection, dict):
        return copy.deepcopy(selection)
    return read_json(Path(selection))


def validate_selection(selection: dict, config: dict, moe: dict[int, MoeLayer]) -> dict[int, list[int]]:
    """Check a selection against a checkpoint's config and MoE tensors; return {layer: sorted ids}.

    Raises SelectionError naming the layer/expert for: another model's selection, a wrong layer
    set, ids out of range or repeated, fewer kept than top-k. Raises CheckpointError when the
    checkpoint's own tensors disagree with its config, or the model would refuse that config.
    """
    top_k = model_text_config(config).num_experts_per_token
    tc = text_config(config)
    counts = experts_per_layer(tc)
    layers = selection.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise SelectionError("selection has no 'layers' object")
    model = selection.get("model") or {}
    for key, have in (("num_hidden_layers", int(tc["num_hidden_layers"])), ("num_experts", int(tc["num_experts"]))):
        if key in model and int(model[key]) != have:
            raise SelectionError(f"selection is for a model with {key}={model[key]}, the checkpoint has {have}")
    if set(moe) != set(counts):
        raise CheckpointError(f"checkpoint has block_sparse_moe tensors for layers {sorted(moe)}, "
                              f"config says MoE layers are {sorted(counts)}")
    try:
        chosen = {int(k): v for k, v in layers.items()}
    except ValueError as e:
        raise SelectionError(f"selection layer keys must be layer numbers: {e}") from e
    if set(chosen) != set(counts):
        missing, extra = sorted(set(counts) - set(chosen)), sorted(set(chosen) - set(counts))
        raise SelectionError(f"selection covers {len(chosen)} layers, the checkpoint has {len(counts)} MoE layers"
                             f" (missing {missing}, not MoE {extra})")
    kept = {}
    for i in sorted(counts):
        n_experts, ids = counts[i], chosen[i]
        if not isinstance(ids, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
            raise SelectionError(f"layer {i}: kept ids must be a list of integers")
        if len(set(ids)) != len(ids):
            raise SelectionError(f"layer {i}: repeated expert ids {sorted({e for e in ids if ids.count(e) > 1})}")
        bad = [e for e in ids if not 0 <= e < n_experts]
        if bad:
            raise SelectionError(f"layer {i}: expert ids {bad} out of range 0..{n_experts - 1}")
        if len(ids) < top_k:
            raise SelectionError(f"layer {i}: keeps {len(ids)} experts, fewer than top-k = {top_k}")
        layer = moe[i]
        if set(layer.experts) != set(range(n_experts)):
            raise CheckpointError(f"layer {i}: checkpoint has experts {len(layer.experts)} ids, config says "
                                  f"{n_experts} (missing {sorted(set(range(n_experts)) - set(layer.experts))[:8]})")
        for name, t in (("gate.weight", layer.gate), ("gate.e_score_correction_bias", layer.bias)):
            if t is None:
                raise CheckpointError(f"{layer.prefix}{name}: missing from the checkpoint")
            if not t.shape or t.shape[0] != n_experts:
                raise CheckpointError(f"{t.name}: shape {list(t.shape)} does not start with {n_experts} experts")
        kept[i] = sorted(ids)
    return kept


def _rows(t: TensorInfo, ids: list[int]) -> list[tuple[Path, int, int]]:
    """Byte ranges of rows `ids` of a row-major tensor, consecutive rows merged into one range."""
    n = t.shape[0]
    if t.nbytes % n:
        raise CheckpointError(f"{t.name}: {t.nbytes} bytes do not split into {n} rows")
    row = t.nbytes // n
    pieces: list[tuple[Path, int, int]] = []
    for e in ids:
        start = t.start + e * row
        if pieces and pieces[-1][2] == start:
            pieces[-1] = (t.file, pieces[-1][1], start + row)
        else:
            pieces.append((t.file, start, start + row))
    return pieces


def plan_output(tensors: dict[str, TensorInfo], moe: dict[int, MoeLayer], kept: dict[int, list[int]]) -> list[OutTensor]:
    """Output tensors in source file/offset order: kept experts renamed, router sliced, rest as is."""
    special: dict[str, OutTensor | None] = {}
    for i, layer in moe.items():
        for e, parts in layer.experts.items():
            for t in parts.values():
                special[t.name] = None
        for k, e in enumerate(kept[i]):
            for suffix, t in layer.experts[e].items():
                special[t.name] = OutTensor(f"{layer.prefix}experts.{k}.{suffix}", t.dtype, t.shape,
                                            [(t.file, t.start, t.end)])
        for t in (layer.gate, layer.bias):
            special[t.name] = OutTensor(t.name, t.dtype, (len(kept[i]), *t.shape[1:]), _rows(t, kept[i]))
    out = []
    for t in tensors.values():
        if t.name in special:
            if special[t.name] is not None:
                out.append(special[t.name])
        else:
            out.append(OutTensor(t.name, t.dtype, t.shape, [(t.file, t.start, t.end)]))
    return out


def split_shards(tensors: list[OutTensor], max_shard_size: int) -> list[list[OutTensor]]:
    """Greedy split in order: a new shard starts when the next tensor would pass max_shard_size."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def pruned_config(config: dict, kept: dict[int, list[int]]) -> dict:
    """config.json for the pruned checkpoint: num_experts = max kept, per-layer counts if non-uniform."""
    config = copy.deepcopy(config)
    tc = text_config(config)
    counts = {i: len(ids) for i, ids in kept.items()}
    tc["num_experts"] = max(counts.values())
    if len(set(counts.values())) > 1:
        tc["num_experts_per_layer"] = [counts.get(i, 0) for i in range(int(tc["num_hidden_layers"]))]
    else:
        tc.pop("num_experts_per_layer", None)
    return config


def _write_shard(path: Path, tensors: list[OutTensor], src_fds: dict[Path, int], bar: tqdm, delay: float) -> None:
    header = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, header)
        for t in tensors:
            for file, start, end in t.pieces:
                copy_range(src_fds[file], fd, start, end - start)
            bar.update(t.nbytes)
            if delay:
                time.sleep(delay)
        expected = len(header) + sum(t.nbytes for t in tensors)
        if os.fstat(fd).st_size != expected:
            raise CheckpointError(f"{path.name}: wrote {os.fstat(fd).st_size} bytes, expected {expected}")
    finally:
        os.close(fd)


def _copy_other_files(src: Path, dst: Path, files: tuple[list[Path], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Copy the source's release files (release_files) that prune does not write itself; return what was left out.

    Shards, index, config and selection are written fresh; a .safetensors file the index does not name is left out.
    The remote-code files are this package's own (`remote_code.copy_remote_code`): the pruned checkpoint runs the
    code that wrote it, whatever the source carried (a copy, a link into this repository, an older version).
    `files` is release_files(src).
    """
    taken, skipped = files[0], list(files[1])
    shard_files = set(shard_names(src))
    for p in taken:
        if p.name in shard_files or p.name in WRITTEN_NAMES or p.name in REMOTE_CODE:
            continue
        if p.suffix == ".safetensors":
            skipped.append((p.name, "not in the source index"))
        else:
            shutil.copy2(p, dst / p.name)
    copy_remote_code(dst)
    return [(name, why) for name, why in skipped if name not in REMOTE_CODE]


def _not_loadable(problems: list[tuple[str, str]], skipped: list[tuple[str, str]]) -> CheckpointError:
    """One error naming each file the output would lack, and why the source's copy was not taken."""
    reasons = dict(skipped)
    parts = [f"{name}: {f'not copied from the source ({reasons[name]})' if name in reasons else problem}"
             for name, problem in problems]
    return CheckpointError("the output would not load: " + "; ".join(parts))


def _check_output_outside(src: Path, dst: Path) -> None:
    """Refuse an output inside the source (links resolved): the next prune of that source would copy it along."""
    real_src, real_dst = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    if real_dst.is_relative_to(real_src):
        raise ValueError(f"output {dst} is inside the source {src}; choose an output folder outside it")


def prune_checkpoint(src_dir: str | Path, selection: str | Path | dict, dst_dir: str | Path, *,
                     max_shard_size: int | str = DEFAULT_MAX_SHARD, progress: bool = True) -> PruneResult:
    """Write the pruned copy of src_dir to dst_dir (which must not exist) and return what was written."""
    src, dst = Path(src_dir), Path(dst_dir)
    _check_output_outside(src, dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new output dir or remove it")
    selection = load_selection(selection)
    config = read_config(src)
    tensors = load_tensors(src)
    moe = scan_moe(tensors)
    kept = validate_selection(selection, config, moe)
    files = release_files(src)
    taken = {p.name for p in files[0]}
    missing = [(name, "missing in the source") for name in LOAD_FILES if name != CONFIG_NAME and name not in taken]
    if missing:
        raise _not_loadable(missing, files[1])
    selection["layers"] = {str(i): ids for i, ids in sorted(kept.items())}
    max_shard_size = parse_size(max_shard_size)
    if max_shard_size <= 0:
        raise ValueError(f"max shard size must be positive, got {max_shard_size} bytes")
    shards = split_shards(plan_output(tensors, moe, kept), max_shard_size)
    del tensors, moe  # the plan holds what the copy needs; free the full tensor list for the writes
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total = sum(t.nbytes for shard in shards for t in shard)
    delay = float(os.environ.get(DELAY_ENV) or 0)
    src_shards = shard_names(src)
    src_fds = {src / name: os.open(src / name, os.O_RDONLY) for name in src_shards}
    try:
        with atomic_output_dir(dst) as tmp, tqdm(total=total, unit="B", unit_scale=True, desc="prune",
                                                  disable=not progress) as bar:
            for name, shard in zip(names, shards):
                _write_shard(tmp / name, shard, src_fds, bar, delay)
            write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total},
                                          "weight_map": dict(sorted((t.name, name) for name, shard in zip(names, shards)
                                                                    for t in shard))})
            write_json(tmp / CONFIG_NAME, pruned_config(config, kept))
            write_json(tmp / SELECTION_NAME, selection)
            skipped = _copy_other_files(src, tmp, files)
            problems = load_problems(tmp)
            if problems:
                raise _not_loadable(problems, skipped)
    finally:
        for fd in src_fds.values():
            os.close(fd)
    return PruneResult(dst, names, sum(len(s) for s in shards), total, {i: len(ids) for i, ids in kept.items()},
                       skipped)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m reap_tools prune", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="source checkpoint dir")
    ap.add_argument("dst", type=Path, help="output dir (must not exist)")
    ap.add_argument("--selection", type=Path, required=True, help="reap_selection.json from `plan`")
    ap.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="e.g. 5GB, 500MB (default %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        r = prune_checkpoint(args.src, args.selection, args.dst, max_shard_size=args.max_shard_size,
                             progress=not args.no_progress)
    except (ValueError, OSError) as e:
        return fail("prune", e)
    except KeyboardInterrupt:
        print(f"prune: interrupted; the partial output was removed and {args.dst} not created", file=sys.stderr)
        return 130
    for name, why in r.skipped:
        print(f"prune: not copied: {name} ({why})", file=sys.stderr)
    counts = sorted(set(r.experts_per_layer.values()))
    print(f"pruned {args.src} -> {r.dst}: {len(r.experts_per_layer)} MoE layers keep "
          f"{counts[0] if len(counts) == 1 else f'{counts[0]}..{counts[-1]}'} experts; "
          f"{r.num_tensors} tensors, {human(r.total_size)} in {len(r.shards)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
