"""Two expert-parallel ranks of one LatentMoE block in one process: the ranks' all-reduces emulated in turn.

Within one MoE block the all-reduce inputs (the shared experts' partial down projection and the routed experts'
partial latent sum) depend only on the block's input, so running rank 1 first, recording each partial in call
order, and then rank 0 with each all-reduce adding rank 1's partial gives rank 0 exactly the two-rank result.
"""

import copy

import tensor_parallel
from tensor_parallel import TensorParallel, shard


def two_rank_moe(moe, x, monkeypatch):
    """The output of `moe` (a KimiK3LatentMoE) on `x` computed as rank 0 of two expert-parallel ranks; also returns
    the two sharded blocks."""
    ranks = []
    for rank in range(2):
        block = copy.deepcopy(moe)
        shard(block, TensorParallel(rank, 2))
        block.stack_experts()  # the rank's experts, stacked again as the loader does
        ranks.append(block)
    partials = []

    def record(t, group=None):
        partials.append(t.clone())
        return t

    def add_partner(t, group=None):
        return t.add_(partials.pop(0))

    monkeypatch.setattr(tensor_parallel, "all_reduce", record)
    ranks[1](x)
    monkeypatch.setattr(tensor_parallel, "all_reduce", add_partner)
    out = ranks[0](x)
    assert not partials, "rank 0 made fewer all-reduces than rank 1"
    return out, ranks
