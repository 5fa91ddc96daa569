"""Choose the demo's decoding settings (its generation_config.json) on a development set of prompts (issue 21).

    python -m demo_build.tune_decoding [--model demo/parent] [--penalties 1.0,1.1,1.2,1.3,1.5] [--max-new-tokens 64]
        [--json FILE]

The prompts are held-out function headers that no score of this repository uses: `retention.retention` judges
the first 50 distinct top-level `def ...:` headers of the held-out code, this takes the 50 after those. Each is
completed greedily (64 new tokens unless `--max-new-tokens` says otherwise) three ways, as typed (the header alone), as typed with token healing (what
`reap_tools generate` does) and with the newline an editor adds after it, for each repetition penalty; a completion counts where `demo_build.eval_demo`'s cut rule leaves Python that
parses. The README's five prompts are not looked at here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from demo_build.eval_demo import HEADER_TOKENS, complete, completion_parses, function_headers, load
from demo_build.exec_eval import wilson_interval

ROOT = Path(__file__).resolve().parents[1]
SKIP, COUNT = 50, 50  # the retention study's headers, then this development set


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--penalties", default="1.0,1.1,1.2,1.3,1.5")
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--max-new-tokens", type=int, default=HEADER_TOKENS,
                        help=f"tokens generated per header (default {HEADER_TOKENS}, what the retention study gives)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load(Path(args.model))
    headers = function_headers(tokenizer, np.load(Path(args.data) / "val_code.npy"), SKIP + COUNT)[SKIP:]
    if len(headers) < COUNT:
        raise SystemExit(f"only {len(headers)} development headers after the first {SKIP}")
    rows = []
    for penalty in map(float, args.penalties.split(",")):
        row = dict(repetition_penalty=penalty, max_new_tokens=args.max_new_tokens)
        forms = (("as_typed", headers, False), ("as_typed_healed", headers, True),
                 ("with_newline", [h + "\n" for h in headers], False))
        for form, prompts, heal in forms:
            texts = complete(model, tokenizer, prompts, args.max_new_tokens, args.batch_size, heal=heal,
                             repetition_penalty=penalty)
            ok = sum(completion_parses(p, t, e) for p, (t, e) in zip(prompts, texts))
            row[form] = dict(parses=ok, of=len(prompts), wilson_95=[round(x, 3) for x in wilson_interval(ok, len(prompts))])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model, headers=headers, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
