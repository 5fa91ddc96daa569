"""Which code lowers the demo's held-out code perplexity when training goes on: the standard library's or the
packages' (issue 21; CPU, ~16 minutes an arm at the defaults).

    python -m demo_build.domain_anneal --source data/train_code.npy [--steps 200] [--lr 1e-4] [--json FILE]
    python -m demo_build.domain_anneal --source DATA_WITH_PACKAGES/train_code_packages.npy ...

The shipped `demo/parent` goes on training from its own weights on windows of 512 tokens drawn from `--source`
only (8 a step, AdamW, the learning rate decayed linearly to 0, clipped at norm 1, `--kda wy`); its routed experts
stay frozen (they are packed MXFP4 in the checkpoint), everything else trains. Before and after, the perplexity on
the training script's 32 held-out code windows (`train_demo.fixed_windows` of `data/val_code.npy`: standard-library
files no training draw has seen). Two arms from the same start and seed, one per source, say whether the held-out
code's domain is worth weighting up in the demo's training mixture (`train_demo.py train --stdlib-share`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from demo_build import train_demo
from demo_build.eval_demo import load

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="uint16 token ids to train on (.npy)")
    parser.add_argument("--model", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, _ = load(Path(args.model))
    model.train()
    val = torch.from_numpy(np.load(Path(args.data) / "val_code.npy").astype(np.int64))
    windows = train_demo.fixed_windows(val, 32)
    source = torch.from_numpy(np.load(args.source).astype(np.int64))
    params = [p for n, p in model.named_parameters()
              if p.dtype.is_floating_point and not n.endswith("e_score_correction_bias")]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with train_demo.wy_kda(model):
        rows.append(dict(step=0, val_code_ppl=math.exp(train_demo.eval_loss(model, windows, 8))))
        print(json.dumps(rows[-1]), flush=True)
        start = time.time()
        for step in range(1, args.steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = args.lr * (1 - (step - 1) / args.steps)
            starts = torch.randint(0, source.numel() - train_demo.SEQ_LEN, (args.batch,), generator=gen)
            ids = source[starts[:, None] + torch.arange(train_demo.SEQ_LEN)]
            model(ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % args.eval_every == 0 or step == args.steps:
                rows.append(dict(step=step, val_code_ppl=math.exp(train_demo.eval_loss(model, windows, 8)),
                                 seconds=round(time.time() - start, 1)))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        result = dict(source=str(args.source), source_tokens=source.numel(), steps=args.steps, batch=args.batch,
                      lr=args.lr, tokens=args.steps * args.batch * train_demo.SEQ_LEN, rows=rows)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
