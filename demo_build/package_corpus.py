"""More training code for the demo (issue 21): the Python sources of installed, permissively licensed packages.

    python -m demo_build.package_corpus [--data data] [--packages numpy,scipy,...] [--max-mb 24] [--workers 16]

Adds `train_code_packages.npy` (uint16 token ids, each file followed by the end-of-document id, as
`demo_build.prepare_corpus` writes) and `packages.json` (per package: version, licence as its metadata states it,
files kept and dropped, bytes, tokens) to the corpus folder `--data`, whose tokenizer and splits it reuses. The
held-out splits stay exactly `prepare_corpus.py`'s; nothing from them reaches training:

* a file is dropped when 20 % or more of its distinct lines of 24+ characters (stripped) occur in a held-out file
  (vendored copies and backports of standard-library modules);
* exact copies (same text after stripping trailing whitespace) of a stdlib train file or of another kept file are
  dropped;
* only `.py` files under 1 MiB that decode as UTF-8 and pass `ast.parse` count, as for the stdlib.

Each package contributes at most `--max-mb` MB, taken in sha256(relative path) order (deterministic, and not
biased to any one sub-package), so the large libraries do not drown the rest. The licences are checked by name
against `LICENCES` below (each is the licence its project publishes); a package missing here is an error.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import json
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from tokenization_kimi_k3 import KimiK3Tokenizer

ROOT = Path(__file__).resolve().parents[1]

# distribution name -> the licence its project publishes (permissive ones only)
LICENCES = {
    "numpy": "BSD-3-Clause", "scipy": "BSD-3-Clause", "pandas": "BSD-3-Clause", "scikit-learn": "BSD-3-Clause",
    "sympy": "BSD-3-Clause", "networkx": "BSD-3-Clause", "statsmodels": "BSD-3-Clause", "matplotlib": "PSF-style "
    "(Matplotlib License)", "seaborn": "BSD-3-Clause", "xarray": "Apache-2.0", "scikit-image": "BSD-3-Clause",
    "requests": "Apache-2.0", "urllib3": "MIT", "click": "BSD-3-Clause", "jinja2": "BSD-3-Clause",
    "werkzeug": "BSD-3-Clause", "pygments": "BSD-2-Clause", "rich": "MIT", "attrs": "MIT", "packaging":
    "Apache-2.0 OR BSD-2-Clause", "pyparsing": "MIT", "setuptools": "MIT", "pip": "MIT", "pytest": "MIT",
    "pluggy": "MIT", "joblib": "BSD-3-Clause", "toolz": "BSD-3-Clause", "cloudpickle": "BSD-3-Clause",
    "fsspec": "BSD-3-Clause", "sortedcontainers": "Apache-2.0", "mpmath": "BSD-3-Clause", "patsy": "BSD-2-Clause",
    "httpx": "BSD-3-Clause", "anyio": "MIT", "markdown": "BSD-3-Clause", "tabulate": "MIT", "pyyaml": "MIT",
    "python-dateutil": "Apache-2.0 OR BSD-3-Clause", "torch": "BSD-3-Clause", "transformers": "Apache-2.0",
    "accelerate": "Apache-2.0", "jax": "Apache-2.0", "flax": "Apache-2.0", "optax": "Apache-2.0",
}
DEFAULT_PACKAGES = ",".join(LICENCES)
MIN_LINE = 24
OVERLAP = 0.2
MAX_FILE_BYTES = 1 << 20


def _normal(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines())


def _long_lines(text: str) -> set[int]:
    return {hash(s) for line in text.splitlines() if len(s := line.strip()) >= MIN_LINE}


def _documents(ids: np.ndarray, eod: int, tokenizer) -> list[str]:
    cuts = np.flatnonzero(ids == eod)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, cuts)]


def package_files(name: str) -> tuple[str, list[tuple[str, Path]]]:
    """(version, [(relative path, file)]) of a distribution's .py files."""
    dist = importlib.metadata.distribution(name)
    files = [(f.as_posix(), Path(dist.locate_file(f))) for f in dist.files or () if f.suffix == ".py"]
    return dist.version, sorted(files, key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())


def _parses(text: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


_worker_tokenizer = None


def _start_worker(rank_file: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = KimiK3Tokenizer(vocab_file=rank_file)


def _encode(text: str) -> list[int]:
    return _worker_tokenizer.encode_ordinary(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--packages", default=DEFAULT_PACKAGES)
    parser.add_argument("--max-mb", type=float, default=24.0, help="at most this many MB of source per package")
    parser.add_argument("--workers", type=int, default=multiprocessing.cpu_count())
    args = parser.parse_args(argv)
    started = time.time()
    data = Path(args.data)
    rank_file = str(data / "tiktoken.model")
    tokenizer = KimiK3Tokenizer(vocab_file=rank_file)
    eod = tokenizer.special_ids["<|end_of_msg|>"]
    held_out = set()
    for split in ("val_code", "val_prose"):
        for text in _documents(np.load(data / f"{split}.npy"), eod, tokenizer):
            held_out |= _long_lines(text)
    seen = {hashlib.sha256(_normal(t).encode()).digest()
            for t in _documents(np.load(data / "train_code.npy"), eod, tokenizer)}
    print(f"{len(held_out)} held-out lines, {len(seen)} stdlib train files ({time.time() - started:.0f}s)", flush=True)

    texts, report = [], {}
    for name in filter(None, args.packages.split(",")):
        if name not in LICENCES:
            raise SystemExit(f"--packages: {name!r} has no licence entry in demo_build/package_corpus.py LICENCES")
        try:
            version, files = package_files(name)
        except importlib.metadata.PackageNotFoundError:
            report[name] = dict(missing=True)
            print(f"{name}: not installed, skipped", flush=True)
            continue
        row = dict(version=version, licence=LICENCES[name], files=0, bytes=0, dropped_overlap=0, dropped_copy=0,
                   dropped_unreadable=0)
        budget = int(args.max_mb * 1e6)
        for rel, path in files:
            try:
                raw = path.read_bytes()
                text = raw.decode("utf-8") if 0 < len(raw) <= MAX_FILE_BYTES else None
            except (OSError, UnicodeDecodeError):
                text = None
            if not text or not text.strip() or not _parses(text):
                row["dropped_unreadable"] += 1
                continue
            lines = _long_lines(text)
            if lines and len(lines & held_out) >= OVERLAP * len(lines):
                row["dropped_overlap"] += 1
                continue
            digest = hashlib.sha256(_normal(text).encode()).digest()
            if digest in seen:
                row["dropped_copy"] += 1
                continue
            if row["bytes"] + len(raw) > budget:
                break
            seen.add(digest)
            texts.append(text)
            row["files"] += 1
            row["bytes"] += len(raw)
        report[name] = row
        print(f"{name} {version}: {row['files']} files, {row['bytes'] / 1e6:.1f} MB", flush=True)

    with multiprocessing.Pool(args.workers, _start_worker, (rank_file,)) as pool:
        encoded = pool.map(_encode, texts, chunksize=16)
    ids = np.fromiter((i for doc in encoded for i in (*doc, eod)), dtype=np.int64)
    if ids.max() >= 1 << 16:
        raise SystemExit("token id does not fit uint16")
    tmp = data / "train_code_packages.tmp.npy"
    np.save(tmp, ids.astype(np.uint16))
    tmp.rename(data / "train_code_packages.npy")
    total = dict(files=len(texts), bytes=sum(r.get("bytes", 0) for r in report.values()), tokens=int(ids.size),
                 seconds=round(time.time() - started, 1))
    (data / "packages.json").write_text(json.dumps(dict(rule=__doc__.split("\n\n")[2], packages=report,
                                                        total=total), indent=1) + "\n")
    print(f"train_code_packages: {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
