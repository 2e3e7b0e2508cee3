"""One vLLM engine run for `deepspec bench serve`, executed by the Python of vLLM's own environment.

    <vllm-python> -I deepspec/benchmarks/vllm_worker.py JOB.json RESULT.json

vLLM pins its own torch and transformers, so it cannot share DeepSpec's environment: this file imports only vLLM
and the standard library, and talks to the benchmark through two JSON files. JOB names the target folder, the
`speculative_config` (null: plain decoding), the prompts as token ids (rendered by DeepSpec, so both sides decode
the same ids) and the sampling settings. Each prompt is generated alone (batch 1, the regime speculative decoding
is for) after one untimed warm-up request; per prompt the result holds the generated ids, the wall and CPU
seconds of its `generate` call and vLLM's own per-request acceptance record (`per_request_spec_decode_metrics=
"detailed"`: accepted and drafted tokens of every verification step), and over the timed requests the deltas
of vLLM's Prometheus counters (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`). An engine that refuses the configuration writes `ok: false` and the error's
own message, which the benchmark prints as the refusal.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (`vllm:spec_decode_*`), summed over engines; {} without speculation."""
    totals: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name == metric.name:
            continue
        if name in COUNTERS:
            totals[name] = totals.get(name, 0) + int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            previous = totals.get(name, [0] * len(metric.values))
            totals[name] = [a + int(b) for a, b in zip(previous, metric.values)]
    return totals


def counter_delta(after: dict, before: dict) -> dict:
    delta = {}
    for name, value in after.items():
        if isinstance(value, list):
            delta[name] = [a - b for a, b in zip(value, before.get(name, [0] * len(value)))]
        else:
            delta[name] = value - before.get(name, 0)
    return delta


def request_metrics(completion) -> dict | None:
    metrics = getattr(completion, "spec_decode_metrics", None)
    return None if metrics is None else metrics.to_dict()


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    speculative = job["speculative_config"]
    # vLLM refuses per-request acceptance records without speculation.
    records = {"per_request_spec_decode_metrics": "detailed"} if speculative else {}
    llm = LLM(model=job["target"], tokenizer=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              speculative_config=speculative, enforce_eager=True, seed=job["seed"], disable_log_stats=False,
              max_num_seqs=1, **records)
    load_s = time.perf_counter() - started
    sampling = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], seed=job["seed"],
                              stop_token_ids=job["stop_token_ids"], ignore_eos=False)
    warmup = SamplingParams(temperature=job["temperature"], max_tokens=8, seed=job["seed"])
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], warmup, use_tqdm=False)
    before = spec_counters(llm)
    prompts = []
    for ids in job["prompts"]:
        wall, cpu = time.perf_counter(), time.process_time()
        (output,) = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        completion = output.outputs[0]
        prompts.append({"token_ids": list(completion.token_ids), "generate_s": wall, "cpu_s": cpu,
                        "finish_reason": completion.finish_reason, "spec": request_metrics(completion)})
    return {"ok": True, "vllm_version": vllm.__version__, "load_s": load_s, "prompts": prompts,
            "counters": counter_delta(spec_counters(llm), before)}


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as err:  # the engine's refusal, reported by the benchmark as one line
        result = {"ok": False, "error_type": type(err).__name__, "error": str(err).strip(),
                  "traceback": traceback.format_exc(limit=8)}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
