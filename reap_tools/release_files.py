"""Which files of a checkpoint folder belong to the release: the one allow-list prune copies and upload sends.

Only top-level regular files whose names match RELEASE_PATTERNS count; dotfiles (`.env`, `.git...`), folders and
anything else are left out, so a secret or a scratch file next to the weights never travels. A symlink counts when
it resolves inside the folder; when it leads, possibly through other links, to a file of its own name elsewhere (a
folder of links, `ln -s SRC/* .`); or when one of the links it goes through is a file of its name in a Hugging Face
cache snapshot (`.../snapshots/<commit>/<name>`) and it ends in that repository's `blobs/`, where the cache keeps
every file's bytes. A link to a file of another name outside the folder, a broken link and a symlink loop are left
out, by name and why.

`load_problems` says which files AutoTokenizer and AutoModelForCausalLM (trust_remote_code) need from a folder and
cannot use there: prune checks its output with it before publishing, verify and upload check a checkpoint.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import stat
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


MAX_HOPS = 40  # the kernel's own limit on links followed in one path lookup


def _hops(path: Path):
    """`path` and each path its chain of links goes through, one link at a time."""
    here = path
    for _ in range(MAX_HOPS):
        yield here
        if not here.is_symlink():
            return
        here = Path(os.path.normpath(os.path.join(os.path.realpath(here.parent), os.readlink(here))))


def _in_snapshot_blobs(hop: Path, target: Path) -> bool:
    snapshot = Path(os.path.realpath(hop.parent))
    return snapshot.parent.name == "snapshots" and target.is_relative_to(snapshot.parent.parent / "blobs")


def _link_problem(path: Path, folder: Path) -> str | None:
    """None when the symlink `path` may be taken as its name (see the module docstring), else why not."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        return f"broken symlink to {os.readlink(path)}" if e.errno == errno.ENOENT else f"symlink: {e.strerror}"
    target = Path(os.path.realpath(path))
    if target.is_relative_to(folder) or target.name == path.name:
        return None
    if any(hop.name == path.name and _in_snapshot_blobs(hop, target) for hop in _hops(path)):
        return None
    return f"symlink to {target}, a file of another name outside the folder"


def release_files(folder: str | Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files to take, sorted; [(name, why it is left out)]) for the top level of `folder`."""
    folder = Path(os.path.realpath(folder))
    taken, skipped = [], []
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            why = "dotfile"
        elif p.is_symlink() and (problem := _link_problem(p, folder)):
            why = problem
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


GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
VOCAB_FILE = "tiktoken.model"
# The files of a release the loaders need that are not code or weights; prune copies them from its source.
LOAD_FILES = (CONFIG_NAME, TOKENIZER_CONFIG, VOCAB_FILE, GENERATION_CONFIG)
MODEL_AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM")
# transformers' own patterns for a remote module's relative imports (dynamic_module_utils.get_relative_imports).
RELATIVE_IMPORT_RES = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                       re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))


def _file_problem(path: Path) -> str | None:
    """None for a readable regular file (through links), else what is wrong with it."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        if path.is_symlink():
            return f"broken symlink to {os.readlink(path)}"
        return "missing" if e.errno == errno.ENOENT else e.strerror
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return "empty" if st.st_size == 0 else None


def _read_object(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _module_file(reference: str) -> str | None:
    """The file of an auto_map class reference (`module.Class`), None for one in another repo (`repo--module.Class`)."""
    if "--" in reference:
        return None
    return reference.rsplit(".", 1)[0].replace(".", "/") + ".py"


def load_problems(folder: str | Path, only: set[str] | None = None) -> list[tuple[str, str]]:
    """[(file, what is wrong)] for every file AutoTokenizer and AutoModelForCausalLM (trust_remote_code) need from
    `folder` and could not use: config.json with an auto_map naming AutoConfig and AutoModelForCausalLM,
    tokenizer_config.json with an auto_map naming AutoTokenizer, tiktoken.model, generation_config.json, and every
    module those auto_maps name with the modules they import relatively. Empty when nothing is wrong.

    With `only` (the names that will travel, as upload sends them), a needed file outside it is "left out"."""
    folder = Path(folder)

    def problem_of(name: str) -> str | None:
        return "left out" if only is not None and name not in only else _file_problem(folder / name)

    problems: list[tuple[str, str]] = []
    modules: dict[str, str] = {}  # module file -> who needs it
    for name in LOAD_FILES:
        problem = problem_of(name)
        if problem:
            problems.append((name, problem))
            continue
        if name not in (CONFIG_NAME, TOKENIZER_CONFIG, GENERATION_CONFIG):
            continue
        try:
            obj = _read_object(folder / name)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            problems.append((name, f"cannot parse: {e}"))
            continue
        if name == GENERATION_CONFIG:
            continue
        classes = MODEL_AUTO_CLASSES if name == CONFIG_NAME else ("AutoTokenizer",)
        auto_map = obj.get("auto_map")
        if not isinstance(auto_map, dict):
            problems.append((name, f"no auto_map, so the {' / '.join(classes)} code is not found"))
            continue
        for cls in classes:
            refs = auto_map.get(cls)
            refs = [refs] if isinstance(refs, str) else refs if isinstance(refs, list) else []
            refs = [r for r in refs if r is not None]
            if not refs or not all(isinstance(r, str) for r in refs):
                problems.append((name, f"auto_map has no {cls}"))
            for ref in refs:
                if isinstance(ref, str) and (file := _module_file(ref)):
                    modules.setdefault(file, f"{name} auto_map {cls} names it")
    queue = list(modules)
    while queue:
        file = queue.pop(0)
        problem = problem_of(file)
        if problem:
            problems.append((file, f"{problem}; {modules[file]}"))
            continue
        try:
            text = (folder / file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            problems.append((file, f"cannot read: {e}"))
            continue
        for pattern in RELATIVE_IMPORT_RES:
            for imported in pattern.findall(text):
                dep = imported.split(".")[0] + ".py"
                if dep not in modules:
                    modules[dep] = f"{file} imports it"
                    queue.append(dep)
    return problems
