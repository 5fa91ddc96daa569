"""Streaming parse cost vs one parse, in every channel: StreamParser against `parse` of the whole output.

    python -m bench.stream_parse          # CPU, about two minutes; writes bench/results/stream_parse.txt

For each channel (a long reasoning, a long answer, a long tools section of the calls a coding agent
makes: file writes with code full of `<`, `[` and quotes, shell commands, numbers, arrays) and each size
(1 and 4 MB), the output is parsed once and streamed: as text in 64-character chunks, and as the
generated token ids (the demo's vocabulary) in 1-, 7- and 4096-id chunks. Every timing is the best of a
few runs in this process; a row's ratio is its stream time / one `parse()` of the same input. A parser
that rescans what it buffered shows as a ratio that grows with the size: the `x4 size` column is the
4 MB time / the 1 MB time, 4.0 for a linear parser (the previous one: 11 for 64-character reasoning).
"""

from __future__ import annotations

import random
import re
import sys
import time
from pathlib import Path

from kimi_k3_parsing import StreamParser, parse
from tokenization_kimi_k3 import KimiK3Tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / "demo" / "parent" / "tiktoken.model"
OUT = ROOT / "bench" / "results" / "stream_parse.txt"
SIZES = (1 << 20, 1 << 22)
TEXT_CHUNK = 64
ID_CHUNKS = (1, 7, 4096)
REPEATS = 5
END = "<|close|>message<|sep|><|end_of_msg|>"
CODE_LINE = "    if a[i] < b[j] and x != \"<|\": out.append(f'{a[i]!r} -> [{j}]')  # naïve 你好 {n}\n"
_CONTROL_RE = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)")


def argument(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def prose(size: int, rng: random.Random) -> str:
    """About `size` bytes of code-heavy text, as a coding model reasons and answers."""
    lines, total = [], 0
    while total < size:
        line = CODE_LINE.replace("{n}", str(rng.randrange(10**6)))
        lines.append(line)
        total += len(line.encode())
    return "".join(lines)


def tools_section(size: int, rng: random.Random) -> str:
    """About `size` bytes of varied calls."""
    calls, total, index = [], 0, 0
    while total < size:
        index += 1
        kind = index % 3
        if kind == 0:
            body = prose(rng.randint(1500, 15000), rng)
            args = argument("path", "string", f"src/mod_{index}.py") + argument("content", "string", body)
            name = "write_file"
        elif kind == 1:
            args = argument("cmd", "string", f"pytest -q tests/test_{index}.py -k 'a and not b' > log{index}.txt")
            args += argument("timeout", "integer", str(rng.randint(1, 600)))
            name = "run_shell"
        else:
            values = ", ".join(str(rng.randrange(1000)) for _ in range(rng.randint(5, 50)))
            args = argument("lines", "array", f"[{values}]") + argument("dry_run", "boolean", "false")
            name = "edit_lines"
        call = f'<|open|>call tool="{name}" index="{index}"<|sep|>{args}<|close|>call<|sep|>'
        calls.append(call)
        total += len(call.encode())
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


def output(channel: str, size: int) -> str:
    """A generated reply (after the thinking generation prompt) with about `size` bytes in `channel`."""
    rng = random.Random(size)
    if channel == "reasoning":
        return prose(size, rng) + "<|close|>think<|sep|><|open|>response<|sep|>Done.<|close|>response<|sep|>" + END
    if channel == "content":
        return "Plan.<|close|>think<|sep|><|open|>response<|sep|>" + prose(size, rng) + "<|close|>response<|sep|>" + END
    head = "Writing the files.<|close|>think<|sep|><|open|>response<|sep|>Done.<|close|>response<|sep|>"
    return head + tools_section(size, rng) + END


def generated_ids(tok: KimiK3Tokenizer, text: str) -> list[int]:
    """The ids the model generates for `text`: its markers as control ids, the rest as BPE."""
    ids: list[int] = []
    for i, piece in enumerate(_CONTROL_RE.split(text)):
        ids += [tok.special_ids[piece]] if i % 2 else tok.encode_ordinary(piece)
    return ids


def stream(data, chunk: int, tokenizer=None) -> dict:
    parser = StreamParser(tokenizer=tokenizer)
    for start in range(0, len(data), chunk):
        parser.feed(data[start : start + chunk])
    parser.finish()
    return parser.result()


def best(fn) -> tuple[float, dict]:
    times, result = [], None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> int:
    tok = KimiK3Tokenizer(str(VOCAB))
    rows, seconds = [], {}
    for channel in ("reasoning", "content", "tools"):
        for size in SIZES:
            text = output(channel, size)
            ids = generated_ids(tok, text)
            runs = [("text", f"{TEXT_CHUNK} chars", text, TEXT_CHUNK, None)]
            runs += [("ids", f"{chunk} ids", ids, chunk, tok) for chunk in ID_CHUNKS]
            parsed = {}
            for kind, data, tokenizer in (("text", text, None), ("ids", ids, tok)):
                parsed[kind] = best(lambda: parse(data, thinking=True, tokenizer=tokenizer))
            for kind, label, data, chunk, tokenizer in runs:
                parse_s, whole = parsed[kind]
                stream_s, streamed = best(lambda: stream(data, chunk, tokenizer))
                if streamed != whole or whole["malformed"] or not whole["finished"]:
                    print(f"stream_parse: {channel} {label}: the streamed result differs from parse()", file=sys.stderr)
                    return 1
                seconds[channel, label, size] = stream_s
                rows.append((channel, size, label, len(data), parse_s, stream_s))
    lines = [
        f"StreamParser vs one parse(), best of {REPEATS}; vocabulary {VOCAB.relative_to(ROOT)} "
        f"({tok.num_ranks} ranks); python {sys.version.split()[0]}",
        f"{'channel':<10} {'size':>5} {'chunks':>10} {'items':>10} {'parse ms':>9} {'stream ms':>10} "
        f"{'ratio':>6} {'x4 size':>8}",
    ]
    for channel, size, label, items, parse_s, stream_s in rows:
        growth = ""
        if size == SIZES[-1]:
            growth = f"{stream_s / seconds[channel, label, SIZES[0]]:8.2f}"
        lines.append(
            f"{channel:<10} {size >> 20:>3} MB {label:>10} {items:>10,} {parse_s * 1000:9.1f} {stream_s * 1000:10.1f} "
            f"{stream_s / parse_s:6.2f} {growth:>8}"
        )
    report = "\n".join(lines) + "\n"
    print(report, end="")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
