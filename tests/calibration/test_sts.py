"""Sequential Temperature Scaling: recovery of known temperatures, order preservation, bad input."""

import json

import numpy as np
import pytest
import torch

from deepspec.calibration.sts import CalibrationResult, apply_temperatures, sequential_temperature_scaling

OVERCONFIDENCE = 3.0


def _synthetic(num_blocks, num_positions, seed):
    """True conditional acceptance p = sigmoid(u); the head reports logits 3u (over-confident)."""
    rng = np.random.default_rng(seed)
    true_logits_NK = rng.normal(1.0, 1.5, size=(num_blocks, num_positions))
    true_conditional_NK = 1.0 / (1.0 + np.exp(-true_logits_NK))
    return rng, OVERCONFIDENCE * true_logits_NK, true_conditional_NK


def test_recovers_temperature_with_analytic_labels():
    _, logits_NK, true_conditional_NK = _synthetic(3000, 4, seed=0)
    survival_NK = np.cumprod(true_conditional_NK, axis=1)
    result = sequential_temperature_scaling(logits_NK, survival_NK, label_kind="analytic")
    assert result.temperatures == pytest.approx([OVERCONFIDENCE] * 4, rel=1e-3)
    assert result.mean_ece_after <= 0.5 * result.mean_ece_before
    assert max(result.ece_after) < 0.01 < min(result.ece_before)
    assert all(after < before for after, before in zip(result.brier_after, result.brier_before))
    assert result.num_samples == [3000] * 4 and result.notes == []


def test_recovers_temperature_with_hard_labels():
    rng, logits_NK, true_conditional_NK = _synthetic(20000, 3, seed=1)
    accepted_NK = rng.random(true_conditional_NK.shape) < true_conditional_NK
    survival_NK = np.cumprod(accepted_NK, axis=1).astype(np.float64)
    result = sequential_temperature_scaling(logits_NK, survival_NK, label_kind="hard")
    assert result.temperatures == pytest.approx([OVERCONFIDENCE] * 3, rel=0.15)
    assert result.mean_ece_after <= 0.5 * result.mean_ece_before
    assert all(0.6 < a < 1.0 for a in result.auroc)


def test_valid_mask_counts_samples_per_position():
    rng, logits_NK, true_conditional_NK = _synthetic(2000, 4, seed=2)
    block_len_N = rng.integers(2, 5, size=2000)  # blocks end after 2..4 positions
    valid_NK = np.arange(4)[None, :] < block_len_N[:, None]
    survival_NK = np.cumprod(true_conditional_NK, axis=1)
    survival_NK[~valid_NK] = 7.0  # garbage beyond the block end must be ignored
    result = sequential_temperature_scaling(logits_NK, survival_NK, valid_NK=valid_NK)
    assert result.num_samples == valid_NK.sum(axis=0).tolist()
    assert result.temperatures == pytest.approx([OVERCONFIDENCE] * 4, rel=0.05)


def test_temperature_scaling_preserves_order():
    _, logits_NK, true_conditional_NK = _synthetic(500, 4, seed=3)
    result = sequential_temperature_scaling(logits_NK, np.cumprod(true_conditional_NK, axis=1))
    calibrated_NK = apply_temperatures(logits_NK, result.temperatures)
    raw_NK = apply_temperatures(logits_NK, [1.0] * 4)
    for k in range(4):  # ranking of c_k across blocks is unchanged at every position
        assert np.array_equal(np.argsort(raw_NK[:, k], kind="stable"), np.argsort(calibrated_NK[:, k], kind="stable"))
    # Position 1's cumulative product is c_1 itself; along each block the cumulative product never rises.
    cumulative_NK = np.cumprod(calibrated_NK, axis=1)
    assert np.array_equal(np.argsort(cumulative_NK[:, 0], kind="stable"), np.argsort(logits_NK[:, 0], kind="stable"))
    assert np.all(np.diff(cumulative_NK, axis=1) <= 0)


def test_apply_temperatures_torch_matches_numpy():
    logits_NK = torch.tensor([[2.0, -1.0], [0.5, 4.0]], dtype=torch.float32)
    out = apply_temperatures(logits_NK, [2.0, 0.5])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected = 1.0 / (1.0 + np.exp(-np.array([[1.0, -2.0], [0.25, 8.0]])))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="temperatures must be finite and > 0"):
        apply_temperatures(logits_NK, [1.0, 0.0])
    with pytest.raises(ValueError, match="2 positions but 3 temperatures"):
        apply_temperatures(logits_NK, [1.0, 1.0, 1.0])


def test_degenerate_positions_keep_unit_temperature_with_note():
    rng, logits_NK, true_conditional_NK = _synthetic(200, 3, seed=4)
    survival_NK = np.cumprod(rng.random((200, 3)) < true_conditional_NK, axis=1).astype(float)
    survival_NK[:, 2] = 0.0  # nobody survives position 3
    result = sequential_temperature_scaling(logits_NK, survival_NK, label_kind="hard")
    assert result.temperatures[2] == 1.0
    assert result.auroc[2] is None
    assert any(note.startswith("position 3: none survived in 200 samples") for note in result.notes)
    assert all(np.isfinite(v) for v in result.ece_after + result.brier_after)

    all_survive_NK = np.ones((60, 1))
    result = sequential_temperature_scaling(np.zeros((60, 1)), all_survive_NK, label_kind="hard")
    assert result.temperatures == [1.0] and "position 1: all survived" in result.notes[0]


def test_too_few_samples_names_position_and_count():
    _, logits_NK, true_conditional_NK = _synthetic(80, 3, seed=5)
    valid_NK = np.ones((80, 3), dtype=bool)
    valid_NK[40:, 2] = False
    with pytest.raises(ValueError, match="position 3: only 40 valid samples, need at least min_samples=50"):
        sequential_temperature_scaling(logits_NK, np.cumprod(true_conditional_NK, axis=1), valid_NK=valid_NK)
    with pytest.raises(ValueError, match="position 1: only 30 valid samples"):
        sequential_temperature_scaling(logits_NK[:30], np.cumprod(true_conditional_NK[:30], axis=1))


def test_bad_labels_raise():
    logits_NK = np.zeros((60, 2))
    with pytest.raises(ValueError, match="label_kind='hard' needs labels in"):
        sequential_temperature_scaling(logits_NK, np.full((60, 2), 0.5), label_kind="hard")
    rising_NK = np.tile([0.3, 0.6], (60, 1))
    with pytest.raises(ValueError, match="pass prefix survival"):
        sequential_temperature_scaling(logits_NK, rising_NK)
    holes_NK = np.ones((60, 2), dtype=bool)
    holes_NK[0, 0] = False
    with pytest.raises(ValueError, match="valid positions must be a prefix"):
        sequential_temperature_scaling(logits_NK, np.full((60, 2), 0.5), valid_NK=holes_NK)
    with pytest.raises(ValueError, match="label_kind must be one of"):
        sequential_temperature_scaling(logits_NK, np.full((60, 2), 0.5), label_kind="soft")


def test_result_json_round_trip(tmp_path):
    _, logits_NK, true_conditional_NK = _synthetic(100, 2, seed=6)
    result = sequential_temperature_scaling(logits_NK, np.cumprod(true_conditional_NK, axis=1), num_bins=10)
    restored = CalibrationResult.from_json(json.loads(json.dumps(result.to_json())))
    assert restored == result
    result.save(tmp_path / "calibration.json")
    assert CalibrationResult.load(tmp_path / "calibration.json") == result
    with pytest.raises(ValueError, match="temperatures at position"):
        CalibrationResult.from_json({**result.to_json(), "temperatures": [1.0, -2.0]})
    with pytest.raises(ValueError, match="unknown field"):
        CalibrationResult.from_json({**result.to_json(), "bogus": 1})


def test_reliability_diagram_png_is_written(tmp_path):
    from deepspec.calibration.plots import save_reliability_diagrams

    _, logits_NK, true_conditional_NK = _synthetic(300, 3, seed=7)
    result = sequential_temperature_scaling(logits_NK, np.cumprod(true_conditional_NK, axis=1))
    path = save_reliability_diagrams(result, tmp_path / "fig" / "reliability.png", positions=[1, 3])
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    single = save_reliability_diagrams(result.bins_before, tmp_path / "before.png")
    assert single.stat().st_size > 1000
    with pytest.raises(ValueError, match=r"positions \[4\] out of range 1..3"):
        save_reliability_diagrams(result, tmp_path / "bad.png", positions=[4])
