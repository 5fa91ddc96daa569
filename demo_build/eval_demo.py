"""Evaluate the trained Kimi K3 demo (issue 5) on the CPU: held-out perplexity and greedy code completions.

    python -m demo_build.eval_demo [--model demo/parent] [--data data] [--windows 64] [--dtype float32] [--json FILE]

Perplexity: the held-out splits of `demo_build.prepare_corpus` (Python source and prose, split by file) are cut into
non-overlapping windows of 512 tokens (`--windows N` spreads N of them evenly over a split; 0 = all); in each
window tokens 2..512 are predicted from the ones before. Printed for each split, over exactly those positions:

* the model: exp(mean NLL);
* uniform: the vocabulary size (every id equally likely);
* unigram: token frequencies of the same source's TRAIN split, add-one smoothed over the whole vocabulary;
* unigram oracle: the frequencies of the evaluated held-out tokens themselves (the best any unigram model can do);
* bits per byte of the model (NLL / ln 2 over the UTF-8 bytes of the predicted tokens), tokenizer-independent.

Completions: greedy decoding of `PROMPTS` (and of `AS_TYPED`: the same without their final newline, as typed and with
token healing, which `reap_tools generate` applies: `reap_tools.generate.heal_prompt`),
`MAX_NEW_TOKENS` new tokens each, judged with `completion_parses`: the text (prompt + completion) is cut at the end
of the prompt's top-level statement, i.e. before the first line after the prompt that starts at column 0 with a
non-blank character; when no such line was generated and the generation did not end the document (EOS), the last,
possibly unfinished, line is dropped instead (unless it is the prompt's own line, which is then judged as it
stands). The cut text must pass `ast.parse`. tests/test_demo.py uses the same prompts and rule.

The completion machinery here (`load`, `complete`, `completion_parses`, `function_headers`) also serves
`demo_build.exec_eval`, `demo_build.tune_decoding` and the retention study.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from reap_tools.generate import StartsWith, cut_completion, heal_prompt  # cut_completion: the rule `generate` stops by

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "demo" / "parent"
SEQ_LEN = 512
MAX_NEW_TOKENS = 64
HEADER_TOKENS = 64  # new tokens for each held-out function header (the retention study's valid-Python rate)
HEADER = re.compile(r"^def [A-Za-z_]\w*\(.*\):$")
# Chosen before looking at any output and not tuned; each ends with the newline of its header line, as a user's
# editor buffer does. That newline matters to a BPE model: the Kimi pre-tokeniser glues punctuation to the line
# break after it (`):\n` and `:\n` are single tokens), so in training `):` almost never ends a line, and a prompt cut
# right after `):` asks for a continuation of that same line (eval_demo.py also prints those, as AS_TYPED).
PROMPTS = (
    "def fibonacci(n):\n",
    "def is_prime(n):\n",
    "class Stack:\n",
    "def read_file(path):\n",
    "import os\n\n\ndef list_files(directory):\n",
)
AS_TYPED = tuple(p.rstrip("\n") for p in PROMPTS)


# ---------------------------------------------------------------------------------------------------------------
# Completion validity
# ---------------------------------------------------------------------------------------------------------------


def completion_parses(prompt: str, completion: str, ended: bool = False) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(cut_completion(prompt, completion, ended))
    except (SyntaxError, ValueError):
        return False
    return True


def load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    return model, tokenizer


@torch.no_grad()
def complete(model, tokenizer, prompts, max_new_tokens: int, batch_size: int, heal=False, **generate_kwargs):
    """[(completion text, ended with EOS)] of greedy decoding, the prompts left-padded into batches, on one CPU
    thread (decode steps are tiny ops, and two threads on a busy 2-core machine ran exec_eval's 40 problems >20x
    slower than one). With `heal`, each prompt's last token is regenerated (token healing,
    `reap_tools.generate.heal_prompt`, as `reap_tools generate` does); the text returned still follows the prompt."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _complete(model, tokenizer, prompts, max_new_tokens, batch_size, heal, generate_kwargs)
    finally:
        torch.set_num_threads(threads)


def _complete(model, tokenizer, prompts, max_new_tokens, batch_size, heal, generate_kwargs):
    from transformers import LogitsProcessorList

    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        pairs = [heal_prompt(tokenizer, p) if heal else (p, "") for p in prompts[start : start + batch_size]]
        batch = [tokenizer.encode(head, add_special_tokens=False) for head, _ in pairs]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        kwargs = dict(generate_kwargs)
        if any(tail for _, tail in pairs):
            kwargs["logits_processor"] = LogitsProcessorList([StartsWith(tokenizer, [tail for _, tail in pairs])])
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=eos, pad_token_id=pad, **kwargs)
        for (_, tail), row in zip(pairs, generated[:, width:].tolist()):
            ended = eos in row
            row = row[: row.index(eos)] if ended else row
            text = tokenizer.decode(row, skip_special_tokens=True)
            out.append((text[len(tail):] if text.startswith(tail) else text, ended))
    return out


def function_headers(tokenizer, ids: np.ndarray, count: int) -> list[str]:
    """The first `count` distinct top-level one-line `def ...:` headers of the held-out code, in corpus order."""
    eos = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    text = tokenizer.decode([int(i) for i in ids if i != eos])
    headers = []
    for line in text.split("\n"):
        if HEADER.match(line) and line not in headers:
            headers.append(line)
            if len(headers) == count:
                break
    return headers


def greedy_completions(model, tokenizer, prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS, heal=False):
    """[(prompt, completion text, ended with EOS, parses)] of greedy decoding (the checkpoint's generation_config,
    e.g. its repetition penalty, applies), one prompt at a time on one CPU thread (`complete`); with
    `heal`, token healing as `reap_tools generate` does it."""
    texts = complete(model, tokenizer, list(prompts), max_new_tokens, batch_size=1, heal=heal)
    return [(p, text, ended, completion_parses(p, text, ended)) for p, (text, ended) in zip(prompts, texts)]


def generate_completions(pipe, prompts=AS_TYPED, max_new_tokens=128):
    """[(full text, parses)] of each prompt as `python -m reap_tools generate` completes it
    (`reap_tools.generate.complete`: token healing, stopping where the block ends, the checkpoint's
    generation_config), on one CPU thread (tiny decode ops: one thread is fastest)."""
    from reap_tools.generate import complete as generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        texts = [generate(pipe, p, max_new_tokens) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    return [(text, completion_parses(p, text[len(p):])) for p, text in zip(prompts, texts)]


# ---------------------------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------------------------


def windows(ids: np.ndarray, count: int, seq_len=SEQ_LEN) -> np.ndarray:
    """Non-overlapping windows: all of them (count 0), or `count` spread evenly over the split."""
    total = ids.size // seq_len
    if count <= 0 or count >= total:
        starts = np.arange(total) * seq_len
    else:
        starts = np.arange(count) * ((ids.size - seq_len) // max(1, count - 1))
    return np.stack([ids[s : s + seq_len] for s in starts]).astype(np.int64)


@torch.no_grad()
def model_nll(model, batches: np.ndarray, batch_size: int) -> np.ndarray:
    """NLL (nats) of tokens 2..T of each window: [N, T-1]."""
    out = []
    for start in range(0, len(batches), batch_size):
        x = torch.from_numpy(batches[start : start + batch_size])
        logits = model(x).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        out.append(-logp.gather(-1, x[:, 1:, None])[..., 0].numpy())
    return np.concatenate(out)


def token_bytes(rank_file: Path, vocab_size: int) -> np.ndarray:
    """UTF-8 byte length of every id (specials count 0)."""
    from tokenization_kimi_k3 import load_rank_file

    lengths = np.zeros(vocab_size, dtype=np.int64)
    for token, rank in load_rank_file(rank_file).items():
        lengths[rank] = len(token)
    return lengths


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def evaluate_perplexity(model, model_dir: Path, data: Path, count: int, batch_size: int) -> dict:
    if _sha(model_dir / "tiktoken.model") != _sha(data / "tiktoken.model"):
        raise SystemExit(f"{data}/tiktoken.model is not the model's vocabulary: re-run demo_build.prepare_corpus")
    vocab = model.config.text_config.vocab_size
    lengths = token_bytes(data / "tiktoken.model", vocab)
    report = {}
    for source in ("code", "prose"):
        train = np.load(data / f"train_{source}.npy")
        counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
        unigram_logp = np.log(counts / counts.sum())
        w = windows(np.load(data / f"val_{source}.npy"), count)
        targets = w[:, 1:]
        t0 = time.time()
        nll = model_nll(model, w, batch_size)
        held = np.bincount(targets.ravel(), minlength=vocab).astype(np.float64)
        oracle = held[held > 0] / held.sum()
        report[source] = dict(
            windows=len(w),
            tokens=int(targets.size),
            model_ppl=math.exp(nll.mean()),
            uniform_ppl=float(vocab),
            unigram_ppl=math.exp(-unigram_logp[targets].mean()),
            unigram_oracle_ppl=math.exp(-(oracle * np.log(oracle)).sum()),
            model_bits_per_byte=float(nll.sum() / math.log(2) / lengths[targets].sum()),
            seconds=round(time.time() - t0, 1),
        )
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--data", default=str(ROOT / "data"))
    parser.add_argument("--windows", type=int, default=64, help="windows of 512 per split (0 = all)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-completions", action="store_true")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    model, tokenizer = load(model_dir, getattr(torch, args.dtype))
    result = {"model": str(model_dir), "dtype": args.dtype}
    result["perplexity"] = evaluate_perplexity(model, model_dir, Path(args.data), args.windows, args.batch_size)
    print(f"held-out perplexity of {model_dir} ({args.dtype}; vocabulary {model.config.text_config.vocab_size})")
    print(f"{'split':<8}{'windows':>8}{'tokens':>9}{'model':>10}{'unigram':>10}{'oracle':>10}{'uniform':>10}"
          f"{'model bpb':>11}")
    for source, r in result["perplexity"].items():
        print(f"{source:<8}{r['windows']:>8}{r['tokens']:>9}{r['model_ppl']:>10.2f}{r['unigram_ppl']:>10.2f}"
              f"{r['unigram_oracle_ppl']:>10.2f}{r['uniform_ppl']:>10.0f}{r['model_bits_per_byte']:>11.3f}")
    print("(perplexities over the held-out tokens; unigram = train-split frequencies, add-one; oracle = unigram "
          "fitted on these held-out tokens; uniform = vocabulary size)")
    if not args.no_completions:
        forms = (("completions", PROMPTS, False, "prompts ending with a newline"),
                 ("completions_as_typed", AS_TYPED, False, "the same prompts without it"),
                 ("completions_as_typed_healed", AS_TYPED, True, "without it, token healing (as generate runs)"))
        for key, prompts, heal, what in forms:
            completions = greedy_completions(model, tokenizer, prompts, heal=heal)
            result[key] = [dict(prompt=p, completion=c, ended=e, parses=ok) for p, c, e, ok in completions]
            print(f"\ngreedy completions, {what} ({MAX_NEW_TOKENS} new tokens; judged up to the first column-0 line "
                  f"after the prompt, else the last complete line)")
            for p, c, e, ok in completions:
                print(f"--- {'PARSES' if ok else 'does not parse'}: {p!r}")
                print(p + c)
            print(f"=> {sum(r[3] for r in completions)} of {len(completions)} parse")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
