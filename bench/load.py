"""Load speed of the release layout against the storage's: a real-width slice at two sizes, timed on the same files.

Writes a slice of the release (its config cut to a few decoder layers, every MoE layer with all its experts, random
bytes with valid MXFP4 scale codes, shards of the release's size, the release's tensor names and order) and times,
per slice, warm (page cache) and cold (the files' cached pages dropped with `posix_fadvise`, where the OS allows):
  * a plain read of every shard (the floor),
  * `safe_open(...).get_tensor` of every tensor onto the target,
  * `from_pretrained` onto the target (the model's own loader, `kimi_k3_loading.load_model`),
  * one tensor-parallel rank's load of its share, as rank 0 of 8 in one process (`tensor_parallel.shard` on the meta
    model, then `read_tensors` of the rank's byte ranges).
With `--baseline TREE` (a `git archive` of an older commit), that tree's `from_pretrained` is timed on the same
files, in a process of its own. The fixed cost is measured on the full release config (meta build and the name/shape check), and two slice sizes
separate it from the cost per byte: the whole checkpoint (and one TP8 rank's share of it, counted on the full meta
model) is extrapolated from those, at this machine's storage rate.

    python -m bench.load --device cuda --layers 2,4 --baseline OLD_TREE   # on a GPU host
    python -m bench.load --device cpu --layers 2,4 --experts 64 --vocab 16384  # the CPU target, twice in this RAM
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from safetensors import safe_open

from bench.common import RESULTS, ROOT, truncated, write_json
from configuration_kimi_k3 import KimiK3Config
from kimi_k3_loading import (DTYPES, build_on_meta, check_checkpoint, materialize, pieces_for, read_safetensors_headers,
                             read_tensors, release_shapes)
from modeling_kimi_k3 import KimiK3ForCausalLM
from tensor_parallel import TensorParallel, shard

RELEASE_GB = 629.0
SHARD_BYTES = 5 * 10**9  # the release's shards (prune's default --max-shard-size 5GB)
READ_BYTES = 64 << 20
SCALE_CODES = (114, 124)  # E8M0 codes 2^-13 .. 2^-4: valid scales, never NaN (0xFF)


def slice_config(layers, experts, vocab):
    config = truncated(KimiK3Config.from_pretrained(ROOT), layers)
    if experts is not None:
        config.text_config.num_experts = experts
    if vocab is not None:
        config.text_config.vocab_size = vocab
    return config


def write_slice(folder, config, seed=0):
    """The release layout of `config` with random bytes, written shard by shard (name order, at most
    `SHARD_BYTES` each) into a temporary folder renamed to `folder`; returns its bytes."""
    shapes = release_shapes(build_on_meta(KimiK3ForCausalLM, config, torch.bfloat16))
    dtypes = {k: "U8" if k.endswith((".weight_packed", ".weight_scale")) else
              ("F32" if k.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else "BF16") for k in shapes}
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (READ_BYTES,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    scales = torch.randint(*SCALE_CODES, (READ_BYTES,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    shards, current, size = [], [], 0
    for key in sorted(shapes):
        nbytes = DTYPES[dtypes[key]].itemsize * _numel(shapes[key])
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((key, nbytes))
        size += nbytes
    shards.append(current)
    tmp = tempfile.mkdtemp(prefix=".slice-", dir=os.path.dirname(os.path.abspath(folder)))
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for key, nbytes in keys:
            header[key] = {"dtype": dtypes[key], "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for key, nbytes in keys:
                source = scales if key.endswith(".weight_scale") else noise
                for start in range(0, nbytes, READ_BYTES):
                    f.write(source[: min(READ_BYTES, nbytes - start)])
        total += offset
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return total


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def drop_cache(folder):
    """Drop the page cache of the folder's shards (POSIX_FADV_DONTNEED); False where the OS does not offer it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def shards(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def plain_read(folder, device):
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    for path in shards(folder):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def safe_open_read(folder, device):
    """Every tensor through safe_open onto the target: on the CPU a copy out of the mapped file (what a load
    holds), not the lazy mapping itself."""
    for path in shards(folder):
        with safe_open(path, "pt", device=device) as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if device == "cpu":
                    tensor.clone()
    _sync(device)


def from_pretrained(folder, device):
    model = KimiK3ForCausalLM.from_pretrained(folder, device_map=None if device == "cpu" else device,
                                              dtype=torch.bfloat16)
    _sync(device)
    del model


BASELINE = """
import sys, time, torch
sys.path.insert(0, ".")
from modeling_kimi_k3 import KimiK3ForCausalLM
start = time.perf_counter()
model = KimiK3ForCausalLM.from_pretrained(sys.argv[1], device_map=None if sys.argv[2] == "cpu" else sys.argv[2],
                                          dtype=torch.bfloat16)
if sys.argv[2] != "cpu":
    torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def baseline(tree):
    """`from_pretrained` of another tree of this repository (`git archive COMMIT`), in a process of its own."""
    def run(folder, device):
        done = subprocess.run([sys.executable, "-c", BASELINE, folder, device], cwd=tree, capture_output=True,
                              text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        if done.returncode:
            raise RuntimeError(f"baseline {tree}: {done.stderr[-2000:]}")
        return float(done.stdout.split()[-1])  # the load alone, not the process start and imports
    return run


def tp_rank(folder, device, rank=0, size=8):
    """Rank `rank` of `size`'s share, loaded as `load_tensor_parallel` does it, without a process group."""
    config = KimiK3Config.from_pretrained(folder)
    headers = read_safetensors_headers(folder)
    model = build_on_meta(KimiK3ForCausalLM, config, torch.bfloat16)
    check_checkpoint(model, folder, config, headers)
    sources = shard(model, TensorParallel(rank, size))
    materialize(model, lambda name: device)
    read_tensors(folder, headers, pieces_for(model, sources))
    _sync(device)


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, folder, device, cold):
    if cold and not drop_cache(folder):
        return None
    gc.collect()
    start = time.perf_counter()
    own = fn(folder, device)  # a method timed in a process of its own returns its seconds
    seconds = time.perf_counter() - start if own is None else own
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds


def fixed_costs():
    """Seconds of the full release config's meta build and of its name/shape table (what a load does before
    reading), and what one TP8 rank holds of it."""
    config = KimiK3Config.from_pretrained(ROOT)
    start = time.perf_counter()
    model = build_on_meta(KimiK3ForCausalLM, config, torch.bfloat16)
    built = time.perf_counter()
    shapes = release_shapes(model)
    checked = time.perf_counter()
    return {"meta_build_s": built - start, "shape_table_s": checked - built, "tensors": len(shapes),
            "parameters": len(list(model.parameters())),
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "tp8_rank_bytes": tp_bytes(config)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="the load target: cuda, cuda:N or cpu")
    parser.add_argument("--layers", default="2,3", help="decoder layers of the two slices (layer 0 is dense)")
    parser.add_argument("--experts", type=int, default=None, help="experts a MoE layer (default: the release's)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the release's)")
    parser.add_argument("--dir", default=None, help="where to write the slices (default: a temporary folder)")
    parser.add_argument("--baseline", default=None, metavar="TREE",
                        help="also time from_pretrained of this tree of the repository (git archive of an older commit)")
    parser.add_argument("--keep", action="store_true", help="keep the slices written")
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/load_<device>.json)")
    args = parser.parse_args()
    device = args.device
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    root = args.dir or tempfile.mkdtemp(prefix="kimi-k3-load-")
    os.makedirs(root, exist_ok=True)
    fixed = fixed_costs()
    print(f"full config: meta build {fixed['meta_build_s']:.2f} s, shape table {fixed['shape_table_s']:.2f} s "
          f"({fixed['tensors']} tensors in the release, {fixed['parameters']} parameters in the model); "
          f"one TP8 rank holds {fixed['tp8_rank_bytes'] / 1e9:.1f} of {fixed['model_bytes'] / 1e9:.1f} GB")
    methods = {"plain read": plain_read, "safe_open": safe_open_read, "from_pretrained": from_pretrained,
               "tp rank 0 of 8": tp_rank}
    if args.baseline:
        methods["baseline"] = baseline(args.baseline)
    results = {"card": card, "device": device, "fixed": fixed, "slices": []}
    try:
        for layers in (int(n) for n in args.layers.split(",")):
            folder = os.path.join(root, f"slice-{layers}")
            config = slice_config(layers, args.experts, args.vocab)
            nbytes = write_slice(folder, config)
            rank_bytes = tp_bytes(config)
            row = {"layers": layers, "bytes": nbytes, "tp_rank_bytes": rank_bytes, "tensors":
                   len(read_safetensors_headers(folder)), "seconds": {}}
            for cold in (False, True):
                for name, fn in methods.items():
                    if name == "plain read" and not cold:
                        timed(fn, folder, device, False)  # fill the page cache for the warm runs
                    seconds = timed(fn, folder, device, cold)
                    row["seconds"][f"{name}, {'cold' if cold else 'warm'}"] = seconds
            results["slices"].append(row)
            _print_slice(row, card)
            if not args.keep:
                shutil.rmtree(folder)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    _print_extrapolation(results)
    write_json(args.out or os.path.join(RESULTS, f"load_{'gpu' if device.startswith('cuda') else 'cpu'}.json"),
               results)


def tp_bytes(config):
    model = build_on_meta(KimiK3ForCausalLM, config, torch.bfloat16)
    shard(model, TensorParallel(0, 8))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _print_slice(row, card):
    print(f"\n=== slice of {row['layers']} decoder layers: {row['bytes'] / 1e9:.2f} GB, {row['tensors']} tensors, "
          f"on {card} ===")
    for mode in ("warm", "cold"):
        floor = row["seconds"][f"plain read, {mode}"]
        if floor is None:
            print(f"{mode}: not measured (no posix_fadvise)")
            continue
        for name in ("plain read", "safe_open", "from_pretrained", "tp rank 0 of 8", "baseline"):
            seconds = row["seconds"].get(f"{name}, {mode}")
            if seconds is None:
                continue
            nbytes = row["tp_rank_bytes"] if name.startswith("tp") else row["bytes"]
            rate = nbytes / 1e9 / seconds
            print(f"{mode:4} {name:16} {seconds:7.2f} s  {rate:6.2f} GB/s  "
                  f"{rate / (row['bytes'] / 1e9 / floor):.2f}x plain read")


def _print_extrapolation(results):
    rows = results["slices"]
    if len(rows) < 2:
        return
    fixed = results["fixed"]
    print(f"\n=== whole checkpoint ({RELEASE_GB:.0f} GB), extrapolated from the two slices ===")
    for mode in ("warm", "cold"):
        for name, size_key, whole in (("from_pretrained", "bytes", RELEASE_GB * 1e9),
                                      ("tp rank 0 of 8", "tp_rank_bytes", fixed["tp8_rank_bytes"]),
                                      ("baseline", "bytes", RELEASE_GB * 1e9)):
            (a, t1), (b, t2) = ((r[size_key], r["seconds"].get(f"{name}, {mode}")) for r in rows[:2])
            floor = [r["seconds"][f"plain read, {mode}"] for r in rows[:2]]
            if None in (t1, t2) or None in floor:
                continue
            per_byte = (t2 - t1) / (b - a)
            fixed_s = t1 - per_byte * a
            read_rate = (rows[1]["bytes"] - rows[0]["bytes"]) / 1e9 / (floor[1] - floor[0])
            print(f"{mode:4} {name:16}: {fixed_s:5.1f} s fixed + {1e9 * per_byte:.3f} s/GB -> "
                  f"{(fixed_s + per_byte * whole) / 60:5.2f} min for {whole / 1e9:.0f} GB "
                  f"(storage here: {read_rate:.2f} GB/s plain read)")


if __name__ == "__main__":
    main()
