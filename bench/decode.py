"""Whole-model decode at the release's real width on one GPU: as many decoder layers as fit, CUDA-graph replay.

Builds `KimiK3ForCausalLM` from the root `config.json` (hidden 7168, vocab 163,840, 320 MXFP4 experts a MoE layer)
on the meta device, keeps its first N decoder layers (as many as fit in the GPU's free memory, or `--layers`),
materialises them on the GPU with random weights (MXFP4 packs: random bytes, scale codes 114..123), prefills
`--context` random tokens through a `KimiK3StaticCache`, then times decode steps at batch 1 and 8:
  * eager: the model's forward on the static cache with graphs off (the fast kernels, launched one by one);
  * graph: the same step replayed from one CUDA graph (`KimiK3StaticCache(cuda_graph=True)`, what generate runs);
  * with --ab, the graph step again with one optional path off at a time, in the same run: the side streams
    (the `side_streams` fast path), the fused small-op kernels (`fused`), fla-core's KDA decode kernel (`kda`);
each next to the bandwidth floor = bytes the step must move (every non-expert weight, the LM head, one embedding
row per sequence, the routed experts the router actually picked in that step, KDA state read + write, the MLA
latents of the real tokens) / device copy bandwidth measured in the same run. With `--profile` it also prints the
kernels of one eager step by total time. Prints one line per measurement and writes everything as JSON.

    python -m bench.decode --out bench/results/decode_h200.json [--layers N] [--context 2048] [--steps 16]
"""

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

import kda
import mxfp4_triton
from bench import common
from bench.common import Timer, copy_bandwidth, expert_bytes, fill_experts, nbytes, truncated
from configuration_kimi_k3 import FAST_PATH_DEFAULTS, KimiK3Config
from kimi_k3_dispatch import resolve_fast_paths
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3StaticCache, MXFP4Linear

GiB = 1 << 30


def layer_bytes(model):
    """Bytes of each decoder layer's parameters (meta tensors count too)."""
    return [nbytes(list(layer.parameters())) for layer in model.language_model.model.layers]


def build(config, layers, seed=0, device="cuda"):
    """The first `layers` decoder layers of the real model, on `device`, random weights, experts stacked."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = KimiK3ForCausalLM(truncated(config, layers))
    finally:
        torch.set_default_dtype(previous)
    text = model.language_model.model
    model.to_empty(device=device)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MXFP4Linear):
                continue  # filled through the stacks below (pack_ would quantize on the host)
            if not list(module.children()) or hasattr(module, "A_log"):
                model._init_weights(module)
        for layer in text.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is None:
                continue
            moe.gate.weight.normal_(0.0, 0.02)
            fill_experts(moe)
        for name in ("self_attention_res_proj", "mlp_res_proj"):
            for layer in text.layers:
                getattr(layer, name).weight.normal_(0.0, 0.02)
    return model


class Routes:
    """Expert ids each MoE gate picked in the last forward (forward hooks)."""

    def __init__(self, model):
        self.ids, self.handles = {}, []
        for layer in model.language_model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                self.handles.append(moe.gate.register_forward_hook(self.hook(layer.layer_idx)))

    def hook(self, index):
        def record(module, args, output):
            self.ids[index] = output[0].detach()

        return record

    def unique_experts(self):
        return sum(int(ids.unique().numel()) for ids in self.ids.values())

    def remove(self):
        for h in self.handles:
            h.remove()


def floor_bytes(model, batch, context, unique_experts):
    text = model.language_model.model
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if name.endswith("embed_tokens.weight"):
            total += batch * p.shape[1] * p.element_size()
        else:
            total += nbytes([p])
    total += unique_experts * expert_bytes(text.layers[1])
    for layer in text.layers:
        attn = layer.self_attn
        if hasattr(attn, "A_log"):
            width = attn.num_heads * attn.head_dim
            total += 2 * batch * attn.num_heads * attn.head_dim**2 * 4  # fp32 state, read + write
            total += 2 * 3 * batch * width * 3 * 2  # three conv histories of kernel - 1 steps, bf16, read + write
        else:
            total += batch * (context + 1) * (attn.kv_lora_rank + attn.rope_dim) * 2
    return total


def prefill(model, cache, ids, chunk):
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start : start + chunk], past_key_values=cache, use_cache=True)
    if ids.is_cuda:
        torch.cuda.synchronize()


def time_steps(model, cache, steps, batch, vocab, gen):
    """Per-step milliseconds of `steps` one-token forwards (each a real step: the cache advances)."""
    times = []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, 1), device="cuda", generator=gen)
            with Timer() as t:
                model(ids, past_key_values=cache, use_cache=True)
            times.append(t.ms)
    return times


def profile_step(model, cache, batch, vocab, top=25):
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (batch, 1), device="cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(ids, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us:
            rows.append((e.key[:90], e.count, cuda_us / 1e3))
    rows.sort(key=lambda r: -r[2])
    kernels = sum(r[1] for r in rows)
    return {"kernel_launches": kernels, "kernel_ms": sum(r[2] for r in rows),
            "top": [{"name": n, "count": c, "ms": ms} for n, c, ms in rows[:top]]}


def generate_tok_s(model, prompt, new_tokens, static):
    """Decode tokens/s of `model.generate` (greedy), prefill excluded: a run of 1 + new_tokens tokens minus a run of
    one, each with a fresh cache (the static one: CUDA-graph replays after the second step, capture included)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def run(tokens):
        cache = model.make_static_cache(prompt.shape[0], prompt.shape[1] + tokens) if static else None
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 cache=cache)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt.shape[1] + tokens
        return time.perf_counter() - start

    run(2)  # warm-up
    return new_tokens / (run(1 + new_tokens) - run(1))


def compile_blocks():
    """Experiment: `torch.compile` the model's elementwise building blocks in place (norms, depth mixes, SiTU,
    router, KDA gate and decode step), so that the graph replays fused kernels instead of chains of small ones."""
    import dataclasses

    import modeling_kimi_k3 as m

    torch._dynamo.config.cache_size_limit = 64
    m.REFERENCE_OPS = dataclasses.replace(m.REFERENCE_OPS, attn_res_mix=torch.compile(m.attn_res_mix, dynamic=False),
                                          situ_glu=torch.compile(m.situ_glu, dynamic=False))
    for cls in (m.KimiK3RMSNorm, m.KimiK3Router):
        cls.forward = torch.compile(cls.forward, dynamic=False)
    kda.recurrent_kda = torch.compile(kda.recurrent_kda, dynamic=False)
    kda.kda_gate = torch.compile(kda.kda_gate, dynamic=False)


DEFAULTS = dict(FAST_PATH_DEFAULTS)  # the shipped fast-path choices; an A/B mode switches one off


def run_modes(model, config, batch, modes, args, bandwidth, results, save):
    vocab = config.text_config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(batch)
    prompt = torch.randint(0, vocab, (batch, args.context), device="cuda", generator=gen)
    routes = Routes(model)
    entry = results.setdefault(f"b{batch}", {})
    max_length = args.context + 2 * args.steps + 8
    try:
        for name, graph, switches in modes:
            model.dispatch.set(**switches)
            cache = KimiK3StaticCache(model.config, batch, max_length, cuda_graph=graph)
            t0 = time.time()
            prefill(model, cache, prompt, args.chunk)
            prefill_s = time.time() - t0
            warm = 3 if graph else 1  # graph: eager warm-up step, capture step, then replays
            time_steps(model, cache, warm, batch, vocab, gen)
            if graph and (cache.decode_graph is None or not cache.decode_graph.captured):
                entry[name] = {"error": "the step was not captured (see the warning above)"}
                continue
            times = time_steps(model, cache, args.steps, batch, vocab, gen)
            floor = floor_bytes(model, batch, cache.get_seq_length(), routes.unique_experts())
            ms = statistics.median(times)
            floor_ms = floor / bandwidth * 1e3
            entry[name] = {"step_ms_median": ms, "step_ms_min": min(times), "floor_ms": floor_ms,
                           "fraction_of_floor": floor_ms / ms, "floor_bytes": floor,
                           "unique_experts_last_step": routes.unique_experts(), "prefill_s": prefill_s}
            print(f"b{batch} {name:26s}: {ms:8.3f} ms/step (min {min(times):.3f}), floor {floor_ms:.3f} ms "
                  f"-> {floor_ms / ms:.0%} of floor; experts hit {routes.unique_experts()}; prefill "
                  f"{args.context} tokens {prefill_s:.1f} s", flush=True)
            if args.profile and name == "eager" and batch == 1:
                entry["profile_eager"] = profile_step(model, cache, batch, vocab)
                p = entry["profile_eager"]
                print(f"profile b{batch} eager step: {p['kernel_launches']} kernels, {p['kernel_ms']:.3f} ms of "
                      "kernel time", flush=True)
                for row in p["top"]:
                    print(f"   {row['ms']:8.3f} ms  x{row['count']:4d}  {row['name']}")
            del cache
            torch.cuda.empty_cache()
            save()
    finally:
        model.dispatch.set(**DEFAULTS)
        routes.remove()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "decode_h200.json"))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to keep (default: as many as fit)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens cached before the decode steps")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (bounds activation memory)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--headroom-gib", type=float, default=14.0)
    parser.add_argument("--ab", action="store_true",
                        help="also time the graph step with the side streams off and with fla-core's KDA off")
    parser.add_argument("--profile", action="store_true", help="kernel table of one eager step at batch 1")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="also time model.generate of N tokens at batch 1, growing cache vs static + graph")
    parser.add_argument("--compile-blocks", action="store_true",
                        help="then also time graphs of torch.compile'd building blocks (an experiment)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.decode needs a CUDA device", file=sys.stderr)
        return 2
    common.quick_tune_from_env()
    started = time.time()
    config = KimiK3Config.from_pretrained(common.ROOT)
    with torch.device("meta"):
        sizes = layer_bytes(KimiK3ForCausalLM(config))
    free, total = torch.cuda.mem_get_info()
    fixed = 2 * config.text_config.vocab_size * config.text_config.hidden_size * 2  # embeddings + LM head, bf16
    layers = args.layers
    if layers is None:
        budget, layers = free - fixed - args.headroom_gib * GiB, 0
        while layers < len(sizes) and sum(sizes[: layers + 1]) <= budget:
            layers += 1
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": layers,
               "layer_types": config.text_config.layer_types[:layers], "context": args.context,
               "gpu_free_GiB_at_start": free / GiB, "weights_GiB": (sum(sizes[:layers]) + fixed) / GiB,
               "mxfp4_decode_config": mxfp4_triton.CONFIGS["decode"],
               "fast_paths": str(resolve_fast_paths({}, "cuda"))}

    def save():
        results["elapsed_s"] = time.time() - started
        common.write_json(args.out, results)

    results["copy_bandwidth_GBps"] = copy_bandwidth(10) / 1e9
    print(f"{layers} of {len(sizes)} layers ({results['weights_GiB']:.1f} GiB of weights) on "
          f"{results['device']}; copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    t0 = time.time()
    model = build(config, layers)
    results["build_s"] = time.time() - t0
    print(f"built in {results['build_s']:.0f} s; GPU memory in use {torch.cuda.memory_allocated() / GiB:.1f} GiB",
          flush=True)
    save()
    modes = [("eager", False, DEFAULTS), ("graph", True, DEFAULTS)]
    if args.ab:
        modes += [(f"graph {off} off", True, dict(DEFAULTS, **{key: "off"})) for key, off in
                  (("side_streams", "side streams"), ("fused", "fused small ops"), ("kda", "fla-kda"))]
    rounds = [modes] + ([[("graph compiled", True, DEFAULTS)]] if args.compile_blocks else [])
    def generate_section():
        prompt = torch.randint(0, config.text_config.vocab_size, (1, args.context), device="cuda")
        for static in (False, True):
            name = "generate static cache + graph" if static else "generate growing cache, eager"
            try:
                results[name + " tok_s"] = generate_tok_s(model, prompt, args.generate, static)
                print(f"b1 {name}: {results[name + ' tok_s']:.1f} tok/s", flush=True)
            except Exception:
                results[name + " error"] = traceback.format_exc()[-2000:]
                print(results[name + " error"], flush=True)
        save()

    for i, round_modes in enumerate(rounds):
        if i:
            if args.generate:
                generate_section()  # before compile_blocks changes the model's code
            compile_blocks()
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                run_modes(model, config, batch, round_modes, args, results["copy_bandwidth_GBps"] * 1e9, results,
                          save)
            except Exception:
                results[f"b{batch}_error"] = traceback.format_exc()[-3000:]
                print(results[f"b{batch}_error"], flush=True)
            save()
    if args.generate and len(rounds) == 1:
        generate_section()
    print(f"elapsed {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
