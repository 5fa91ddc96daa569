"""Where the demo's REAP calibration windows start, and how many there are: what the REAP-40 prune keeps of
top-level Python (issue 21; CPU, ~20 minutes).

    python -m retention.calibration_arms [--json retention/results/calibration_arms.json]

`retention.retention` calibrates REAP on windows of 512 train-code tokens. Cut anywhere in a file, such a window
almost always starts inside a class or a function; a completion prompt is the top of a file. Each arm observes the
parent on one calibration load, prunes to the 64.3 % cut by REAP, and measures the prune as the README's user meets
it: the five README prompts typed without their newline, completed as `python -m reap_tools generate` does
(`reap_tools.generate.complete`: 128 new tokens, token healing, stopping where the block ends; the demo's
generation_config, greedy with its repetition penalty), in float32 and in bfloat16 (transformers 5.x loads the
checkpoint's bfloat16, 4.57 float32), judged by `demo_build.eval_demo`'s rule; and beside them `retention.retention`'s
held-out code perplexity (64 windows) and valid-Python rate (50 held-out headers, 64 new tokens). The parent is
measured the same way first. The arms were fixed before this script ran; they were chosen after one exploratory
run of the same measurements, so they are not a clean held-out comparison (the README says so).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from demo_build.eval_demo import function_headers, generate_completions, load, windows
from reap_tools.observe import observe
from reap_tools.plan import plan_selection
from reap_tools.prune import prune_checkpoint
from retention.retention import SEQ_LEN, calibration_batches, calibration_windows, evaluate

ROOT = Path(__file__).resolve().parents[1]

ARMS = (("anywhere", 256), ("anywhere", 1024), ("file-starts", 256), ("file-starts", 1024))
KEPT = 40  # round(112 * 320 / 896)


def readme_prompts(model_dir: Path, dtype) -> list[bool]:
    """Per README prompt typed as is: does `generate`'s completion parse."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(model_dir), trust_remote_code=True, dtype=dtype)
    return [parses for _, parses in generate_completions(pipe)]


def measure(model_dir: Path, tokenizer, eval_windows, headers) -> dict:
    model, _ = load(model_dir)
    row = evaluate(model, tokenizer, {"code": eval_windows}, headers, [], batch_size=8, gen_batch_size=50)
    del model
    result = dict(code_ppl=float(np.exp(np.mean(row["code_nll"]))), valid_python=int(sum(row["validity"])),
                  headers=len(headers))
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        result[f"readme_prompts_{name}"] = readme_prompts(model_dir, dtype)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--json", default=str(ROOT / "retention" / "results" / "calibration_arms.json"))
    args = parser.parse_args(argv)
    data, parent = Path(args.data), Path(args.parent)
    model, tokenizer = load(parent)
    train_code, val_code = np.load(data / "train_code.npy"), np.load(data / "val_code.npy")
    eval_windows = windows(val_code, 64, SEQ_LEN)
    headers = function_headers(tokenizer, val_code, 50)
    results = {"parent": measure(parent, tokenizer, eval_windows, headers)}
    print("parent", results["parent"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for at, count in ARMS:
            t0 = time.time()
            calib = calibration_windows(train_code, count, at, model.config.eos_token_id)
            report = observe(model, calibration_batches(calib, 8), name_or_path=str(parent), progress=False,
                             calibration={"source": "train_code.npy", "windows": count, "at": at, "seq_len": SEQ_LEN})
            pruned = Path(tmp) / f"{at}-{count}"
            prune_checkpoint(str(parent), plan_selection(report, num_experts=KEPT, criterion="reap", seed=0), pruned,
                             progress=False)
            name = f"reap{KEPT} calibrated on {count} windows at {at}"
            results[name] = dict(measure(pruned, tokenizer, eval_windows, headers), seconds=round(time.time() - t0))
            print(name, results[name], flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
