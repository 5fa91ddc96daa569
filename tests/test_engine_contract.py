"""The serving engines' contract (SGLang 0.5.23, vLLM 0.33.0) against the demo's and a pruned checkpoint's config and
tensor names.

Read, not run: `tests/fixtures/engine_contract.json` records what their model code (CUDA-only; it does not import
on a CPU machine) requires: the architecture name, the config fields, the tensor names and where the compressed-
tensors block is looked up. Run: where the engines' wheels lie in $KIMI_K3_ENGINE_WHEELS (default /tmp/wheels, from
`pip download --no-deps sglang==0.5.23 vllm==0.33.0`), their own `KimiK3Config` classes are executed on both configs
(read out of the wheel at test time, with stubs for the two runtime modules they import); else those tests skip.
"""

import json
import os
import re
import sys
import types
import zipfile
from pathlib import Path

import pytest

from reap_tools.checkpoint import experts_per_layer, load_tensors, read_config, text_config
from reap_tools.prune import prune_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = json.loads((ROOT / "tests" / "fixtures" / "engine_contract.json").read_text())
WHEELS = Path(os.environ.get("KIMI_K3_ENGINE_WHEELS", "/tmp/wheels"))


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A uniform prune (8 -> 3 experts) of a tiny release-layout checkpoint with the vision tower."""
    from reap_tools.tiny import write_checkpoint

    root = tmp_path_factory.mktemp("engine")
    src = write_checkpoint(str(root / "src"), vision=True)
    selection = {"criterion": "reap", "model": {}, "layers": {str(i): [0, 4, 7] for i in range(1, 6)}}
    prune_checkpoint(src, selection, root / "pruned", progress=False)
    return root / "pruned"


def checkpoints(pruned):
    return {"demo/parent": ROOT / "demo" / "parent", "demo/reap40": ROOT / "demo" / "reap40", "pruned": pruned}


def contract_problems(config: dict, names: set[str]) -> list[str]:
    """Every way `config` and tensor `names` break the recorded contract."""
    c, problems = CONTRACT, []
    if config.get("architectures") != [c["architecture"]]:
        problems.append(f"architectures {config.get('architectures')}, engines dispatch on [{c['architecture']!r}]")
    if config.get("model_type") != c["model_type"]:
        problems.append(f"model_type {config.get('model_type')!r}")
    problems += [f"no top-level {k}" for k in c["top_level_fields"] if k not in config]
    text = config.get("text_config") or {}
    if text.get("model_type") != c["text_model_type"]:
        problems.append(f"text_config.model_type {text.get('model_type')!r}")
    problems += [f"no text_config.{k}" for k in c["text_config_fields"] if k not in text]
    lac = text.get("linear_attn_config") or {}
    problems += [f"no text_config.linear_attn_config.{k}" for k in c["linear_attn_config_fields"] if k not in lac]
    problems += [f"no vision_config.{k}" for k in c["vision_config_fields"] if k not in config.get("vision_config", {})]
    counts = set(experts_per_layer(text).values()) if "num_experts" in text else set()
    if counts != {text.get("num_experts")}:
        problems.append(f"MoE layers hold {sorted(counts)} experts; the engines size every layer from num_experts "
                        f"= {text.get('num_experts')} (only uniform prunes serve there)")
    q = text.get("quantization_config")
    if q is None:
        problems.append("no text_config.quantization_config")
    else:
        if q.get("quant_method") != c["quantization"]["quant_method"] or "mxfp4" not in str(q.get("format")):
            problems.append(f"quantization {q.get('quant_method')!r} / {q.get('format')!r}")
        for name, group in q.get("config_groups", {}).items():
            if group.get("targets") != c["quantization"]["group_targets"]:
                problems.append(f"config_groups.{name}.targets {group.get('targets')} (vLLM's MoE lookup needs "
                                f"{c['quantization']['group_targets']})")
            weights = {k: group.get("weights", {}).get(k) for k in c["quantization"]["weights"]}
            if weights != c["quantization"]["weights"]:
                problems.append(f"config_groups.{name}.weights {weights}")
    patterns = [re.compile(p) for p in c["tensor_patterns"]]
    problems += [f"tensor {n}: no engine name" for n in sorted(names) if not any(p.search(n) for p in patterns)]
    for n in names:
        m = re.search(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.", n)
        if m and int(m.group(2)) >= text.get("num_experts", 0):
            problems.append(f"tensor {n}: expert id beyond num_experts")
    return problems


@pytest.mark.parametrize("name", ["demo/parent", "demo/reap40", "pruned"])
def test_checkpoint_meets_the_recorded_contract(name, pruned):
    directory = checkpoints(pruned)[name]
    assert contract_problems(read_config(directory), set(load_tensors(directory))) == []


def test_root_config_meets_the_recorded_contract():
    config = read_config(ROOT)
    names = set(load_tensors(ROOT / "demo" / "reap40"))  # the same names at toy size
    assert contract_problems(config, names) == []


def test_non_uniform_prune_is_named_as_unservable(pruned):
    config = read_config(pruned)
    text = text_config(config)
    text["num_experts_per_layer"] = [0, 3, 2, 3, 3, 3]
    assert any("only uniform prunes serve there" in p for p in contract_problems(config, set()))


def load_engine_config(wheel_glob, package, modules, stubs):
    """Import the engine's config modules from its wheel (not installed), with `stubs` for runtime-only imports."""
    wheels = sorted(WHEELS.glob(wheel_glob))
    if not wheels:
        pytest.skip(f"no {wheel_glob} in {WHEELS} (pip download --no-deps {package} -d {WHEELS})")
    saved = dict(sys.modules)
    try:
        for name, attrs in stubs.items():
            sys.modules[name] = types.SimpleNamespace(**attrs)
        with zipfile.ZipFile(wheels[0]) as wheel:
            loaded = {}
            for module in modules:
                code = wheel.read(module.replace(".", "/") + ".py").decode()
                mod = types.ModuleType(module)
                sys.modules[module] = mod
                try:
                    exec(compile(code, f"{wheels[0].name}/{module}", "exec"), mod.__dict__)
                except ImportError as e:  # vLLM 0.33 needs transformers 5 (PreTrainedConfig)
                    pytest.skip(f"{package}'s {module} does not import with this transformers: {e}")
                loaded[module] = mod
        return loaded[modules[-1]]
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def engine_configs():
    sglang = load_engine_config(
        "sglang-0.5.23-*.whl", "sglang==0.5.23",
        ["sglang.srt.configs.kimi_linear", "sglang.srt.configs.kimi_k3"],
        {"sglang.srt.configs.mamba_utils": {"KimiLinearCacheParams": object, "KimiLinearStateShape": object},
         "sglang.srt.runtime_context": {"get_parallel": None}},
    )
    import logging

    vllm = load_engine_config(
        "vllm-0.33.0-*.whl", "vllm==0.33.0",
        ["vllm.transformers_utils.configs.kimi_linear", "vllm.transformers_utils.configs.kimi_k3"],
        {"vllm.logger": {"init_logger": logging.getLogger}},
    )
    return {"sglang": sglang.KimiK3Config, "vllm": vllm.KimiK3Config}


@pytest.mark.parametrize("name", ["root", "demo/reap40", "pruned"])
def test_engines_own_config_classes_read_the_checkpoint(name, pruned):
    directory = ROOT if name == "root" else checkpoints(pruned)[name]
    config = read_config(directory)
    for engine, cls in engine_configs().items():
        parsed = cls(**{k: v for k, v in config.items() if k != "model_type"})
        text = config["text_config"]
        assert parsed.text_config.num_experts == text["num_experts"], engine
        assert parsed.text_config.num_experts_per_token == text["num_experts_per_token"], engine
        assert parsed.text_config.linear_attn_config["kda_layers"] == text["linear_attn_config"]["kda_layers"]
        assert parsed.quantization_config["config_groups"]["group_0"]["targets"] == ["Linear"], engine
        assert parsed.media_placeholder_token_id == config["media_placeholder_token_id"], engine
        assert parsed.vision_config.text_hidden_size == text["hidden_size"], engine


@pytest.mark.parametrize("args, says", [(["--budget", "13"], True), (["-n", "4"], False)])
def test_plan_says_non_uniform_prunes_do_not_serve_on_the_engines(tmp_path, capsys, args, says):
    from test_plan import make_report

    from reap_tools.plan import NON_UNIFORM_NOTE, main

    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report(experts=8, top_k=2)))
    assert main([str(report), "-o", str(tmp_path / "sel.json"), *args]) == 0
    out = capsys.readouterr().out
    assert (NON_UNIFORM_NOTE in out) == says
    assert ("SGLang and vLLM size every MoE layer from one num_experts" in out) == says
