"""Verification-side acceptance (rejection sampling): the PyTorch reference, its inputs and its result.

Terminology (as in vLLM's rejection sampler): for request b the proposer drafted
`num_draft_B[b]` tokens x_0..x_{n-1}; the target scored prefix+x[:j] for j = 0..n in one forward.
- accepted tokens: the longest prefix of drafts that passes the test `u_j * p_d(x_j) < p_t(x_j)`
  (accept with probability min(1, p_t/p_d); written without a division so p_d(x)=0 is safe);
- recovered token: at the first rejection j, a sample from norm(max(0, p_t - p_d)) at row j;
- bonus token: when all n drafts are accepted, a sample from p_t at row n.
Each request emits num_accepted + 1 tokens. This is exactly lossless: the emitted tokens follow
the (filtered) target law. Greedy (temperature 0) accepts while draft == argmax(target) and then
emits the target argmax, so the output equals plain greedy decoding token for token.

Randomness is an input (`AcceptanceNoise`) so the Triton kernel (acceptance_triton.py, same signature)
and this reference produce the same tokens for the same noise; acceptance.py dispatches between them.
Samples use the exponential race: argmax_v(w_v / E_v) with E_v ~ Exp(1) i.i.d. is a sample from
w / sum(w), so the residual is never normalised.

Shape legend: B = requests, K = max draft tokens per request, K1 = K + 1 target rows, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepspec.decoding.sampling import SamplingParams, process_logits

# Residual mass sum(max(0, p_t - p_d)) equals the rejection probability TV(p_t, p_d). Below this
# value the residual is treated as float rounding noise and a rejection as having happened with
# (analytic) probability ~0: the residual direction is meaningless, so the recovered token is drawn
# from p_t instead. The change to the emitted law is < 2 * mass. 1e-8 is the DSpark reference's
# threshold: a real residual of 1e-8..1e-5 (a near-perfect draft row) is sampled, not replaced by p_t.
RESIDUAL_MASS_EPS = 1e-8


@dataclass
class AcceptanceNoise:
    """Random inputs of one verification round; drawn in torch so kernels can be compared exactly.

    uniform_BK: float32 in [0, 1), one per draft position (the accept test).
    exponential_BV: float32 Exp(1) noise (> 0), one row per request for its single
    recovered-or-bonus sample (only one such sample is ever needed per request per round).
    """

    uniform_BK: torch.Tensor
    exponential_BV: torch.Tensor

    @classmethod
    def draw(
        cls,
        batch: int,
        num_draft: int,
        vocab: int,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> "AcceptanceNoise":
        uniform_BK = torch.rand(batch, num_draft, generator=generator, device=device, dtype=torch.float32)
        exponential_BV = torch.empty(batch, vocab, device=device, dtype=torch.float32)
        exponential_BV.exponential_(generator=generator)
        # Exp(1) can round to exactly 0; 0 would make w/E = inf or nan (0/0) in the race.
        exponential_BV.clamp_(min=torch.finfo(torch.float32).tiny)
        return cls(uniform_BK=uniform_BK, exponential_BV=exponential_BV)


@dataclass
class AcceptResult:
    output_ids_BK1: torch.Tensor  # [B, K+1] int64: accepted drafts then the recovered/bonus token, -1 padded
    num_accepted_B: torch.Tensor  # [B] int64: draft tokens accepted
    num_emitted_B: torch.Tensor  # [B] int64: num_accepted + 1


def validate_inputs(
    draft_ids_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    target_logits_BK1V: torch.Tensor,
    num_draft_B: torch.Tensor,
    params: SamplingParams,
    noise: AcceptanceNoise | None,
) -> None:
    if draft_ids_BK.ndim != 2:
        raise ValueError(f"draft_ids_BK must be [B, K], got shape {tuple(draft_ids_BK.shape)}")
    batch, num_draft = draft_ids_BK.shape
    if target_logits_BK1V.ndim != 3 or tuple(target_logits_BK1V.shape[:2]) != (batch, num_draft + 1):
        raise ValueError(
            f"target_logits_BK1V must be [B, K+1, V] = [{batch}, {num_draft + 1}, V], "
            f"got shape {tuple(target_logits_BK1V.shape)}"
        )
    vocab = target_logits_BK1V.shape[2]
    if draft_probs_BKV is not None and tuple(draft_probs_BKV.shape) != (batch, num_draft, vocab):
        raise ValueError(
            f"draft_probs_BKV must be [B, K, V] = [{batch}, {num_draft}, {vocab}], "
            f"got shape {tuple(draft_probs_BKV.shape)}"
        )
    if tuple(num_draft_B.shape) != (batch,):
        raise ValueError(f"num_draft_B must be [B] = [{batch}], got shape {tuple(num_draft_B.shape)}")
    if batch > 0 and (int(num_draft_B.min()) < 0 or int(num_draft_B.max()) > num_draft):
        raise ValueError(f"num_draft_B values must be in [0, K={num_draft}], got {num_draft_B.tolist()}")
    if not params.is_greedy:
        if noise is None:
            raise ValueError("noise is required when params.temperature > 0 (sampled acceptance)")
        if tuple(noise.uniform_BK.shape) != (batch, num_draft):
            raise ValueError(f"noise.uniform_BK must be [{batch}, {num_draft}], got {tuple(noise.uniform_BK.shape)}")
        if tuple(noise.exponential_BV.shape) != (batch, vocab):
            raise ValueError(
                f"noise.exponential_BV must be [{batch}, {vocab}], got {tuple(noise.exponential_BV.shape)}"
            )


def _assemble_output(
    draft_ids_BK: torch.Tensor, last_token_B: torch.Tensor, num_accepted_B: torch.Tensor
) -> AcceptResult:
    batch, num_draft = draft_ids_BK.shape
    slot_K1 = torch.arange(num_draft + 1, device=draft_ids_BK.device)
    padded_drafts_BK1 = torch.cat([draft_ids_BK.long(), draft_ids_BK.new_full((batch, 1), -1).long()], dim=1)
    output_ids_BK1 = torch.where(slot_K1 < num_accepted_B[:, None], padded_drafts_BK1, -1)
    output_ids_BK1 = torch.where(slot_K1 == num_accepted_B[:, None], last_token_B[:, None], output_ids_BK1)
    return AcceptResult(output_ids_BK1, num_accepted_B, num_accepted_B + 1)


def _accepted_prefix_length(accept_BK: torch.Tensor, num_draft_B: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of accepted positions, counting only the first num_draft_B[b]."""
    slot_K = torch.arange(accept_BK.shape[1], device=accept_BK.device)
    accept_BK = accept_BK & (slot_K < num_draft_B[:, None])
    return torch.cumprod(accept_BK.long(), dim=1).sum(dim=1)


def accept_draft_torch(
    draft_ids_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    target_logits_BK1V: torch.Tensor,
    num_draft_B: torch.Tensor,
    params: SamplingParams,
    noise: AcceptanceNoise | None,
) -> AcceptResult:
    """PyTorch reference of `accept_draft` (dense probabilities; readable, used for testing)."""
    batch, num_draft = draft_ids_BK.shape
    vocab = target_logits_BK1V.shape[2]
    num_draft_B = num_draft_B.long()
    rows_B = torch.arange(batch, device=draft_ids_BK.device)
    # Positions past num_draft_B[b] may hold padding (e.g. -1): clamp only to index safely.
    safe_ids_BK = draft_ids_BK.long().clamp(0, vocab - 1)

    if params.is_greedy:
        target_argmax_BK1 = target_logits_BK1V.float().argmax(dim=-1)
        num_accepted_B = _accepted_prefix_length(safe_ids_BK == target_argmax_BK1[:, :num_draft], num_draft_B)
        return _assemble_output(draft_ids_BK, target_argmax_BK1[rows_B, num_accepted_B], num_accepted_B)

    target_probs_BK1V = torch.softmax(process_logits(target_logits_BK1V, params), dim=-1)
    p_target_BK = target_probs_BK1V[:, :num_draft].gather(-1, safe_ids_BK[..., None])[..., 0]
    if draft_probs_BKV is None:
        p_draft_BK = torch.ones_like(p_target_BK)  # deterministic proposal: p_d(x) = 1
    else:
        p_draft_BK = draft_probs_BKV.float().gather(-1, safe_ids_BK[..., None])[..., 0]
    accept_BK = noise.uniform_BK.float() * p_draft_BK < p_target_BK
    num_accepted_B = _accepted_prefix_length(accept_BK, num_draft_B)

    # One recovered-or-bonus sample per request, from target row num_accepted_B[b].
    p_target_BV = target_probs_BK1V[rows_B, num_accepted_B]
    rejected_B = num_accepted_B < num_draft_B
    last_draft_row_B = num_accepted_B.clamp(max=max(num_draft - 1, 0))
    if num_draft == 0:
        p_draft_BV = torch.zeros_like(p_target_BV)
    elif draft_probs_BKV is None:
        rejected_ids_B = safe_ids_BK[rows_B, last_draft_row_B]
        p_draft_BV = torch.zeros_like(p_target_BV).scatter_(-1, rejected_ids_B[:, None], 1.0)
    else:
        p_draft_BV = draft_probs_BKV.float()[rows_B, last_draft_row_B]
    # Bonus rows subtract nothing: the residual of a bonus row is p_t itself.
    p_draft_BV = torch.where(rejected_B[:, None], p_draft_BV, 0.0)
    residual_BV = (p_target_BV - p_draft_BV).clamp_min(0.0)
    degenerate_B = residual_BV.sum(dim=-1) < RESIDUAL_MASS_EPS
    weights_BV = torch.where(degenerate_B[:, None], p_target_BV, residual_BV)
    last_token_B = (weights_BV / noise.exponential_BV.float()).argmax(dim=-1)
    return _assemble_output(draft_ids_BK, last_token_B, num_accepted_B)
