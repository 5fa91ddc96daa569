"""Split Kimi K3 output into reasoning, answer and OpenAI-style tool calls, whole or streaming.

An assistant message in K3's XTML format (the chat template's; the channel layout SGLang's `kimi_k3`
reasoning and tool-call parsers read) is

    <|open|>message role="assistant"<|sep|>                      (the generation prompt ...)
    <|open|>think<|sep|>REASONING<|close|>think<|sep|>           (... ends here with thinking on)
    <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>...
    <|close|>call<|sep|>...<|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

The structure is carried by control tokens (`<|open|>`, `<|close|>`, `<|sep|>`, and the
`<|end_of_msg|>` / `[EOT]` that stop generation). Text the model writes can spell the same
strings with ordinary tokens, so only the token ids tell structure from text: parse the generated
ids, `parse(ids, tokenizer=tok)`, or stream them into `StreamParser(tokenizer=tok)`. `parse(text)`
is for callers that only have decoded text, which cannot tell the two apart.

Either way the input may be what was generated after the prompt (it starts inside the think
channel, or inside the response channel with thinking off) or a whole message. Parsing never
raises on model output and never drops text: anything that does not fit the format comes back in
`content` with `malformed: True` and an `error`. Output that stops inside the think channel, the
common result of a small `max_new_tokens`, is flagged `truncated_in_reasoning` with a `warning`
that says what to do. `StreamParser` gives the same result from input fed in pieces of any size,
in time linear in its length, and never emits part of a marker it might still be reading.

Markers the model skips are read as meant: a think channel that runs into `<|open|>response` or
`<|open|>tools` without `<|close|>think` still gives its answer and calls; one closed as the response
or the message (the model answered without thinking) is the content; a tools section cut off after
complete calls gives them, flagged truncated. Tool-call `arguments` are always strict JSON (no NaN
or Infinity); a call whose values are not, or whose tool name is blank or multi-line, is malformed.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import re

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
# Generation stops at either of these, so only one at the very end ends the message.
END_MARKERS = ("<|end_of_msg|>", "[EOT]")

RECOMMENDED_MAX_NEW_TOKENS = 32768
TRUNCATED_IN_REASONING = (
    "The output ended inside the thinking channel, before any answer: generation ran out of "
    f"max_new_tokens while the model was still reasoning. Raise max_new_tokens (at least "
    f"{RECOMMENDED_MAX_NEW_TOKENS} is recommended with thinking on), lower thinking_effort, or "
    "turn thinking off: pipe(messages, thinking=False) or apply_chat_template(..., thinking=False)."
)
TRUNCATED = "The output ended before the message was closed, usually because max_new_tokens ran out: raise it."

_ATTRS_RE = re.compile(r'(?:\s+\w+="[^"]*")*\s*')
_ATTR_RE = re.compile(r'(\w+)="([^"]*)"')
_TYPES = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),  # JSON Schema's, as SGLang reads it
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


class MalformedToolCall(ValueError):
    """A tools section that does not follow the XTML call grammar (never escapes `parse`)."""


class _Marker:
    """A control token in the item stream the parser reads; text items are plain `str`."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


M_OPEN, M_CLOSE, M_SEP = _Marker(OPEN), _Marker(CLOSE), _Marker(SEP)
M_END = _Marker("")  # the message ended: generation stopped at <|end_of_msg|> or [EOT]
_STRUCTURE = {OPEN: M_OPEN, CLOSE: M_CLOSE, SEP: M_SEP}

# What may follow each closed part of a message (whitespace between parts is ignored).
_NEXT = {
    "after_think": ((M_OPEN, "response", "response"), (M_OPEN, "tools", "tools"), (M_CLOSE, "message", "done")),
    "after_response": ((M_OPEN, "tools", "tools"), (M_CLOSE, "message", "done")),
    "after_tools": ((M_CLOSE, "message", "done"),),
}
_CHANNEL_OPENS = ((M_OPEN, "think", "think"), (M_OPEN, "response", "response"), (M_OPEN, "tools", "tools"))
# What ends each channel. Besides its own closing marker, the model may skip a marker: a think channel
# that opens the response or tools goes on there; one that closes the response or the message was the
# answer all along (the model answered without thinking). An answer may run straight into tools or the end.
_CHANNEL_ENDS = {
    "think": (
        (M_CLOSE, "think", "after_think"),
        (M_OPEN, "response", "response"),
        (M_OPEN, "tools", "tools"),
        (M_CLOSE, "response", "after_response"),
        (M_CLOSE, "message", "done"),
    ),
    "response": ((M_CLOSE, "response", "after_response"), (M_OPEN, "tools", "tools"), (M_CLOSE, "message", "done")),
}


def _text(items) -> str:
    """Items written back as text (control tokens as their strings)."""
    return "".join(item if isinstance(item, str) else item.text for item in items)


def _merged(items: list) -> list:
    """`items` with each run of adjacent text items joined into one."""
    out, run = [], []
    for item in items:
        if isinstance(item, str):
            run.append(item)
            continue
        if run:
            out.append("".join(run))
            run = []
        out.append(item)
    if run:
        out.append("".join(run))
    return out


# -- lexers: input -> items -------------------------------------------------------------------


def _prefixes(words) -> str:
    """A regex (a trie, so a mismatch fails at once) for a non-empty prefix of one of `words`."""
    branches = []
    for first in sorted({word[0] for word in words}):
        rest = [word[1:] for word in words if word[0] == first and len(word) > 1]
        branches.append(re.escape(first) + (f"(?:{_prefixes(rest)})?" if rest else ""))
    return "|".join(branches)


_MARKERS = (OPEN, CLOSE, SEP, *END_MARKERS)
_MARKER_RE = re.compile("|".join(map(re.escape, _MARKERS)))
_PARTIAL_MARKER_RE = re.compile(f"(?:{_prefixes(_MARKERS)})\\Z")  # the start of one at the very end
_LONGEST_MARKER = max(map(len, _MARKERS))
# After an end marker: what decoding a finished batch row without skip_special_tokens leaves.
_TRAILING = (*END_MARKERS, "[PAD]")
_TRAILING_RE = re.compile(r"(?:\s|" + "|".join(map(re.escape, _TRAILING)) + ")*")
_PARTIAL_TRAILING_RE = re.compile(f"(?:{_prefixes(_TRAILING)})\\Z")


class _TextLexer:
    """Decoded text -> items: every spelling of a control token counts as one (text cannot tell).

    An end marker ends the message only when nothing but whitespace, end markers and `[PAD]`
    follows it (generation stops there); one inside the text is text.
    """

    def __init__(self):
        self._tail = ""  # the end of the input so far that may be the start of a marker
        self._ending: list[str] = []  # an end marker and the trailing text after it so far

    def feed(self, text: str) -> list:
        if not isinstance(text, str):
            raise TypeError("expected text; to parse token ids give StreamParser the tokenizer")
        return self._lex(self._tail + text, final=False)

    def finish(self) -> list:
        return self._lex(self._tail, final=True)

    def text_of(self, chunk) -> str | None:
        """`chunk` when it is all text (no marker, nor the start of one at its end), else None: StreamParser's
        fast path."""
        if type(chunk) is not str or self._tail or self._ending:
            return None
        if "<" not in chunk and "[" not in chunk:  # every marker starts with one of them: most chunks end here
            return chunk
        if _MARKER_RE.search(chunk):
            return None
        return None if _PARTIAL_MARKER_RE.search(chunk, max(0, len(chunk) - _LONGEST_MARKER)) else chunk

    def _lex(self, buf: str, final: bool) -> list:
        out, pos, literal_until = [], 0, 0
        if self._ending:
            end = _TRAILING_RE.match(buf).end()
            if end == len(buf) or (not final and _PARTIAL_TRAILING_RE.match(buf, end)):
                self._ending.append(buf[:end])
                self._tail = buf[end:]
                return [M_END] if final else []
            out.append("".join(self._ending))
            self._ending, literal_until = [], end
        for match in _MARKER_RE.finditer(buf):
            if match.start() > pos:
                out.append(buf[pos : match.start()])
            marker, pos = match.group(), match.end()
            if marker in _STRUCTURE:
                out.append(_STRUCTURE[marker])
                continue
            if match.start() >= literal_until:
                end = _TRAILING_RE.match(buf, pos).end()
                if end == len(buf) or (not final and _PARTIAL_TRAILING_RE.match(buf, end)):
                    self._ending, self._tail = [buf[match.start() : end]], buf[end:]
                    return [*out, M_END] if final else out
                literal_until = end
            out.append(marker)
        partial = None if final else _PARTIAL_MARKER_RE.search(buf, max(pos, len(buf) - _LONGEST_MARKER))
        end = partial.start() if partial else len(buf)
        if pos < end:
            out.append(buf[pos:end])
        self._tail = buf[end:]
        return out


def _as_ids(ids) -> list[int]:
    """Token ids given as an int, a sequence of ints or a 1-D tensor / array."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, int) for i in ids):
        raise TypeError("expected token ids (an int, a list of ints or a 1-D tensor); parse text with tokenizer=None")
    return list(ids)


class _IdLexer:
    """Token ids -> items: only the control token ids are structure; every other id is text.

    Text is decoded as `skip_special_tokens=True` decodes it, each run between control ids on its
    own. The run's bytes are decoded incrementally (Python's UTF-8 decoder with final=False), which
    holds back the bytes of a character that is not complete yet and replaces invalid bytes exactly as
    decoding all of them at once does, so any chunking gives the same text, U+FFFD included.
    """

    def __init__(self, tokenizer):
        self._controls = {}
        for marker, item in ((OPEN, M_OPEN), (CLOSE, M_CLOSE), (SEP, M_SEP), *((m, M_END) for m in END_MARKERS)):
            token_id = tokenizer.convert_tokens_to_ids(marker)
            if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != marker:
                raise ValueError(f"the tokenizer has no {marker} token: it is not a Kimi K3 tokenizer")
            self._controls[token_id] = item
        if not callable(getattr(tokenizer, "decode_bytes", None)):
            raise ValueError("the tokenizer has no decode_bytes: it is not a Kimi K3 tokenizer")
        self._tokenizer = tokenizer
        self._pending = b""  # the start of a character whose remaining bytes have not arrived
        self._token_bytes: dict[int, bytes] = {}  # id -> its bytes, for text fed one id at a time
        self._ended = False

    def _utf8(self, data: bytes, final: bool) -> str:
        if self._pending:
            data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def _bytes_of(self, token_id: int) -> bytes:
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = self._tokenizer.decode_bytes([token_id], skip_special_tokens=True)
        return data

    def text_of(self, chunk) -> str | None:
        """The text ordinary ids add (possibly ""), or None if the chunk needs `feed`: StreamParser's fast path."""
        if self._ended:
            return None
        if type(chunk) is list and len(chunk) == 1:
            chunk = chunk[0]
        if type(chunk) is int:  # one id a call, the usual stream: inlined, it is most of the parser's time
            if chunk in self._controls:
                return None
            data = self._token_bytes.get(chunk)
            if data is None:
                data = self._bytes_of(chunk)
            if self._pending:
                data = self._pending + data
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._pending = data[used:]
            return text
        if type(chunk) is not list or not all(type(i) is int for i in chunk):
            return None
        if not self._controls.keys().isdisjoint(chunk):
            return None
        return self._utf8(b"".join([self._bytes_of(token_id) for token_id in chunk]), False)

    def _flush(self, out: list, ids: list[int], final: bool) -> None:
        text = self._utf8(self._tokenizer.decode_bytes(ids, skip_special_tokens=True) if ids else b"", final)
        if text:
            out.append(text)

    def feed(self, ids) -> list:
        out, start = [], 0
        if self._ended:
            return out
        ids = _as_ids(ids)
        for i, token_id in enumerate(ids):
            item = self._controls.get(token_id)
            if item is None:
                continue
            self._flush(out, ids[start:i], final=True)
            out.append(item)
            start = i + 1
            if item is M_END:
                self._ended = True
                return out
        self._flush(out, ids[start:], final=False)
        return out

    def finish(self) -> list:
        out: list = []
        if not self._ended:
            self._flush(out, [], final=True)
        return out


# -- tool calls ---------------------------------------------------------------------------------


def _attrs(text: str) -> dict[str, str]:
    """` key="value"...` with the template's `&`/`"` escaping undone."""
    if not _ATTRS_RE.fullmatch(text):
        raise MalformedToolCall(f"bad attributes {text!r}")
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTR_RE.findall(text)}


def _opens(items: list, i: int, name: str) -> bool:
    """Does `<|open|>name...` start at items[i]?"""
    return items[i] is M_OPEN and i + 1 < len(items) and isinstance(items[i + 1], str) and items[i + 1].startswith(name)


def _closes(items: list, i: int, name: str) -> bool:
    """Does `<|close|>name<|sep|>` start at items[i]?"""
    return items[i] is M_CLOSE and i + 2 < len(items) and items[i + 1] == name and items[i + 2] is M_SEP


def _header(items: list, i: int, name: str) -> tuple[dict[str, str], int]:
    """The attributes of the `<|open|>name ATTRS<|sep|>` at items[i], and the index after it."""
    if i + 2 >= len(items) or items[i + 2] is not M_SEP:
        raise MalformedToolCall(f"unclosed {name} header {_text(items[i : i + 2])[:80]!r}")
    return _attrs(items[i + 1][len(name) :]), i + 3


def _element(items: list, i: int, name: str) -> tuple[dict[str, str], str, int]:
    """Read `<|open|>name ATTRS<|sep|>BODY<|close|>name<|sep|>` at items[i]: (attributes, body, index after)."""
    attrs, start = _header(items, i, name)
    j = start
    while j < len(items) and not _closes(items, j, name):
        if _opens(items, j, "argument") or _opens(items, j, "call"):
            raise MalformedToolCall(f"unclosed {_text(items[i : i + 3])!r}")
        j += 1
    if j == len(items):
        raise MalformedToolCall(f"no {CLOSE}{name}{SEP} after {_text(items[i : i + 3])!r}")
    return attrs, _text(items[start:j]), j + 3


def _no_constant(word: str):
    raise MalformedToolCall(f"{word} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise MalformedToolCall(f"{text[:40]} is past the range of a JSON number")
    return number


def _json(value: str, what: str):
    """`value` read as strict JSON (no NaN or Infinity, no number that overflows to one); MalformedToolCall
    when it cannot be, so that the arguments handed on are always JSON that any reader takes."""
    try:
        return json.loads(value, parse_constant=_no_constant, parse_float=_finite)
    except MalformedToolCall as err:
        raise MalformedToolCall(f"{what}: {err}") from None
    except json.JSONDecodeError as err:
        raise MalformedToolCall(f"{what} is not valid JSON: {value[:80]!r} ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # past Python's int-digit limit or its recursion limit
        raise MalformedToolCall(f"{what} cannot be read: {str(err)[:120]}") from None


def _typed(value: str, kind: str, key: str):
    if kind == "string":
        return value
    if kind not in _TYPES:
        raise MalformedToolCall(f"argument {key!r} has unknown type {kind!r}")
    parsed = _json(value, f"argument {key!r} of type {kind}")
    if not _TYPES[kind](parsed):
        raise MalformedToolCall(f"argument {key!r} is declared {kind} but holds {value[:80]!r}")
    return parsed


def _call_id(index: int, name: str, arguments: str) -> str:
    """A stable id (the same call text always gets the same id), unique within a message."""
    return "call_" + hashlib.sha256(f"{index}\0{name}\0{arguments}".encode()).hexdigest()[:24]


def _skip_space(items: list, i: int) -> int:
    while i < len(items) and isinstance(items[i], str) and not items[i].strip():
        i += 1
    return i


def _parse_calls(items: list) -> list[dict]:
    """The OpenAI tool calls in the items of a tools section body; MalformedToolCall if it is not one."""
    items = _merged(items)
    calls, i = [], 0
    while True:
        i = _skip_space(items, i)
        if i == len(items):
            return calls
        if not _opens(items, i, "call"):
            raise MalformedToolCall(f"expected {OPEN}call, found {_text(items[i : i + 3])[:40]!r}")
        attrs, i = _header(items, i, "call")
        name = attrs.get("tool")
        if not name:
            raise MalformedToolCall(f"call without a tool name: {_text(items[i - 3 : i])!r}")
        if not name.strip() or not name.isprintable():
            raise MalformedToolCall(f"blank or multi-line tool name {name[:80]!r}")
        arguments: dict = {}
        raw_json = None
        while True:
            i = _skip_space(items, i)
            if i < len(items) and _closes(items, i, "call"):
                i += 3
                break
            if i < len(items) and _opens(items, i, "argument"):
                attrs, value, i = _element(items, i, "argument")
                if "key" not in attrs:
                    raise MalformedToolCall(f"argument without a key in call {name!r}")
                arguments[attrs["key"]] = _typed(value, attrs.get("type", "string"), attrs["key"])
            elif i < len(items) and _opens(items, i, "json"):
                _, raw_json, i = _element(items, i, "json")
                if not isinstance(_json(raw_json, f"the json arguments of {name!r}"), dict):
                    raise MalformedToolCall(f"the json arguments of {name!r} are not an object")
            else:
                raise MalformedToolCall(f"unclosed call {name!r}: found {_text(items[i : i + 3])[:40]!r}")
        if raw_json is not None and arguments:
            raise MalformedToolCall(f"call {name!r} has both a json block and arguments")
        try:
            text = raw_json if raw_json is not None else json.dumps(arguments, ensure_ascii=False)
        except RecursionError:
            raise MalformedToolCall(f"the arguments of {name!r} nest too deeply to write back") from None
        index = len(calls) + 1
        calls.append(
            {"id": _call_id(index, name, text), "type": "function", "function": {"name": name, "arguments": text}}
        )


def parse_tool_calls(section: str) -> list[dict]:
    """The OpenAI tool calls in the text of a tools section body; MalformedToolCall if it is not one."""
    lexer = _TextLexer()
    return _parse_calls([item for item in lexer.feed(section) + lexer.finish() if item is not M_END])


# -- the parser ---------------------------------------------------------------------------------


def _match(held: list, options) -> tuple[str, str | None]:
    """Does `held` start with `MARKER name<|sep|>` of one of `options` (marker, name, state)?

    ("yes", state), ("maybe", None) while the items so far could still become one, or ("no", None).
    """
    first = held[0]
    if not any(first is marker for marker, _, _ in options):
        return "no", None
    if len(held) == 1:
        return "maybe", None
    tag = held[1]
    if not isinstance(tag, str):
        return "no", None
    names = [(name, state) for marker, name, state in options if marker is first]
    if len(held) == 2:
        return ("maybe", None) if any(name.startswith(tag) for name, _ in names) else ("no", None)
    if held[2] is M_SEP:
        for name, state in names:
            if tag == name:
                return "yes", state
    return "no", None


# The message key each text channel writes.
_CHANNEL_KEYS = {"think": "reasoning_content", "response": "content"}
# How much text of a tools section StreamParser gathers before lexing it.
_TOOLS_BATCH = 1 << 14


class StreamParser:
    """Incremental parser: `feed(chunk)` returns what became certain, `finish()` the rest.

    With `tokenizer` given, chunks are generated token ids (an int, a list or a 1-D tensor) and
    structure comes only from the control token ids; without it chunks are decoded text, in which
    text that spells a control token cannot be told from one (see `parse`).

    Deltas are dicts with any of `reasoning_content`, `content` (strings to append) and
    `tool_calls` (whole calls, OpenAI streaming style with an `index`); a tools section is
    emitted when it closes, as content instead if it turns out malformed. `result()` after
    `finish()` (or after the end token) is the complete message, equal to `parse` of all the input.
    `thinking` says where generated output starts without a channel marker: inside the think
    channel (True, the generation prompt's default) or inside the response channel (False).
    """

    def __init__(self, thinking: bool = True, tokenizer=None):
        self._lexer = _TextLexer() if tokenizer is None else _IdLexer(tokenizer)
        self._by_id = tokenizer is not None
        self._default = "think" if thinking else "response"
        self._state = "start"
        self._held: list = []  # items read ahead to tell a marker from text (a few)
        self._space: list[str] = []  # whitespace between two parts, content if no part follows
        self._section: list = []  # the items of an open message header or tools section
        self._deferred: list[str] = []  # text of a tools section not lexed yet (see feed)
        self._deferred_size = 0
        self._probe = ""  # the end of that text, to see a closing marker split over chunks
        self._ended = False
        # Text is kept as lists of pieces and joined when asked for: appending to a string copies it,
        # which made a long channel quadratic.
        self._text: dict[str, list[str]] = {"reasoning_content": [], "content": []}
        self._delta: dict[str, list] = {}
        self._handlers = {
            "start": self._start,
            "header": self._header,
            "think": self._think,
            "response": self._response,
            "after_think": self._between,
            "after_response": self._between,
            "after_tools": self._between,
            "tools": self._tools,
            "done": self._done,
            "raw": self._raw,
        }
        self._message = {
            "role": "assistant",
            "reasoning_content": None,  # "" once a think channel opens; the text is in self._text
            "content": "",
            "tool_calls": [],
            "finished": False,
            "truncated": False,
            "truncated_in_reasoning": False,
            "malformed": False,
            "error": None,
            "warning": None,
        }

    def feed(self, chunk) -> dict:
        """Add generated text (or ids, with a tokenizer); return the delta it settled (possibly empty)."""
        if self._ended:
            return {}
        kind = type(chunk)
        if kind is not int and kind is not str and kind is not list and hasattr(chunk, "tolist"):
            chunk = chunk.tolist()
        if not self._held and (self._state in _CHANNEL_KEYS or (self._by_id and self._state == "tools")):
            # Text alone, the usual chunk while generating: no item stream needed.
            text = self._lexer.text_of(chunk)
            if text is not None:
                if not text:
                    return {}
                if self._state == "tools":
                    self._section.append(text)
                    return {}
                key = _CHANNEL_KEYS[self._state]
                self._text[key].append(text)
                return {key: text}
        if self._state == "tools" and not self._held and isinstance(self._lexer, _TextLexer) and isinstance(chunk, str):
            # Inside a tools section nothing settles before it closes: lex many chunks in one pass.
            window = (self._probe if self._deferred else self._lexer._tail) + chunk
            if TOOLS_CLOSE not in window and self._deferred_size + len(chunk) < _TOOLS_BATCH:
                self._deferred.append(chunk)
                self._deferred_size += len(chunk)
                self._probe = window[1 - len(TOOLS_CLOSE) :]
                return {}
            chunk = "".join((*self._deferred, chunk))
            self._deferred, self._deferred_size = [], 0
        return self._process(self._lexer.feed(chunk), final=False)

    def finish(self) -> dict:
        """No more input: settle everything held back and return that last delta."""
        if self._ended:
            return {}
        items = self._lexer.feed("".join(self._deferred)) if self._deferred else []
        return self._process(items + self._lexer.finish(), final=True)

    def result(self) -> dict:
        """The parsed message (call after `finish`)."""
        if not self._ended:
            raise RuntimeError("call finish() before result()")
        reasoning = self._message["reasoning_content"]
        return {
            **self._message,
            "reasoning_content": None if reasoning is None else "".join(self._text["reasoning_content"]),
            "content": "".join(self._text["content"]),
            "tool_calls": list(self._message["tool_calls"]),
        }

    # -- internals ----------------------------------------------------------------------------

    def _process(self, items: list, final: bool) -> dict:
        held = self._held
        for item in items:
            if item is M_END:
                final = True
                break
            if not held and self._state == "tools" and isinstance(item, str):
                self._section.append(item)  # the bulk of a tools section: nothing to decide yet
                continue
            if held and isinstance(item, str) and isinstance(held[-1], str):
                held[-1] += item
            else:
                held.append(item)
            while held and self._handlers[self._state](False):
                pass
        if final:
            self._close()
        delta = {key: value if key == "tool_calls" else "".join(value) for key, value in self._delta.items()}
        self._delta = {}
        return delta

    def _close(self) -> None:
        self._ended = True
        while self._held and self._handlers[self._state](True):
            pass
        if self._state == "start":
            self._enter(self._default)
        elif self._state == "header":
            self._emit("content", OPEN + _text(self._section))
            self._state = "raw"
        elif self._state == "tools":
            self._end_tools(closed=False)
        if self._state in ("think", "response", "tools"):
            self._message["truncated"] = True
            self._message["warning"] = TRUNCATED_IN_REASONING if self._state == "think" else TRUNCATED
            self._message["truncated_in_reasoning"] = self._state == "think"
        self._message["finished"] = self._state == "done"

    def _enter(self, state: str) -> None:
        self._state = state
        if state == "think" and self._message["reasoning_content"] is None:
            self._message["reasoning_content"] = ""

    def _emit(self, key: str, text: str) -> None:
        if text:
            self._text[key].append(text)
            self._delta.setdefault(key, []).append(text)

    def _think_was_the_answer(self) -> None:
        """A think channel closed as the response or the message: what it held is the content.

        Its text has already streamed as reasoning; it streams again as content, and the result has no
        reasoning, as `parse` of the whole output gives.
        """
        text = "".join(self._text["reasoning_content"])
        self._text["reasoning_content"] = []
        self._message["reasoning_content"] = None
        self._emit("content", text)

    def _malformed(self, error: str, raw: str) -> None:
        if not self._message["malformed"]:
            self._message["malformed"], self._message["error"] = True, error
        self._emit("content", raw)

    # Each handler reads self._held[0:] in its state; it returns True when it consumed something
    # and may go on, False when it must wait for more items (never when `final`).

    def _start(self, final: bool) -> bool:
        held = self._held
        if held[0] is M_OPEN and len(held) > 1 and isinstance(held[1], str):
            if held[1].startswith("message"):
                self._section = [held[1]]
                del held[:2]
                self._state = "header"
                return True
            if len(held) == 2 and "message".startswith(held[1]) and not final:
                return False
        verdict, state = _match(held, _CHANNEL_OPENS)
        if verdict == "yes":
            del held[:3]
            self._enter(state)
            return True
        if verdict == "maybe" and not final:
            return False
        self._enter(self._default)
        return True

    def _header(self, final: bool) -> bool:
        item = self._held.pop(0)
        if item is M_SEP:
            self._section = []
            self._state = "start"
        else:
            self._section.append(item)
        return True

    def _channel(self, final: bool, name: str, key: str) -> bool:
        held = self._held
        if isinstance(held[0], str) or held[0] is M_SEP:
            item = held.pop(0)
            self._emit(key, item if isinstance(item, str) else item.text)
            return True
        verdict, state = _match(held, _CHANNEL_ENDS[name])
        if verdict == "yes":
            if name == "think" and state in ("after_response", "done"):
                self._think_was_the_answer()
            del held[:3]
            self._state = state
            return True
        if verdict == "maybe":
            if final:  # a marker cut off by the token limit is structure, not text
                held.clear()
            return False
        self._emit(key, held.pop(0).text)
        return True

    def _think(self, final: bool) -> bool:
        return self._channel(final, "think", "reasoning_content")

    def _response(self, final: bool) -> bool:
        return self._channel(final, "response", "content")

    def _between(self, final: bool) -> bool:
        held = self._held
        if isinstance(held[0], str):
            rest = held[0].lstrip()
            self._space.append(held[0][: len(held[0]) - len(rest)])
            if not rest:
                held.pop(0)
                return True
            held[0] = rest
        verdict, state = _match(held, _NEXT[self._state])
        if verdict == "yes":
            del held[:3]
            self._space = []
            self._state = state
            return True
        if verdict == "maybe" and not final:
            return False
        # The error names no text: how much of it has arrived depends on the chunking.
        self._malformed(f"unexpected text after the {self._state.removeprefix('after_')} channel", "")
        self._state = "raw"
        self._emit("content", "".join(self._space))
        self._space = []
        return True

    def _tools(self, final: bool) -> bool:
        held = self._held
        if held[0] is not M_CLOSE:
            self._section.append(held.pop(0))
            return True
        verdict, _ = _match(held, ((M_CLOSE, "tools", "after_tools"),))
        if verdict == "maybe":
            if final:  # a closing marker cut off by the token limit is structure, not text
                held.clear()
            return False
        if verdict != "yes":
            self._section.append(held.pop(0))
            return True
        del held[:3]
        self._end_tools(closed=True)
        self._state = "after_tools"
        return True

    def _end_tools(self, closed: bool) -> None:
        """Emit the calls of the tools section read so far, or the section as malformed content.

        A section that was never closed (generation stopped after a call) still gives its calls when
        it holds nothing but complete ones; `_close` flags the message truncated.
        """
        section, self._section = self._section, []
        try:
            calls = _parse_calls(section)
            if not closed and not calls:
                raise MalformedToolCall("no complete call")
        except MalformedToolCall as err:
            if closed:
                self._malformed(f"malformed tool call: {err}", TOOLS_OPEN + _text(section) + TOOLS_CLOSE)
            else:
                self._malformed(f"the tools section is not closed: {err}", TOOLS_OPEN + _text(section))
            return
        start = len(self._message["tool_calls"])
        self._message["tool_calls"] += calls
        self._delta.setdefault("tool_calls", []).extend({"index": start + i, **call} for i, call in enumerate(calls))

    def _done(self, final: bool) -> bool:
        held = self._held
        if isinstance(held[0], str) and not held[0].strip():
            self._space.append(held.pop(0))
            return True
        self._malformed("text after the end of the message", "".join(self._space))
        self._space = []
        self._state = "raw"
        return True

    def _raw(self, final: bool) -> bool:
        self._emit("content", _text(self._held))
        self._held.clear()
        return False


def _starts_in_think(items: list) -> bool:
    """Where output without a leading channel marker starts: inside think unless it shows otherwise."""
    tags = {
        (items[i], items[i + 1])
        for i in range(len(items) - 2)
        if isinstance(items[i], _Marker) and isinstance(items[i + 1], str) and items[i + 2] is M_SEP
    }
    if (M_CLOSE, "think") in tags:
        return True
    return not tags & {(M_CLOSE, "response"), (M_OPEN, "tools"), (M_CLOSE, "message")}


def parse(output, thinking: bool | None = None, tokenizer=None) -> dict:
    """Parse a whole output or message into an OpenAI-style assistant message plus flags.

    `output` is the generated token ids with `tokenizer` given (the reliable way: structure comes
    only from control token ids), else text. Text-only parsing cannot tell a control token from
    text that spells it (decoding, even with skip_special_tokens=True, writes `<|open|>`,
    `<|close|>` and `<|sep|>` as the same strings): a reply that merely writes
    `<|open|>call tool="x"<|sep|>...` reads as a tool call. Nor can it tell a real end token from
    a written one, so in text `<|end_of_msg|>` or `[EOT]` ends the message only at the end
    (followed by nothing but whitespace, end tokens and `[PAD]`).

    Keys: role, reasoning_content (None without a think channel), content, tool_calls
    (`{"id", "type": "function", "function": {"name", "arguments": JSON string}}`), finished
    (the message was closed), truncated, truncated_in_reasoning, malformed, error, warning.
    `thinking` says where output without a leading channel marker starts (see StreamParser); by
    default it is guessed from the markers the output contains.
    """
    if tokenizer is None and not isinstance(output, str):
        raise TypeError("parse() of token ids needs their tokenizer: parse(ids, tokenizer=tok)")
    lexer = _TextLexer() if tokenizer is None else _IdLexer(tokenizer)
    items = _merged(lexer.feed(output) + lexer.finish())
    parser = StreamParser(_starts_in_think(items) if thinking is None else thinking)
    parser._process(items, final=True)
    return parser.result()
