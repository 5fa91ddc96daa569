"""Layer-sequential observe (`reap_tools.sequential`) of one real-width parent MoE layer of each kind, on one GPU.

For a KDA+MoE layer (index 90) and an MLA+MoE layer (index 91) of the parent's config (`tests/fixtures/
parent_config.json`: hidden 7168, 896 MXFP4 experts 3584 <-> 3072, top-16), random weights (`common.build_layer`):
  * the layer is written to a safetensors file under the release's names and `load_layer` is timed reading it, cold
    (the file's pages dropped from the page cache with posix_fadvise) and hot;
  * random carried states for `--tokens` tokens (the 8 block snapshots and the partial sum a token has there) are put
    in a `CarriedState`, and `run_layer` is timed over them: what `observe --sequential` does at that layer (the state
    to the GPU, the layer under the observer's hooks, the new partial sum back and written to the scratch folder);
  * the reference, measured in the same run: the layer's forward alone over the same states, already on the GPU
    (observe / forward says what the statistics and the state traffic cost);
then the parent is extrapolated: 93 layers (69 KDA, the dense layer 0 counted as one, + 24 MLA) on 1M calibration
tokens, on one GPU and on 8 (the sequences split; every GPU loads every layer, cold).

    python -m bench.observe_layer [--tokens 8192] [--seq-len 2048] [--batch-size 1] [--out FILE]
    python -m bench.observe_layer --device cpu --quick      # a smoke run at tiny widths
"""

import argparse
import json
import os
import re
import tempfile
import time

import torch

from bench import common
from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import new_dispatch
from reap_tools import sequential as sq
from reap_tools.checkpoint import encode_header

PARENT_CONFIG = os.path.join(common.ROOT, "tests", "fixtures", "parent_config.json")
PARENT_LAYERS = {"kda": 69, "mla": 24}
CALIBRATION_TOKENS = 1_000_000
SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}
STACKED = re.compile(r"^(block_sparse_moe\.experts\.)(w[123]\.weight_(?:packed|scale))$")


def release_tensors(layer, index):
    """The layer's tensors on the CPU under the release's names: a stacked expert parameter [E, ...] as E tensors
    `experts.{e}.w1.weight_packed` ... (views of one CPU copy)."""
    prefix = sq.LAYER_PREFIX.format(index)
    out = {}
    for key, tensor in layer.state_dict().items():
        host = tensor.detach().cpu().contiguous()
        m = STACKED.match(key)
        if m and host.dim() == 3:
            out.update({f"{prefix}{m[1]}{e}.{m[2]}": host[e] for e in range(host.shape[0])})
        else:
            out[prefix + key] = host
    return out


def write_shard(tensors, path):
    """`tensors` as one safetensors file, streamed (views need no copies), fsynced; then its pages are dropped from
    the page cache, so the next read comes from the disk."""
    entries = [(name, SAFETENSORS_NAMES[t.dtype], tuple(t.shape), t.numel() * t.element_size())
               for name, t in tensors.items()]
    with open(path, "wb") as f:
        f.write(encode_header(entries))
        for t in tensors.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return sum(e[3] for e in entries)


def timed_load(config, index, checkpoint, device, dtype):
    """(the layer built and filled from `checkpoint`, seconds)."""
    common.sync()
    t0 = time.perf_counter()
    layer = sq.build_layer(config, index, dtype, device, new_dispatch(config))
    sq.load_layer(layer, checkpoint, index)
    common.sync()
    return layer, time.perf_counter() - t0


def random_states(text, index, batches, batch, length, seed):
    """Per batch, the state a token has after layer index-1: its block snapshots and the partial sum (CPU, bf16)."""
    g = torch.Generator().manual_seed(seed)
    rows = (index - 1) // text.attn_res_block_size + 1

    def one():
        return torch.randn(batch, length, text.hidden_size, generator=g).to(torch.bfloat16)

    return [(tuple(one() for _ in range(rows)), one()) for _ in range(batches)]


def best_of(reps, fn, setup=None):
    """The fastest of `reps` timed runs of `fn()` (`setup()` untimed before each), in seconds."""
    times = []
    for _ in range(reps):
        if setup:
            setup()
        common.sync()
        t0 = time.perf_counter()
        fn()
        common.sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_kind(config, kind, index, args, scratch):
    text = config.text_config
    device = torch.device(common.DEVICE)
    entry = {"layer_idx": index}
    built = common.build_layer(text, index, seed=index)  # random weights, the experts' packs random bytes
    tensors = release_tensors(built, index)
    del built
    if common.DEVICE == "cuda":
        torch.cuda.empty_cache()
    shard = os.path.join(scratch, "model.safetensors")
    entry["layer_bytes"] = write_shard(tensors, shard)
    del tensors
    checkpoint = sq.Checkpoint(scratch)
    layer, entry["load_cold_s"] = timed_load(config, index, checkpoint, device, torch.bfloat16)
    del layer
    if common.DEVICE == "cuda":
        torch.cuda.empty_cache()
    layer, entry["load_hot_s"] = timed_load(config, index, checkpoint, device, torch.bfloat16)
    os.unlink(shard)

    batches = max(1, args.tokens // (args.batch_size * args.seq_len))
    tokens = batches * args.batch_size * args.seq_len
    states = random_states(text, index, batches, args.batch_size, args.seq_len, seed=index)
    calibration = [{"input_ids": torch.zeros(args.batch_size, args.seq_len, dtype=torch.long),
                    "attention_mask": torch.ones(args.batch_size, args.seq_len, dtype=torch.long)}
                   for _ in range(batches)]
    store = sq.CarriedState(os.path.join(scratch, "state"), None)
    for b, (bank, partial) in enumerate(states):
        store.put(b, index - 1, bank, partial)
    entry["carried_bytes_per_token"] = (len(states[0][0]) + 1) * text.hidden_size * 2

    on_device = [(tuple(r.to(device) for r in bank), partial.to(device)) for bank, partial in states]

    def forward():
        with torch.inference_mode():
            for bank, partial in on_device:
                sq.run_batch(layer, bank, partial, None, args.chunk)

    forward()  # warm-up: kernels compiled and tuned
    entry["forward_s"] = best_of(args.reps, forward)
    on_device.clear()

    def observe():
        return sq.run_layer(layer, index, calibration, list(range(batches)), store, args.chunk,
                            text.attn_res_block_size)

    def reset():  # the states before the layer again, its outputs gone
        for b, (bank, partial) in enumerate(states):
            store.put(b, index - 1, bank, partial)
        store.forget(range(batches), index)

    def state_io():  # what observe moves besides the layer: each state to the device, the new partial back and out
        for b in range(batches):
            bank, partial = store.get(b, index - 1, text.attn_res_block_size)
            on = partial.to(device)
            for row in bank:
                row.to(device)
            store.put(b, index, bank, on.cpu())
        store.sync()

    stats = observe()  # warm-up (the observer's own expert calls)
    entry["observe_s"] = best_of(args.reps, observe, reset)
    entry["state_io_s"] = best_of(args.reps, state_io, reset)
    entry["tokens"] = tokens
    entry["routed_pairs_counted"] = int(stats[0].sum())
    entry["tok_s"] = tokens / entry["observe_s"]
    entry["forward_tok_s"] = tokens / entry["forward_s"]
    entry["observe_over_forward"] = entry["observe_s"] / entry["forward_s"]
    del layer
    if common.DEVICE == "cuda":
        torch.cuda.empty_cache()
    return entry


def extrapolate(layers, gpus, tokens=CALIBRATION_TOKENS, load="load_cold_s"):
    """Hours for the parent's 93 layers on `tokens` calibration tokens split over `gpus` GPUs, each loading every
    layer."""
    seconds = sum(count * (tokens / gpus / layers[kind]["tok_s"] + layers[kind][load])
                  for kind, count in PARENT_LAYERS.items())
    return seconds / 3600


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny widths on the CPU (a smoke run), or fewer tokens")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens through each layer")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=8192, help="--prefill-chunk")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each (the fastest counts)")
    ap.add_argument("--scratch", help="folder for the layer file and the carried state (default: a temporary one)")
    ap.add_argument("--out", help="results JSON (default on CUDA: bench/results/observe_layer.json)")
    args = ap.parse_args()
    common.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu --quick for a smoke run)")
    if args.device == "cpu":
        from reap_tools.tiny import parent_text_config, tiny_config

        config = tiny_config(**parent_text_config(routed_expert_hidden_size=64, moe_intermediate_size=64))
        kinds = (("kda", 5), ("mla", 7))
        if args.quick:
            args.tokens, args.seq_len = 256, 64
    else:
        with open(PARENT_CONFIG) as f:
            config = KimiK3Config(**json.load(f))
        kinds = (("kda", 90), ("mla", 91))
        if args.quick:
            args.tokens = min(args.tokens, 4096)
    text = config.text_config
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "triton": common.package_version("triton"),
               "config": {"hidden_size": text.hidden_size, "num_experts": text.num_experts,
                          "num_experts_per_token": text.num_experts_per_token},
               "args": vars(args), "layers": {}}
    print(f"{results['device']}: {text.num_experts} experts, hidden {text.hidden_size}, {args.tokens} tokens "
          f"({args.batch_size} x {args.seq_len} a batch), prefill chunk {args.chunk}", flush=True)
    with tempfile.TemporaryDirectory(prefix="observe-layer-", dir=args.scratch) as scratch:
        for kind, index in kinds:
            e = bench_kind(config, kind, index, args, scratch)
            results["layers"][kind] = e
            print(f"{kind} layer {index}: {e['tok_s']:.0f} tokens/s observed ({e['forward_tok_s']:.0f} the forward "
                  f"alone: observe/forward {e['observe_over_forward']:.2f}x; moving and writing the state "
                  f"{e['state_io_s'] / e['observe_s']:.0%} of observe); load {e['layer_bytes'] / 1e9:.2f} GB in "
                  f"{e['load_cold_s']:.1f}s cold ({e['layer_bytes'] / 1e9 / e['load_cold_s']:.2f} GB/s), "
                  f"{e['load_hot_s']:.1f}s hot; carried state {e['carried_bytes_per_token']} bytes a token "
                  f"({e['carried_bytes_per_token'] * CALIBRATION_TOKENS / 1e9:.0f} GB for 1M tokens)", flush=True)
    layers = results["layers"]
    results["parent_hours_1M_tokens"] = {"1_gpu": extrapolate(layers, 1), "8_gpus": extrapolate(layers, 8),
                                         "1_gpu_hot_loads": extrapolate(layers, 1, load="load_hot_s"),
                                         "8_gpus_hot_loads": extrapolate(layers, 8, load="load_hot_s")}
    hours = results["parent_hours_1M_tokens"]
    print(f"parent (69 KDA + 24 MLA layers) on 1M calibration tokens: {hours['1_gpu']:.1f} h on 1 GPU, "
          f"{hours['8_gpus']:.2f} h on 8 (cold layer loads; hot: {hours['1_gpu_hot_loads']:.1f} h / "
          f"{hours['8_gpus_hot_loads']:.2f} h); targets 12 h / 2 h", flush=True)
    out = args.out or (os.path.join(common.RESULTS, "observe_layer.json") if args.device == "cuda" else None)
    if out:
        common.write_json(out, results)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
