"""Speculative decoding: what prompt lookup gains on the CPU demo, what a verification step costs at real width.

Three measurements, each against a reference measured in the same run:

  demo      The trained demo checkpoint in fp32 on the CPU, three code-editing prompts written for this benchmark
            (rewrite a function, rename a variable, add a docstring): plain greedy against greedy prompt lookup
            (`generate(..., prompt_lookup_num_tokens=N)`), the same tokens checked, with the tokens each forward
            produced (accepted draft tokens + 1) and the speed-up.
  rollback  The KDA core after a verification step of k + 1 tokens, two ways to be able to roll it back: keep the
            state at every position (`states_at`, computed inside the chunked pass), or keep the state before the
            step and replay the accepted tokens from it at `crop` (what `KimiK3Cache` does), at the demo's and the
            release's KDA head shapes; ratios to the plain verification step.
  verify    The first --layers decoder layers at the release's width (random weights, bench/decode.py's builder) on
            a static cache after --context tokens: a one-token step against a k + 1-token verification step, each
            a CUDA graph per token count over the model's decode stages (fla's chunked KDA kernel and, with the
            `kda_prefill` path off, its recurrent one), k = 1..8, plus recording and rolling back 2 of 5 tokens.
            Prints the implied speed-up at acceptance 2, 3 and 4.7 tokens a step: a * t(1) / t(k + 1) for the best
            k, on one GPU (the layers' time scaled to the 93-layer model, the LM head and embedding as measured,
            the rollback added) and for TP8 (bench/tp_sim.py's predicted time a token at batch 1 and 8, interpolated
            over the tokens of a step; --tp8-ms to override).

    python -m bench.speculative demo [--checkpoint demo/parent] [--new-tokens 64] [--lookup 10]
    python -m bench.speculative rollback [--device cpu]
    python -m bench.speculative verify --device cuda [--layers 4] [--context 2048] [--out bench/results/spec.json]
    python -m bench.speculative verify --device cpu [--tiny]      # the demo checkpoint, or a smoke run at tiny widths
"""

import argparse
import json
import os
import sys
import time

import torch

from bench import common

ACCEPTANCE = (2.0, 3.0, 4.7)
KS = range(1, 9)

# Code-editing prompts: the code to edit, the instruction as a comment, the start of the edited code. The demo is a
# small code model; edits that copy most of the prompt are what prompt lookup drafts well.
EDIT_PROMPTS = {
    "rewrite a function": (
        "def count_words(text):\n"
        "    counts = {}\n"
        "    for word in text.split():\n"
        "        if word in counts:\n"
        "            counts[word] = counts[word] + 1\n"
        "        else:\n"
        "            counts[word] = 1\n"
        "    return counts\n"
        "\n"
        "\n"
        "# the same function, with counts.get instead of the if\n"
        "def count_words(text):\n"
        "    counts = {}\n"
    ),
    "rename a variable": (
        "def mean(values):\n"
        "    total = 0\n"
        "    for value in values:\n"
        "        total += value\n"
        "    return total / len(values)\n"
        "\n"
        "\n"
        "# the same function with total renamed to acc\n"
        "def mean(values):\n"
        "    acc = 0\n"
    ),
    "add a docstring": (
        "def clamp(x, low, high):\n"
        "    if x < low:\n"
        "        return low\n"
        "    if x > high:\n"
        "        return high\n"
        "    return x\n"
        "\n"
        "\n"
        "# the same function with a docstring\n"
        "def clamp(x, low, high):\n"
        '    """Return x limited to the range [low, high]."""\n'
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# demo: prompt lookup on the CPU demo
# ---------------------------------------------------------------------------------------------------------------


def counted_forwards(model):
    """Count the model's forward calls (each a verification step under prompt lookup); returns the counter list."""
    calls = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = spy
    return calls


def demo(args):
    from transformers import AutoTokenizer

    from modeling_kimi_k3 import KimiK3ForCausalLM

    torch.set_num_threads(args.threads)
    model = KimiK3ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, trust_remote_code=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    calls = counted_forwards(model)
    rows, total = [], {"plain_s": 0.0, "lookup_s": 0.0, "tokens": 0, "steps": 0}
    for name, text in EDIT_PROMPTS.items():
        prompt = tokenizer(text, return_tensors="pt")["input_ids"]
        times = {"plain": [], "lookup": []}
        outputs = {}
        for _ in range(args.reps):  # interleaved, best of: the machine is shared
            for mode, extra in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": args.lookup})):
                calls.clear()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, **extra)
                times[mode].append(time.perf_counter() - t0)
                outputs[mode], steps = out, len(calls)
        new = outputs["lookup"].shape[1] - prompt.shape[1]
        same = outputs["lookup"].tolist() == outputs["plain"].tolist()
        plain_s, lookup_s = min(times["plain"]), min(times["lookup"])
        row = {"prompt": name, "prompt_tokens": prompt.shape[1], "new_tokens": new, "lookup_steps": steps,
               "tokens_per_step": new / steps, "plain_s": plain_s, "lookup_s": lookup_s,
               "speedup": plain_s / lookup_s, "same_tokens": same,
               "completion": tokenizer.decode(outputs["lookup"][0, prompt.shape[1]:])}
        rows.append(row)
        for key, value in (("plain_s", plain_s), ("lookup_s", lookup_s), ("tokens", new), ("steps", steps)):
            total[key] += value
        print(f"{name:20s}: {new} tokens in {steps} steps = {new / steps:.2f} tokens/step; plain {plain_s:.2f} s, "
              f"lookup {lookup_s:.2f} s -> {plain_s / lookup_s:.2f}x; same tokens: {same}", flush=True)
    summary = {"tokens_per_step": total["tokens"] / total["steps"], "speedup": total["plain_s"] / total["lookup_s"]}
    print(f"all prompts: {summary['tokens_per_step']:.2f} tokens/step, {summary['speedup']:.2f}x plain greedy "
          f"(prompt_lookup_num_tokens={args.lookup}, {args.new_tokens} new tokens, fp32, {args.threads} threads)")
    return {"checkpoint": args.checkpoint, "lookup": args.lookup, "threads": args.threads, "rows": rows,
            "summary": summary}


# ---------------------------------------------------------------------------------------------------------------
# rollback: per-position states against replay from the last accepted state
# ---------------------------------------------------------------------------------------------------------------


def best_ms(fn, reps, warmup=1, setup=None):
    """Milliseconds of `fn()`: on a GPU the median of `reps` runs (`common.time_ms`), on a CPU the fastest (a shared
    CPU's median carries other processes' time, the minimum the op's own). `setup()` runs untimed before each."""
    if common.DEVICE == "cuda":
        return common.time_ms(fn, reps, warmup=warmup, setup=setup)
    times = []
    for i in range(warmup + reps):
        if setup:
            setup()
        with common.Timer() as t:
            fn()
        if i >= warmup:
            times.append(t.ms)
    return min(times)


def rollback(args):
    from kda import kda_forward

    device = args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    shapes = {"demo (4 heads x 64)": (4, 64), "release (96 heads x 128)": (96, 128)}
    results = {}
    for label, (heads, dim) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        constants = (torch.zeros(heads, device=device), torch.zeros(heads * dim, device=device), -5.0, dim**-0.5)
        state = torch.randn(1, heads, dim, dim, device=device, generator=gen) * 0.1
        kernel = "chunk" if device == "cuda" else None
        for k in KS:
            n = k + 1
            inputs = [torch.randn(1, n, heads, dim, device=device, generator=gen) for _ in range(4)]
            inputs.append(torch.randn(1, n, heads, device=device, generator=gen))
            accepted = k // 2 + 1  # tokens kept of the step: the last bonus token and half the drafts
            plain = best_ms(lambda: kda_forward(*inputs, *constants, state, kernel=kernel), args.reps)
            every = best_ms(lambda: kda_forward(*inputs, *constants, state, kernel=kernel, states_at=range(n + 1)),
                            args.reps)
            replay = best_ms(lambda: kda_forward(*(t[:, :accepted] for t in inputs), *constants, state,
                                                 kernel=kernel if accepted > 1 else "recurrent"), args.reps)
            results.setdefault(label, {})[k] = {"step_ms": plain, "per_position_states_ms": every,
                                                "replay_ms": replay, "replayed_tokens": accepted}
            print(f"{label:26s} k={k}: step {plain:7.3f} ms; keeping every state {every:7.3f} ms "
                  f"({every / plain:.2f}x); step + replay of {accepted} {plain + replay:7.3f} ms "
                  f"({(plain + replay) / plain:.2f}x)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------------
# verify: the cost of a k + 1-token verification step at real width
# ---------------------------------------------------------------------------------------------------------------


def tp8_times(args):
    """TP8 milliseconds a step of 1 and of 8 tokens (batch 1 and 8 at one token each: an upper bound for one
    sequence's 8 tokens, which read one KDA state and one MLA cache instead of 8)."""
    if args.tp8_ms:
        one, eight = (float(x) for x in args.tp8_ms.split(","))
        return one, eight, "--tp8-ms"
    with open(args.tp_sim) as f:
        predicted = json.load(f)["predicted"]["tpot_ms"]["h200_nvlink"]
    return predicted["1"], predicted["8"], f"{args.tp_sim} predicted.tpot_ms.h200_nvlink"


def best_k(times):
    """For each acceptance a (tokens a step): the k with the largest a * t(1) / t(k + 1) among k >= a - 1."""
    out = {}
    for a in ACCEPTANCE:
        options = {k: a * times[1] / times[k + 1] for k in KS if k + 1 >= a}
        k = max(options, key=options.get)
        out[a] = (k, options[k])
    return out


def build_verify_model(args):
    from modeling_kimi_k3 import KimiK3StaticCache

    if args.tiny:
        from reap_tools.tiny import random_model, tiny_config

        model = random_model(tiny_config(packed=True), seed=0).to(args.device)
        layers_total = model.config.text_config.num_hidden_layers
    elif args.device == "cpu":  # the demo checkpoint: the CPU figure beside the demo mode's
        from modeling_kimi_k3 import KimiK3ForCausalLM

        torch.set_num_threads(args.threads)
        model = KimiK3ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        layers_total = model.config.text_config.num_hidden_layers
    else:
        from bench.decode import build
        from configuration_kimi_k3 import KimiK3Config

        config = KimiK3Config.from_pretrained(common.ROOT)
        layers_total = config.text_config.num_hidden_layers
        model = build(config, args.layers, device=args.device)
    text = model.config.text_config
    gen = torch.Generator(device=args.device).manual_seed(0)
    context = torch.randint(0, text.vocab_size, (1, args.context), device=args.device, generator=gen)
    cache = KimiK3StaticCache(model.config, 1, args.context + 16, cuda_graph=args.device == "cuda")
    with torch.no_grad():
        for start in range(0, args.context, 512):
            model(context[:, start : start + 512], cache=cache, use_cache=True)
    return model, cache, layers_total, gen


def verify(args):
    from kimi_k3_dispatch import use_fast_paths

    model, cache, layers_total, gen = build_verify_model(args)
    text = model.config.text_config
    layers = text.num_hidden_layers
    head = model.language_model.lm_head
    embed = model.language_model.model.embed_tokens

    def ids(n):
        return torch.randint(0, text.vocab_size, (1, n), device=args.device, generator=gen)

    def reset():
        cache.seen_tokens = args.context

    stages = [stage for _, stage, _ in model.decode_stages()]

    def step_ms(n, graph):
        """A step of n tokens on the static cache at --context (put back before each run) through the model's
        decode stages, as a graph-per-k runner would replay it: the cache's mask and position buffers written
        first, then the embedding, the layers, the output mix and the head, one CUDA graph per n where `graph`."""
        x = ids(n)
        reset()
        mask, positions = cache.prepare(None, 1, n, x.device)

        def fn():
            state = (x,)
            for stage in stages:
                state = stage(state, mask, positions, cache)
            return state[0]

        if not graph:
            return best_ms(fn, args.reps, setup=reset), "eager"
        try:
            g, _ = common.graph_of(fn, reset)
        except Exception as err:  # e.g. a host sync somewhere in the path
            print(f"  {n} tokens: not capturable ({type(err).__name__}: {str(err)[:200]}), timed eagerly")
            return best_ms(fn, args.reps, setup=reset), "eager (capture failed)"
        return common.time_ms(g.replay, args.reps, warmup=2), "graph"

    def io_ms(n):
        x = ids(n)
        h = torch.randn(1, n, text.hidden_size, device=args.device, dtype=head.weight.dtype)
        return best_ms(lambda: (embed(x), head(h)), args.reps)

    graph = args.device == "cuda"
    results = {"device": torch.cuda.get_device_name(0) if graph else "cpu", "layers": layers,
               "layer_types": text.layer_types, "context": args.context, "paths": {}}
    with torch.no_grad():
        for label, switches in (("chunked KDA kernel", {}), ("recurrent KDA kernel", {"kda_prefill": "off"})):
            if switches and not graph:
                continue
            times, modes = {}, {}
            with use_fast_paths(model, **switches):
                for n in range(1, 10):
                    times[n], modes[n] = step_ms(n, graph)
            results["paths"][label] = {"step_ms": times, "mode": modes}
            print(f"{label}: 1-token step {times[1]:.3f} ms ({modes[1]})", flush=True)
            for k in KS:
                print(f"  k={k}: {k + 1}-token step {times[k + 1]:.3f} ms = {times[k + 1] / times[1]:.2f}x "
                      f"({modes[k + 1]})", flush=True)
        best_label = min(results["paths"], key=lambda lb: results["paths"][lb]["step_ms"][5])
        times = results["paths"][best_label]["step_ms"]

        # the rollback: a recording verification step of 5 tokens, 2 of them rolled back (eager)
        cache.activate_past_recording()
        x = ids(5)

        def recorded_step():
            model(x, cache=cache, use_cache=True)
            cache.crop(-2)

        recorded = best_ms(recorded_step, args.reps, setup=reset)
        cache.rollback_window = 0
        for layer in cache.layers:
            layer.rollback_window = 0
        plain = best_ms(lambda: model(x, cache=cache, use_cache=True), args.reps, setup=reset)
        results["rollback_overhead_5_tokens"] = {"recording_step_and_crop_ms": recorded, "eager_step_ms": plain}
        print(f"recording + rollback of 2 of 5 tokens: {recorded:.3f} ms against {plain:.3f} ms for the eager step "
              f"({recorded / plain:.2f}x)", flush=True)
        rollback_ms = max(recorded - plain, 0.0)

        io = {n: io_ms(n) for n in range(1, 10)}
    scale = layers_total / layers
    one_gpu = {n: (times[n] - io[n]) * scale + io[n] + (rollback_ms * scale if n > 1 else 0.0) for n in times}
    one, eight, source = tp8_times(args)
    tp8 = {n: one + (eight - one) * (n - 1) / 7 for n in range(1, 10)}
    results.update(best_path=best_label, io_ms=io, rollback_ms=rollback_ms, one_gpu_full_model_ms=one_gpu,
                   tp8_ms=tp8, tp8_source=source)
    print(f"k=4 verification step: {times[5] / times[1]:.2f}x a 1-token step ({best_label}; target <= 1.3x)")
    one_device = f"1 {'GPU' if graph else 'CPU'}, {layers_total} layers" + (" (scaled)" if scale != 1 else "")
    for name, series in ((one_device, one_gpu), ("TP8 prediction", tp8)):
        picks = best_k(series)
        results[f"implied_speedup {name}"] = {str(a): {"k": k, "speedup": s} for a, (k, s) in picks.items()}
        print(f"{name}: 1-token step {series[1]:.2f} ms; implied speed-up "
              + ", ".join(f"at {a:g} tokens/step {s:.2f}x (k={k})" for a, (k, s) in picks.items()))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("demo", "rollback", "verify"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=None, help="repetitions a timing (default: 2 demo, 10 else)")
    parser.add_argument("--checkpoint", default=os.path.join(common.ROOT, "demo", "parent"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4, help="verify: real-width layers (3 KDA + 1 MLA)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="verify: the tiny test config instead of real width")
    parser.add_argument("--tp-sim", default=os.path.join(common.RESULTS, "tp_sim_h200.json"))
    parser.add_argument("--tp8-ms", default=None, help="verify: TP8 ms a step at 1 and 8 tokens, e.g. 30.5,43.9")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.mode == "demo" else 10
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.speculative: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    common.DEVICE = args.device
    if args.mode == "verify" and args.device == "cuda":
        common.quick_tune_from_env()
    started = time.time()
    results = {"demo": demo, "rollback": rollback, "verify": verify}[args.mode](args)
    if args.out:
        common.write_json(args.out, {"mode": args.mode, "elapsed_s": time.time() - started, **results})
    print(f"elapsed {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
