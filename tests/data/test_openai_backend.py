"""OpenAI-compatible backend against a local HTTP server: order, retries, request bodies, errors."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepspec.data.openai_backend import OpenAIChatBackend, RequestFailed, chat_completions_url
from deepspec.data.regenerate import RegenerationSettings, regenerate_conversations
from deepspec.data.sampling import SamplingParams
from deepspec.data.sources import Conversation

REPO = Path(__file__).resolve().parents[2]

GREEDY = SamplingParams(temperature=0.0)


# The bodies of the engines' context-length refusals (HTTP 400), as their servers write them: SGLang 0.5.23
# (serving_base.create_error_response of tokenizer_manager's ValueError), vLLM 0.33.0 (an ErrorResponse of
# renderers/params.py's VLLMValidationError).
CONTEXT_REFUSALS = {
    "sglang": {"object": "error", "message": "Requested token count exceeds the model's maximum context length of "
               "8192 tokens. You requested a total of 8300 tokens: 6252 tokens from the input messages and 2048 "
               "tokens for the completion. Please reduce the number of tokens in the input messages or the "
               "completion to fit within the limit.", "type": "BadRequest", "param": None, "code": 400},
    "vllm": {"error": {"message": "This model's maximum context length is 8192 tokens. However, your prompt contains "
                       "8300 input tokens, which exceeds this limit even without any output tokens. Please reduce "
                       "the length of the input prompt.", "type": "BadRequestError", "param": "input_tokens",
                       "code": 400}},
}


class FakeServer:
    """Canned /v1/chat/completions. Prompts containing 'flaky' fail their first attempt with HTTP 500;
    'broken' always fails with 500; 'bad' gets HTTP 400; 'redirect' a 302 to `redirect_to`; 'html' a
    non-JSON 200; 'null' (always) / 'nullonce' (first attempt) `content: null`; 'drip' an answer that
    arrives one byte every 0.2 s; 'empty' `content: ""`. With `context_chars`, a conversation of more
    characters than that gets the context-length refusal of the engine `refusal` names (HTTP 400). Answers
    are delayed so that earlier requests finish last (order must come from the client, not from completion
    order)."""

    def __init__(self, chat_server, redirect_to: str = "", context_chars: int | None = None, refusal: str = "sglang"):
        self.requests = []  # (path, headers, body) of every attempt
        self.lock = threading.Lock()
        self.redirect_to = redirect_to
        self.context_chars = context_chars
        self.refusal = CONTEXT_REFUSALS[refusal]
        self.url = chat_server(self.respond).url

    def respond(self, handler, body):
        last = body["messages"][-1]["content"]
        with self.lock:
            self.requests.append((handler.path, dict(handler.headers), body))
            attempts = sum(1 for _, _, b in self.requests if b["messages"][-1]["content"] == last)
        if self.context_chars is not None and sum(len(m["content"]) for m in body["messages"]) > self.context_chars:
            return handler.reply(400, self.refusal)
        if "bad" in last:
            return handler.reply(400, {"error": "bad request"})
        if "empty" in last:
            return handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": ""},
                                                    "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})
        if "redirect" in last:
            handler.send_response(302)
            handler.send_header("Location", self.redirect_to + "/v1/chat/completions")
            handler.send_header("Content-Length", "0")
            return handler.end_headers()
        if "html" in last:
            return handler.reply(200, None, raw=b"<html>upstream proxy error</html>")
        if last.startswith("null") and (last != "nullonce" or attempts == 1):
            return handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": None},
                                                    "finish_reason": "stop"}]})
        if "drip" in last:
            return self.drip(handler, json.dumps({"choices": [{"message": {"content": "late"}}]}).encode())
        if "broken" in last or ("flaky" in last and attempts == 1):
            return handler.reply(500, {"error": "overloaded"})
        time.sleep(0.05 / (1 + body["seed"] % 4))
        n_assist = sum(m["role"] == "assistant" for m in body["messages"])
        handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": f"A({last})#{n_assist}"},
                                         "finish_reason": "stop"}],
                            "usage": {"completion_tokens": len(last.split())}})

    @staticmethod
    def drip(handler, data):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        try:
            for k in range(len(data)):
                handler.wfile.write(data[k:k + 1])
                handler.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the client gave up
            pass


@pytest.fixture
def server(chat_server):
    return FakeServer(chat_server)


@pytest.fixture
def redirecting(server, chat_server):
    """(a server answering 'redirect' prompts with a 302 to `server`, another origin; `server`)."""
    return FakeServer(chat_server, redirect_to=server.url), server


def user(text):
    return [{"role": "user", "content": text}]


def test_answers_keep_input_order_and_flaky_requests_are_retried(server):
    backend = OpenAIChatBackend(server.url, "tgt", api_key="k3y", concurrency=3, backoff_s=0.01)
    prompts = ["one", "two flaky", "three", "four", "five flaky", "six"]
    got = backend.generate([user(p) for p in prompts], SamplingParams(temperature=0.5, top_k=20), 7, seed=100)
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
        backend.generate([user("fine"), user("broken")], GREEDY, 4, seed=0)
    assert sum("broken" in b["messages"][-1]["content"] for _, _, b in server.requests) == 3
    with pytest.raises(RequestFailed, match="HTTP 400"):
        backend.generate([user("bad")], GREEDY, 4, seed=0)
    assert sum("bad" in b["messages"][-1]["content"] for _, _, b in server.requests) == 1  # no retry on 4xx
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=0.0, top_k=-1)


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = OpenAIChatBackend(f"http://127.0.0.1:{port}", "tgt", max_retries=1, backoff_s=0.0, timeout=2)
    with pytest.raises(RequestFailed, match="failed after 2 attempts; last error: ConnectionRefusedError"):
        backend.generate([user("x")], GREEDY, 4, seed=0)


def test_multi_turn_regeneration_through_the_server(server, tmp_path):
    convs = [Conversation(id=f"c{k}", messages=user(f"q{k}") + [{"role": "assistant", "content": "old"}]
                          + user(f"follow{k}"), source="t", line=k) for k in range(3)]
    backend = OpenAIChatBackend(server.url, "tgt", concurrency=2, backoff_s=0.0)
    out = tmp_path / "o.jsonl"
    report = regenerate_conversations(convs, backend, out,
                                      RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))
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


def test_redirect_is_not_followed_so_the_key_never_leaves(redirecting):
    first, other = redirecting
    backend = OpenAIChatBackend(first.url, "tgt", api_key="s3cret", max_retries=3, backoff_s=0.0)
    with pytest.raises(RequestFailed, match=rf"HTTP 302 redirect to '{other.url}/v1/chat/completions' not followed"):
        backend.generate([user("redirect me")], GREEDY, 4, seed=0)
    assert len(first.requests) == 1 and other.requests == []  # not retried, never sent to the other origin


def test_total_deadline_bounds_a_slow_drip_server(server):
    backend = OpenAIChatBackend(server.url, "tgt", max_retries=1, backoff_s=0.0, timeout=1.0)
    with pytest.raises(RequestFailed, match=r"failed after 2 attempts; last error: no complete answer within the "
                                            r"1 s deadline"):
        backend.generate([user("drip")], GREEDY, 4, seed=0)


@pytest.mark.parametrize("prompt,error", [("html", r"answer is not JSON \(application/json\): '<html>upstream"),
                                          ("null", r"answer has content None, not text")])
def test_malformed_answers_are_retried_then_reported_with_the_record_id(server, tmp_path, prompt, error):
    from deepspec.data.regenerate import GenerationFailed

    convs = [Conversation(id=f"rec{k}", messages=user(text), source="p.jsonl", line=k + 1)
             for k, text in enumerate(["fine", prompt])]
    backend = OpenAIChatBackend(server.url, "tgt", max_retries=2, backoff_s=0.0)
    out = tmp_path / "o.jsonl"
    with pytest.raises(GenerationFailed, match=rf"record 'rec1' \(p.jsonl:2\), turn 1: request 0 .* failed after 3 "
                                               rf"attempts; last error: HTTP 200 {error}"):
        regenerate_conversations(convs, backend, out,
                                 RegenerationSettings(max_new_tokens=4, batch_size=1, show_progress=False))
    assert sum(b["messages"][-1]["content"] == prompt for _, _, b in server.requests) == 3
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["rec0"]  # nothing empty stored


def test_a_null_answer_that_recovers_is_stored_not_emptied(server):
    got = OpenAIChatBackend(server.url, "tgt", backoff_s=0.0).generate([user("nullonce")], GREEDY, 4, seed=0)
    assert got[0].text == "A(nullonce)#0"


def test_cli_reads_the_key_from_the_environment_and_takes_timeout_and_retries(server, tmp_path):
    repo = REPO
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "conversations": user("two flaky")}) + "\n")
    base = [sys.executable, str(repo / "data_tools" / "regenerate.py"), "--prompts", str(prompts), "--backend",
            "openai", "--base-url", server.url, "--model", "tgt", "--max-new-tokens", "4", "--timeout", "5"]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OPENAI_API_KEY": "from-env", "MY_KEY": "named"}
    proc = subprocess.run([*base, "--out", str(tmp_path / "a.jsonl"), "--retries", "0"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "failed after 1 attempts; last error: HTTP 500" in proc.stderr
    proc = subprocess.run([*base, "--out", str(tmp_path / "b.jsonl"), "--api-key-env", "MY_KEY"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [h["Authorization"] for _, h, _ in server.requests] == ["Bearer from-env", "Bearer named"]
    proc = subprocess.run([*base, "--out", str(tmp_path / "c.jsonl"), "--api-key-env", "UNSET_VARIABLE_X"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--api-key-env UNSET_VARIABLE_X: that environment variable is not set" in proc.stderr


def conversation(cid, *user_turns, line):
    messages = []
    for k, text in enumerate(user_turns):
        messages += user(text) + ([{"role": "assistant", "content": "old"}] if k + 1 < len(user_turns) else [])
    return Conversation(id=cid, messages=messages, source="p.jsonl", line=line)


@pytest.mark.parametrize("engine", sorted(CONTEXT_REFUSALS))
def test_a_context_length_refusal_ends_that_conversation_and_the_run_goes_on(chat_server, tmp_path, caplog, engine):
    """A prompt past the server's context (HTTP 400 with the engine's own message) is no failure: that turn gets
    no answer, its conversation is written up to its last answer, counted and named; a rerun resumes past it."""
    server = FakeServer(chat_server, context_chars=40, refusal=engine)
    convs = [conversation("c0", "q0", line=1), conversation("long", "x" * 50, line=2),
             conversation("cut", "q2", "y" * 40, line=3), conversation("c3", "q3", "f3", line=4)]
    backend = OpenAIChatBackend(server.url, "tgt", concurrency=2, max_retries=3, backoff_s=0.0)
    out = tmp_path / "o.jsonl"
    with caplog.at_level("WARNING", logger="deepspec.data.regenerate"):
        report = regenerate_conversations(convs, backend, out,
                                          RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["c0", "long", "cut", "c3"]  # input order, every record
    assert records[1]["conversations"] == user("x" * 50) and records[1]["finish_reasons"] == ["prompt_too_long"]
    assert records[2]["conversations"] == user("q2") + [{"role": "assistant", "content": "A(q2)#0"}]
    assert records[2]["finish_reasons"] == ["stop", "prompt_too_long"]
    assert records[3]["finish_reasons"] == ["stop", "stop"]
    assert sum(b["messages"][-1]["content"] == "x" * 50 for _, _, b in server.requests) == 1  # never retried
    assert report.unanswered == {"prompt_too_long": 2} and report.num_written == 4
    assert "2 ended at a turn without an answer {'prompt_too_long': 2}" in report.summary()
    message = CONTEXT_REFUSALS[engine].get("message") or CONTEXT_REFUSALS[engine]["error"]["message"]
    final = [r.getMessage() for r in caplog.records if "written up to the last answered turn" in r.getMessage()]
    assert len(final) == 1 and "2 prompt_too_long ('long' (p.jsonl:2), turn 1: the server refused the prompt " \
        f"(HTTP 400: {message[:60]}" in final[0] and "'cut' (p.jsonl:3), turn 2: the server refused" in final[0]

    asked = len(server.requests)
    again = regenerate_conversations(convs, backend, out,
                                     RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))
    assert again.num_resumed == 4 and again.num_written == 0 and len(server.requests) == asked


def test_an_empty_answer_is_counted_named_and_never_written(server, tmp_path, caplog):
    convs = [conversation("e", "empty please", line=1), conversation("later", "q", "empty again", line=2),
             conversation("ok", "fine", line=3)]
    out = tmp_path / "o.jsonl"
    with caplog.at_level("WARNING", logger="deepspec.data.regenerate"):
        report = regenerate_conversations(convs, OpenAIChatBackend(server.url, "tgt", backoff_s=0.0), out,
                                          RegenerationSettings(max_new_tokens=4, show_progress=False))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["e"]["conversations"] == user("empty please") and records["e"]["finish_reasons"] == ["empty_answer"]
    assert records["later"]["conversations"] == user("q") + [{"role": "assistant", "content": "A(q)#0"}]
    assert records["later"]["finish_reasons"] == ["stop", "empty_answer"]
    assert not any(m["content"] == "" for r in records.values() for m in r["conversations"])
    assert report.unanswered == {"empty_answer": 2} and report.num_turns_generated == 2
    assert any("2 empty_answer ('e' (p.jsonl:1), turn 1: an empty answer" in r.getMessage() for r in caplog.records)


def test_max_prompt_tokens_keeps_a_long_prompt_from_the_server(server, tmp_path, tiny_llama):
    from deepspec.data.rendering import Rendering

    tokenizer = tiny_llama.tokenizer
    limit = len(Rendering().prompt_ids(tokenizer, user("short"))) + 2
    backend = OpenAIChatBackend(server.url, "tgt", backoff_s=0.0, max_prompt_tokens=limit, tokenizer=tokenizer)
    convs = [conversation("s", "short", line=1), conversation("l", "word " * 40, line=2),
             conversation("t", "short", "two " * 40, line=3)]
    report = regenerate_conversations(convs, backend, tmp_path / "o.jsonl",
                                      RegenerationSettings(max_new_tokens=4, show_progress=False))
    sent = [b["messages"][-1]["content"] for _, _, b in server.requests]
    assert sent == ["short", "short"]  # the long prompts were never sent
    assert report.unanswered == {"prompt_too_long": 2}
    assert report.unanswered_records["prompt_too_long"][0].startswith(
        f"'l' (p.jsonl:2), turn 1: the prompt has {len(Rendering().prompt_ids(tokenizer, user('word ' * 40)))} "
        f"tokens, over --max-prompt-tokens {limit}")
    meta = json.loads((tmp_path / "o.jsonl.meta.json").read_text())
    assert meta["max_prompt_tokens"] == limit
    with pytest.raises(ValueError, match="max_prompt_tokens=5 must be positive and comes with the target's tokenizer"):
        OpenAIChatBackend(server.url, "tgt", max_prompt_tokens=5)


def test_a_resume_against_another_address_of_the_same_model_goes_on(chat_server, tmp_path, caplog):
    first, second = FakeServer(chat_server), FakeServer(chat_server)
    convs = [conversation(f"c{k}", f"q{k}", line=k + 1) for k in range(4)]
    out = tmp_path / "o.jsonl"
    regenerate_conversations(convs, OpenAIChatBackend(first.url, "tgt"), out,
                             RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))
    complete = out.read_bytes()
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:2]))  # killed after the first batch
    with caplog.at_level("INFO", logger="deepspec.data.regenerated_output"):
        report = regenerate_conversations(convs, OpenAIChatBackend(second.url + "/v1", "tgt"), out,
                                          RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))
    assert report.num_resumed == 2 and out.read_bytes() == complete
    # Only the batch holding the first missing record is asked again (its requests run concurrently: any order).
    assert sorted(b["messages"][-1]["content"] for _, _, b in second.requests) == ["q2", "q3"]
    assert any(f"resuming against {second.url}/v1/chat/completions" in r.getMessage() for r in caplog.records)
    out.write_bytes(b"".join(complete.splitlines(keepends=True)[:2]))
    with pytest.raises(ValueError, match=r"cannot resume with different settings: backend was .*'model': 'tgt'"):
        regenerate_conversations(convs, OpenAIChatBackend(second.url, "other-model"), out,
                                 RegenerationSettings(max_new_tokens=4, batch_size=2, show_progress=False))


def test_cli_max_prompt_tokens_counts_with_the_target_s_tokenizer(server, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": cid, "conversations": user(text)}) + "\n"
                               for cid, text in [("short", "hello"), ("long", "word " * 300)]))
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, str(repo / "data_tools" / "regenerate.py"), "--prompts", str(prompts), "--backend",
               "openai", "--base-url", server.url, "--model", "tgt", "--target", "tiny-random-llama",
               "--max-new-tokens", "4", "--max-prompt-tokens", "64", "--out", str(tmp_path / "o.jsonl")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [b["messages"][-1]["content"] for _, _, b in server.requests] == ["hello"]
    assert "1 ended at a turn without an answer {'prompt_too_long': 1}" in proc.stdout
    assert "'long' (p.jsonl:2), turn 1: the prompt has" in proc.stderr and "over --max-prompt-tokens 64" in proc.stderr
    proc = subprocess.run([*command[:-4], "--max-prompt-tokens", "0", "--out", str(tmp_path / "z.jsonl")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--max-prompt-tokens 0: must be positive" in proc.stderr


def test_cli_refuses_in_one_line_a_server_that_is_down_or_serves_another_model(server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "conversations": user("hi")}) + "\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://user:pw@127.0.0.1:{sock.getsockname()[1]}/v1"
    base = [sys.executable, "-m", "deepspec.cli", "regenerate", "--prompts", str(prompts), "--backend", "openai",
            "--target", "tiny-random-llama", "--max-new-tokens", "4", "--greedy"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for url, model, expected in ((down, "tgt", "no server answers at http://***@127.0.0.1"),
                                 (server.url, "other", "serves ['tgt'], not --model 'other'")):
        out = tmp_path / f"{model}.jsonl"
        proc = subprocess.run([*base, "--base-url", url, "--model", model, "--out", str(out)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("deepspec regenerate: error:") and expected in last, last
        assert "pw" not in proc.stderr and not out.exists()


def test_credentials_in_the_base_url_are_sent_but_never_written_or_printed(server, tmp_path):
    """`--base-url http://user:secret@host/v1`: the request carries them (HTTP basic authentication), the output's
    meta, the lock file, the log and the error line show the address without them."""
    import base64
    import os
    import subprocess
    import sys
    from pathlib import Path

    secret_url = server.url.replace("http://", "http://alice:s3cret@") + "/v1"
    backend = OpenAIChatBackend(secret_url, "tgt", max_retries=0, backoff_s=0.0)
    convs = [Conversation(id="c0", messages=user("hello"), source="t", line=1)]
    out = tmp_path / "r.jsonl"
    regenerate_conversations(convs, backend, out,
                             RegenerationSettings(max_new_tokens=4, batch_size=1, show_progress=False))
    meta = (tmp_path / "r.jsonl.meta.json").read_text()
    assert "s3cret" not in meta and "alice" not in meta and '"url": "http://***@127.0.0.1:' in meta
    assert server.requests[-1][1]["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()
    with pytest.raises(RequestFailed) as error:
        backend.generate([user("broken")], GREEDY, 4, seed=0)
    assert "s3cret" not in str(error.value) and "to http://***@127.0.0.1:" in str(error.value)

    repo = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "conversations": user("broken")}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "deepspec.cli", "regenerate", "--prompts", str(prompts),
                           "--backend", "openai", "--base-url", secret_url, "--model", "tgt", "--retries", "0",
                           "--max-new-tokens", "4", "--out", str(tmp_path / "c.jsonl")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "deepspec regenerate: error: record 'x' (p.jsonl:1)" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout and "http://***@127.0.0.1:" in proc.stderr
    assert "s3cret" not in (tmp_path / "c.jsonl.meta.json").read_text()
