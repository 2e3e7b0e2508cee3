"""Paper appendix A, numerically: a retrospective (no early stop) scheduler biases the output law.

Scenario (verbatim from the appendix): one request (R = 1), gamma = 2, vocabulary {A, B}.
Position 1: target p_t = (0.7, 0.3), draft p_d = (0.5, 0.5), so the pre-token confidence is
c_1 = sum_x min(p_t, p_d) = 0.8. The Markov confidence head reads the sampled x_1:
c_2 = 0.9 if x_1 = A, 0 if x_1 = B. SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.
Position-2 distributions are chosen so that c_2 is exactly their acceptance rate:
after A: p_t = (0.9, 0.1), p_d = (1, 0) -> 0.9; after B: p_t = (1, 0), p_d = (0, 1) -> 0.

Verification is plain rejection sampling (accept x with prob min(1, p_t(x)/p_d(x)), else sample
norm(max(0, p_t - p_d)); bonus from p_t when every admitted token is accepted). A token not
produced this round comes from the next round, whose law is p_t for a lossless round.
Checks: exact enumeration (law of the first two output tokens) and a 200k-sample Monte Carlo.
"""

import itertools

import numpy as np
import pytest

from deepspec.decoding.scheduler import retrospective_prefix_lengths, schedule_prefix_lengths

A, B = 0, 1
TARGET_1 = np.array([0.7, 0.3])
DRAFT_1 = np.array([0.5, 0.5])
TARGET_2 = {A: np.array([0.9, 0.1]), B: np.array([1.0, 0.0])}  # conditioned on x_1
DRAFT_2 = {A: np.array([1.0, 0.0]), B: np.array([0.0, 1.0])}
APPENDIX_SPS = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__


def _acceptance_rate(p_t, p_d):
    return float(np.minimum(p_t, p_d).sum())


def _confidence_after(x1):
    return [[_acceptance_rate(TARGET_1, DRAFT_1), _acceptance_rate(TARGET_2[x1], DRAFT_2[x1])]]


def _residual(p_t, p_d):
    mass = np.maximum(p_t - p_d, 0.0)
    return mass / mass.sum()


def _accept_prob(p_t, p_d, x):
    return min(1.0, p_t[x] / p_d[x])


def _exact_output_law(scheduler, sps):
    """P(Y1 = y1, Y2 = y2) by enumerating draft tokens and verification outcomes."""
    law = np.zeros((2, 2))
    for x1, x2 in itertools.product((A, B), repeat=2):
        p_draws = DRAFT_1[x1] * DRAFT_2[x1][x2]
        if p_draws == 0.0:
            continue
        length = scheduler(_confidence_after(x1), sps)[0]
        if length == 0:  # target samples Y1 itself; Y2 from the next round
            law += p_draws * np.outer(TARGET_1, np.ones(2)) * np.stack([TARGET_2[A], TARGET_2[B]])
            continue
        alpha1 = _accept_prob(TARGET_1, DRAFT_1, x1)
        # Rejected at position 1: Y1 ~ residual, Y2 ~ p_t(. | Y1) next round.
        law += p_draws * (1 - alpha1) * np.outer(_residual(TARGET_1, DRAFT_1), np.ones(2)) * np.stack(
            [TARGET_2[A], TARGET_2[B]]
        )
        if length == 1:  # accepted x1, bonus from p_t(. | x1)
            law[x1] += p_draws * alpha1 * TARGET_2[x1]
        else:
            alpha2 = _accept_prob(TARGET_2[x1], DRAFT_2[x1], x2)
            law[x1, x2] += p_draws * alpha1 * alpha2
            law[x1] += p_draws * alpha1 * (1 - alpha2) * _residual(TARGET_2[x1], DRAFT_2[x1])
    return law


TARGET_JOINT = np.outer(TARGET_1, np.ones(2)) * np.stack([TARGET_2[A], TARGET_2[B]])


def test_scenario_matches_the_appendix_numbers():
    assert _confidence_after(A) == [[pytest.approx(0.8), pytest.approx(0.9)]]
    assert _confidence_after(B) == [[pytest.approx(0.8), 0.0]]
    # Early stop: Theta_1 = 0.9 < Theta_0 = 1.0 -> l = 0 whatever x_1 is.
    assert [schedule_prefix_lengths(_confidence_after(x), APPENDIX_SPS) for x in (A, B)] == [[0], [0]]
    # Retrospective: Theta_2 = 1.134 after A (l = 2); 0.81 after B (l = 0).
    assert [retrospective_prefix_lengths(_confidence_after(x), APPENDIX_SPS) for x in (A, B)] == [[2], [0]]


def test_exact_law_retrospective_is_biased_algorithm1_is_not():
    retro = _exact_output_law(retrospective_prefix_lengths, APPENDIX_SPS)
    algo1 = _exact_output_law(schedule_prefix_lengths, APPENDIX_SPS)
    np.testing.assert_allclose(retro.sum(axis=1), [0.85, 0.15], atol=1e-12)
    np.testing.assert_allclose(algo1.sum(axis=1), TARGET_1, atol=1e-12)
    np.testing.assert_allclose(algo1, TARGET_JOINT, atol=1e-12)


def test_exact_law_algorithm1_admitting_tokens_stays_lossless():
    # Flat SPS: Algorithm 1 admits x_1 always and x_2 only after A (a_2 = 0 after B): the
    # admission of x_2 depends on x_1 but never on x_2 itself, so the law is still exact.
    lengths = [schedule_prefix_lengths(_confidence_after(x), lambda b: 1.0) for x in (A, B)]
    assert lengths == [[2], [1]]
    np.testing.assert_allclose(_exact_output_law(schedule_prefix_lengths, lambda b: 1.0), TARGET_JOINT, atol=1e-12)


def _sample(p_NV, u_N):
    """Inverse-CDF sampling of one token per row."""
    return (u_N[:, None] > np.cumsum(p_NV, axis=1)[:, :-1]).sum(axis=1)


def _monte_carlo_first_token(scheduler, sps, num_samples, seed):
    rng = np.random.default_rng(seed)
    x1_N = _sample(np.tile(DRAFT_1, (num_samples, 1)), rng.random(num_samples))
    # The scheduler is a pure function of its input, so one call per distinct x_1 suffices.
    length_by_x1 = {x: scheduler(_confidence_after(x), sps)[0] for x in (A, B)}
    length_N = np.where(x1_N == A, length_by_x1[A], length_by_x1[B])
    accept_N = rng.random(num_samples) < np.minimum(1.0, TARGET_1[x1_N] / DRAFT_1[x1_N])
    residual_token_N = _sample(np.tile(_residual(TARGET_1, DRAFT_1), (num_samples, 1)), rng.random(num_samples))
    target_token_N = _sample(np.tile(TARGET_1, (num_samples, 1)), rng.random(num_samples))
    admitted_N = length_N >= 1
    y1_N = np.where(admitted_N, np.where(accept_N, x1_N, residual_token_N), target_token_N)
    return np.bincount(y1_N, minlength=2) / num_samples


def test_monte_carlo_200k_reproduces_the_bias():
    num_samples = 200_000  # std of a frequency <= 0.0011; tolerance 0.005 is > 4 sigma
    retro = _monte_carlo_first_token(retrospective_prefix_lengths, APPENDIX_SPS, num_samples, seed=0)
    algo1 = _monte_carlo_first_token(schedule_prefix_lengths, APPENDIX_SPS, num_samples, seed=0)
    # Flat SPS: Algorithm 1 admits x_1 for every draw, so the rejection-sampling path is exercised.
    algo1_admitting = _monte_carlo_first_token(schedule_prefix_lengths, lambda b: 1.0, num_samples, seed=1)
    np.testing.assert_allclose(retro, [0.85, 0.15], atol=0.005)
    np.testing.assert_allclose(algo1, TARGET_1, atol=0.005)
    np.testing.assert_allclose(algo1_admitting, TARGET_1, atol=0.005)
    assert abs(retro[A] - TARGET_1[A]) > 0.1
