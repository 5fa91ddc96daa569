"""`python -m reap_tools VERB ARGS...`: run one tool.

Each verb is a module `reap_tools.<module>` with a `main(argv) -> int | None`; the module is
imported only when its verb is run, so one tool's heavy imports never slow down another.
Add a verb by adding a line to VERBS.
"""

from __future__ import annotations

import importlib
import sys

# verb -> (module under reap_tools, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "bpe": ("bpe", "train a byte-level BPE vocabulary and write a tiktoken.model"),
    "quantize": ("quantize", "quantize the routed experts of a bf16/fp32 checkpoint to MXFP4"),
    "observe": ("observe", "measure per-expert REAP saliency on calibration data (report for plan)"),
    "plan": ("plan", "choose the experts to keep per layer from a saliency report"),
    "prune": ("prune", "write a checkpoint with only the selected experts (byte-exact copy)"),
    "verify": ("verify", "check a checkpoint's shards, index and config (and hashes vs its source)"),
    "upload": ("upload", "upload a verified checkpoint folder to the Hugging Face Hub"),
    "generate": ("generate", "complete a prompt or chat with a checkpoint (default: the shipped demo)"),
    "tiny": ("tiny", "write a tiny random checkpoint in the release layout"),
}


def usage() -> str:
    """The help text: one line per verb."""
    width = max(map(len, VERBS))
    lines = ["usage: python -m reap_tools VERB [ARGS...]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {help_text}" for verb, (_, help_text) in sorted(VERBS.items())]
    lines += ["", "Run `python -m reap_tools VERB --help` for a verb's own options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch argv[0] to its module's main(argv[1:]); exit code 2 for an unknown verb."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"unknown verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"reap_tools.{VERBS[verb][0]}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
