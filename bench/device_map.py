"""Greedy decode with the model spread over devices by `device_map`, every fast path on, on one GPU and the CPU.

Loads the demo parent (`demo/parent`, bf16) three ways through `from_pretrained(device_map=...)` (accelerate's
hooks move the activations between devices):
  * single: everything on cuda:0 (one decode graph);
  * split_layers: the embedding, the first half of the layers and the output norm + head on cuda:0, the other half
    of the layers on "cpu", which in a `device_map` with a GPU means, as accelerate places it, weights held on the
    CPU and loaded onto cuda:0 by its hooks for each call (graphs before and after that eager run of layers);
  * offload_embed_head: the embedding and the LM head on the CPU, every layer on cuda:0 (one graph in between);
prefills a coding prompt through a static cache and times each greedy one-token step (CUDA synchronised), after
the warm-up and capture steps. Writes

    {"runs": [{"name", "devices", "segments", "same_tokens_as_single_device", "first_difference", "ms_per_step",
               "captured"}], "prompt", "steps", "fast_paths"}

    python -m bench.device_map --out bench/results/device_map_h200.json [--steps 48]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import common
from bench.common import ROOT

PROMPT = "def fibonacci(n):\n    "


def placements(layers):
    head = {"language_model.model.norm": 0, "language_model.model.output_attn_res_norm": 0,
            "language_model.model.output_attn_res_proj": 0, "language_model.lm_head": 0}
    on_gpu = {"language_model.model.embed_tokens": 0, **{f"language_model.model.layers.{i}": 0 for i in range(layers)},
              **head}
    split = dict(on_gpu, **{f"language_model.model.layers.{i}": "cpu" for i in range(layers // 2, layers)})
    offload = dict(on_gpu, **{"language_model.model.embed_tokens": "cpu", "language_model.lm_head": "cpu"})
    return {"single": on_gpu, "split_layers": split, "offload_embed_head": offload}


def greedy(model, prompt_ids, steps):
    """Greedy tokens and per-step milliseconds of `steps` one-token steps after the prompt (static cache)."""
    cache = model.make_static_cache(1, prompt_ids.shape[1] + steps + 3)
    # where the embedding computes: with its weights offloaded they sit on the meta device between calls
    embed_device = sys.modules[type(model).__module__].execution_device(model.language_model.model.embed_tokens)
    ids = prompt_ids.to(embed_device)
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        tokens, times = [], []
        for _ in range(steps):
            token = logits.argmax(-1).to(embed_device)
            tokens.append(int(token))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(token, cache=cache, use_cache=True).logits
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    graph = cache.decode_graph
    segments = [f"{s.device}:{len(s.stages)}" + ("" if s.graph is not None else f" eager ({s.why_eager})")
                for s in graph.segments] if graph is not None else []
    return tokens, times[2:], segments, bool(graph is not None and graph.captured)  # after warm-up and capture


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=os.path.join(ROOT, "demo", "parent"))
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "device_map_h200.json"))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, trust_remote_code=True)
    prompt_ids = torch.tensor([tokenizer.encode(PROMPT)])
    layers = json.load(open(os.path.join(args.checkpoint, "config.json")))["text_config"]["num_hidden_layers"]
    runs, reference, fast = [], None, None
    for name, device_map in placements(layers).items():
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, trust_remote_code=True, dtype=torch.bfloat16,
                                                     device_map=device_map)
        model.generation_config.eos_token_id = None
        fast = str(model.language_model.model.dispatch.resolved(torch.device("cuda", 0)))
        tokens, times, segments, captured = greedy(model, prompt_ids, args.steps)
        reference = reference or tokens
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
        run = {"name": name, "devices": sorted({str(torch.device("cuda", d) if isinstance(d, int) else d)
                                                   for d in device_map.values()}), "segments": segments,
               "same_tokens_as_single_device": tokens == reference, "first_difference": first,
               "ms_per_step": statistics.median(times), "captured": captured, "tokens": tokens}
        print(f"{name}: devices {run['devices']}, segments {segments}, {run['ms_per_step']:.2f} ms/step, "
              f"same tokens {run['same_tokens_as_single_device']}", flush=True)
        runs.append(run)
        del model
        torch.cuda.empty_cache()
    print(repr(tokenizer.decode(reference)))
    result = {"runs": runs, "prompt": PROMPT, "steps": args.steps, "fast_paths": fast,
              "checkpoint": os.path.relpath(args.checkpoint, ROOT), "device": torch.cuda.get_device_name()}
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
