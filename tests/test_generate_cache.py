"""`generate` keeps and reuses the model's own cache on the installed transformers release (tests/run.sh runs this
file under each supported one): after the prompt every step feeds one token, for greedy, sampling, beam search, the
static cache and `pipeline`; the static cache generates the growing cache's tokens; nothing warns about the cache's
name. Run in a fresh interpreter because transformers prints each deprecation warning once per process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json, logging, warnings
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging as hf_logging
    from reap_tools.tiny import random_model, tiny_config

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    hf_logging.get_logger().addHandler(Keep())  # the library's root logger: every transformers module logs under it
    warnings.simplefilter("always")

    def spied(model):
        lengths = []
        forward = model.forward

        def spy(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            lengths.append(None if ids is None else ids.shape[1])
            return forward(*args, **kwargs)

        model.forward = spy
        return lengths

    model = random_model(tiny_config(packed=True), seed=3)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.pad_token_id
    lengths = spied(model)
    prompt = torch.tensor([[11, 200, 37, 5, 91, 14, 3]])
    runs, tokens = {}, {}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        for name, kwargs in {
            "greedy": dict(do_sample=False),
            "sampling": dict(do_sample=True, top_p=0.9),
            "beam": dict(do_sample=False, num_beams=3),
            "static": dict(do_sample=False, cache=model.make_static_cache(1, 16)),
            "static_beam": dict(do_sample=False, num_beams=3, cache=model.make_static_cache(3, 16)),
        }.items():
            lengths.clear()
            torch.manual_seed(0)
            tokens[name] = model.generate(prompt, max_new_tokens=6, **kwargs).tolist()
            runs[name] = list(lengths)
        lengths.clear()
        out = model(prompt, use_cache=True)
        model(prompt[:, -1:], cache=out["cache"] if "cache" in out.keys() else out["past_key_values"], use_cache=True)
        runs["forward_twice"] = list(lengths)

        demo = os.path.join({root!r}, "demo", "reap40")
        tok = AutoTokenizer.from_pretrained(demo, trust_remote_code=True)
        lm = AutoModelForCausalLM.from_pretrained(demo, trust_remote_code=True)
        lm.generation_config.eos_token_id = None
        lengths = spied(lm)
        pipe = pipeline("text-generation", model=lm, tokenizer=tok)
        text = "def add(a, b):"
        pipe(text, max_new_tokens=5, do_sample=False)
        runs["pipeline"] = list(lengths)
        prompt_length = len(tok(text)["input_ids"])
    messages += [str(w.message) for w in caught]
    print("RESULT " + json.dumps(dict(runs=runs, tokens=tokens, messages=messages, pipeline_prompt=prompt_length)))
    """
)


@pytest.fixture(scope="module")
def result():
    script = "import os\n" + SCRIPT.replace("{root!r}", repr(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("run", ["greedy", "sampling", "beam", "static", "static_beam"])
def test_each_generate_step_after_the_prompt_feeds_one_token(result, run):
    assert result["runs"][run] == [7, 1, 1, 1, 1, 1]


def test_a_returned_cache_serves_the_next_forward(result):
    assert result["runs"]["forward_twice"] == [7, 1]


def test_pipeline_feeds_one_token_a_step(result):
    assert result["runs"]["pipeline"] == [result["pipeline_prompt"]] + [1] * 4


def test_static_cache_generates_the_growing_caches_tokens(result):
    assert result["tokens"]["static"] == result["tokens"]["greedy"]
    assert result["tokens"]["static_beam"] == result["tokens"]["beam"]


def test_nothing_warns_about_the_cache(result):
    """transformers 5.24 warns "`past_key_values`/`cache_params` are deprecated" when a model takes or returns the
    cache under its old name; other libraries' deprecation warnings (torch's, on some installs) are not ours."""
    about_cache = [m for m in result["messages"] if "past_key_values" in m or "cache" in m.lower()]
    assert about_cache == []
