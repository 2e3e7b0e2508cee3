"""Per-position agreement / expected acceptance and simulated tau on hand examples."""

import math

import pytest
import torch

from deepspec.losses.distribution import DistributionTerms
from deepspec.losses.metrics import AcceptanceMetrics, acceptance_metrics, simulated_acceptance_length

torch.set_num_threads(1)


def example():
    # Block 10 (K=3): TV 0.2, 0.4, 1.0 -> accept 0.9, 0.8, 0.5; argmax agrees, agrees, differs.
    # Block 3: TV 0.0, 2.0, (slot 2 unsupervised) -> accept 1.0, 0.0; agrees, agrees.
    tv = torch.tensor([0.2, 0.4, 1.0, 0.0, 2.0, 0.6])
    draft_argmax = torch.tensor([1, 2, 3, 4, 5, 6])
    target_argmax = torch.tensor([1, 2, 0, 4, 5, 0])
    valid = torch.tensor([True, True, True, True, True, False])
    terms = DistributionTerms(None, tv, None, draft_argmax, target_argmax, valid)
    position = torch.tensor([0, 1, 2, 0, 1, 2])
    block = torch.tensor([10, 10, 10, 3, 3, 3])
    return terms, position, block


def test_simulated_tau_hand_example():
    terms, position, block = example()
    accept = 1 - terms.tv_N / 2
    tau = simulated_acceptance_length(accept, terms.valid_N, position, block, 3)
    # Blocks sorted by id: block 3 first.
    expected_block3 = 1 + 1.0 + 1.0 * 0.0
    expected_block10 = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.5
    torch.testing.assert_close(tau, torch.tensor([expected_block3, expected_block10], dtype=torch.float64))


def test_acceptance_metrics_per_position_and_tau():
    terms, position, block = example()
    metrics = acceptance_metrics(terms, position, block, 3)
    torch.testing.assert_close(metrics["top1_agreement"], torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(metrics["expected_acceptance"], torch.tensor([0.95, 0.4, 0.5], dtype=torch.float64))
    tau_expected = ((1 + 1.0) + (1 + 0.9 + 0.72 + 0.36)) / 2
    assert metrics["tau_sim"] == pytest.approx(tau_expected)
    assert metrics["tau_greedy_sim"] == pytest.approx(((1 + 2) + (1 + 2)) / 2)
    assert metrics["num_blocks"] == 2


def test_accumulator_sums_batches_and_state_roundtrip():
    terms, position, block = example()
    accumulator = AcceptanceMetrics(3)
    accumulator.update(terms, position, block)
    accumulator.update(terms, position, block)
    two_batches = accumulator.compute()
    single = acceptance_metrics(terms, position, block, 3)
    assert two_batches["tau_sim"] == pytest.approx(single["tau_sim"]) and two_batches["num_blocks"] == 4
    # All-reduce of two identical ranks == two batches.
    one_rank = AcceptanceMetrics(3)
    one_rank.update(terms, position, block)
    reduced = AcceptanceMetrics(3)
    reduced.load_state_tensor(one_rank.state_tensor() * 2)
    torch.testing.assert_close(reduced.state_tensor(), accumulator.state_tensor())
    empty = AcceptanceMetrics(3).compute()
    assert math.isnan(empty["tau_sim"]) and torch.isnan(empty["top1_agreement"]).all()
    with pytest.raises(ValueError, match="state"):
        reduced.load_state_tensor(torch.zeros(5))


def test_metrics_input_errors():
    terms, position, block = example()
    with pytest.raises(ValueError, match="at most once"):
        acceptance_metrics(terms, position, torch.zeros(6, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="position_index_N"):
        acceptance_metrics(terms, position + 1, block, 3)
    with pytest.raises(ValueError, match="block_index_N"):
        acceptance_metrics(terms, position, block[:3], 3)
