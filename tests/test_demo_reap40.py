"""The shipped REAP-40 demo (issue 6): a bit-exact prune of the trained parent, and the README's default model."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from reap_tools.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PARENT, PRUNED = ROOT / "demo" / "parent", ROOT / "demo" / "reap40"


def test_kept_experts_verify_bit_exact_against_the_parent():
    result = verify_checkpoint(PRUNED, source=PARENT, progress=False)
    assert result.ok, result.errors
    selection = json.loads((PRUNED / "reap_selection.json").read_text())
    assert selection["criterion"] == "reap"
    assert all(len(ids) == 40 for ids in selection["layers"].values())
    assert json.loads((PRUNED / "config.json").read_text())["text_config"]["num_experts"] == 40


def test_pruned_demo_is_the_generate_default_and_generates():
    from reap_tools.generate import DEFAULT_MODEL, complete, load_pipeline

    assert Path(DEFAULT_MODEL) == PRUNED
    model = AutoModelForCausalLM.from_pretrained(PRUNED, trust_remote_code=True)
    assert len(model.language_model.model.layers[1].block_sparse_moe.experts) == 40
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny decode ops: one thread is fastest
    try:
        text = complete(load_pipeline(str(PRUNED)), "def fibonacci(n):\n", max_new_tokens=16)
    finally:
        torch.set_num_threads(threads)
    assert text.startswith("def fibonacci(n):\n") and len(text) > len("def fibonacci(n):\n")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_prompt_completes_into_code_that_does_what_its_name_says(dtype, tmp_path):
    """`python -m reap_tools generate` with its defaults (demo/reap40, greedy, 128 new tokens): the completion
    parses, and the function it defines reads a file (float32 is the CPU default without AMX, bfloat16 elsewhere)."""
    import ast

    from transformers import pipeline

    from reap_tools.generate import DEFAULT_PROMPT, complete

    model = AutoModelForCausalLM.from_pretrained(PRUNED, trust_remote_code=True, dtype=dtype)
    pipe = pipeline("text-generation", model=model, tokenizer=str(PRUNED), trust_remote_code=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        text = complete(pipe, DEFAULT_PROMPT, max_new_tokens=128)
    finally:
        torch.set_num_threads(threads)
    assert text.startswith(DEFAULT_PROMPT)
    ast.parse(text)
    namespace = {}
    exec(compile(text, "completion", "exec"), namespace)  # noqa: S102 - the demo's own output, checked above
    sample = tmp_path / "sample.txt"
    sample.write_text("two\nlines\n")
    assert namespace["read_file"](str(sample)) == "two\nlines\n", text
