"""Upload a verified checkpoint folder to the Hugging Face Hub.

    python -m reap_tools upload DIR REPO_ID [--source SRC_DIR] [--private] [--revision BRANCH]
        [--message "..."] [--method auto|large|folder] [--dry-run]

REPO_ID must be a Hub repo id, `namespace/name` by huggingface_hub's rules (letters, digits, `-`, `_`, `.`; no
`--` or `..`; not ending in `.git`; the name at most 96 characters), checked before anything else, --dry-run
included. `verify` runs first (with sha256 checks against --source when given); a folder that fails it, a
half-written `.<name>.partial-<pid>` folder or one without config.json / weights is refused, so
only complete checkpoints reach the Hub. Only the release files go (the allow-list in release_files.py:
weights, index, configs, tokenizer, chat template, top-level remote code, README, licence,
reap_selection.json, read through links as release_files.py says); dotfiles such as `.env` or `.git`, folders,
symlink loops and links to files of other names out of the folder never do, and what is left out is listed on
stderr. A folder whose release files would not load (a file AutoTokenizer or AutoModelForCausalLM needs is left
out) is refused naming it. The token comes from `huggingface-cli login` or HF_TOKEN.

How (`--method`, default auto): folders of LARGE_FOLDER_BYTES or more (the 629 GB release) go through
huggingface_hub's resumable `upload_large_folder` (several commits; rerun the same command to resume an
interrupted upload), smaller ones through `upload_folder` in one commit with --message. The large upload
runs on a staging folder, `DIR/.cache/reap_tools-upload/`, that holds one link per release file and nothing
else, so the hub library walks only those (never a nested `.git` or any other folder) and keeps its resume
state there. huggingface_hub 1.x and later have no `upload_large_folder`: their `upload_folder` is the
resumable, multi-commit upload when `hf_xet` is installed, and is used instead (a large folder without
`hf_xet` is refused). --dry-run lists the files that would go, with sizes and the method, and touches no
network.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import CONFIG_NAME, INDEX_NAME, PARTIAL_RE, human, shard_names
from .cli import ArgumentParser, fail
from .release_files import load_problems, release_files
from .verify import verify_checkpoint


# From this many bytes of release files on, `auto` uploads with upload_large_folder (resumable, many commits).
LARGE_FOLDER_BYTES = 20 * 2**30
METHODS = ("auto", "large", "folder")
STAGING = Path(".cache") / "reap_tools-upload"  # inside the checkpoint folder; a dotted folder, never uploaded
# One part of a repo id, as huggingface_hub's validate_repo_id: word characters, '-' and '.', not at either end.
REPO_PART_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
MAX_REPO_NAME = 96


class UploadRefused(RuntimeError):
    """The folder is not a complete, verified checkpoint."""


@dataclass
class UploadResult:
    repo_id: str
    files: list[tuple[str, int]]  # (path relative to the folder, bytes)
    dry_run: bool
    url: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why it is not uploaded)
    method: str = "upload_folder"  # the HfApi method that uploads (or would upload) the files

    @property
    def total_size(self) -> int:
        return sum(size for _, size in self.files)


def check_repo_id(repo_id: str) -> None:
    """Refuse anything but `namespace/name` by huggingface_hub's repo id rules (a path such as `../../etc` too)."""
    namespace, _, name = repo_id.partition("/")
    if not (REPO_PART_RE.fullmatch(namespace) and REPO_PART_RE.fullmatch(name) and len(name) <= MAX_REPO_NAME
            and "--" not in repo_id and ".." not in repo_id and not repo_id.endswith(".git")):
        raise UploadRefused(f"repo id {repo_id!r} is not a Hub model repo id: give namespace/name (letters, digits, "
                            f"'-', '_', '.'; no '--' or '..'; not ending in '.git'; a name of at most "
                            f"{MAX_REPO_NAME} characters)")


def upload_files(folder: Path) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """(release files with sizes, sorted; [(name, why it is left out)]): exactly what upload sends."""
    taken, skipped = release_files(folder)
    return [(p.name, p.stat().st_size) for p in taken], skipped


def staging_folder(folder: Path, files: list[tuple[str, int]]) -> Path:
    """`folder/.cache/reap_tools-upload/`: one relative link per release file and nothing else (stale ones go).

    upload_large_folder walks every file under the folder it is given and keeps its resume state in
    `.cache/huggingface/` there; given this folder it sees only the release files (never a nested `.git`), and
    the same folder, hence the same resume state, is used again when the command is rerun.
    """
    stage = folder / STAGING
    stage.mkdir(parents=True, exist_ok=True)
    names = {name for name, _ in files}
    for entry in stage.iterdir():
        if entry.is_symlink() and entry.name not in names:
            entry.unlink()
    for name in names:
        link, target = stage / name, os.path.relpath(folder / name, stage)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return stage


def _xet_available() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return is_xet_available()


def choose_method(api, total_size: int, method: str = "auto") -> str:
    """The HfApi method for `total_size` bytes: upload_large_folder when the folder is large and the api has it."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    large = method == "large" or (method == "auto" and total_size >= LARGE_FOLDER_BYTES)
    if not large:
        return "upload_folder"
    if api is None:
        from huggingface_hub import HfApi as api  # only its attributes are read: no network
    if hasattr(api, "upload_large_folder"):
        return "upload_large_folder"
    if not _xet_available():
        raise UploadRefused(f"{human(total_size)} is too large for one commit, and this huggingface_hub has no "
                            "upload_large_folder: install hf_xet (`pip install hf_xet`) for its resumable, "
                            "multi-commit upload_folder, or pass --method folder to force one commit")
    return "upload_folder"  # huggingface_hub >= 1 with hf_xet: upload_folder is the resumable pipeline


def upload_checkpoint(folder: str | Path, repo_id: str, *, source: str | Path | None = None, private: bool = False,
                      revision: str | None = None, commit_message: str | None = None, dry_run: bool = False,
                      api=None, progress: bool = True, method: str = "auto") -> UploadResult:
    """Verify `folder`, then upload it to model repo `repo_id` (or only list it, with dry_run).

    `api` is an HfApi-like object (tests pass a mock); by default huggingface_hub.HfApi(). `method`:
    "auto" (upload_large_folder from LARGE_FOLDER_BYTES on), "large" or "folder" (one upload_folder commit).
    """
    check_repo_id(repo_id)
    folder = Path(folder)
    if PARTIAL_RE.match(folder.name):
        raise UploadRefused(f"{folder} is an unfinished prune output (temporary folder); rerun the prune")
    if not (folder / CONFIG_NAME).is_file():
        raise UploadRefused(f"{folder}: no {CONFIG_NAME}; not a complete checkpoint folder")
    result = verify_checkpoint(folder, source=source, progress=progress)
    if not result.ok:
        raise UploadRefused(f"verify failed, not uploading: {result.summary()}")
    files, skipped = upload_files(folder)
    needed = {CONFIG_NAME, *shard_names(folder)} | ({INDEX_NAME} if (folder / INDEX_NAME).exists() else set())
    left_out = sorted(needed - {name for name, _ in files})
    reasons = dict(skipped)
    left_out += [name for name, _ in load_problems(folder, only={name for name, _ in files}) if name not in left_out]
    if left_out:
        raise UploadRefused("the checkpoint needs files that are not uploaded: "
                            + ", ".join(f"{name} ({reasons.get(name, 'not a release file')})" for name in left_out))
    chosen = choose_method(api, sum(size for _, size in files), method)
    if dry_run:
        return UploadResult(repo_id, files, dry_run=True, skipped=skipped, method=chosen)
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id=repo_id, repo_type="model", branch=revision, exist_ok=True)
    patterns = [glob.escape(name) for name, _ in files]
    if chosen == "upload_large_folder":
        # Commits are made (and named) by huggingface_hub; --message does not apply.
        api.upload_large_folder(repo_id=repo_id, folder_path=str(staging_folder(folder, files)), repo_type="model",
                                revision=revision, private=private, allow_patterns=patterns,
                                print_report=progress)
        tree = f"tree/{revision}" if revision else "tree/main"
        return UploadResult(repo_id, files, dry_run=False, url=f"https://huggingface.co/{repo_id}/{tree}",
                            skipped=skipped, method=chosen)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                               commit_message=commit_message or f"Upload {folder.name} ({len(files)} files, verified)",
                               allow_patterns=patterns)
    return UploadResult(repo_id, files, dry_run=False, url=str(getattr(commit, "commit_url", commit)), skipped=skipped,
                        method=chosen)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m reap_tools upload", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="checkpoint folder (a prune output)")
    ap.add_argument("repo_id", help="Hub model repo, e.g. org/KIMI-K3-CODER-REAP-320-MXFP4")
    ap.add_argument("--source", type=Path, help="source checkpoint: also verify sha256 of every tensor against it")
    ap.add_argument("--private", action="store_true", help="create the repo private")
    ap.add_argument("--revision", help="branch to upload to (created if missing)")
    ap.add_argument("--message", help="commit message")
    ap.add_argument("--method", choices=METHODS, default="auto",
                    help=f"auto: upload_large_folder (resumable) from {human(LARGE_FOLDER_BYTES)} on, else upload_folder; "
                         "large / folder force one")
    ap.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar while verifying")
    args = ap.parse_args(argv)
    try:
        r = upload_checkpoint(args.folder, args.repo_id, source=args.source, private=args.private,
                              revision=args.revision, commit_message=args.message, dry_run=args.dry_run,
                              progress=not args.no_progress, method=args.method)
    except UploadRefused as e:
        print(f"upload: refused: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        return fail("upload", e)
    for name, why in r.skipped:
        print(f"upload: not uploaded: {name} ({why})", file=sys.stderr)
    if r.dry_run:
        width = max((len(name) for name, _ in r.files), default=0)
        for name, size in r.files:
            print(f"{name:<{width}}  {human(size):>10}")
        print(f"dry run: {len(r.files)} files, {human(r.total_size)} would go to {r.repo_id} with {r.method}")
    else:
        print(f"uploaded {len(r.files)} files, {human(r.total_size)} to {r.repo_id}: {r.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
