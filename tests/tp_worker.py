"""One rank of a tensor-parallel run, for tests/test_tensor_parallel.py.

`torchrun --nproc-per-node N tp_worker.py CHECKPOINT OUT` loads CHECKPOINT with `from_pretrained(..., tp_plan="auto")`
(gloo on the CPU), runs a forward and a short greedy `generate` on fixed ids, and rank 0 saves what the test compares
with a one-process load: the logits, the tokens and, gathered from every rank, its parameter shapes and `moe_layers`
of its shard.

`torchrun --nproc-per-node N tp_worker.py --random OVERRIDES SEED OUT` shards the tiny random model of
`tiny_config(**OVERRIDES)` (JSON) in each rank and saves rank 0's logits on PROMPT and the outputs of the modules
whose output is whole on every rank (`record_whole`), for a layer-by-layer comparison of the split numerics.
"""

import hashlib
import json
import os
import re
import sys

import torch
import torch.distributed as dist

PROMPT = [[5, 17, 99, 3, 250, 42, 7, 8]]
NEW_TOKENS = 4


def digest(tensors):
    """sha256 of the tensors' bytes, in order."""
    return hashlib.sha256(b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                   for t in tensors)).hexdigest()


def moe_layers(model):
    """Per MoE layer: the first global id of the experts held, each expert's digest (its packs and scales), their
    bytes, and the router's shape and digest."""
    info = {}
    for i, layer in enumerate(model.language_model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue
        params = [[p for _, p in sorted(expert.named_parameters())] for expert in moe.experts]
        info[i] = {
            "first": moe.expert_parallel.first if moe.expert_parallel is not None else 0,
            "experts": [digest(p) for p in params],
            "bytes": sum(p.nbytes for ps in params for p in ps),
            "router": (tuple(moe.gate.weight.shape), digest([moe.gate.weight])),
        }
    return info


def run(model):
    """The forward's logits on PROMPT, the greedy tokens after it (exactly NEW_TOKENS: the tiny model may say
    end-of-sequence anywhere) with the default cache and with a static one, and the static cache's KDA state
    shapes (the heads a rank holds)."""
    ids = torch.tensor(PROMPT)
    cache = model.make_static_cache(1, ids.shape[1] + NEW_TOKENS)
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        static = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                cache=cache)
    states = [tuple(layer.recurrent_state.shape) for layer in cache.layers if hasattr(layer, "recurrent_state")]
    return logits, tokens, static, states


# Modules whose output every rank holds whole (a split projection's after its all-reduce hook): decoder layers,
# attention output projections, MLP and MoE blocks and their down projections, the LM head.
WHOLE = re.compile(r"(layers\.\d+|self_attn\.o_proj|mlp|block_sparse_moe|down_proj|lm_head)$")


def record_whole(model):
    """Forward hooks keeping, per module matching WHOLE, its output of the first call in float64 (a decoder layer's:
    the partial sum it returns); returns the dict they fill, in call order. Registered after `shard`, they see each
    split projection's output after its all-reduce hook."""
    outputs = {}

    def keep(name, module, args, output):
        output = output[1] if isinstance(output, tuple) else output
        outputs.setdefault(name, output.detach().double().clone())

    for name, module in model.named_modules():
        if WHOLE.search(name):
            module.register_forward_hook(lambda m, a, o, name=name: keep(name, m, a, o))
    return outputs


def split_numerics(overrides, seed, out):
    """Rank 0's logits on PROMPT and `record_whole` outputs for the random model of `tiny_config(**overrides)` with
    `seed`, each rank holding its `shard` of it."""
    from reap_tools.tiny import random_model, tiny_config
    from tensor_parallel import init_distributed, shard

    torch.set_num_threads(1)
    tp, _ = init_distributed()
    model = random_model(tiny_config(packed=True, **json.loads(overrides)), seed=int(seed))
    shard(model, tp)
    model.tensor_parallel = tp
    model.stack_experts()
    outputs = record_whole(model)
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT)).logits
    if tp.rank == 0:
        torch.save({"logits": logits, "outputs": outputs}, out)
    dist.destroy_process_group()


def main(directory, out):
    from transformers import AutoModelForCausalLM  # after HF_MODULES_CACHE is set, which transformers reads once

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, tp_plan="auto",
                                                 dtype=torch.float32)
    logits, tokens, static, states = run(model)
    ranks = [None] * dist.get_world_size()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    dist.all_gather_object(ranks, {"moe": moe_layers(model), "shapes": shapes, "states": states})
    if dist.get_rank() == 0:
        torch.save({"logits": logits, "tokens": tokens, "static_tokens": static, "ranks": ranks}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    # Each rank its own remote-code module cache: ranks writing one at once could import each other's half-copied
    # files.
    if sys.argv[1] == "--random":
        split_numerics(*sys.argv[2:5])
    else:
        os.environ["HF_MODULES_CACHE"] = os.path.join(sys.argv[2] + ".modules", os.environ["RANK"])
        main(*sys.argv[1:3])
