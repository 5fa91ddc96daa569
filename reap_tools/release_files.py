"""Which files of a checkpoint folder belong to the release: the one allow-list prune copies and upload sends.

Only top-level regular files whose names match RELEASE_PATTERNS count; dotfiles (`.env`, `.git...`), folders and
anything else are left out, so a secret or a scratch file next to the weights never travels. A symlink counts only
when it resolves inside the folder, or, for a Hugging Face cache snapshot (`.../snapshots/<commit>/`), inside that
repository's `blobs/`, where the cache keeps every file's bytes; a link that points anywhere else is left out.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from .checkpoint import CONFIG_NAME, INDEX_NAME, SELECTION_NAME

RELEASE_PATTERNS = (
    "*.safetensors", INDEX_NAME, CONFIG_NAME, "generation_config.json",
    "tiktoken.model", "tokenizer_config.json", "tokenizer.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja",
    "*.py",
    "README.md", "LICENSE*",
    SELECTION_NAME,
)


def is_release_name(name: str) -> bool:
    """A top-level file name the release may contain (never a dotfile)."""
    return not name.startswith(".") and any(fnmatch.fnmatchcase(name, p) for p in RELEASE_PATTERNS)


def _link_target_allowed(path: Path, folder: Path) -> bool:
    target = path.resolve()
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append(folder.parent.parent / "blobs")
    return any(target.is_relative_to(root) for root in roots)


def release_files(folder: str | Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files to take, sorted; [(name, why it is left out)]) for the top level of `folder`."""
    folder = Path(folder).resolve()
    taken, skipped = [], []
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            why = "dotfile"
        elif p.is_symlink() and not _link_target_allowed(p, folder):
            why = f"symlink to {p.resolve()}, outside the folder"
        elif p.is_dir():
            why = "folder"
        elif not p.is_file():
            why = "not a regular file"
        elif not is_release_name(p.name):
            why = "not a release file"
        else:
            taken.append(p)
            continue
        skipped.append((p.name, why))
    return taken, skipped
