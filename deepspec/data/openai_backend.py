"""Regeneration backend for any OpenAI-compatible server (vLLM, SGLang, ...): POST /v1/chat/completions.

Standard library only (http.client + a thread pool). The server applies the target's chat template itself,
so the messages sent are exactly those `render_conversation` later renders (same system prompt rule); the
template options go along as `chat_template_kwargs` (a vLLM/SGLang request extension), sent when set.
Requests of one call run concurrently; answers come back in input order whatever order they finish.

Each attempt has one total deadline (`timeout` seconds for connect, send, wait and read together: a
server that drips bytes cannot hold a request longer). Redirects are never followed: they would resend
the API key to another address (and a 302/303 turns the POST into a GET); the error names the target.
Transient failures (HTTP 5xx/408/409/425/429, timeouts, connection errors) and malformed answers (a
body that is not JSON, no choices, `content: null`) are retried with exponential backoff, then reported
naming the request (and, through regenerate_conversations, the record id). The API key comes from the
caller (the CLI reads it from an environment variable, never from the command line). Proxy variables
(HTTP(S)_PROXY) are not used.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from deepspec.data.regenerate import Generation, GenerationFailed, SamplingParams

log = logging.getLogger(__name__)

_RETRYABLE_HTTP = {408, 409, 425, 429}


class RequestFailed(GenerationFailed):
    """A request failed for good (non-retryable status, redirect, or retries exhausted)."""


class _Retryable(Exception):
    """One attempt failed in a way worth retrying (the message says how)."""


def chat_completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


class OpenAIChatBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, concurrency: int = 8,
                 max_retries: int = 5, timeout: float = 600.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 chat_template_kwargs: dict | None = None):
        if concurrency <= 0:
            raise ValueError(f"concurrency={concurrency} must be positive")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.url = chat_completions_url(base_url)
        self.model = model
        self.api_key = api_key
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.timeout = float(timeout)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def describe(self) -> dict:
        return {"backend": "openai", "url": self.url, "model": self.model}

    def request_body(self, messages: list[dict], sampling: SamplingParams, seed: int) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k  # vLLM/SGLang extension; omitted when disabled
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs  # vLLM/SGLang extension
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

    def _complete(self, index: int, messages: list[dict], sampling: SamplingParams, seed: int) -> Generation:
        body = self.request_body(messages, sampling, seed)
        what = f"request {index} ({len(messages)} messages, seed {seed}) to {self.url}"
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                status, headers, data = self._post(body)
                return self._answer(status, headers, data, what, index)
            except _Retryable as err:
                last_error = str(err)
            log.warning("%s: attempt %d/%d failed (%s)", what, attempt + 1, self.max_retries + 1, last_error)
        raise RequestFailed(f"{what} failed after {self.max_retries + 1} attempts; last error: {last_error}",
                            index=index)

    @staticmethod
    def _answer(status: int, headers: dict, data: bytes, what: str, index: int) -> Generation:
        """The answer of a 2xx reply; raises RequestFailed (final) or _Retryable for anything else."""
        detail = data.decode("utf-8", "replace")[:300]
        if 300 <= status < 400:
            raise RequestFailed(f"{what}: HTTP {status} redirect to {headers.get('location')!r} not followed (it "
                                "would resend the API key elsewhere and turn the POST into a GET); set --base-url "
                                "to the final address", index=index)
        if status >= 500 or status in _RETRYABLE_HTTP:
            raise _Retryable(f"HTTP {status}: {detail}")
        if status >= 400 or status < 200:
            raise RequestFailed(f"{what}: HTTP {status}: {detail}", index=index)
        try:
            payload = json.loads(data)
            choice = payload["choices"][0]
            text = choice["message"]["content"]
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Retryable(f"HTTP {status} answer is not JSON ({headers.get('content-type')}): {detail!r}") from None
        except (KeyError, IndexError, TypeError):
            raise _Retryable(f"HTTP {status} answer has no choices[0].message.content: {detail}") from None
        if not isinstance(text, str):
            raise _Retryable(f"HTTP {status} answer has content {text!r}, not text: {detail}")
        usage = payload.get("usage") or {}
        return Generation(text=text, finish_reason=choice.get("finish_reason") or "stop",
                          num_tokens=int(usage.get("completion_tokens") or 0))

    def generate(self, conversations: list[list[dict]], sampling: SamplingParams, seed: int) -> list[Generation]:
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(conversations), 1))) as pool:
            # map() yields in submission order, so answers line up with conversations.
            return list(pool.map(lambda k: self._complete(k, conversations[k], sampling, seed + k),
                                 range(len(conversations))))
