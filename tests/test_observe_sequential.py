"""observe --sequential on a parent-layout tiny checkpoint (dense layer 0, KDA and MLA layers, three attention-residual
blocks, MXFP4 packs, several shards, vision tensors present and skipped): the report equals the whole-model observe's
in one piece, chunked, with the carried state spilled, after a stop or an interruption plus --resume and split over
two processes; peak host memory stays within the budget plus a layer; a layer that does not match is one error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from reap_tools import observe as ob
from reap_tools import sequential as sq
from reap_tools.plan import PlanError, load_report
from reap_tools.tiny import parent_text_config, tiny_config, write_parent_layout

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 24, 2


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """(checkpoint, calibration file, the whole-model report) with a padded last batch."""
    folder = tmp_path_factory.mktemp("sequential")
    path = write_parent_layout(str(folder / "parent"), seed=4)
    data = folder / "tokens.npy"
    np.save(data, np.random.default_rng(2).integers(0, 500, 5 * SEQ + 9))  # 6 sequences, the last 9 tokens long
    full = folder / "full.json"
    assert ob.main(cli(path, data, full)) == 0
    return path, data, json.loads(full.read_text())


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    """The runs here take one CPU thread (`--threads 1`: fast on a busy machine, and the numerics of the two-process
    split, one thread each); the suite's other tests get torch's setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def cli(path, data, out, *extra):
    return ["--model", str(path), "--data", str(data), "--out", str(out), "--seq-len", str(SEQ), "--batch-size",
            str(BATCH), "--dtype", "float32", "--threads", "1", "--no-progress", *extra]


def assert_same_statistics(got, want, rtol=0.0):
    """Counts exactly; the float64 sums within `rtol` relative (0: bit for bit)."""
    assert got.keys() == want.keys()
    for i in want:
        assert got[i]["count"] == want[i]["count"], i
        for field in ("reap_sum", "ean_sum", "max_norm"):
            if rtol:
                np.testing.assert_allclose(got[i][field], want[i][field], rtol=rtol, atol=0, err_msg=f"{i} {field}")
            else:
                assert got[i][field] == want[i][field], (i, field)


def test_the_checkpoint_has_the_parents_layout(parent):
    path, _, full = parent
    text = tiny_config(**parent_text_config()).text_config
    assert text.layer_types == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"] * 2
    assert text.experts_in_layer(0) == 0 and full["model"]["moe_layers"] == list(range(1, 9))
    names = sq.Checkpoint(path).headers
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("mm_projector.") for n in names)
    assert len({t.file for t in names.values()}) > 3  # several shards, the vision tower in its own
    assert names["language_model.model.layers.4.block_sparse_moe.experts.15.w2.weight_packed"].dtype == "U8"
    assert full["calibration"]["num_padding_tokens"] == SEQ - 9 and full["progress"]["complete"]


def test_sequential_equals_the_whole_model(parent, tmp_path, capsys):
    path, data, full = parent
    out = tmp_path / "seq.json"
    assert ob.main([a for a in cli(path, data, out, "--sequential") if a != "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert_same_statistics(report["layers"], full["layers"])  # same ops, same float64 order: bit for bit
    for key in ("format", "model", "calibration", "progress"):
        assert report[key] == full[key], key
    assert report["sequential"]["layers_done"] == list(range(9)) and report["sequential"]["world_size"] == 1
    assert not out.with_name("seq.json.scratch").exists()  # the scratch folder is gone
    err = capsys.readouterr().err
    assert "observe: skipping the checkpoint's 18 vision-tower tensors" in err
    assert "observe: layer 1 of 9 (kda, dense)" in err and "observe: layer 9 of 9 (mla, MoE)" in err
    assert "tokens/s" in err and "ETA 0:00:00" in err


def test_chunked_prefill_equals_the_models_chunked_prefill(parent, tmp_path):
    """Sequences longer than --prefill-chunk go through each layer's cache as the model prefills them."""
    path = parent[0]
    data = tmp_path / "full-batches.npy"
    np.save(data, np.random.default_rng(3).integers(0, 500, 2 * BATCH * SEQ))  # no padding anywhere
    out = tmp_path / "chunked.json"
    assert ob.main(cli(path, data, out, "--sequential", "--prefill-chunk", "10")) == 0
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    model.language_model.model.prefill_chunk_size = 10
    observer = ob.SaliencyObserver(model)
    sequences, _ = ob.load_calibration([data], seq_len=SEQ)
    with observer, torch.inference_mode():
        for batch in ob.make_batches(sequences, BATCH, 511):
            observer.set_mask(None)
            model(input_ids=batch["input_ids"], use_cache=True, logits_to_keep=1)  # 24 tokens: chunks of 10, 10, 4
            observer.commit()
    assert_same_statistics(json.loads(out.read_text())["layers"], observer.layers_report())


def test_spill_stop_interrupt_and_resume_give_the_same_report(parent, tmp_path, monkeypatch, capsys):
    path, data, full = parent
    out, scratch = tmp_path / "r.json", tmp_path / "scratch"
    args = cli(path, data, out, "--sequential", "--max-host-gb", "1e-6", "--scratch", str(scratch))
    assert ob.main(args + ["--stop-after-layer", "3"]) == 0
    part = json.loads(out.read_text())
    assert part["sequential"]["layers_done"] == [0, 1, 2, 3] and not part["progress"]["complete"]
    assert sorted(part["layers"]) == ["1", "2", "3"] and part["sequential"]["peak_state_bytes_in_memory_rank0"] == 0
    with pytest.raises(PlanError, match="report is incomplete"):
        load_report(out)
    files = sorted(p.name for p in scratch.iterdir())
    assert files == [f"b{b:07d}.{w}.safetensors" for b in range(3) for w in ("after003", "bank00", "bank01")]
    assert ob.main(args) == 1 and "pass --resume" in capsys.readouterr().err  # the report exists

    real = sq.load_layer

    def interrupted(layer, reader, index):
        if index == 6:
            raise KeyboardInterrupt
        return real(layer, reader, index)

    monkeypatch.setattr(sq, "load_layer", interrupted)
    assert ob.main(args + ["--resume"]) == 130
    assert "covers the decoder layers it lists as done" in capsys.readouterr().err
    assert json.loads(out.read_text())["sequential"]["layers_done"] == [0, 1, 2, 3, 4, 5]
    monkeypatch.setattr(sq, "load_layer", real)
    assert ob.main(cli(path, data, out, "--sequential", "--resume", "--batch-size", "3")) == 1
    assert "cannot resume: batch_size was 2, now 3" in capsys.readouterr().err
    assert ob.main(args + ["--resume"]) == 0
    report = json.loads(out.read_text())
    assert_same_statistics(report["layers"], full["layers"])
    assert report["progress"] == full["progress"] and not scratch.exists()


def test_two_processes_sum_to_the_same_report(parent, tmp_path):
    path, data, full = parent
    out = tmp_path / "dp.json"
    assert ob.main(cli(path, data, out, "--sequential", "--devices", "cpu,cpu")) == 0
    report = json.loads(out.read_text())
    assert report["sequential"]["world_size"] == 2
    assert_same_statistics(report["layers"], full["layers"], rtol=1e-9)
    assert report["calibration"] == full["calibration"] and report["progress"] == full["progress"]


def test_a_layer_that_does_not_match_is_one_error(parent):
    from configuration_kimi_k3 import KimiK3Config
    from modeling_kimi_k3 import new_dispatch

    path = parent[0]
    config = KimiK3Config.from_pretrained(path)
    layer = sq.build_layer(config, 4, torch.float32, "cpu", new_dispatch(config))
    checkpoint = sq.Checkpoint(path)
    headers = checkpoint.headers
    gone = headers.pop("language_model.model.layers.4.block_sparse_moe.experts.7.w3.weight_scale")
    extra = "language_model.model.layers.4.block_sparse_moe.bias"
    headers[extra] = gone._replace(dtype="F32", shape=(64,))
    norm = "language_model.model.layers.4.input_layernorm.weight"
    headers[norm] = headers[norm]._replace(dtype="I64")
    with pytest.raises(ob.ObserveError) as e:
        sq.load_layer(layer, checkpoint, 4)
    message = str(e.value)
    assert "\n" not in message and "layer 4 does not match the model" in message
    assert "missing language_model.model.layers.4.block_sparse_moe.experts.7.w3.weight_scale" in message
    assert f"unexpected {extra} (in {gone.file})" in message
    assert f"wrong dtype: {norm} in {headers[norm].file} is I64" in message


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from reap_tools import observe as ob

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def reset_peak():  # the high-water mark from here on, not the warm-up's (Linux: clear_refs 5 resets VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024

    path, data, folder = sys.argv[1:4]
    common = ["--model", path, "--data", data, "--seq-len", "512", "--batch-size", "1", "--dtype", "float32",
              "--threads", "1", "--no-progress", "--sequential"]
    ob.main(common + ["--out", folder + "/warm.json", "--max-tokens", "512"])  # imports, kernels, allocator
    results = {}
    for name, extra in (("budget", ["--max-host-gb", "0.004"]), ("unlimited", [])):
        reset_peak()
        base = rss()
        assert ob.main(common + ["--out", f"{folder}/{name}.json", *extra]) == 0
        results[name] = peak() - base
    print(json.dumps(results))
""")


def test_peak_host_memory_stays_within_the_budget_plus_a_layer(tmp_path):
    """A subprocess's peak RSS over each run (the high-water mark reset before it), first with a 4 MB budget, then
    with none, on 4096 tokens whose final carried state is ~59 MB (6 layers of hidden 512, a
    block snapshot at every layer: 6 rows and the partial sum, 14 KB a token), in batches of one 512-token sequence,
    whose forward needs some 30 MB (the depth mixes stack the batch's 7 sources)."""
    path = write_parent_layout(str(tmp_path / "wide"), hidden_size=512, attn_res_block_size=1, num_hidden_layers=6,
                               linear_attn_config=dict(num_heads=4, head_dim=16, full_attn_layers=[4, 6],
                                                       kda_layers=[1, 2, 3, 5]))
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(5).integers(0, 500, 4096))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, path, str(data), str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    grew = json.loads(run.stdout.strip().splitlines()[-1])
    state = 4096 * 7 * 512 * 4
    tensors = sq.Checkpoint(path).headers
    layer = tensors[sq.EMBED_KEY].stop - tensors[sq.EMBED_KEY].start + max(
        sum(t.stop - t.start for n, t in tensors.items() if n.startswith(sq.LAYER_PREFIX.format(i))) for i in range(6))
    # one batch's state, of which a depth mix holds some five copies at once (the inputs, their stack, its
    # normalised copy, the weighted product, the sum): the forward's working set
    sources = 512 * 7 * 512 * 4
    assert grew["budget"] <= 4e6 + layer + 5 * sources + 8e6, (grew, layer, sources)  # measured: 39 MB of 52
    assert grew["unlimited"] >= 0.8 * state, grew  # measured: 83 MB; the state is there when all of it is kept
