"""Upload a verified checkpoint folder to the Hugging Face Hub.

    python -m reap_tools upload DIR REPO_ID [--source SRC_DIR] [--private] [--revision BRANCH]
        [--message "..."] [--dry-run]

`verify` runs first (with sha256 checks against --source when given); a folder that fails it, a
half-written `.<name>.partial-<pid>` folder or one without config.json / weights is refused, so
only complete checkpoints reach the Hub. Then `create_repo(exist_ok=True)` and `upload_folder`
(huggingface_hub; the token comes from `huggingface-cli login` or HF_TOKEN). --dry-run lists the
files that would go, with sizes, and touches no network.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CONFIG_NAME, PARTIAL_RE, human
from .verify import verify_checkpoint

IGNORE_PATTERNS = [".git/*", ".cache/*", "*/__pycache__/*", "__pycache__/*", "*.pyc", ".DS_Store"]


class UploadRefused(RuntimeError):
    """The folder is not a complete, verified checkpoint."""


@dataclass
class UploadResult:
    repo_id: str
    files: list[tuple[str, int]]  # (path relative to the folder, bytes)
    dry_run: bool
    url: str | None = None

    @property
    def total_size(self) -> int:
        return sum(size for _, size in self.files)


def upload_files(folder: Path) -> list[tuple[str, int]]:
    """Files upload_folder would send (IGNORE_PATTERNS applied), sorted, with sizes."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not any(fnmatch.fnmatch(rel, pat) for pat in IGNORE_PATTERNS):
            out.append((rel, p.stat().st_size))
    return out


def upload_checkpoint(folder: str | Path, repo_id: str, *, source: str | Path | None = None, private: bool = False,
                      revision: str | None = None, commit_message: str | None = None, dry_run: bool = False,
                      api=None, progress: bool = True) -> UploadResult:
    """Verify `folder`, then upload it to model repo `repo_id` (or only list it, with dry_run).

    `api` is an HfApi-like object (tests pass a mock); by default huggingface_hub.HfApi().
    """
    folder = Path(folder)
    if PARTIAL_RE.match(folder.name):
        raise UploadRefused(f"{folder} is an unfinished prune output (temporary folder); rerun the prune")
    if not (folder / CONFIG_NAME).is_file():
        raise UploadRefused(f"{folder}: no {CONFIG_NAME}; not a complete checkpoint folder")
    result = verify_checkpoint(folder, source=source, progress=progress)
    if not result.ok:
        raise UploadRefused(f"verify failed, not uploading: {result.summary()}")
    files = upload_files(folder)
    if dry_run:
        return UploadResult(repo_id, files, dry_run=True)
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id=repo_id, repo_type="model", branch=revision, exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                               commit_message=commit_message or f"Upload {folder.name} ({len(files)} files, verified)",
                               ignore_patterns=IGNORE_PATTERNS)
    return UploadResult(repo_id, files, dry_run=False, url=str(getattr(commit, "commit_url", commit)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reap_tools upload", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="checkpoint folder (a prune output)")
    ap.add_argument("repo_id", help="Hub model repo, e.g. org/KIMI-K3-CODER-REAP-320-MXFP4")
    ap.add_argument("--source", type=Path, help="source checkpoint: also verify sha256 of every tensor against it")
    ap.add_argument("--private", action="store_true", help="create the repo private")
    ap.add_argument("--revision", help="branch to upload to (created if missing)")
    ap.add_argument("--message", help="commit message")
    ap.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar while verifying")
    args = ap.parse_args(argv)
    try:
        r = upload_checkpoint(args.folder, args.repo_id, source=args.source, private=args.private,
                              revision=args.revision, commit_message=args.message, dry_run=args.dry_run,
                              progress=not args.no_progress)
    except UploadRefused as e:
        print(f"upload: refused: {e}", file=sys.stderr)
        return 1
    if r.dry_run:
        width = max(len(name) for name, _ in r.files)
        for name, size in r.files:
            print(f"{name:<{width}}  {human(size):>10}")
        print(f"dry run: {len(r.files)} files, {human(r.total_size)} would go to {r.repo_id}")
    else:
        print(f"uploaded {len(r.files)} files, {human(r.total_size)} to {r.repo_id}: {r.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
