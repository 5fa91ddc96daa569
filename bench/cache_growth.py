"""A growing cache's MLA latents: the time of a decode step's append, the model's buffer with room
(`KimiK3LatentCacheLayer`) beside concatenation (what it did before), at the release's latent width on one GPU.

For each context, one layer starts from that many cached latents (a prompt's, kept as given) and appends 256 single
tokens; prints the mean GPU time of an append, the peak memory above the start, and the ratio.

    python -m bench.cache_growth [--out bench/results/cache_growth_h200.json]
"""

import argparse
import os

import torch

from bench import common
from kimi_k3_cache import KimiK3LatentCacheLayer

WIDTH, STEPS = 512 + 64, 256  # kv_lora_rank + qk_rope_head_dim


class ConcatenatingLayer(KimiK3LatentCacheLayer):
    """The reference: every append concatenates, copying every cached latent."""

    def update(self, latent, positions):
        self.latent = latent if self.latent is None else torch.cat([self.latent, latent], dim=1)
        return self.latent


def appends(layer_type, context, device):
    """Mean ms of an append and the peak bytes above the start, over STEPS appends after `context` latents."""
    layer = layer_type()
    layer.update(torch.randn(1, context, WIDTH, device=device, dtype=torch.bfloat16), None)
    tokens = torch.randn(STEPS, 1, 1, WIDTH, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with common.Timer() as t:
        for token in tokens:
            keys = layer.update(token, None)
    assert keys.shape[1] == context + STEPS
    return t.ms / STEPS, torch.cuda.max_memory_allocated() - base


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "cache_growth_h200.json"))
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "steps": STEPS, "width": WIDTH, "contexts": {}}
    for context in (2048, 32768, 131072):
        appends(KimiK3LatentCacheLayer, context, "cuda")  # warm-up
        grown_ms, grown_peak = appends(KimiK3LatentCacheLayer, context, "cuda")
        cat_ms, cat_peak = appends(ConcatenatingLayer, context, "cuda")
        result["contexts"][str(context)] = {"buffer_ms": grown_ms, "concat_ms": cat_ms, "concat_over_buffer":
                                            cat_ms / grown_ms, "buffer_peak_MiB": grown_peak / 2**20,
                                            "concat_peak_MiB": cat_peak / 2**20}
        print(f"context {context}: append {grown_ms * 1e3:.1f} us (buffer with room) vs {cat_ms * 1e3:.1f} us "
              f"(concatenation), {cat_ms / grown_ms:.1f}x; peak +{grown_peak / 2**20:.0f} vs +{cat_peak / 2**20:.0f} "
              f"MiB; x 24 MLA layers: {24 * grown_ms:.2f} vs {24 * cat_ms:.2f} ms a token", flush=True)
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
