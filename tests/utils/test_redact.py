"""Credentials in URLs are redacted wherever a URL is written or printed."""

from __future__ import annotations

import pytest

from deepspec.utils.redact import redact_url, redact_urls


@pytest.mark.parametrize("url,shown", [
    ("http://user:secret@host/v1", "http://***@host/v1"),
    ("https://token@host:8000/v1", "https://***@host:8000/v1"),
    ("https://host/v1?api_key=abc&model=m", "https://host/v1?api_key=***&model=m"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("not a url", "not a url"),
])
def test_a_url_loses_its_credentials_and_nothing_else(url, shown):
    assert redact_url(url) == shown


def test_every_url_in_a_line_is_redacted():
    line = "deepspec regenerate --base-url http://u:p4ss@h/v1 --out r.jsonl (then https://k@h2/x)"
    assert redact_urls(line) == "deepspec regenerate --base-url http://***@h/v1 --out r.jsonl (then https://***@h2/x)"


def test_a_lock_holder_s_command_line_is_recorded_redacted(tmp_path, monkeypatch):
    import json
    import sys

    from deepspec.utils.locks import exclusive_lock

    monkeypatch.setattr(sys, "argv", ["deepspec", "regenerate", "--base-url", "http://u:p4ss@h/v1"])
    with exclusive_lock(tmp_path / ".lock", "test"):
        holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["command"] == "deepspec regenerate --base-url http://***@h/v1"
