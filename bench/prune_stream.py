"""Benchmark the streaming prune against a plain copy of the same shards.

    python -m bench.prune_stream [--size-gb 2.5] [--keep-frac 0.36] [--dir /tmp] [--repeat 2]

Builds a synthetic MXFP4 checkpoint of about --size-gb (random bytes, release tensor names,
--experts per layer, as many MoE layers as the size needs) in a temporary dir, then times
(a) shutil.copyfile of every shard and (b) `python -m reap_tools prune` keeping --keep-frac of
the experts (scattered ids), as a subprocess whose peak RSS (ru_maxrss from wait4) is compared
with the same interpreter after importing reap_tools.prune. All read from a warm page cache and
start with no dirty pages (os.sync); each is run --repeat times, best time counts. The prune
fsyncs its output, so "copy + fsync" is the like-for-like baseline; the plain copy is also shown. Targets: prune <= 1.5x copy, RSS < 1 GB above baseline.
The prune output is then checked with `verify --source`.

Metadata at full scale (92-ish layers x 896 experts, ~450k tiny tensors; per-tensor overhead and
header memory rather than bandwidth):
    python -m bench.prune_stream --experts 896 --hidden 64 --latent 32 --inter 32 --vocab 64 \
        --size-gb 0.135 --keep-frac 0.3572 --shard-bytes 3000000 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from reap_tools.checkpoint import INDEX_NAME, encode_header, human
from reap_tools.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]

P = "language_model.model.layers."
NOISE = os.urandom(64 << 20)


def random_bytes(n: int, state: list[int]):
    """Yield n pseudo-random bytes in chunks, cycling through one 64 MB urandom block."""
    while n:
        pos = state[0] % len(NOISE)
        chunk = NOISE[pos:pos + min(n, len(NOISE) - pos)]
        state[0] += len(chunk) + 4099
        n -= len(chunk)
        yield chunk


def tensor_plan(layers: int, experts: int, hidden: int, latent: int, inter: int, vocab: int):
    """(name, dtype, shape, nbytes) of a release-layout checkpoint; layer 0 dense, the rest MoE."""
    def bf16(name, *shape):
        return name, "BF16", shape, 2 * math.prod(shape)

    def u8(name, *shape):
        return name, "U8", shape, math.prod(shape)

    out = [bf16("language_model.model.embed_tokens.weight", vocab, hidden)]
    for i in range(layers):
        p = f"{P}{i}."
        out += [bf16(p + "input_layernorm.weight", hidden), bf16(p + "post_attention_layernorm.weight", hidden),
                bf16(p + "self_attn.o_proj.weight", hidden, hidden)]
        if i == 0:
            out += [bf16(f"{p}mlp.{w}.weight", 2 * hidden, hidden) for w in ("gate_proj", "up_proj", "down_proj")]
            continue
        m = p + "block_sparse_moe."
        out += [bf16(m + "gate.weight", experts, hidden),
                (m + "gate.e_score_correction_bias", "F32", (experts,), 4 * experts),
                bf16(m + "routed_expert_down_proj.weight", latent, hidden),
                bf16(m + "routed_expert_up_proj.weight", hidden, latent)]
        for e in range(experts):
            for w, (rows, cols) in (("w1", (inter, latent)), ("w2", (latent, inter)), ("w3", (inter, latent))):
                out += [u8(f"{m}experts.{e}.{w}.weight_packed", rows, cols // 2),
                        u8(f"{m}experts.{e}.{w}.weight_scale", rows, cols // 32)]
    out += [bf16("language_model.model.norm.weight", hidden), bf16("language_model.lm_head.weight", vocab, hidden)]
    return out


def build(path: Path, args) -> tuple[int, int, int]:
    """Write the synthetic checkpoint; returns (MoE layers, tensors, bytes)."""
    def size(moe_layers):
        plan = tensor_plan(moe_layers + 1, args.experts, args.hidden, args.latent, args.inter, args.vocab)
        return sum(t[3] for t in plan)
    per_layer = size(2) - size(1)
    moe_layers = max(1, round((args.size_gb * 1e9 - size(0)) / per_layer))
    plan = tensor_plan(moe_layers + 1, args.experts, args.hidden, args.latent, args.inter, args.vocab)
    shards, size = [[]], 0
    for t in plan:
        if shards[-1] and size + t[3] > args.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[3]
    path.mkdir()
    weight_map, state = {}, [0]
    with tqdm(total=sum(t[3] for t in plan), unit="B", unit_scale=True, desc="build") as bar:
        for k, shard in enumerate(shards):
            name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            with open(path / name, "wb") as f:
                f.write(encode_header(shard))
                for t in shard:
                    for chunk in random_bytes(t[3], state):
                        f.write(chunk)
                    bar.update(t[3])
                    weight_map[t[0]] = name
                f.flush()
                os.fsync(f.fileno())  # no writeback of the build may overlap the timed runs
    total = sum(t[3] for t in plan)
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"model_type": "kimi_k3", "text_config": {
        "num_hidden_layers": moe_layers + 1, "hidden_size": args.hidden, "num_experts": args.experts,
        "num_experts_per_token": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_intermediate_size": args.inter, "routed_expert_hidden_size": args.latent},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                "config_groups": {"group_0": {"weights": {"group_size": 32}}}}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return moe_layers, len(plan), total


# Spawned from the benchmark (a big process), a child's ru_maxrss would start at the parent's
# high-water mark (Linux carries it across vfork+exec). A small launcher process spawns the
# measured command instead and reports that grandchild's ru_maxrss from wait4.
LAUNCHER = ("import os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:]); "
            "_, status, usage = os.wait4(p.pid, 0); "
            "print(os.waitstatus_to_exitcode(status), time.perf_counter() - t, usage.ru_maxrss * 1024)")


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Run cmd through the launcher; return (wall seconds, peak RSS bytes of cmd's process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], cwd=ROOT, env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout.split()
    rc, wall, rss = int(out[-3]), float(out[-2]), int(out[-1])
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {rc}")
    return wall, rss


def timed_copy(shards: list[Path], out: Path, fsync: bool) -> float:
    """Seconds to shutil.copyfile every shard into a fresh dir (optionally fsyncing each)."""
    out.mkdir()
    os.sync()
    t0 = time.perf_counter()
    for s in shards:
        shutil.copyfile(s, out / s.name)
        if fsync:
            fd = os.open(out / s.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(out)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.5, help="synthetic checkpoint size (default 2.5)")
    ap.add_argument("--keep-frac", type=float, default=0.36, help="fraction of experts kept (default 0.36)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts per layer (default 128)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--latent", type=int, default=1024, help="routed_expert_hidden_size (default 1024)")
    ap.add_argument("--inter", type=int, default=768, help="moe_intermediate_size (default 768)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard-bytes", type=int, default=500_000_000, help="source shard size (default 500 MB)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each (default 3)")
    ap.add_argument("--dir", type=Path, default=None, help="where to make the temporary dir")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prune_bench_", dir=args.dir) as tmp:
        tmp = Path(tmp)
        src = tmp / "src"
        moe_layers, n_tensors, total = build(src, args)
        keep = max(8, round(args.experts * args.keep_frac))
        rng = random.Random(0)
        sel = {"criterion": "random", "layers": {str(i): sorted(rng.sample(range(args.experts), keep))
                                                 for i in range(1, moe_layers + 1)}}
        (tmp / "sel.json").write_text(json.dumps(sel))
        shards = sorted(src.glob("*.safetensors"))
        print(f"synthetic checkpoint: {human(total)} in {len(shards)} shards, {moe_layers} MoE layers x "
              f"{args.experts} experts, {n_tensors} tensors; keep {keep}/{args.experts} ({keep / args.experts:.1%})")
        for s in shards:  # warm the page cache so both sides read from memory
            with open(s, "rb") as f:
                while f.read(64 << 20):
                    pass
        copies, synced, prunes, rss = [], [], [], 0
        for r in range(args.repeat):
            copies.append(timed_copy(shards, tmp / "copy", fsync=False))
            synced.append(timed_copy(shards, tmp / "copy", fsync=True))
            dst = tmp / f"pruned{r}"
            os.sync()
            wall, peak = run_measured([sys.executable, "-m", "reap_tools", "prune", str(src), str(dst),
                                       "--selection", str(tmp / "sel.json"), "--no-progress"])
            prunes.append(wall)
            rss = max(rss, peak)
            if r < args.repeat - 1:
                shutil.rmtree(dst)
        _, base = run_measured([sys.executable, "-c", "import reap_tools.prune"])
        out_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
        copy_t, synced_t, prune_t = min(copies), min(synced), min(prunes)

        def runs(ts):
            return ", ".join(f"{t:.2f}" for t in ts)
        print(f"copy         (shutil.copyfile of {human(total)}): best {copy_t:.2f} s "
              f"({total / copy_t / 1e9:.2f} GB/s); runs {runs(copies)}")
        print(f"copy + fsync (same, each file fsynced): best {synced_t:.2f} s "
              f"({total / synced_t / 1e9:.2f} GB/s); runs {runs(synced)}")
        print(f"prune        (subprocess, writes {human(out_bytes)}, fsynced): best {prune_t:.2f} s "
              f"({out_bytes / prune_t / 1e9:.2f} GB/s written); runs {runs(prunes)}")
        print(f"ratio prune / copy = {prune_t / copy_t:.2f}, prune / (copy + fsync) = {prune_t / synced_t:.2f} "
              f"(target <= 1.5)")
        print(f"peak RSS prune {human(rss)}, interpreter + import baseline {human(base)}: "
              f"+{human(rss - base)} (target < 1 GB)")
        t0 = time.perf_counter()
        res = verify_checkpoint(dst, source=src, progress=False)
        print(f"verify --source: {'OK' if res.ok else 'FAILED'} in {time.perf_counter() - t0:.2f} s: {res.summary()}")


if __name__ == "__main__":
    main()
