"""upload: dry run, refusal of unverified/incomplete folders, and the Hub calls (HfApi mocked; no network)."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_prune_verify import UNIFORM, flip_byte, make_checkpoint, selection  # noqa: E402

from reap_tools import upload  # noqa: E402
from reap_tools.prune import prune_checkpoint  # noqa: E402
from reap_tools.remote_code import REMOTE_CODE  # noqa: E402
from reap_tools.upload import UploadRefused, upload_checkpoint  # noqa: E402

P = "language_model.model.layers."


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any real HfApi use fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "HfApi", mock.Mock(side_effect=AssertionError("network used")))


@pytest.fixture
def pruned(tmp_path) -> tuple[Path, Path]:
    src = make_checkpoint(tmp_path / "src")
    dst = tmp_path / "pruned"
    prune_checkpoint(src, selection(UNIFORM), dst, max_shard_size="20KB", progress=False)
    (dst / "__pycache__").mkdir()
    (dst / "__pycache__" / "x.pyc").write_bytes(b"junk")
    return src, dst


def test_dry_run_lists_files_with_sizes(pruned, capsys):
    _, dst = pruned
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = {line.split()[0] for line in out[:-1]}
    shards = {p.name for p in dst.glob("model-*.safetensors")}
    assert len(shards) >= 3
    assert {"config.json", "model.safetensors.index.json", "reap_selection.json", "tokenizer_config.json",
            *REMOTE_CODE} | shards == listed
    assert not any("__pycache__" in name or "extra" in name for name in listed)
    assert out[-1].startswith("dry run: ") and "org/model" in out[-1]
    r = upload_checkpoint(dst, "org/model", dry_run=True, progress=False)
    sizes = dict(r.files)
    assert sizes["config.json"] == (dst / "config.json").stat().st_size and r.url is None


def test_refuses_corrupt_folder(pruned):
    _, dst = pruned
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    api = mock.Mock()
    with pytest.raises(UploadRefused, match=f"verify failed.*{shard.name}"):
        upload_checkpoint(dst, "org/model", api=api, progress=False)
    api.create_repo.assert_not_called()
    api.upload_folder.assert_not_called()


def test_refuses_bytes_that_differ_from_source(pruned, capsys):
    src, dst = pruned
    name = f"{P}3.block_sparse_moe.experts.0.w2.weight_scale"
    flip_byte(dst, name)
    assert upload.main([str(dst), "org/model", "--source", str(src), "--dry-run", "--no-progress"]) == 1
    assert name in capsys.readouterr().err


def test_refuses_incomplete_folders(pruned, tmp_path):
    _, dst = pruned
    partial = tmp_path / ".pruned.partial-12345"
    dst.rename(partial)
    with pytest.raises(UploadRefused, match="unfinished"):
        upload_checkpoint(partial, "org/model", dry_run=True, progress=False)
    (partial / "config.json").unlink()
    partial.rename(dst)
    with pytest.raises(UploadRefused, match="no config.json"):
        upload_checkpoint(dst, "org/model", dry_run=True, progress=False)


def test_upload_calls_hub(pruned):
    src, dst = pruned
    api = mock.Mock()
    api.upload_folder.return_value = mock.Mock(commit_url="https://huggingface.co/org/model/commit/abc")
    r = upload_checkpoint(dst, "org/model", source=src, private=True, revision="v1", api=api, progress=False)
    api.create_repo.assert_called_once_with(repo_id="org/model", repo_type="model", private=True, exist_ok=True)
    api.create_branch.assert_called_once_with(repo_id="org/model", repo_type="model", branch="v1", exist_ok=True)
    kwargs = api.upload_folder.call_args.kwargs
    assert kwargs["folder_path"] == str(dst) and kwargs["repo_id"] == "org/model" and kwargs["revision"] == "v1"
    assert sorted(kwargs["allow_patterns"]) == sorted(name for name, _ in r.files)
    assert r.url.endswith("/commit/abc") and not r.dry_run


def test_cli_uses_hfapi(pruned, monkeypatch, capsys):
    _, dst = pruned
    api = mock.Mock()
    api.upload_folder.return_value = mock.Mock(commit_url="https://huggingface.co/org/model/commit/def")
    monkeypatch.setattr(huggingface_hub, "HfApi", mock.Mock(return_value=api))
    assert upload.main([str(dst), "org/model", "--no-progress"]) == 0
    api.create_repo.assert_called_once()
    assert api.create_branch.call_count == 0
    assert "commit/def" in capsys.readouterr().out
