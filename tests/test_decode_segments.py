"""The decode runner behind CUDA-graph decode (`KimiK3DecodeGraph`), on the CPU: how it cuts a model placed over
several devices into segments, and that running a step stage by stage (eagerly, as it runs CPU and offloaded
segments and as it records the shapes it captures on) gives the plain forward's logits, with accelerate's hooks."""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from kimi_k3_runners import KimiK3DecodeGraph
from reap_tools.tiny import random_model, tiny_config


def placed(model, devices):
    """Make `model`'s stages report the execution devices `devices` (one per stage: embedding, layers, output norm,
    head), as accelerate's hooks do for a `device_map` over several GPUs."""
    text = model.language_model.model
    modules = [text.embed_tokens, *text.layers, text.norm, model.language_model.lm_head]
    for module, device in zip(modules, devices, strict=True):
        module._hf_hook = types.SimpleNamespace(execution_device=device)
    return model


def test_segments_are_contiguous_runs_on_one_device():
    model = random_model(tiny_config(packed=True), seed=0)  # 6 layers: 9 stages
    plan = [0, 0, 0, 0, 1, 1, "cpu", 2, 2]
    model.language_model.model.layers[2].to("meta")  # its weights offloaded: accelerate loads them at each call
    runner = KimiK3DecodeGraph(placed(model, [torch.device("cuda", d) if d != "cpu" else torch.device(d)
                                              for d in plan]))
    got = [(str(s.device), len(s.stages), s.why_eager) for s in runner.segments]
    assert got == [("cuda:0", 3, None), ("cuda:0", 1, "weights offloaded by accelerate (loaded at each call)"),
                   ("cuda:1", 2, None), ("cpu", 1, "not on a CUDA device"), ("cuda:2", 2, None)]
    assert runner.enabled and not runner.captured


def test_a_model_on_the_cpu_has_nothing_to_capture():
    model = random_model(tiny_config(packed=True), seed=0)
    runner = KimiK3DecodeGraph(model)
    assert [str(s.device) for s in runner.segments] == ["cpu"] and not runner.enabled


def greedy_steps(model, decode, prompt, steps):
    """Logits of `steps` greedy one-token steps after `prompt`, each step through `decode(cache, ids)`."""
    code = sys.modules[type(model).__module__]  # the classes the (remote-code) model itself uses
    cache = code.KimiK3StaticCache(model.config, prompt.shape[0], prompt.shape[1] + steps)
    with torch.no_grad():
        logits = model(prompt, cache=cache, use_cache=True).logits[:, -1:]
        out = []
        for _ in range(steps):
            logits = decode(cache, logits.argmax(-1))
            out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("offload", [False, True])
def test_stage_by_stage_steps_equal_the_forward(packed_checkpoint, tmp_path, offload):
    """With accelerate's hooks (and with layers offloaded to disk, loaded by the hooks at each call)."""
    kwargs = dict(device_map="auto", max_memory={"cpu": "600KB"}, offload_folder=str(tmp_path / "offload")) if (
        offload) else {}
    model = AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True, **kwargs)
    if offload:
        assert "disk" in set(model.hf_device_map.values())
    runner = sys.modules[type(model).__module__.rpartition(".")[0] + ".kimi_k3_runners"].KimiK3DecodeGraph(model)
    assert not runner.enabled  # nothing to capture on the CPU: every segment runs stage by stage
    prompt = torch.tensor([[5, 9, 200, 31, 7], [3, 3, 8, 100, 2]])
    staged = greedy_steps(model, lambda cache, ids: runner(cache, ids, None), prompt, 6)
    plain = greedy_steps(model, lambda cache, ids: model(ids, cache=cache, use_cache=True).logits, prompt, 6)
    assert runner.steps == 6
    assert torch.allclose(staged, plain, atol=1e-6, rtol=1e-6)
