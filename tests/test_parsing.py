"""Parsing K3 output: every rendered assistant turn parses back, streaming in any chunks equals
parsing the whole text, malformed output comes back as flagged content, truncation is explained."""

import json
import random

import pytest
from chat_cases import CASES, PROMPT_RESPONSE, PROMPT_THINK

from kimi_k3_parsing import TRUNCATED, TRUNCATED_IN_REASONING, StreamParser, parse
from tokenization_kimi_k3 import chat_options, render_chat, segments_text

END = "<|close|>message<|sep|><|end_of_msg|>"


def _turns():
    """(original message, thinking, its rendered text) for every assistant message in CASES."""
    for name, (messages, tools, options, _) in CASES.items():
        thinking, _ = chat_options(
            options.get("thinking"), None, options.get("thinking_effort"), options.get("reasoning_effort")
        )
        render_options = {k: v for k, v in options.items() if k != "add_generation_prompt"}
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                text = segments_text(render_chat(messages[: i + 1], tools, **render_options))
                turn = text[text.rindex('<|open|>message role="assistant"') :]
                yield pytest.param(message, thinking, turn, id=f"{name}-{i}")


TURNS = list(_turns())
# The turns a generation prompt opens (not the named one), as (message, thinking, generated text).
GENERATED = [
    pytest.param(message, thinking, turn.removeprefix(PROMPT_THINK if thinking else PROMPT_RESPONSE), id=p.id)
    for p in TURNS
    for message, thinking, turn in [p.values]
    if turn.startswith(PROMPT_THINK if thinking else PROMPT_RESPONSE)
]


def _content_text(content):
    return "".join(part["text"] for part in content) if isinstance(content, list) else content or ""


def _check_matches(parsed, message, thinking):
    assert not parsed["malformed"], parsed["error"]
    assert not parsed["truncated"] and parsed["warning"] is None
    reasoning = message.get("reasoning_content") or ""
    if thinking:  # a blank reasoning is rendered as an empty think channel
        assert parsed["reasoning_content"] == (reasoning if reasoning.strip() else "")
    else:
        assert parsed["reasoning_content"] is None
    assert parsed["content"] == _content_text(message.get("content"))
    expected_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    got_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]]
    assert got_calls == expected_calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed["tool_calls"])


def _stream(text, thinking, sizes):
    """Feed `text` in chunks of the given sizes; return (result, concatenated deltas)."""
    parser, seen, pos = StreamParser(thinking=thinking), {"reasoning_content": "", "content": "", "tool_calls": []}, 0
    for size in sizes:
        for key, value in parser.feed(text[pos : pos + size]).items():
            seen[key] += value
        pos += size
    for key, value in parser.finish().items():
        seen[key] += value
    assert pos >= len(text)
    return parser.result(), seen


def _check_stream_equals_parse(text, thinking):
    whole = parse(text, thinking=thinking)
    rng = random.Random(len(text))
    chunkings = [[1] * len(text), [len(text)], [rng.randint(1, 9) for _ in range(len(text))]]
    for sizes in chunkings:
        result, seen = _stream(text, thinking, sizes)
        assert result == whole
        assert seen["reasoning_content"] == (whole["reasoning_content"] or "")
        assert seen["content"] == whole["content"]
        assert [{k: v for k, v in c.items() if k != "index"} for c in seen["tool_calls"]] == whole["tool_calls"]
        assert [c["index"] for c in seen["tool_calls"]] == list(range(len(whole["tool_calls"])))
    return whole


@pytest.mark.parametrize("message, thinking, turn", TURNS)
def test_rendered_assistant_turns_parse_back(message, thinking, turn):
    parsed = parse(turn)
    _check_matches(parsed, message, thinking)
    assert parsed["finished"]
    assert parse(turn, thinking=thinking) == parsed


@pytest.mark.parametrize("message, thinking, generated", GENERATED)
def test_generated_text_after_the_prompt_parses_the_same(message, thinking, generated):
    parsed = parse(generated)
    _check_matches(parsed, message, thinking)
    assert parse(generated, thinking=thinking) == parsed


@pytest.mark.parametrize("message, thinking, turn", TURNS)
def test_streaming_whole_turns_in_any_chunks(message, thinking, turn):
    _check_matches(_check_stream_equals_parse(turn, thinking), message, thinking)


@pytest.mark.parametrize("message, thinking, generated", GENERATED)
def test_streaming_generated_text_in_any_chunks(message, thinking, generated):
    _check_matches(_check_stream_equals_parse(generated, thinking), message, thinking)


def test_partial_markers_are_held_back():
    parser = StreamParser()
    assert parser.feed("Let me think<|clo") == {"reasoning_content": "Let me think"}
    assert parser.feed("se|>think") == {}
    assert parser.feed("<|sep|><|open|>resp") == {}
    assert parser.feed("onse<|sep|>Hi <") == {"content": "Hi "}
    assert parser.feed("3 <|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=") == {"content": "<3 "}
    assert parser.feed('"f" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')["tool_calls"][0][
        "function"
    ] == {
        "name": "f",
        "arguments": "{}",
    }
    assert parser.feed(f"{END}ignored after the end") == {}
    assert parser.finish() == {}
    result = parser.result()
    assert result["finished"] and not result["malformed"] and result["content"] == "Hi <3 "


def test_output_that_ends_while_thinking_says_so():
    parsed = parse("The user wants a sorting function. First I should consider")
    assert parsed["truncated_in_reasoning"] and parsed["truncated"] and not parsed["finished"]
    assert parsed["reasoning_content"] == "The user wants a sorting function. First I should consider"
    assert parsed["content"] == "" and parsed["tool_calls"] == []
    assert parsed["warning"] == TRUNCATED_IN_REASONING
    assert "max_new_tokens" in parsed["warning"] and "32768" in parsed["warning"]
    # Cut off just after the closing control token: the marker is not reasoning text.
    assert parse("abc<|close|>think")["reasoning_content"] == "abc"
    assert parse("abc<|close|>")["truncated_in_reasoning"]


def test_output_that_ends_inside_the_answer():
    parsed = parse("ok<|close|>think<|sep|><|open|>response<|sep|>Partial ans")
    assert parsed["truncated"] and not parsed["truncated_in_reasoning"]
    assert (parsed["reasoning_content"], parsed["content"], parsed["warning"]) == ("ok", "Partial ans", TRUNCATED)
    thinking_off = parse("Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert (thinking_off["reasoning_content"], thinking_off["content"], thinking_off["finished"]) == (
        None,
        "Hello",
        True,
    )
    stopped = parse("r<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>[EOT]")
    assert stopped["content"] == "Hi" and not stopped["truncated"] and not stopped["finished"]


CALL = '<|open|>call tool="f" index="1"<|sep|>'
A = "ok<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>"
MALFORMED = {
    "unclosed_call": (
        A + "<|open|>tools<|sep|>" + CALL + '<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|>',
        "x",
    ),
    "bad_json_number": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="n" type="number"<|sep|>12,5<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "12,5",
    ),
    "type_mismatch": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="b" type="boolean"<|sep|>yes<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "yes",
    ),
    "object_holding_a_string": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="o" type="object"<|sep|>"x"<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        '"x"',
    ),
    "unknown_type": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="d" type="date"<|sep|>2026-01-01<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "2026-01-01",
    ),
    "argument_without_key": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "v",
    ),
    "call_without_tool": (
        A + '<|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + END,
        'index="1"',
    ),
    "unclosed_argument": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="a" type="string"<|sep|>one<|open|>argument key="b" type="string"<|sep|>two<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "one",
    ),
    "text_between_calls": (
        A + "<|open|>tools<|sep|>stray words" + CALL + "<|close|>call<|sep|><|close|>tools<|sep|>" + END,
        "stray words",
    ),
    "unquoted_attributes": (
        A + "<|open|>tools<|sep|><|open|>call tool=f index=1<|sep|><|close|>call<|sep|><|close|>tools<|sep|>" + END,
        "tool=f",
    ),
    "json_block_not_json": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>json type="object"<|sep|>{"a": <|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        '{"a": ',
    ),
    "json_block_not_object": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "[1, 2]",
    ),
    "json_block_and_arguments": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>json type="object"<|sep|>{}<|close|>json<|sep|><|open|>argument key="a" type="string"<|sep|>q<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "q",
    ),
    "unknown_element": (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>param key="a"<|sep|>z<|close|>param<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        + END,
        "param",
    ),
    "unclosed_call_header": (A + '<|open|>tools<|sep|><|open|>call tool="f"', 'tool="f"'),
    "unclosed_tools_section": (A + "<|open|>tools<|sep|>" + CALL + "<|close|>call<|sep|>" + END, CALL),
    "text_after_response": (A + "stray text", "stray text"),
    "text_after_message": (A + "<|close|>message<|sep|>more text", "more text"),
    "answer_outside_a_channel": ("hmm<|close|>think<|sep|>Answer without a channel" + END, "Answer without a channel"),
    "second_tools_section": (
        A
        + "<|open|>tools<|sep|><|close|>tools<|sep|><|open|>tools<|sep|>"
        + CALL
        + "<|close|>call<|sep|><|close|>tools<|sep|>"
        + END,
        CALL,
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_output_comes_back_as_flagged_content(name):
    text, kept = MALFORMED[name]
    parsed = _check_stream_equals_parse(text, True)
    assert parsed["malformed"] and isinstance(parsed["error"], str) and parsed["error"]
    assert parsed["tool_calls"] == []
    assert parsed["content"].startswith("Sure.") or name == "answer_outside_a_channel"
    assert kept in parsed["content"], "no text may be lost"


def test_calls_stream_as_a_section_and_keep_their_order():
    text = (
        A
        + "<|open|>tools<|sep|>"
        + CALL
        + '<|open|>argument key="a" type="array"<|sep|>[1, {"b": null}]<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>{"raw": true}<|close|>json<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|>" + END
    )
    parsed = _check_stream_equals_parse(text, True)
    assert [c["function"] for c in parsed["tool_calls"]] == [
        {"name": "f", "arguments": '{"a": [1, {"b": null}]}'},
        {"name": "g", "arguments": '{"raw": true}'},
    ]
    assert len({c["id"] for c in parsed["tool_calls"]}) == 2
    assert parse(text)["tool_calls"] == parsed["tool_calls"], "ids are stable"
