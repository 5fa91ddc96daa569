"""Issue 20, session of 2026-12-04 (second): the prompt path's expert upcast and chunking, measured alone.

At the release's expert shapes (latent 3584, inner 3072; a chunk of 32 experts) on the H200:
  * the shipped upcast (`mxfp4_triton.dequantize`: a 2-warp program per row, BLOCK 2048) beside variants of it
    written here: blocks that tile a row exactly (256 x 7 for w1's 1792 bytes, 512 x 3 for w2's 1536), two or four
    rows a program, streaming cache hints (loads evict_first, stores .cs); each compared bit for bit;
  * `run_experts_upcast_once` at an 8k-token chunk of random top-16 routing over 320 experts with chunks of 2, 4
    and 8 GiB of bf16 weights (fewer, larger grouped GEMMs).

    python bench/results/prefill_20/explore_upcast.py  -> explore_call6.json here (or under $OUT where set)
"""

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import mxfp4_triton as mt  # noqa: E402
from mxfp4_triton import _bf16_bits, _e2m1  # noqa: E402,F401  (called by the variant kernel)

EXPERTS, LATENT, INNER, TOP_K, TOKENS = 320, 3584, 3072, 16, 8192


@triton.jit
def _variant(w_ptr, s_ptr, out_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS_PER: tl.constexpr,
             STREAM: tl.constexpr):
    """The shipped upcast's math, ROWS_PER rows x BLOCK bytes a program, optionally with streaming cache hints."""
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < HALF
    for r in tl.static_range(ROWS_PER):
        row = (tl.program_id(0) * ROWS_PER + r).to(tl.int64)
        if STREAM:
            packed = tl.load(w_ptr + row * HALF + j, mask=mask, other=0, eviction_policy="evict_first")
            code = tl.load(s_ptr + row * (HALF // 16) + j // 16, mask=mask, other=127, eviction_policy="evict_first")
        else:
            packed = tl.load(w_ptr + row * HALF + j, mask=mask, other=0)
            code = tl.load(s_ptr + row * (HALF // 16) + j // 16, mask=mask, other=127)
        packed, code = packed.to(tl.int32), code.to(tl.int32)
        scale = tl.where(code == 0, 0x400000, code << 23).to(tl.float32, bitcast=True)
        lo = _bf16_bits(_e2m1(packed & 7) * scale, packed & 8)
        hi = _bf16_bits(_e2m1((packed >> 4) & 7) * scale, packed & 128)
        if STREAM:
            tl.store(out_ptr + row * HALF + j, lo | (hi << 16), mask=mask, cache_modifier=".cs")
        else:
            tl.store(out_ptr + row * HALF + j, lo | (hi << 16), mask=mask)


def timed(fn, reps=10, warmup=2):
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
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    upcast = {}
    for name, (w, s) in (("w1", (w1, s1)), ("w2", (w2, s2))):
        w, s = w[:32], s[:32]
        rows, half = w.shape[-2:]
        buf = torch.empty(32, rows, 2 * half, dtype=torch.bfloat16, device="cuda")
        moved = (w.numel() + s.numel() + buf.numel() * 2) / 1e9
        want = mt.dequantize(w, s)
        ms = timed(lambda: mt.dequantize(w, s, buf))
        result = {"GB_moved": moved, "shipped": {"ms": ms, "TBps": moved / ms, "equal": torch.equal(buf, want)}}
        exact = 256 if half == 1792 else 512
        for block, rows_per, warps, stream in ((2048, 1, 2, True), (2048, 2, 2, False), (2048, 2, 4, False),
                                                (2048, 4, 4, False), (2048, 1, 1, False), (exact, 1, 1, False),
                                                (exact, 1, 2, False), (exact, 2, 2, False), (exact, 4, 4, False)):
            buf.zero_()
            grid = (w.numel() // half // rows_per, triton.cdiv(half, block))

            def run():
                _variant[grid](w, s, buf.view(torch.int32), HALF=half, BLOCK=block, ROWS_PER=rows_per,
                               STREAM=stream, num_warps=warps)

            ms = timed(run)
            result[f"block{block}_rows{rows_per}_w{warps}{'_stream' if stream else ''}"] = {
                "ms": ms, "TBps": moved / ms, "equal": torch.equal(buf, want)}
        upcast[name] = result
        print(name, json.dumps(result), flush=True)
    out["upcast_32_experts"] = upcast

    stack = mt.Stack(w1, s1, w3, s3, w2, s2, LATENT, INNER, None, True)
    z = torch.randn(TOKENS, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    weights = torch.rand(TOKENS, TOP_K, device="cuda", generator=gen)
    chunks, ref = {}, None
    for gib in (2, 4, 8):
        def run():
            return mt.run_experts_upcast_once(stack, z, ids, weights, EXPERTS, 4.0, 25.0, chunk_bytes=gib << 30)

        got = run()
        ref = got if ref is None else ref
        torch.cuda.reset_peak_memory_stats()
        ms = timed(run, reps=5)
        chunks[f"{gib}GiB"] = {"ms": ms, "equal": torch.equal(got, ref),
                               "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
        print(gib, chunks[f"{gib}GiB"], flush=True)
    out["experts_8k_by_chunk"] = chunks
    out["elapsed_s"] = time.time() - began
    with open(os.path.join(os.environ.get("OUT", HERE), "explore_call6.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
