#!/usr/bin/env python3
"""One OpenAI-compatible chat request with a tool against a running server; prints the reasoning, the content and
the tool calls, and exits non-zero when the answer is empty (no content and no tool call).

    python deployment/smoke_chat.py http://localhost:30000 [--model NAME] [--max-tokens 4096]

Standard library only (urllib), so it runs on a bare serving node.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request

TOOL = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python snippet and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
PROMPT = "Write a Python function that merges two sorted lists, then run it on [1, 4] and [2, 3] with the tool."


def chat(url, model, max_tokens, timeout):
    """The server's reply to one chat request with TOOL offered, as a dict (an error names the URL and status)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "tools": [TOOL],
            "max_tokens": max_tokens, "temperature": 1.0, "top_p": 0.95}
    endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1") + "/chat/completions"
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"smoke_chat: {endpoint}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}")
    except (urllib.error.URLError, TimeoutError, ValueError) as e:
        raise SystemExit(f"smoke_chat: {endpoint}: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="server base URL, e.g. http://localhost:30000")
    ap.add_argument("--model", default="default", help="model name the server expects (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the reply")
    args = ap.parse_args(argv)
    reply = chat(args.url, args.model, args.max_tokens, args.timeout)
    try:
        choice = reply["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        print(f"smoke_chat: no choices[0].message in the reply: {json.dumps(reply)[:500]}", file=sys.stderr)
        return 2
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    print(f"finish_reason: {choice.get('finish_reason')}")
    print(f"reasoning ({len(reasoning)} chars):\n{reasoning}\n")
    print(f"content ({len(content)} chars):\n{content}\n")
    print(f"tool calls ({len(calls)}):")
    for call in calls:
        fn = call.get("function", {})
        print(f"  {fn.get('name')}({fn.get('arguments')})")
    if not content.strip() and not calls:
        hint = " (the reply ended inside the reasoning: raise --max-tokens)" if reasoning else ""
        print(f"smoke_chat: empty answer: no content and no tool call{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
