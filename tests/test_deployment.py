"""deployment/: the serve scripts carry the card's flags, and smoke_chat.py talks to a live OpenAI-compatible server.

The server here is a stdlib stub on localhost, started and stopped by the test: `transformers serve` needs the
`transformers[serving]` extras (fastapi, uvicorn), which the test environments do not install, so it is not run.
"""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "deployment" / "smoke_chat.py"
FULL = {"reasoning_content": "Merge with two pointers.", "content": "def merge(a, b): ...",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "run_python", "arguments": "{\"code\": \"print(merge([1, 4], [2, 3]))\"}"}}]}
EMPTY = {"reasoning_content": "Let me think about the merge step by", "content": None, "tool_calls": []}


@pytest.fixture
def server():
    """(base URL, requests received, set the next reply) of a stub /v1/chat/completions server."""
    received, reply = [], {"message": FULL}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            data = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", **reply["message"]}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", received, lambda m: reply.update(message=m)
    finally:
        httpd.shutdown()
        httpd.server_close()


def smoke(url):
    return subprocess.run([sys.executable, str(SMOKE), url, "--timeout", "30"], capture_output=True, text=True,
                          timeout=60)


def test_smoke_chat_prints_reasoning_content_and_tool_calls(server):
    url, received, _ = server
    run = smoke(url)
    assert run.returncode == 0, run.stderr
    assert "Merge with two pointers." in run.stdout and "def merge(a, b)" in run.stdout
    assert 'run_python({"code": "print(merge([1, 4], [2, 3]))"})' in run.stdout
    path, body = received[0]
    assert path == "/v1/chat/completions" and body["tools"][0]["function"]["name"] == "run_python"
    assert body["messages"][0]["role"] == "user"


def test_smoke_chat_fails_on_an_empty_answer(server):
    url, _, set_reply = server
    set_reply(EMPTY)
    run = smoke(url + "/v1")
    assert run.returncode == 1
    assert "empty answer" in run.stderr and "raise --max-tokens" in run.stderr


def test_smoke_chat_names_an_unreachable_server():
    run = smoke("http://127.0.0.1:9")
    assert run.returncode != 0 and "127.0.0.1:9/v1/chat/completions" in run.stderr


@pytest.mark.parametrize("script, flags", [
    ("serve_sglang.sh", ["--tp-size 8", "--mem-fraction-static 0.94", "--context-length 32768",
                         "--reasoning-parser kimi_k3", "--tool-call-parser kimi_k3", "--moe-runner-backend marlin",
                         "--trust-remote-code", "SM120"]),
    ("serve_vllm.sh", ["--tensor-parallel-size 8", "--gpu-memory-utilization 0.94", "--max-model-len 32768",
                       "--reasoning-parser kimi_k3", "--tool-call-parser kimi_k3", "--moe-backend marlin",
                       "--trust-remote-code", "SM120"]),
])
def test_serve_scripts_carry_the_cards_flags(script, flags):
    path = ROOT / "deployment" / script
    text = path.read_text()
    assert all(flag in text for flag in flags), [f for f in flags if f not in text]
    assert "only uniform prunes serve" in text.lower()
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
