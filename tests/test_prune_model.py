"""Model-level checks of prune: observe -> plan -> prune on a real tiny MXFP4 checkpoint in 3+ shards.

A pruned model must be the original with its router restricted to the kept experts: forcing the original's
router off the dropped experts (their e_score_correction_bias set to -1e4, so the bias-corrected top-k never
picks them; the weights g come from the unbiased scores and are unchanged) gives the same logits, exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from reap_tools import observe as ob
from reap_tools.checkpoint import INDEX_NAME, load_tensors, read_config
from reap_tools.plan import check_report_matches, plan_selection
from reap_tools.prune import prune_checkpoint
from reap_tools.tiny import write_checkpoint
from reap_tools.verify import verify_checkpoint

PAD = 511
EXPERTS = 8
HIDDEN = 64  # tiny_config's hidden size
MOE = "language_model.model.layers.{}.block_sparse_moe."


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(checkpoint dir, REAP report from observing it on random token data)."""
    root = tmp_path_factory.mktemp("prune-model")
    src = write_checkpoint(str(root / "src"), packed=True, seed=0, max_shard_size="100KB")
    shards = set(json.loads((Path(src) / INDEX_NAME).read_text())["weight_map"].values())
    assert len(shards) >= 3, shards
    model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True)
    sequences = list(np.random.default_rng(0).integers(0, 500, (12, 32)))
    sequences[-1] = sequences[-1][:20]
    report = ob.observe(model, ob.make_batches(sequences, 4, PAD), progress=False)
    return Path(src), report


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def forced_original(src, kept):
    """The original model with the dropped experts' router bias at -1e4: they are never chosen."""
    model = load(src)
    with torch.no_grad():
        for i, ids in kept.items():
            bias = model.language_model.model.layers[int(i)].block_sparse_moe.gate.e_score_correction_bias
            dropped = [e for e in range(bias.numel()) if e not in ids]
            bias[dropped] = -1e4
    return model


def inputs():
    ids = torch.randint(0, 500, (3, 24), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def routed_logits(model, ids, mask):
    """(logits, {layer: (chosen expert ids [N, k] sorted, their weights)}) of one forward."""
    seen, handles = {}, []
    for i, layer in enumerate(model.language_model.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            handles.append(layer.block_sparse_moe.gate.register_forward_hook(
                lambda m, args, out, i=i: seen.__setitem__(i, out)))
    try:
        out = logits(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    routes = {}
    for i, (chosen, weights) in seen.items():
        order = chosen.sort(-1)
        routes[i] = (order.values, weights.gather(-1, order.indices))
    return out, routes


def assert_logits_match(got, want):
    """Equal up to the router GEMM's fp32 rounding.

    Nothing but the router's x @ W.T differs between the two models (same expert bytes, same ops in the same order,
    same choices, checked token by token beside this); with another number of router rows BLAS may take another
    sgemm kernel, so the sigmoid scores, hence g, can differ in the last fp32 bit (~1e-7 to 3e-7 in these tests'
    logits). Which shapes do depends on the CPU: a probe of it on random data predicted bit-identical logits on
    one 2-core machine and not on another, so the rounding is allowed everywhere (atol 1e-6, well below the 1e-4
    that the restriction itself moves the logits by)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def assert_same_routing(pruned_routes, forced_routes, kept):
    """Every token chooses the same (original) experts in both models, with the same weights up to fp32 rounding."""
    for i, (chosen, weights) in pruned_routes.items():
        original = torch.tensor(kept[str(i)])[chosen]  # renumbered 0..N-1 -> original ids (ascending, so order kept)
        assert torch.equal(original, forced_routes[i][0]), f"layer {i}: routing differs"
        torch.testing.assert_close(weights, forced_routes[i][1], rtol=1e-6, atol=1e-7)


def test_uniform_prune_is_the_original_restricted_to_the_kept_experts(source, tmp_path):
    src, report = source
    selection = plan_selection(report, num_experts=4)
    dst = tmp_path / "pruned"
    result = prune_checkpoint(src, selection, dst, max_shard_size="100KB", progress=False)
    assert len(result.shards) >= 3 and set(result.experts_per_layer.values()) == {4}

    pruned = load(dst)
    text = pruned.config.text_config
    assert text.num_experts == 4 and text.num_experts_per_layer is None
    for i in range(1, text.num_hidden_layers):
        moe = pruned.language_model.model.layers[i].block_sparse_moe
        assert len(moe.experts) == 4 and moe.gate.weight.shape[0] == 4
        assert type(moe.experts[0].w1).__name__ == "MXFP4Linear"

    ids, mask = inputs()
    got, routes = routed_logits(pruned, ids, mask)
    want, forced_routes = routed_logits(forced_original(src, selection["layers"]), ids, mask)
    assert_same_routing(routes, forced_routes, selection["layers"])
    # the prune changes nothing but the expert set: the same logits up to the router GEMM's rounding
    assert_logits_match(got, want)
    assert not torch.allclose(got, logits(load(src), ids, mask), atol=1e-4)  # the restriction matters

    res = verify_checkpoint(dst, source=src, progress=False)
    assert res.ok, res.errors

    # one flipped byte in a kept expert's pack: verify names the tensor
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    name = MOE.format(2) + "experts.3.w2.weight_packed"
    t = load_tensors(broken)[name]
    with open(t.file, "r+b") as f:
        f.seek(t.start + 5)
        byte = f.read(1)[0]
        f.seek(t.start + 5)
        f.write(bytes([byte ^ 0x10]))
    res = verify_checkpoint(broken, source=src, progress=False)
    assert not res.ok and any(name in e for e in res.errors), res.errors
    assert all(name in e for e in res.errors), res.errors  # and only it


def test_budget_prune_gives_per_layer_counts_that_load_and_generate(source, tmp_path):
    src, report = source
    selection = plan_selection(report, budget=22)
    counts = {int(i): len(ids) for i, ids in selection["layers"].items()}
    assert sum(counts.values()) == 22 and len(set(counts.values())) > 1, counts
    dst = tmp_path / "budget"
    prune_checkpoint(src, selection, dst, max_shard_size="100KB", progress=False)

    config = read_config(dst)["text_config"]
    assert config["num_experts_per_layer"] == [0] + [counts[i] for i in range(1, 6)]
    assert config["num_experts"] == max(counts.values())
    pruned = load(dst)
    for i, n in counts.items():
        assert len(pruned.language_model.model.layers[i].block_sparse_moe.experts) == n

    forced = forced_original(src, selection["layers"])
    ids, mask = inputs()
    got, routes = routed_logits(pruned, ids, mask)
    want, forced_routes = routed_logits(forced, ids, mask)
    assert_same_routing(routes, forced_routes, selection["layers"])
    # Here some layers keep 5 or 6 router rows, for which MKL's sgemm rounds differently than for 8 (~3e-7 in the
    # logits): equal up to that, and the choice of experts is identical token by token (checked above).
    assert_logits_match(got, want)
    prompt = ids[:1, :10]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    out = pruned.generate(prompt, **kwargs)
    assert out.shape == (1, 16)
    assert torch.equal(out, forced.generate(prompt, **kwargs))
    res = verify_checkpoint(dst, source=src, progress=False)
    assert res.ok, res.errors

    # the non-uniform model can be observed and planned again
    again = ob.observe(pruned, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert again["model"]["num_experts_per_layer"] == config["num_experts_per_layer"]
    check_report_matches(again, read_config(dst))
    assert {len(v) for v in plan_selection(again, num_experts=2)["layers"].values()} == {2}


def test_prune_of_the_demo_writes_the_packages_code(tmp_path):
    """The pruned checkpoint gets regular files holding this package's code (never a link out of its folder), loads
    on its own and equals demo/reap40's logits."""
    from reap_tools.remote_code import REMOTE_CODE, ROOT

    demo = ROOT / "demo"
    dst = tmp_path / "reap40"
    prune_checkpoint(demo / "parent", demo / "reap40" / "reap_selection.json", dst, progress=False)
    for name in REMOTE_CODE:
        assert not (dst / name).is_symlink() and (dst / name).read_bytes() == (ROOT / name).read_bytes(), name
    moved = tmp_path / "elsewhere"
    shutil.move(str(dst), str(moved))  # nothing in it points back at the repository
    ids = torch.tensor([[5, 17, 9, 33, 2]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(moved, trust_remote_code=True)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(demo / "reap40", trust_remote_code=True)(ids).logits
    assert torch.equal(got, want)
