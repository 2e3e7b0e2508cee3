"""OpenAI-compatible backend against a local HTTP server: order, retries, request bodies, errors."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deepspec.data.openai_backend import OpenAIChatBackend, RequestFailed, chat_completions_url
from deepspec.data.regenerate import SamplingParams, regenerate_conversations
from deepspec.data.sources import Conversation


class FakeServer:
    """Canned /v1/chat/completions. Prompts containing 'flaky' fail their first attempt with HTTP 500;
    'broken' always fails with 500; 'bad' gets HTTP 400. Answers are delayed so that earlier requests
    finish last (order must come from the client, not from completion order)."""

    def __init__(self):
        self.requests = []  # (path, headers, body) of every attempt
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                last = body["messages"][-1]["content"]
                with server.lock:
                    server.requests.append((self.path, dict(self.headers), body))
                    attempts = sum(1 for _, _, b in server.requests if b["messages"][-1]["content"] == last)
                if "bad" in last:
                    return self.reply(400, {"error": "bad request"})
                if "broken" in last or ("flaky" in last and attempts == 1):
                    return self.reply(500, {"error": "overloaded"})
                time.sleep(0.05 / (1 + body["seed"] % 4))
                n_assist = sum(m["role"] == "assistant" for m in body["messages"])
                self.reply(200, {"choices": [{"message": {"role": "assistant", "content": f"A({last})#{n_assist}"},
                                              "finish_reason": "stop"}],
                                 "usage": {"completion_tokens": len(last.split())}})

            def reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def user(text):
    return [{"role": "user", "content": text}]


def test_answers_keep_input_order_and_flaky_requests_are_retried(server):
    backend = OpenAIChatBackend(server.url, "tgt", api_key="k3y", concurrency=3, backoff_s=0.01)
    prompts = ["one", "two flaky", "three", "four", "five flaky", "six"]
    got = backend.generate([user(p) for p in prompts], SamplingParams(max_new_tokens=7, temperature=0.5, top_k=20),
                           seed=100)
    assert [g.text for g in got] == [f"A({p})#0" for p in prompts]
    assert [g.num_tokens for g in got] == [len(p.split()) for p in prompts]
    assert all(g.finish_reason == "stop" for g in got)
    assert len(server.requests) == len(prompts) + 2  # one retry per flaky prompt
    path, headers, body = server.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k3y"
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k")} == {
        "model": "tgt", "max_tokens": 7, "temperature": 0.5, "top_p": 1.0, "top_k": 20}
    assert sorted(b["seed"] for _, _, b in server.requests if "flaky" not in b["messages"][-1]["content"]) == [
        100, 102, 103, 105]


def test_failures_after_retries_and_client_errors_name_the_request(server):
    backend = OpenAIChatBackend(server.url + "/v1/", "tgt", max_retries=2, backoff_s=0.0)
    with pytest.raises(RequestFailed, match=r"request 1 \(1 messages, seed 1\) to .*/v1/chat/completions failed "
                                            r"after 3 attempts; last error: HTTP 500"):
        backend.generate([user("fine"), user("broken")], SamplingParams(max_new_tokens=4), seed=0)
    assert sum("broken" in b["messages"][-1]["content"] for _, _, b in server.requests) == 3
    with pytest.raises(RequestFailed, match="HTTP 400"):
        backend.generate([user("bad")], SamplingParams(max_new_tokens=4), seed=0)
    assert sum("bad" in b["messages"][-1]["content"] for _, _, b in server.requests) == 1  # no retry on 4xx
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_new_tokens=4, top_k=-1).validate()


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = OpenAIChatBackend(f"http://127.0.0.1:{port}", "tgt", max_retries=1, backoff_s=0.0, timeout=2)
    with pytest.raises(RequestFailed, match="failed after 2 attempts; last error: URLError"):
        backend.generate([user("x")], SamplingParams(max_new_tokens=4), seed=0)


def test_multi_turn_regeneration_through_the_server(server, tmp_path):
    convs = [Conversation(id=f"c{k}", messages=user(f"q{k}") + [{"role": "assistant", "content": "old"}]
                          + user(f"follow{k}"), source="t", line=k) for k in range(3)]
    backend = OpenAIChatBackend(server.url, "tgt", concurrency=2, backoff_s=0.0)
    out = tmp_path / "o.jsonl"
    report = regenerate_conversations(convs, backend, out, max_new_tokens=4, batch_size=2, show_progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["c0", "c1", "c2"]
    assert records[1]["conversations"] == user("q1") + [{"role": "assistant", "content": "A(q1)#0"}] + user(
        "follow1") + [{"role": "assistant", "content": "A(follow1)#1"}]
    second = next(b for _, _, b in server.requests if b["messages"][-1]["content"] == "follow2")
    assert second["messages"][1] == {"role": "assistant", "content": "A(q2)#0"}  # the server's own answer
    assert report.num_generated_tokens == 6 and "top_k" not in second


def test_base_url_forms():
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("https://h/v1/") == "https://h/v1/chat/completions"
    with pytest.raises(ValueError, match="base_url"):
        chat_completions_url("h:1")
