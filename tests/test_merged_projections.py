"""Projections merged at load (issue 44), CPU: the linear layers of a block that read the same input (KDA's q, k, v,
g, f_a and b; MLA's q_a, kv_a and g; an MLP's gate and up) share one weight buffer, each parameter a view of its
rows, and run as one matmul. The outputs are the separate projections' (bit for bit for one row, as a decode step at
batch 1 has; within fp32 summation order for several rows), the parameters, `state_dict` and saved checkpoints are
unchanged, a tensor-parallel rank merges its own slices, `.to()` merges again, autograd takes the separate path, and
a decode step launches one GEMM a group.
"""

import collections
import copy
import importlib.util
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensor_parallel
from kimi_k3_dispatch import use_fast_paths
from modeling_kimi_k3 import (KimiK3DeltaAttention, KimiK3ForCausalLM, KimiK3MLAttention, KimiK3MLP,
                              MergedProjections, merge_block_projections)
from reap_tools.tiny import random_model, tiny_config, write_checkpoint
from tensor_parallel import TensorParallel, shard
from test_loader import assert_same_bytes, shard_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8]])
GEMMS = {"mm", "addmm", "bmm"}


def blocks(model):
    return [m for m in model.modules() if isinstance(m, MergedProjections)]


def merged_model(dtype=torch.float32, seed=0):
    """The tiny random model (dense layer 0, KDA and MLA layers, shared experts) in `dtype` and a merged copy."""
    model = random_model(tiny_config(), seed=seed).to(dtype)
    merged = copy.deepcopy(model)
    merged.merge_projections()
    return model, merged


def assert_views_of_the_buffer(block):
    """Each merged weight is a view of its rows of the block's buffer: no copy held beside it."""
    buffer = block.merged_weight()
    assert buffer is not None
    row = 0
    for name in block.merged:
        weight = getattr(block, name).weight
        assert weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
        assert torch.equal(weight, buffer[row : row + weight.shape[0]]), name
        row += weight.shape[0]
    assert row == buffer.shape[0]


def assert_within_summation_order(got, want, x, weight):
    """fp32 sums of the same products in another order: apart by at most 2 n eps sum |x_i w_i| (n the inner size),
    and in bf16 by one more rounding of the result."""
    bound = 2 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    if want.dtype != torch.float32:
        bound = bound + torch.finfo(want.dtype).eps * want.abs().double()
    assert bool(((got.double() - want.double()).abs() <= bound).all())


def run(model, merged_on, *args, **kwargs):
    with torch.no_grad(), use_fast_paths(model, merged_projections="on" if merged_on else "off"):
        return model(*args, **kwargs)


class GemmCounter(TorchDispatchMode):
    """Counts the GEMMs (aten mm, addmm, bmm) run under it, in `counts[label]`."""

    def __init__(self):
        super().__init__()
        self.label, self.counts = None, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.label] += func.overloadpacket.__name__ in GEMMS
        return func(*args, **(kwargs or {}))


def test_the_cpu_takes_the_merged_path_only_when_asked():
    """"auto" merges the matmuls on CUDA only (`_taken_by_auto`); "on" takes them on the CPU too."""
    from kimi_k3_dispatch import resolve_fast_paths

    assert not resolve_fast_paths({}, "cpu").merged_projections
    assert resolve_fast_paths({"merged_projections": "on"}, "cpu").merged_projections
    assert resolve_fast_paths({}, "cuda").merged_projections


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_block_s_one_matmul_is_its_projections(dtype):
    model, merged = merged_model(dtype)
    kinds = {type(b) for b in blocks(merged)}
    assert kinds == {KimiK3DeltaAttention, KimiK3MLAttention, KimiK3MLP}
    with use_fast_paths(merged, merged_projections="on"), torch.no_grad():
        ops = merged.dispatch.ops(torch.device("cpu"))
        for block in blocks(merged):
            assert_views_of_the_buffer(block)
            hidden = block.merged_weight().shape[1]
            for shape in ((1, 1, hidden), (3, 5, hidden)):
                x = torch.randn(shape).to(dtype)
                got = block.merged_outputs(x, ops)
                want = [getattr(block, name)(x) for name in block.merged]
                assert len(got) == len(want)
                for name, a, b in zip(block.merged, got, want):
                    assert a.shape == b.shape and a.dtype == b.dtype, name
                    if shape[:2] == (1, 1):  # one row: the same dot products
                        assert torch.equal(a, b), (type(block).__name__, name, dtype)
                    else:  # several: the matmul may block the sums another way for another width
                        assert_within_summation_order(a, b, x, getattr(block, name).weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_merged_and_separate(dtype):
    """A prompt (several rows a matmul) within fp32 summation order; a decode step from the same cache (one row) bit
    for bit, through KDA and MLA layers (MLA attending in the latent space), the dense MLP and the shared experts."""
    model, merged = merged_model(dtype)
    prompt_ref = run(model, False, PROMPT).logits
    prompt = run(merged, True, PROMPT).logits
    if dtype == torch.float32:
        torch.testing.assert_close(prompt, prompt_ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(prompt, prompt_ref, rtol=2e-2, atol=2e-2)
    for static in (False, True):
        caches = []
        for _ in range(2):  # the same prompt, the separate path: the same cache for both steps
            cache = model.make_static_cache(1, PROMPT.shape[1] + 2) if static else None
            out = run(model, False, PROMPT, cache=cache, use_cache=True)
            caches.append(out.past_key_values if cache is None else cache)
        token = out.logits[:, -1:].argmax(-1)
        want = run(model, False, token, cache=caches[0], use_cache=True).logits
        got = run(merged, True, token, cache=caches[1], use_cache=True).logits
        assert torch.equal(got, want), (static, (got - want).abs().max())


def test_state_dict_and_save_pretrained_are_unchanged(tmp_path):
    """A load merges (every block, views of one buffer a block) and changes no name, shape or byte: `state_dict` is
    the separate model's, and `save_pretrained` writes the checkpoint's bytes back, which load again the same."""
    source = write_checkpoint(str(tmp_path / "tiny"), packed=True, seed=2)
    loaded = KimiK3ForCausalLM.from_pretrained(source, dtype=torch.float32)
    for block in blocks(loaded):
        assert_views_of_the_buffer(block)
    buffers = [block.merged_weight() for block in blocks(loaded)]
    loaded.merge_projections()  # merged already: no copy
    assert all(block.merged_weight() is buffer for block, buffer in zip(blocks(loaded), buffers))
    separate = copy.deepcopy(loaded)
    for block in blocks(separate):
        assert block.merged_weight() is None  # deepcopy copies each parameter on its own
    state, separate_state = loaded.state_dict(), separate.state_dict()
    assert list(state) == list(separate_state)
    for name, tensor in separate_state.items():
        assert_same_bytes(state[name], tensor, name)
    loaded.save_pretrained(tmp_path / "saved")
    want = {k: v for k, v in shard_tensors(source).items() if not k.startswith(("vision_tower.", "mm_projector."))}
    got = shard_tensors(tmp_path / "saved")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert_same_bytes(got[name], tensor, name)
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for name, tensor in again.state_dict().items():
        assert_same_bytes(tensor, state[name], name)


def test_blocks_offloaded_by_accelerate_keep_their_projections_apart(tmp_path):
    """Under a device map with disk offload the offloaded blocks' weights are loaded by accelerate's hooks at each
    call: they are not merged (no buffer holds them in memory) and run their projections one by one; the resident
    blocks merge. The logits are the plain load's."""
    source = write_checkpoint(str(tmp_path / "tiny"), packed=True, seed=2)
    reference = KimiK3ForCausalLM.from_pretrained(source, dtype=torch.float32)
    offloaded = KimiK3ForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="auto",
                                                  max_memory={"cpu": "600KB"}, offload_folder=str(tmp_path / "off"))
    assert {"cpu", "disk"} <= set(offloaded.hf_device_map.values())
    merged = [b.merged_weight() is not None for b in blocks(offloaded)]
    assert any(merged) and not all(merged)
    with use_fast_paths(offloaded, merged_projections="on"), torch.no_grad():
        ops = offloaded.dispatch.ops(torch.device("cpu"))
        for block, is_merged in zip(blocks(offloaded), merged):
            assert is_merged != any(getattr(block, name).weight.is_meta for name in block.merged)
            if is_merged:  # the resident blocks' hooks only move inputs: the merged matmul runs
                x = torch.randn(1, 1, block.merged_weight().shape[1])
                assert block.merged_outputs(x, ops) is not None
    torch.testing.assert_close(run(offloaded, True, PROMPT).logits, run(reference, False, PROMPT).logits,
                               rtol=1e-5, atol=1e-6)


def test_to_a_dtype_merges_again():
    """`.to(dtype)` casts each parameter on its own; the blocks merge the cast weights again (the fp32 buffers let
    go), and the merged path gives the cast separate model's decode step bit for bit."""
    model, merged = merged_model()
    model, merged = model.to(torch.bfloat16), merged.to(torch.bfloat16)
    for block in blocks(merged):
        assert block.merged_weight().dtype == torch.bfloat16
        assert_views_of_the_buffer(block)
    caches = [run(model, False, PROMPT, use_cache=True).past_key_values for _ in range(2)]
    token = torch.tensor([[9]])
    want = run(model, False, token, cache=caches[0], use_cache=True).logits
    assert torch.equal(run(merged, True, token, cache=caches[1], use_cache=True).logits, want)


def test_replaced_weights_take_the_separate_projections():
    """A weight replaced after the merge (here as tensor parallel's `shard` and `load_state_dict(assign=True)` do)
    is no longer a view of the buffer: the block takes its projections one by one, and lets the buffer go."""
    _, merged = merged_model()
    attn = merged.language_model.model.layers[1].self_attn
    with use_fast_paths(merged, merged_projections="on"), torch.no_grad():
        ops = merged.dispatch.ops(torch.device("cpu"))
        x = torch.randn(1, 1, attn.q_proj.in_features)
        assert attn.merged_outputs(x, ops) is not None
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
        assert attn.merged_outputs(x, ops) is None and attn._merged_weight is None
        attn.merge_projections()
        handle = attn.q_proj.register_forward_hook(lambda *args: None)  # a hook waits on q_proj's own forward
        assert attn.merged_outputs(x, ops) is None and attn.merged_weight() is not None
        handle.remove()
        assert attn.merged_outputs(x, ops) is not None


def test_training_takes_the_separate_projections_and_updates_the_buffer():
    """While autograd records, the projections run on their own (their gradients reach them); an optimizer step
    updates the parameters in place, which are the buffer's rows, so the merged path sees the new weights."""
    model, merged = merged_model()
    merged.train()
    with use_fast_paths(merged, merged_projections="on"):
        with GemmCounter() as training:
            loss = merged(PROMPT, labels=PROMPT).loss
        with torch.no_grad(), GemmCounter() as inference:
            model(PROMPT)
        assert training.counts == inference.counts  # the separate projections' GEMMs
        loss.backward()
        attn = merged.language_model.model.layers[1].self_attn
        assert all(getattr(attn, name).weight.grad is not None for name in attn.merged)
        torch.optim.SGD(merged.parameters(), lr=0.1).step()
        for block in blocks(merged):
            assert_views_of_the_buffer(block)
        assert not torch.equal(attn.q_proj.weight, model.language_model.model.layers[1].self_attn.q_proj.weight)
        merged.eval()
        x = torch.randn(1, 1, attn.q_proj.in_features)
        with torch.no_grad():
            got = attn.merged_outputs(x, merged.dispatch.ops(torch.device("cpu")))
            assert got is not None and all(torch.equal(a, getattr(attn, name)(x))
                                           for name, a in zip(attn.merged, got))


def decode_step_gemms(model, merged_on):
    """GEMMs of one batch-1 decode step of `model` (after a prompt), per decoder layer."""
    cache = model.make_static_cache(1, PROMPT.shape[1] + 2)
    run(model, merged_on, PROMPT, cache=cache, use_cache=True)
    counter = GemmCounter()
    layers = model.language_model.model.layers
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "label", i))
               for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda *args: setattr(counter, "label", None)) for layer in layers]
    try:
        with counter:
            run(model, merged_on, torch.tensor([[9]]), cache=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return counter.counts


def test_a_decode_step_launches_one_gemm_a_group():
    """KDA: q, k, v, g, f_a, b -> 1 (5 fewer); MLA: q_a, kv_a, g -> 1 (2 fewer); the dense MLP's and the shared
    experts' gate and up -> 1 (1 fewer)."""
    _, merged = merged_model()
    separate, one = decode_step_gemms(merged, False), decode_step_gemms(merged, True)
    text = merged.config.text_config
    for i, kind in enumerate(text.layer_types):
        fewer = {"kda": 5, "mla": 2}[kind] + 1  # + the MLP's or the shared experts' gate and up
        assert separate[i] - one[i] == fewer, (i, kind, separate[i], one[i])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_cuda_decode_step_launches_one_gemm_a_group_and_nothing_else():
    """The CUDA fast paths' decode step (`bench.kernel_count`'s fake GPU, where "auto" takes the merged matmuls), at
    batch 1, whole and as rank 0 of 8: each group's GEMMs -> 1, and no other launch added (each projection's output,
    a slice of one row, is read in place)."""
    from bench import kernel_count

    base = kernel_count.build_model()
    for tp in (1, kernel_count.TP):
        counts = {}
        for choice in ("off", "auto"):
            model = copy.deepcopy(base)
            if tp > 1:
                shard(model, TensorParallel(0, tp))
            with use_fast_paths(model, merged_projections=choice):
                counts[choice] = kernel_count.count_step(model, 1)
        fewer = {"layer 0 (dense0)": 5 + 1, "layer 1 (kda_moe)": 5 + 1, "layer 3 (mla_moe)": 2 + 1}
        for label, n in fewer.items():
            separate, merged = counts["off"][label], counts["auto"][label]
            assert separate["gemms"] - merged["gemms"] == n, (tp, label, separate["ops"], merged["ops"])
            assert separate["kernels"] - merged["kernels"] == n, (tp, label, separate["ops"], merged["ops"])


def test_a_tensor_parallel_rank_merges_its_own_slices(monkeypatch):
    """`shard` gives each projection this rank's rows; the merge after it puts those in one buffer, and the rank's
    outputs (its partial sums, the all-reduces left out) are the separate projections'."""
    monkeypatch.setattr(tensor_parallel, "all_reduce", lambda x, group=None: x)
    model = random_model(tiny_config(), seed=0)
    for rank in range(2):
        separate = copy.deepcopy(model)
        shard(separate, TensorParallel(rank, 2))
        separate.stack_experts()
        merged = merge_block_projections(copy.deepcopy(separate))
        for block in blocks(merged):
            assert_views_of_the_buffer(block)
        attn = merged.language_model.model.layers[1].self_attn
        assert attn.num_heads == 2  # of 4: q, k, v, g and b this rank's heads' rows, f_a whole
        assert attn.merged_weight().shape[0] == 4 * attn.q_proj.out_features + attn.head_dim + attn.num_heads
        caches = [run(separate, False, PROMPT, use_cache=True).past_key_values for _ in range(2)]
        torch.testing.assert_close(run(merged, True, PROMPT).logits, run(separate, False, PROMPT).logits,
                                   rtol=1e-5, atol=1e-6)
        token = torch.tensor([[9]])
        want = run(separate, False, token, cache=caches[0], use_cache=True).logits
        assert torch.equal(run(merged, True, token, cache=caches[1], use_cache=True).logits, want)


TP_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from kimi_k3_dispatch import use_fast_paths
    from modeling_kimi_k3 import MergedProjections

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, tp_plan="auto",
                                                 dtype=torch.float32)
    merged = [m.merged_weight() is not None for m in model.modules() if type(m).__name__ in
              ("KimiK3DeltaAttention", "KimiK3MLAttention", "KimiK3MLP")]
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8]])
    out = {}
    with torch.no_grad():
        for choice in ("off", "on"):
            with use_fast_paths(model, merged_projections=choice):
                out[choice] = model(ids).logits
    if dist.get_rank() == 0:
        torch.save({"merged": merged, **out}, sys.argv[2])
    dist.destroy_process_group()
    """
)


def test_a_torchrun_load_merges_each_rank_s_slices(tmp_path):
    """`from_pretrained(tp_plan="auto")` on 2 gloo ranks merges every block of its shard after reading it; the logits
    with the merged matmuls are those without, within fp32 summation order."""
    source = write_checkpoint(str(tmp_path / "tiny"), packed=True, seed=2)
    script = tmp_path / "worker.py"
    script.write_text(TP_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(script), source, str(tmp_path / "out.pt")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
               HF_MODULES_CACHE=str(tmp_path / "modules"))
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["merged"] and all(result["merged"])
    torch.testing.assert_close(result["on"], result["off"], rtol=1e-5, atol=1e-6)


FUSED_SCRIPT = textwrap.dedent(
    """
    import copy
    import torch
    from kimi_k3_dispatch import use_fast_paths
    from reap_tools.tiny import random_model, tiny_config

    model = random_model(tiny_config(), seed=0).to(torch.bfloat16)
    merged = copy.deepcopy(model)
    merged.merge_projections()
    prompt = torch.tensor([[5, 17, 99, 3], [8, 250, 42, 7]])
    token = torch.tensor([[9], [11]])
    logits = []
    for m, choice in ((model, "off"), (merged, "on")):
        with torch.no_grad(), use_fast_paths(m, fused="on", merged_projections=choice):
            cache = m.make_static_cache(2, 6, cuda_graph=False)
            m(prompt, cache=cache, use_cache=True)
            logits.append(m(token, cache=cache, use_cache=True).logits.float())
    err = ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item()
    assert err < 2e-2, err
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernels_read_the_merged_outputs_rows_apart():
    """At batch 2 each projection's output is a column slice of the one matmul's, its rows apart: the fused kernels
    (KDA's decode step, SiTU-GLU, MLA's latent keys and gated heads) read them in place, in Triton's interpreter, to
    the logits of the separate projections (bf16, the merged and separate matmuls of two rows may round apart)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
