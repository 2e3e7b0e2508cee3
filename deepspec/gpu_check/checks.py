"""The five checks: `check_<name>(ctx)` records figures with `ctx.record` and properties with `ctx.expect`.

Each runs in its own process (runner.py); all DeepSpec calls go through project.py. Figures only a GPU
can give are recorded as None in the CPU dry run, never estimated.

Shape legend: B = requests, K = draft tokens, K1 = K + 1, V = vocabulary, N = loss rows, H = hidden.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from deepspec.gpu_check import project
from deepspec.gpu_check.context import CheckContext

# (mode, temperature, top_k, top_p, with draft probabilities): greedy; sampling with the draft's
# distribution; a deterministic proposal (p_d = 1, e.g. n-gram); top-k + top-p filtering.
ACCEPT_MODES = (("greedy", 0.0, 0, 1.0, False), ("sampled", 1.0, 0, 1.0, True),
                ("sampled_deterministic_draft", 1.0, 0, 1.0, False), ("top_k_top_p", 0.8, 50, 0.9, True))
TARGET_DIR, PROMPTS_FILE, BENCH_PROMPTS_FILE = "target", "conversations.jsonl", "bench_prompts.jsonl"
WORDS = ("the of and to in is that it for on with as was at by this be from or have an they which one you were "
         "all we can her has there been if more when will would who so no time about many then them these some "
         "model token layer draft target cache block value train speed memory kernel batch loss step state "
         "python function return list number string error file data table chart answer question reason").split()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _peak_mb(fn) -> float:
    """Peak CUDA memory (MB) allocated while `fn()` runs beyond what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - baseline) / 2**20


# -- 1. acceptance kernel -------------------------------------------------------------------------


def _acceptance_case(batch, vocab, num_draft, mode, generator, device, logits_dtype):
    """Random round inputs where acceptance is partial: drafts near the target, ragged lengths, padding."""
    _, temperature, top_k, top_p, with_probs = mode
    params = project.sampling_params(temperature, top_k, top_p)
    logits_BK1V = 3.0 * torch.randn(batch, num_draft + 1, vocab, generator=generator, device=device)
    # Ragged: every length 0..K occurs over the batch when it is large enough; request 0 drafts K.
    num_draft_B = torch.randint(0, num_draft + 1, (batch,), generator=generator, device=device)
    num_draft_B[0] = num_draft
    draft_logits_BKV = logits_BK1V[:, :num_draft] + torch.randn(batch, num_draft, vocab, generator=generator,
                                                                device=device)
    if params.is_greedy:  # the target's argmax 70% of the time, else a random token
        agree_BK = torch.rand(batch, num_draft, generator=generator, device=device) < 0.7
        random_BK = torch.randint(0, vocab, (batch, num_draft), generator=generator, device=device)
        draft_ids_BK = torch.where(agree_BK, logits_BK1V[:, :num_draft].argmax(-1), random_BK)
        draft_probs_BKV = None
    else:
        probs_BKV = project.processed_probs(draft_logits_BKV, params)
        draft_ids_BK = torch.multinomial(probs_BKV.view(-1, vocab), 1, generator=generator).view(batch, num_draft)
        draft_probs_BKV = probs_BKV if with_probs else None
    slot_K = torch.arange(num_draft, device=device)
    draft_ids_BK = torch.where(slot_K < num_draft_B[:, None], draft_ids_BK, -1)  # padding past each length
    noise = project.draw_noise(batch, num_draft, vocab, generator, device)
    return draft_ids_BK, draft_probs_BKV, logits_BK1V.to(logits_dtype), num_draft_B, params, noise


def _compare_acceptance(vocab, batch, dtype, mode, num_draft, generator, device) -> tuple[bool, int, int, list]:
    """(same, accepted, drafted, differing rows) of one case: torch reference vs Triton, same inputs."""
    args = _acceptance_case(batch, vocab, num_draft, mode, generator, device, dtype)
    ref_accepted_B, ref_out_BK1 = project.accept("torch", *args)
    ker_accepted_B, ker_out_BK1 = project.accept("triton", *args)
    same = torch.equal(ref_accepted_B, ker_accepted_B) and torch.equal(ref_out_BK1, ker_out_BK1)
    rows = [] if same else (ref_out_BK1 != ker_out_BK1).any(-1).nonzero().flatten().tolist()
    return same, int(ref_accepted_B.sum()), int(args[3].sum()), rows


def _kernel_timing(ctx: CheckContext) -> None:
    """`deepspec bench kernels`: torch reference vs Triton per call (Triton only on CUDA)."""
    p = ctx.profile
    out_json = ctx.work_dir / "bench_kernels.json"
    ctx.run(project.bench_kernels_command(out_json, p.timing_batch_sizes, p.timing_vocab_sizes, p.accept_num_draft,
                                          p.timing_iters), "bench_kernels")
    bench = json.loads(out_json.read_text())
    columns = ("batch", "vocab", "mode", "torch_ms", "triton_ms", "speedup")
    ctx.record("timing", {"device": bench["device"], "iters": bench["iters"], "note": bench["note"],
                          "columns": list(columns), "rows": [[r.get(k) for k in columns] for r in bench["results"]]})
    batch, vocab, num_draft = p.goal_case
    goal = {r["mode"]: r.get("speedup") for r in bench["results"] if (r["batch"], r["vocab"]) == (batch, vocab)}
    met = None if ctx.device != "cuda" else bool(goal) and all(s is not None and s >= 3.0 for s in goal.values())
    ctx.record("goal_3x", {"case": f"B={batch} V={vocab} K={num_draft}", "speedup": goal, "met": met})


def check_acceptance(ctx: CheckContext) -> None:
    p, device = ctx.profile, ctx.device
    ctx.record("device_name", torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)")
    generator = torch.Generator(device=device).manual_seed(0)
    cases = [(v, b, torch.float32) for v in p.accept_vocab_sizes for b in p.accept_batch_sizes]
    cases.append((p.accept_bf16_case[1], p.accept_bf16_case[0], torch.bfloat16))
    num_cases = num_accepted = num_drafted = 0
    mismatches, errors = [], 0
    for vocab, batch, dtype in cases:
        for mode in ACCEPT_MODES:
            label = f"V={vocab} B={batch} {mode[0]} {str(dtype).removeprefix('torch.')}"
            result = ctx.attempt(label, _compare_acceptance, vocab, batch, dtype, mode, p.accept_num_draft,
                                 generator, device)
            num_cases += 1
            if result is None:
                errors += 1
                continue
            same, accepted, drafted, rows = result
            num_accepted, num_drafted = num_accepted + accepted, num_drafted + drafted
            if not same:
                mismatches.append(f"{label}: rows {rows[:8]} differ")
    ctx.record("equality", {"cases": num_cases, "mismatched_cases": len(mismatches), "errored_cases": errors,
                            "mismatches": mismatches[:10], "vocab_sizes": list(p.accept_vocab_sizes),
                            "batch_sizes": list(p.accept_batch_sizes), "num_draft": p.accept_num_draft,
                            "modes": [m[0] for m in ACCEPT_MODES],
                            "acceptance_rate": num_accepted / max(num_drafted, 1)})
    ctx.expect(not mismatches, f"Triton and torch acceptance differ in {len(mismatches)} of {num_cases} cases")
    ctx.expect(0 < num_accepted < num_drafted, "the cases accepted all or no drafts: the comparison is degenerate")
    ctx.attempt("bench_kernels", _kernel_timing, ctx)


# -- 2. fused TV-loss kernel ----------------------------------------------------------------------


def _loss_inputs(p, dtype, device, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden_NH = torch.randn(p.tv_rows, p.tv_hidden, generator=generator, device=device)
    head_VH = torch.randn(p.tv_vocab, p.tv_hidden, generator=generator, device=device) * p.tv_hidden**-0.5
    target_NH = hidden_NH + 0.5 * torch.randn(p.tv_rows, p.tv_hidden, generator=generator, device=device)
    labels_N = torch.randint(0, p.tv_vocab, (p.tv_rows,), generator=generator, device=device)
    labels_N[::7] = -100  # ignored rows
    return hidden_NH.to(dtype), head_VH.to(dtype), target_NH.to(dtype), labels_N


def _loss_and_grad(inputs, use_triton, chunk_rows):
    hidden_NH, head_VH, target_NH, labels_N = inputs
    hidden_NH = hidden_NH.detach().requires_grad_(True)
    ce_N, tv_N, soft_ce_N = project.distribution_terms(hidden_NH, head_VH, target_NH, labels_N,
                                                       use_triton=use_triton, chunk_rows=chunk_rows)
    (0.1 * ce_N.sum() + 0.9 * tv_N.sum() + 0.5 * soft_ce_N.sum()).backward()
    return (ce_N.detach(), tv_N.detach(), soft_ce_N.detach()), hidden_NH.grad


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


# Both paths are chunked identically and see the same logits; they differ only in how the softmax
# terms are reduced (kernel tiles vs torch), so the gap is float32 rounding.
VALUE_TOL = {"float32": 1e-4, "bfloat16": 1e-4}  # relative to max(1, |value|)
GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # relative to the largest gradient entry (bf16 gradients round)


def _compare_loss_paths(ctx: CheckContext, dtype: torch.dtype) -> None:
    """Fused Triton vs torch rows inside the chunked loss: values, gradients, time and peak memory."""
    p, device, name = ctx.profile, ctx.device, str(dtype).removeprefix("torch.")
    inputs = _loss_inputs(p, dtype, device)
    ref_terms, ref_grad = _loss_and_grad(inputs, False, p.tv_chunk_rows)
    ker_terms, ker_grad = _loss_and_grad(inputs, True, p.tv_chunk_rows)
    terms = ("ce", "tv", "soft_ce")
    diffs = {term: _max_diff(a, b) for term, a, b in zip(terms, ker_terms, ref_terms)}
    scale = {term: max(1.0, float(b.float().abs().max())) for term, b in zip(terms, ref_terms)}
    grad_scale = float(ref_grad.float().abs().max())
    diffs["grad"] = _max_diff(ker_grad, ref_grad)
    row = {"max_abs_diff": diffs, "max_abs_grad": grad_scale}
    for term in terms:
        ctx.expect(diffs[term] <= VALUE_TOL[name] * scale[term],
                   f"{name}: fused {term} differs from the torch path by {diffs[term]:.3g}")
    ctx.expect(diffs["grad"] <= GRAD_TOL[name] * grad_scale,
               f"{name}: fused gradient differs by {diffs['grad']:.3g} (largest entry {grad_scale:.3g})")
    for label, use_triton in (("fused", True), ("torch", False)):
        def step(use_triton=use_triton):
            return _loss_and_grad(inputs, use_triton, p.tv_chunk_rows)

        row[f"{label}_fwd_bwd_ms"] = _timed(step, device, p.tv_repeats) if device == "cuda" else None
        row[f"{label}_peak_mb"] = _peak_mb(step) if device == "cuda" else None
    ctx.record(name, row)


def _compare_bf16_rows(ctx: CheckContext) -> None:
    """The kernel on bf16 logit rows directly (it loads bf16 and writes a bf16 gradient)."""
    p, device = ctx.profile, ctx.device
    generator = torch.Generator(device=device).manual_seed(1)
    rows = min(p.tv_rows, 512)
    draft_NV = (3 * torch.randn(rows, p.tv_vocab, generator=generator, device=device)).bfloat16().requires_grad_(True)
    target_NV = (3 * torch.randn(rows, p.tv_vocab, generator=generator, device=device)).bfloat16()
    labels_N = torch.randint(0, p.tv_vocab, (rows,), generator=generator, device=device)
    outputs = {fused: project.row_terms(draft_NV, target_NV, labels_N, fused=fused) for fused in (True, False)}
    grads = {fused: torch.autograd.grad(sum(t.sum() for t in terms), draft_NV)[0] for fused, terms in outputs.items()}
    direct = {term: _max_diff(a, b) for term, a, b in zip(("ce", "tv", "soft_ce"), outputs[True], outputs[False])}
    direct["grad"] = _max_diff(grads[True], grads[False])
    direct["grad_dtype"] = str(grads[True].dtype).removeprefix("torch.")
    ctx.record("bf16_logit_rows", {"rows": rows, "max_abs_diff": direct})
    ctx.expect(direct["grad_dtype"] == "bfloat16", "the fused backward did not return a bf16 gradient")
    ctx.expect(max(direct["ce"], direct["tv"], direct["soft_ce"]) <= 1e-3,
               f"fused terms on bf16 logits differ from the reference: {direct}")


def _loss_memory_entry_point(ctx: CheckContext) -> None:
    """`deepspec bench loss-memory` as users run it: chunked (fused on CUDA) vs one-shot naive loss."""
    p = ctx.profile
    out_json = ctx.work_dir / "bench_loss_memory.json"
    command = project.loss_memory_command(out_json, p.tv_rows, p.tv_hidden, p.tv_vocab, p.tv_chunk_rows,
                                          ctx.device)
    ctx.run(command, "loss_memory")
    ctx.record("loss_memory_entry_point", project.read_loss_memory(out_json))


def check_tv_loss(ctx: CheckContext) -> None:
    p = ctx.profile
    ctx.record("shape", {"rows": p.tv_rows, "hidden": p.tv_hidden, "vocab": p.tv_vocab, "chunk_rows": p.tv_chunk_rows})
    for dtype in (torch.float32, torch.bfloat16):
        ctx.attempt(f"loss paths {dtype}", _compare_loss_paths, ctx, dtype)
        _free(ctx.device)
    ctx.attempt("bf16 logit rows", _compare_bf16_rows, ctx)
    _free(ctx.device)
    ctx.attempt("loss memory entry point", _loss_memory_entry_point, ctx)


# -- targets --------------------------------------------------------------------------------------


def check_target(ctx: CheckContext) -> None:
    """Write the random-weight target every later check loads, and the synthetic prompt files."""
    p = ctx.profile
    start = time.perf_counter()
    path = project.write_target(p.target_shape, ctx.work_dir / TARGET_DIR, ctx.device)
    size_mb = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    config = json.loads((path / "config.json").read_text())
    ctx.record("target", {"shape": p.target_shape, "path": str(path), "write_s": time.perf_counter() - start,
                          "size_mb": size_mb, "vocab_size": config["vocab_size"],
                          "num_hidden_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"]})
    rng = random.Random(0)

    def text(num_words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."

    conversations = [{"conversations": [{"role": "user", "content": text(rng.randint(6, 16))},
                                        {"role": "assistant", "content": text(rng.randint(30, 70))}]}
                     for _ in range(p.num_conversations)]
    (ctx.work_dir / PROMPTS_FILE).write_text("".join(json.dumps(c) + "\n" for c in conversations))
    prompts = [{"turns": [text(rng.randint(6, 16))]} for _ in range(max(p.bench_prompts, 8))]
    (ctx.work_dir / BENCH_PROMPTS_FILE).write_text("".join(json.dumps(c) + "\n" for c in prompts))
    loaded = project.load_target(path, "float32", ctx.device)  # the load path every entry point takes
    ids = project.chat_prompt_ids(loaded.tokenizer, prompts[0]["turns"][0])
    ctx.record("tokenizer", {"vocab": len(loaded.tokenizer), "prompt_tokens": len(ids),
                             "eos_token_id": loaded.tokenizer.eos_token_id, "conversations": len(conversations)})
    ctx.expect(len(loaded.tokenizer) == config["vocab_size"], "tokenizer and model vocabulary sizes differ")


# -- 3. training ----------------------------------------------------------------------------------


def _run_figures(run_dir: Path) -> dict:
    train, validation = project.train_records(run_dir)
    losses = [r["loss"] for r in train]
    finite = all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for v in losses)
    span = max(1, len(losses) // 4)  # mean of the first quarter vs the last quarter of the steps
    head, tail = losses[:span], losses[-span:]
    later = train[1:] or train  # step 1 includes the first kernels' compilation and allocations
    peaks = [r["peak_mem_mb"] for r in train if "peak_mem_mb" in r]
    return {
        "steps": len(losses), "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "loss_decreased": bool(losses) and statistics.mean(tail) < statistics.mean(head), "finite": finite,
        "step_ms_median": statistics.median(r["step_ms"] for r in later) if later else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in later) if later else None,
        "peak_mem_mb": max(peaks) if peaks else None,
        "tau_sim": validation[-1].get("tau_sim") if validation else None,
    }


def check_training(ctx: CheckContext) -> None:
    p, work = ctx.profile, ctx.work_dir
    target_dir, cache_dir, train_dir = work / TARGET_DIR, work / "cache", work / "train"
    for stale in (cache_dir, train_dir):  # a second run in the same folder would resume instead of measuring
        shutil.rmtree(stale, ignore_errors=True)
    _, seconds = ctx.run(project.cache_command(target_dir, work / PROMPTS_FILE, cache_dir, p.max_length, "bfloat16"),
                         "cache_hiddens")
    counts = project.cache_counts(cache_dir)
    size_mb = sum(f.stat().st_size for f in cache_dir.iterdir() if f.is_file()) / 2**20
    ctx.record("cache", {**counts, "size_mb": size_mb, "process_wall_s": seconds})
    common = dict(steps=p.train_steps, global_batch_size=p.global_batch_size, micro_batch_size=p.micro_batch_size,
                  max_tokens_per_row=p.max_tokens_per_row, device=ctx.device, dtype="bfloat16", extra=p.train_extra)
    # ZeRO-2: every drafter kind in one Hydra multirun process (one sub-folder per kind); then ZeRO-3 (never
    # run on a GPU before) for the chain drafters, one plain process each. A failed process is recorded and
    # the next one still runs.
    jobs = [("zero2", list(project.DRAFTER_KINDS), 2, train_dir / "zero2"),
            *((f"zero3-{kind}", [kind], 3, train_dir / f"zero3-{kind}") for kind in ("eagle3", "mtp"))]
    runs, processes = {}, {}
    for name, kinds, stage, run_dir in jobs:
        command = project.train_command(target_dir, cache_dir, kinds, stage, run_dir, **common)
        done = ctx.attempt(f"deepspec train {name}", ctx.run, command, f"train_{name}")
        processes[name] = {"wall_s": done[1] if done else None, "ok": done is not None}
        for kind in kinds:  # what a sweep finished is reported even if a later job of it failed
            folder = run_dir / kind if len(kinds) > 1 else run_dir
            if (folder / "metrics.jsonl").is_file():
                runs[f"zero{stage}/{kind}"] = _run_figures(folder)
        ctx.record("runs", runs)
        ctx.record("processes", processes)
    for label, run in runs.items():
        ctx.expect(run["steps"] == p.train_steps, f"{label}: {run['steps']} of {p.train_steps} steps logged")
        ctx.expect(run["finite"], f"{label}: non-finite loss")
        ctx.expect(run["loss_decreased"], f"{label}: loss did not decrease ({run['loss_first']} -> {run['loss_last']})")
    ctx.expect(len(runs) == len(project.DRAFTER_KINDS) + 2, f"only {sorted(runs)} produced metrics")


# -- 4. decoding ----------------------------------------------------------------------------------


def _greedy_kind(ctx: CheckContext, target, kind: str, prompts, references, label: str, must_match: bool) -> dict:
    """One drafter kind (random weights): speculative greedy output vs the target's greedy `generate`."""
    num_tokens = ctx.profile.greedy_tokens
    drafter = project.random_drafter(target, kind)
    matched, first_divergence, rounds, accepted = 0, None, 0, 0
    for prompt, reference in zip(prompts, references):
        tokens, num_rounds, num_accepted = project.speculative_greedy(target, drafter, prompt, num_tokens)
        rounds, accepted = rounds + num_rounds, accepted + num_accepted
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
        matched += same
        if (same < num_tokens or len(tokens) != len(reference)) and first_divergence is None:
            first_divergence = same
    identical = matched == num_tokens * len(prompts) and first_divergence is None
    if must_match:
        ctx.expect(identical, f"{label} {kind}: speculative greedy output differs from generate at token "
                              f"{first_divergence}")
    return {"identical": identical, "matched_tokens": matched, "first_divergence": first_divergence,
            "rounds": rounds, "accepted_drafts": accepted}


def _greedy_identity(ctx: CheckContext, target, prompt_texts: list[str], label: str, must_match: bool) -> dict:
    """Every drafter kind on one target; a kind that raises is recorded and the others still run."""
    prompts = [project.chat_prompt_ids(target.tokenizer, text) for text in prompt_texts]
    references = [project.greedy_generate(target.model, prompt, ctx.profile.greedy_tokens) for prompt in prompts]
    figures = {"tokens": ctx.profile.greedy_tokens * len(prompts)}
    for kind in project.DRAFTER_KINDS:
        figures[kind] = ctx.attempt(f"{label} {kind}", _greedy_kind, ctx, target, kind, prompts, references, label,
                                    must_match)
    return figures


def _greedy_on_saved_target(ctx: CheckContext, dtype: str, must_match: bool, greedy: dict) -> None:
    p = ctx.profile
    target = project.load_target(ctx.work_dir / TARGET_DIR, dtype, ctx.device)
    texts = _prompt_texts(ctx)[:p.greedy_prompts]
    greedy[f"{p.target_shape}/{dtype}"] = _greedy_identity(ctx, target, texts, f"{p.target_shape} {dtype}", must_match)


def _greedy_on_second_shape(ctx: CheckContext, greedy: dict) -> None:
    p = ctx.profile
    target = project.make_target(p.second_shape, ctx.device, torch.float32)
    texts = _prompt_texts(ctx)[:p.greedy_prompts]
    greedy[f"{p.second_shape}/float32"] = _greedy_identity(ctx, target, texts, f"{p.second_shape} float32", True)


def _prompt_texts(ctx: CheckContext) -> list[str]:
    lines = (ctx.work_dir / BENCH_PROMPTS_FILE).read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines]


def _bench_speed(ctx: CheckContext) -> None:
    """`deepspec bench speed` on the saved target (bf16 on CUDA) with one saved random drafter of each kind."""
    p, work, device = ctx.profile, ctx.work_dir, ctx.device
    dtype = "bf16" if device == "cuda" else "float32"
    target = project.load_target(work / TARGET_DIR, dtype, device)
    drafter_dirs = {kind: project.save_drafter(project.random_drafter(target, kind), work / "drafters" / kind)
                    for kind in project.DRAFTER_KINDS}
    del target
    _free(device)
    speed_json = work / "bench_speed.json"
    ctx.run(project.bench_speed_command(work / TARGET_DIR, drafter_dirs, work / BENCH_PROMPTS_FILE, speed_json,
                                        num_prompts=p.bench_prompts, max_new_tokens=p.bench_tokens,
                                        temperatures=p.bench_temperatures, dtype=dtype, device=device), "bench_speed")
    speed = json.loads(speed_json.read_text())
    keep = ("tau", "tokens_per_s", "speedup_vs_ar", "verify_cost_ratio", "draft_cost_ratio", "verify_ms_per_round",
            "draft_ms_per_round")
    ctx.record("bench_speed", {
        "dtype": speed["settings"]["dtype"], "device_name": speed["settings"]["device_name"],
        "max_new_tokens": speed["settings"]["max_new_tokens"], "num_prompts": speed["settings"]["num_prompts"],
        "ar_step_ms": {t: b["ar_loop"]["step_ms"] for t, b in speed["baselines"].items()},
        "hf_generate_tokens_per_s": {t: b["hf_generate"].get("tokens_per_s") for t, b in speed["baselines"].items()},
        "drafters": {name: {t: {k: row.get(k) for k in keep} for t, row in per_t.items()}
                     for name, per_t in speed["drafters"].items()}})


def _bench_batched(ctx: CheckContext) -> None:
    """`deepspec bench scheduler`: the batched loop at each concurrency, and the target's SPS table."""
    p, work = ctx.profile, ctx.work_dir
    batched_json = work / "bench_scheduler.json"
    ctx.run(project.bench_scheduler_command(work / TARGET_DIR, work / BENCH_PROMPTS_FILE, batched_json,
                                            concurrency=p.concurrency, max_new_tokens=p.batched_tokens,
                                            requests_per_slot=p.batched_requests_per_slot,
                                            context_len=p.batched_context_len,
                                            profile_repeats=p.batched_profile_repeats, device=ctx.device),
            "bench_scheduler")
    batched = json.loads(batched_json.read_text())
    by_concurrency = {str(r["concurrency"]): {mode: m["tokens_per_s"] for mode, m in r["modes"].items()}
                      for r in batched["results"]}
    # One request's SPS table: verifying B tokens costs sps(1) / sps(B) decode steps.
    single = next((r for r in batched["results"] if r["concurrency"] == 1), None)
    ratios = None
    if single is not None:
        sps = dict(zip(single["sps_table"]["batch_sizes"], single["sps_table"]["steps_per_second"]))
        ratios = {str(b): sps[min(sps)] / s for b, s in sorted(sps.items())}
    ctx.record("batched", {"tokens_per_s": by_concurrency, "verify_cost_by_tokens": ratios, "target_dtype": "float32",
                           "drafter": batched["drafter"], "max_new_tokens": batched["max_new_tokens"]})


def check_decoding(ctx: CheckContext) -> None:
    # float32: the contract is token-for-token equality. bf16: not exact by design (the target scores
    # k+1 tokens in one forward, whose rounding differs from one-token steps): agreement is reported.
    greedy = {}
    for dtype, must_match in (("float32", True), ("bfloat16", False)):
        ctx.attempt(f"greedy {dtype}", _greedy_on_saved_target, ctx, dtype, must_match, greedy)
        ctx.record("greedy_identity", greedy)
        _free(ctx.device)
    ctx.attempt("greedy second shape", _greedy_on_second_shape, ctx, greedy)
    ctx.record("greedy_identity", greedy)
    _free(ctx.device)
    ctx.attempt("bench_speed", _bench_speed, ctx)
    ctx.attempt("bench_scheduler", _bench_batched, ctx)
