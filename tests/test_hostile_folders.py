"""Source and checkpoint folders as users really have them: folders of links, the hub cache, links to links, symlink
loops, files missing or left behind, an output inside its source and repo ids that are paths. A prune either writes
an output that AutoTokenizer and AutoModelForCausalLM load or exits non-zero naming the file; verify and upload
refuse a checkpoint the loaders cannot load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_prune_verify import UNIFORM, make_checkpoint, selection  # noqa: E402

from reap_tools import prune, upload  # noqa: E402
from reap_tools.checkpoint import PARTIAL_RE  # noqa: E402
from reap_tools.prune import prune_checkpoint  # noqa: E402
from reap_tools.remote_code import REMOTE_CODE, copy_remote_code  # noqa: E402
from reap_tools.verify import verify_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo" / "parent"
DEMO_SELECTION = ROOT / "demo" / "reap40" / "reap_selection.json"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def one_error_line(err: str, prog: str) -> str:
    """The single stderr line of a failed tool run (no traceback)."""
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def nothing_written(parent: Path, dst: Path) -> bool:
    return not dst.exists() and not any(PARTIAL_RE.match(p.name) for p in parent.iterdir())


def link_folder(folder: Path, source: Path) -> Path:
    """`folder` with one absolute link per entry of `source`, to the entry of the same name (`ln -s SRC/* .`)."""
    folder.mkdir(parents=True)
    for p in sorted(source.iterdir()):
        (folder / p.name).symlink_to(p.absolute())
    return folder


def hub_cache(root: Path, source: Path) -> Path:
    """`source` laid out as huggingface_hub caches a download; returns the snapshot folder.

    models--<org>--<name>/blobs/<hash> hold the bytes (sha256 for LFS files, the git blob sha1 for others),
    snapshots/<revision>/<file> are relative links to them and refs/main names the revision.
    """
    repo = root / "hub" / "models--org--kimi-k3-demo"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for p in sorted(source.iterdir()):
        if not p.is_file():
            continue
        data = p.read_bytes()
        digest = (hashlib.sha256(data) if p.suffix == ".safetensors"
                  else hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / p.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


LAYOUTS = {
    "links": lambda tmp: link_folder(tmp / "links", DEMO),
    "hub-cache": lambda tmp: hub_cache(tmp, DEMO),
    "links-to-hub-cache": lambda tmp: link_folder(tmp / "links", hub_cache(tmp, DEMO)),
}


def run_prune(src: Path, dst: Path, sel: Path) -> int:
    return prune.main([str(src), str(dst), "--selection", str(sel), "--no-progress"])


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("folders") / "ckpt")


@pytest.fixture
def sel(tmp_path) -> Path:
    path = tmp_path / "sel.json"
    path.write_text(json.dumps(selection(UNIFORM)))
    return path


@pytest.fixture(scope="module")
def pruned(src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("folders-pruned") / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, progress=False)
    return dst


# -- 1. sources made of links ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prune_of_a_linked_source_loads(layout, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = LAYOUTS[layout](tmp_path)
    dst = tmp_path / f"pruned-{layout}"
    assert run_prune(source, dst, DEMO_SELECTION) == 0, capsys.readouterr().err
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert not (dst / name).is_symlink() and (dst / name).read_bytes() == (DEMO / name).read_bytes(), name
    assert "train_log.json (not a release file)" in capsys.readouterr().err
    result = verify_checkpoint(dst, progress=False)
    assert result.ok, result.errors
    tokenizer = AutoTokenizer.from_pretrained(str(dst), trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(str(dst), trust_remote_code=True)
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_needed_file_linked_to_another_name_is_refused_by_name(src, sel, tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    shutil.copyfile(src / "tiktoken.model", store / "vocab-v2.bin")
    source = link_folder(tmp_path / "links", src)
    (source / "tiktoken.model").unlink()
    (source / "tiktoken.model").symlink_to(store / "vocab-v2.bin")
    dst = tmp_path / "pruned"
    assert run_prune(source, dst, sel) == 1
    line = one_error_line(capsys.readouterr().err, "prune")
    assert "tiktoken.model" in line and "vocab-v2.bin" in line
    assert nothing_written(tmp_path, dst)


def test_upload_sends_the_files_of_a_folder_of_links(pruned, tmp_path, capsys):
    folder = link_folder(tmp_path / "links", pruned)
    assert upload.main([str(folder), "org/model", "--dry-run", "--no-progress"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]}
    assert {"tiktoken.model", "tokenizer_config.json", "generation_config.json", "config.json"} <= listed


# -- 2. a checkpoint has everything the loaders need -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer_config.json", "generation_config.json"])
def test_prune_fails_naming_a_needed_file_the_source_lacks(src, sel, tmp_path, name, capsys):
    source = tmp_path / "source"
    shutil.copytree(src, source)
    (source / name).unlink()
    dst = tmp_path / "pruned"
    assert run_prune(source, dst, sel) == 1
    assert name in one_error_line(capsys.readouterr().err, "prune")
    assert nothing_written(tmp_path, dst)


def test_prune_fails_when_remote_code_is_not_written(src, sel, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prune, "copy_remote_code",
                        lambda dst: copy_remote_code(dst, [n for n in REMOTE_CODE if n != "configuration_kimi_k3.py"]))
    dst = tmp_path / "pruned"
    assert run_prune(src, dst, sel) == 1
    assert "configuration_kimi_k3.py" in one_error_line(capsys.readouterr().err, "prune")
    assert nothing_written(tmp_path, dst)


def test_prune_fails_when_the_tokenizer_names_a_module_it_does_not_carry(src, sel, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(src, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["auto_map"]["AutoTokenizer"] = ["tokenization_other.OtherTokenizer", None]
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    dst = tmp_path / "pruned"
    assert run_prune(source, dst, sel) == 1
    assert "tokenization_other.py" in one_error_line(capsys.readouterr().err, "prune")
    assert nothing_written(tmp_path, dst)


@pytest.mark.parametrize("name", ["configuration_kimi_k3.py", "modeling_kimi_k3.py", "kimi_k3_loading.py",
                                  "tokenization_kimi_k3.py", "kimi_k3_parsing.py", "tiktoken.model",
                                  "tokenizer_config.json", "generation_config.json"])
def test_verify_and_upload_name_a_file_the_loaders_need(pruned, tmp_path, name, capsys):
    dst = tmp_path / "pruned"
    shutil.copytree(pruned, dst)
    (dst / name).unlink()
    errors = verify_checkpoint(dst, progress=False).errors
    assert any(e.startswith(f"{name}: ") for e in errors), errors
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 1
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("auto_map"), "config.json: no auto_map"),
    (lambda c: c["auto_map"].pop("AutoModelForCausalLM"), "config.json: auto_map has no AutoModelForCausalLM"),
    (lambda c: c["auto_map"].update(AutoConfig="configuration_other.OtherConfig"), "configuration_other.py: "),
])
def test_verify_checks_the_auto_map(pruned, tmp_path, edit, message):
    dst = tmp_path / "pruned"
    shutil.copytree(pruned, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    errors = verify_checkpoint(dst, progress=False).errors
    assert any(e.startswith(message) for e in errors), errors


# -- 3. symlink loops ------------------------------------------------------------------------------------------------


def add_loops(folder: Path, *names: str) -> None:
    (folder / "a.json").symlink_to("b.json")
    (folder / "b.json").symlink_to("a.json")
    for name in names:
        (folder / name).symlink_to(name)


def test_prune_and_upload_skip_a_symlink_loop_by_name(src, sel, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(src, source)
    add_loops(source, "README.md")
    dst = tmp_path / "pruned"
    assert run_prune(source, dst, sel) == 0
    err = capsys.readouterr().err
    assert "not copied: README.md (symlink loop)" in err and "not copied: a.json (symlink loop)" in err
    assert "Traceback" not in err
    add_loops(dst, "LICENSE")
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "not uploaded: LICENSE (symlink loop)" in err and "Traceback" not in err


def test_a_needed_file_that_is_a_symlink_loop_fails_by_name(src, sel, pruned, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(src, source)
    (source / "tiktoken.model").unlink()
    add_loops(source, "tiktoken.model")
    dst = tmp_path / "pruned"
    assert run_prune(source, dst, sel) == 1
    line = one_error_line(capsys.readouterr().err, "prune")
    assert "tiktoken.model" in line and "symlink loop" in line
    assert nothing_written(tmp_path, dst)
    broken = tmp_path / "broken"
    shutil.copytree(pruned, broken)
    (broken / "tiktoken.model").unlink()
    (broken / "tiktoken.model").symlink_to("tiktoken.model")
    assert upload.main([str(broken), "org/model", "--dry-run", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "tiktoken.model" in err and "Traceback" not in err


def test_a_source_folder_that_is_a_symlink_loop_is_one_line(sel, tmp_path, capsys):
    (tmp_path / "loop").symlink_to("loop")
    assert run_prune(tmp_path / "loop", tmp_path / "pruned", sel) == 1
    assert "loop" in one_error_line(capsys.readouterr().err, "prune")
    assert upload.main([str(tmp_path / "loop"), "org/model", "--dry-run", "--no-progress"]) == 1


# -- 4. an output inside its source, repo ids that are paths ---------------------------------------------------------


@pytest.mark.parametrize("where", ["pruned", "sub/pruned", "via-link/pruned"])
def test_prune_into_its_own_source_is_refused(src, sel, tmp_path, where, capsys):
    source = tmp_path / "source"
    shutil.copytree(src, source)
    (tmp_path / "via-link").symlink_to(source)
    before = sorted(p.name for p in source.iterdir())
    dst = tmp_path / where if where.startswith("via-link") else source / where
    assert run_prune(source, dst, sel) == 1
    assert "inside the source" in one_error_line(capsys.readouterr().err, "prune")
    assert sorted(p.name for p in source.iterdir()) == before


@pytest.mark.parametrize("repo_id", ["../../etc", "org/../../etc", "/etc/passwd", "org/", "model", "org/a/b",
                                     "org/na me", "org/name.git", "org/a--b", "org/" + "x" * 97])
def test_upload_refuses_a_bad_repo_id_even_in_a_dry_run(pruned, repo_id, capsys):
    assert upload.main([str(pruned), repo_id, "--dry-run", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "repo id" in err and repr(repo_id) in err


@pytest.mark.parametrize("repo_id", ["org/model", "Org-1/KIMI-K3-CODER-REAP-320-MXFP4", "a_b/c.d"])
def test_upload_accepts_good_repo_ids(pruned, repo_id, capsys):
    assert upload.main([str(pruned), repo_id, "--dry-run", "--no-progress"]) == 0
