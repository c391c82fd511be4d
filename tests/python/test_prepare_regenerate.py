"""`hslake prepare --regenerate` against a real OpenAI-compatible server (`transformers serve` with
SmolLM2 on CPU, bound to 127.0.0.1) behind a small proxy of this test that logs every request and
injects errors: answers land, failing requests are retried and then reported per conversation, and
a killed and restarted run asks nothing it had already answered."""
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from capture_util import hslake_bin
from prepare_util import SMOLLM2, read_jsonl, write_jsonl


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assert (SMOLLM2 / "model.safetensors").exists(), f"{SMOLLM2} is missing: run scripts/setup.sh"
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve",
                             str(SMOLLM2), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 180)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


class Proxy:
    """Forwards to the server; logs each chat request; 500 for prompts containing FAIL, one 503 for
    each prompt containing FLAKY; `delay` seconds before forwarding."""

    def __init__(self, upstream):
        self.upstream, self.requests, self.delay, self.flaked = upstream, [], 0.0, set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def forward(self, body=None):
                req = urllib.request.Request(proxy.upstream + self.path, data=body, method=self.command,
                                             headers={"content-type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        self.reply(r.status, r.read())
                except urllib.error.HTTPError as e:
                    self.reply(e.code, e.read())

            def do_GET(self):
                self.forward()

            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                messages = json.loads(body)["messages"]
                proxy.requests.append(messages)
                last = messages[-1]["content"]
                if "FAIL" in last:
                    return self.reply(500, b'{"error": "injected failure"}')
                if "FLAKY" in last and last not in proxy.flaked:
                    proxy.flaked.add(last)
                    return self.reply(503, b'{"error": "injected overload"}')
                time.sleep(proxy.delay)
                self.forward(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def proxy(server):
    p = Proxy(server)
    yield p
    p.close()


def regen_cmd(inp, out, endpoint, *extra):
    return [hslake_bin(), "prepare", "--model", str(SMOLLM2), "--input", str(inp), "--output", str(out),
            "--regenerate", "--endpoint", endpoint, "--max-tokens", "6", "--temperature", "0", *extra]


def test_answers_land_and_failures_are_retried_then_reported(proxy, tmp_path):
    convs = [
        {"id": 0, "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "ORIGINAL"}]},
        {"id": 1, "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "ORIGINAL"},
                               {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "ORIGINAL"}]},
        {"id": 2, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]},
        {"id": 3, "conversations": [{"from": "human", "value": "FLAKY: name a planet."}, {"from": "gpt", "value": "ORIGINAL"}]},
        {"id": 4, "messages": [{"role": "user", "content": "FAIL on purpose."}, {"role": "assistant", "content": "ORIGINAL"}]},
        {"id": 5, "prompt": "Name a color."},
    ]
    inp, out, rej = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    write_jsonl(inp, convs)
    r = subprocess.run(regen_cmd(inp, out, proxy.url, "--retries", "2", "--retry-backoff-ms", "50",
                                 "--concurrency", "2", "--rejects", str(rej)), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert [x["location"] for x in read_jsonl(rej)] == ["line 5"]
    assert "HTTP 500" in read_jsonl(rej)[0]["reason"] and "gave up after 3 attempts" in read_jsonl(rej)[0]["reason"]
    fail_asks = [m for m in proxy.requests if "FAIL" in m[-1]["content"]]
    flaky_asks = [m for m in proxy.requests if "FLAKY" in m[-1]["content"]]
    assert len(fail_asks) == 3 and len(flaky_asks) == 2

    progress = {p["index"]: p for p in read_jsonl(tmp_path / "out.jsonl.regen.jsonl")}
    assert sorted(progress) == [0, 1, 2, 3, 5]
    for p in progress.values():
        answers = [m["content"] for m in p["messages"] if m["role"] == "assistant"]
        assert answers and all(a != "ORIGINAL" for a in answers), p
    # The second question went with the model's own first answer.
    second = next(m for m in proxy.requests if m[-1]["content"] == "And 3+3?")
    assert second[1] == {"role": "assistant", "content": progress[1]["messages"][1]["content"]}

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    rows = {x["id"]: x for x in read_jsonl(out)}
    assert sorted(rows) == [0, 1, 2, 3, 5]
    for i, p in progress.items():
        assert rows[i]["input_ids"] == tok.apply_chat_template(p["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert sum(rows[i]["loss_mask"]) > 0


def test_a_killed_run_resumes_without_asking_again(proxy, tmp_path):
    convs = [{"id": i, "prompt": f"Question {i}: name a number."} for i in range(10)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    progress = tmp_path / "progress.jsonl"
    write_jsonl(inp, convs)
    cmd = regen_cmd(inp, out, proxy.url, "--concurrency", "1", "--progress-file", str(progress))
    proxy.delay = 0.4
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not progress.exists() or len(progress.read_text().splitlines()) < 3):
        time.sleep(0.05)
    first.kill()
    first.wait()
    answered = {p["index"] for p in read_jsonl(progress)}
    assert 3 <= len(answered) < 10 and not out.exists()
    asked_before = len(proxy.requests)

    proxy.delay = 0.0
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    asked_again = [m[-1]["content"] for m in proxy.requests[asked_before:]]
    assert not any(a.startswith(f"Question {i}:") for a in asked_again for i in answered), (answered, asked_again)
    assert len(asked_again) == 10 - len(answered)
    assert sorted(x["id"] for x in read_jsonl(out)) == list(range(10))
    assert len(read_jsonl(progress)) == 10
