"""The kernels one decode step launches, per layer kind, whole and as rank 0 of TP8, counted on the CPU.

The release's architecture at tiny widths (`bench.tp_sim`'s, every TP8 split even) with four decoder layers (the
release's first four: KDA + dense MLP, two KDA + MoE, MLA + MoE) runs one-token decode steps on a fake GPU
(`bench.fake_gpu`: CPU tensors that report a CUDA device, so every CUDA branch and fast path is taken, side streams
and graphs apart), through the decode graph's stages on a static cache (its mask and positions as `prepare` makes
them). Counted per stage:
  * Triton kernels and fla's KDA entry points (recorded, not run);
  * aten ops that launch a CUDA kernel: every op but views, allocations without a fill and host reads (a host read
    is counted apart: it would break a CUDA graph);
  * GEMMs among them (mm, addmm, bmm, `_grouped_mm`); cuBLAS may add a split-K reduction to some, not counted;
  * `tensor_parallel.all_reduce` calls (rank 0 of 8, the model sharded by `tensor_parallel.shard`).
The counts depend on the code path, not on the widths (the expert kernels' blocks at batch 1 are one a pair). A
decode step's block bank is one buffer that the depth mixes read in place, which the model recognises by tensor
identity and the fake GPU's aliases lose: a `stack` of rows that lie one after another in one storage (the leading
rows of such a buffer) is not counted (tests/test_decode_glue.py checks on real tensors that no stack runs). A GPU
profile (`bench.tp_sim`) counts what really launches; this count runs anywhere, and is what the CPU can say.

    python -m bench.kernel_count [--batch 1 8] [--trace] [--out bench/results/kernel_count.json]
"""

import argparse
import collections
import contextlib
import copy
import json
import os
import traceback
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tensor_parallel
from bench import common
import mxfp4_triton
from bench.fake_gpu import FakeGpuMode, recorded_launches, stand_in, standing_in, to_fake_gpu
from bench.tp_sim import load_config
from kimi_k3_dispatch import use_fast_paths
from reap_tools.tiny import random_model
from tensor_parallel import TensorParallel, shard

TP = 8
CONTEXT = 16
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm"}
# aten ops that launch no kernel: allocations without a fill, and what only changes metadata
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "_unsafe_view", "_reshape_alias",
             "alias", "resize_", "set_", "_has_compatible_shallow_copy_type", "is_same_size", "sym_size",
             "sym_stride", "sym_numel", "sym_storage_offset", "record_stream"}
HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero"}


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops under it that launch a kernel, in `counts[label]` (a Counter by op name)."""

    def __init__(self):
        super().__init__()
        self.label = None
        self.counts = collections.defaultdict(collections.Counter)
        self.trace = None  # a list: each counted op's (label, name, where in the model's code)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        counted = not func.is_view and name not in NO_KERNEL and self.label is not None and not standing_in()
        if counted and not (name == "stack" and _rows_of_one_buffer(args[0])):  # bank rows: a view on a GPU
            if self.trace is not None:
                self.trace.append((self.label, name, _model_frame()))
            self.counts[self.label]["host read: " + name if name in HOST_READS else name] += 1
        return func(*args, **(kwargs or {}))


def _rows_of_one_buffer(rows):
    """Whether `rows` lie one after another in one storage, each right after the previous, from the storage's start."""
    first = rows[0]
    size = first.numel() * first.element_size()
    return all(r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and r.is_contiguous()
               and r.data_ptr() == first.untyped_storage().data_ptr() + i * size for i, r in enumerate(rows))


class OneKernelOnCuda(TorchFunctionMode):
    """Torch functions that are one CUDA kernel but a composite of several ops on the CPU (`F.rms_norm`): counted
    once, as `counter` counts a kernel, their CPU ops not."""

    FUNCTIONS = {F.rms_norm: "rms_norm"}

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = self.FUNCTIONS.get(func)
        if name is None or standing_in():
            return func(*args, **(kwargs or {}))
        if self.counter.label is not None:
            self.counter.counts[self.counter.label][name] += 1
        with stand_in():
            return func(*args, **(kwargs or {}))


def _model_frame():
    """file:line function of the innermost frame in the model's own code."""
    for frame in reversed(traceback.extract_stack()):
        if os.path.dirname(os.path.abspath(frame.filename)) == common.ROOT:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def build_model():
    """The release config at tiny widths, four decoder layers as the release's first four: KDA + dense MLP, KDA + MoE
    twice, MLA + MoE; bf16 but the parameters a load keeps in fp32."""
    config = load_config(tiny=True)
    d = config.to_dict()
    d["text_config"].update(num_hidden_layers=4)
    d["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    config = type(config)(**d)
    model = random_model(config, seed=0).to(torch.bfloat16).eval()
    for name, param in model.named_parameters():  # in fp32, as a bf16 load keeps them
        if name.rsplit(".", 1)[-1] in model._keep_in_fp32_modules:
            param.data = param.data.float()
    return model


def stage_labels(model):
    text = model.config.text_config
    kinds = ["dense0" if not text.experts_in_layer(i) else f"{text.layer_types[i]}_moe"
             for i in range(text.num_hidden_layers)]
    return ["embed", *(f"layer {i} ({kind})" for i, kind in enumerate(kinds)), "output", "head"]


def count_step(model, batch, trace=False):
    """{stage label: {"kernels", "gemms", "triton", "all_reduces", "host_reads", "ops"}} for one decode step at
    `batch` rows on the fake GPU, after a first step (the cache's lazily made buffers are made there), the blocks'
    projections merged there as a load merges them."""
    to_fake_gpu(model).merge_projections()
    counter, reduces = KernelCounter(), collections.Counter()
    counter.trace = [] if trace else None

    def all_reduce(x, group=None):
        reduces[counter.label] += 1
        return x

    labels = stage_labels(model)
    with contextlib.ExitStack() as stack:
        launches = stack.enter_context(recorded_launches(mxfp4_triton.UPCAST_ONCE_MIN_PAIRS_PER_EXPERT))
        stack.enter_context(mock.patch.object(tensor_parallel, "all_reduce", all_reduce))
        stack.enter_context(use_fast_paths(model, side_streams="off", cuda_graphs="off", experts="on", kda="on",
                                           kda_prefill="on", fused="on"))
        stack.enter_context(torch.no_grad())
        stack.enter_context(FakeGpuMode())
        stack.enter_context(OneKernelOnCuda(counter))
        cache = model.make_static_cache(batch, CONTEXT + 4, cuda_graph=False)
        cache.advance(CONTEXT)
        device = torch.device("cuda", 1)
        tokens = torch.full((batch, 1), 7, dtype=torch.long, device=device)
        for step in range(2):
            stack_counter = contextlib.nullcontext() if step == 0 else counter
            with stack_counter:
                marks = {}
                mask, positions = cache.prepare(None, batch, 1, device)
                state = (tokens,)
                for label, (_, stage, _) in zip(labels, model.decode_stages()):
                    counter.label = label
                    marks[label] = len(launches)
                    state = stage(state, mask, positions, cache)
                counter.label = None
                cache.advance(1)
            if step == 0:
                launches.clear()
                reduces.clear()
    out = {}
    ends = list(marks.values())[1:] + [len(launches)]
    for (label, start), end in zip(marks.items(), ends):
        ops = counter.counts[label]
        triton = collections.Counter(name for name, _, _ in launches[start:end])
        torch_kernels = sum(n for op, n in ops.items() if not op.startswith("host read"))
        out[label] = {"kernels": torch_kernels + sum(triton.values()), "gemms": sum(ops[g] for g in GEMMS),
                      "triton": dict(triton), "all_reduces": reduces[label],
                      "host_reads": sum(n for op, n in ops.items() if op.startswith("host read")),
                      "ops": dict(sorted(ops.items()))}
        if counter.trace is not None:
            out[label]["trace"] = [f"{op} @ {where}" for at, op, where in counter.trace if at == label]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--trace", action="store_true", help="also list each counted op and where the model calls it")
    parser.add_argument("--out", default=os.path.join(common.ROOT, "bench", "results", "kernel_count.json"))
    args = parser.parse_args()
    results = {"method": __doc__.split("\n\n")[1], "tp": TP, "context": CONTEXT, "steps": {}}
    base = build_model()
    for batch in args.batch:
        for name in ("tp1", f"tp{TP} rank 0"):
            model = copy.deepcopy(base)
            if name != "tp1":
                shard(model, TensorParallel(0, TP))
            counts = count_step(model, batch, args.trace)
            results["steps"][f"{name} b{batch}"] = counts
            print(f"{name}, batch {batch}: kernels (GEMMs, Triton) + all-reduces a stage")
            for label, c in counts.items():
                triton = ", ".join(f"{k} {v}" if v > 1 else k for k, v in sorted(c["triton"].items()))
                reads = f"; {c['host_reads']} host reads" if c["host_reads"] else ""
                print(f"  {label:18s} {c['kernels']:3d} ({c['gemms']} GEMMs, {sum(c['triton'].values())} Triton)"
                      f" + {c['all_reduces']} AR{reads}   [{triton}]")
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
