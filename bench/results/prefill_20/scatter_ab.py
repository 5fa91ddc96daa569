"""Issue 20, session of 2026-12-05 (third): the expert outputs' scatter back to (token, slot) order,
`mxfp4_triton.scatter_rows` against torch's `index_copy_` (what `run_experts_upcast_once` called before), in one
process on one GPU, in turns: the scatter alone at an 8k prompt's size (131,072 rows of 3584 bf16) and the whole
`run_experts_upcast_once` at real shapes (8192 tokens, top-16 of 320 experts); outputs compared bit for bit.
Run from the repository root; writes JSON to the path given (measurements only)."""

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
import mxfp4_triton as mt  # noqa: E402

OUT = sys.argv[1]
E, L, I, T, K = 320, 3584, 3072, 8192, 16
gen = torch.Generator("cuda").manual_seed(0)
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
shipped = mt.scatter_rows


def index_copy(src, index, out):
    return out.index_copy_(0, index, src)


def bench(fn):
    return do_bench(fn, warmup=3, rep=200, return_mode="median")


src = torch.randn(T * K, L, device="cuda", generator=gen).to(torch.bfloat16)
index = torch.randperm(T * K, device="cuda", generator=gen)
out = torch.empty_like(src)
assert torch.equal(shipped(src, index, out.clone()).view(torch.int16), index_copy(src, index, out.clone()).view(torch.int16))
rows = results["scatter_131072x3584_ms"] = {"index_copy": [], "scatter_rows": []}
for _ in range(2):
    rows["index_copy"].append(bench(lambda: index_copy(src, index, out)))
    rows["scatter_rows"].append(bench(lambda: shipped(src, index, out)))
print("scatter alone", rows, flush=True)
del src, index, out


def packs(r, c):
    return torch.randint(0, 256, (E, r, c // 2), device="cuda", dtype=torch.uint8, generator=gen)


def codes(r, c):
    return torch.randint(118, 124, (E, r, c // 32), device="cuda", dtype=torch.uint8, generator=gen)


stack = mt.Stack(packs(I, L), codes(I, L), packs(I, L), codes(I, L), packs(L, I), codes(L, I), L, I, None, True)
z = torch.randn(T, L, device="cuda", generator=gen).to(torch.bfloat16)
ids = torch.rand(T, E, device="cuda", generator=gen).topk(K).indices
run = lambda: mt.run_experts_upcast_once(stack, z, ids, E, 4.0, 25.0)  # noqa: E731
with torch.no_grad():
    new = run()
    mt.scatter_rows = index_copy
    old = run()
    results["same_bits"] = bool(torch.equal(new.view(torch.int16), old.view(torch.int16)))
    rows = results["run_experts_upcast_once_8k_ms"] = {"index_copy": [], "scatter_rows": []}
    for _ in range(2):
        mt.scatter_rows = index_copy
        rows["index_copy"].append(bench(run))
        mt.scatter_rows = shipped
        rows["scatter_rows"].append(bench(run))
print("run_experts_upcast_once", rows, "same bits:", results["same_bits"], flush=True)
with open(OUT, "w") as f:
    json.dump(results, f, indent=1)
