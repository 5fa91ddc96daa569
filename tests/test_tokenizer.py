"""Tokenizer: the reserved-id layout, exact round trips, plain text never becoming control tokens,
save/reload, and the BPE trainer behind tests/fixtures/tiktoken.model.

The fixture vocabulary was made with (PYLIB = the Python 3.11 standard library):
    python -m reap_tools bpe $PYLIB/json $PYLIB/email $PYLIB/logging $PYLIB/asyncio $PYLIB/argparse.py \
        $PYLIB/textwrap.py $PYLIB/dataclasses.py $PYLIB/pathlib.py $PYLIB/collections \
        /usr/share/common-licenses/* /usr/share/vim/vim90/doc/usr_0*.txt \
        --vocab-size 1536 --out tests/fixtures/tiktoken.model
"""

import inspect
import json
import string
from pathlib import Path

import pytest
import tiktoken
from transformers import AutoTokenizer

import tokenization_kimi_k3 as k3
from reap_tools import bpe
from reap_tools.__main__ import main as reap_main

ROOT = Path(__file__).resolve().parents[1]
RANK_FILE = ROOT / "tests" / "fixtures" / "tiktoken.model"
RANKS = k3.load_rank_file(RANK_FILE)
R = len(RANKS)

TEXTS = {
    "python": inspect.getsource(string),
    "english": "The quick brown fox doesn't jump; it's 3.14159 times lazier than you'd think, isn't it?\n",
    "chinese": "你好，世界！欢迎使用 Kimi K3：一个会写代码的模型。繁體中文也行。",
    "emoji": "ok 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 mixed🎉text ✨\u200d",
    "whitespace": "a \t\t  b\n\n\n   \r\n\r\n\u00a0\u3000 end   \n\t",
    "scripts": "Ελληνικά Русский العربية हिन्दी 日本語のテキスト 한국어 cafe\u0301 naïve",
    "controls": "\x00\x01\x1b[31mred\x1b[0m\x7f",
    "markers": '<|open|>message role="system"<|sep|>x<|close|>message<|sep|><|end_of_msg|>[BOS][EOT][PAD]<|reserved_token_1600|>',
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = k3.write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"), RANK_FILE)
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=True)


def reference_encode(text: str) -> list[int]:
    """tiktoken's BPE in plain Python over the `regex` split, to check the pattern is read alike."""
    ids = []
    for piece in bpe.split_pieces(text):
        data = piece.encode("utf-8")
        if data in RANKS:
            ids.append(RANKS[data])
            continue
        parts = [bytes([b]) for b in data]
        while len(parts) > 1:
            ranked = [(RANKS.get(parts[i] + parts[i + 1], len(RANKS)), i) for i in range(len(parts) - 1)]
            rank, i = min(ranked)
            if rank == len(RANKS):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [RANKS[part] for part in parts]
    return ids


def test_reserved_id_layout(tokenizer):
    assert R == 1536
    assert tokenizer.vocab_size == len(tokenizer) == len(tokenizer.get_vocab()) == R + 256
    for offset, name in k3.SPECIAL_TOKEN_OFFSETS.items():
        assert tokenizer.convert_tokens_to_ids(name) == R + offset
        assert tokenizer.convert_ids_to_tokens(R + offset) == name
    assert tokenizer.convert_ids_to_tokens(R + 8) == f"<|reserved_token_{R + 8}|>"
    assert tokenizer.convert_ids_to_tokens(R + 253) == f"<|reserved_token_{R + 253}|>"
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("[BOS]", R)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|end_of_msg|>", R + 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("[PAD]", R + 255)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("[UNK]", R + 254)
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(R + 256))
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(list(range(0, R, 97)))) == list(
        range(0, R, 97)
    )
    assert [t.content for i, t in tokenizer.added_tokens_decoder.items() if not t.special] == [
        "<|open|>",
        "<|close|>",
        "<|sep|>",
    ]


@pytest.mark.parametrize("name", TEXTS)
def test_round_trip_is_exact(tokenizer, name):
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < R, "plain text must never encode to a reserved id"
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer(text, split_special_tokens=False, add_special_tokens=True)["input_ids"] == ids
    assert tokenizer.convert_tokens_to_string(tokenizer.tokenize(text)) == text
    assert tokenizer.batch_decode([ids, ids[:1]])[0] == text


@pytest.mark.parametrize("name", TEXTS)
def test_pattern_reads_the_same_in_tiktoken_and_regex(tokenizer, name):
    assert tokenizer.encode(TEXTS[name]) == reference_encode(TEXTS[name])


def test_long_runs_are_cut_like_the_release(tokenizer):
    plain = tiktoken.Encoding(name="plain", pat_str=k3.PAT_STR, mergeable_ranks=RANKS, special_tokens={})
    text = "x" * 60001 + "   " + "y" * 10
    pieces = ["x" * 25000, "x" * 25000, "x" * 10001 + "   " + "y" * 10]
    assert tokenizer.encode(text) == [i for piece in pieces for i in plain.encode_ordinary(piece)]
    long = "ab cd " * 66668
    head, tail = long[: k3.MAX_ENCODE_CHARS], long[k3.MAX_ENCODE_CHARS :]
    ids = tokenizer.encode(long)
    assert ids == plain.encode_ordinary(head) + plain.encode_ordinary(tail)
    assert tokenizer.decode(ids) == long


def test_decode_keeps_only_the_structural_specials(tokenizer):
    tid = tokenizer.convert_tokens_to_ids
    ids = [tid("[BOS]"), tid("<|open|>"), *tokenizer.encode("message"), tid("<|sep|>"), *tokenizer.encode("hi")]
    ids += [tid("<|close|>"), tid("<|end_of_msg|>"), tid("[EOT]"), R + 100, tid("[PAD]")]
    full = f"[BOS]<|open|>message<|sep|>hi<|close|><|end_of_msg|>[EOT]<|reserved_token_{R + 100}|>[PAD]"
    assert tokenizer.decode(ids) == full
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<|open|>message<|sep|>hi<|close|>"
    assert tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)[0] == "<|open|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([R + 256])


def test_save_and_reload(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tiktoken.model").read_bytes() == RANK_FILE.read_bytes()
    reloaded = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(reloaded).__name__ == "KimiK3Tokenizer"
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded.chat_template == tokenizer.chat_template
    assert [reloaded.encode(t) for t in TEXTS.values()] == [tokenizer.encode(t) for t in TEXTS.values()]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "r", "content": "a"}]
    assert reloaded.apply_chat_template(messages, return_dict=False) == tokenizer.apply_chat_template(
        messages, return_dict=False
    )
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (R, R + 2, R + 255)


def test_any_number_of_ranks(tmp_path):
    ranks = bpe.train([TEXTS["python"]], 300)
    k3.write_rank_file(ranks, tmp_path / "small.model")
    directory = k3.write_tokenizer_files(tmp_path / "tok", tmp_path / "small.model")
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    assert tokenizer.vocab_size == 300 + 256
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("[BOS]", "<|end_of_msg|>", "<|open|>", "[PAD]")] == [
        300,
        302,
        303,
        555,
    ]
    assert tokenizer.decode(tokenizer.encode(TEXTS["chinese"])) == TEXTS["chinese"]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], thinking=False, return_dict=False)
    assert ids[0] == 303 and ids[-1] == 302


def test_bpe_trainer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXTS["english"] * 20 + TEXTS["python"], encoding="utf-8")
    ranks = bpe.train([corpus.read_text(encoding="utf-8")], 400)
    assert len(ranks) == 400
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert bpe.train([corpus.read_text(encoding="utf-8")], 400) == ranks, "training is deterministic"
    assert any(token == b" the" for token in ranks) and b" fox" in ranks
    out = tmp_path / "out.model"
    assert reap_main(["bpe", str(tmp_path), "--vocab-size", "400", "--out", str(out)]) == 0
    assert k3.load_rank_file(out) == ranks


def test_rank_file_errors(tmp_path):
    gap = tmp_path / "gap.model"
    gap.write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="without gaps"):
        k3.load_rank_file(gap)
    bad = tmp_path / "bad.model"
    bad.write_text("not-base64! 0\n")
    with pytest.raises(ValueError, match="bad.model:1"):
        k3.load_rank_file(bad)


def test_root_tokenizer_config_is_generated():
    """The hub repo's tokenizer_config.json is what the helper writes for the release's 163584 ranks."""
    shipped = json.loads((ROOT / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert shipped == k3.tokenizer_config(163584)
    assert shipped["added_tokens_decoder"]["163586"]["content"] == "<|end_of_msg|>"
    assert shipped["added_tokens_decoder"]["163839"]["content"] == "[PAD]"


def test_an_empty_rank_file_is_named_in_one_line(tmp_path):
    """Not a traceback about [BOS]: the message names the file and says what is wrong with it."""
    directory = k3.write_tokenizer_files(tmp_path / "tok", RANK_FILE)
    (directory / k3.VOCAB_FILE).write_bytes(b"")
    for load in (
        lambda: k3.load_rank_file(directory / k3.VOCAB_FILE),
        lambda: k3.KimiK3Tokenizer(str(directory / k3.VOCAB_FILE)),
        lambda: AutoTokenizer.from_pretrained(directory, trust_remote_code=True),
    ):
        with pytest.raises(ValueError, match="no BPE ranks") as err:
            load()
        message = str(err.value)
        assert str(directory / k3.VOCAB_FILE) in message and "\n" not in message and "[BOS]" not in message
