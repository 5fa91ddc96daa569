"""save_pretrained of a trust_remote_code model and tokenizer writes every remote-code file, and the result loads.

transformers' custom_object_save copies the class's module and the files it imports relatively (recursively);
the tokenizer module names kimi_k3_parsing.py that way (under TYPE_CHECKING), so the reply parser the model card
imports travels with every save.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
REMOTE_FILES = sorted(p.name for p in ROOT.glob("*.py"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("save")
    src = tmp / "reap40copy"
    shutil.copytree(ROOT / "demo" / "reap40", src, symlinks=False)
    for name in REMOTE_FILES:  # regular files from the root, as on the Hub
        (src / name).unlink(missing_ok=True)
        shutil.copyfile(ROOT / name, src / name)
    model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=True)
    out = tmp / "resaved"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return src, out, model, tokenizer


def test_every_remote_code_file_is_saved(saved):
    src, out, _, _ = saved
    assert "kimi_k3_parsing.py" in REMOTE_FILES and "tokenization_kimi_k3.py" in REMOTE_FILES
    missing = [name for name in REMOTE_FILES if not (out / name).is_file()]
    assert not missing, f"save_pretrained left out {missing}"
    for name in REMOTE_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (out / name).is_file(), name


def test_the_saved_folder_loads_again_offline(saved, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, out, model, tokenizer = saved
    model2 = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    tokenizer2 = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert "resaved" in type(model2).__module__ and "resaved" in type(tokenizer2).__module__
    messages = [{"role": "user", "content": "Write a function."}]
    ids = tokenizer2.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids[:16]])
    with torch.no_grad():
        torch.testing.assert_close(model2(x).logits, model(x).logits, rtol=0, atol=0)
    # The parser the README imports from the snapshot directory is there and works with the saved tokenizer.
    spec = importlib.util.spec_from_file_location("saved_kimi_k3_parsing", out / "kimi_k3_parsing.py")
    parsing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parsing)
    parsed = parsing.parse(tokenizer2.encode_ordinary("hi"), tokenizer=tokenizer2)
    assert {"reasoning_content", "content", "tool_calls"} <= set(parsed)
