"""Train a small byte-level BPE vocabulary and write it as a tiktoken rank file (`tiktoken.model`).

Ranks 0..255 are the single bytes (rank = byte value), so every text encodes; learned merges
follow in the order they were learned. Text is first split with the Kimi pre-tokenisation
pattern (`tokenization_kimi_k3.PAT_STR`, read by the `regex` module in V1 mode, which like
tiktoken understands its `&&` class intersections), and merges never cross a piece, as tiktoken
applies them. Pure Python: meant for test and demo vocabularies of a few thousand ranks trained
on a few MB of text.

    python -m reap_tools bpe CORPUS... --vocab-size N --out FILE
"""

from __future__ import annotations

import heapq
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from tokenization_kimi_k3 import PAT_STR, write_rank_file

from .cli import ArgumentParser, fail, int_at_least

PIECE_RE = regex.compile(PAT_STR, flags=regex.V1)
DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def split_pieces(text: str) -> list[str]:
    """The pre-tokenisation pieces of `text` (BPE merges stay inside one piece)."""
    return PIECE_RE.findall(text)


def train(texts: Iterable[str], vocab_size: int) -> dict[bytes, int]:
    """Learn merges until there are `vocab_size` ranks (or nothing is left to merge).

    Each step merges the most frequent adjacent pair (ties: the smallest pair of byte strings,
    so training is deterministic). A merge whose bytes are already a token adds no rank.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    counts = Counter(piece.encode("utf-8") for text in texts for piece in split_pieces(text))
    words = [[bytes([b]) for b in word] for word in counts]
    freqs = list(counts.values())
    pair_counts: dict[tuple[bytes, bytes], int] = defaultdict(int)
    where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-count, a, b) for (a, b), count in pair_counts.items()]
    heapq.heapify(heap)
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < vocab_size and heap:
        negative, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b)) != -negative:
            continue  # stale heap entry
        merged = a + b
        ranks.setdefault(merged, len(ranks))
        changed = set()
        for i in where.pop((a, b)):
            old, freq = words[i], freqs[i]
            new, j = [], 0
            while j < len(old):
                if j + 1 < len(old) and old[j] == a and old[j + 1] == b:
                    new.append(merged)
                    j += 2
                else:
                    new.append(old[j])
                    j += 1
            for pair in zip(old, old[1:]):
                pair_counts[pair] -= freq
                changed.add(pair)
            for pair in zip(new, new[1:]):
                pair_counts[pair] += freq
                where[pair].add(i)
                changed.add(pair)
            words[i] = new
        for pair in changed:
            count = pair_counts[pair]
            if count > 0:
                heapq.heappush(heap, (-count, *pair))
            else:
                del pair_counts[pair]
                where.pop(pair, None)
    return ranks


def read_corpus(paths: Iterable[str | Path], suffixes: Iterable[str], max_bytes: int) -> list[str]:
    """UTF-8 texts from files and directories (files with one of `suffixes`), in order.

    Files that are not UTF-8 text are skipped; directories are read in sorted order; reading
    stops once `max_bytes` have been read (whole files only).
    """
    suffixes = tuple(suffixes)
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path not found: {path}")
    texts, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        data = file.read_bytes()
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        total += len(data)
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m reap_tools bpe", description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", nargs="+", help="text files, or directories to read files from")
    parser.add_argument("--vocab-size", type=int_at_least(256), required=True,
                        help="ranks to write, 256 single bytes included")
    parser.add_argument("--out", required=True, help="the tiktoken.model file to write")
    parser.add_argument("--max-bytes", type=int_at_least(1), default=32 << 20,
                        help="read at most this much text (default 32 MiB)")
    parser.add_argument(
        "--suffix", action="append", help=f"file suffixes read from directories (default {' '.join(DEFAULT_SUFFIXES)})"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        texts = read_corpus(args.corpus, args.suffix or DEFAULT_SUFFIXES, args.max_bytes)
        if not texts:
            parser.error("the corpus has no UTF-8 text")
        ranks = train(texts, args.vocab_size)
        write_rank_file(ranks, tmp)
        os.replace(tmp, out)
    except OSError as e:
        return fail("bpe", e)
    finally:
        tmp.unlink(missing_ok=True)
    size = sum(len(text.encode("utf-8")) for text in texts)
    print(f"wrote {len(ranks)} ranks to {args.out} from {len(texts)} texts ({size} bytes)")
    if len(ranks) < args.vocab_size:
        print(f"the corpus ran out of pairs to merge before {args.vocab_size} ranks", file=sys.stderr)
    return 0
