"""One dispatch for the optional fast paths: `fast_paths` (a `from_pretrained` keyword, not written to config.json)
says per path "auto" / "on" / "off"; `kimi_k3_dispatch` turns it into the `Ops` table each device runs, once per
device, with one log line; blocks call that table. "on" means on: a path that cannot run on the device or for the
config's shapes is an error at load. On the CPU every path resolves off except the fused kernels in Triton's
interpreter, which is how this file checks that a switch reaches a model loaded with trust_remote_code."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from configuration_kimi_k3 import FAST_PATH_DEFAULTS, KimiK3Config
import kimi_k3_dispatch
from kimi_k3_dispatch import FastPaths, check_shapes, resolve_fast_paths, resolve_ops, use_fast_paths
from modeling_kimi_k3 import REFERENCE_OPS, KimiK3ForCausalLM
from reap_tools.tiny import random_model, tiny_config, write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo", "reap40")


def test_auto_on_the_cpu_is_the_reference():
    assert resolve_fast_paths({}, "cpu") == FastPaths()
    assert str(FastPaths()) == ", ".join(f"{path}=off" for path in FAST_PATH_DEFAULTS)


@pytest.mark.parametrize("path", sorted(set(FAST_PATH_DEFAULTS) - {"merged_projections"}))  # runs on the CPU too
def test_on_where_a_path_cannot_run_is_an_error_naming_it(path):
    with pytest.raises(ValueError, match=rf"fast_paths\['{path}'\] is 'on', but it needs"):
        resolve_fast_paths({path: "on"}, "cpu")


def test_unknown_paths_and_choices_are_errors_naming_them():
    with pytest.raises(ValueError, match="unknown path.*'experts_kernel'"):
        KimiK3Config(fast_paths={"experts_kernel": "off"})
    with pytest.raises(ValueError, match=r"fast_paths\['kda'\] is 'maybe'"):
        resolve_fast_paths({"kda": "maybe"}, "cpu")


def test_the_environment_overrides_the_config(monkeypatch):
    monkeypatch.setenv("KIMI_K3_FAST_PATHS", "experts=on")
    with pytest.raises(ValueError, match="experts"):
        resolve_fast_paths({"experts": "off"}, "cpu")


def test_fast_paths_stay_out_of_a_config_unless_saved_there_on_purpose(tmp_path):
    assert not hasattr(KimiK3Config(), "fast_paths") and "fast_paths" not in KimiK3Config().to_dict()
    config = KimiK3Config(fast_paths={"experts": False, "fused": "off"})
    assert config.fast_paths == {**FAST_PATH_DEFAULTS, "experts": "off", "fused": "off"}
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["fast_paths"]["fused"] == "off"
    assert KimiK3Config.from_pretrained(tmp_path).fast_paths["experts"] == "off"


def test_the_load_time_keyword_is_used_and_not_saved(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, trust_remote_code=True, fast_paths={"fused": "off"})
    assert model.dispatch.at_load == {"fused": "off"}
    assert str(model.dispatch.ops(torch.device("cpu")).paths) == str(FastPaths())  # the remote copy's class
    assert not hasattr(model.config, "fast_paths")
    model.save_pretrained(tmp_path / "saved")
    assert "fast_paths" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_on_for_a_shape_a_kernel_cannot_run_is_refused_at_load_naming_path_and_field(tmp_path):
    """Under "on" a kernel never declines a call: shapes it cannot run are refused when the model loads. Under
    "auto" the op whose kernel cannot run them resolves to its reference (and the log says which)."""
    folder = write_checkpoint(str(tmp_path / "top3"), packed=True, seed=0, num_experts_per_token=3)
    with pytest.raises(ValueError, match=r"fast_paths\['fused'\] is 'on', but its kernel for router_topk cannot "
                                         r"run num_experts_per_token = 3 \(needs a power of two\)"):
        KimiK3ForCausalLM.from_pretrained(folder, fast_paths={"fused": "on"})
    config = tiny_config(packed=True, num_experts_per_token=3)
    assert check_shapes({"fused": "auto"}, config) == {"router_topk"}
    assert check_shapes({"fused": "off"}, config) == set()
    ops = resolve_ops(FastPaths(fused=True), REFERENCE_OPS, check_shapes({}, config))
    assert ops.router_topk is REFERENCE_OPS.router_topk and ops.pair_sum_norm is not REFERENCE_OPS.pair_sum_norm
    floats = tiny_config(packed=False)
    with pytest.raises(ValueError, match=r"fast_paths\['experts'\] is 'on', but its kernel for routed_experts "
                                         r"cannot run quantization_config = float"):
        check_shapes({"experts": "on"}, floats)


def test_a_kernel_refuses_a_shape_it_cannot_run_instead_of_returning_nothing():
    import fused_triton

    if fused_triton.triton is None:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="router_topk: top_k = 3 is not a power of two"):
        fused_triton.router_topk(torch.zeros(2, 8), torch.zeros(8), 3, True, 1.0)


def test_use_fast_paths_restores_the_previous_choices():
    model = random_model(tiny_config(packed=True), seed=0)
    dispatch = model.language_model.model.dispatch
    assert all(layer.dispatch is dispatch for layer in model.language_model.model.layers)  # one per model
    with use_fast_paths(model, fused="off", kda=False):
        assert dispatch.overrides == {"fused": "off", "kda": False}
        with use_fast_paths(model, fused="auto"):
            assert dispatch.overrides == {"fused": "auto", "kda": False}
        assert dispatch.overrides == {"fused": "off", "kda": False}
    assert dispatch.overrides == {}


def test_while_autograd_records_only_paths_with_a_backward_are_taken(monkeypatch):
    """Training takes the references and fla's chunked KDA kernel, never a forward-only kernel: with every path
    resolved on, a forward + backward under autograd calls no other kernel and gives the reference's gradients."""
    every = FastPaths(**{path: True for path in FAST_PATH_DEFAULTS})
    assert every.with_backward() == FastPaths(kda_prefill=True)

    def grads(model):
        ids = torch.tensor([[5, 17, 9, 33, 2, 8]])
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = random_model(tiny_config(), seed=0).float()
    reference = grads(model)
    dispatch = model.dispatch
    dispatch.refresh()
    calls = []
    kernels = {f.name: (lambda *a, _name=f.name, **k: calls.append(_name)) for f in dataclasses.fields(REFERENCE_OPS)
               if f.name != "paths"}
    # as a CUDA device with triton and fla-core resolves "auto"
    dispatch._resolved[torch.device("cpu")] = dataclasses.replace(REFERENCE_OPS, paths=every, **kernels)
    chunks = []
    kda_forward = kimi_k3_dispatch.kda_forward
    monkeypatch.setattr(kimi_k3_dispatch, "kda_forward",
                        lambda *a, **k: chunks.append(k["kernel"]) or kda_forward(*a, **k))
    got = grads(model)
    assert calls == [] and set(chunks) == {"chunk"}
    assert dispatch.ops(torch.device("cpu")).paths == FastPaths(kda_prefill=True)
    with torch.no_grad():
        assert dispatch.ops(torch.device("cpu")).paths == every
    assert got.keys() == reference.keys() and any("q_proj" in n for n in got)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


def test_side_stream_variants_are_the_reference_in_another_order(monkeypatch):
    """With `side_streams` resolved on, every KDA, MLA and MoE block runs its side-by-side variant (the runners'
    section); off CUDA a side branch runs in place, so a prompt and two decode steps through a cache give the
    reference's logits bit for bit, and both caches end equal."""
    import modeling_kimi_k3 as code

    model = random_model(tiny_config(), seed=0)
    ids = torch.tensor([[5, 17, 9, 33, 2, 8], [7, 7, 1, 30, 4, 9]])

    def run():
        cache = code.KimiK3Cache(model.config.text_config)
        with torch.no_grad():
            logits = [model(ids, cache=cache).logits]
            for step in range(2):
                logits.append(model(ids[:, step : step + 1], cache=cache).logits)
        return logits, [t for layer in cache.layers for t in layer.tensors()]

    reference, reference_cache = run()
    calls = []
    for name in ("kda_side_by_side", "mla_side_by_side", "moe_side_by_side"):
        variant = getattr(code, name)
        monkeypatch.setattr(code, name, lambda *a, _v=variant, _n=name: calls.append(_n) or _v(*a))
    dispatch = model.dispatch
    dispatch.refresh()
    dispatch._resolved[torch.device("cpu")] = dataclasses.replace(REFERENCE_OPS, paths=FastPaths(side_streams=True))
    got, got_cache = run()
    layers = model.config.text_config.layer_types
    moe = sum(map(bool, map(model.config.text_config.experts_in_layer, range(len(layers)))))
    assert sorted(set(calls)) == ["kda_side_by_side", "mla_side_by_side", "moe_side_by_side"]
    assert len(calls) == 3 * (layers.count("kda") + layers.count("mla") + moe)
    for a, b in zip(got + got_cache, reference + reference_cache, strict=True):
        assert torch.equal(a, b)


REMOTE = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "fast paths" in record.getMessage():
                lines.append(record.getMessage())

    hf_logging.set_verbosity_info()
    hf_logging.get_logger().addHandler(Keep())
    folder, requested = sys.argv[1], json.loads(sys.argv[2])
    kwargs = {"fast_paths": requested} if requested is not None else {}
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)
    code = sys.modules[type(model).__module__]  # the remote-code copy transformers imported, not the repository's
    dispatch = sys.modules[code.__name__.rpartition(".")[0] + ".kimi_k3_dispatch"]
    calls = {"fused": 0}
    mix = dispatch.triton_attn_res_mix

    def counted(*args, **kw):
        calls["fused"] += 1
        return mix(*args, **kw)

    dispatch.triton_attn_res_mix = counted
    with torch.no_grad():
        model(torch.tensor([[5, 17, 9, 33]]))
    print("RESULT " + json.dumps({"lines": lines, "calls": calls, "config": getattr(model.config, "fast_paths", None),
                                  "module": code.__name__}))
    """
)


@pytest.fixture(scope="module")
def remote_folder(tmp_path_factory):
    """demo/reap40 with the repository's current code, loaded from a folder as the hub would serve it."""
    folder = tmp_path_factory.mktemp("remote") / "reap40"
    shutil.copytree(DEMO, folder, ignore=shutil.ignore_patterns("*.py"))
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), folder / name)
    return folder


def load_and_run(folder, requested, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("KIMI_K3_FAST_PATHS", None)
    done = subprocess.run([sys.executable, "-c", REMOTE, str(folder), json.dumps(requested)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_switch_reaches_a_model_loaded_with_trust_remote_code(remote_folder, tmp_path):
    default = load_and_run(remote_folder, None, tmp_path)
    off = load_and_run(remote_folder, {"fused": "off"}, tmp_path)
    assert default["module"].startswith("transformers_modules")
    # the choice, logged once at load for the model's device, then the path the blocks took
    assert default["lines"] == ["Kimi K3 fast paths on cpu: experts=off, kda=off, kda_prefill=off, fused=on, "
                                "side_streams=off, cuda_graphs=off, merged_projections=off"]
    assert default["calls"]["fused"] > 0
    assert off["lines"] == ["Kimi K3 fast paths on cpu: experts=off, kda=off, kda_prefill=off, fused=off, "
                            "side_streams=off, cuda_graphs=off, merged_projections=off"]
    assert off["calls"]["fused"] == 0
    assert off["config"] is None  # a load-time choice, not written into the config


ON_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoModelForCausalLM

    errors = {}
    for path in json.loads(sys.argv[2]):
        try:
            AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, fast_paths={path: "on"})
        except ValueError as err:
            errors[path] = str(err)
    print("RESULT " + json.dumps(errors))
    """
)


def test_on_for_a_cuda_path_fails_at_load_naming_it(remote_folder, tmp_path):
    paths = ["experts", "kda", "kda_prefill", "side_streams", "cuda_graphs"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("KIMI_K3_FAST_PATHS", None)
    done = subprocess.run([sys.executable, "-c", ON_SCRIPT, str(remote_folder), json.dumps(paths)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert sorted(errors) == sorted(paths)
    for path, message in errors.items():
        assert f"fast_paths['{path}'] is 'on', but it needs" in message


def test_a_block_bank_is_stacked_once_for_every_depth_mix_that_reads_it(monkeypatch):
    """The fused depth mix reads the block bank as one stack: a `BlockBank`, which the decoder hands from layer to
    layer within a block, makes it once and gives the same tensor to every mix (a plain tuple is stacked at each)."""
    import modeling_kimi_k3 as code

    stacks = []
    monkeypatch.setattr(kimi_k3_dispatch, "triton_attn_res_mix", lambda stacked, *args: stacks.append(stacked))
    hidden = 16
    norm, proj, out_norm = code.KimiK3RMSNorm(hidden), code.KimiK3AttnResProj(hidden), code.KimiK3RMSNorm(hidden)
    mix = kimi_k3_dispatch.fused_attn_res_mix
    bank, partial = code.BlockBank(torch.randn(1, 3, hidden) for _ in range(3)), torch.randn(1, 3, hidden)
    mix(bank, partial, norm, proj, out_norm)
    mix(bank, 2 * partial, norm, proj, out_norm)
    assert stacks[0] is stacks[1] and torch.equal(stacks[0], torch.stack(tuple(bank)))
    plain = tuple(bank)
    for _ in range(2):
        mix(plain, partial, norm, proj, out_norm)
    assert stacks[2] is not stacks[3]

    model = random_model(tiny_config(), seed=0).float()
    layers = model.language_model.model.layers
    banks = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: banks.append(args[0]))
    with torch.no_grad():
        model(torch.tensor([[5, 17, 9, 33]]))
    assert banks[0] == ()
    for i in range(1, len(layers)):
        assert isinstance(banks[i], code.BlockBank)
        assert (banks[i] is banks[i - 1]) == (not layers[i - 1].opens_block), i  # a new bank only past an opening
