"""upload: dry run, refusal of unverified/incomplete folders, and the Hub calls (HfApi mocked; no network)."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import HfApi as RealHfApi

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
            "tiktoken.model", "generation_config.json", "chat_template.jinja", *REMOTE_CODE} | shards == listed
    assert not any("__pycache__" in name or "extra" in name for name in listed)
    assert out[-1].startswith("dry run: ") and "org/model" in out[-1]
    r = upload_checkpoint(dst, "org/model", dry_run=True, progress=False)
    sizes = dict(r.files)
    assert sizes["config.json"] == (dst / "config.json").stat().st_size and r.url is None


def test_refuses_corrupt_folder(pruned, monkeypatch):
    _, dst = pruned
    monkeypatch.setattr(upload, "LARGE_FOLDER_BYTES", 1)  # the large-folder path has the same gate
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    api = mock.Mock()
    with pytest.raises(UploadRefused, match=f"verify failed.*{shard.name}"):
        upload_checkpoint(dst, "org/model", api=api, progress=False)
    api.create_repo.assert_not_called()
    api.upload_folder.assert_not_called()
    api.upload_large_folder.assert_not_called()


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


class HubCalls:
    """huggingface_hub.HfApi with its Hub methods monkeypatched: records calls, makes no request.

    The fake upload_large_folder walks its folder the way the real one does (every file below it,
    links followed) and records what it saw.
    """

    def __init__(self, monkeypatch, large_folder=True):
        self.calls, self.seen = [], []
        for name in ("create_repo", "create_branch", "upload_folder"):
            monkeypatch.setattr(RealHfApi, name, self._record(name))
        if large_folder:
            monkeypatch.setattr(RealHfApi, "upload_large_folder", lambda api, *a, **k: self._large(*a, **k),
                                raising=False)
        else:
            monkeypatch.delattr(RealHfApi, "upload_large_folder", raising=False)
        monkeypatch.setattr(huggingface_hub, "HfApi", RealHfApi)

    def _record(self, name):
        def method(api, *args, **kwargs):
            self.calls.append((name, kwargs))
            return mock.Mock(commit_url=f"https://huggingface.co/x/commit/{name}")
        return method

    def _large(self, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_large_folder", {"repo_id": repo_id, "folder_path": folder_path, **kwargs}))
        root = Path(folder_path)
        self.seen.append({p.relative_to(root).as_posix(): p.read_bytes() for p in root.glob("**/*") if p.is_file()})
        (root / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)  # its resume state lives there

    def names(self):
        return [name for name, _ in self.calls]

    def kwargs(self, name):
        return next(kwargs for n, kwargs in self.calls if n == name)


def _add_nested_git(dst):
    """A nested .git (and one in a subfolder) holding files whose names match the release patterns."""
    for git in (dst / ".git", dst / "sub" / ".git"):
        (git / "objects").mkdir(parents=True)
        (git / "config.json").write_text("{}")
        (git / "objects" / "model-00001-of-00001.safetensors").write_bytes(b"not a shard")
    (dst / ".gitattributes").write_text("*.safetensors filter=lfs\n")


def test_large_folder_uses_resumable_upload_large_folder(pruned, monkeypatch, capsys):
    _, dst = pruned
    _add_nested_git(dst)
    monkeypatch.setattr(upload, "LARGE_FOLDER_BYTES", 1)
    hub = HubCalls(monkeypatch)
    assert upload.main([str(dst), "org/model", "--revision", "v1", "--private", "--no-progress"]) == 0
    assert hub.names() == ["create_repo", "create_branch", "upload_large_folder"]
    kwargs = hub.kwargs("upload_large_folder")
    assert kwargs["repo_id"] == "org/model" and kwargs["repo_type"] == "model" and kwargs["revision"] == "v1"
    assert kwargs["private"] is True
    files = dict(upload.upload_files(dst)[0])
    assert sorted(kwargs["allow_patterns"]) == sorted(files)
    # What the hub library walks: exactly the release files, with their bytes; no .git anywhere.
    (seen,) = hub.seen
    assert set(seen) == set(files) and not any(".git" in name for name in seen)
    assert all(seen[name] == (dst / name).read_bytes() for name in files)
    assert "tree/v1" in capsys.readouterr().out
    # Rerun (resume): the same staging folder and its resume state; a file gone from the release goes from it.
    (dst / "reap_selection.json").unlink()
    stage = Path(kwargs["folder_path"])
    assert (stage / ".cache" / "huggingface").is_dir()
    r = upload_checkpoint(dst, "org/model", api=RealHfApi(), progress=False)
    assert r.method == "upload_large_folder" and Path(hub.calls[-1][1]["folder_path"]) == stage
    assert set(hub.seen[-1]) == set(files) - {"reap_selection.json"}
    # The staging folder never becomes part of the release, nor trips verify.
    assert ".cache" not in dict(upload.upload_files(dst)[0])


def test_small_folder_is_one_upload_folder_commit(pruned, monkeypatch):
    _, dst = pruned
    _add_nested_git(dst)
    hub = HubCalls(monkeypatch)
    r = upload_checkpoint(dst, "org/model", api=RealHfApi(), progress=False, commit_message="release")
    assert hub.names() == ["create_repo", "upload_folder"] and r.method == "upload_folder"
    kwargs = hub.kwargs("upload_folder")
    assert kwargs["commit_message"] == "release"
    assert not any(".git" in p or "/" in p for p in kwargs["allow_patterns"])
    assert not (dst / ".cache").exists()
    # --method large forces the resumable path on a small folder.
    r = upload_checkpoint(dst, "org/model", api=RealHfApi(), progress=False, method="large")
    assert r.method == "upload_large_folder" and hub.names()[-1] == "upload_large_folder"


def test_hub_without_upload_large_folder(pruned, monkeypatch):
    """huggingface_hub >= 1 dropped upload_large_folder; its upload_folder resumes (with hf_xet)."""
    _, dst = pruned
    monkeypatch.setattr(upload, "LARGE_FOLDER_BYTES", 1)
    hub = HubCalls(monkeypatch, large_folder=False)
    monkeypatch.setattr(upload, "_xet_available", lambda: True)
    r = upload_checkpoint(dst, "org/model", api=RealHfApi(), progress=False)
    assert r.method == "upload_folder" and hub.names() == ["create_repo", "upload_folder"]
    monkeypatch.setattr(upload, "_xet_available", lambda: False)
    with pytest.raises(UploadRefused, match="hf_xet"):
        upload_checkpoint(dst, "org/model", api=RealHfApi(), progress=False)
    with pytest.raises(UploadRefused, match="hf_xet"):  # said before anything is sent, also in a dry run
        upload_checkpoint(dst, "org/model", progress=False, dry_run=True)
    assert hub.names() == ["create_repo", "upload_folder"]


def test_dry_run_says_the_method_and_lists_no_git(pruned, monkeypatch, capsys):
    _, dst = pruned
    _add_nested_git(dst)
    monkeypatch.setattr(upload, "LARGE_FOLDER_BYTES", 1)
    assert upload.main([str(dst), "org/model", "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1].endswith("with upload_large_folder")
    assert not any(".git" in line for line in out.out.splitlines())
    assert ".git (dotfile)" in out.err and not (dst / ".cache").exists()
