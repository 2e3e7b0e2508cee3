"""The vLLM server DeepSpec starts is always stopped: on a normal exit, on an error, on SIGTERM to DeepSpec, and when
DeepSpec's process is killed outright. A stand-in "vLLM python" answers /v1/models like the real server (the real
one: tests/data/test_regenerate_vllm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deepspec.targets.engine import EngineError, ServerSettings, VllmServer, check_served

FAKE_SERVER = textwrap.dedent('''
    import http.server, json, os, sys
    args = sys.argv[1:]
    name, port = args[args.index("--served-model-name") + 1], int(args[args.index("--port") + 1])
    if os.environ.get("FAKE_VLLM_FAIL"):
        sys.exit("ValueError: this engine refuses the model")
    open(os.environ["FAKE_VLLM_PIDFILE"], "w").write(str(os.getpid()))
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            body = json.dumps({"data": [{"id": name}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> Path:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")  # drops `-m vllm...`
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(tmp_path / "server.pid"))
    return python


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else ""
    return state != "Z"


def wait_gone(pid: int, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_server_serves_its_name_and_is_gone_after_the_block(fake_python, tmp_path):
    with VllmServer("folder", "tgt", tmp_path / "log", python=fake_python) as server:
        pid = int((tmp_path / "server.pid").read_text())
        check_served(server.base_url, "tgt")
        with pytest.raises(EngineError, match="serves \\['tgt'\\], not --model 'other'"):
            check_served(server.base_url, "other")
    assert wait_gone(pid)
    with pytest.raises(EngineError, match="no server answers at"):
        check_served(server.base_url, "tgt", timeout=2)


def test_a_server_that_exits_while_starting_is_one_error_with_its_log(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    before = signal.getsignal(signal.SIGTERM)
    server = VllmServer("folder", "tgt", tmp_path / "log", ServerSettings(start_timeout_s=60), python=fake_python)
    with pytest.raises(EngineError, match="exited with 1 while starting .*this engine refuses the model"):
        server.__enter__()
    assert signal.getsignal(signal.SIGTERM) is before  # DeepSpec's own handler is back


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_server_ends_with_deepspec_s_process(fake_python, tmp_path, how):
    holder = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
              "from deepspec.targets.engine import VllmServer\n"
              f"with VllmServer('folder', 'tgt', {str(tmp_path / 'log')!r}, python={str(fake_python)!r}):\n"
              "    print('ready', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert proc.stdout.readline().strip() == "ready"
    pid = int((tmp_path / "server.pid").read_text())
    proc.send_signal(how)
    proc.wait(timeout=60)
    assert wait_gone(pid), f"the server outlived DeepSpec's process ({how.name})"
