"""Prepare the training corpus of the trained Kimi K3 demo (issue 5), on the CPU machine.

    python -m demo_build.prepare_corpus [--out data] [--stdlib DIR] [--doc-dir DIR] [--vocab-size 4096]

Two sources, each split into train / held-out **by file**:

* code: the Python standard library of this machine (`--stdlib`, default the running interpreter's `Lib`),
  every `.py` file outside `site-packages`, `encodings/` and `pydoc_data/` (tables and generated text, not code)
  that parses with `ast.parse` (drops Python 2 fixtures and the test suite's deliberately broken files);
* prose: the reStructuredText sources of the Python documentation (`_sources/**/*.rst.txt`) from Debian's
  `python3.11-doc` package (`python3-doc` depends on it). Without `--doc-dir` the package is fetched with
  `apt-get download` into `--cache` (default .tmp/corpus-cache, git-ignored) and unpacked there with `dpkg -x`.

A file is held out iff `sha256(relative path) mod 100 < --heldout-percent` (default 5): deterministic, independent
of file order and content, and stable when files are added. The BPE vocabulary (`reap_tools/bpe.py`, `--vocab-size`
ranks, single bytes included) is trained on the train files only; the 256 K3 reserved specials follow the ranks.
Each file is encoded as plain text (`KimiK3Tokenizer.encode_ordinary`) followed by the end-of-document id
`<|end_of_msg|>` (= num_ranks + 2, the config's eos_token_id), and the files of each split are concatenated.

Writes into --out (git-ignored): tiktoken.model, {train,val}_{code,prose}.npy (uint16 token ids) and manifest.json
(sources, file lists with sha256, counts, special ids).
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from reap_tools import bpe
from tokenization_kimi_k3 import NUM_RESERVED_SPECIAL_TOKENS, KimiK3Tokenizer, write_rank_file

ROOT = Path(__file__).resolve().parents[1]

DOC_PACKAGE = "python3.11-doc"
CODE_EXCLUDED_DIRS = ("site-packages", "encodings", "pydoc_data", "__pycache__")
MAX_FILE_BYTES = 1 << 20  # a few generated files are larger than any hand-written module
SPLITS = ("train", "val")
SOURCES = ("code", "prose")


def held_out(relpath: str, percent: int) -> bool:
    """The split rule: a file is held out iff sha256(its relative path) mod 100 < percent."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % 100 < percent


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if not data.strip() or len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def code_files(stdlib: Path) -> dict[str, str]:
    """relative path -> text of the stdlib .py files that are real, parseable Python 3 source."""
    out = {}
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if any(part in CODE_EXCLUDED_DIRS for part in Path(rel).parts[:-1]) or rel.startswith("_sysconfigdata"):
            continue
        text = _read_text(path)
        if text is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        out[rel] = text
    return out


def fetch_doc_sources(workdir: Path) -> tuple[Path, str]:
    """Download and unpack Debian's python3.11-doc; returns (the _sources folder, the .deb file name)."""
    debs = sorted(workdir.glob(f"{DOC_PACKAGE}_*.deb"))
    if not debs:
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", DOC_PACKAGE], cwd=workdir, check=True)
        debs = sorted(workdir.glob(f"{DOC_PACKAGE}_*.deb"))
    deb = debs[-1]
    unpacked = workdir / "python3-doc"
    if not unpacked.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=workdir, prefix=".unpack-"))
        subprocess.run(["dpkg", "-x", str(deb), str(tmp)], check=True)
        tmp.rename(unpacked)
    found = glob.glob(str(unpacked / "usr/share/doc/python3*/html/_sources"))
    if not found:
        raise FileNotFoundError(f"{deb}: no html/_sources folder inside")
    return Path(found[0]), deb.name


def prose_files(sources: Path) -> dict[str, str]:
    """relative path -> text of the documentation's reStructuredText sources."""
    out = {}
    for path in sorted(sources.rglob("*.rst.txt")):
        text = _read_text(path)
        if text is not None:
            out[path.relative_to(sources).as_posix()] = text
    return out


def encode_split(tokenizer: KimiK3Tokenizer, texts: list[str], eod: int) -> np.ndarray:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode_ordinary(text))
        ids.append(eod)
    array = np.asarray(ids, dtype=np.int64)
    assert array.max() < 1 << 16
    return array.astype(np.uint16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "data"), help="output folder (default: data/, git-ignored)")
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="Python Lib folder (code source)")
    parser.add_argument("--doc-dir", default=None, help="an html/_sources folder (default: fetch python3.11-doc)")
    parser.add_argument("--cache", default=str(ROOT / ".tmp" / "corpus-cache"), help="where the .deb is unpacked")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE ranks, the 256 single bytes included")
    parser.add_argument("--heldout-percent", type=int, default=5)
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    stdlib = Path(args.stdlib).resolve()
    if args.doc_dir:
        doc_dir, deb = Path(args.doc_dir).resolve(), None
    else:
        doc_dir, deb = fetch_doc_sources(Path(args.cache))
    files = {"code": code_files(stdlib), "prose": prose_files(doc_dir)}
    split = {
        source: {s: sorted(rel for rel in found if held_out(rel, args.heldout_percent) == (s == "val")) for s in SPLITS}
        for source, found in files.items()
    }
    for source in SOURCES:
        n_train, n_val = len(split[source]["train"]), len(split[source]["val"])
        size = sum(len(files[source][r].encode()) for r in files[source])
        print(f"{source}: {n_train} train + {n_val} held-out files, {size / 1e6:.1f} MB")

    train_texts = [files[source][rel] for source in SOURCES for rel in split[source]["train"]]
    t0 = time.time()
    ranks = bpe.train(train_texts, args.vocab_size)
    rank_file = out / "tiktoken.model"
    write_rank_file(ranks, rank_file)
    print(f"BPE: {len(ranks)} ranks trained on the train split in {time.time() - t0:.1f}s -> {rank_file}")
    tokenizer = KimiK3Tokenizer(vocab_file=str(rank_file))
    num_ranks = len(ranks)
    eod = tokenizer.special_ids["<|end_of_msg|>"]
    assert eod == num_ranks + 2

    manifest = {
        "vocab_ranks": num_ranks,
        "vocab_size": num_ranks + NUM_RESERVED_SPECIAL_TOKENS,
        "end_of_document_id": eod,
        "heldout_rule": f"sha256(relative path) % 100 < {args.heldout_percent}",
        "sources": {
            "code": {"root": str(stdlib), "python": sys.version.split()[0]},
            "prose": {"root": str(doc_dir), "debian_package": deb},
        },
        "splits": {},
    }
    for source in SOURCES:
        for s in SPLITS:
            rels = split[source][s]
            texts = [files[source][rel] for rel in rels]
            ids = encode_split(tokenizer, texts, eod)
            np.save(out / f"{s}_{source}.npy", ids)
            nbytes = sum(len(t.encode()) for t in texts)
            manifest["splits"][f"{s}_{source}"] = {
                "files": len(rels),
                "bytes": nbytes,
                "tokens": int(ids.size),
                "bytes_per_token": round(nbytes / max(1, ids.size - len(rels)), 3),
                "paths": {rel: hashlib.sha256(files[source][rel].encode()).hexdigest()[:16] for rel in rels},
            }
            print(f"{s}_{source}: {len(rels)} files, {nbytes / 1e6:.2f} MB -> {ids.size} tokens")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(os.path.getsize(out / f"{s}_{src}.npy") for s in SPLITS for src in SOURCES)
    print(f"wrote {out} ({total / 1e6:.1f} MB of token ids) in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
