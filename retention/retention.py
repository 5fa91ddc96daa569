"""Retention of the coding prune at small scale: REAP vs frequency vs EAN vs random on the trained demo (issues 6, 21).

    python -m retention.retention [--parent demo/parent] [--data data] [--out retention/results] [--ship DIR]
        [--calib-windows 1024] [--calib-at file-starts] [--eval-windows 64] [--headers 50] [--problems 40] [--seeds 3] [--quick]

One command from the parent (E routed experts per MoE layer, read from its config) and the corpus of
`demo_build.prepare_corpus`:
1. `observe` the parent on a coding calibration load: `--calib-windows` windows of 512 tokens taken from the
   *train* split of the code corpus (the evaluation uses the held-out split, so the two never overlap), each
   starting at the first token of a file (`--calib-at file-starts`, spread evenly over the files: a completion
   prompt is the top of a file, and a prune calibrated only on windows cut anywhere lost top-level functions, see
   `retention.calibration_arms`), or spread evenly over the split wherever they fall (`--calib-at anywhere`);
2. `plan` + `prune` at three cuts, keeping round(E/2) (50 %), round(E * 320/896) (64.3 %, the release's 896 -> 320)
   and round(E/5) (80 %) experts per layer, with each criterion at every cut: reap, frequency, ean and random
   (seeds 0 .. `--seeds` - 1);
3. evaluate the parent and every prune, on the same items for all: perplexity and next-token accuracy over fixed
   held-out windows of Python source and of prose; the valid-Python rate of greedy completions (64 new tokens) of
   the first `--headers` top-level function headers of the held-out code (`demo_build.eval_demo`'s rule); and exec
   pass@1 of `demo_build.exec_eval`'s unit-tested problems (greedy, 128 new tokens, run in a sandboxed subprocess).

Intervals (95 %): perplexity and accuracy by a bootstrap over windows (1000 resamples of the windows, seed 0; the
same resamples for every model, so differences are paired); the two rates by Wilson's interval over items.
Each criterion is compared with REAP at the same cut by the paired bootstrap of REAP's advantage (the other's
perplexity minus REAP's; REAP's rate minus the other's), over the windows, headers or problems. REAP counts as
ahead (behind) beyond the noise only where that interval lies wholly above (below) 0 and, for the two rates, the
exact sign test of the per-item differences (McNemar's exact test for one seed) also gives p < 0.05. Random is
pooled over its seeds: its value is the mean over seeds, its bootstrap resamples the seeds (with replacement) as
well as the items, so the seed-to-seed spread widens its intervals; its Wilson interval is that of the mean pass
count over the items, its sign test compares REAP with the seeds' mean per item, and the seeds' range is shown.

Writes `report.json` (the calibration), `retention.json` (settings, per-item results of every model, summaries,
comparisons, verdicts, timings), `retention.md` (the README tables and verdicts) and `retention.png` (code and prose
perplexity against the cut with their intervals, one line per criterion) into `--out`. `--ship DIR` copies the
64.3 % REAP prune to DIR after `reap_tools verify` has checked it bit-exact against the parent; the default is not to
ship (nothing is written outside `--out`); demo/reap40 was made with `--ship demo/reap40`. `--quick` (one cut, one
random seed, a few windows, headers and problems) smoke-tests the script end to end; its numbers mean nothing.
Nothing here was tuned on the evaluation: the settings above were fixed before any run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from demo_build.eval_demo import (HEADER_TOKENS, _sha, complete, completion_parses, function_headers, load,
                                  windows)
from demo_build.exec_eval import PROBLEMS, pass_at_1, sign_test, wilson_interval
from reap_tools.observe import observe
from reap_tools.plan import plan_selection
from reap_tools.prune import prune_checkpoint
from reap_tools.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]

SEQ_LEN = 512
CRITERIA = ("reap", "frequency", "ean", "random")
CUTS = (("50 %", 1 / 2), ("64.3 %", 320 / 896), ("80 %", 1 / 5))  # (name, share of the experts kept)
SHIP_CUT = "64.3 %"
QUICK = dict(calib_windows=8, eval_windows=8, headers=8, problems=8, seeds=1)
RESAMPLES = 1000
EXEC_TOKENS = 128
SPLITS = ("code", "prose")
RATES = (("validity", "valid Python"), ("exec", "exec pass@1"))


def validity(model, tokenizer, headers, batch_size) -> list[bool]:
    """Per header: does the greedy completion of the header (+ newline) parse."""
    prompts = [h + "\n" for h in headers]
    return [completion_parses(p, text, ended)
            for p, (text, ended) in zip(prompts, complete(model, tokenizer, prompts, HEADER_TOKENS, batch_size))]


@torch.no_grad()
def evaluate(model, tokenizer, eval_windows, headers, problems, batch_size, gen_batch_size) -> dict:
    """Per-item results: mean NLL and accuracy of each window per split, parse / pass of each header / problem."""
    row, seconds = {}, {}
    for source, w in eval_windows.items():
        t0 = time.time()
        nll, correct = [], []
        for start in range(0, len(w), batch_size):
            x = torch.from_numpy(w[start : start + batch_size])
            logits = model(x).logits[:, :-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
                       .double().mean(1))
            correct.append((logits.argmax(-1) == x[:, 1:]).double().mean(1))
        row[f"{source}_nll"] = torch.cat(nll).tolist()
        row[f"{source}_acc"] = torch.cat(correct).tolist()
        seconds[source] = time.time() - t0
    t0 = time.time()
    row["validity"] = validity(model, tokenizer, headers, gen_batch_size)
    seconds["validity"] = time.time() - t0
    t0 = time.time()
    row["exec"] = pass_at_1(model, tokenizer, problems, EXEC_TOKENS, gen_batch_size)
    seconds["exec"] = time.time() - t0
    row["seconds"] = seconds
    return row


def file_start_windows(ids: np.ndarray, count: int, separator: int, seq_len=SEQ_LEN) -> np.ndarray:
    """`count` windows that each begin at a file's first token (the split's start, or the token after a
    `<|end_of_msg|>` separator), spread evenly over the files; a window runs on into the next file where its own
    is shorter than `seq_len`."""
    starts = np.concatenate([[0], np.flatnonzero(ids[:-1] == separator) + 1])
    starts = starts[starts + seq_len <= ids.size]
    if count > starts.size:
        raise SystemExit(f"train_code.npy: {count} calibration windows at file starts asked, "
                         f"{starts.size} files start {seq_len} tokens before its end")
    pick = starts[np.linspace(0, starts.size - 1, count).round().astype(np.int64)]
    return np.stack([ids[s : s + seq_len] for s in pick]).astype(np.int64)


def calibration_windows(ids: np.ndarray, count: int, at: str, separator: int) -> np.ndarray:
    """The calibration windows of `--calib-at`: at files' first tokens ("file-starts"), or spread evenly over the
    split wherever they fall ("anywhere")."""
    return file_start_windows(ids, count, separator) if at == "file-starts" else windows(ids, count, SEQ_LEN)


def calibration_batches(w: np.ndarray, batch_size: int):
    return [{"input_ids": torch.from_numpy(w[i : i + batch_size]),
             "attention_mask": torch.ones(len(w[i : i + batch_size]), SEQ_LEN, dtype=torch.long)}
            for i in range(0, len(w), batch_size)]


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


METRICS = {  # metric -> (per-item key of an evaluation row, the items it is over, statistic of their mean)
    "code_ppl": ("code_nll", "code", np.exp), "prose_ppl": ("prose_nll", "prose", np.exp),
    "code_acc": ("code_acc", "code", None), "prose_acc": ("prose_acc", "prose", None),
    "validity": ("validity", "headers", None), "exec": ("exec", "problems", None),
}


class Bootstrap:
    """Fixed resamples of every item set (and of the seeds), shared by all models so that differences are paired."""

    def __init__(self, sizes: dict[str, int], seeds: int, resamples=RESAMPLES, seed=0):
        rng = np.random.default_rng(seed)
        self.items = {key: rng.integers(0, n, size=(resamples, n)) for key, n in sorted(sizes.items())}
        self.seeds = rng.random((resamples, seeds))  # a group of S seeds draws seed floor(u * S) for each u

    def draws(self, rows: list[dict], metric: str) -> tuple[float, np.ndarray]:
        """The metric of a group of seeds (the mean over them) and its value in each resample."""
        key, items, stat = METRICS[metric]
        f = stat or (lambda v: v)
        values = np.asarray([r[key] for r in rows], dtype=np.float64)  # [seeds, items]
        point = float(np.mean([f(v.mean()) for v in values]))
        per_seed = f(values[:, self.items[items]].mean(-1))  # [seeds, resamples]
        if len(rows) == 1:
            return point, per_seed[0]
        picks = (self.seeds[:, : len(rows)] * len(rows)).astype(int)  # [resamples, seeds]
        return point, per_seed[picks.T, np.arange(per_seed.shape[1])].mean(0)


def interval(draws: np.ndarray) -> list[float]:
    return [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]


def summarise(rows, parent_rows, boot) -> dict:
    """Point values, intervals, retention vs the parent and the seeds' spread of one (criterion, cut)."""
    out = {"seeds": [r["seed"] for r in rows]}
    for metric in METRICS:
        point, draws = boot.draws(rows, metric)
        entry = {"value": point, "ci": interval(draws)}
        if metric.endswith("ppl"):
            parent, parent_draws = boot.draws(parent_rows, metric)
            entry["retention"] = 100 * parent / point
            entry["retention_ci"] = interval(100 * parent_draws / draws)
        if metric in dict(RATES):
            n = len(rows[0][metric])
            entry["k"] = float(np.mean([sum(r[metric]) for r in rows]))
            entry["n"] = n
            entry["ci"] = list(wilson_interval(entry["k"], n))
        if len(rows) > 1:
            seed_values = [boot.draws([r], metric)[0] for r in rows]
            entry["seed_values"] = seed_values
            entry["seed_sd"] = float(np.std(seed_values, ddof=1))
        out[metric] = entry
    return out


def compare(rows, reap_rows, boot) -> dict:
    """REAP's advantage over `rows` at the same cut (> 0: REAP better), its paired interval and its verdict: beyond
    the noise where the interval excludes 0, and for the two rates also the exact sign test says p < 0.05 (the
    percentile bootstrap of a few discordant pass/fail pairs is too narrow on its own)."""
    out = {}
    for metric in METRICS:
        value, draws = boot.draws(rows, metric)
        reap, reap_draws = boot.draws(reap_rows, metric)
        sign = 1 if metric.endswith("ppl") else -1  # lower perplexity is better, higher rates are
        advantage, ci = sign * (value - reap), interval(sign * (draws - reap_draws))
        entry = {"advantage": advantage, "ci": ci}
        resolved = True
        if metric in dict(RATES):
            per_item = np.asarray(reap_rows[0][metric], dtype=float) - np.mean([r[metric] for r in rows], axis=0)
            entry["sign_test_p"] = sign_test(per_item)
            resolved = entry["sign_test_p"] < 0.05
        entry["verdict"] = ("ahead" if ci[0] > 0 and resolved else "behind" if ci[1] < 0 and resolved
                            else "within noise")
        out[metric] = entry
    return out


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def _ci(entry, fmt):
    lo, hi = entry["ci"]
    return f"{fmt.format(entry['value'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _seeds(entry, fmt, scale=1):
    """The seeds' range of a pooled random entry ("" for one model)."""
    if "seed_values" not in entry:
        return ""
    lo, hi = (fmt.format(scale * f(entry["seed_values"])) for f in (min, max))
    return f"; seeds {lo}" if lo == hi else f"; seeds {lo}–{hi}"


def _rate(entry):
    lo, hi = entry["ci"]
    k = f"{entry['k']:g}" if float(entry["k"]).is_integer() else f"{entry['k']:.1f}"
    return f"{k}/{entry['n']} = {entry['value']:.0%} [{lo:.0%}, {hi:.0%}]" + _seeds(entry, "{:.0f}", entry["n"])


def _name(criterion, summary):
    seeds = len(summary["seeds"])
    return f"random ({seeds} seeds, mean)" if criterion == "random" and seeds > 1 else criterion


def retention_table(groups) -> list[str]:
    lines = ["| cut | model | experts kept | code ppl | code retention | prose ppl | prose retention | code acc | "
             "prose acc | valid Python | exec pass@1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (cut, criterion, kept), s in groups.items():
        cells = [cut, _name(criterion, s), str(kept)]
        for split in SPLITS:
            ppl = s[f"{split}_ppl"]
            lo, hi = ppl["retention_ci"]
            cells += [_ci(ppl, "{:.2f}") + _seeds(ppl, "{:.2f}"), f"{ppl['retention']:.1f} % [{lo:.1f}, {hi:.1f}]"]
        cells += [_ci(s[f"{split}_acc"], "{:.3f}") for split in SPLITS]
        cells += [_rate(s[metric]) for metric, _ in RATES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _advantage(entry, fmt, scale=1, unit=""):
    value, lo, hi = (fmt.format(round(scale * v, 9) + 0.0) for v in (entry["advantage"], *entry["ci"]))
    mark = {"ahead": " **ahead**", "behind": " **behind**", "within noise": ""}[entry["verdict"]]
    return f"{value} [{lo}, {hi}]{unit}{mark}"


def comparison_table(comparisons) -> list[str]:
    lines = ["| cut | REAP vs | code ppl | prose ppl | code acc | prose acc | valid Python | exec pass@1 |",
             "|---|---|---|---|---|---|---|---|"]
    for (cut, criterion), c in comparisons.items():
        cells = [cut, criterion, _advantage(c["code_ppl"], "{:+.2f}"), _advantage(c["prose_ppl"], "{:+.2f}"),
                 _advantage(c["code_acc"], "{:+.3f}"), _advantage(c["prose_acc"], "{:+.3f}")]
        for metric, _ in RATES:
            cells.append(_advantage(c[metric], "{:+.0f}", 100, " pp") + f" (p {c[metric]['sign_test_p']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


VERDICT_METRICS = (("code_ppl", "code perplexity"), ("prose_ppl", "prose perplexity"), ("code_acc", "code accuracy"),
                   ("prose_acc", "prose accuracy"), ("validity", "valid Python"), ("exec", "exec pass@1"))


def verdicts(comparisons, cuts, num_experts) -> dict[str, str]:
    """Plain text per cut: on which metric REAP is ahead of which criterion beyond the noise, behind, or neither."""
    out = {}
    for cut, kept in cuts:
        others = [criterion for c_cut, criterion in comparisons if c_cut == cut]
        found = {"ahead": [], "behind": [], "within noise": []}
        for metric, label in VERDICT_METRICS:
            for verdict in found:
                criteria = [c for c in others if comparisons[(cut, c)][metric]["verdict"] == verdict]
                if criteria:
                    names = "all" if len(criteria) == len(others) > 1 else ", ".join(criteria)
                    found[verdict].append(f"{label} (vs {names})")
        out[cut] = (f"{cut} cut ({kept} of {num_experts} kept). REAP ahead beyond the noise: "
                    f"{', '.join(found['ahead']) or 'nowhere'}. REAP behind beyond the noise: "
                    f"{', '.join(found['behind']) or 'nowhere'}. Within the noise: "
                    f"{', '.join(found['within noise']) or 'nothing'}.")
    return out


def markdown(groups, comparisons, verdict, settings) -> str:
    seeds = settings["seeds"]
    lines = retention_table(groups)
    lines += ["", "REAP's advantage over each criterion at the same cut (other's perplexity − REAP's; REAP's "
              "accuracy or rate − the other's; > 0 = REAP better), paired 95 % bootstrap interval; **ahead** / "
              "**behind** = the interval excludes 0 (and for the rates p < 0.05):", ""]
    lines += comparison_table(comparisons)
    pooling = (f"Random is the mean over {seeds} seeds: its bootstrap resamples the seeds as well as the items, its "
               "Wilson interval is that of the mean count, and the seeds' range follows it."
               if seeds > 1 else "Random is one seed (0).")
    lines += ["", *[f"- {v}" for v in verdict.values()], "",
              f"Intervals are 95 %. Perplexity, retention and accuracy: bootstrap over the {settings['eval_windows']} "
              f"held-out windows of 512 tokens per split ({RESAMPLES} resamples, the same for every model). Valid "
              f"Python ({settings['headers']} headers) and exec pass@1 ({settings['problems']} problems): Wilson's "
              "interval; their differences by the paired bootstrap over the headers or problems, and p is the exact "
              "sign test of the per-item differences (McNemar's exact test for one seed), which must also be < 0.05 "
              f"for **ahead** / **behind**. {pooling}"]
    return "\n".join(lines) + "\n"


def plot(groups, parent, num_experts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for k, criterion in enumerate(CRITERIA):
        points = sorted((100 * (1 - kept / num_experts), s) for (_, c, kept), s in groups.items() if c == criterion)
        points = [(0.0, parent)] + points
        for ax, split in zip(axes, SPLITS):
            xs = [x + 0.6 * (k - 1.5) for x, _ in points]
            ys = [s[f"{split}_ppl"]["value"] for _, s in points]
            err = np.array([[y - s[f"{split}_ppl"]["ci"][0], s[f"{split}_ppl"]["ci"][1] - y]
                            for y, (_, s) in zip(ys, points)]).T
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=criterion)
    for ax, split in zip(axes, SPLITS):
        ax.set_title(f"held-out {split}")
        ax.set_xlabel("routed experts removed (%)")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("bars: each model's own 95 % bootstrap interval over windows; criteria are compared paired "
                 "(retention.md)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def cut_plan(num_experts: int, quick: bool) -> list[tuple[str, int]]:
    cuts = [(name, round(num_experts * share)) for name, share in CUTS]
    return [c for c in cuts if c[0] == SHIP_CUT] if quick else cuts


def ship(pruned_dir: Path, parent: str, target: str) -> None:
    verdict = verify_checkpoint(pruned_dir, source=parent, progress=False)
    if not verdict.ok:
        raise SystemExit(f"the {SHIP_CUT} REAP prune does not verify: {verdict.summary()}")
    dst, staged = Path(target), Path(target + ".partial")
    shutil.copytree(pruned_dir, staged)
    if dst.exists():
        shutil.rmtree(dst)
    os.rename(staged, dst)
    print(f"shipped {dst}: {verdict.summary()}")


def _brief(name, row, seconds):
    values = {f"{s}_ppl": round(math.exp(np.mean(row[f"{s}_nll"])), 3) for s in SPLITS}
    values.update({m: f"{sum(row[m])}/{len(row[m])}" for m, _ in RATES})
    print(f"{name}: {values}; {seconds['total']:.0f} s "
          f"({', '.join(f'{k} {v:.0f}' for k, v in seconds.items() if k != 'total')})", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--out", default=str(ROOT / "retention" / "results"))
    parser.add_argument("--ship", default=None,
                        help=f"copy the verified {SHIP_CUT.replace('%', '%%')} REAP prune here (default: no copy)")
    parser.add_argument("--calib-windows", type=int, default=1024, help="calibration windows of 512 (train code)")
    parser.add_argument("--calib-at", choices=("file-starts", "anywhere"), default="file-starts",
                        help="where the calibration windows start: at files' first tokens, or spread over the split")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows of 512 per split")
    parser.add_argument("--headers", type=int, default=50, help="held-out function headers for valid Python")
    parser.add_argument("--problems", type=int, default=len(PROBLEMS), help="exec_eval problems (the first N)")
    parser.add_argument("--seeds", type=int, default=3, help="random-criterion seeds at each cut")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    parser.add_argument("--gen-batch-size", type=int, default=50, help="prompts per greedy batch")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the forwards (0 = torch's; 1 where another job shares the cores: two "
                             "contended threads ran them ~40x slower); greedy decoding always runs on one")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: one cut, {QUICK}")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.quick:
        if args.ship:
            raise SystemExit("--quick does not ship: its calibration is a smoke test")
        vars(args).update(QUICK)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data, out = Path(args.data), Path(args.out)
    if _sha(Path(args.parent) / "tiktoken.model") != _sha(data / "tiktoken.model"):
        raise SystemExit(f"{data}/tiktoken.model is not the parent's vocabulary: re-run demo_build.prepare_corpus")
    text_config = json.loads((Path(args.parent) / "config.json").read_text())["text_config"]
    num_experts = int(text_config["num_experts"])
    cuts = cut_plan(num_experts, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(args.parent)
    eval_windows = {s: windows(np.load(data / f"val_{s}.npy"), args.eval_windows, SEQ_LEN) for s in SPLITS}
    headers = function_headers(tokenizer, np.load(data / "val_code.npy"), args.headers)
    if len(headers) < args.headers:
        raise SystemExit(f"only {len(headers)} function headers in the held-out code, {args.headers} asked")
    problems = PROBLEMS[: args.problems]
    settings = dict(vars(args), num_experts=num_experts, top_k=int(text_config["num_experts_per_token"]),
                    cuts=cuts, resamples=RESAMPLES, header_tokens=HEADER_TOKENS, exec_tokens=EXEC_TOKENS,
                    eval_windows=len(eval_windows["code"]), threads=torch.get_num_threads())

    t0 = time.time()
    train_code = np.load(data / "train_code.npy")
    calib = calibration_windows(train_code, args.calib_windows, args.calib_at, model.config.eos_token_id)
    report = observe(model, calibration_batches(calib, args.batch_size), name_or_path=args.parent, progress=False,
                     calibration={"source": "train_code.npy", "windows": args.calib_windows, "at": args.calib_at,
                                  "seq_len": SEQ_LEN})
    (out / "report.json").write_text(json.dumps(report))
    observe_s = time.time() - t0
    print(f"observed {args.calib_windows} x {SEQ_LEN} calibration tokens in {observe_s:.0f} s", flush=True)
    t0 = time.time()
    parent = dict(criterion="parent", num_experts=num_experts, seed=0,
                  **evaluate(model, tokenizer, eval_windows, headers, problems, args.batch_size, args.gen_batch_size))
    parent["seconds"]["total"] = time.time() - t0
    _brief("parent", parent, parent["seconds"])
    del model

    runs = []
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for cut, kept in cuts:
            for criterion in CRITERIA:
                for seed in range(args.seeds if criterion == "random" else 1):
                    t0 = time.time()
                    selection = plan_selection(report, num_experts=kept, criterion=criterion, seed=seed)
                    name = f"{criterion}-{kept}-s{seed}"
                    pruned_dir = Path(tmp) / name
                    prune_checkpoint(args.parent, selection, pruned_dir, progress=False)
                    t1 = time.time()
                    pruned, _ = load(pruned_dir)
                    t2 = time.time()
                    row = dict(criterion=criterion, cut=cut, num_experts=kept, seed=seed,
                               **evaluate(pruned, tokenizer, eval_windows, headers, problems, args.batch_size,
                                          args.gen_batch_size))
                    del pruned
                    row["seconds"].update(prune=t1 - t0, load=t2 - t1, total=time.time() - t0)
                    runs.append(row)
                    _brief(name, row, row["seconds"])
                    if args.ship and (cut, criterion) == (SHIP_CUT, "reap"):
                        ship(pruned_dir, args.parent, args.ship)
                    shutil.rmtree(pruned_dir)

    sizes = {items: len(parent[key]) for key, items, _ in METRICS.values()}
    boot = Bootstrap(sizes, max(1, args.seeds))
    groups, comparisons = {("—", "parent", num_experts): summarise([parent], [parent], boot)}, {}
    for cut, kept in cuts:
        by = {c: [r for r in runs if r["cut"] == cut and r["criterion"] == c] for c in CRITERIA}
        for criterion, rows in by.items():
            groups[(cut, criterion, kept)] = summarise(rows, [parent], boot)
            if criterion != "reap":
                comparisons[(cut, criterion)] = compare(rows, by["reap"], boot)
    verdict = verdicts(comparisons, cuts, num_experts)
    table = markdown(groups, comparisons, verdict, settings)
    timings = {"observe": observe_s, "parent": parent["seconds"],
               "runs": {f"{r['criterion']}-{r['num_experts']}-s{r['seed']}": r["seconds"] for r in runs}}
    (out / "retention.json").write_text(json.dumps({
        "settings": settings, "headers": headers, "problems": [p.name for p in problems],
        "parent": parent, "runs": runs,
        "summary": [dict(cut=c, criterion=k, num_experts=n, **s) for (c, k, n), s in groups.items()],
        "comparisons_vs_reap": [dict(cut=c, criterion=k, **v) for (c, k), v in comparisons.items()],
        "verdicts": verdict, "timings": timings}, indent=1) + "\n")
    (out / "retention.md").write_text(table)
    plot(groups, groups[("—", "parent", num_experts)], num_experts, out / "retention.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
