"""CPU defaults of `generate` and `observe` (issue 47): float32 on a CPU without AMX, where it is faster than
bfloat16 (README, "On the CPU"); the checkpoint's dtype on an accelerator or with AMX; `--threads`; one log line."""

import io
import json

import numpy as np
import pytest
import torch

from reap_tools import cpu
from reap_tools import generate as gen
from reap_tools import observe as ob
from reap_tools.tiny import random_model, tiny_config, write_checkpoint


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("amx,on_cpu,dtype,expected", [
    (False, True, "auto", torch.float32),
    (True, True, "auto", "auto"),
    (False, False, "auto", "auto"),  # an accelerator keeps the checkpoint's dtype
    (False, True, "bfloat16", torch.bfloat16),
])
def test_choose_picks_float32_only_on_a_cpu_without_amx(monkeypatch, capsys, threads, amx, on_cpu, dtype, expected):
    monkeypatch.setattr(cpu, "fast_bf16", lambda: amx)
    monkeypatch.setattr(cpu, "runs_on_cpu", lambda device_map=None: on_cpu)
    assert cpu.choose("tool", dtype, threads=1) == expected
    assert torch.get_num_threads() == 1
    lines = capsys.readouterr().err.splitlines()
    name = expected if expected == "auto" else str(expected).removeprefix("torch.")
    assert len(lines) == 1 and lines[0].startswith(f"tool: {'CPU' if on_cpu else 'accelerator'}, dtype {name} ")


def test_runs_on_cpu_follows_the_device_map(monkeypatch):
    assert cpu.runs_on_cpu("cpu")
    assert not cpu.runs_on_cpu({"": 0})
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert not cpu.runs_on_cpu(None) and not cpu.runs_on_cpu("auto")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cpu.runs_on_cpu(None) and cpu.runs_on_cpu("auto")


def test_generate_takes_threads_and_logs_its_choice(monkeypatch, capsys, threads):
    monkeypatch.setattr(cpu, "fast_bf16", lambda: False)
    monkeypatch.setattr(cpu, "runs_on_cpu", lambda device_map=None: True)
    loaded = {}
    real = gen.load_pipeline

    def load(model_dir, device_map=None, dtype="auto"):
        loaded["pipe"] = real(model_dir, device_map, dtype)
        return loaded["pipe"]

    monkeypatch.setattr(gen, "load_pipeline", load)
    assert gen.main(["--max-new-tokens", "2", "--threads", "2"]) == 0
    err = capsys.readouterr().err
    assert "generate: CPU, dtype float32 (no AMX on this CPU" in err and "2 CPU thread(s)" in err
    assert loaded["pipe"].model.dtype == torch.float32 and torch.get_num_threads() == 2
    assert gen.main(["--max-new-tokens", "1"]) == 0
    assert "1 CPU thread(s)" in capsys.readouterr().err  # the CPU default: one-token steps are too small to share


def test_observe_takes_threads_and_loads_float32_on_such_a_cpu(monkeypatch, tmp_path, capsys, threads):
    monkeypatch.setattr(cpu, "fast_bf16", lambda: False)
    monkeypatch.setattr(cpu, "runs_on_cpu", lambda device_map=None: True)
    path = write_checkpoint(str(tmp_path / "tiny"), random_model(tiny_config(True), 0).to(torch.bfloat16))
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["dtype"] == "bfloat16"
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(1).integers(0, 500, 64))
    out = tmp_path / "report.json"
    assert ob.main(["--model", path, "--data", str(data), "--seq-len", "16", "--out", str(out), "--threads", "1",
                    "--no-progress"]) == 0
    assert "observe: CPU, dtype float32" in capsys.readouterr().err and torch.get_num_threads() == 1
    assert json.loads(out.read_text())["model"]["dtype"] == "float32"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_generate_shows_tokens_per_second_and_an_eta_on_a_terminal():
    terminal = Terminal()
    progress = gen.Progress(100, "generate", file=terminal)
    progress.bar.mininterval = 0
    for new in range(1, 4):
        assert not progress(torch.zeros(1, 4 + new, dtype=torch.long), None).any()  # it never stops generation
    progress.close()
    shown = terminal.getvalue()
    assert "3/100" in shown and "tok/s" in shown and "<" in shown, shown  # count, rate, ETA
    assert gen.Progress(100, "generate", file=io.StringIO()).bar.disable  # not a terminal: no bar
