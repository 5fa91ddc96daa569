"""Measure REAP saliency: run calibration data through the model and record, per MoE layer and
routed expert, what `plan` needs (REAP: Lasby et al., 2025).

    python -m reap_tools observe --model DIR --data FILE [FILE ...] --out report.json
        [--seq-len 2048] [--batch-size 1] [--max-tokens T] [--no-pack] [--padding-side right|left]
        [--device-map auto] [--dtype auto|bfloat16|float16|float32] [--threads N] [--offload-folder DIR]
        [--tokenizer DIR] [--save-every 10] [--stop-after S] [--resume] [--no-progress]
    python -m reap_tools observe --sequential --model DIR --data FILE [FILE ...] --out report.json
        [--devices 0,1,...] [--max-host-gb G] [--scratch DIR] [--prefill-chunk 8192] [--stop-after-layer K]
        [--resume]      (a checkpoint too large to load, one decoder layer at a time: reap_tools/sequential.py)

What is measured. Forward hooks on every `...layers.{i}.block_sparse_moe` (LatentMoE) block:
- on `block_sparse_moe.gate` (the router): its real output, the chosen ids [N, k] (bias-corrected
  top-k) and the weights [N, k] the model multiplies expert outputs by (sigmoid scores
  renormalised over the chosen top-k, times routed_scaling_factor). Nothing is recomputed.
- on `block_sparse_moe.routed_expert_down_proj`: its output z = down(x) [N, L], the latent input
  every routed expert sees.
- on the block itself: when it returns, for every (non-padding token, chosen expert e) pair,
  f_e(z) is recomputed with the block's own routed-experts op (`expert_outputs`: the latent expert
  output before the latent norm) and, in float64, per expert: count (tokens routed), reap_sum (sum of
  g·||f||₂), ean_sum (sum of ||f||₂) and max_norm (max ||f||₂).
The block flattens [B, T, H] to [N = B·T, H] in B-major order; `SaliencyObserver.set_mask` takes
the [B, T] attention mask of the coming forward and padding rows (mask 0) are dropped before any
expert is run, so they never count. Per-forward numbers are staged and added to the totals only
once the whole forward has finished, so the totals always cover whole batches.

Calibration data (`--data`, any mix, in the order given):
- `.txt`: one document per file, encoded with `tokenizer.encode(text)`.
- `.jsonl`: one document per line, an object with `"text"` (encoded as above) or `"messages"`
  (a chat, rendered and encoded with `tokenizer.apply_chat_template(messages, tokenize=True)`).
- `.npy` (integer array) / `.json` (list of ids, or list of lists): already-tokenised ids, used
  verbatim; a 1-D array / flat list is one document, a 2-D array / list of lists one per row.
The tokenizer (`--tokenizer`, default the model dir) is loaded only for text/JSONL files.
Packing (default): documents are concatenated, each text/JSONL document followed by the eos id
unless it already ends with it, and the stream is cut into sequences of `--seq-len`; only the last
sequence can be shorter. `--no-pack`: one sequence per document, truncated to `--seq-len`.
`--max-tokens` caps the tokens taken (before packing). Batches of `--batch-size` sequences are padded
to their longest with the pad id (`--padding-side`), attention mask 0 there.

Report (plan.py's schema, which `plan` validates; extra keys are ignored there):

    {"format": "reap-saliency/1",
     "model": {"name_or_path", "revision" (hub commit / .git HEAD / null), "num_hidden_layers",
               "num_experts", "num_experts_per_token", "moe_layers",
               "num_experts_per_layer" (only for a non-uniform model), "dtype"},
     "calibration": {"files": [{"path", "sha256", "bytes", "format", "documents"}], "seq_len",
                     "batch_size", "packing", "padding_side", "max_tokens", "separator_id",
                     "pad_id", "tokenizer", "num_sequences" (observed), "num_tokens" (observed,
                     non-padding), "num_padding_tokens"},
     "progress": {"sequences_done", "total_sequences", "complete"},
     "layers": {"<i>": {"count": [E], "reap_sum": [E], "ean_sum": [E], "max_norm": [E]}}}

Saving and resuming. The report is rewritten atomically (temp file + fsync + rename) every
`--save-every` batches, at the end, and on Ctrl-C (always at a whole-batch boundary).
`--resume` reads the existing `--out`, checks it was taken on the same model structure with the
same calibration files (sha256), sequence length, packing, padding side, token cap, separator and
tokenizer, then skips its `sequences_done` sequences and continues; with the same batch size the
result is identical to one uninterrupted run. `--stop-after S` stops after S sequences in all
(report marked incomplete), e.g. to spread one observation over several sessions. A report with
`progress.complete` false is not a finished measurement: do not plan from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import cpu
from .cli import ArgumentParser, check_writable, fail, int_at_least

REPORT_FORMAT = "reap-saliency/1"
FIELDS = ("count", "reap_sum", "ean_sum", "max_norm")
BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.block_sparse_moe$")
TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".npy", ".json")
# calibration keys that must agree for --resume to continue a report
RESUME_KEYS = ("seq_len", "packing", "padding_side", "max_tokens", "separator_id", "pad_id", "tokenizer")
MODEL_KEYS = ("num_hidden_layers", "num_experts", "num_experts_per_token", "moe_layers", "num_experts_per_layer")


class ObserveError(ValueError):
    """Bad calibration data, a model without LatentMoE blocks, or a report that cannot be resumed."""


# ------------------------------------------------------------------------------------------------
# Hooks and accumulation
# ------------------------------------------------------------------------------------------------


def find_moe_blocks(model) -> dict[int, torch.nn.Module]:
    """{layer index: LatentMoE block} for every `layers.{i}.block_sparse_moe` with gate/down/experts."""
    blocks = {}
    for name, module in model.named_modules():
        m = BLOCK_RE.search(name)
        if m and all(hasattr(module, a) for a in ("gate", "routed_expert_down_proj", "experts")):
            blocks[int(m.group(1))] = module
    if not blocks:
        raise ObserveError("the model has no `layers.{i}.block_sparse_moe` LatentMoE blocks to observe")
    return dict(sorted(blocks.items()))


def expert_outputs(block, z, ids) -> torch.Tensor:
    """Each (token, slot)'s routed expert output f = expert_{ids[:, k]}(z) [N, k, L] (unweighted, before the latent
    norm) for the latents z [N, L]: the block's own routed-experts op, the one its forward calls on z's device (a
    kernel where one runs there; each expert module where accelerate offloads the weights, so its hooks load them)."""
    ops = block.dispatch.ops(z.device, block.routed_expert_up_proj.weight.is_meta)
    return ops.routed_experts(block, z, ids)


class SaliencyObserver:
    """Forward hooks on every LatentMoE block that accumulate REAP / frequency / EAN / max statistics.

    Use as a context manager (hooks attached inside). Before each forward call `set_mask(attention_mask)`
    ([B, T], 0 = padding, or None for no padding); after it, `commit()` adds that forward's numbers to the
    totals. `totals()` gives {layer: float64 CPU tensor [4, E]} in FIELDS order. `initial` (a report's
    "layers" block) starts the totals from a previous, partial report. `blocks` ({layer: LatentMoE block}) watches
    those blocks instead of the model's (the layer-sequential engine passes the one layer it has built).
    """

    def __init__(self, model, initial: dict | None = None, blocks: dict | None = None):
        self.blocks = dict(blocks) if blocks is not None else find_moe_blocks(model)
        self.experts = {i: len(b.experts) for i, b in self.blocks.items()}
        self._totals: dict[int, torch.Tensor] = {}
        for i, n in self.experts.items():
            t = torch.zeros(len(FIELDS), n, dtype=torch.float64)
            if initial is not None:
                stats = initial.get(str(i))
                if stats is None:
                    raise ObserveError(f"report to resume has no layer {i}")
                for f, field in enumerate(FIELDS):
                    values = stats.get(field)
                    if not isinstance(values, list) or len(values) != n:
                        raise ObserveError(f"report to resume: layer {i} {field!r} is not a list of {n} numbers")
                    t[f] = torch.tensor(values, dtype=torch.float64)
            self._totals[i] = t
        self._mask: torch.Tensor | None = None
        self._pending: dict[int, dict] = {}
        self._staged: dict[int, torch.Tensor] = {}
        self._handles = []

    # -- hooks --------------------------------------------------------------------------------

    def attach(self) -> None:
        if self._handles:
            return
        for i, block in self.blocks.items():
            self._handles += [
                block.register_forward_pre_hook(self._block_pre_hook(i)),
                block.gate.register_forward_hook(self._gate_hook(i)),
                block.routed_expert_down_proj.register_forward_hook(self._down_hook(i)),
                # inside the block's forward, where an offloaded block's weights are loaded (accelerate's hook)
                block.routed_expert_up_proj.register_forward_pre_hook(self._block_hook(i, block)),
            ]
            block.pairs_observer = self._pairs_observer(i)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        for block in self.blocks.values():
            block.pairs_observer = None
        self._handles = []
        self._pending.clear()

    def __enter__(self):
        self.attach()
        return self

    def __exit__(self, *exc):
        self.detach()
        return False

    def set_mask(self, attention_mask) -> None:
        """The [B, T] attention mask (0 = padding) of the next forward, or None when nothing is padding."""
        self._mask = None if attention_mask is None else torch.as_tensor(attention_mask).reshape(-1).bool()

    def _block_pre_hook(self, i):
        def hook(module, args):
            self._pending[i] = {}
        return hook

    def _gate_hook(self, i):
        def hook(module, args, output):
            ids, weights = output
            self._pending.setdefault(i, {}).update(ids=ids, weights=weights)
        return hook

    def _down_hook(self, i):
        def hook(module, args, output):
            self._pending.setdefault(i, {})["z"] = output
        return hook

    def _pairs_observer(self, i):
        def observe(pairs):
            self._pending.setdefault(i, {})["pairs"] = pairs
        return observe

    def _block_hook(self, i, block):
        def hook(module, args):
            seen = self._pending.pop(i, {})
            if not {"ids", "weights", "z"} <= set(seen):
                raise RuntimeError(f"observe: layer {i}: the MoE block ran without calling its gate and "
                                   f"routed_expert_down_proj once each (got {sorted(seen)})")
            self._accumulate(i, block, seen["ids"], seen["weights"], seen["z"], seen.get("pairs"))
        return hook

    @torch.no_grad()
    def _accumulate(self, i, block, ids, weights, z, pairs=None) -> None:
        """Add one forward's statistics of block i: from its per-pair expert outputs `pairs` as the forward computed
        them, or (a block that gave none: an expert-parallel share) computed again from the latents z."""
        n, n_experts = z.shape[0], self.experts[i]
        device = z.device
        ids, weights = ids.to(device), weights.to(device)
        if ids.shape[0] != n or weights.shape != ids.shape:
            raise RuntimeError(f"observe: layer {i}: router gave ids {list(ids.shape)} / weights "
                               f"{list(weights.shape)} for {n} tokens")
        if self._mask is not None:
            if self._mask.numel() != n:
                raise RuntimeError(f"observe: layer {i}: the MoE block saw {n} tokens but the attention mask "
                                   f"covers {self._mask.numel()} (call set_mask with this forward's [B, T] mask)")
            keep = self._mask.to(device).nonzero().squeeze(1)
            ids, weights, z = ids[keep], weights[keep], z[keep]
            pairs = None if pairs is None else pairs[keep]
        if pairs is None:
            pairs = expert_outputs(block, z, ids)
        norms = torch.linalg.vector_norm(pairs.to(torch.float64), dim=-1)
        flat = ids.reshape(-1)
        norms = norms.reshape(-1)
        stats = torch.zeros(len(FIELDS), n_experts, dtype=torch.float64, device=device)
        stats[0] = torch.bincount(flat, minlength=n_experts).to(torch.float64)
        stats[1].index_add_(0, flat, weights.reshape(-1).to(torch.float64) * norms)
        stats[2].index_add_(0, flat, norms)
        stats[3].scatter_reduce_(0, flat, norms, reduce="amax", include_self=True)
        if i in self._staged:  # the same block twice in one forward: combine
            prev = self._staged[i].to(device)
            stats[:3] += prev[:3]
            stats[3] = torch.maximum(stats[3], prev[3])
        self._staged[i] = stats

    # -- totals -------------------------------------------------------------------------------

    def commit(self) -> None:
        """Add the staged numbers of the forward that just finished to the totals."""
        for i, stats in self._staged.items():
            total = self._totals[i]
            if total.device != stats.device:
                total = self._totals[i] = total.to(stats.device)
            total[:3] += stats[:3]
            torch.maximum(total[3], stats[3], out=total[3])
        self._staged.clear()

    def discard(self) -> None:
        """Forget the staged numbers (a forward that failed or was interrupted)."""
        self._staged.clear()
        self._pending.clear()

    def totals(self) -> dict[int, torch.Tensor]:
        return {i: t.detach().cpu() for i, t in self._totals.items()}

    def layers_report(self) -> dict[str, dict[str, list]]:
        return self.layers_report_of(self.totals())

    @staticmethod
    def layers_report_of(totals: dict[int, torch.Tensor]) -> dict[str, dict[str, list]]:
        """The report's "layers" object from {layer: float64 [4, E]} totals in FIELDS order."""
        out = {}
        for i, t in totals.items():
            rows = t.tolist()
            out[str(i)] = {"count": [int(c) for c in rows[0]], "reap_sum": rows[1], "ean_sum": rows[2],
                           "max_norm": rows[3]}
        return out


# ------------------------------------------------------------------------------------------------
# The observation loop
# ------------------------------------------------------------------------------------------------


def model_block(model, name_or_path: str | None = None) -> dict:
    """The report's "model" object (plan.py schema) from a loaded model's config."""
    config = model.config
    tc = getattr(config, "text_config", None) or config
    counts = None
    if not hasattr(tc, "experts_in_layer"):
        blocks = find_moe_blocks(model)
        counts = [len(blocks[i].experts) if i in blocks else 0 for i in range(int(tc.num_hidden_layers))]
    return describe_model(config, name_or_path or getattr(config, "_name_or_path", None) or None,
                          model_revision(model, name_or_path), next(model.parameters()).dtype, counts)


def describe_model(config, name_or_path: str | None, revision: str | None, dtype, counts=None) -> dict:
    """The report's "model" object from a config (`counts`: routed experts per layer, default the config's)."""
    tc = getattr(config, "text_config", None) or config
    layers = int(tc.num_hidden_layers)
    if counts is None:
        counts = [int(tc.experts_in_layer(i)) for i in range(layers)]
    block = {
        "name_or_path": name_or_path,
        "revision": revision,
        "num_hidden_layers": layers,
        "num_experts": int(tc.num_experts),
        "num_experts_per_token": int(tc.num_experts_per_token),
        "moe_layers": [i for i, c in enumerate(counts) if c],
    }
    if getattr(tc, "num_experts_per_layer", None) is not None:
        block["num_experts_per_layer"] = [int(c) for c in counts]
    block["dtype"] = str(dtype).removeprefix("torch.")
    return block


def model_revision(model, path: str | None = None) -> str | None:
    """Commit the weights came from: the hub commit transformers recorded, a `.git` HEAD, or a cache snapshot id."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    return path_revision(path or getattr(model.config, "_name_or_path", None))


def path_revision(path: str | None) -> str | None:
    """Commit of a local checkpoint folder: its `.git` HEAD, or the hub cache snapshot id in its path."""
    if not path or not os.path.isdir(path):
        return None
    head = git_head(path)
    if head:
        return head
    m = re.search(r"[\\/]snapshots[\\/]([0-9a-f]{40})(?:[\\/]|$)", os.path.abspath(path))
    return m.group(1) if m else None


def git_head(path: str | Path) -> str | None:
    """The commit HEAD points at in `path/.git` (read from the files, no git binary), or None."""
    git = Path(path) / ".git"
    if git.is_file():  # a worktree / submodule: "gitdir: ..."
        text = git.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git = (Path(path) / text.split(":", 1)[1].strip()).resolve()
    try:
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    if re.fullmatch(r"[0-9a-f]{40}", head):
        return head
    if not head.startswith("ref:"):
        return None
    ref = head.split(":", 1)[1].strip()
    common = git
    if (git / "commondir").exists():
        common = (git / (git / "commondir").read_text().strip()).resolve()
    for base in (git, common):
        try:
            sha = (base / ref).read_text().strip()
            if re.fullmatch(r"[0-9a-f]{40}", sha):
                return sha
        except OSError:
            pass
        try:
            for line in (base / "packed-refs").read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
        except OSError:
            pass
    return None


def input_device(model) -> torch.device:
    """Where input ids go: the embedding's device (accelerate's hooks move them on when it is offloaded)."""
    try:
        device = model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def _as_batch(batch):
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)):
        ids, mask = batch[0], batch[1] if len(batch) > 1 else None
    else:
        ids, mask = batch, None
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(ids.shape)
    return ids, mask


def observe(model, batches, *, resume_from: dict | None = None, calibration: dict | None = None,
            name_or_path: str | None = None, total_sequences: int | None = None, stop_after: int | None = None,
            save_path: str | Path | None = None, save_every: int = 10, progress: bool = True) -> dict:
    """Run `batches` through `model` with a SaliencyObserver attached and return the saliency report.

    batches: an iterable of {"input_ids": [B, T], "attention_mask": [B, T] (optional, 0 = padding)} (or
    (ids, mask) tuples, or id tensors). resume_from: a previous report of the same model and data — its
    totals are the starting point and its `progress.sequences_done` first sequences of `batches` are skipped.
    calibration: provenance merged into the report's "calibration". stop_after: stop after that many
    sequences in all (the report is then marked incomplete). save_path: where to write the report atomically
    every `save_every` batches, on KeyboardInterrupt (then re-raised) and at the end.
    """
    model.eval()
    done = 0
    tokens = padding = 0
    if resume_from is not None:
        done = int(resume_from.get("progress", {}).get("sequences_done", 0))
        tokens = int(resume_from.get("calibration", {}).get("num_tokens", 0))
        padding = int(resume_from.get("calibration", {}).get("num_padding_tokens", 0))
    base = {"format": REPORT_FORMAT, "model": model_block(model, name_or_path)}
    if resume_from is not None:
        for key in MODEL_KEYS:
            if resume_from.get("model", {}).get(key) != base["model"].get(key):
                theirs, ours = resume_from.get("model", {}).get(key), base["model"].get(key)
                raise ObserveError(f"cannot resume: the report's model {key} is {theirs!r}, this model's is {ours!r}")
    observer = SaliencyObserver(model, initial=resume_from["layers"] if resume_from is not None else None)
    calibration = dict(calibration or {})
    state = {"done": done, "tokens": tokens, "padding": padding, "complete": False}

    def report():
        cal = {**calibration, "num_sequences": state["done"], "num_tokens": state["tokens"],
               "num_padding_tokens": state["padding"]}
        return {**base, "calibration": cal,
                "progress": {"sequences_done": state["done"], "total_sequences": total_sequences,
                             "complete": state["complete"]},
                "layers": observer.layers_report()}

    skip = done
    device = input_device(model)
    bar = tqdm(total=total_sequences, initial=done, unit="seq", desc="observe", disable=not progress)
    first, start = state["tokens"], time.time()  # tokens/s of this run (the bar's ETA counts sequences)
    since_save = 0
    exhausted = False
    try:
        with observer, torch.inference_mode():
            for batch in batches:
                ids, mask = _as_batch(batch)
                if skip:
                    if skip >= ids.shape[0]:
                        skip -= ids.shape[0]
                        continue
                    ids, mask = ids[skip:], None if mask is None else mask[skip:]
                    skip = 0
                if stop_after is not None:
                    room = stop_after - state["done"]
                    if room <= 0:
                        break
                    ids, mask = ids[:room], None if mask is None else mask[:room]
                observer.set_mask(mask)
                try:
                    model(input_ids=ids.to(device), attention_mask=None if mask is None else mask.to(device),
                          use_cache=False, logits_to_keep=1)
                except BaseException:
                    observer.discard()
                    raise
                observer.commit()
                real = int(mask.sum()) if mask is not None else ids.numel()
                state["done"] += ids.shape[0]
                state["tokens"] += real
                state["padding"] += ids.numel() - real
                bar.update(ids.shape[0])
                rate = (state["tokens"] - first) / max(time.time() - start, 1e-9)
                bar.set_postfix({"tokens": state["tokens"], "tok/s": f"{rate:.0f}"})
                since_save += 1
                if save_path is not None and save_every and since_save >= save_every:
                    save_report(report(), save_path)
                    since_save = 0
            else:
                exhausted = True
    except KeyboardInterrupt:
        if save_path is not None:
            save_report(report(), save_path)
        raise
    finally:
        bar.close()
    if skip:
        raise ObserveError(f"the report to resume has {done} sequences done, but the data has only "
                           f"{done - skip}")
    state["complete"] = exhausted
    final = report()
    if save_path is not None:
        save_report(final, save_path)
    return final


def save_report(report: dict, path: str | Path) -> None:
    """Write JSON atomically: a temp file in the same directory, fsync, rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------------
# Calibration data
# ------------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding by default
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        if len(out) != 1:
            raise ObserveError(f"apply_chat_template returned {len(out)} sequences for one chat")
        out = out[0]
    return [int(t) for t in out]


def _id_rows(data, path) -> list[np.ndarray]:
    """Documents from a 1-D array / flat list (one) or a 2-D array / list of lists (one per row, ragged allowed)."""
    if isinstance(data, list) and data and all(isinstance(r, list) for r in data):
        return [_id_array(r, path, 1) for r in data]
    array = _id_array(data, path, None)
    return [array] if array.ndim == 1 else list(array)


def _id_array(data, path, ndim) -> np.ndarray:
    try:
        array = np.asarray(data)
    except ValueError as e:
        raise ObserveError(f"{path}: not an array of token ids ({e})") from None
    if array.ndim not in ((1, 2) if ndim is None else (ndim,)):
        raise ObserveError(f"{path}: expected a 1-D or 2-D array / list of token ids, got {array.ndim}-D")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ObserveError(f"{path}: token ids must be integers (got {array.dtype})")
    return array.astype(np.int64)


def read_documents(path: str | Path, tokenizer=None) -> tuple[list[np.ndarray], str]:
    """Token-id documents of one calibration file and its format name (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES and tokenizer is None:
        raise ObserveError(f"{path}: text data needs a tokenizer")
    if suffix == ".txt":
        return [np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)], "txt"
    if suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ObserveError(f"{path}:{n}: not JSON ({e})") from None
                if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                    ids = tokenizer.encode(obj["text"])
                elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                    ids = _chat_ids(tokenizer, obj["messages"])
                else:
                    raise ObserveError(f"{path}:{n}: expected an object with a 'text' string or a 'messages' list")
                docs.append(np.asarray(ids, dtype=np.int64))
        return docs, "jsonl"
    if suffix == ".npy":
        return _id_rows(np.load(path, allow_pickle=False), path), "npy"
    if suffix == ".json":
        return _id_rows(json.loads(path.read_text()), path), "json"
    raise ObserveError(f"{path}: unknown calibration format {suffix!r} "
                       f"(use {', '.join(TEXT_SUFFIXES + TOKEN_SUFFIXES)})")


def pack_sequences(documents: list[np.ndarray], seq_len: int, *, pack: bool = True,
                   separators: list[bool] | None = None, separator_id: int | None = None,
                   max_tokens: int | None = None) -> list[np.ndarray]:
    """Sequences of at most seq_len ids: packed from the joined stream (default) or one per document."""
    if seq_len < 1:
        raise ObserveError("--seq-len must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ObserveError(f"--max-tokens must be >= 1, got {max_tokens}")
    separators = separators or [False] * len(documents)
    pieces = []
    for doc, sep in zip(documents, separators):
        if pack and sep and separator_id is not None and (not len(doc) or doc[-1] != separator_id):
            doc = np.concatenate([doc, np.asarray([separator_id], dtype=np.int64)])
        if len(doc):
            pieces.append(doc)
    if pack:
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        if max_tokens is not None:
            stream = stream[:max_tokens]
        return [stream[s:s + seq_len] for s in range(0, len(stream), seq_len)]
    out, left = [], max_tokens
    for doc in pieces:
        doc = doc[:seq_len] if left is None else doc[:min(seq_len, left)]
        if not len(doc):
            break
        out.append(doc)
        if left is not None:
            left -= len(doc)
    return out


def make_batches(sequences: list[np.ndarray], batch_size: int, pad_id: int, padding_side: str = "right"):
    """Yield {"input_ids", "attention_mask"} batches, padded to the batch's longest sequence."""
    if batch_size < 1:
        raise ObserveError("--batch-size must be >= 1")
    if padding_side not in ("right", "left"):
        raise ObserveError(f"padding side {padding_side!r} is not 'right' or 'left'")
    for s in range(0, len(sequences), batch_size):
        rows = sequences[s:s + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, seq in enumerate(rows):
            span = slice(0, len(seq)) if padding_side == "right" else slice(width - len(seq), width)
            ids[r, span] = torch.from_numpy(np.asarray(seq, dtype=np.int64))
            mask[r, span] = 1
        yield {"input_ids": ids, "attention_mask": mask}


def load_calibration(files, tokenizer=None, *, vocab_size: int | None = None, seq_len: int, pack: bool = True,
                     separator_id: int | None = None, max_tokens: int | None = None):
    """(sequences, provenance of each file) for the given calibration files."""
    docs, seps, provenance = [], [], []
    for path in files:
        try:
            file_docs, fmt = read_documents(path, tokenizer)
        except ObserveError:
            raise
        except ValueError as e:  # not UTF-8, not JSON, not an .npy array
            raise ObserveError(f"{path}: cannot read: {e}") from None
        for d in file_docs:
            if vocab_size is not None and len(d) and (d.min() < 0 or d.max() >= vocab_size):
                raise ObserveError(f"{path}: token id {int(d.min() if d.min() < 0 else d.max())} is outside the "
                                   f"model's vocabulary 0..{vocab_size - 1}")
        docs += file_docs
        seps += [fmt in ("txt", "jsonl")] * len(file_docs)
        provenance.append({"path": str(path), "sha256": file_sha256(path), "bytes": os.path.getsize(path),
                           "format": fmt, "documents": len(file_docs)})
    sequences = pack_sequences(docs, seq_len, pack=pack, separators=seps, separator_id=separator_id,
                               max_tokens=max_tokens)
    if not sequences:
        raise ObserveError("the calibration files hold no tokens")
    return sequences, provenance


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _first(value):
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def check_resumable(previous: dict, model: dict, calibration: dict) -> None:
    """Refuse to continue a report taken on another model structure or other calibration data/settings."""
    for key in MODEL_KEYS:
        if previous.get("model", {}).get(key) != model.get(key):
            raise ObserveError(f"cannot resume: the report's model {key} is {previous.get('model', {}).get(key)!r}, "
                               f"this model's is {model.get(key)!r}")
    old = previous.get("calibration", {})
    old_files = [(f.get("path"), f.get("sha256")) for f in old.get("files", [])]
    new_files = [(f["path"], f["sha256"]) for f in calibration["files"]]
    if [s for _, s in old_files] != [s for _, s in new_files]:
        raise ObserveError(f"cannot resume: the report was taken on calibration files {old_files}, "
                           f"now {new_files} (contents by sha256 must match, in order)")
    for key in RESUME_KEYS:
        if old.get(key) != calibration.get(key):
            raise ObserveError(f"cannot resume: calibration {key} was {old.get(key)!r}, now {calibration.get(key)!r}")


def _load_model(args, dtype="auto"):
    from transformers import AutoModelForCausalLM

    kwargs = {"trust_remote_code": True, "dtype": dtype}
    if args.device_map:
        kwargs["device_map"] = args.device_map
    if args.offload_folder:
        kwargs["offload_folder"] = args.offload_folder
    if args.revision:
        kwargs["revision"] = args.revision
    return AutoModelForCausalLM.from_pretrained(args.model, **kwargs)


def _needs_tokenizer(files) -> bool:
    return any(Path(f).suffix.lower() in TEXT_SUFFIXES for f in files)


def prepare_calibration(args, config) -> tuple[list[np.ndarray], dict, int]:
    """(sequences, the report's calibration provenance, pad id) for the CLI's --data and settings on `config`."""
    tc = getattr(config, "text_config", config)
    tokenizer = tokenizer_name = None
    if _needs_tokenizer(args.data):
        from transformers import AutoTokenizer
        tokenizer_name = args.tokenizer or args.model
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=True)
        except ValueError as e:
            raise ObserveError(f"cannot load the tokenizer {tokenizer_name}: {e}") from None
    pad_id = _first(getattr(tc, "pad_token_id", None))
    pad_id = pad_id if pad_id is not None else _first(getattr(config, "pad_token_id", None))
    if pad_id is None:
        pad_id = 0  # padded positions are masked out, so the id only has to be valid
    separator_id = _first(getattr(tc, "eos_token_id", None))
    sequences, files = load_calibration(args.data, tokenizer, vocab_size=int(tc.vocab_size), seq_len=args.seq_len,
                                        pack=not args.no_pack, separator_id=separator_id, max_tokens=args.max_tokens)
    calibration = {"files": files, "seq_len": args.seq_len, "batch_size": args.batch_size,
                   "packing": "document" if args.no_pack else "pack", "padding_side": args.padding_side,
                   "max_tokens": args.max_tokens, "separator_id": separator_id, "pad_id": int(pad_id),
                   "tokenizer": tokenizer_name, "device_map": args.device_map}
    return sequences, calibration, int(pad_id)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m reap_tools observe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model dir (or hub id) to observe")
    ap.add_argument("--revision", help="hub revision of --model")
    ap.add_argument("--data", nargs="+", required=True, help="calibration files: .txt, .jsonl, .npy, .json")
    ap.add_argument("--out", type=Path, required=True, help="saliency report JSON to write")
    ap.add_argument("--tokenizer", help="tokenizer dir for text/JSONL data (default: --model)")
    ap.add_argument("--seq-len", type=int_at_least(1), default=2048, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--batch-size", type=int_at_least(1), default=1, help="sequences per forward (default %(default)s)")
    ap.add_argument("--max-tokens", type=int_at_least(1), help="use at most this many calibration tokens")
    ap.add_argument("--no-pack", action="store_true", help="one sequence per document instead of packing")
    ap.add_argument("--padding-side", choices=("right", "left"), default="right")
    ap.add_argument("--device-map", help='transformers device_map, e.g. "auto" (default: load on CPU)')
    ap.add_argument("--dtype", choices=cpu.DTYPES, default="auto",
                    help="default: float32 on a CPU without AMX (faster there), else the checkpoint's")
    ap.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--offload-folder", help="offload folder for device_map auto")
    ap.add_argument("--save-every", type=int_at_least(1), default=10,
                    help="rewrite the report every N batches (default 10)")
    ap.add_argument("--stop-after", type=int_at_least(1), help="stop after this many sequences in all (resume later)")
    ap.add_argument("--resume", action="store_true", help="continue the partial report at --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    seq = ap.add_argument_group("layer-sequential observe (a checkpoint too large to load; reap_tools/sequential.py)")
    seq.add_argument("--sequential", action="store_true",
                     help="run one decoder layer at a time, read straight from the shards")
    seq.add_argument("--devices", help="comma-separated devices splitting the sequences, e.g. 0,1,2,3 or cpu,cpu "
                                       "(default: cuda:0 if there is one, else cpu; under torchrun one per rank)")
    seq.add_argument("--max-host-gb", type=float, help="host memory for the carried state (GB, whole host); the "
                                                       "rest is read back from --scratch (default: no limit)")
    seq.add_argument("--scratch", type=Path, help="folder for the carried state, deleted at the end "
                                                  "(default: OUT.scratch beside --out)")
    seq.add_argument("--prefill-chunk", type=int_at_least(1), default=8192,
                     help="tokens a sequence goes through a layer at a time, as the model prefills (default 8192)")
    seq.add_argument("--stop-after-layer", type=int_at_least(0), help="stop after this decoder layer (resume later)")
    args = ap.parse_args(argv)
    if args.sequential:
        for flag, value in (("--device-map", args.device_map), ("--offload-folder", args.offload_folder),
                            ("--stop-after", args.stop_after)):
            if value is not None:
                ap.error(f"{flag} does not apply to --sequential")
        if args.max_host_gb is not None and args.max_host_gb < 0:
            ap.error(f"--max-host-gb must be >= 0, got {args.max_host_gb}")
    else:
        for flag, value in (("--devices", args.devices), ("--max-host-gb", args.max_host_gb),
                            ("--scratch", args.scratch), ("--stop-after-layer", args.stop_after_layer)):
            if value is not None:
                ap.error(f"{flag} needs --sequential")
    try:
        previous = None
        if args.resume:
            if not args.out.exists():
                raise ObserveError(f"--resume: {args.out} does not exist")
            try:
                previous = json.loads(args.out.read_text())
            except ValueError as e:
                raise ObserveError(f"--resume: {args.out} is not JSON ({e})") from None
            if not isinstance(previous, dict) or previous.get("format") != REPORT_FORMAT:
                raise ObserveError(f"--resume: {args.out} is not a {REPORT_FORMAT} report")
            if ("sequential" in previous) != args.sequential:
                taken = "with" if "sequential" in previous else "without"
                raise ObserveError(f"--resume: {args.out} was taken {taken} --sequential; resume it the same way")
            if previous.get("progress", {}).get("complete"):
                print(f"{args.out} is already complete ({previous['progress']['sequences_done']} sequences)")
                return 0
        elif args.out.exists():
            raise ObserveError(f"{args.out} exists; pass --resume to continue it or choose another --out")
        check_writable(args.out)
        started = time.time()
        if args.sequential:
            from .sequential import observe_cli
            report = observe_cli(args, previous)
        else:
            dtype = cpu.choose("observe", args.dtype, args.device_map, args.threads)
            try:
                model = _load_model(args, dtype)
            except ValueError as e:
                raise ObserveError(f"cannot load --model {args.model}: {e}") from None
            sequences, calibration, pad_id = prepare_calibration(args, model.config)
            if previous is not None:
                check_resumable(previous, model_block(model, args.model), calibration)
            report = observe(model, make_batches(sequences, args.batch_size, pad_id, args.padding_side),
                             resume_from=previous, calibration=calibration, name_or_path=args.model,
                             total_sequences=len(sequences), stop_after=args.stop_after, save_path=args.out,
                             save_every=args.save_every, progress=not args.no_progress)
    except (ObserveError, OSError) as e:
        return fail("observe", e)
    except KeyboardInterrupt:
        covers = "the decoder layers it lists as done" if args.sequential else "whole batches"
        print(f"observe: interrupted; the report at {args.out} covers {covers} — continue with --resume",
              file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")):  # under torchrun, rank 0 says it
        return 0
    p = report["progress"]
    state = "complete" if p["complete"] else "partial (continue with --resume)"
    if args.sequential:
        state += f", decoder layers done {_spans(report['sequential']['layers_done'])}"
    print(f"wrote {args.out}: {p['sequences_done']}/{p['total_sequences']} sequences, "
          f"{report['calibration']['num_tokens']} tokens, {len(report['layers'])} MoE layers, {state} "
          f"in {time.time() - started:.1f}s")
    return 0


def _spans(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none"


if __name__ == "__main__":
    sys.exit(main())
