"""Kimi K3 tokenizer: tiktoken BPE ranks plus 256 reserved special ids, and the K3 "XTML" chat format.

The chat format follows Moonshot's `encoding_k3.py` (`build_chat_segments`, shipped in the
`moonshotai/Kimi-K3` repo; vLLM vendors it as `vllm/tokenizers/encoding_k3.py`). A prompt is
rendered as a list of segments: control segments (`<|open|>`, `<|close|>`, `<|sep|>`,
`<|end_of_msg|>`) become their reserved ids, every other segment (tag names, attributes, and
all user, tool and assistant text) is encoded as ordinary BPE, one segment at a time, exactly as
the reference encodes them. So text that spells a control token never becomes one.
`chat_template.jinja` renders the same strings for engines that render text; tests keep the two
byte-identical.
"""

from __future__ import annotations

import base64
import importlib
import inspect
import json
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

if TYPE_CHECKING:
    # Never run. transformers' remote-code loader follows the relative imports of this file (a line match, so
    # this one counts): loading the tokenizer with trust_remote_code fetches kimi_k3_parsing.py, the reply
    # parser the model card tells users to import, and save_pretrained copies it beside this file.
    from .kimi_k3_parsing import parse  # noqa: F401

# Pre-tokenisation regex of the Kimi tokenizers, as `pat_str` in Moonshot's `tokenization_kimi.py`
# (moonshotai/Kimi-K2-Instruct, Kimi-Linear-48B-A3B-Instruct, Kimi-K3). The `&&` class
# intersections are intended: tiktoken's regex engine reads them as written, and the `regex`
# module reads them the same way in its V1 mode.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256
# Offset (id - number of ranks) -> name of the named reserved tokens; the rest are
# `<|reserved_token_{id}|>`. 65 `<osagent_mode>` is not in the chat format's description but is in the
# release's `tokenizer_config.json` (as read by public K3 ports), so we name it the same way.
SPECIAL_TOKEN_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
# Structure, not noise: `decode(..., skip_special_tokens=True)` keeps these three.
KEPT_ON_SKIP = (OPEN, CLOSE, SEP)

# Long inputs are cut before BPE the way Moonshot's tokenizer cuts them (tiktoken is slow on, and
# can overflow on, huge runs); the cut points change the ids, so they are part of the format.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
MODEL_MAX_LENGTH = 131072
VOCAB_FILE = "tiktoken.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The tokenizer's `response_template` (and `response_schema`, the name older 5.x releases such as 5.0.0
# read). transformers' chat pipelines hand a reply to `parse_response` when a tokenizer has one; this
# value is no declarative template but says that `KimiK3Tokenizer.parse_response` (kimi_k3_parsing)
# parses the reply. It is never saved.
RESPONSE_TEMPLATE = "kimi_k3_parsing"
RESPONSE_HOOKS = ("response_template", "response_schema")


def _no_ranks(path) -> str:
    return f"{path}: no BPE ranks (the file is empty): use the {VOCAB_FILE} of the Kimi K3 release"


def load_rank_file(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file (`base64(token) rank` per line) of any size.

    Parsed here rather than with `tiktoken.load.load_tiktoken_bpe`, which caches files by path
    in a temp dir and so can return a stale vocabulary when a file is rewritten in place.
    """
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: expected 'base64-token rank', got {line[:80]!r}") from err
    if not ranks:
        raise ValueError(_no_ranks(path))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be unique and cover 0..{len(ranks) - 1} without gaps")
    return ranks


def write_rank_file(ranks: Mapping[bytes, int], path: str | Path) -> None:
    """Write `ranks` as a tiktoken rank file, in rank order."""
    lines = [
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    Path(path).write_text("".join(lines), encoding="ascii")


def special_token_layout(num_ranks: int) -> dict[int, tuple[str, bool]]:
    """The 256 reserved ids after the ranks: id -> (name, special). Only open/close/sep are not special."""
    layout = {}
    for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
        token_id = num_ranks + offset
        name = SPECIAL_TOKEN_OFFSETS.get(offset, f"<|reserved_token_{token_id}|>")
        layout[token_id] = (name, name not in KEPT_ON_SKIP)
    return layout


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, so every rank has a `str` token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _split_long_runs(text: str) -> list[str]:
    """Cut `text` so that no run of whitespace or of non-whitespace is longer than MAX_RUN_CHARS.

    Each run is cut every MAX_RUN_CHARS characters from its start; pieces keep their order.
    """
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    cuts, run_start = [], 0
    for i in range(1, len(text) + 1):
        if i == len(text) or text[i].isspace() != text[i - 1].isspace():
            cuts.extend(range(run_start + MAX_RUN_CHARS, i, MAX_RUN_CHARS))
            run_start = i
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _parsing():
    """The kimi_k3_parsing module beside this file (in the repo, or in transformers' remote-code package)."""
    return importlib.import_module(f"{__package__}.kimi_k3_parsing" if __package__ else "kimi_k3_parsing")


class DecodedText(str):
    """What `decode` returns: the text, remembering the ids it was decoded from in `token_ids`.

    transformers' pipelines give `parse_response` decoded text; through `token_ids` it parses the ids,
    which alone tell a control token from text spelling it. Any string operation on it gives a plain
    `str`, and it pickles and copies as one.
    """

    def __new__(cls, text: str, token_ids):
        self = super().__new__(cls, text)
        self.token_ids = tuple(token_ids)
        return self

    def __reduce__(self):
        return str, (str(self),)


# ---------------------------------------------------------------------------------------------
# Chat rendering (pure Python; mirrored by chat_template.jinja)
# ---------------------------------------------------------------------------------------------


class Segment(NamedTuple):
    """One piece of a rendered prompt: a control token (encoded as its id) or ordinary text."""

    text: str
    control: bool


class _Segments(list):
    """A segment list with the XTML tag helpers; empty text segments are dropped, as upstream."""

    def control(self, token: str) -> None:
        self.append(Segment(token, True))

    def text(self, text: str) -> None:
        if text:
            self.append(Segment(text, False))

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        """`<|open|>tag key="value"...<|sep|>`; each attribute is four text segments, as upstream."""
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(str(value).replace("&", "&amp;").replace('"', "&quot;"))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def message(self, attrs: list[tuple[str, Any]], body: str) -> None:
        """A whole `message` element with a plain-text body, ended by `<|end_of_msg|>`."""
        self.open("message", *attrs)
        self.text(body)
        self.close("message")
        self.control(END_OF_MSG)


def chat_options(thinking=None, enable_thinking=None, thinking_effort=None, reasoning_effort=None) -> tuple[bool, str]:
    """Resolve the thinking switch and effort the way upstream does; reject unknown efforts.

    `thinking` wins over `enable_thinking` (default on); `reasoning_effort="none"` turns thinking
    off, any other `reasoning_effort` stands in for a missing `thinking_effort`; default "max".
    The switches take only True, False or None: a string such as "no" would read as on.
    """
    for name, value in (("thinking", thinking), ("enable_thinking", enable_thinking)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False (or None for the default, on), got {value!r}")
    if thinking is None:
        thinking = True if enable_thinking is None else enable_thinking
    if reasoning_effort == "none":
        thinking = False
    elif thinking_effort is None and reasoning_effort is not None:
        thinking_effort = reasoning_effort
    effort = DEFAULT_THINKING_EFFORT if thinking_effort is None else thinking_effort
    if effort not in THINKING_EFFORTS:
        raise ValueError(
            f"Unsupported thinking_effort={effort!r}: Kimi K3 accepts {', '.join(THINKING_EFFORTS)} "
            f"(default {DEFAULT_THINKING_EFFORT}), or reasoning_effort='none' to turn thinking off."
        )
    return bool(thinking), effort


# What transformers hands a chat template in place of a set, bytes or complex value. A template cannot
# tell these strings from the values, so both renderers refuse both, and agree on every input.
_PLACEHOLDERS = frozenset(f"<{name}>" for name in ("set", "frozenset", "bytes", "bytearray", "complex"))


def _check_json_data(value: Any, what: str) -> None:
    """Refuse, naming `what`, a value that JSON cannot represent (or transformers' stand-in for one)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item in _PLACEHOLDERS:
                raise ValueError(
                    f"{what} holds {item!r}, transformers' stand-in for a value JSON cannot represent: give JSON data"
                )
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None and not isinstance(item, (bool, int, float)):
            raise ValueError(
                f"{what} holds a {type(item).__name__}, which JSON cannot represent: give a list, a string or a number"
            )


def _compact_json(value: Any, what: str) -> str:
    """Key-sorted (at every depth), compact, non-ASCII kept: how K3 writes schemas."""
    _check_json_data(value, what)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def _tool_arguments(arguments: Any) -> tuple[Mapping, str | None]:
    """A call's arguments as (per-key values, raw JSON block). Unparsable strings become the block."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, Mapping):
        return arguments, None
    if not isinstance(arguments, str):
        raise ValueError(f"tool call arguments must be a dict or a JSON object string, got {type(arguments).__name__}")
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments[:80]!r}")
    return parsed, None


def _function(call: Mapping) -> Mapping:
    """OpenAI `{"function": {...}}` calls and bare `{"name", "arguments"}` calls alike."""
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not function.get("name"):
        raise ValueError(f"tool call without a function name: {call!r}")
    return function


def _content(out: _Segments, content: Any) -> None:
    """Message content: a string, or a list of text parts (this text-only package refuses media)."""
    if content is None:
        return
    if isinstance(content, str):
        out.text(content)
        return
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError(f"content parts must be dicts like {{'type': 'text', 'text': ...}}, got {part!r}")
        if part.get("type") in ("image", "image_url"):
            raise ValueError("this Kimi K3 package is text-only: image content parts are not supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a content part has no text: {part!r}")
        out.text(part["text"])


def _first_set(message: Mapping, *keys: str) -> Any:
    """The first of `keys` that `message` holds with a value other than None (OpenAI clients send nulls)."""
    return next((message[key] for key in keys if message.get(key) is not None), None)


def _order_tool_results(messages: list[Mapping]) -> list[Mapping]:
    """Put each run of tool results in the order of the calls they answer, as upstream does.

    A run matches the latest assistant's calls by `tool_call_id` (first call wins for a repeated
    id); only a fully matched run is reordered, and its `tool` name is then the call's name.
    """
    ordered: list[Mapping] = []
    positions: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                positions = {}
                for position, call in enumerate(message.get("tool_calls") or (), 1):
                    if call.get("id") is not None:
                        positions.setdefault(str(call["id"]), (position, _function(call)["name"]))
            ordered.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            call_id = _first_set(messages[i], "tool_call_id", "id")
            run.append((positions.get(str(call_id)) if call_id is not None else None, messages[i]))
            i += 1
        if any(match is None for match, _ in run):
            ordered.extend(message for _, message in run)
        else:
            run.sort(key=lambda item: item[0][0])
            ordered.extend({**message, "tool": match[1]} for match, message in run)
    return ordered


def _assistant(out: _Segments, message: Mapping, thinking: bool) -> None:
    """think (only when thinking is on, even if empty), response, then the tools channel."""
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out.open("think")
        if reasoning is not None and str(reasoning).strip():
            out.text(str(reasoning))
        out.close("think")
    out.open("response")
    _content(out, message.get("content"))
    out.close("response")
    calls = message.get("tool_calls") or ()
    if not calls:
        return
    out.open("tools")
    for index, call in enumerate(calls, 1):
        function = _function(call)
        out.open("call", ("tool", function["name"]), ("index", index))
        arguments, json_block = _tool_arguments(function.get("arguments"))
        if json_block is not None:
            out.open("json", ("type", "object"))
            out.text(json_block)
            out.close("json")
        for key, value in arguments.items():
            _check_json_data(value, f"tool call argument {key!r} of {function['name']!r}")
            out.open("argument", ("key", key), ("type", _xtml_type(value)))
            out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            out.close("argument")
        out.close("call")
    out.close("tools")


def _tool_declaration(out: _Segments, tools: Any, dynamic: bool) -> None:
    if dynamic:
        head = (
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
        )
    else:
        head = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
    out.message([("role", "system"), ("type", "tool-declare")], f"{head}```json\n{_compact_json(tools, 'tools')}\n```")


def _response_schema(response_format: Any) -> Any:
    """The schema of an OpenAI `response_format` (`json_schema.schema`, or the json_schema itself)."""
    json_schema = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
    if isinstance(json_schema, Mapping):
        return json_schema.get("schema", json_schema.get("json_schema", json_schema))
    return json_schema


def _directives(out: _Segments, tool_choice: Any, response_format: Any, response_schema: Any) -> None:
    """The request-scoped system messages upstream puts after the conversation."""
    choice = {
        "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
    }
    if isinstance(tool_choice, str) and tool_choice in choice:
        out.message([("role", "system"), ("type", "tool-choice")], choice[tool_choice])
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    no_markdown = (
        "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    )
    if kind == "json_object":
        body = f"The system is invoked with `response_format=json_object`.\n{no_markdown}"
        out.message([("role", "system"), ("type", "response-format")], body)
    elif kind == "json_schema":
        schema = response_schema if response_schema is not None else _response_schema(response_format)
        body = (
            f"The system is invoked with `response_format=json_schema`.\n{no_markdown}\n"
            f"The JSON data must match the following schema:\n```json\n{_compact_json(schema, 'response_schema')}\n```"
        )
        out.message([("role", "system"), ("type", "response-format")], body)


def _named(role: str, message: Mapping) -> list[tuple[str, Any]]:
    return [("role", role), *([("name", message["name"])] if message.get("name") else [])]


def _effort_message(out: _Segments, effort: str) -> None:
    """The system message that thinking on sends, naming the effort."""
    body = (
        "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
        "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={effort}`."
    )
    out.message([("role", "system"), ("type", "thinking-effort")], body)


def _render(
    messages: list[Mapping], tools, thinking: bool, effort: str, add_generation_prompt: bool, extras
) -> _Segments:
    out = _Segments()
    if tools:
        _tool_declaration(out, tools, dynamic=False)
    if thinking:
        _effort_message(out, effort)
    calls: list = []
    tool_index = 0
    for message in _order_tool_results(messages):
        role = message.get("role")
        if role == "system" and message.get("tools"):
            _tool_declaration(out, message["tools"], dynamic=True)
        elif role in ("system", "user"):
            out.open("message", *_named(role, message))
            _content(out, message.get("content"))
            out.close("message")
            out.control(END_OF_MSG)
        elif role == "assistant":
            calls, tool_index = list(message.get("tool_calls") or ()), 0
            out.open("message", *_named(role, message))
            _assistant(out, message, thinking)
            out.close("message")
            out.control(END_OF_MSG)
        elif role == "tool":
            tool_index += 1
            name = _first_set(message, "tool", "name")
            if name is None and tool_index <= len(calls):
                name = _function(calls[tool_index - 1])["name"]
            if name is None:
                raise ValueError(
                    "a tool message needs a resolvable tool name: give it `tool`/`name`, a `tool_call_id` "
                    "matching a call of the preceding assistant message, or answer the calls in order"
                )
            out.open("message", ("role", "tool"), ("tool", name), ("index", tool_index))
            _content(out, message.get("content"))
            out.close("message")
            out.control(END_OF_MSG)
        else:
            # Upstream renders unknown roles as nothing; a silent drop hides bugs, so we refuse.
            raise ValueError(f"unsupported message role {role!r}: use system, user, assistant or tool")
    _directives(out, *extras)
    if add_generation_prompt:
        out.open("message", ("role", "assistant"))
        out.open("think" if thinking else "response")
    return out


def _mark_final_message(messages: list[Mapping], key: str, mark: str) -> list[Mapping]:
    """Copy `messages` with `mark` after the final message's `key` text (last text part)."""
    final = dict(messages[-1])
    value = final.get(key)
    if isinstance(value, (list, tuple)):
        parts = [dict(part) for part in value]
        text_parts = [part for part in parts if "text" in part]
        if not text_parts:
            raise ValueError("continue_final_message is set but the final message has no text to continue")
        text_parts[-1]["text"] += mark
        final[key] = parts
    else:
        final[key] = ("" if value is None else str(value)) + mark
    return [*messages[:-1], final]


def render_chat(
    messages: list[Mapping],
    tools: list[Mapping] | None = None,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    thinking: bool | None = None,
    enable_thinking: bool | None = None,
    thinking_effort: str | None = None,
    reasoning_effort: str | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    response_schema: Any = None,
) -> list[Segment]:
    """Render one conversation as K3 XTML segments (the canonical renderer).

    `tools` are JSON schemas (OpenAI `{"type": "function", "function": {...}}`). With thinking
    on (the default) a `thinking-effort` system message follows the tool declaration and every
    assistant turn carries a think channel; with thinking off past turns have no think channel and
    the generation prompt opens the response channel. `continue_final_message` (True, or the key
    to continue, e.g. "reasoning_content") leaves the final message open after its text.

    Where the chat format's description is silent this follows the release's encoding_k3.py: the effort message's text, and that it is
    sent whenever thinking is on (with or without tools); empty think channels; no think channel
    at all with thinking off; tool results reordered to their calls; the `tool-choice` and
    `response-format` directives; and the `name` attribute of user/system/assistant messages.
    """
    if not messages:
        raise ValueError("cannot render an empty conversation")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot be used together")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} is a {type(message).__name__}, not a dict with a 'role'")
    think, effort = chat_options(thinking, enable_thinking, thinking_effort, reasoning_effort)
    extras = (tool_choice, response_format, response_schema)
    if not continue_final_message:
        return list(_render(list(messages), tools, think, effort, add_generation_prompt, extras))
    key = "content" if continue_final_message is True else continue_final_message
    # Where the final message stops: a mark appended to its text and cut off again, new for every
    # call so that no message text can contain it and move the cut.
    mark = f"\x00{secrets.token_hex(16)}\x00"
    segments = _render(_mark_final_message(list(messages), key, mark), tools, think, effort, False, extras)
    for i, segment in enumerate(segments):
        if mark in segment.text:
            head = segment.text.split(mark)[0]
            return [*segments[:i], *([Segment(head, False)] if head else [])]
    raise ValueError(f"continue_final_message: the final message's {key!r} text is not rendered")


def segments_text(segments: list[Segment]) -> str:
    """The rendered prompt as one string (what chat_template.jinja renders)."""
    return "".join(segment.text for segment in segments)


def _chat_template_text() -> str:
    return Path(__file__).with_name(CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

# The keyword options of render_chat that apply_chat_template passes through.
CHAT_OPTIONS = (
    "thinking",
    "enable_thinking",
    "thinking_effort",
    "reasoning_effort",
    "tool_choice",
    "response_format",
    "response_schema",
)
# The ones a rendered prompt can be re-rendered with (`KimiK3Tokenizer.rerender_prompt`).
THINKING_OPTIONS = CHAT_OPTIONS[:4]
# `return_dict` defaults to False on transformers 4.x and True on 5.x; keep each version's default.
_RETURN_DICT_DEFAULT = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters["return_dict"].default


class KimiK3Tokenizer(PreTrainedTokenizer):
    """tiktoken-backed Kimi K3 tokenizer.

    Plain text is always encoded as ordinary BPE (`tokenizer(text)` never yields a control id);
    control ids come only from `apply_chat_template`, which renders with `render_chat` and encodes
    segment by segment. `decode(..., skip_special_tokens=True)` drops the reserved tokens except
    `<|open|>`, `<|close|>` and `<|sep|>`, so the output can still be parsed. `parse_response` parses
    replies with kimi_k3_parsing, which `response_template` hands it in transformers' chat pipelines.
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    @classmethod
    def _from_pretrained(cls, resolved_vocab_files, *args, **kwargs):
        """transformers 4.57 reports any error of `__init__` as a missing protobuf where protobuf is not installed:
        an empty rank file is refused here, before it, so that its own one-line error reaches the user."""
        vocab_file = resolved_vocab_files.get("vocab_file")
        if vocab_file is not None and Path(vocab_file).is_file() and Path(vocab_file).stat().st_size == 0:
            raise ValueError(_no_ranks(vocab_file))
        return super()._from_pretrained(resolved_vocab_files, *args, **kwargs)

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = END_OF_MSG,
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: Mapping[int, AddedToken] | None = None,
        clean_up_tokenization_spaces: bool = False,
        **kwargs,
    ):
        if vocab_file is None or not Path(vocab_file).is_file():
            folder = kwargs.get("name_or_path") or (Path(vocab_file).parent if vocab_file else "the tokenizer folder")
            raise ValueError(  # not an OSError: transformers replaces those by a message that names no file
                f"{VOCAB_FILE} is missing in {folder}: the tokenizer needs the BPE rank file of the Kimi K3 release; "
                f"copy `{VOCAB_FILE}` from the moonshotai/Kimi-K3 repository on the Hugging Face Hub into that folder"
            )
        self.vocab_file = vocab_file
        ranks = load_rank_file(vocab_file)
        self.num_ranks = len(ranks)
        layout = special_token_layout(self.num_ranks)
        for token_id, token in (added_tokens_decoder or {}).items():
            if int(token_id) not in layout:
                raise ValueError(
                    f"added token {token!r} has id {token_id}, outside the reserved ids {min(layout)}..{max(layout)}"
                )
            layout[int(token_id)] = (str(token), token.special if isinstance(token, AddedToken) else True)
        self.special_ids = {name: token_id for token_id, (name, _) in layout.items()}
        if len(self.special_ids) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError("the reserved special token names must be unique")
        self._skipped_ids = frozenset(token_id for token_id, (_, special) in layout.items() if special)
        self._model = tiktoken.Encoding(
            name=Path(vocab_file).stem, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        byte_map = _byte_to_unicode()
        self._id_to_token = [
            "".join(byte_map[b] for b in token) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        ]
        self._token_to_id = {token: token_id for token_id, token in enumerate(self._id_to_token)}
        self._unicode_to_byte = {char: b for b, char in byte_map.items()}
        clash = set(self.special_ids) & set(self._token_to_id)
        if clash:
            raise ValueError(f"reserved token names that are also ordinary tokens: {sorted(clash)}")
        decoder = {
            token_id: AddedToken(name, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for token_id, (name, special) in layout.items()
        }
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=decoder,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            **kwargs,
        )
        for hook in RESPONSE_HOOKS:
            setattr(self, hook, RESPONSE_TEMPLATE)

    def save_pretrained(self, *args, **kwargs):
        """Save as the base class does, but without RESPONSE_TEMPLATE, which no other loader could read."""
        own = [hook for hook in RESPONSE_HOOKS if getattr(self, hook, None) == RESPONSE_TEMPLATE]
        for hook in own:
            setattr(self, hook, None)
        try:
            return super().save_pretrained(*args, **kwargs)
        finally:
            for hook in own:
                setattr(self, hook, RESPONSE_TEMPLATE)

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.num_ranks + NUM_RESERVED_SPECIAL_TOKENS

    def get_vocab(self) -> dict[str, int]:
        return {**self._token_to_id, **self.special_ids}

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}{VOCAB_FILE}"
        if Path(self.vocab_file).resolve() != target.resolve():
            shutil.copyfile(self.vocab_file, target)
        return (str(target),)

    # -- encoding -----------------------------------------------------------------------------

    def encode_ordinary(self, text: str) -> list[int]:
        """BPE ids of `text` as plain text: control-token spellings stay text."""
        return [
            token_id
            for start in range(0, len(text), MAX_ENCODE_CHARS)
            for piece in _split_long_runs(text[start : start + MAX_ENCODE_CHARS])
            for token_id in self._model.encode_ordinary(piece)
        ]

    def encode_segments(self, segments: list[Segment]) -> list[int]:
        """Ids of rendered chat segments: control segments by id, text segments one by one as BPE."""
        ids: list[int] = []
        for segment in segments:
            if segment.control:
                ids.append(self.special_ids[segment.text])
            else:
                ids.extend(self.encode_ordinary(segment.text))
        return ids

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """Plain-text tokens; unlike the base class, never splits out added/special tokens."""
        return self._tokenize(text)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self._id_to_token[token_id] for token_id in self.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index]

    # -- decoding -----------------------------------------------------------------------------

    def _valid_ids(self, ids: list[int]) -> list[int]:
        """The ids as ints; an error naming any outside the vocabulary."""
        ids = [int(token_id) for token_id in ids]
        bad = [token_id for token_id in ids if not 0 <= token_id < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary (0..{self.vocab_size - 1}): {bad[:8]}")
        return ids

    def _kept_ids(self, ids: list[int], skip_special_tokens: bool, valid: bool = False) -> list[int]:
        """The ids to decode (checked unless `valid`): without the skipped specials where asked."""
        ids = ids if valid else self._valid_ids(ids)
        return [token_id for token_id in ids if token_id not in self._skipped_ids] if skip_special_tokens else ids

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.convert_ids_to_tokens([ids])[0]
        return [
            self._added_tokens_decoder[token_id].content if token_id >= self.num_ranks else self._id_to_token[token_id]
            for token_id in self._kept_ids(ids, skip_special_tokens)
        ]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(
            token.encode() if token in self.special_ids else bytes(self._unicode_to_byte[char] for char in token)
            for token in tokens
        )
        return data.decode("utf-8", errors="replace")

    def decode_bytes(self, token_ids, skip_special_tokens: bool = False) -> bytes:
        """The UTF-8 bytes `decode` reads (before cleanup): a character may span ids, so streaming decodes these."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self._model.decode_bytes(self._kept_ids(ids, skip_special_tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        ids = self._valid_ids([token_ids] if isinstance(token_ids, int) else token_ids)  # what the text carries
        kept = self._kept_ids(ids, skip_special_tokens, valid=True)
        text = self._model.decode_bytes(kept).decode("utf-8", errors="replace")
        if (
            clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is not None
            else self.clean_up_tokenization_spaces
        ):
            text = self.clean_up_tokenization(text)
        return DecodedText(text, ids)

    # -- replies ------------------------------------------------------------------------------

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):
        """Parse generated output into an assistant message: `kimi_k3_parsing.parse`'s dict.

        transformers' chat pipelines call this (see RESPONSE_TEMPLATE). Those that read
        `response_template` (5.22.2 to 5.25.0 checked) pass the prompt as `prefix` and the reply as
        this tokenizer's DecodedText, which is parsed from its ids, so exactly. `response` may be the
        generated ids (exact) or text; text that is not a DecodedText (5.0.0's pipeline cuts it out
        of a longer decode) is parsed as text, where a spelled `<|open|>`, `<|close|>` or `<|sep|>`
        cannot be told from the control token (see `parse`). A batch (2-D ids, a list of sequences
        or strings) gives a list. `prefix` is the prompt, text or ids: one ending in the think or
        response generation prompt says where the reply starts; without it `parse` guesses. `tools`
        is unused: K3 writes each argument's type. Another `schema` goes to transformers' own parser.
        """
        if schema is None:
            schema = self.response_template
        if schema != RESPONSE_TEMPLATE:
            return super().parse_response(response, schema, prefix=prefix, tools=tools)
        if hasattr(response, "tolist"):
            response = response.tolist()
        if isinstance(response, (list, tuple)) and response and not isinstance(response[0], int):
            batched_prefix = isinstance(prefix, (list, tuple)) and prefix and not isinstance(prefix[0], int)
            prefixes = prefix if batched_prefix else [prefix] * len(response)
            return [self.parse_response(item, prefix=item_prefix) for item, item_prefix in zip(response, prefixes)]
        parsing = _parsing()
        thinking = None
        if prefix is not None:
            prompt = prefix if isinstance(prefix, str) else self.decode(prefix)
            starts = {parsing.THINK_OPEN: True, parsing.RESPONSE_OPEN: False}
            thinking = next((value for end, value in starts.items() if prompt.endswith(end)), None)
        output = getattr(response, "token_ids", response)
        return parsing.parse(output, thinking=thinking, tokenizer=None if isinstance(output, str) else self)

    def get_response_parser(self, response_template=None, **kwargs):
        """transformers' streaming parser reads declarative templates only; K3 streams through StreamParser."""
        if response_template is None and self.response_template == RESPONSE_TEMPLATE:
            raise NotImplementedError(
                "Kimi K3 replies stream through kimi_k3_parsing.StreamParser(thinking=..., tokenizer=tok): "
                "feed it the generated ids"
            )
        return super().get_response_parser(response_template, **kwargs)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        padding=False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors=None,
        return_dict: bool | None = None,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict | None = None,
        **kwargs,
    ):
        """Render (and by default encode) conversations in the K3 format with `render_chat`.

        Same call as the base class; the template options of CHAT_OPTIONS go in `**kwargs` and,
        as with a Jinja template, other keyword arguments are ignored. Text comes from the Python
        renderer, which chat_template.jinja mirrors; ids are encoded segment by segment, so text
        never becomes a control token (`sanitize_control_tokens` is always in effect). A different
        `chat_template` is rendered by the base class, as text only.
        """
        if chat_template is not None and chat_template != self.chat_template:
            if tokenize:
                raise ValueError(
                    "a custom chat_template can only be rendered with tokenize=False: encoding its text would "
                    "turn control-token spellings in user text into control tokens"
                )
            return super().apply_chat_template(
                conversation,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        if documents:
            raise ValueError("Kimi K3's chat format has no documents; put them in a message instead")
        if return_assistant_tokens_mask:
            raise ValueError("return_assistant_tokens_mask is not supported by the Kimi K3 tokenizer")
        batched = bool(conversation) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        )
        conversations = [getattr(c, "messages", c) for c in (conversation if batched else [conversation])]
        schemas = (
            None if tools is None else [tool if isinstance(tool, Mapping) else get_json_schema(tool) for tool in tools]
        )
        rendered = [
            render_chat(
                [
                    {k: v for k, v in message.items() if v is not None} if isinstance(message, Mapping) else message
                    for message in messages
                ],
                schemas,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **{name: kwargs[name] for name in CHAT_OPTIONS if name in kwargs},
            )
            for messages in conversations
        ]
        if not tokenize:
            texts = [segments_text(segments) for segments in rendered]
            return texts if batched else texts[0]
        ids = [self.encode_segments(segments) for segments in rendered]
        if truncation and max_length is not None:
            ids = [row[:max_length] for row in ids]
        pad_options = {k: v for k, v in (tokenizer_kwargs or {}).items() if k in ("pad_to_multiple_of", "padding_side")}
        if batched or return_tensors is not None:
            encoded = self.pad(
                {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]},
                padding=padding,
                max_length=max_length,
                return_tensors=return_tensors,
                **pad_options,
            )
        else:
            encoded = self.pad(
                {"input_ids": ids[0], "attention_mask": [1] * len(ids[0])},
                padding=padding,
                max_length=max_length,
                **pad_options,
            )
        return_dict = _RETURN_DICT_DEFAULT if return_dict is None else return_dict
        return encoded if return_dict else encoded["input_ids"]

    def rerender_prompt(self, ids, **options) -> tuple[list[int], list[int]]:
        """A chat prompt's ids rendered with thinking on (apply_chat_template's default) turned into the ids that
        `options` (THINKING_OPTIONS, e.g. thinking=False) give, as if they had been passed to apply_chat_template;
        and the bridge: the ids that, put after the original prompt, make its reply read as this one's (an empty
        think channel when thinking turns off, else none).

        transformers' text-generation pipeline hands such options to `generate`, not to the template; the model's
        `generate` calls this. Only whole segments change (the effort message, past think channels, the generation
        prompt), and segments are encoded one by one, so the ids are exactly the re-rendered ones.
        """
        unknown = sorted(set(options) - set(THINKING_OPTIONS))
        if unknown:
            raise ValueError(f"chat option {unknown[0]!r} cannot be applied to a rendered prompt: pass it to the "
                             f"template (tokenizer_encode_kwargs=...); generate takes {', '.join(THINKING_OPTIONS)}")
        think, effort = chat_options(**options)
        ids = [int(token_id) for token_id in ids]

        def encoded(tag=None, name=None, effort=None):
            out = _Segments()
            if tag is not None:
                getattr(out, tag)(name)
            if effort is not None:
                _effort_message(out, effort)
            return self.encode_segments(out)

        def find(part, start=0):
            return next((i for i in range(start, len(ids) - len(part) + 1) if ids[i : i + len(part)] == part), None)

        think_open, think_close = encoded("open", "think"), encoded("close", "think")
        if ids[-len(think_open) :] != think_open:
            raise ValueError(
                "chat options given to generate apply to a chat prompt rendered with thinking on, ending in its "
                "generation prompt; for another prompt pass them to the template (tokenizer_encode_kwargs=...)"
            )
        messages = [encoded(effort=name) for name in THINKING_EFFORTS]
        found = [(start, len(message)) for message in messages if (start := find(message)) is not None]
        if not found:
            raise ValueError("the chat prompt has no thinking-effort message: it was not rendered with thinking on")
        start, length = min(found)
        head, body, end = ids[:start], [], len(ids) - len(think_open)
        if think:
            return head + encoded(effort=effort) + ids[start + length : end] + think_open, []
        i = start + length
        while i < end:  # past assistant turns: drop their think channels
            opened = find(think_open, i)
            if opened is None or opened >= end:
                body += ids[i:end]
                break
            body += ids[i:opened]
            i = find(think_close, opened) + len(think_close)
        response_open = encoded("open", "response")
        return head + body + response_open, think_close + response_open


# ---------------------------------------------------------------------------------------------
# Tokenizer directories
# ---------------------------------------------------------------------------------------------


def tokenizer_config(num_ranks: int) -> dict:
    """The `tokenizer_config.json` of a K3 tokenizer with `num_ranks` BPE ranks."""
    return {
        "tokenizer_class": "KimiK3Tokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi_k3.KimiK3Tokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": END_OF_MSG,
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(token_id): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, (name, special) in special_token_layout(num_ranks).items()
        },
        "chat_template": _chat_template_text(),
    }


def write_tokenizer_files(directory: str | Path, rank_file: str | Path) -> Path:
    """Make `directory` a loadable K3 tokenizer (AutoTokenizer, trust_remote_code) for `rank_file`.

    Writes tiktoken.model, tokenizer_config.json and chat_template.jinja, and copies this module
    and kimi_k3_parsing.py beside them. Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = load_rank_file(rank_file)
    if Path(rank_file).resolve() != (directory / VOCAB_FILE).resolve():
        shutil.copyfile(rank_file, directory / VOCAB_FILE)
    config = json.dumps(tokenizer_config(len(ranks)), indent=2, ensure_ascii=False) + "\n"
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")
    (directory / CHAT_TEMPLATE_FILE).write_text(_chat_template_text(), encoding="utf-8")
    here = Path(__file__).parent
    for name in (Path(__file__).name, "kimi_k3_parsing.py"):
        if (here / name).resolve() != (directory / name).resolve():
            shutil.copyfile(here / name, directory / name)
    return directory
