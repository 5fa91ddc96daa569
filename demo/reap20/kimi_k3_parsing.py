"""Split Kimi K3 output into reasoning, answer and OpenAI-style tool calls, whole or streaming.

An assistant message in K3's XTML format (SPEC §4; the channel layout SGLang's `kimi_k3`
reasoning and tool-call parsers read) is

    <|open|>message role="assistant"<|sep|>                      (the generation prompt ...)
    <|open|>think<|sep|>REASONING<|close|>think<|sep|>           (... ends here with thinking on)
    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>...
    <|close|>call<|sep|>...<|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

`parse(text)` accepts either the text generated after the prompt (it starts inside the think
channel, or inside the response channel with thinking off) or a whole message. It never raises
on model output and never drops text: anything that does not fit the format comes back in
`content` with `malformed: True` and an `error`. Output that stops inside the think channel, the
common result of a small `max_new_tokens`, is flagged `truncated_in_reasoning` with a `warning`
that says what to do. `StreamParser` gives the same result from text fed in pieces of any size,
and never emits part of a marker it might still be reading.
"""

from __future__ import annotations

import hashlib
import json
import re

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_HEAD, MESSAGE_CLOSE = f"{OPEN}message", f"{CLOSE}message{SEP}"
CALL_HEAD, CALL_CLOSE = f"{OPEN}call", f"{CLOSE}call{SEP}"
ARGUMENT_HEAD, ARGUMENT_CLOSE = f"{OPEN}argument", f"{CLOSE}argument{SEP}"
JSON_HEAD, JSON_CLOSE = f"{OPEN}json", f"{CLOSE}json{SEP}"
# Generation stops at either of these; nothing after them belongs to the message.
END_MARKERS = ("<|end_of_msg|>", "[EOT]")

RECOMMENDED_MAX_NEW_TOKENS = 32768
TRUNCATED_IN_REASONING = (
    "The output ended inside the thinking channel, before any answer: generation ran out of "
    f"max_new_tokens while the model was still reasoning. Raise max_new_tokens (at least "
    f"{RECOMMENDED_MAX_NEW_TOKENS} is recommended with thinking on), lower thinking_effort, or "
    "turn thinking off with thinking=False."
)
TRUNCATED = "The output ended before the message was closed, usually because max_new_tokens ran out: raise it."

_ATTRS_RE = re.compile(r'(?:\s+\w+="[^"]*")*\s*')
_ATTR_RE = re.compile(r'(\w+)="([^"]*)"')
_TYPES = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
# What may follow each closed part of a message (whitespace between parts is ignored).
_NEXT = {
    "after_think": ((RESPONSE_OPEN, "response"), (TOOLS_OPEN, "tools"), (MESSAGE_CLOSE, "done")),
    "after_response": ((TOOLS_OPEN, "tools"), (MESSAGE_CLOSE, "done")),
    "after_tools": ((MESSAGE_CLOSE, "done"),),
}
_CHANNEL_OPENS = ((THINK_OPEN, "think"), (RESPONSE_OPEN, "response"), (TOOLS_OPEN, "tools"))
_OPENINGS = (MESSAGE_HEAD, *dict(_CHANNEL_OPENS))


class MalformedToolCall(ValueError):
    """A tools section that does not follow the XTML call grammar (never escapes `parse`)."""


def _held_back(text: str, markers) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


def _attrs(text: str) -> dict[str, str]:
    """` key="value"...` with the template's `&`/`"` escaping undone."""
    if not _ATTRS_RE.fullmatch(text):
        raise MalformedToolCall(f"bad attributes {text!r}")
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTR_RE.findall(text)}


def _element(section: str, pos: int, head: str, close: str) -> tuple[dict[str, str], str, int]:
    """Read `head ATTRS<|sep|>BODY close` at `pos`: (attributes, body, position after it)."""
    header_end = section.find(SEP, pos)
    if header_end < 0:
        raise MalformedToolCall(f"unclosed {head}... header")
    attrs = _attrs(section[pos + len(head) : header_end])
    body_end = section.find(close, header_end)
    if body_end < 0:
        raise MalformedToolCall(f"no {close} after {section[pos:header_end + len(SEP)]!r}")
    body = section[header_end + len(SEP) : body_end]
    if ARGUMENT_HEAD in body or CALL_HEAD in body:
        raise MalformedToolCall(f"unclosed {section[pos:header_end + len(SEP)]!r}")
    return attrs, body, body_end + len(close)


def _typed(value: str, kind: str, key: str):
    if kind == "string":
        return value
    if kind not in _TYPES:
        raise MalformedToolCall(f"argument {key!r} has unknown type {kind!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise MalformedToolCall(
            f"argument {key!r} of type {kind} is not valid JSON: {value[:80]!r} ({err.msg})"
        ) from None
    if not _TYPES[kind](parsed):
        raise MalformedToolCall(f"argument {key!r} is declared {kind} but holds {value[:80]!r}")
    return parsed


def _call_id(index: int, name: str, arguments: str) -> str:
    """A stable id (the same call text always gets the same id), unique within a message."""
    return "call_" + hashlib.sha256(f"{index}\0{name}\0{arguments}".encode()).hexdigest()[:24]


def parse_tool_calls(section: str) -> list[dict]:
    """The OpenAI tool calls in the body of a tools section; MalformedToolCall if it is not one."""
    calls, pos = [], 0
    while True:
        while pos < len(section) and section[pos].isspace():
            pos += 1
        if pos == len(section):
            return calls
        if not section.startswith(CALL_HEAD, pos):
            raise MalformedToolCall(f"expected {CALL_HEAD}, found {section[pos:pos + 40]!r}")
        header_end = section.find(SEP, pos)
        if header_end < 0:
            raise MalformedToolCall("unclosed call header")
        name = _attrs(section[pos + len(CALL_HEAD) : header_end]).get("tool")
        if not name:
            raise MalformedToolCall(f"call without a tool name: {section[pos:header_end + len(SEP)]!r}")
        pos = header_end + len(SEP)
        arguments: dict = {}
        raw_json = None
        while True:
            while pos < len(section) and section[pos].isspace():
                pos += 1
            if section.startswith(CALL_CLOSE, pos):
                pos += len(CALL_CLOSE)
                break
            if section.startswith(ARGUMENT_HEAD, pos):
                attrs, value, pos = _element(section, pos, ARGUMENT_HEAD, ARGUMENT_CLOSE)
                if "key" not in attrs:
                    raise MalformedToolCall(f"argument without a key in call {name!r}")
                arguments[attrs["key"]] = _typed(value, attrs.get("type", "string"), attrs["key"])
            elif section.startswith(JSON_HEAD, pos):
                _, raw_json, pos = _element(section, pos, JSON_HEAD, JSON_CLOSE)
                try:
                    if not isinstance(json.loads(raw_json), dict):
                        raise MalformedToolCall(f"the json arguments of {name!r} are not an object")
                except json.JSONDecodeError as err:
                    raise MalformedToolCall(f"the json arguments of {name!r} are not valid JSON ({err.msg})") from None
            else:
                raise MalformedToolCall(f"unclosed call {name!r}: found {section[pos:pos + 40]!r}")
        if raw_json is not None and arguments:
            raise MalformedToolCall(f"call {name!r} has both a json block and arguments")
        text = raw_json if raw_json is not None else json.dumps(arguments, ensure_ascii=False)
        index = len(calls) + 1
        calls.append(
            {"id": _call_id(index, name, text), "type": "function", "function": {"name": name, "arguments": text}}
        )


class StreamParser:
    """Incremental parser: `feed(text)` returns what became certain, `finish()` the rest.

    Deltas are dicts with any of `reasoning_content`, `content` (strings to append) and
    `tool_calls` (whole calls, OpenAI streaming style with an `index`); a tools section is
    emitted when it closes, as content instead if it turns out malformed. `result()` after
    `finish()` is the complete message, equal to `parse(text, thinking=...)` of all the text.
    `thinking` says where generated text starts without a channel marker: inside the think
    channel (True, the generation prompt's default) or inside the response channel (False).
    """

    def __init__(self, thinking: bool = True):
        self._default = "think" if thinking else "response"
        self._buf = ""
        self._state = "start"
        self._ended = False
        self._delta: dict = {}
        self._message = {
            "role": "assistant",
            "reasoning_content": None,
            "content": "",
            "tool_calls": [],
            "finished": False,
            "truncated": False,
            "truncated_in_reasoning": False,
            "malformed": False,
            "error": None,
            "warning": None,
        }

    def feed(self, text: str) -> dict:
        """Add generated text; return the delta it settled (possibly empty)."""
        if self._ended:
            return {}
        self._buf += text
        ends = [i for i in (self._buf.find(marker) for marker in END_MARKERS) if i >= 0]
        if ends:
            self._buf = self._buf[: min(ends)]
            return self.finish()
        self._run(final=False)
        return self._take()

    def finish(self) -> dict:
        """No more text: settle everything held back and return that last delta."""
        if self._ended:
            return {}
        self._ended = True
        self._run(final=True)
        if self._state in ("think", "response", "tools", "start"):
            self._message["truncated"] = True
            self._message["warning"] = TRUNCATED_IN_REASONING if self._state == "think" else TRUNCATED
            self._message["truncated_in_reasoning"] = self._state == "think"
        self._message["finished"] = self._state == "done"
        return self._take()

    def result(self) -> dict:
        """The parsed message (call after `finish`)."""
        if not self._ended:
            raise RuntimeError("call finish() before result()")
        return {**self._message, "tool_calls": list(self._message["tool_calls"])}

    # -- internals ----------------------------------------------------------------------------

    def _take(self) -> dict:
        delta, self._delta = self._delta, {}
        return delta

    def _emit(self, key: str, text: str) -> None:
        if key == "reasoning_content" and self._message[key] is None:
            self._message[key] = ""
        if text:
            self._message[key] += text
            self._delta[key] = self._delta.get(key, "") + text

    def _malformed(self, error: str, raw: str) -> None:
        if not self._message["malformed"]:
            self._message["malformed"], self._message["error"] = True, error
        self._emit("content", raw)

    def _run(self, final: bool) -> None:
        while getattr(self, f"_{self._state}")(final):
            pass

    def _start(self, final: bool) -> bool:
        buf = self._buf
        if buf.startswith(MESSAGE_HEAD):
            end = buf.find(SEP)
            if end < 0:
                if final:
                    self._state = "raw"
                    return True
                return False
            self._buf = buf[end + len(SEP) :]
            return True
        for marker, state in _CHANNEL_OPENS:
            if buf.startswith(marker):
                self._buf, self._state = buf[len(marker) :], state
                return True
        if not final and any(marker.startswith(buf) for marker in (*_OPENINGS, *END_MARKERS)):
            return False
        self._state = self._default
        return True

    def _channel(self, final: bool, close: str, key: str, next_state: str) -> bool:
        idx = self._buf.find(close)
        if idx >= 0:
            self._emit(key, self._buf[:idx])
            self._buf, self._state = self._buf[idx + len(close) :], next_state
            return True
        text = self._buf
        if final:
            # A marker cut off by the token limit (`<|close|>think`, ...) is structure, not text.
            cut = _held_back(text, [close])
            if cut >= len(CLOSE):
                text = text[:-cut]
            self._buf = ""
            self._emit(key, text)
            return False
        hold = _held_back(text, [close, *END_MARKERS])
        self._buf = text[len(text) - hold :]
        self._emit(key, text[: len(text) - hold])
        return False

    def _think(self, final: bool) -> bool:
        self._emit("reasoning_content", "")
        return self._channel(final, THINK_CLOSE, "reasoning_content", "after_think")

    def _response(self, final: bool) -> bool:
        return self._channel(final, RESPONSE_CLOSE, "content", "after_response")

    def _between(self, final: bool) -> bool:
        options = _NEXT[self._state]
        stripped = self._buf.lstrip()
        for marker, state in options:
            if stripped.startswith(marker):
                self._buf, self._state = stripped[len(marker) :], state
                return True
        if not stripped or (
            not final and any(marker.startswith(stripped) for marker in (*dict(options), *END_MARKERS))
        ):
            return False
        # The error names no text: how much of it has arrived depends on the chunking.
        self._malformed(f"unexpected text after the {self._state.removeprefix('after_')} channel", "")
        self._state = "raw"
        return True

    _after_think = _after_response = _after_tools = _between

    def _tools(self, final: bool) -> bool:
        idx = self._buf.find(TOOLS_CLOSE)
        if idx < 0:
            if final:
                self._malformed("the tools section is not closed", TOOLS_OPEN + self._buf)
                self._buf = ""
            return False
        section, self._buf, self._state = self._buf[:idx], self._buf[idx + len(TOOLS_CLOSE) :], "after_tools"
        try:
            calls = parse_tool_calls(section)
        except MalformedToolCall as err:
            self._malformed(f"malformed tool call: {err}", TOOLS_OPEN + section + TOOLS_CLOSE)
            return True
        start = len(self._message["tool_calls"])
        self._message["tool_calls"] += calls
        self._delta.setdefault("tool_calls", []).extend({"index": start + i, **call} for i, call in enumerate(calls))
        return True

    def _done(self, final: bool) -> bool:
        if final and self._buf.strip():
            self._malformed(f"text after the end of the message: {self._buf.strip()[:40]!r}", self._buf)
            self._buf = ""
        return False

    def _raw(self, final: bool) -> bool:
        hold = 0 if final else _held_back(self._buf, END_MARKERS)
        self._emit("content", self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold :]
        return False


def _starts_in_think(text: str) -> bool:
    """Where text without a leading channel marker starts: inside think unless it shows otherwise."""
    if THINK_CLOSE in text:
        return True
    return not any(marker in text for marker in (RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE))


def parse(text: str, thinking: bool | None = None) -> dict:
    """Parse a whole output or message into an OpenAI-style assistant message plus flags.

    Keys: role, reasoning_content (None without a think channel), content, tool_calls
    (`{"id", "type": "function", "function": {"name", "arguments": JSON string}}`), finished
    (the message was closed), truncated, truncated_in_reasoning, malformed, error, warning.
    `thinking` says where text without a leading channel marker starts (see StreamParser); by
    default it is guessed from the markers the text contains.
    """
    parser = StreamParser(_starts_in_think(text) if thinking is None else thinking)
    parser.feed(text)
    parser.finish()
    return parser.result()
