"""Choose which routed experts each MoE layer keeps, from an `observe` saliency report.

    python -m reap_tools plan REPORT.json [-n 320 | --budget B [--min-per-layer F]]
        [--criterion reap|frequency|ean|random] [--seed 0] [--protect-super K]
        [--checkpoint DIR] [--allow-incomplete] [-o reap_selection.json]
        [--heatmap reap_selection.png | --no-heatmap]

Saliency report (written by `observe`), JSON:

    {"format": "reap-saliency/1",                # optional; another value is refused
     "model": {"name_or_path": str, "revision": str | null, "num_hidden_layers": int,
               "num_experts": int, "num_experts_per_token": int, "moe_layers": [int, ...],
               "num_experts_per_layer": [int, ...]   # optional, for an already non-uniform model
              },
     "calibration": {"files": [...], "num_tokens": int, "seq_len": int, ...},   # free-form, kept
     "progress": {"sequences_done": int, "total_sequences": int, "complete": bool},  # optional
     "layers": {"<i>": {"count": [E], "reap_sum": [E], "ean_sum": [E], "max_norm": [E]}, ...}}

A report whose progress.complete is false (an interrupted observe) is refused unless
--allow-incomplete; extra keys are ignored. A malformed report (a layer that is null, a count that is not a
number) is refused in one line naming the key. Infinite entries, and layers where every expert scores 0 by the
criterion, still plan, with a warning on stderr: the first rank above everything else, the second keep their lowest
expert ids, and neither is a saliency ranking.

per MoE layer i and expert j: count = tokens routed to j (padding excluded), reap_sum = sum over
those tokens of g_j(x)·||f_j(x)||₂ (g the renormalised sigmoid weight the model applies, f the
latent expert output), ean_sum = sum of ||f_j(x)||₂, max_norm = max ||f_j(x)||₂.

Scores per criterion: reap = reap_sum / count (0 where count is 0; the REAP score), frequency = count,
ean = ean_sum, random = uniform draws from a generator seeded by (seed, layer). Ties go to the
lower expert id.

Keep rules:
- uniform (default): every MoE layer keeps its top N (N >= top-k, N <= the layer's experts).
- budget B: B experts in total over the MoE layers. Each layer first gets its floor
  (--min-per-layer, default and minimum top-k): its protected experts, then its best by score.
  The rest of the budget goes to the highest *normalised* scores across all layers, where
  normalised = score / mean score of that layer, so a layer whose saliency is spread over many
  experts keeps more of them than one dominated by a few. SGLang and vLLM read one
  text_config.num_experts for every layer: such a checkpoint runs only with this package's remote
  code, which plan says on stderr whenever --budget is given.
- --protect-super K: the K experts of each layer with the largest max_norm ("super experts",
  rare but huge activations) are always kept, counted inside N / the floor.

Output reap_selection.json:

    {"format": "reap-selection/1", "criterion": str, "mode": "uniform" | "budget",
     "num_experts": N (uniform) | "budget": B, "min_per_layer": F (budget),
     "protect_super": K, "seed": int,
     "model": {...the report's model block...},
     "source_report": {"path": str, "sha256": str, "calibration": {...}},
     "layers": {"<i>": [kept original expert ids, ascending], ...}}

and a PNG heat map (MoE layers x experts, log score / layer max, kept experts in colour and
dropped ones in grey, kept count per layer alongside). With --checkpoint the report is checked against that checkpoint's
config.json first (a report from another model is refused).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, experts_per_layer, read_config, text_config, write_json
from .cli import ArgumentParser, check_writable, fail, int_at_least
from .model_config import model_text_config

CRITERIA = ("reap", "frequency", "ean", "random")
REPORT_FORMAT = "reap-saliency/1"
FIELDS = ("count", "reap_sum", "ean_sum", "max_norm")
DEFAULT_N = 320


class PlanError(ValueError):
    """The report or the requested plan is invalid; the message says which layer/field."""


def load_report(path: str | Path, *, allow_incomplete: bool = False) -> dict:
    """Read a saliency report and check its schema (see the module docstring)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read report {path}: {e}") from e
    validate_report(report, allow_incomplete=allow_incomplete)
    return report


def report_experts(report: dict) -> dict[int, int]:
    """Expert count of every MoE layer the report's model declares."""
    model = report["model"]
    per_layer = model.get("num_experts_per_layer")
    return {i: int(per_layer[i]) if per_layer else int(model["num_experts"]) for i in model["moe_layers"]}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_report(report: dict, *, allow_incomplete: bool = False) -> None:
    if not isinstance(report, dict):
        raise PlanError("report is not a JSON object")
    if report.get("format", REPORT_FORMAT) != REPORT_FORMAT:
        raise PlanError(f"report format is {report['format']!r}, expected {REPORT_FORMAT!r}")
    progress = report.get("progress") or {}
    if progress.get("complete") is False and not allow_incomplete:
        raise PlanError(f"report is incomplete ({progress.get('sequences_done')} of {progress.get('total_sequences')} "
                        f"sequences observed); finish `observe --resume` or pass --allow-incomplete")
    model = report.get("model")
    if not isinstance(model, dict):
        raise PlanError("report has no 'model' object")
    for key in ("num_hidden_layers", "num_experts", "num_experts_per_token", "moe_layers"):
        if key not in model:
            raise PlanError(f"report model block lacks {key!r}")
    if not isinstance(report.get("layers"), dict):
        raise PlanError("report has no 'layers' object")
    for key in ("num_hidden_layers", "num_experts", "num_experts_per_token"):
        if not _is_count(model[key]):
            raise PlanError(f"report model {key!r} must be a whole number >= 0, got {model[key]!r}")
    moe_layers = model["moe_layers"]
    if not isinstance(moe_layers, list) or not all(_is_count(i) for i in moe_layers):
        raise PlanError(f"report model 'moe_layers' must be a list of layer numbers, got {moe_layers!r}")
    per_layer = model.get("num_experts_per_layer")
    if per_layer is not None and (not isinstance(per_layer, list) or not all(_is_count(n) for n in per_layer)):
        raise PlanError(f"report model 'num_experts_per_layer' must be a list of whole numbers, got {per_layer!r}")
    if per_layer is not None and len(per_layer) != int(model["num_hidden_layers"]):
        raise PlanError(f"report num_experts_per_layer has {len(per_layer)} entries, "
                        f"num_hidden_layers is {model['num_hidden_layers']}")
    if per_layer and max(moe_layers, default=0) >= len(per_layer):
        raise PlanError(f"report moe_layers {moe_layers} go past num_experts_per_layer ({len(per_layer)} entries)")
    counts = report_experts(report)
    try:
        have = {int(k) for k in report["layers"]}
    except ValueError as e:
        raise PlanError(f"report layer keys must be layer numbers: {e}") from e
    if have != set(counts):
        raise PlanError(f"report layers {sorted(have)} != its model's moe_layers {sorted(counts)}")
    for i, n in counts.items():
        stats = report["layers"][str(i)]
        if not isinstance(stats, dict):
            raise PlanError(f"report layer {i}: expected an object with {', '.join(FIELDS)}, got {stats!r:.40}")
        for key in FIELDS:
            values = stats.get(key)
            if not isinstance(values, list) or len(values) != n:
                raise PlanError(f"report layer {i}: {key!r} must be a list of {n} numbers")
            if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v for v in values):
                raise PlanError(f"report layer {i}: {key!r} has negative, NaN or non-numeric entries")


def report_warnings(report: dict, criterion: str) -> list[str]:
    """What makes a validated report a poor basis for a plan, though one can be made: infinite entries (they rank
    above everything), and layers where every expert scores 0 by `criterion` (they keep their lowest ids)."""
    warnings = []
    for i in sorted(report_experts(report)):
        for key in FIELDS:
            inf = [j for j, v in enumerate(report["layers"][str(i)][key]) if v == float("inf")]
            if inf:
                warnings.append(f"report layer {i}: {key!r} is infinite for experts {inf[:8]}"
                                f"{' ...' if len(inf) > 8 else ''} (an overflow in observe?); they rank first")
    if criterion != "random":
        zero = [i for i, s in sorted(expert_scores(report, criterion).items()) if not np.any(s)]
        if zero:
            warnings.append(f"every expert of layers {zero} scores 0 by {criterion} (nothing was routed to them?): "
                            f"those layers keep the lowest expert ids")
    return warnings


def check_report_matches(report: dict, config: dict) -> None:
    """Refuse a report taken on another model than the checkpoint the plan is for."""
    tc = text_config(config)
    model = report["model"]
    top_k = model_text_config(config).num_experts_per_token
    if int(model["num_hidden_layers"]) != int(tc["num_hidden_layers"]):
        raise PlanError(f"report is for a model with {model['num_hidden_layers']} layers, "
                        f"the checkpoint has {tc['num_hidden_layers']}")
    if int(model["num_experts_per_token"]) != top_k:
        raise PlanError(f"report is for top-{model['num_experts_per_token']}, the checkpoint routes top-{top_k}")
    want, have = experts_per_layer(tc), report_experts(report)
    if set(want) != set(have):
        raise PlanError(f"report MoE layers {sorted(have)} != checkpoint MoE layers {sorted(want)}")
    for i in sorted(want):
        if want[i] != have[i]:
            raise PlanError(f"layer {i}: report has {have[i]} experts, the checkpoint has {want[i]} "
                            f"(report from another model?)")


def expert_scores(report: dict, criterion: str, seed: int = 0) -> dict[int, np.ndarray]:
    """Per-layer score vectors for a criterion (higher = keep first)."""
    if criterion not in CRITERIA:
        raise PlanError(f"unknown criterion {criterion!r}; choose from {', '.join(CRITERIA)}")
    scores = {}
    for i, n in report_experts(report).items():
        stats = {k: np.asarray(v, dtype=np.float64) for k, v in report["layers"][str(i)].items() if k in FIELDS}
        if criterion == "reap":
            count = stats["count"]
            scores[i] = np.divide(stats["reap_sum"], count, out=np.zeros(n), where=count > 0)
        elif criterion == "frequency":
            scores[i] = stats["count"]
        elif criterion == "ean":
            scores[i] = stats["ean_sum"]
        else:
            scores[i] = np.random.default_rng([seed, i]).random(n)
    return scores


def _ranked(values: np.ndarray) -> list[int]:
    """Indices by descending value, ties to the lower index."""
    return [int(j) for j in np.lexsort((np.arange(len(values)), -values))]


def _initial(scores: np.ndarray, norms: np.ndarray, n: int, protect: int) -> list[int]:
    """Protected experts (top `protect` by max norm), then the best by score, up to n in all."""
    chosen = _ranked(norms)[:protect]
    protected = set(chosen)
    rest = [j for j in _ranked(scores) if j not in protected]
    return chosen + rest[:max(0, n - len(chosen))]


NON_UNIFORM_NOTE = ("note: the layers keep different numbers of experts. Transformers (this repo's remote code) "
                    "loads that; SGLang and vLLM size every MoE layer from one num_experts and do not: only uniform "
                    "prunes (-n N) serve there.")
# said on stderr before planning whenever --budget is given (the note above follows a non-uniform result)
NON_UNIFORM_WARNING = ("--budget keeps different numbers of experts per layer; SGLang and vLLM read one "
                       "text_config.num_experts for every layer, so such a checkpoint runs only with this package's "
                       "remote code (transformers, trust_remote_code=True). Plan with -n N to serve it there.")


def plan_selection(report: dict, *, num_experts: int | None = None, budget: int | None = None,
                   min_per_layer: int | None = None, criterion: str = "reap", seed: int = 0,
                   protect_super: int = 0, report_path: str | Path | None = None) -> dict:
    """Build the selection dict (schema in the module docstring) from a validated report."""
    model = report["model"]
    top_k = int(model["num_experts_per_token"])
    experts = report_experts(report)
    scores = expert_scores(report, criterion, seed)
    norms = {i: np.asarray(report["layers"][str(i)]["max_norm"], dtype=np.float64) for i in experts}
    if protect_super < 0:
        raise PlanError("--protect-super must be >= 0")
    selection = {"format": "reap-selection/1", "criterion": criterion}
    if budget is None:
        n = DEFAULT_N if num_experts is None else num_experts
        if n < top_k:
            raise PlanError(f"keeping {n} experts per layer is fewer than top-k = {top_k}")
        for i, e in experts.items():
            if n > e:
                raise PlanError(f"keeping {n} experts per layer, but layer {i} has only {e}")
        if protect_super > n:
            raise PlanError(f"--protect-super {protect_super} is more than the {n} experts kept per layer")
        kept = {i: _initial(scores[i], norms[i], n, protect_super) for i in experts}
        selection.update(mode="uniform", num_experts=n)
    else:
        if num_experts is not None:
            raise PlanError("give either a per-layer count or a total budget, not both")
        floor = top_k if min_per_layer is None else min_per_layer
        if floor < top_k:
            raise PlanError(f"--min-per-layer {floor} is fewer than top-k = {top_k}")
        for i, e in experts.items():
            if floor > e:
                raise PlanError(f"--min-per-layer {floor}, but layer {i} has only {e} experts")
        kept = {i: _initial(scores[i], norms[i], floor, protect_super) for i in experts}
        lowest, highest = sum(map(len, kept.values())), sum(experts.values())
        if not lowest <= budget <= highest:
            raise PlanError(f"budget {budget} must be between {lowest} (the per-layer floors) and {highest} "
                            f"(every expert) for {len(experts)} MoE layers")
        candidates = []
        for i in experts:
            mean = scores[i].mean()
            with np.errstate(invalid="ignore"):
                normed = scores[i] / mean if mean > 0 else np.zeros_like(scores[i])
            normed = np.where(np.isinf(scores[i]), np.inf, np.nan_to_num(normed, nan=0.0))
            taken = set(kept[i])
            candidates += [(-normed[j], i, j) for j in range(experts[i]) if j not in taken]
        for _, i, j in sorted(candidates)[:budget - lowest]:
            kept[i].append(j)
        selection.update(mode="budget", budget=budget, min_per_layer=floor)
    selection.update(protect_super=protect_super, seed=seed, model=model)
    source = {"calibration": report.get("calibration")}
    if report_path is not None:
        source = {"path": str(report_path), "sha256": hashlib.sha256(Path(report_path).read_bytes()).hexdigest(),
                  **source}
    selection["source_report"] = source
    selection["layers"] = {str(i): sorted(kept[i]) for i in sorted(kept)}
    return selection


HEATMAP_DECADES = 3  # the heat map shows score / layer max on a log scale down to 10^-3


def write_heatmap(report: dict, selection: dict, path: str | Path, seed: int = 0) -> None:
    """PNG: MoE layers x experts, log(score / layer max); kept in colour, dropped in grey. Written atomically.

    Saliency is heavy-tailed, so a log scale per layer shows structure a linear one hides; the
    random criterion shows REAP scores. A bar panel gives the kept count of each layer.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colors

    criterion = selection["criterion"]
    shown = "reap" if criterion == "random" else criterion
    scores = expert_scores(report, shown, seed)
    layers = sorted(scores)
    width = max(len(s) for s in scores.values())
    lo = 10.0 ** -HEATMAP_DECADES
    grid = np.full((len(layers), width), np.nan)
    kept = np.zeros((len(layers), width), dtype=bool)
    for r, i in enumerate(layers):
        s = scores[i]
        finite = np.where(np.isinf(s), 0.0, s)
        rel = np.where(np.isinf(s), 1.0, finite / finite.max() if finite.max() > 0 else 0.0)
        grid[r, :len(s)] = 1 + np.log10(np.maximum(rel, lo)) / HEATMAP_DECADES
        kept[r, selection["layers"][str(i)]] = True
    cmap = plt.get_cmap("viridis")
    rgba = cmap(np.nan_to_num(grid))
    grey = rgba[..., :3] @ np.array([0.299, 0.587, 0.114])
    rgba[~kept, :3] = grey[~kept, None]
    rgba[np.isnan(grid)] = (1, 1, 1, 1)
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(16, max(4, 0.09 * len(layers) + 2)), sharey=True,
                                  gridspec_kw={"width_ratios": [12, 1]})
    ax.imshow(rgba, aspect="auto", interpolation="nearest", extent=(-0.5, width - 0.5, len(layers) - 0.5, -0.5))
    ax.set_xlabel("expert id (original)")
    ax.set_ylabel("MoE layer")
    ticks = np.linspace(0, len(layers) - 1, min(len(layers), 12)).round().astype(int)
    ax.set_yticks(ticks, [str(layers[t]) for t in ticks])
    n_kept = kept.sum(1)
    ax.set_title(f"{shown} score / layer max; kept in colour, dropped in grey "
                 f"({criterion}: {int(n_kept.sum())} of {int((~np.isnan(grid)).sum())} experts kept)")
    fig.colorbar(plt.cm.ScalarMappable(colors.LogNorm(lo, 1), cmap), ax=bar, label="score / layer max")
    bar.barh(np.arange(len(layers)), n_kept, color="tab:orange")
    bar.set_xlabel("kept")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")  # the suffix picks the image format
    try:
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m reap_tools plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="saliency report JSON from `observe`")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("-n", "--num-experts", type=int, help=f"experts kept in every MoE layer (default {DEFAULT_N})")
    size.add_argument("--budget", type=int, help="total experts kept over all MoE layers (non-uniform)")
    ap.add_argument("--min-per-layer", type=int, help="per-layer floor with --budget (default: top-k)")
    ap.add_argument("--criterion", choices=CRITERIA, default="reap", help="score to rank experts by (default reap)")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="seed for --criterion random (default 0)")
    ap.add_argument("--protect-super", type=int_at_least(0), default=0, metavar="K",
                    help="always keep the K experts with the largest max activation norm per layer")
    ap.add_argument("--allow-incomplete", action="store_true", help="plan from an interrupted observe report")
    ap.add_argument("--checkpoint", type=Path, help="checkpoint dir (or config.json) the plan is for; "
                                                    "refuses a report from another model")
    ap.add_argument("-o", "--output", type=Path, default=Path("reap_selection.json"), help="selection JSON to write")
    ap.add_argument("--heatmap", type=Path, help="PNG heat map path (default: output with .png)")
    ap.add_argument("--no-heatmap", action="store_true", help="skip the heat map")
    args = ap.parse_args(argv)
    if args.min_per_layer is not None and args.budget is None:
        ap.error("--min-per-layer only applies with --budget")
    if args.heatmap is not None and args.no_heatmap:
        ap.error("--heatmap and --no-heatmap contradict each other")
    heatmap = None if args.no_heatmap else args.heatmap or args.output.with_suffix(".png")
    outputs = [("-o/--output", args.output)] + ([("--heatmap", heatmap)] if heatmap is not None else [])
    for flag, path in outputs:
        if path.resolve() == args.report.resolve():
            ap.error(f"{flag} {path} is the report itself; choose another path")
    if heatmap is not None and heatmap.resolve() == args.output.resolve():
        ap.error(f"--heatmap {heatmap} is the selection output; choose another path")
    if args.budget is not None:
        print(f"plan: warning: {NON_UNIFORM_WARNING}", file=sys.stderr)
    try:
        report = load_report(args.report, allow_incomplete=args.allow_incomplete)
        for warning in report_warnings(report, args.criterion):
            print(f"plan: warning: {warning}", file=sys.stderr)
        if args.checkpoint is not None:
            check_report_matches(report, read_config(args.checkpoint))
        selection = plan_selection(report, num_experts=args.num_experts, budget=args.budget,
                                   min_per_layer=args.min_per_layer, criterion=args.criterion, seed=args.seed,
                                   protect_super=args.protect_super, report_path=args.report)
        for _, path in outputs:
            check_writable(path)
        write_json(args.output, selection)
        counts = sorted({len(v) for v in selection["layers"].values()})
        print(f"wrote {args.output}: {args.criterion}, {len(selection['layers'])} MoE layers keep "
              f"{counts[0] if len(counts) == 1 else f'{counts[0]}..{counts[-1]}'} experts")
        if len(counts) > 1:
            print(NON_UNIFORM_NOTE)
        if heatmap is not None:
            write_heatmap(report, selection, heatmap, args.seed)
            print(f"wrote {heatmap}")
    except (PlanError, CheckpointError, OSError) as e:
        return fail("plan", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
