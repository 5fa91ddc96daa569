"""The kernels a decode step launches, counted on the CPU (`bench/kernel_count.py`): what must not come back."""

import copy
import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from bench import kernel_count  # noqa: E402
from tensor_parallel import TensorParallel, shard  # noqa: E402


@pytest.fixture(scope="module")
def counts():
    base = kernel_count.build_model()
    out = {}
    for batch in (1, 8):
        for tp in (1, kernel_count.TP):
            model = copy.deepcopy(base)
            if tp > 1:
                shard(model, TensorParallel(0, tp))
            out[tp, batch] = kernel_count.count_step(model, batch)
    return out


def moe_layers(step):
    return [label for label in step if label.endswith("_moe)")]


def test_no_decode_stage_reads_the_host(counts):
    """A host read in a decode step would stop it being captured in a CUDA graph."""
    reads = {(tp, batch, label): c["host_reads"] for (tp, batch), step in counts.items() for label, c in step.items()
             if c["host_reads"]}
    assert not reads


def test_an_expert_parallel_rank_launches_the_kernels_of_the_whole_layer(counts):
    """At batch 1 a rank's MoE layer takes the router's ids as they are and sums its pairs in the w2 kernel (the
    fp32 row it adds into zeroed by the launch that readies the latents): no id remap, no per-pair sum, no fill."""
    whole, rank = counts[1, 1], counts[kernel_count.TP, 1]
    for label in moe_layers(whole):
        assert rank[label]["kernels"] == whole[label]["kernels"], (label, rank[label]["ops"], whole[label]["ops"])
        assert rank[label]["triton"]["_expert_inputs_kernel"] == 1
        assert rank[label]["all_reduces"] == 3 and whole[label]["all_reduces"] == 0
        assert {"where", "sub", "bitwise_and", "sum"}.isdisjoint(rank[label]["ops"]), rank[label]["ops"]
        assert rank[label]["triton"]["_w13_kernel"] == rank[label]["triton"]["_w2_kernel"] == 1


def test_the_count_sees_every_kind_of_launch(counts):
    """GEMMs, Triton kernels and torch's own kernels each show up (the counter is not blind)."""
    step = counts[1, 1]
    kda = step["layer 1 (kda_moe)"]
    assert kda["gemms"] >= 5 and kda["triton"].get("_kda_decode_step_kernel") == 1
    assert kda["kernels"] > kda["gemms"] + sum(kda["triton"].values())
    assert "_latent_attention_combine_kernel" in step["layer 3 (mla_moe)"]["triton"]


def test_a_kda_decode_step_is_one_kernel_after_the_projections(counts):
    """A KDA layer's short convs, delta rule (fla's zeroed output and recurrence) and gated norm are one kernel at a
    decode step, whole and as a TP8 rank, at batch 1 and 8."""
    for (tp, batch), step in counts.items():
        for label in (label for label in step if "(kda_" in label):
            triton = step[label]["triton"]
            assert triton.get("_kda_decode_step_kernel") == 1, (tp, batch, label, triton)
            assert {"_short_conv_kernel", "_gated_rms_norm_kernel", "fla_fused_recurrent_kda"}.isdisjoint(triton)


def test_a_batch_of_8_sorts_its_pairs_in_one_kernel(counts):
    """At batch 8 the expert kernels' routing metadata (pairs sorted into blocks by expert) is one launch, not
    align_blocks' ~25 torch kernels and a sort."""
    for tp in (1, kernel_count.TP):
        for label in moe_layers(counts[tp, 1]):
            eight, one = counts[tp, 8][label], counts[tp, 1][label]
            assert eight["triton"].get("_align_blocks_kernel") == 1 and "sort" not in eight["ops"], eight["ops"]
            assert eight["kernels"] == one["kernels"] + 1, (tp, label, eight["ops"], one["ops"])
