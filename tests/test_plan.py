"""plan: scores per criterion, uniform / budget keep rules, super-expert protection, bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_prune_verify import make_checkpoint  # noqa: E402

from reap_tools.plan import PlanError, check_report_matches, expert_scores, load_report, plan_selection  # noqa: E402
from reap_tools.prune import prune_checkpoint  # noqa: E402
from reap_tools.verify import verify_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def make_report(layers=(1, 2, 3), experts=16, top_k=2, seed=0, num_hidden_layers=4) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i in layers:
        count = rng.integers(1, 100, experts).astype(float)
        reap = rng.random(experts) * count
        out[str(i)] = {"count": count.tolist(), "reap_sum": reap.tolist(),
                       "ean_sum": (rng.random(experts) * count * 3).tolist(), "max_norm": rng.random(experts).tolist()}
    return {"model": {"name_or_path": "synthetic", "revision": None, "num_hidden_layers": num_hidden_layers,
                      "num_experts": experts, "num_experts_per_token": top_k, "moe_layers": list(layers)},
            "calibration": {"files": ["x.jsonl"], "num_tokens": 1000, "seq_len": 64},
            "layers": out}


def top(values, n):
    return sorted(int(j) for j in np.argsort(-np.asarray(values), kind="stable")[:n])


def test_reap_score_is_mean_weighted_norm_and_zero_when_unrouted():
    report = make_report()
    layer = report["layers"]["1"]
    layer["count"][4], layer["reap_sum"][4] = 0, 0.0
    layer["count"][7], layer["reap_sum"][7] = 1, 1e6  # rare but salient: REAP keeps it, frequency may not
    scores = expert_scores(report, "reap")[1]
    assert scores[4] == 0 and scores[7] == 1e6
    np.testing.assert_allclose(scores[0], layer["reap_sum"][0] / layer["count"][0])
    sel = plan_selection(report, num_experts=5)
    assert 7 in sel["layers"]["1"] and 4 not in sel["layers"]["1"]


@pytest.mark.parametrize("criterion, field", [("frequency", "count"), ("ean", "ean_sum")])
def test_baseline_criteria(criterion, field):
    report = make_report()
    sel = plan_selection(report, num_experts=6, criterion=criterion)
    for i in ("1", "2", "3"):
        assert sel["layers"][i] == top(report["layers"][i][field], 6)


def test_uniform_selection_schema():
    report = make_report()
    sel = plan_selection(report, num_experts=6, report_path=None)
    assert sel["mode"] == "uniform" and sel["num_experts"] == 6 and sel["criterion"] == "reap"
    assert sel["model"]["num_experts"] == 16 and sel["source_report"]["calibration"]["num_tokens"] == 1000
    for i, ids in sel["layers"].items():
        scores = np.asarray(report["layers"][i]["reap_sum"]) / np.asarray(report["layers"][i]["count"])
        assert ids == top(scores, 6) and all(type(e) is int for e in ids)
    json.dumps(sel)


def test_random_is_seeded():
    report = make_report()
    a = plan_selection(report, num_experts=6, criterion="random", seed=1)
    b = plan_selection(report, num_experts=6, criterion="random", seed=1)
    c = plan_selection(report, num_experts=6, criterion="random", seed=2)
    assert a["layers"] == b["layers"] != c["layers"] and a["seed"] == 1


def test_protect_super_keeps_max_norm_experts():
    report = make_report()
    layer = report["layers"]["2"]
    weakest = int(np.argmin(np.asarray(layer["reap_sum"]) / np.asarray(layer["count"])))
    layer["max_norm"][weakest] = 1e9
    assert weakest not in plan_selection(report, num_experts=4)["layers"]["2"]
    sel = plan_selection(report, num_experts=4, protect_super=1)
    assert weakest in sel["layers"]["2"] and len(sel["layers"]["2"]) == 4 and sel["protect_super"] == 1


def test_budget_gives_non_uniform_counts_with_floor():
    report = make_report(experts=16, top_k=2)
    flat, peaked = report["layers"]["1"], report["layers"]["2"]
    flat["count"], flat["reap_sum"] = [10.0] * 16, [10.0] * 16
    peaked["count"] = [10.0] * 16
    peaked["reap_sum"] = [1000.0, 900.0] + [1.0] * 14
    sel = plan_selection(report, budget=24, min_per_layer=3)
    counts = {i: len(ids) for i, ids in sel["layers"].items()}
    assert sum(counts.values()) == 24 and min(counts.values()) >= 3
    assert counts["1"] > counts["2"] and len(set(counts.values())) > 1
    assert sel["mode"] == "budget" and sel["budget"] == 24 and sel["min_per_layer"] == 3
    assert {0, 1} <= set(sel["layers"]["2"])


def test_budget_plan_prunes_to_per_layer_config(tmp_path):
    src = make_checkpoint(tmp_path / "src", experts=8, top_k=2)
    report = make_report(experts=8, top_k=2)
    check_report_matches(report, json.loads((src / "config.json").read_text()))
    sel = plan_selection(report, budget=13)
    counts = [len(sel["layers"][str(i)]) for i in (1, 2, 3)]
    prune_checkpoint(src, sel, tmp_path / "dst", progress=False)
    tc = json.loads((tmp_path / "dst" / "config.json").read_text())["text_config"]
    assert len(set(counts)) > 1 and tc["num_experts_per_layer"] == [0, *counts]  # 13 does not split evenly
    assert tc["num_experts"] == max(counts)
    assert verify_checkpoint(tmp_path / "dst", source=src, progress=False).ok


@pytest.mark.parametrize("kwargs, message", [
    ({"num_experts": 1}, "fewer than top-k"),
    ({"num_experts": 17}, "only 16"),
    ({"num_experts": 4, "protect_super": 5}, "protect-super"),
    ({"budget": 5}, "between 6"),
    ({"budget": 49}, "and 48"),
    ({"budget": 20, "min_per_layer": 1}, "fewer than top-k"),
    ({"budget": 20, "num_experts": 4}, "not both"),
    ({"num_experts": 4, "criterion": "magic"}, "unknown criterion"),
])
def test_bad_plans(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan_selection(make_report(), **kwargs)


def test_report_from_another_model_refused():
    config = {"text_config": {"num_hidden_layers": 4, "num_experts": 16, "num_experts_per_token": 2,
                              "first_k_dense_replace": 1}}
    check_report_matches(make_report(), config)
    with pytest.raises(PlanError, match="32 experts"):
        check_report_matches(make_report(experts=32), config)
    with pytest.raises(PlanError, match="93 layers"):
        check_report_matches(make_report(num_hidden_layers=93), config)
    with pytest.raises(PlanError, match="top-8"):
        check_report_matches(make_report(top_k=8), config)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["layers"].pop("2"), "moe_layers"),
    (lambda r: r["layers"]["1"]["count"].pop(), "list of 16"),
    (lambda r: r["layers"]["3"]["ean_sum"].__setitem__(0, -1.0), "negative"),
    (lambda r: r["model"].pop("num_experts_per_token"), "num_experts_per_token"),
])
def test_malformed_report(tmp_path, edit, message):
    report = make_report()
    edit(report)
    (tmp_path / "r.json").write_text(json.dumps(report))
    with pytest.raises(PlanError, match=message):
        load_report(tmp_path / "r.json")


def test_cli_writes_selection_and_heatmap(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report()))
    out = tmp_path / "sel.json"
    run = subprocess.run([sys.executable, "-m", "reap_tools", "plan", str(report), "-n", "5", "--protect-super", "1",
                          "-o", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    sel = json.loads(out.read_text())
    assert sel["source_report"]["path"] == str(report) and len(sel["source_report"]["sha256"]) == 64
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_cli_refuses_mismatched_checkpoint(tmp_path):
    src = make_checkpoint(tmp_path / "src", experts=8)
    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report(experts=16)))
    run = subprocess.run([sys.executable, "-m", "reap_tools", "plan", str(report), "-n", "4", "--checkpoint", str(src),
                          "-o", str(tmp_path / "sel.json")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and "another model" in run.stderr and not (tmp_path / "sel.json").exists()


def test_incomplete_or_foreign_report(tmp_path):
    report = make_report()
    report["format"] = "reap-saliency/1"
    report["progress"] = {"sequences_done": 3, "total_sequences": 10, "complete": False}
    (tmp_path / "r.json").write_text(json.dumps(report))
    with pytest.raises(PlanError, match="incomplete .3 of 10"):
        load_report(tmp_path / "r.json")
    assert load_report(tmp_path / "r.json", allow_incomplete=True)["progress"]["complete"] is False
    report["format"] = "something-else/2"
    (tmp_path / "r.json").write_text(json.dumps(report))
    with pytest.raises(PlanError, match="format"):
        load_report(tmp_path / "r.json", allow_incomplete=True)


def run_plan(tmp_path, report, *flags):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return subprocess.run([sys.executable, "-m", "reap_tools", "plan", str(path), "-n", "4", "--no-heatmap",
                           "-o", str(tmp_path / "sel.json"), *flags], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["layers"].__setitem__("2", None), "report layer 2: expected an object"),
    (lambda r: r["layers"].__setitem__("2", [1, 2]), "report layer 2: expected an object"),
    (lambda r: r["model"].__setitem__("num_experts", None), "num_experts"),
    (lambda r: r["model"].__setitem__("moe_layers", None), "moe_layers"),
    (lambda r: r["model"].__setitem__("moe_layers", ["x"]), "moe_layers"),
])
def test_malformed_report_is_one_line(tmp_path, edit, message):
    report = make_report()
    edit(report)
    run = run_plan(tmp_path, report)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("plan: error: ") and message in run.stderr
    assert not (tmp_path / "sel.json").exists()


def test_infinite_saliency_plans_with_a_warning(tmp_path):
    report = make_report()
    report["layers"]["2"]["reap_sum"][5] = float("inf")
    run = run_plan(tmp_path, report)
    assert run.returncode == 0, run.stderr
    assert "plan: warning: report layer 2: 'reap_sum' is infinite for experts [5]" in run.stderr
    assert 5 in json.loads((tmp_path / "sel.json").read_text())["layers"]["2"]
    budget = plan_selection(report, budget=20)
    assert 5 in budget["layers"]["2"] and sum(map(len, budget["layers"].values())) == 20


def test_all_zero_saliency_plans_with_a_warning(tmp_path):
    report = make_report()
    for layer in report["layers"].values():
        for key in layer:
            layer[key] = [0.0] * 16
    run = run_plan(tmp_path, report)
    assert run.returncode == 0, run.stderr
    assert ("plan: warning: every expert of layers [1, 2, 3] scores 0 by reap (nothing was routed to them?): "
            "those layers keep the lowest expert ids") in run.stderr
    report["layers"]["1"]["count"] = [1.0] * 16
    report["layers"]["1"]["reap_sum"] = [2.0] * 16
    run = run_plan(tmp_path, report, "--criterion", "frequency")
    assert "every expert of layers [2, 3] scores 0 by frequency" in run.stderr
