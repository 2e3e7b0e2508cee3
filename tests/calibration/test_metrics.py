"""ECE / AUROC / Brier / reliability bins against hand-computed and brute-force references."""

import itertools

import numpy as np
import pytest
import torch

from deepspec.calibration.metrics import auroc, brier_score, expected_calibration_error, reliability_bins


def test_ece_hand_computed_two_bins():
    probs = [0.1, 0.2, 0.6, 0.9]
    labels = [0, 1, 1, 1]
    # bin [0, .5): mean p .15, acc .5 -> gap .35, weight 2/4; bin [.5, 1]: mean p .75, acc 1 -> gap .25
    assert expected_calibration_error(probs, labels, num_bins=2) == pytest.approx(0.5 * 0.35 + 0.5 * 0.25)


def test_ece_soft_labels_and_perfect_calibration_is_zero():
    probs_N = np.linspace(0.0, 1.0, 101)
    assert expected_calibration_error(probs_N, probs_N, num_bins=20) == pytest.approx(0.0, abs=1e-12)
    # Soft labels: every prediction 0.8, expected acceptance 0.6 -> ECE = 0.2 with any binning.
    assert expected_calibration_error(np.full(10, 0.8), np.full(10, 0.6), num_bins=7) == pytest.approx(0.2)


def test_ece_probability_one_lands_in_last_bin():
    bins = reliability_bins([1.0, 0.0], [1, 0], num_bins=4)
    assert bins["counts"] == [1, 0, 0, 1]
    assert bins["edges"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert bins["mean_confidence"][1] is None and bins["accuracy"][1] is None
    assert bins["accuracy"][3] == 1.0


def test_brier_hard_and_soft():
    assert brier_score([0.9, 0.2], [1, 0]) == pytest.approx((0.01 + 0.04) / 2)
    assert brier_score(torch.tensor([0.5]), torch.tensor([0.25])) == pytest.approx(0.0625)


def _pairwise_auroc(scores, labels):
    wins = total = 0.0
    for (si, yi), (sj, yj) in itertools.product(zip(scores, labels), repeat=2):
        weight = yi * (1 - yj)
        total += weight
        wins += weight * (1.0 if si > sj else 0.5 if si == sj else 0.0)
    return wins / total


def test_auroc_matches_pairwise_definition_with_ties_and_soft_labels():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=40) / 4.0  # many ties
    hard = rng.integers(0, 2, size=40).astype(float)
    soft = rng.random(40)
    assert auroc(scores, hard) == pytest.approx(_pairwise_auroc(scores, hard), abs=1e-12)
    assert auroc(scores, soft) == pytest.approx(_pairwise_auroc(scores, soft), abs=1e-12)


def test_auroc_hand_values():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)


def test_auroc_degenerate_labels_raise():
    with pytest.raises(ValueError, match="all positive"):
        auroc([0.2, 0.3], [1, 1])
    with pytest.raises(ValueError, match="all negative"):
        auroc([0.2, 0.3], [0, 0])


def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="probs: values must lie in"):
        expected_calibration_error([1.5], [1])
    with pytest.raises(ValueError, match="labels: values must lie in"):
        brier_score([0.5], [2])
    with pytest.raises(ValueError, match="NaN"):
        expected_calibration_error([float("nan")], [1])
    with pytest.raises(ValueError, match="probs has 2 values but labels has 1"):
        expected_calibration_error([0.1, 0.2], [1])
