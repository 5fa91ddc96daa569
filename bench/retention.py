"""Retention of the coding prune at small scale: REAP vs frequency vs EAN vs random on the trained demo (issue 6).

    python bench/retention.py [--parent demo/parent] [--data data] [--out bench/results/retention] [--ship demo/reap20]

One command from the shipped parent (56 experts per MoE layer) and the corpus of `bench/prepare_corpus.py`:
1. `observe` the parent on a coding calibration load: `--calib-windows` windows of 512 tokens taken from the
   *train* split of the code corpus (the evaluation uses the held-out split, so the two never overlap);
2. `plan` + `prune` to 20 experts per layer (the 64.3 % cut of 896 -> 320) with each criterion — reap, frequency,
   ean, random (seeds 0, 1, 2) — and to 28 (50 %) and 11 (80 %) with reap and frequency;
3. evaluate the parent and every prune on held-out Python source and held-out prose: perplexity and next-token
   accuracy over the same fixed windows, and the syntactic-validity rate of greedy completions of the first
   `--headers` top-level function headers of the held-out code (judged with `bench/eval_demo.py`'s rule).
Writes `retention.json`, `retention.md` (the README table) and `retention.png` (code and prose perplexity against
the cut, one line per criterion) into `--out`; with `--ship` the REAP-20 prune is copied there (verified bit-exact
against the parent first). Nothing here was tuned on the evaluation: the settings above were fixed before any run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from eval_demo import completion_parses, load, windows  # noqa: E402
from reap_tools.observe import observe  # noqa: E402
from reap_tools.plan import plan_selection  # noqa: E402
from reap_tools.prune import prune_checkpoint  # noqa: E402
from reap_tools.verify import verify_checkpoint  # noqa: E402

SEQ_LEN = 512
RUNS = [("reap", 20, 0), ("frequency", 20, 0), ("ean", 20, 0), ("random", 20, 0), ("random", 20, 1),
        ("random", 20, 2), ("reap", 28, 0), ("frequency", 28, 0), ("reap", 11, 0), ("frequency", 11, 0)]
HEADER = re.compile(r"^def [A-Za-z_]\w*\(.*\):$")


def function_headers(tokenizer, ids: np.ndarray, count: int) -> list[str]:
    """The first `count` distinct top-level one-line `def ...:` headers of the held-out code, in corpus order."""
    eos = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    text = tokenizer.decode([int(i) for i in ids if i != eos])
    headers = []
    for line in text.split("\n"):
        if HEADER.match(line) and line not in headers:
            headers.append(line)
            if len(headers) == count:
                break
    return headers


@torch.no_grad()
def validity_rate(model, tokenizer, prompts, max_new_tokens=64, batch_size=25):
    """Share of prompts whose greedy completion parses; prompts are left-padded into batches."""
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ok = 0
    for start in range(0, len(prompts), batch_size):
        batch = [tokenizer.encode(p + "\n", add_special_tokens=False) for p in prompts[start : start + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)
        for prompt, row in zip(prompts[start : start + batch_size], out[:, width:].tolist()):
            ended = eos in row
            row = row[: row.index(eos)] if ended else row
            ok += completion_parses(prompt + "\n", tokenizer.decode(row, skip_special_tokens=True), ended)
    return ok / len(prompts)


@torch.no_grad()
def evaluate(model, tokenizer, eval_windows, headers, batch_size):
    """Perplexity and next-token accuracy per held-out split (one forward per batch), and the validity rate."""
    row = {}
    for source, w in eval_windows.items():
        nll, correct = [], []
        for start in range(0, len(w), batch_size):
            x = torch.from_numpy(w[start : start + batch_size])
            logits = model(x).logits[:, :-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none"))
            correct.append(logits.argmax(-1) == x[:, 1:])
        row[f"{source}_ppl"] = math.exp(torch.cat(nll).double().mean().item())
        row[f"{source}_acc"] = torch.cat(correct).double().mean().item()
    row["validity"] = validity_rate(model, tokenizer, headers)
    return row


def calibration_batches(ids: np.ndarray, count: int, batch_size: int):
    w = windows(ids, count, SEQ_LEN)
    return [{"input_ids": torch.from_numpy(w[i : i + batch_size]),
             "attention_mask": torch.ones(len(w[i : i + batch_size]), SEQ_LEN, dtype=torch.long)}
            for i in range(0, len(w), batch_size)]


def markdown(results, parent):
    def cell(rows, key, fmt):
        values = [r[key] for r in rows]
        if len(values) == 1:
            return fmt.format(values[0])
        return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"

    lines = ["| model | experts kept | code ppl | prose ppl | code retention | prose retention | code acc | "
             "prose acc | valid Python |", "|---|---|---|---|---|---|---|---|---|"]
    groups = {("parent", 56): [parent]}
    for r in results:
        groups.setdefault((r["criterion"], r["num_experts"]), []).append(r)
    for (criterion, kept), rows in groups.items():
        for r in rows:
            r["code_retention"] = 100 * parent["code_ppl"] / r["code_ppl"]
            r["prose_retention"] = 100 * parent["prose_ppl"] / r["prose_ppl"]
        name = criterion if criterion != "random" else f"random ({len(rows)} seeds, mean ± sd)"
        lines.append(f"| {name} | {kept} | {cell(rows, 'code_ppl', '{:.2f}')} | {cell(rows, 'prose_ppl', '{:.2f}')} | "
                     f"{cell(rows, 'code_retention', '{:.1f}')} % | {cell(rows, 'prose_retention', '{:.1f}')} % | "
                     f"{cell(rows, 'code_acc', '{:.3f}')} | {cell(rows, 'prose_acc', '{:.3f}')} | "
                     f"{cell(rows, 'validity', '{:.0%}')} |")
    return "\n".join(lines) + "\n"


def plot(results, parent, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for criterion in ("reap", "frequency", "ean", "random"):
        rows = [r for r in results if r["criterion"] == criterion]
        cuts = sorted({r["num_experts"] for r in rows}, reverse=True)
        xs = [0.0] + [100 * (1 - n / 56) for n in cuts]
        for ax, source in zip(axes, ("code", "prose")):
            ys = [parent[f"{source}_ppl"]] + [statistics.mean(r[f"{source}_ppl"] for r in rows
                                                              if r["num_experts"] == n) for n in cuts]
            ax.plot(xs, ys, marker="o", label=criterion)
    for ax, source in zip(axes, ("code", "prose")):
        ax.set_title(f"held-out {source}")
        ax.set_xlabel("routed experts removed (%)")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "retention"))
    parser.add_argument("--ship", default=None, help="copy the verified REAP-20 prune here")
    parser.add_argument("--calib-windows", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--headers", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(args.parent)
    eval_windows = {s: windows(np.load(data / f"val_{s}.npy"), args.eval_windows, SEQ_LEN) for s in ("code", "prose")}
    headers = function_headers(tokenizer, np.load(data / "val_code.npy"), args.headers)
    if len(headers) < args.headers:
        raise SystemExit(f"only {len(headers)} function headers in the held-out code, {args.headers} asked")

    t0 = time.time()
    report = observe(model, calibration_batches(np.load(data / "train_code.npy"), args.calib_windows,
                                                args.batch_size), name_or_path=args.parent, progress=False,
                     calibration={"source": "train_code.npy", "windows": args.calib_windows, "seq_len": SEQ_LEN})
    (out / "report.json").write_text(json.dumps(report))
    print(f"observed {args.calib_windows} x {SEQ_LEN} calibration tokens in {time.time() - t0:.0f} s")
    parent = dict(criterion="parent", num_experts=56, seed=0, **evaluate(model, tokenizer, eval_windows, headers,
                                                                       args.batch_size))
    print("parent", {k: round(v, 4) for k, v in parent.items() if isinstance(v, float)})

    results = []
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for criterion, kept, seed in RUNS:
            selection = plan_selection(report, num_experts=kept, criterion=criterion, seed=seed)
            name = f"{criterion}-{kept}-s{seed}"
            pruned_dir = Path(tmp) / name
            prune_checkpoint(args.parent, selection, pruned_dir, progress=False)
            pruned, _ = load(pruned_dir)
            row = dict(criterion=criterion, num_experts=kept, seed=seed,
                       **evaluate(pruned, tokenizer, eval_windows, headers, args.batch_size))
            results.append(row)
            print(name, {k: round(v, 4) for k, v in row.items() if isinstance(v, float)})
            if args.ship and (criterion, kept) == ("reap", 20):
                verdict = verify_checkpoint(pruned_dir, source=args.parent, progress=False)
                if not verdict.ok:
                    raise SystemExit(f"REAP-20 prune does not verify: {verdict.summary()}")
                ship, staged = Path(args.ship), Path(args.ship + ".partial")
                shutil.copytree(pruned_dir, staged)
                if ship.exists():
                    shutil.rmtree(ship)
                os.rename(staged, ship)
                print(f"shipped {ship}: {verdict.summary()}")
    table = markdown(results, parent)
    (out / "retention.json").write_text(json.dumps({"parent": parent, "runs": results, "headers": headers,
                                                    "settings": vars(args)}, indent=2))
    (out / "retention.md").write_text(table)
    plot(results, parent, out / "retention.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
