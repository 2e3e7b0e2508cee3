"""Regeneration backend for any OpenAI-compatible server (vLLM, SGLang, ...): POST /v1/chat/completions.

Standard library only (urllib + a thread pool). The server applies the target's chat template itself,
so the messages sent are exactly those `render_conversation` later renders (same system prompt rule).
Requests of one call run concurrently; answers come back in input order whatever order they finish.
Transient failures (HTTP 5xx/429, timeouts, connection errors) are retried with exponential backoff.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from deepspec.data.regenerate import Generation, SamplingParams

log = logging.getLogger(__name__)

_RETRYABLE_HTTP = {408, 409, 425, 429}


class RequestFailed(RuntimeError):
    """A request failed for good (non-retryable status, bad response, or retries exhausted)."""


def chat_completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


class OpenAIChatBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, concurrency: int = 8,
                 max_retries: int = 5, timeout: float = 600.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        if concurrency <= 0:
            raise ValueError(f"concurrency={concurrency} must be positive")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        self.url = chat_completions_url(base_url)
        self.model = model
        self.api_key = api_key
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.timeout = timeout
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def describe(self) -> dict:
        return {"backend": "openai", "url": self.url, "model": self.model}

    def request_body(self, messages: list[dict], sampling: SamplingParams, seed: int) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k  # vLLM/SGLang extension; omitted when disabled
        return body

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode("utf-8"), headers=headers,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read().decode("utf-8"))

    def _complete(self, index: int, messages: list[dict], sampling: SamplingParams, seed: int) -> Generation:
        body = self.request_body(messages, sampling, seed)
        what = f"request {index} ({len(messages)} messages, seed {seed}) to {self.url}"
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                payload = self._post(body)
            except urllib.error.HTTPError as err:
                detail = err.read().decode("utf-8", "replace")[:300]
                if err.code < 500 and err.code not in _RETRYABLE_HTTP:
                    raise RequestFailed(f"{what}: HTTP {err.code}: {detail}") from None
                last_error = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                last_error = f"{type(err).__name__}: {err}"
            else:
                return self._parse(payload, what)
            log.warning("%s: attempt %d/%d failed (%s)", what, attempt + 1, self.max_retries + 1, last_error)
        raise RequestFailed(f"{what} failed after {self.max_retries + 1} attempts; last error: {last_error}")

    @staticmethod
    def _parse(payload: dict, what: str) -> Generation:
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RequestFailed(f"{what}: response has no choices[0].message.content: "
                                f"{json.dumps(payload)[:300]}") from None
        usage = payload.get("usage") or {}
        return Generation(text=text or "", finish_reason=choice.get("finish_reason") or "stop",
                          num_tokens=int(usage.get("completion_tokens") or 0))

    def generate(self, conversations: list[list[dict]], sampling: SamplingParams, seed: int) -> list[Generation]:
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(conversations), 1))) as pool:
            # map() yields in submission order, so answers line up with conversations.
            return list(pool.map(lambda k: self._complete(k, conversations[k], sampling, seed + k),
                                 range(len(conversations))))
