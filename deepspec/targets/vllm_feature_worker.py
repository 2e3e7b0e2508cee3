"""The target's hidden states computed by vLLM, in vLLM's own environment: the worker behind
`cache.engine=vllm`.

    <vllm-python> -I vllm_feature_worker.py JOB.json REPLY_FD      (started by
    deepspec.cache.engine_source)

vLLM pins its own torch and transformers, so this file imports only vLLM, torch, safetensors and the
standard library, and DeepSpec never imports it: DeepSpec copies it into a private folder, starts it
there, writes one JSON request per line on its stdin and reads one JSON reply per line from the file
descriptor REPLY_FD (stdout and stderr are vLLM's log). The first reply is `{"event": "ready", ...}`
once the engine has loaded, or `{"ok": false, "error": ...}` with the engine's own message; then
each request `{"id": n, "prompts": [[token ids], ...]}` gets `{"id": n, "ok": true, "paths":
[...]}`: one safetensors file per prompt, in request order, holding `hidden_states` [T, N, H] (the
target's residual stream at the job's N vLLM layer ids, increasing) and `token_ids` [T]. EOF on
stdin ends the worker.

How vLLM computes them: its `extract_hidden_states` speculative method (vllm/v1/spec_decode/
extract_hidden_states.py) stores, during each prefill, the layers named by
`eagle_aux_hidden_state_layer_ids` into a cache-only attention layer's KV cache; a KV connector
copies a finished request's rows out of that cache. vLLM's `ExampleHiddenStatesConnector` does the
copy on a CUDA side stream into pinned memory, which vLLM's CPU build refuses
(example_hidden_states_connector.py:402, `torch.empty_like(..., pin_memory=True)`: "pin_memory=True
requires a CUDA or other accelerator backend"); `DeepSpecHiddenStatesConnector` below is that
connector with a plain synchronous copy, so it runs on CPU and GPU alike. vLLM finds it through
`kv_connector_module_path` (this file's module name; the engine's processes inherit this folder on
sys.path). Each prompt is run prefill only (`max_tokens=1`): the one sampled token is discarded.

vLLM's layer id k is the *input* of decoder layer k (the embeddings for k = 0): DeepSpec's id l (the
output of layer l) is vLLM's l + 1, and vLLM's id L (L = number of layers) is the last layer's
output before the final norm.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

CONNECTOR = "DeepSpecHiddenStatesConnector"


def _connector_class():
    """ExampleHiddenStatesConnector with a synchronous copy out of the KV cache (module
    docstring)."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Done:
        """The copy is finished when `_submit_async_write` returns (what get_finished polls)."""

        @staticmethod
        def query() -> bool:
            return True

    class DeepSpecHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:  # rank 0 holds every layer's full hidden state
                return
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size)
            slots = (block_ids[:, None] * self._block_size + offsets).flatten()
            num_tokens = pending.token_ids.shape[0]
            # A blocking copy: on CPU there is no pinned memory nor side stream, on a GPU it costs
            # a sync.
            slots = slots.to(self._kv_cache.device)
            hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
            tensors = {"hidden_states": hidden.to("cpu", copy=True).contiguous(),
                       "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            try:
                tmp = f"{pending.filename}.tmp"
                save_file(tensors, tmp)
                os.replace(tmp, pending.filename)  # a reader never sees a partial file
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the reader waiting on the lock file
            self._req_copy_events[pending.req_id] = _Done()

    return DeepSpecHiddenStatesConnector


def __getattr__(name: str):
    # vLLM looks the connector up by name; built on first use so that reading this file imports no
    # vLLM.
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def make_engine(job: dict):
    from vllm import LLM

    module = os.path.splitext(os.path.basename(__file__))[0]
    layers = {"eagle_aux_hidden_state_layer_ids": job["layer_ids"]}
    return LLM(model=job["target"], tokenizer=job["target"], skip_tokenizer_init=True,
               dtype=job["dtype"], max_model_len=job["max_model_len"],
               max_num_seqs=job["max_num_seqs"],
               max_num_batched_tokens=job.get("max_num_batched_tokens"),
               tensor_parallel_size=job["tensor_parallel_size"],
               enforce_eager=job["enforce_eager"],
               gpu_memory_utilization=job["gpu_memory_utilization"],
               # Cached prefix blocks would be taken over without passing the layers again; a
               # sample whose prefix another shares must still get every row.
               enable_prefix_caching=False, seed=0, disable_log_stats=True,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": layers}},
               kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": module,
                                   "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {
                                       "shared_storage_path": job["spool"]}})


def wait_written(path: str) -> None:
    """Block until the connector has written `path` (it holds an exclusive lock on `path.lock`
    until then)."""
    import fcntl

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    os.remove(path + ".lock")


def serve(llm, requests, reply) -> None:
    from vllm import SamplingParams

    prefill_only = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for line in requests:
        request = json.loads(line)
        try:
            prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
            outputs = llm.generate(prompts, prefill_only, use_tqdm=False)
            paths = []
            for output in outputs:  # generate returns the outputs in prompt order
                path = (output.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError(f"request {output.request_id}: the connector returned no "
                                       "hidden states")
                wait_written(path)
                paths.append(path)
            reply({"id": request["id"], "ok": True, "paths": paths})
        except Exception as err:  # one prompt's refusal (e.g. too long) ends only this request
            reply({"id": request["id"], "ok": False, "error_type": type(err).__name__,
                   "error": str(err).strip(), "traceback": traceback.format_exc(limit=6)})


def main(argv: list[str]) -> int:
    job_path, reply_fd = argv
    reply_file = os.fdopen(int(reply_fd), "w", buffering=1)

    def reply(record: dict) -> None:
        reply_file.write(json.dumps(record) + "\n")
        reply_file.flush()

    # The engine's processes inherit sys.path and import the connector from this folder.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with open(job_path) as f:
        job = json.load(f)
    started = time.perf_counter()
    try:
        import vllm

        llm = make_engine(job)
    except Exception as err:  # the engine's refusal, reported by DeepSpec as one line
        reply({"ok": False, "error_type": type(err).__name__, "error": str(err).strip(),
               "traceback": traceback.format_exc(limit=8)})
        return 3
    reply({"event": "ready", "ok": True, "vllm_version": vllm.__version__,
           "load_s": time.perf_counter() - started})
    serve(llm, sys.stdin, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
