"""The reference routed experts (`modeling_kimi_k3.routed_experts`, batched over the expert stack) give each
(token, slot) pair the output of its expert module's own forward."""

import pytest
import torch

import modeling_kimi_k3
from modeling_kimi_k3 import routed_experts
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


def per_expert_loop(moe, z, ids):
    """Each (token, slot)'s expert output as the model computed it before batching: each expert's `forward` on the
    rows routed to it, in token order; zeros for ids past the experts (another rank's)."""
    out = torch.zeros(*ids.shape, z.shape[-1], dtype=z.dtype)
    for e in ids.unique().tolist():
        if e < moe.num_experts:
            token, slot = (ids == e).nonzero(as_tuple=True)
            out[token, slot] = moe.experts[e](z[token])
    return out


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
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    assert counts[6:].sum() == 0 and (tokens != 9 or counts[2] == 9 and (counts[counts > 0] < 9).any())
    with torch.no_grad():
        ours = routed_experts(moe, z, ids)
        ref = per_expert_loop(moe, z, ids)
    assert ours.dtype == dtype and ours.shape == (tokens, TOP_K, LATENT)
    assert ref.abs().max() > 1.0  # the experts produce something to compare
    torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-6, atol=1e-6)


def test_pairs_of_another_ranks_experts_are_zero_rows(moe):
    """Under expert parallel, ids equal to the expert count stand for experts another rank holds."""
    z = torch.randn(3, LATENT)
    ids = torch.tensor([[0, EXPERTS, 4], [EXPERTS, EXPERTS, EXPERTS], [7, 1, EXPERTS]])
    with torch.no_grad():
        ours = routed_experts(moe, z, ids)
        ref = per_expert_loop(moe, z, ids)
    foreign = ids == EXPERTS
    assert bool((ours[foreign] == 0).all()) and ref[~foreign].abs().max() > 1.0
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_no_tokens(moe):
    z = torch.zeros(0, LATENT)
    with torch.no_grad():
        out = routed_experts(moe, z, torch.zeros(0, TOP_K, dtype=torch.long))
    assert out.shape == (0, TOP_K, LATENT)


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
