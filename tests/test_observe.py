"""observe: REAP / frequency / EAN / max statistics against a float64 SPEC reference, padding, resume, CLI, data.

The reference here recomputes the router (sigmoid, bias-corrected top-k, renormalised over the chosen scores)
and the routed experts in float64 from the hand-set weights, on the MoE inputs captured from the same forward
that `observe` watches; only the weights' values are shared with the model, none of its code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from reap_tools import observe as ob
from reap_tools.checkpoint import read_config
from reap_tools.plan import PlanError, check_report_matches, load_report, plan_selection
from reap_tools.tiny import random_model, tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
NEVER, ALWAYS = 0, 7  # experts whose router bias keeps them out of / in every top-k
BIAS = [-1e4, 0.0, 0.1, -0.1, 0.2, -0.2, 0.05, 3.0]
PAD = 511


def mxfp4_exact(out_features, in_features, exponent, generator):
    """A weight exactly representable as MXFP4 under the quantiser of SPEC §3: E2M1 values times 2**exponent,
    each group of 32 holding a +-6 so its scale is 2**exponent."""
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    codes[:, ::32] = torch.where(torch.rand(out_features, in_features // 32, generator=generator) < 0.5, 7, 15)
    return torch.tensor(E2M1, dtype=torch.float64)[codes] * 2.0**exponent


def hand_set_model():
    """Tiny MXFP4 model with hand-set routers and experts; returns (model, float64 weights by layer)."""
    model = random_model(tiny_config(packed=True), seed=3)
    g = torch.Generator().manual_seed(11)
    weights = {}
    with torch.no_grad():
        for i, layer in enumerate(model.language_model.model.layers):
            if not hasattr(layer, "block_sparse_moe"):
                continue
            moe = layer.block_sparse_moe
            hidden = moe.gate.weight.shape[1]
            gate = torch.randn(moe.gate.weight.shape, generator=g, dtype=torch.float64) / math.sqrt(hidden)
            moe.gate.weight.copy_(gate)
            moe.gate.e_score_correction_bias.copy_(torch.tensor(BIAS))
            experts = []
            for e, expert in enumerate(moe.experts):
                w = {name: mxfp4_exact(lin.out_features, lin.in_features, exp, g)
                     for name, lin, exp in (("w1", expert.w1, -2), ("w3", expert.w3, -2),
                                            ("w2", expert.w2, -5 + e % 4))}
                for name, value in w.items():
                    getattr(expert, name).pack_(value.float())
                experts.append(w)
            weights[i] = {"gate": moe.gate.weight.double().clone(),  # as stored (fp32), in float64
                          "bias": moe.gate.e_score_correction_bias.double().clone(),
                          "down": moe.routed_expert_down_proj.weight.double().clone(), "experts": experts}
    return model, weights


@pytest.fixture(scope="module")
def hand_set(tmp_path_factory):
    model, weights = hand_set_model()
    path = write_checkpoint(str(tmp_path_factory.mktemp("observe") / "hand-set"), model=model)
    loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    # premise: the packs hold exactly the hand-set values
    from mxfp4 import dequantize_mxfp4
    w1 = loaded.language_model.model.layers[2].block_sparse_moe.experts[5].w1
    unpacked = dequantize_mxfp4(w1.weight_packed, w1.weight_scale, torch.float64)
    assert torch.equal(unpacked, weights[2]["experts"][5]["w1"])
    return path, loaded, weights


def reference_stats(x, mask, w, text):
    """float64 count / reap_sum / ean_sum / max_norm of one layer per SPEC §2 and §5. x [B, T, H], mask [B, T]."""
    flat = x.reshape(-1, x.shape[-1]).double()[mask.reshape(-1).bool()]
    scores = torch.sigmoid(flat @ w["gate"].T)
    biased = scores + w["bias"]
    k = text.num_experts_per_token
    order = biased.sort(dim=-1, descending=True)
    margin = (order.values[:, k - 1] - order.values[:, k]).min()
    assert margin > 1e-5, f"near-tie in the top-{k} choice ({margin}); the reference would be ambiguous"
    ids = order.indices[:, :k]
    g = scores.gather(-1, ids)
    g = g / g.sum(-1, keepdim=True) * text.routed_scaling_factor
    z = flat @ w["down"].T
    beta, lbeta = text.activation_situ_beta, text.activation_situ_linear_beta
    n_experts = len(w["experts"])
    stats = {f: [0.0] * n_experts for f in ob.FIELDS}
    for t in range(flat.shape[0]):
        for slot in range(k):
            e = int(ids[t, slot])
            ew = w["experts"][e]
            gate, up = ew["w1"] @ z[t], ew["w3"] @ z[t]
            act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * lbeta * torch.tanh(up / lbeta)
            norm = float(torch.linalg.vector_norm(ew["w2"] @ act))
            stats["count"][e] += 1
            stats["reap_sum"][e] += float(g[t, slot]) * norm
            stats["ean_sum"][e] += norm
            stats["max_norm"][e] = max(stats["max_norm"][e], norm)
    return stats


def capture_moe_inputs(model):
    """Pre-hooks that record each MoE block's input [B, T, H]; returns (dict, handles)."""
    seen, handles = {}, []
    for i, layer in enumerate(model.language_model.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            handles.append(layer.block_sparse_moe.register_forward_pre_hook(
                lambda m, args, i=i: seen.__setitem__(i, args[0].detach().clone())))
    return seen, handles


def padded_batch():
    """3 x 12: no padding, right padding (4), left padding (5); pad positions hold the pad id."""
    ids = torch.randint(0, 500, (3, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, :5] = 0
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


def test_observe_matches_the_float64_reference_and_ignores_padding(hand_set):
    path, model, weights = hand_set
    batch = padded_batch()
    seen, handles = capture_moe_inputs(model)
    try:
        report = ob.observe(model, [batch], progress=False)
    finally:
        for h in handles:
            h.remove()
    text = model.config.text_config
    real = int(batch["attention_mask"].sum())
    assert real == 36 - 9
    assert report["calibration"]["num_tokens"] == real and report["calibration"]["num_padding_tokens"] == 9
    assert report["model"]["moe_layers"] == [1, 2, 3, 4, 5] and report["model"]["num_experts"] == 8
    assert report["progress"] == {"sequences_done": 3, "total_sequences": None, "complete": True}
    load_report_dict = json.loads(json.dumps(report))  # JSON-clean
    assert set(load_report_dict["layers"]) == {"1", "2", "3", "4", "5"}
    for i, w in weights.items():
        got = report["layers"][str(i)]
        want = reference_stats(seen[i], batch["attention_mask"], w, text)
        assert got["count"] == want["count"], i
        # the routing the biases force: padding rows (which are routed too) do not count
        assert got["count"][NEVER] == 0 and got["count"][ALWAYS] == real and sum(got["count"]) == 2 * real
        for field in ("reap_sum", "ean_sum", "max_norm"):
            np.testing.assert_allclose(got[field], want[field], rtol=1e-5, atol=1e-12, err_msg=f"layer {i} {field}")
        assert got["reap_sum"][NEVER] == got["ean_sum"][NEVER] == got["max_norm"][NEVER] == 0
        # g is the renormalised *unbiased* score: the always-chosen expert's weight is well below 1
        assert 0 < got["reap_sum"][ALWAYS] < got["ean_sum"][ALWAYS]


def test_padding_changes_nothing_but_the_padded_rows(hand_set):
    """The same real tokens observed with and without extra padded rows give the same counts."""
    _, model, _ = hand_set
    batch = padded_batch()
    rows = [ob.observe(model, [{"input_ids": batch["input_ids"][r:r + 1, batch["attention_mask"][r].bool()]}],
                       progress=False) for r in range(3)]
    together = ob.observe(model, [batch], progress=False)
    for i in together["layers"]:
        assert together["layers"][i]["count"] == [sum(r["layers"][i]["count"][e] for r in rows) for e in range(8)]
        np.testing.assert_allclose(together["layers"][i]["reap_sum"],
                                   np.sum([r["layers"][i]["reap_sum"] for r in rows], axis=0), rtol=1e-4)


def test_a_mask_of_the_wrong_size_is_an_error(hand_set):
    _, model, _ = hand_set
    observer = ob.SaliencyObserver(model)
    with observer, torch.no_grad():
        observer.set_mask(torch.ones(1, 5))
        with pytest.raises(RuntimeError, match=r"layer 1: the MoE block saw 6 tokens but the attention mask covers 5"):
            model(torch.arange(6)[None])


def test_the_observer_reads_the_forwards_own_expert_outputs(hand_set, monkeypatch):
    """The expert outputs are the ones the block's forward computed (no second experts call), and the statistics
    are those of computing them again from the captured latents: the same counts, the sums to fp32 rounding (the
    forward ran its padded rows too, and a matmul's rounding may depend on how many rows it has)."""
    _, model, _ = hand_set
    batches, total = random_batches()
    again = []
    recompute = ob.expert_outputs
    monkeypatch.setattr(ob, "expert_outputs", lambda *args: again.append(1) or recompute(*args))
    own = ob.observe(model, batches, total_sequences=total, progress=False)
    assert not again, "the observer ran the experts a second time"
    blocks = ob.find_moe_blocks(model)
    monkeypatch.setattr(ob.SaliencyObserver, "_pairs_observer", lambda self, i: None)  # blocks that give none
    computed = ob.observe(model, batches, total_sequences=total, progress=False)
    assert len(again) == len(blocks) * len(batches)
    for i, layer in own["layers"].items():
        assert layer["count"] == computed["layers"][i]["count"]
        for field in ("reap_sum", "ean_sum", "max_norm"):
            np.testing.assert_allclose(layer[field], computed["layers"][i][field], rtol=1e-6, err_msg=field)
    assert all(block.pairs_observer is None for block in blocks.values()), "the observer left its callback behind"


def random_batches(n_batches=4, batch_size=2, seq_len=16, seed=0):
    sequences = list(np.random.default_rng(seed).integers(0, 500, (n_batches * batch_size, seq_len)))
    sequences[-1] = sequences[-1][:9]  # the last batch is padded
    return list(ob.make_batches(sequences, batch_size, PAD)), len(sequences)


def test_resume_from_half_equals_one_full_run(hand_set, tmp_path):
    _, model, _ = hand_set
    batches, total = random_batches()
    full = ob.observe(model, batches, total_sequences=total, progress=False)
    assert full["progress"]["complete"] and full["calibration"]["num_padding_tokens"] == 7
    half = ob.observe(model, batches[:2], total_sequences=total, progress=False, save_path=tmp_path / "r.json")
    assert half["progress"]["sequences_done"] == 4
    saved = json.loads((tmp_path / "r.json").read_text())  # resume from what was written, not the dict
    resumed = ob.observe(model, batches, resume_from=saved, total_sequences=total, progress=False)
    assert resumed["layers"] == full["layers"]  # exactly: same batches, same float64 summation order
    assert resumed["calibration"] == full["calibration"] and resumed["progress"] == full["progress"]

    other = json.loads(json.dumps(half))
    other["model"]["num_experts_per_token"] = 3
    with pytest.raises(ob.ObserveError, match="cannot resume: the report's model num_experts_per_token is 3"):
        ob.observe(model, batches, resume_from=other, progress=False)

    # stopping mid-batch: the rest of that batch is run on its own, so only float rounding may differ
    part = ob.observe(model, batches, stop_after=3, total_sequences=total, progress=False)
    assert part["progress"] == {"sequences_done": 3, "total_sequences": total, "complete": False}
    rest = ob.observe(model, batches, resume_from=part, total_sequences=total, progress=False)
    assert rest["progress"]["complete"] and rest["calibration"]["num_tokens"] == full["calibration"]["num_tokens"]
    for i, layer in full["layers"].items():
        assert rest["layers"][i]["count"] == layer["count"]
        for field in ("reap_sum", "ean_sum", "max_norm"):
            np.testing.assert_allclose(rest["layers"][i][field], layer[field], rtol=1e-5, atol=1e-12)


def test_cli_stop_resume_equals_a_full_run(hand_set, tmp_path):
    path = hand_set[0]
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(1).integers(0, 500, 184))
    common = ["--model", path, "--data", str(data), "--seq-len", "16", "--batch-size", "2", "--no-progress"]
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    assert ob.main(common + ["--out", str(full)]) == 0
    assert ob.main(common + ["--out", str(part), "--stop-after", "6", "--save-every", "1"]) == 0
    partial = json.loads(part.read_text())
    assert partial["progress"] == {"sequences_done": 6, "total_sequences": 12, "complete": False}
    with pytest.raises(PlanError, match="report is incomplete"):  # plan will not use a partial measurement
        load_report(part)
    assert ob.main(common + ["--out", str(part)]) == 1  # exists: needs --resume
    assert ob.main(common + ["--out", str(part), "--resume"]) == 0
    a, b = json.loads(full.read_text()), json.loads(part.read_text())
    assert a["layers"] == b["layers"] and a["progress"] == b["progress"] == {
        "sequences_done": 12, "total_sequences": 12, "complete": True}
    assert a["calibration"] == b["calibration"]
    cal = a["calibration"]
    assert cal["num_tokens"] == 184 and cal["num_padding_tokens"] == 8 and cal["seq_len"] == 16
    assert cal["files"] == [{"path": str(data), "sha256": ob.file_sha256(data), "bytes": data.stat().st_size,
                             "format": "npy", "documents": 1}]
    assert a["model"]["name_or_path"] == path and a["format"] == ob.REPORT_FORMAT
    assert load_report(full)["layers"].keys() == {"1", "2", "3", "4", "5"}  # plan accepts it


def test_cli_resume_refuses_other_data(hand_set, tmp_path, capsys):
    path = hand_set[0]
    data, other = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(data, np.arange(100) % 500)
    np.save(other, np.arange(100)[::-1].copy())
    out = tmp_path / "r.json"
    common = ["--model", path, "--seq-len", "16", "--no-progress", "--out", str(out)]
    assert ob.main(common + ["--data", str(data), "--stop-after", "2"]) == 0
    assert ob.main(common + ["--data", str(other), "--resume"]) == 1
    assert "cannot resume: the report was taken on calibration files" in capsys.readouterr().err
    assert ob.main(common + ["--data", str(data), "--seq-len", "8", "--resume"]) == 1
    assert "cannot resume: calibration seq_len was 16, now 8" in capsys.readouterr().err


def test_revision_comes_from_the_git_head(hand_set, tmp_path):
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("ab" * 20 + "\n")
    assert ob.git_head(tmp_path / "repo") == "ab" * 20
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs with: peeled\n" + "cd" * 20 + " refs/heads/main\n")
    assert ob.git_head(tmp_path / "repo") == "cd" * 20
    assert ob.git_head(tmp_path) is None


def test_the_verb_is_registered():
    out = subprocess.run([sys.executable, "-m", "reap_tools", "observe", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "--resume" in out and "--device-map" in out


class ByteTokenizer:
    """Stand-in with the two calls observe makes; chat rendering mimics transformers 5 (a dict back)."""

    eos = 258

    def encode(self, text):
        return list(text.encode())

    def apply_chat_template(self, messages, tokenize=True):
        ids = [t for m in messages for t in [259, *m["content"].encode(), self.eos]]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def test_text_jsonl_and_token_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "abc"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([[1, 2, 3], [4, 5]]))
    np.save(tmp_path / "d.npy", np.array([7, 8, 9, 10], dtype=np.int32))
    files = [tmp_path / n for n in ("a.txt", "b.jsonl", "c.json", "d.npy")]
    seqs, prov = ob.load_calibration(files, ByteTokenizer(), vocab_size=512, seq_len=8, separator_id=258)
    stream = [*b"hello", 258, *b"abc", 258, 259, *b"hi", 258, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert [s.tolist() for s in seqs] == [stream[k:k + 8] for k in range(0, len(stream), 8)]
    assert [(p["format"], p["documents"]) for p in prov] == [("txt", 1), ("jsonl", 2), ("json", 2), ("npy", 1)]
    seqs, _ = ob.load_calibration(files, ByteTokenizer(), seq_len=3, pack=False, separator_id=258, max_tokens=13)
    assert [s.tolist() for s in seqs] == [list(b"hel"), list(b"abc"), [259, *b"hi"], [1, 2, 3], [4]]
    with pytest.raises(ob.ObserveError, match="outside the model's vocabulary"):
        ob.load_calibration([tmp_path / "c.json"], vocab_size=4, seq_len=8)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ob.ObserveError, match=r"bad.jsonl:1: expected an object with a 'text' string"):
        ob.load_calibration([tmp_path / "bad.jsonl"], ByteTokenizer(), seq_len=8)
    with pytest.raises(ob.ObserveError, match="needs a tokenizer"):
        ob.load_calibration([tmp_path / "a.txt"], seq_len=8)
    batches = list(ob.make_batches([np.arange(3), np.arange(5)], 2, PAD, "left"))
    assert batches[0]["input_ids"].tolist() == [[PAD, PAD, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert batches[0]["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_chat_jsonl_with_the_k3_tokenizer(tmp_path):
    tok_mod = pytest.importorskip("tokenization_kimi_k3")
    tok_mod.write_rank_file({bytes([b]): b for b in range(256)}, tmp_path / "tiktoken.model")
    tokenizer = tok_mod.KimiK3Tokenizer(vocab_file=str(tmp_path / "tiktoken.model"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    seqs, _ = ob.load_calibration([tmp_path / "chat.jsonl"], tokenizer, vocab_size=512, seq_len=10_000,
                                  separator_id=tokenizer.eos_token_id)
    expected = tokenizer.apply_chat_template(messages, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert seqs[0].tolist() == list(expected)  # already ends with <|end_of_msg|>: no second separator
    assert expected[-1] == tokenizer.eos_token_id


def test_plan_refuses_a_report_from_another_model(hand_set, tmp_path, capsys):
    _, model, _ = hand_set
    report = ob.observe(model, [padded_batch()], progress=False)
    ob.save_report(report, tmp_path / "report.json")
    fewer = write_checkpoint(str(tmp_path / "six-experts"), packed=True, num_experts=6)
    with pytest.raises(PlanError, match="layer 1: report has 8 experts, the checkpoint has 6"):
        check_report_matches(report, read_config(fewer))
    shallower = write_checkpoint(str(tmp_path / "four-layers"), packed=True, num_hidden_layers=4,
                                 linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[4],
                                                         kda_layers=[1, 2, 3]))
    with pytest.raises(PlanError, match="report is for a model with 6 layers, the checkpoint has 4"):
        check_report_matches(report, read_config(shallower))
    from reap_tools.plan import main as plan_main
    assert plan_main([str(tmp_path / "report.json"), "-n", "4", "--checkpoint", fewer, "--no-heatmap",
                      "-o", str(tmp_path / "sel.json")]) == 1
    assert "plan: error: layer 1: report has 8 experts, the checkpoint has 6" in capsys.readouterr().err
    check_report_matches(report, read_config(hand_set[0]))  # its own checkpoint is fine
    assert all(len(ids) == 4 for ids in plan_selection(report, num_experts=4)["layers"].values())


def test_observe_under_device_map_with_disk_offload(hand_set, tmp_path):
    """accelerate's offload hooks load expert weights when the observer calls the experts itself."""
    path, model, _ = hand_set
    offloaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, device_map="auto",
                                                     max_memory={"cpu": "600KB"},
                                                     offload_folder=str(tmp_path / "offload"))
    assert "disk" in set(offloaded.hf_device_map.values())
    batches, total = random_batches(2)
    a = ob.observe(model, batches, progress=False)
    b = ob.observe(offloaded, batches, progress=False)
    for i in a["layers"]:
        assert a["layers"][i]["count"] == b["layers"][i]["count"]
        np.testing.assert_allclose(b["layers"][i]["reap_sum"], a["layers"][i]["reap_sum"], rtol=1e-5)
        np.testing.assert_allclose(b["layers"][i]["max_norm"], a["layers"][i]["max_norm"], rtol=1e-5)
