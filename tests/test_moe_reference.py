"""The batched CPU/reference path of the MXFP4 routed experts equals the per-expert loop it replaces."""

import pytest
import torch

import modeling_kimi_k3
from reap_tools.tiny import random_model, tiny_config

EXPERTS, TOP_K, LATENT, INNER = 8, 3, 64, 96


@pytest.fixture(scope="module")
def moe():
    config = tiny_config(packed=True, routed_expert_hidden_size=LATENT, moe_intermediate_size=INNER,
                         num_experts=EXPERTS, num_experts_per_token=TOP_K)
    moe = random_model(config, seed=1).language_model.model.layers[1].block_sparse_moe
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for e in moe.experts:  # random bytes and scales: every expert different, all nibble codes present
            for lin in (e.w1, e.w2, e.w3):
                lin.weight_packed.copy_(torch.randint(0, 256, lin.weight_packed.shape, dtype=torch.uint8, generator=g))
                lin.weight_scale.copy_(torch.randint(118, 126, lin.weight_scale.shape, dtype=torch.uint8, generator=g))
    return moe


def per_expert_loop(moe, z, ids, weights):
    """The expert sum as the model computed it before batching: each expert's `forward` on its own rows."""
    top_k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=moe.num_experts).tolist()
    token = order // top_k
    routed = z[token]
    out = torch.empty(routed.shape, dtype=torch.float32)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start : start + count] = moe.experts[e](routed[start : start + count]).float()
            start += count
    out *= weights.flatten()[order, None]
    return torch.zeros(z.shape, dtype=torch.float32).index_add_(0, token, out)


def routing(tokens, generator):
    """Distinct experts per token from the first 6; expert 2 chosen by every token after the first."""
    ids = torch.stack([torch.randperm(6, generator=generator)[:TOP_K] for _ in range(tokens)])
    for t in range(1, tokens):
        if not (ids[t] == 2).any():
            ids[t, 0] = 2
    return ids


# (tokens, ids or None for `routing`): a decode step (one token: batched matmuls), every expert hit twice
# (batched, two rows each), and uneven counts (per-expert matmuls). Experts 6 and 7 are never chosen.
CASES = [(1, None), (4, [[0, 1, 2], [3, 4, 5], [5, 0, 1], [2, 3, 4]]), (9, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, ids", CASES)
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # None: all hit experts in one chunk; 1: one expert a chunk
def test_batched_experts_equal_the_per_expert_loop(moe, monkeypatch, dtype, tokens, ids, chunk_bytes):
    if chunk_bytes is not None:
        monkeypatch.setattr(modeling_kimi_k3, "DEQUANT_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(tokens)
    z = torch.randn(tokens, LATENT, generator=g).to(dtype)
    ids = routing(tokens, g) if ids is None else torch.tensor(ids)
    weights = torch.rand(tokens, TOP_K, generator=g)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    assert counts[6:].sum() == 0 and (tokens != 9 or counts[2] == 9 and (counts[counts > 0] < 9).any())
    with torch.no_grad():
        ours = moe.routed_experts(z, ids, weights)
        ref = per_expert_loop(moe, z, ids, weights)
    assert ours.dtype == torch.float32 and ours.shape == (tokens, LATENT)
    assert ref.abs().max() > 1.0  # the experts produce something to compare
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_no_tokens(moe):
    z = torch.zeros(0, LATENT)
    with torch.no_grad():
        out = moe.routed_experts(z, torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K))
    assert out.shape == (0, LATENT)


def test_packs_are_read_from_shared_stacks_and_still_save(tmp_path):
    """The batched path views the experts' packs through one stack per weight (held once), and a model whose
    experts were stacked so saves and reloads the same tensors."""
    model = random_model(tiny_config(packed=True), seed=2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model(torch.tensor([[5, 9, 200, 31]]))
    layer = model.language_model.model.layers[1].block_sparse_moe
    stack = layer.expert_stack
    assert layer.experts[3].w2.weight_packed.data_ptr() == stack.w2[3].data_ptr()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == ref.keys() and all(torch.equal(loaded[k], v) for k, v in ref.items())
