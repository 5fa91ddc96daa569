"""Issue 20, session of 2026-12-05 (third): where an 8192-token prompt's time goes in a KDA + MoE and an MLA + MoE
layer on the current tree (torch profiler, CUDA time per kernel, one profiled run after a timed median of 5).
Run from the repository root on a GPU; writes JSON to the path given (measurements only, nothing here ships)."""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.getcwd()
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import layer as bench_layer  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from modeling_kimi_k3 import BlockBank, KimiK3Cache  # noqa: E402

OUT = sys.argv[1]
TOKENS = 8192
text = KimiK3Config.from_pretrained(ROOT).text_config
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS}
started = time.time()
for kind, index in (("kda", 1), ("mla", 3)):
    layer = bench_layer.build_layer(text, index, seed=index)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bank = BlockBank(torch.randn(1, TOKENS, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
                     for _ in range(4))
    partial = torch.randn(1, TOKENS, text.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
    step = lambda: layer(bank, partial, None, KimiK3Cache(text))[1]  # noqa: E731
    with torch.no_grad():
        step()
        ms = bench_layer.time_ms(step, 5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(t for _, t, _ in kernels)
    results[kind] = {"ms": ms, "kernel_ms_total": total,
                     "kernels_ms": [[k[:120], round(t, 3), n] for k, t, n in kernels[:40]]}
    print(kind, round(ms, 2), "ms wall,", round(total, 2), "ms of kernels", flush=True)
    for k, t, n in kernels[:40]:
        print(f"   {t:7.3f} ms {n:3d}x {k[:110]}", flush=True)
    del layer
    torch.cuda.empty_cache()
results["elapsed_s"] = time.time() - started
with open(OUT, "w") as f:
    json.dump(results, f, indent=1)
