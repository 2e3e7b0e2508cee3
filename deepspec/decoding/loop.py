"""Chain speculative decoding, one request: propose -> (truncate by policy) -> verify -> accept -> crop.

Lossless by construction: every emitted token comes from `accept_draft`, which accepts a draft
token with probability min(1, p_t/p_d) and otherwise samples the residual (or the bonus token),
so the output law equals the target's under the same SamplingParams; at temperature 0 it is the
target's greedy output token for token. `autoregressive_generate` is the no-drafter baseline on
the same verifier code path (one scored token per step).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from deepspec.decoding.acceptance import Acceptance, AcceptanceNoise
from deepspec.decoding.proposal import GenerationResult, RoundRecord
from deepspec.decoding.proposers import NoDraftProposer, Proposer
from deepspec.decoding.sampling import SamplingParams, sample_from_logits
from deepspec.decoding.verifier import TargetVerifier

# (confidence_K or None, max_len) -> number of draft tokens to verify for this request.
LengthPolicy = Callable[[torch.Tensor | None, int], int]


def truncate_at_stop(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Truncate at the first EOS (kept) or at max_new_tokens; report whether generation is done."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1], True
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], True
    return tokens, False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def speculative_generate(verifier: TargetVerifier, proposer: Proposer, prompt_ids: list[int] | torch.Tensor,
                         max_new_tokens: int, sampling: SamplingParams, *, eos_token_ids=(),
                         generator: torch.Generator | None = None, length_policy: LengthPolicy | None = None,
                         acceptance_backend: str | Acceptance = "auto") -> GenerationResult:
    """Generate up to `max_new_tokens` tokens for one prompt; returns tokens and per-round records.

    `acceptance_backend`: a backend name or an `Acceptance` shared over several calls (its backend is
    resolved once)."""
    accept = acceptance_backend if isinstance(acceptance_backend, Acceptance) else Acceptance(acceptance_backend)
    device = next(verifier.model.parameters()).device
    prompt_1T = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
    if prompt_1T.shape[1] == 0:
        raise ValueError("prompt_ids is empty")
    eos = set(int(e) for e in eos_token_ids)

    t0 = time.perf_counter()
    verifier.reset()
    scored = verifier.score(prompt_1T)
    proposer.reset(prompt_1T[0], scored.features_BTF[0], scored.final_hidden_BTH[0])
    # The first token is the target's own sample: the anchor of the first round.
    anchor = int(sample_from_logits(scored.logits_BTV[:, -1], sampling, generator)[0])
    synchronize(device)
    result = GenerationResult(token_ids=[anchor], prefill_s=time.perf_counter() - t0)
    tokens, done = truncate_at_stop(result.token_ids, max_new_tokens, eos)

    t_decode = time.perf_counter()
    while not done:
        anchor_pos = verifier.length  # the anchor is not in the target cache yet
        t_draft = time.perf_counter()
        proposal = proposer.propose(anchor, anchor_pos, sampling, generator)
        drafted = proposal.num_tokens
        # Never verify past what the request may still emit (the bonus token counts as one).
        max_len = min(drafted, max_new_tokens - len(tokens) - 1)
        length = max_len if length_policy is None else min(length_policy(
            None if proposal.confidence_BK is None else proposal.confidence_BK[0], max_len), max_len)
        proposal = proposal.truncate(max(length, 0))
        synchronize(device)
        t_verify = time.perf_counter()

        k = proposal.num_tokens
        candidates_1K1 = torch.cat([torch.tensor([[anchor]], device=device), proposal.token_ids_BK], dim=1)
        scored = verifier.score(candidates_1K1)
        noise = None if sampling.is_greedy else AcceptanceNoise.draw(
            1, k, scored.logits_BTV.shape[-1], generator=generator, device=device)
        accepted = accept(proposal.token_ids_BK, proposal.probs_BKV, scored.logits_BTV,
                          torch.tensor([k], device=device), sampling, noise)
        n = int(accepted.num_accepted_B[0])
        emitted = accepted.output_ids_BK1[0, : n + 1].tolist()
        # Keep the target K/V of the anchor and the accepted drafts; drop the rejected ones.
        verifier.keep(k + 1, n + 1)
        proposer.on_accept(candidates_1K1[0, : n + 1], scored.features_BTF[0, : n + 1],
                           scored.final_hidden_BTH[0, : n + 1])
        synchronize(device)
        t_end = time.perf_counter()
        result.rounds.append(RoundRecord(proposed=k, accepted=n, draft_s=t_verify - t_draft,
                                         verify_s=t_end - t_verify, drafted=drafted))
        anchor = emitted[-1]
        tokens, done = truncate_at_stop(tokens + emitted, max_new_tokens, eos)
    result.token_ids = tokens
    result.decode_s = time.perf_counter() - t_decode
    return result


def autoregressive_generate(verifier: TargetVerifier, prompt_ids, max_new_tokens: int, sampling: SamplingParams,
                            *, eos_token_ids=(), generator: torch.Generator | None = None,
                            acceptance_backend: str | Acceptance = "auto") -> GenerationResult:
    """Plain decoding with the same verifier: one target forward per token."""
    return speculative_generate(verifier, NoDraftProposer(), prompt_ids, max_new_tokens, sampling,
                                eos_token_ids=eos_token_ids, generator=generator, acceptance_backend=acceptance_backend)


@torch.no_grad()
def decoded_tau(verifier: TargetVerifier, proposer: Proposer, prompts, max_new_tokens: int, sampling: SamplingParams,
                *, eos_token_ids=(), seed: int = 0, acceptance_backend: str | Acceptance = "auto") -> dict:
    """The real loop over `prompts` (token id lists): tokens per round pooled over every round of every prompt.

    Prompt i draws with a generator seeded `seed + i`, so the number does not depend on what ran before.
    Returns {"tau", "num_rounds", "num_tokens", "decode_s"}; tau is NaN when no round ran.
    """
    accept = acceptance_backend if isinstance(acceptance_backend, Acceptance) else Acceptance(acceptance_backend)
    device = next(verifier.model.parameters()).device
    rounds = emitted = 0
    seconds = 0.0
    for index, prompt in enumerate(prompts):
        generator = torch.Generator(device=device).manual_seed(seed + index)
        result = speculative_generate(verifier, proposer, prompt, max_new_tokens, sampling, eos_token_ids=eos_token_ids,
                                      generator=generator, acceptance_backend=accept)
        rounds += len(result.rounds)
        emitted += sum(r.tau for r in result.rounds)
        seconds += result.decode_s
    return {"tau": emitted / rounds if rounds else float("nan"), "num_rounds": rounds, "num_tokens": emitted,
            "decode_s": seconds}
