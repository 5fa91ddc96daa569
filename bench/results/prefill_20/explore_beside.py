"""Issue 20, session of 2026-12-04 (second): a prompt's expert upcast beside the grouped GEMMs, measured alone.

At the release's expert shapes (320 experts, latent 3584, inner 3072, top-16) and an 8k-token chunk of random
routing, on the H200:
  * `run_experts_upcast_once` with the upcast and the GEMMs taking turns (sms=0) against the next chunk's upcast
    on a second stream while the GEMMs leave it `sms` SMs, per programs' shape and chunk size; each result
    compared bit for bit with the turn-taking one;
  * one chunk's upcast (32 experts' w1) alone: a program per row against `sms` programs of each shape;
  * one chunk's w13 grouped GEMM with and without an SM carve-out (does torch's grouped GEMM honour it?).

    python bench/results/prefill_20/explore_beside.py  -> explore_call5.json here (or under $OUT where set)

It ran on tree 91b4c0f, whose `run_experts_upcast_once` and `dequantize` took a `beside` argument; the next commit
took that path out (it was slower), so on later trees this script no longer runs. `prefill_beside.*` is
bench/prefill.py --quick on that tree.
"""

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import mxfp4_triton as mt  # noqa: E402

EXPERTS, LATENT, INNER, TOP_K, TOKENS = 320, 3584, 3072, 16, 8192
SHAPES = ((16, 8), (8, 4), (32, 16))  # (warps, rows a step)


def timed(fn, reps=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    began = time.time()
    gen = torch.Generator("cuda").manual_seed(0)

    def packs(rows, cols):
        return (torch.randint(0, 256, (EXPERTS, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=gen),
                torch.randint(118, 123, (EXPERTS, rows, cols // 32), dtype=torch.uint8, device="cuda", generator=gen))

    (w1, s1), (w3, s3), (w2, s2) = packs(INNER, LATENT), packs(INNER, LATENT), packs(LATENT, INNER)
    stack = mt.Stack(w1, s1, w3, s3, w2, s2, LATENT, INNER, None, True)
    z = torch.randn(TOKENS, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    weights = torch.rand(TOKENS, TOP_K, device="cuda", generator=gen)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}

    def experts(chunk, beside):
        return lambda: mt.run_experts_upcast_once(stack, z, ids, weights, EXPERTS, 4.0, 25.0, chunk_bytes=chunk,
                                                  beside=beside)

    turns = experts(2 << 30, dict(sms=0, warps=16, rows=8))
    ref = turns()
    layer = {"turns_2GiB_ms": timed(turns), "turns_1GiB_ms": timed(experts(1 << 30, dict(sms=0, warps=16, rows=8)))}
    for chunk, label in ((2 << 30, "2GiB"), (1 << 30, "1GiB")):
        for sms in (16, 24, 32, 40):
            for warps, rows in SHAPES:
                fn = experts(chunk, dict(sms=sms, warps=warps, rows=rows))
                same = torch.equal(fn(), ref)
                layer[f"beside_{label}_sms{sms}_w{warps}_r{rows}"] = {"ms": timed(fn), "equal": same}
                print(label, sms, warps, rows, layer[f"beside_{label}_sms{sms}_w{warps}_r{rows}"], flush=True)
    out["experts_8k"] = layer

    group = slice(0, 32)
    buf = torch.empty(32, INNER, LATENT, dtype=torch.bfloat16, device="cuda")
    moved = (w1[group].numel() + s1[group].numel() + buf.numel() * 2) / 1e9
    want = mt.dequantize(w1[group], s1[group])
    alone = {"GB_moved": moved}
    ms = timed(lambda: mt.dequantize(w1[group], s1[group], buf), reps=10)
    alone["row_per_program"] = {"ms": ms, "TBps": moved / ms, "equal": torch.equal(buf, want)}
    for sms in (16, 24, 32, 40, 132):
        for warps, rows in SHAPES:
            beside = dict(sms=sms, warps=warps, rows=rows)
            buf.zero_()
            ms = timed(lambda: mt.dequantize(w1[group], s1[group], buf, beside=beside), reps=10)
            alone[f"sms{sms}_w{warps}_r{rows}"] = {"ms": ms, "TBps": moved / ms, "GBps_per_sm": moved / ms * 1e3 / sms,
                                                   "equal": torch.equal(buf, want)}
    out["upcast_w1_chunk"] = alone

    w13 = torch.randn(32, 2 * INNER, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(32 * 410, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    ends = torch.arange(1, 33, device="cuda", dtype=torch.int32) * 410
    gemm = {}
    for carve in (None, 24, 66):
        torch._C._set_sm_carveout_experimental(carve)
        gemm[f"carve_{carve}"] = timed(lambda: torch._grouped_mm(x, w13.transpose(1, 2), offs=ends), reps=10)
    torch._C._set_sm_carveout_experimental(None)
    out["w13_gemm_32_experts_ms"] = gemm
    out["elapsed_s"] = time.time() - began
    with open(os.path.join(os.environ.get("OUT", HERE), "explore_call5.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
