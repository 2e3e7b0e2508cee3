"""Held-out validation on the cache's validation split: loss terms and acceptance metrics, all-reduced.

Metrics (deepspec.losses.metrics.AcceptanceMetrics): per-position top-1 agreement with the target, expected
acceptance 1 - TV/2 per position, simulated acceptance length tau (bonus token included) from the
TV-based and the greedy (top-1) acceptance. Loss parts are averaged over validation micro-batches.

TV is needed for the acceptance metrics even where the objective does not train on it (DFlash's default
tv_weight 0): validation asks the objective for it (`with_metrics=True`), which computes it without
weighting it into the loss.

Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively inside forward): a
rank without a batch of its own re-runs the first one and discards the result.

Decoded tau (`trainer.decode_eval_prompts`): the simulated tau scores teacher-forced blocks of the validation
data; the real loop (`deepspec.decoding.loop.decoded_tau`) drafts from the drafter's own proposals and the
target's own continuation. `run_decode_validation` decodes the prompts of the first validation samples
(`heldout_prompts`: the tokens before their first supervised token) at each configured temperature and reports
`tau_decoded_T<t>` with its gap to the simulated value of the same temperature (`tau_gap_T0` = decoded minus
`tau_greedy_sim`, `tau_gap_T1` = decoded minus `tau_sim`). Rank 0 decodes alone (the other ranks go on to the
next step), so it needs the whole drafter on rank 0: not under ZeRO-3.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from deepspec.decoding.loop import decoded_tau
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.proposers import make_proposer
from deepspec.losses.metrics import AcceptanceMetrics

DEFAULT_DECODE_EVAL_PROMPTS = 4
LARGE_TARGET_PARAMS = 10**9  # decode_eval_prompts=null turns decoding off from this target size on
SIMULATED_TAU_AT = {0.0: "tau_greedy_sim", 1.0: "tau_sim"}  # temperature -> its simulated counterpart


@torch.no_grad()
def run_validation(model, data, num_positions: int, rank: int, world: int, device: torch.device,
                   dtype: torch.dtype) -> dict:
    """`model(batch, with_metrics=True) -> (loss, StepResult)` (the engine over session.TrainingModule); `data`
    a `TrainingData`."""
    val_ids = data.val_ids
    if not val_ids:
        return {}
    micro = data.micro_batch_size
    per_round = micro * world
    num_rounds = math.ceil(len(val_ids) / per_round)
    metrics = AcceptanceMetrics(num_positions)
    part_sums: dict[str, float] = {}
    num_batches = 0
    was_training = model.module.training
    model.eval()
    for round_index in range(num_rounds):
        start = round_index * per_round + rank * micro
        ids = val_ids[start:start + micro]
        real = bool(ids)
        batch = data.collate_validation(ids if real else val_ids[:micro]).to(device, dtype)
        _, result = model(batch, with_metrics=True)
        if not real:  # the loss parts' names still count: every rank all-reduces a state of the same length
            for name in result.loss.parts:
                part_sums.setdefault(name, 0.0)
            continue
        metrics.update(result.terms, result.position_index_N, result.block_index_N)
        for name, value in result.loss.parts.items():
            part_sums[name] = part_sums.get(name, 0.0) + float(value)
        num_batches += 1
    if was_training:
        model.train()
    names = sorted(part_sums)
    state = torch.cat([metrics.state_tensor(), torch.tensor([part_sums[n] for n in names] + [num_batches],
                                                            dtype=torch.float64)])
    if world > 1:
        dist.all_reduce(state)
    metrics.load_state_tensor(state[: metrics.state_size])
    totals = state[metrics.state_size:]
    batches = max(float(totals[-1]), 1.0)
    out = {f"loss_{n}": float(totals[i]) / batches for i, n in enumerate(names)}
    out.update(metrics.compute())
    out["num_samples"] = len(val_ids)
    return out


def decode_eval_prompt_count(configured: int | None, target_model) -> int:
    """`trainer.decode_eval_prompts`, or its default for this target when null (module docstring)."""
    if configured is not None:
        return int(configured)
    num_params = sum(p.numel() for p in target_model.parameters())
    return DEFAULT_DECODE_EVAL_PROMPTS if num_params < LARGE_TARGET_PARAMS else 0


def heldout_prompts(reader, sample_ids: list[int], num: int, max_prompt_tokens: int) -> list[list[int]]:
    """Up to `num` prompts: of each sample in order, the tokens before its first supervised token (the rendered
    user turn and generation prompt), skipping samples whose prompt is longer than `max_prompt_tokens`."""
    prompts = []
    for i in sample_ids:
        if len(prompts) == num:
            break
        ids_T, mask_T = reader.tokens(i)
        supervised = torch.nonzero(mask_T.bool()).flatten()
        if supervised.numel() and 0 < int(supervised[0]) <= max_prompt_tokens:
            prompts.append(ids_T[: int(supervised[0])].tolist())
    return prompts


def temperature_key(temperature: float) -> str:
    """`T0`, `T1`, `T0.7`: the suffix of the decoded-tau metrics."""
    return f"T{float(temperature):g}"


@torch.no_grad()
def run_decode_validation(drafter, target_model, prompts: list[list[int]], temperatures, max_new_tokens: int,
                          eos_token_ids, seed: int = 0, simulated: dict | None = None) -> dict:
    """`tau_decoded_T<t>` (and `decode_s_T<t>`) per temperature; with the simulated metrics, `tau_gap_T<t>`."""
    if not prompts:
        return {}
    was_training = drafter.training
    verifier = TargetVerifier(target_model, drafter.config.target_layer_ids)
    out = {}
    for temperature in temperatures:
        key = temperature_key(temperature)
        result = decoded_tau(verifier, make_proposer(drafter, target_model), prompts, max_new_tokens,
                             SamplingParams(temperature=float(temperature)), eos_token_ids=eos_token_ids, seed=seed)
        out[f"tau_decoded_{key}"] = result["tau"]
        out[f"decode_s_{key}"] = result["decode_s"]
        reference = SIMULATED_TAU_AT.get(float(temperature))
        if simulated and reference in simulated:
            out[f"tau_gap_{key}"] = result["tau"] - float(simulated[reference])
    drafter.train(was_training)
    out["decode_num_prompts"] = len(prompts)
    return out
