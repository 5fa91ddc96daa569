"""Generate with a Kimi K3 checkpoint through `pipeline("text-generation", trust_remote_code=True)`.

Without `--model` it runs the small trained demo that ships in `demo/`. With `--chat` the prompt becomes a user
message rendered with the K3 chat template, and the reply is split into reasoning and content. Without it, a blank
prompt is refused: there is nothing to complete.
"""

import os
import sys

from reap_tools import cpu
from reap_tools.cli import ArgumentParser, fail, int_at_least

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "demo", "reap40")
# The shipped demo completes this prompt into working code (`return f.read()`) in float32 and bfloat16 alike; it is
# a tiny model, and of the README's five bare headers it completes 3 into code that parses and none into code that
# does what the name says (tests/test_demo.py, tests/test_demo_reap40.py).
DEFAULT_PROMPT = "def read_file(path):\n    with open(path) as f:\n"


def load_pipeline(model_dir, device_map=None, dtype="auto"):
    from transformers import pipeline

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir}: not a checkpoint directory (no config.json)")
    kwargs = {"device_map": device_map} if device_map else {}
    return pipeline("text-generation", model=model_dir, trust_remote_code=True, dtype=dtype, **kwargs)


class Progress:
    """A `stopping_criteria` entry that never stops anything: a progress bar of new tokens on stderr, with tokens/s
    and an ETA (for `total`, the most there can be), shown only on a terminal."""

    def __init__(self, total, desc, file=None):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="tok", desc=desc, leave=False, disable=None, file=file)
        self.start = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.start is None:
            self.start = input_ids.shape[1] - 1
        self.bar.update(input_ids.shape[1] - self.start - self.bar.n)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self):
        self.bar.close()


def check_length(pipe, prompt_tokens, max_new_tokens):
    """A warning on stderr when prompt + new tokens pass the model's max_position_embeddings: the model runs
    there, but past the positions it was trained on, so the output is not to be trusted."""
    limit = pipe.model.config.get_text_config().max_position_embeddings
    if prompt_tokens + max_new_tokens > limit:
        print(f"generate: warning: the prompt is {prompt_tokens} tokens; with --max-new-tokens {max_new_tokens} that "
              f"passes the model's max_position_embeddings = {limit}; output past it is untrained territory",
              file=sys.stderr)


def _prompt_lines(prompt):
    """How many lines the prompt fills (a final newline opens none)."""
    return prompt.rstrip("\n").count("\n") + 1


def block_end(prompt, text):
    """Where the block that `prompt` opens ends in `text` (prompt + completion): the start of the first line after
    the prompt's last line that begins at column 0 with a non-blank character (the next top-level statement), or
    None while there is none."""
    first = _prompt_lines(prompt)
    offset = 0
    for i, line in enumerate(text.split("\n")):
        if i >= first and line[:1] not in ("", " ", "\t"):
            return offset
        offset += len(line) + 1
    return None


def cut_completion(prompt, completion, ended=False):
    """prompt + completion up to the end of the prompt's block. Where the block has not ended and the generation did
    not end the document (`ended`: EOS), the last, possibly unfinished, line is dropped, unless it is the prompt's
    own line."""
    text = prompt + completion
    end = block_end(prompt, text)
    if end is not None:
        return text[:end].rstrip() + "\n"
    lines = text.split("\n")
    if not ended and len(lines) > _prompt_lines(prompt):
        lines = lines[:-1]
    return "\n".join(lines).rstrip() + "\n"


class EndOfBlock:
    """A `stopping_criteria` entry that stops a one-prompt generation once the prompt's block has ended
    (`block_end`). The first call sees the prompt and one new token, which is how it learns the prompt's length."""

    def __init__(self, tokenizer, prompt):
        self.tokenizer, self.prompt, self.start = tokenizer, prompt, None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.start is None:
            self.start = input_ids.shape[1] - 1
        done = [block_end(self.prompt, self.prompt + self.tokenizer.decode(row[self.start:].tolist(),
                                                                            skip_special_tokens=True)) is not None
                for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def heal_prompt(tokenizer, prompt):
    """Token healing: (the prompt less the text of its last token, that text), or (prompt, "") for a one-token
    prompt. A prompt typed up to a boundary that the tokenizer merges across ends on a token the model rarely saw
    there: `):` then a line break is one token, `):\n`, so a prompt that stops after `):` asks for more of the
    header's own line. Generating from the prompt less its last token, with the first new token held to those whose
    text starts with the removed text (`StartsWith`), lets the model pick the merged token itself."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    tail = tokenizer.decode(ids[-1:]) if len(ids) > 1 else ""
    if not tail or not prompt.endswith(tail):
        return prompt, ""
    return prompt[: -len(tail)], tail


class StartsWith:
    """A `logits_processor` entry that holds each row's first generated token to the ids whose text starts with
    that row's text ("" leaves the row free): token healing, `heal_prompt`. The first call sees the prompts, which
    is how it knows the first step."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.start, self.mask = tokenizer, list(texts), None, None

    def __call__(self, input_ids, scores):
        import torch

        if self.start is None:
            self.start = input_ids.shape[1]
        if input_ids.shape[1] != self.start:
            return scores
        if self.mask is None:
            pieces = [self.tokenizer.decode([i]) for i in range(scores.shape[-1])]
            self.mask = torch.zeros(len(self.texts), scores.shape[-1], device=scores.device)
            for row, text in enumerate(self.texts):
                if text:
                    self.mask[row] = torch.tensor([0.0 if piece.startswith(text) else float("-inf")
                                                   for piece in pieces])
        return scores + self.mask


def complete(pipe, prompt, max_new_tokens=128, sample=False, heal=True):
    """Plain completion: the prompt and its continuation up to the end of the block the prompt opens, where
    generation stops; with `heal`, the prompt's last token is regenerated (`heal_prompt`). Decoding follows the
    checkpoint's generation_config.json (the demo's: greedy with a repetition penalty), greedy unless `sample`."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    options = dict(do_sample=True, temperature=1.0, top_p=0.95) if sample else dict(do_sample=False)
    check_length(pipe, len(pipe.tokenizer(prompt)["input_ids"]), max_new_tokens)
    head, tail = heal_prompt(pipe.tokenizer, prompt) if heal else (prompt, "")
    if tail:
        options["logits_processor"] = LogitsProcessorList([StartsWith(pipe.tokenizer, [tail])])
    progress = Progress(max_new_tokens, "generate")
    try:
        out = pipe(head, max_new_tokens=max_new_tokens, return_full_text=False,
                   stopping_criteria=StoppingCriteriaList([EndOfBlock(pipe.tokenizer, head), progress]), **options)
    finally:
        progress.close()
    text = head + out[0]["generated_text"]
    end = block_end(head, text)
    return text if end is None else text[:end].rstrip() + "\n"


def chat(pipe, prompt, max_new_tokens=256, sample=True, thinking=True):
    """One user turn; returns the parsed reply (reasoning_content, content, tool_calls and flags)."""
    from kimi_k3_parsing import parse
    from transformers import StoppingCriteriaList

    options = dict(do_sample=True, temperature=1.0, top_p=0.95) if sample else dict(do_sample=False)
    messages = [{"role": "user", "content": prompt}]
    ids = pipe.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, thinking=thinking)
    prompt_ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    check_length(pipe, len(prompt_ids), max_new_tokens)
    progress = Progress(max_new_tokens, "chat")
    try:
        out = pipe(messages, max_new_tokens=max_new_tokens, tokenizer_encode_kwargs={"thinking": thinking},
                   return_tensors=True, stopping_criteria=StoppingCriteriaList([progress]), **options)
    finally:
        progress.close()
    generated = list(out[0]["generated_token_ids"])[len(prompt_ids):]  # structure from the special ids, not text
    return parse(generated, tokenizer=pipe.tokenizer, thinking=thinking)


def main(argv=None):
    parser = ArgumentParser(prog="python -m reap_tools generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped demo)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                        help="default 128 (completion; it stops where the prompt's block ends) or 256 (chat)")
    parser.add_argument("--chat", action="store_true", help="use the chat template; print reasoning and content")
    parser.add_argument("--no-thinking", action="store_true", help="with --chat: answer without the think channel")
    parser.add_argument("--sample", action="store_true", help="sample (temperature 1.0, top_p 0.95); default greedy")
    parser.add_argument("--no-heal", action="store_true", help="complete the prompt's last token as typed (no token "
                        "healing)")
    parser.add_argument("--device-map", default=None, help='e.g. "auto" to spread a large model over GPUs')
    parser.add_argument("--dtype", choices=cpu.DTYPES, default="auto", help="default: float32 on a CPU without AMX "
                        "(faster there), else the checkpoint's")
    parser.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads (default 1 on the CPU: "
                        "one-token steps are too small to share; torch's default on an accelerator)")
    args = parser.parse_args(argv)
    if args.no_thinking and not args.chat:
        parser.error("--no-thinking only applies with --chat")
    if not args.chat and not args.prompt.strip():
        parser.error("--prompt is empty: give the start of the text to complete")
    threads = args.threads or (1 if cpu.runs_on_cpu(args.device_map) else None)
    dtype = cpu.choose("generate", args.dtype, args.device_map, threads)
    try:
        pipe = load_pipeline(args.model, args.device_map, dtype)
    except (OSError, ValueError) as e:
        return fail("generate", e)
    if not args.chat:
        print(complete(pipe, args.prompt, 128 if args.max_new_tokens is None else args.max_new_tokens, args.sample,
                       heal=not args.no_heal))
        return 0
    max_new_tokens = 256 if args.max_new_tokens is None else args.max_new_tokens
    reply = chat(pipe, args.prompt, max_new_tokens, args.sample, thinking=not args.no_thinking)
    print("--- reasoning ---")
    print(reply.get("reasoning_content") or "")
    print("--- content ---")
    print(reply.get("content") or "")
    for call in reply.get("tool_calls") or []:
        print(f"--- tool call --- {call['function']['name']}({call['function']['arguments']})")
    for key in ("warning", "error"):
        if reply.get(key):
            print(f"--- {key} --- {reply[key]}", file=sys.stderr)
    return 0
