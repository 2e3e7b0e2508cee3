"""Regeneration backend for any OpenAI-compatible server (vLLM, SGLang, ...): POST /v1/chat/completions, or
/v1/completions in the text format (a base model: the prefix is continued, no chat template).

Standard library only (http.client + a thread pool). The server applies the target's chat template itself,
so the messages sent are exactly those `render_conversation` later renders (same system prompt rule); the
template options go along as `chat_template_kwargs` and a template given in the target config as
`chat_template` (vLLM/SGLang request extensions), each sent when set. In the text format the server tokenizes
the prefix as a prompt (with the tokenizer's BOS), as the text format renders it.
Requests of one call run concurrently; answers come back in input order whatever order they finish.

Each attempt has one total deadline (`timeout` seconds for connect, send, wait and read together: a
server that drips bytes cannot hold a request longer). Redirects are never followed: they would resend
the API key to another address (and a 302/303 turns the POST into a GET); the error names the target.
Transient failures (HTTP 5xx/408/409/425/429, timeouts, connection errors) and malformed answers (a
body that is not JSON, no choices, `content: null`) are retried with exponential backoff, then reported
naming the request (and, through regenerate_conversations, the record id). The API key comes from the
caller (the CLI reads it from an environment variable, never from the command line); credentials in
the base URL (`http://user:password@host/v1`) are sent as HTTP basic authentication when there is no
API key, and never written or printed (the output's meta, the log and every error show the URL
redacted, deepspec.utils.redact). Proxy variables (HTTP(S)_PROXY) are not used.

A prompt the server refuses for its context length (HTTP 400 with the engine's context-length message,
`CONTEXT_LENGTH_REFUSAL`) is no failure: the turn gets no answer (finish reason prompt_too_long, the server's
words as its cause) and regeneration ends that conversation at its last answered turn. SGLang 0.5.23 refuses a
prompt whose tokens plus `max_tokens` pass its context length (`srt/managers/tokenizer_manager.py:1337-1378`),
vLLM 0.33.0 one longer than its context alone (`renderers/params.py:531-552`, `v1/engine/input_processor.py:
557-602`; it shortens `max_tokens` to fit otherwise, `entrypoints/serve/utils/api_utils.py:234-270`). With
`max_prompt_tokens` (and the target's tokenizer) a longer prompt, as DeepSpec renders it with the template and
options the server applies, is never sent: the same answer as a refusal, decided here whatever the server.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from deepspec.data.regenerate import Generation, GenerationFailed
from deepspec.data.rendering import Rendering
from deepspec.data.sampling import SamplingParams
from deepspec.utils.redact import redact_url

log = logging.getLogger(__name__)

_RETRYABLE_HTTP = {408, 409, 425, 429}
# The context-length refusals of the engines (HTTP 400), in the versions read (module docstring): SGLang "The input
# (N tokens) is longer than the model's context length" / "Requested token count exceeds the model's maximum context
# length"; vLLM "This model's maximum context length is", "... longer than the maximum model length of",
# "Input length (N) exceeds model's maximum context length".
CONTEXT_LENGTH_REFUSAL = re.compile(r"context length|maximum model length", re.IGNORECASE)


class RequestFailed(GenerationFailed):
    """A request failed for good (non-retryable status, redirect, or retries exhausted)."""


class _Retryable(Exception):
    """One attempt failed in a way worth retrying (the message says how)."""


def chat_completions_url(base_url: str, endpoint: str = "chat/completions") -> str:
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"base_url={redact_url(base_url)!r} must start with http:// or https://")
    return base + (f"/{endpoint}" if base.endswith("/v1") else f"/v1/{endpoint}")


class OpenAIChatBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, concurrency: int = 8,
                 max_retries: int = 5, timeout: float = 600.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 rendering: Rendering | None = None, max_prompt_tokens: int | None = None, tokenizer=None):
        if max_prompt_tokens is not None and (max_prompt_tokens <= 0 or tokenizer is None):
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} must be positive and comes with the target's "
                             "tokenizer (to count a prompt's tokens as the server will)")
        if concurrency <= 0:
            raise ValueError(f"concurrency={concurrency} must be positive")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.rendering = rendering or Rendering()
        self.url = chat_completions_url(base_url, "completions" if self.rendering.is_text else "chat/completions")
        self.shown_url = redact_url(self.url)  # what is written (the meta) and printed
        self.model = model
        self.api_key = api_key
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.timeout = float(timeout)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer

    def describe(self) -> dict:
        return {"backend": "openai", "url": self.shown_url, "model": self.model}

    def request_body(self, prompt: list[dict] | str, sampling: SamplingParams, max_new_tokens: int,
                     seed: int) -> dict:
        """The body for a conversation (chat) or a prefix (text format)."""
        body = {"model": self.model, "prompt" if self.rendering.is_text else "messages": prompt,
                "max_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "seed": seed}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k  # vLLM/SGLang extension; omitted when disabled
        if not self.rendering.is_text and self.rendering.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.rendering.chat_template_kwargs)  # vLLM/SGLang extension
        if not self.rendering.is_text and self.rendering.chat_template is not None:
            body["chat_template"] = self.rendering.chat_template  # vLLM/SGLang extension
        return body

    def _post(self, body: dict) -> tuple[int, dict, bytes]:
        """One POST within the total deadline: (status, lower-cased headers, body). Never follows redirects."""
        parts = urllib.parse.urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = connection_class(parts.hostname, parts.port, timeout=self.timeout)
        expired = threading.Event()
        opened: list[socket.socket] = []  # conn.sock is dropped once a response owns the socket: keep our own

        def expire():  # wakes a blocked recv: the socket is shut down under it
            expired.set()
            for sock in opened:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif parts.username is not None:  # credentials in --base-url: HTTP basic authentication
            user, password = (urllib.parse.unquote(v or "")
                              for v in (parts.username, parts.password))
            token = base64.b64encode(f"{user}:{password}".encode("utf-8")).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            conn.connect()  # bounded by the socket timeout (= the deadline)
            opened.append(conn.sock)
            if expired.is_set():
                raise TimeoutError
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request("POST", path, body=json.dumps(body).encode("utf-8"), headers=headers)
            response = conn.getresponse()
            data = response.read()
            if expired.is_set():
                raise TimeoutError
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        except (OSError, http.client.HTTPException) as err:
            if expired.is_set():
                raise _Retryable(f"no complete answer within the {self.timeout:g} s deadline") from None
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        finally:
            timer.cancel()
            conn.close()

    def prompt_over_limit(self, prompt: list[dict] | str) -> Generation | None:
        """The no-answer of a prompt longer than `max_prompt_tokens` (None when it fits, or without a limit)."""
        if self.max_prompt_tokens is None:
            return None
        ids = (self.rendering.text_prompt_ids(self.tokenizer, prompt) if isinstance(prompt, str)
               else self.rendering.prompt_ids(self.tokenizer, prompt))
        if len(ids) <= self.max_prompt_tokens:
            return None
        return Generation(text="", finish_reason="prompt_too_long", num_tokens=0,
                          cause=f"the prompt has {len(ids)} tokens, over --max-prompt-tokens {self.max_prompt_tokens}")

    def _complete(self, index: int, prompt: list[dict] | str, sampling: SamplingParams, max_new_tokens: int,
                  seed: int) -> Generation:
        too_long = self.prompt_over_limit(prompt)
        if too_long is not None:
            return too_long
        body = self.request_body(prompt, sampling, max_new_tokens, seed)
        size = f"{len(prompt)} characters" if isinstance(prompt, str) else f"{len(prompt)} messages"
        what = f"request {index} ({size}, seed {seed}) to {self.shown_url}"
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                status, headers, data = self._post(body)
                return self._answer(status, headers, data, what, index, text=self.rendering.is_text)
            except _Retryable as err:
                last_error = str(err)
            log.warning("%s: attempt %d/%d failed (%s)", what, attempt + 1, self.max_retries + 1, last_error)
        raise RequestFailed(f"{what} failed after {self.max_retries + 1} attempts; last error: {last_error}",
                            index=index)

    @staticmethod
    def _answer(status: int, headers: dict, data: bytes, what: str, index: int, text: bool = False) -> Generation:
        """The answer of a 2xx reply (`text`: a completions reply, choices[0].text), or none (prompt_too_long) for a
        context-length refusal; raises RequestFailed (final) or _Retryable for anything else."""
        detail = data.decode("utf-8", "replace")[:300]
        if 300 <= status < 400:
            raise RequestFailed(f"{what}: HTTP {status} redirect to {headers.get('location')!r} not followed (it "
                                "would resend the API key elsewhere and turn the POST into a GET); set --base-url "
                                "to the final address", index=index)
        if status >= 500 or status in _RETRYABLE_HTTP:
            raise _Retryable(f"HTTP {status}: {detail}")
        refusal = _error_message(data) if status == 400 else ""
        if CONTEXT_LENGTH_REFUSAL.search(refusal):  # not a failure: this turn gets no answer
            return Generation(text="", finish_reason="prompt_too_long", num_tokens=0,
                              cause=f"the server refused the prompt (HTTP 400: {refusal[:200]})")
        if status >= 400 or status < 200:
            raise RequestFailed(f"{what}: HTTP {status}: {detail}", index=index)
        field = "choices[0].text" if text else "choices[0].message.content"
        try:
            payload = json.loads(data)
            choice = payload["choices"][0]
            answer = choice["text"] if text else choice["message"]["content"]
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Retryable(f"HTTP {status} answer is not JSON ({headers.get('content-type')}): {detail!r}") from None
        except (KeyError, IndexError, TypeError):
            raise _Retryable(f"HTTP {status} answer has no {field}: {detail}") from None
        if not isinstance(answer, str):
            raise _Retryable(f"HTTP {status} answer has content {answer!r}, not text: {detail}")
        usage = payload.get("usage") or {}
        return Generation(text=answer, finish_reason=choice.get("finish_reason") or "stop",
                          num_tokens=int(usage.get("completion_tokens") or 0))

    def generate(self, conversations: list[list[dict]], sampling: SamplingParams, max_new_tokens: int,
                 seed: int) -> list[Generation]:
        return self._all(conversations, sampling, max_new_tokens, seed)

    def complete(self, prefixes: list[str], sampling: SamplingParams, max_new_tokens: int,
                 seed: int) -> list[Generation]:
        return self._all(prefixes, sampling, max_new_tokens, seed)

    def _all(self, prompts: list, sampling: SamplingParams, max_new_tokens: int, seed: int) -> list[Generation]:
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(prompts), 1))) as pool:
            # map() yields in submission order, so answers line up with the prompts.
            return list(pool.map(lambda k: self._complete(k, prompts[k], sampling, max_new_tokens, seed + k),
                                 range(len(prompts))))


def _error_message(data: bytes) -> str:
    """The message of an error body: vLLM's {"error": {"message"}}, SGLang's {"message"}, else the text itself."""
    text = data.decode("utf-8", "replace")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(payload, dict):
        error = payload.get("error")
        message = error.get("message") if isinstance(error, dict) else payload.get("message", error)
        if isinstance(message, str):
            return message
    return text
