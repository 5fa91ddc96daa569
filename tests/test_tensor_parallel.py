"""Tensor + expert parallel loading (issue 19, CPU): `from_pretrained(DIR, trust_remote_code=True, tp_plan="auto")`
under `torchrun --nproc-per-node 2` and `4` (gloo) gives the one-process model's logits and greedy tokens, each
rank holding 1/N of every layer's MXFP4 experts, the router whole and the plan's shapes; the split numerics layer by
layer against a float64 reference; the plan's slices in one process with a fake rank; and the errors for an
indivisible config, another plan and a load outside torchrun.
"""

import copy
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from modeling_kimi_k3 import KimiK3ForCausalLM
from reap_tools.tiny import random_model, tiny_config, write_checkpoint
from tensor_parallel import TensorParallel, check_tp_size, shard
from tp_worker import NEW_TOKENS, PROMPT, moe_layers, record_whole, run

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")

# The smallest config with everything the plan splits: layer 0 dense (KDA), layer 1 MoE (KDA), layer 2 MoE (MLA),
# two attention-residual blocks; 4 heads of each kind, 8 MXFP4 experts, intermediate 128, shared 2 x 32, vocab 512:
# all divisible by 4.
TEXT = dict(num_hidden_layers=3, linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[3],
                                                         kda_layers=[1, 2]))

# Parameters split by output rows (dim 0) or input columns (dim 1); everything else but the routed experts is whole.
ROWS = re.compile(r"self_attn\.((q|k|v|f_b|b|g|q_b|kv_b)_proj\.weight|[qkv]_conv1d\.weight|dt_bias)$"
                  r"|(mlp|shared_experts)\.(gate|up)_proj\.weight$|(lm_head|embed_tokens)\.weight$")
COLUMNS = re.compile(r"(self_attn\.o_proj|mlp\.down_proj|shared_experts\.down_proj)\.weight$")
STACKED = re.compile(r".*\.experts\.w[123]\.weight_(packed|scale)$")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("tp") / "tiny"), packed=True, seed=0, **TEXT)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The one-process load of the checkpoint (fp32): the model, its logits, greedy tokens (default and static cache)
    and the static cache's KDA state shapes."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32)
    return model, *run(model)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_shapes(config, rank, size):
    """Parameter shapes of rank `rank` of `size` after `shard`, on the meta device."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    shard(model, TensorParallel(rank, size))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("size", [2, 4])
def test_torchrun_load_matches_one_process(checkpoint, reference, tmp_path, size):
    model, logits, tokens, static, states = reference
    out = tmp_path / "out.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), WORKER, checkpoint, str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = torch.load(out)
    # The ranks sum partial dot products (o_proj, down_proj) in another order than one matmul does: fp32 rounding,
    # ~1e-7 of the logits' ~0.5 scale, which atol covers for logits near zero, where rtol alone bounds nothing.
    torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(result["tokens"], tokens) and tokens.shape == (1, len(PROMPT[0]) + NEW_TOKENS)
    assert torch.equal(result["static_tokens"], static) and torch.equal(static, tokens)
    assert len(result["ranks"]) == size
    whole = moe_layers(model)
    assert sorted(whole) == [1, 2]
    for rank, got in enumerate(result["ranks"]):
        assert got["shapes"] == plan_shapes(model.config, rank, size)
        assert got["states"] == [(b, h // size, k, v) for b, h, k, v in states], "a rank's cache holds its heads"
        for i, layer in whole.items():
            per_rank = len(layer["experts"]) // size
            assert got["moe"][i]["first"] == rank * per_rank
            assert got["moe"][i]["experts"] == layer["experts"][rank * per_rank : (rank + 1) * per_rank]
            assert got["moe"][i]["bytes"] * size == layer["bytes"]
            assert got["moe"][i]["router"] == layer["router"]


def test_torchrun_split_numerics_are_as_close_as_fp32_summation_order(tmp_path):
    """Issue 44's shape (tiny_config's defaults: six layers, KDA and MLA, 4 heads, 8 experts top-2, hidden 64) on 4
    gloo ranks: every whole module output (each decoder layer, o_proj and down projection after its all-reduce, each
    MoE block, the logits) is as far from a float64 one-process reference as the fp32 one-process model's is, up to
    the change of summation order. A split op that rounds differently (a partial sum in a narrower dtype, a norm of
    a rank's share) would stand out at the module that introduces it, by the factor of its extra rounding."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), WORKER, "--random", json.dumps({}), "0", str(tmp_path / "out.pt")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    split = torch.load(tmp_path / "out.pt")
    model = random_model(tiny_config(packed=True), seed=0)
    wide = copy.deepcopy(model).double()
    wide.stack_experts()
    outputs, wide_outputs = record_whole(model), record_whole(wide)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits, wide_logits = model(ids).logits, wide(ids).logits
    outputs["logits"], wide_outputs["logits"], split["outputs"]["logits"] = logits, wide_logits, split["logits"]
    assert list(split["outputs"]) == list(wide_outputs) and len(wide_outputs) == 31

    def error(got, reference):
        return ((got.double() - reference.double()).abs().max() / reference.double().abs().max()).item()

    for name, reference in wide_outputs.items():
        one, tp = error(outputs[name], reference), error(split["outputs"][name], reference)
        assert 0 < one < 1e-5, name
        assert tp <= 3 * one + 2e-7, f"{name}: 4 ranks {tp:.2e} from float64, one process {one:.2e}"


@pytest.mark.parametrize("size", [2, 4])
def test_shard_in_one_process_keeps_this_ranks_slices(size):
    model = random_model(tiny_config(packed=True, **TEXT), seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    text = model.config.text_config
    heads, experts = text.linear_attn_config["num_heads"], text.num_experts
    assert heads == text.num_attention_heads
    rank = size - 1  # the last rank: every slice starts past 0
    sources = shard(model, TensorParallel(rank, size))
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    for name, param in after.items():
        source, index = sources.get(name, (name, ()))
        assert torch.equal(param, before[source][index]), name
        original = before[source]
        if name.endswith("A_log"):  # stored padded to 128 heads: the rank's heads only
            assert param.shape == (heads // size,)
        elif ROWS.search(name):
            assert param.shape == (original.shape[0] // size, *original.shape[1:]), name
        elif COLUMNS.search(name):
            assert param.shape == (original.shape[0], original.shape[1] // size), name
        elif STACKED.match(name):  # the rank's consecutive experts of each stack
            share = experts // size
            assert index == (slice(rank * share, (rank + 1) * share),), name
            assert param.dtype == torch.uint8 and param.shape == (share, *original.shape[1:])
        else:
            assert param.shape == original.shape and name not in sources, name
    layers = model.language_model.model.layers
    assert [layer.self_attn.num_heads for layer in layers] == [heads // size] * 3
    assert [len(layers[i].block_sparse_moe.experts) for i in (1, 2)] == [experts // size] * 2
    assert layers[1].block_sparse_moe.gate.weight.shape == (experts, text.hidden_size)


# Divisible by 3 in every field but the shared experts' width, 1 x 32 (a multiple of the MXFP4 group, so of 4 too).
BY_THREE = dict(num_attention_heads=6, num_key_value_heads=6, intermediate_size=129, num_experts=6,
                num_shared_experts=1, vocab_size=513,
                linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=6))


@pytest.mark.parametrize("overrides, size, field", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, "num_attention_heads = 6"),
    (dict(linear_attn_config=dict(TEXT["linear_attn_config"], num_heads=6)), 4, "linear_attn_config.num_heads = 6"),
    (dict(intermediate_size=130), 4, "intermediate_size = 130"),
    (BY_THREE, 3, "num_shared_experts \\* moe_intermediate_size = 32"),
    (dict(num_experts=6), 4, "num_experts = 6"),
    (dict(num_experts_per_layer=[0, 8, 6]), 4, r"num_experts_per_layer\[2\] = 6"),
    (dict(vocab_size=510, pad_token_id=509), 4, "vocab_size = 510"),
])
def test_check_tp_size_names_the_field_it_cannot_split(overrides, size, field):
    text = tiny_config(**{**TEXT, **overrides}).text_config
    with pytest.raises(ValueError, match=f"^Kimi K3 tensor parallel: {size} ranks do not divide {field}$"):
        check_tp_size(text, size)
    check_tp_size(text, 1)


def test_check_tp_size_accepts_what_divides_and_skips_absent_layer_kinds():
    check_tp_size(tiny_config(**TEXT).text_config, 4)
    only_kda = dict(TEXT, num_attention_heads=6, num_key_value_heads=6,
                    linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[], kda_layers=[1, 2, 3]))
    check_tp_size(tiny_config(**only_kda).text_config, 4)  # no MLA layer: its head count splits nothing


def test_another_plan_is_rejected(checkpoint):
    with pytest.raises(ValueError, match=r"supports tp_plan='auto' only .*got 'colwise'"):
        AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, tp_plan="colwise")


def test_auto_plan_outside_torchrun_says_how_to_run_it(checkpoint, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"one shard per process: run under torchrun"):
        AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, tp_plan="auto")


@pytest.mark.parametrize("tokens", [1, 9])
def test_expert_parallel_moe_block_sums_to_the_whole_block(tokens, monkeypatch):
    """Two expert-parallel ranks of one MoE block (tests/tp_emulation.py), reference path, fp32: the same output
    as the whole block, and each pair computed on exactly one rank."""
    from tp_emulation import two_rank_moe

    model = random_model(tiny_config(packed=True, **TEXT), seed=1)
    moe = model.language_model.model.layers[1].block_sparse_moe
    x = torch.randn(tokens, model.config.text_config.hidden_size)
    with torch.no_grad():
        whole = moe(x)
        out, ranks = two_rank_moe(moe, x, monkeypatch)
        ids, _ = moe.gate(x)
    held = [(ids >= r.expert_parallel.first) & (ids < r.expert_parallel.first + r.expert_parallel.count)
            for r in ranks]
    assert [r.expert_parallel.count for r in ranks] == [4, 4]
    assert (held[0].int() + held[1].int() == 1).all(), "a pair is on no rank or on both"
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranks", [1, 2])
def test_per_pair_expert_outputs_are_weighted_and_summed_by_the_block(ranks, monkeypatch):
    """The contracts of the expert ops, which the expert kernels keep. `routed_experts`: each (token, slot)'s
    expert output on its own, unweighted, which `pair_sum_norm` weights in fp32 and sums. `routed_expert_sum`
    (expert parallel): the weighted fp32 sum over the pairs of the rank's experts, given the router's ids, which
    one all-reduce completes. Torch stand-ins for the kernels (rows they must not read NaN) give the reference
    path's output, whole and as two expert-parallel ranks."""
    import dataclasses

    from kimi_k3_dispatch import FastPathDispatch, FastPaths
    from modeling_kimi_k3 import REFERENCE_OPS
    from tp_emulation import two_rank_moe

    def per_pair_outputs(moe, z, ids):
        out = torch.full((*ids.shape, z.shape[-1]), float("nan"), dtype=z.dtype)
        for (token, slot), e in zip(ids.new_ones(ids.shape).nonzero().tolist(), ids.flatten().tolist()):
            if e < moe.num_experts:
                out[token, slot] = moe.experts[e](z[token : token + 1])[0]
        return out

    def share_sum(moe, z, ids, weights, first):
        local = ids - first
        held = (local >= 0) & (local < moe.num_experts)
        pairs = per_pair_outputs(moe, z, torch.where(held, local, moe.num_experts))
        return torch.where(held[..., None], pairs.float() * weights[..., None], 0.0).sum(1, keepdim=True)

    model = random_model(tiny_config(packed=True, **TEXT), seed=1)
    moe = model.language_model.model.layers[1].block_sparse_moe
    x = torch.randn(7, model.config.text_config.hidden_size)
    stand_in = dataclasses.replace(REFERENCE_OPS, paths=FastPaths(experts=True), routed_experts=per_pair_outputs,
                                   routed_expert_sum=share_sum if ranks == 2 else None)
    with torch.no_grad():
        whole = moe(x)
        monkeypatch.setattr(FastPathDispatch, "ops", lambda self, device, offloaded=False: stand_in)
        out = moe(x) if ranks == 1 else two_rank_moe(moe, x, monkeypatch)[0]
    assert not out.isnan().any()
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
