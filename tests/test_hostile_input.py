"""Hostile or careless input to the checkpoint tools and the loader: stray files, wrong dtypes, configs the model
refuses, broken index files, a missing tokenizer file, bad numbers and unwritable outputs on the command line."""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from test_prune_verify import UNIFORM, make_checkpoint, selection  # noqa: E402

from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from reap_tools import generate, observe, plan, prune, upload, verify  # noqa: E402
from reap_tools.checkpoint import INDEX_NAME, PARTIAL_RE, CheckpointError, read_index  # noqa: E402
from reap_tools.prune import prune_checkpoint  # noqa: E402
from reap_tools.tiny import tiny_text_config, write_checkpoint  # noqa: E402
from reap_tools.verify import verify_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(err: str, prog: str) -> str:
    """The single stderr line of a failed tool run (no traceback)."""
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "ckpt")


@pytest.fixture
def littered(src, tmp_path) -> Path:
    """A copy of the source with a secret, an outward link, an inward link, a scratch file and a folder."""
    outside = tmp_path / "outside.md"
    outside.write_text("not part of the release")
    path = tmp_path / "littered"
    shutil.copytree(src, path)
    (path / ".env").write_text("HF_TOKEN=hf_secret\n")
    (path / "README.md").symlink_to(outside)
    (path / "LICENSE").write_text("licence")
    (path / "generation_config.json").unlink()
    (path / "generation_config.json").symlink_to("tokenizer_config.json")
    (path / "train_log.json").write_text("{}")
    return path


# -- 1. only release files are copied and uploaded ------------------------------------------------------------------


def test_prune_copies_only_release_files(littered, tmp_path, capsys):
    dst = tmp_path / "pruned"
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))
    assert prune.main([str(littered), str(dst), "--selection", str(sel), "--no-progress"]) == 0
    names = {p.name for p in dst.iterdir()}
    assert {"LICENSE", "generation_config.json", "tokenizer_config.json", "modeling_kimi_k3.py"} <= names
    assert not names & {".env", "README.md", "train_log.json", "extra"}
    assert not (dst / "generation_config.json").is_symlink()
    err = capsys.readouterr().err
    for name in (".env", "README.md", "train_log.json", "extra"):
        assert f"not copied: {name} (" in err
    assert "outside the folder" in err


def test_upload_dry_run_leaves_out_dotfiles_and_outward_links(src, tmp_path, capsys):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("private")
    (dst / ".env").write_text("HF_TOKEN=hf_secret\n")
    (dst / "LICENSE.txt").symlink_to(outside)
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    listed = {line.split()[0] for line in out.splitlines()[:-1]}
    assert ".env" not in listed and "LICENSE.txt" not in listed and "config.json" in listed
    assert "not uploaded: .env (dotfile)" in err and "not uploaded: LICENSE.txt (symlink to" in err


# -- 2. wrong dtypes are refused by the loader ----------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype, found, expected", [
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale", torch.bfloat16, "BF16", "U8"),
    ("language_model.model.layers.2.block_sparse_moe.gate.weight", torch.int64, "I64", "BF16 or F16 or F32"),
])
def test_wrong_dtype_is_an_error_naming_tensor_file_and_dtypes(packed_checkpoint, name, dtype, found, expected):
    from transformers import AutoModelForCausalLM

    path = Path(packed_checkpoint) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="wrong dtype") as info:
        AutoModelForCausalLM.from_pretrained(packed_checkpoint, trust_remote_code=True)
    assert f"{name} in model.safetensors ({found}, model expects {expected})" in str(info.value)


# -- 3. configs the model refuses, and a truncated source shard -----------------------------------------------------


@pytest.mark.parametrize("edit, key", [
    ({"num_experts_per_token": 0}, "num_experts_per_token"),
    ({"num_experts_per_token": 32}, "num_experts_per_token"),
    ({"num_experts": "20"}, "num_experts"),
])
def test_verify_and_upload_refuse_configs_the_model_refuses(src, tmp_path, capsys, edit, key):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(edit)
    (dst / "config.json").write_text(json.dumps(config))
    errors = verify_checkpoint(dst, progress=False).errors
    assert any("the model refuses this config" in e and key in e for e in errors), errors
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 1
    assert key in capsys.readouterr().err


def test_verify_source_with_truncated_shard_names_the_file(src, tmp_path, capsys):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    source = tmp_path / "source"
    shutil.copytree(src, source)
    shard = sorted(source.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert verify.main([str(dst), "--source", str(source), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("FAILED") and f"{shard}: unexpected end of file" in err and "Traceback" not in err


# -- 4. missing tiktoken.model, malformed index files ---------------------------------------------------------------


def test_missing_tiktoken_model_names_the_file_folder_and_source(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer_config.json", "tokenization_kimi_k3.py", "kimi_k3_parsing.py", "chat_template.jinja"):
        shutil.copyfile(ROOT / "demo" / "reap40" / name, folder / name)
    shutil.copyfile(ROOT / "tokenization_kimi_k3.py", folder / "tokenization_kimi_k3.py")
    with pytest.raises(Exception) as info:
        AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    chain = [info.value]  # transformers 4.57 without protobuf re-raises any tokenizer error as an ImportError
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    assert any(isinstance(e, ValueError) and re.search(rf"tiktoken\.model is missing in {re.escape(str(folder))}: "
                                                       r".*moonshotai/Kimi-K3", str(e)) for e in chain), chain


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"metadata": {}}', '{"weight_map": {"a": 3}}'])
def test_malformed_index_is_an_error_naming_it(tmp_path, text):
    from transformers import AutoModelForCausalLM

    directory = Path(write_checkpoint(str(tmp_path / "sharded"), packed=True, max_shard_size="100KB"))
    (directory / INDEX_NAME).write_text(text)
    with pytest.raises(ValueError, match=INDEX_NAME):
        AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True)
    with pytest.raises(CheckpointError, match=INDEX_NAME):
        read_index(directory)


def test_index_naming_a_file_outside_the_folder_is_refused(src, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../elsewhere.safetensors"
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a shard file name in the folder"):
        read_index(path)


# -- 5. num_experts_per_tok --------------------------------------------------------------------------------------------


def test_num_experts_per_tok_is_an_alias_and_a_conflict_is_an_error():
    text = tiny_text_config()
    del text["num_experts_per_token"]
    config = KimiK3Config(text_config={**text, "num_experts_per_tok": 4})
    assert config.text_config.num_experts_per_token == 4
    written = config.to_dict()["text_config"]
    assert written["num_experts_per_token"] == 4 and "num_experts_per_tok" not in written
    with pytest.raises(ValueError, match="num_experts_per_tok = 4 and num_experts_per_token = 2 disagree"):
        KimiK3Config(text_config={**tiny_text_config(), "num_experts_per_tok": 4})


# -- 6. the command line ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool, argv, message", [
    (generate, ["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (generate, ["--no-thinking"], "--no-thinking only applies with --chat"),
    (observe, ["--model", "m", "--data", "d.npy", "--out", "r.json", "--max-tokens", "-100"],
     "argument --max-tokens: must be >= 1, got -100"),
    (verify, ["somewhere", "--workers", "0"], "argument --workers: must be >= 1, got 0"),
    (plan, ["report.json", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
])
def test_bad_numbers_and_flags_are_refused(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_plan_refuses_to_overwrite_its_report(tmp_path, capsys):
    from test_plan import make_report

    report = tmp_path / "report.json"
    report.write_text(json.dumps(make_report()))
    before = report.read_bytes()
    for flags in (["-o", str(report), "--no-heatmap"], ["-o", str(tmp_path / "sel.json"), "--heatmap", str(report)]):
        with pytest.raises(SystemExit):
            plan.main([str(report), "-n", "4", *flags])
        assert "is the report itself" in capsys.readouterr().err
    assert report.read_bytes() == before and not (tmp_path / "sel.json").exists()


def test_observe_unwritable_output_fails_before_loading(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = observe.main(["--model", str(tmp_path / "no-model"), "--data", "d.npy",
                         "--out", str(blocker / "report.json"), "--no-progress"])
    assert code == 1 and str(blocker) in one_error_line(capsys.readouterr().err, "observe")


def test_prune_unwritable_output_and_bad_shard_size(src, tmp_path, capsys):
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert prune.main([str(src), str(blocker / "out"), "--selection", str(sel), "--no-progress"]) == 1
    assert str(blocker) in one_error_line(capsys.readouterr().err, "prune")
    assert prune.main([str(src), str(tmp_path / "out"), "--selection", str(sel), "--max-shard-size", "0",
                       "--no-progress"]) == 1
    assert "max shard size must be positive" in one_error_line(capsys.readouterr().err, "prune")
    assert prune.main([str(tmp_path / "missing"), str(tmp_path / "out"), "--selection", str(sel)]) == 1
    assert "config.json: missing in" in one_error_line(capsys.readouterr().err, "prune")


def test_prune_on_a_full_disk_leaves_nothing_behind(src, tmp_path, monkeypatch, capsys):
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(selection(UNIFORM)))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prune, "copy_range", full)
    assert prune.main([str(src), str(tmp_path / "out"), "--selection", str(sel), "--no-progress"]) == 1
    assert "No space left on device" in one_error_line(capsys.readouterr().err, "prune")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sel.json"]
    assert not any(PARTIAL_RE.match(p.name) for p in tmp_path.iterdir())


def test_generate_warns_when_the_prompt_passes_max_position_embeddings(tmp_path, capsys):
    model = tmp_path / "reap40"
    shutil.copytree(ROOT / "demo" / "reap40", model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 8
    (model / "config.json").write_text(json.dumps(config))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert generate.main(["--model", str(model), "--prompt", "def f(x):\n    return x + 1\n" * 2,
                              "--max-new-tokens", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "passes the model's max_position_embeddings = 8" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "\n"])
def test_generate_refuses_an_empty_prompt(prompt, capsys):
    with pytest.raises(SystemExit) as info:
        generate.main(["--prompt", prompt, "--max-new-tokens", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt is empty" in err
