"""Fixtures shared by the acceptance tests here and the interpreted kernel tests in interpreted/."""

import pytest
import torch

from deepspec.decoding.acceptance import AcceptanceNoise
from deepspec.decoding.sampling import SamplingParams


def _small_residual_case(residual_mass: float, batch: int = 64, vocab: int = 8):
    """Target puts 1 - m on token 0 and m on token 1 (the rest masked by top-k); the draft proposes token 0
    with p_d(0) = 1 and u = 1 (the test u * p_d < p_t then fails even where p_t(0) rounds to 1), so every
    request rejects. The residual max(0, p_t - p_d) is m on token 1 and
    exactly 0 elsewhere: a sampled residual emits token 1, the p_t fallback emits token 0 (probability 1 - m)."""
    logits_V = torch.full((vocab,), -30.0)
    logits_V[0], logits_V[1] = 0.0, float(torch.log(torch.tensor(residual_mass / (1.0 - residual_mass))))
    logits_BK1V = logits_V.expand(batch, 2, vocab).clone()
    draft_probs_BKV = torch.zeros(batch, 1, vocab)
    draft_probs_BKV[..., 0] = 1.0
    noise = AcceptanceNoise.draw(batch, 1, vocab, torch.Generator().manual_seed(5))
    noise.uniform_BK.fill_(1.0)
    return (torch.zeros(batch, 1, dtype=torch.long), draft_probs_BKV, logits_BK1V, torch.ones(batch, dtype=torch.long),
            SamplingParams(temperature=1.0, top_k=2), noise)


@pytest.fixture
def small_residual_case():
    """Factory: residual mass -> accept_draft arguments (see _small_residual_case)."""
    return _small_residual_case
