"""Every fast-path kernel launches under the CUDA device of its tensors, also for a layer on a second GPU.

Triton and fla kernels launch on the current CUDA device; under `device_map` accelerate's hooks leave it at cuda:0
while a layer's tensors sit on cuda:1. Here, on a CPU, the model's own blocks run on fake tensors placed on cuda:1
(CPU tensors that report cuda:1, through a torch function mode that keeps every result so), with every fast path
on, CUDA's current-device state simulated, and each kernel replaced by a recorder that notes the current device it
was launched under. A kernel entry point the model calls without the device guard is launched under device 0 and
fails the test.
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fused_triton  # noqa: E402
import kda  # noqa: E402
import kimi_k3_dispatch  # noqa: E402
import mxfp4  # noqa: E402
import mxfp4_triton  # noqa: E402
from kimi_k3_dispatch import use_fast_paths  # noqa: E402
from modeling_kimi_k3 import KimiK3Cache, KimiK3DecoderLayer, new_dispatch  # noqa: E402
from reap_tools.tiny import tiny_config  # noqa: E402

SECOND_GPU = torch.device("cuda", 1)


class OnSecondGpu(torch.Tensor):
    """A CPU tensor that reports itself on the second GPU."""

    @property
    def device(self):
        return SECOND_GPU

    @property
    def is_cuda(self):
        return True


def _host(value):
    if isinstance(value, OnSecondGpu):
        return value.as_subclass(torch.Tensor)
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "cuda" else value


class SecondGpuMode(TorchFunctionMode):
    """Runs every torch call on the CPU data and hands back its tensors as `OnSecondGpu`: allocations asked for on
    a CUDA device land on the CPU. `torch.mm(..., out_dtype=)` (CUDA only) runs as the same fp32 products."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:
            return func(*args, **(kwargs or {}))
        args, kwargs = tree_map(_host, args), tree_map(_host, dict(kwargs or {}))
        if func is torch.mm and kwargs.get("out_dtype") is not None:
            dtype = kwargs.pop("out_dtype")
            args = tuple(a.to(dtype) for a in args)
        out = func(*args, **kwargs)
        return tree_map(lambda t: t.as_subclass(OnSecondGpu) if type(t) is torch.Tensor else t, out)


class CudaState:
    """Stands in for CUDA's current-device state: `torch.cuda.device(d)` sets it for its block."""

    def __init__(self):
        self.current = 0
        state = self

        class device:  # noqa: N801 (torch's name)
            def __init__(self, d):
                self.index = torch.device(d).index if not isinstance(d, int) else d

            def __enter__(self):
                self.previous, state.current = state.current, self.index

            def __exit__(self, *exc):
                state.current = self.previous

        self.device = device


def tensor_devices(values):
    return {t.device for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, torch.Tensor)}


@pytest.fixture
def launches(monkeypatch):
    """[(kernel name, current device index at launch, devices of its tensor arguments)] of every launch."""
    calls, cuda = [], CudaState()
    monkeypatch.setattr(torch.cuda, "device", cuda.device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda.current)

    def recorder(name):
        def launch(*args, **kwargs):
            calls.append((name, cuda.current, tensor_devices(list(args) + list(kwargs.values()))))
            if name == "_router_topk_kernel":  # its ids index the experts next: slots 0..k-1, equal weights
                ids, weights = args[2], args[3]
                ids.copy_(torch.arange(ids.shape[1]).expand_as(ids))
                weights.fill_(1.0 / ids.shape[1])
        return type("Kernel", (), {"__getitem__": lambda self, grid: launch})()

    kernels = [(m, n) for m in (mxfp4_triton, fused_triton) for n, v in vars(m).items()
               if isinstance(v, JITFunction) and n.endswith("_kernel")]
    for module, name in kernels:
        monkeypatch.setattr(module, name, recorder(name))

    def fla_kernel(name):  # fla's chunk and recurrent entry points: record, return fake outputs of their shapes
        def run(q, k, v, g, beta, initial_state=None, **kwargs):
            calls.append((name, cuda.current, tensor_devices([q, k, v, g, beta, initial_state])))
            batch, _, heads, dim = q.shape
            return torch.empty_like(v), torch.empty(batch, heads, dim, v.shape[-1], device=v.device)
        return run

    monkeypatch.setattr(kda, "_fla", (fla_kernel("fla_chunk_kda"), fla_kernel("fla_fused_recurrent_kda")))
    monkeypatch.setattr(mxfp4, "max_scale_code", lambda *scales: 0)  # a host read: fake tensors have none
    # the prompts (5 pairs an expert at batch 2) take the upcast-once path, which needs SM90 (no such GPU here); the
    # decode steps keep the fused expert kernels
    monkeypatch.setattr(mxfp4_triton, "upcast_once_pays", lambda pairs, experts, device: pairs >= 5 * experts)
    return calls, {name for _, name in kernels}


def on_second_gpu(module):
    for m in module.modules():
        for name, p in [(n, p) for n, p in m._parameters.items() if p is not None]:
            m._parameters[name] = torch.nn.Parameter(p.data.as_subclass(OnSecondGpu), requires_grad=False)
    return module


def run_layers_on_second_gpu(kda_prefill="on"):
    """A KDA + MoE and an MLA + MoE layer on cuda:1, prefill of 5 tokens at batch 2, then a one-token decode step at
    batch 2 and at batch 1 (per-pair expert blocks), every fast path on but side streams (fla's chunked KDA prefill
    kernel as `kda_prefill` says)."""
    config = tiny_config(packed=True, hidden_size=64, routed_expert_hidden_size=64, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_token=4).text_config
    kinds = {config.layer_types[i]: i for i in range(1, config.num_hidden_layers)}
    dispatch = new_dispatch(config)
    layers = [on_second_gpu(KimiK3DecoderLayer(config, kinds[kind], True, dispatch).to(torch.bfloat16))
              for kind in ("kda", "mla")]
    with SecondGpuMode(), torch.no_grad():
        for layer in layers:
            assert layer.block_sparse_moe.stack_experts() is not None
        with use_fast_paths(layers[0], side_streams="off", cuda_graphs="off", kda_prefill=kda_prefill, experts="on",
                            kda="on", fused="on"):
            for batch in (2, 1):
                cache = KimiK3Cache(config)
                for length in (5, 1):
                    partial = torch.randn(batch, length, config.hidden_size, dtype=torch.bfloat16, device=SECOND_GPU)
                    bank = (torch.randn_like(partial),)
                    seen = cache.get_seq_length()
                    positions = torch.arange(seen, seen + length, device=SECOND_GPU)
                    for layer in layers:
                        bank, partial = layer(bank, partial, None, cache, positions)
                    cache.advance(length)


def test_every_kernel_launch_is_under_its_tensors_device(launches):
    calls, kernels = launches
    run_layers_on_second_gpu()
    assert calls, "no fast-path kernel ran"
    unguarded = sorted({name for name, current, devices in calls if devices != {SECOND_GPU} or current != 1})
    assert not unguarded, f"launched under another device than their tensors' {SECOND_GPU}: {unguarded}"
    launched = {name for name, _, _ in calls}
    assert {"fla_chunk_kda", "fla_fused_recurrent_kda"} <= launched
    assert kernels <= launched, f"kernels this test does not reach: {sorted(kernels - launched)}"


def test_an_unguarded_entry_point_is_caught(launches, monkeypatch):
    """The check bites: with the guard taken off one entry point its launches are seen under device 0."""
    calls, _ = launches
    guard = kimi_k3_dispatch.on_input_device
    monkeypatch.setattr(kimi_k3_dispatch, "on_input_device",
                        lambda kernel: kernel if kernel is kimi_k3_dispatch.fused_attn_res_mix else guard(kernel))
    run_layers_on_second_gpu()
    assert {name for name, current, _ in calls if current != 1} == {"_attn_res_mix_kernel"}


def test_prompts_take_fla_recurrent_kernel_where_kda_prefill_is_off(launches):
    """With kda on and kda_prefill off, prompts and decode steps alike run fla's recurrent kernel."""
    calls, _ = launches
    run_layers_on_second_gpu(kda_prefill="off")
    assert {name for name, _, _ in calls if name.startswith("fla_")} == {"fla_fused_recurrent_kda"}
