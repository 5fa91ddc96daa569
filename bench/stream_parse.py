"""Streaming parse cost vs one parse: a 1 MB tools section fed to StreamParser in 64-byte chunks.

    python -m bench.stream_parse          # CPU, a few seconds; writes bench/results/stream_parse.txt

The section holds calls a coding agent makes (file writes with code full of `<`, `[` and quotes,
shell commands, numbers, arrays). Both timings run in this process, best of five; the ratio is
stream time / parse time, so a parser that rescans what it buffered shows up as a ratio that
grows with the section (the previous, quadratic parser: 10 s, ratio 656, on this section).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from kimi_k3_parsing import StreamParser, parse

SECTION_BYTES = 1 << 20
CHUNK = 64
REPEATS = 5
OUT = Path(__file__).resolve().parent / "results" / "stream_parse.txt"


def argument(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def tools_section(size: int) -> str:
    """A generated reply whose tools section is about `size` bytes of varied calls."""
    rng = random.Random(0)
    code_line = "    if a[i] < b[j] and x != \"<|\": out.append(f'{a[i]!r} -> [{j}]')  # {n}\n"
    calls, total, index = [], 0, 0
    while total < size:
        index += 1
        kind = index % 3
        if kind == 0:
            body = "".join(code_line.replace("{n}", str(rng.randrange(10**6))) for _ in range(rng.randint(20, 200)))
            args = argument("path", "string", f"src/mod_{index}.py") + argument("content", "string", body)
            name = "write_file"
        elif kind == 1:
            args = argument("cmd", "string", f"pytest -q tests/test_{index}.py -k 'a and not b' > log{index}.txt")
            args += argument("timeout", "number", str(rng.randint(1, 600)))
            name = "run_shell"
        else:
            values = ", ".join(str(rng.randrange(1000)) for _ in range(rng.randint(5, 50)))
            args = argument("lines", "array", f"[{values}]") + argument("dry_run", "boolean", "false")
            name = "edit_lines"
        call = f'<|open|>call tool="{name}" index="{index}"<|sep|>{args}<|close|>call<|sep|>'
        calls.append(call)
        total += len(call.encode())
    head = "Writing the files.<|close|>think<|sep|><|open|>response<|sep|>Done.<|close|>response<|sep|>"
    return head + "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"


def stream(text: str) -> dict:
    parser = StreamParser()
    for start in range(0, len(text), CHUNK):
        parser.feed(text[start : start + CHUNK])
    parser.finish()
    return parser.result()


def best(fn, text: str) -> tuple[float, dict]:
    times, result = [], None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = fn(text)
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> int:
    text = tools_section(SECTION_BYTES)
    parse_s, whole = best(parse, text)
    stream_s, streamed = best(stream, text)
    if streamed != whole or whole["malformed"] or not whole["tool_calls"]:
        print("stream_parse: the streamed result differs from parse()", file=sys.stderr)
        return 1
    report = (
        f"tools section: {len(text.encode()):,} bytes, {len(whole['tool_calls'])} calls; "
        f"python {sys.version.split()[0]}\n"
        f"parse() once:                 {parse_s * 1000:8.1f} ms\n"
        f"StreamParser, {CHUNK}-byte chunks: {stream_s * 1000:8.1f} ms "
        f"({len(text) // CHUNK + 1:,} feeds)\n"
        f"ratio stream / parse:         {stream_s / parse_s:8.2f}\n"
    )
    print(report, end="")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
