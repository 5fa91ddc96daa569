"""Every fast-path kernel launches under the CUDA device of its tensors, also for a layer on a second GPU.

Triton and fla kernels launch on the current CUDA device; under `device_map` accelerate's hooks leave it at cuda:0
while a layer's tensors sit on cuda:1. Here, on a CPU, the model's own blocks run on fake tensors placed on cuda:1
(`bench.fake_gpu`: CPU tensors that report cuda:1), with every fast path on, CUDA's current-device state simulated,
and each kernel replaced by a recorder that notes the current device it was launched under. A kernel entry point the
model calls without the device guard is launched under device 0 and fails the test.
"""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402

import kimi_k3_dispatch  # noqa: E402
from bench.fake_gpu import FAKE_GPU, FakeGpuMode, recorded_launches, to_fake_gpu, triton_kernels  # noqa: E402
from kimi_k3_dispatch import use_fast_paths  # noqa: E402
from modeling_kimi_k3 import KimiK3Cache, KimiK3DecoderLayer, KimiK3StaticCache, new_dispatch  # noqa: E402
from reap_tools.tiny import tiny_config  # noqa: E402

SECOND_GPU = FAKE_GPU


@pytest.fixture
def launches():
    """[(kernel name, current device index at launch, devices of its tensor arguments)] of every launch (the
    prompts, 5 pairs an expert at batch 2, take the upcast-once experts path, which needs SM90; the decode steps keep
    the fused expert kernels), and the names of all the Triton kernels."""
    with recorded_launches(upcast_once_min_pairs_per_expert=5) as calls:
        yield calls, {name for _, name in triton_kernels()}


def run_layers_on_second_gpu(kda_prefill="on"):
    """A KDA + MoE and an MLA + MoE layer on cuda:1, prefill of 5 tokens at batch 2, then a one-token decode step at
    batch 2 and at batch 1 (per-pair expert blocks), growing caches and a static one, every fast path on but side
    streams (fla's chunked KDA prefill kernel as `kda_prefill` says)."""
    config = tiny_config(packed=True, hidden_size=64, routed_expert_hidden_size=64, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_token=4).text_config
    kinds = {config.layer_types[i]: i for i in range(1, config.num_hidden_layers)}
    dispatch = new_dispatch(config)
    layers = [to_fake_gpu(KimiK3DecoderLayer(config, kinds[kind], True, dispatch).to(torch.bfloat16))
              for kind in ("kda", "mla")]
    with FakeGpuMode(), torch.no_grad():
        for layer in layers:
            assert layer.block_sparse_moe.stack_experts() is not None
        with use_fast_paths(layers[0], side_streams="off", cuda_graphs="off", kda_prefill=kda_prefill, experts="on",
                            kda="on", fused="on"):
            for batch, cache in ((2, KimiK3Cache(config)), (1, KimiK3Cache(config)),
                                 (1, KimiK3StaticCache(config, batch_size=1, max_length=8, cuda_graph=False))):
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
    assert "fla_chunk_kda" in launched and "_kda_decode_step_kernel" in launched
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
    """With kda on and kda_prefill off, prompts run fla's recurrent kernel (under their tensors' device), decode
    steps the one-kernel KDA step of the fused path."""
    calls, _ = launches
    run_layers_on_second_gpu(kda_prefill="off")
    fla = {(name, current) for name, current, _ in calls if name.startswith("fla_")}
    assert fla == {("fla_fused_recurrent_kda", 1)}
