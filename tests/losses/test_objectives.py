"""Position weights, confidence BCE and the per-drafter objectives against hand-computed values."""

import math

import pytest
import torch

from deepspec.losses.confidence import confidence_bce, confidence_targets
from deepspec.losses.distribution import DistributionTerms
from deepspec.losses.objectives import dflash_objective, dspark_objective, eagle3_objective, mtp_objective
from deepspec.losses.position_weights import position_weights, ttt_step_weights

torch.set_num_threads(1)


def make_terms(ce, tv, soft_ce=None, labels_valid=None):
    ce = torch.tensor(ce, dtype=torch.float32, requires_grad=True)
    tv = torch.tensor(tv, dtype=torch.float32, requires_grad=True)
    soft = None if soft_ce is None else torch.tensor(soft_ce, dtype=torch.float32, requires_grad=True)
    valid = torch.ones(len(ce), dtype=torch.bool) if labels_valid is None else torch.tensor(labels_valid)
    zeros = torch.zeros(len(ce), dtype=torch.long)
    return DistributionTerms(ce, tv, soft, zeros, zeros, valid)


def test_position_and_step_weights():
    torch.testing.assert_close(position_weights(3, gamma=2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert position_weights(7).shape == (7,) and float(position_weights(7)[4]) == pytest.approx(math.exp(-1.0))
    torch.testing.assert_close(ttt_step_weights(4), torch.tensor([1.0, 0.8, 0.64, 0.512]))
    with pytest.raises(ValueError, match="gamma"):
        position_weights(3, gamma=0.0)
    with pytest.raises(ValueError, match="num_steps"):
        ttt_step_weights(0)


def test_confidence_targets_and_bce_closed_form():
    tv = torch.tensor([0.0, 0.5, 2.0, 1.2])
    targets = confidence_targets(tv)
    torch.testing.assert_close(targets, torch.tensor([1.0, 0.75, 0.0, 0.4]))
    logits = torch.tensor([2.0, -1.0, 0.3, 0.0])
    c = torch.sigmoid(logits)
    expected = -(targets * c.log() + (1 - targets) * (1 - c).log())
    torch.testing.assert_close(confidence_bce(logits, targets), expected)
    # Stable for large logits: log(1 + e^-100) ~ 1e-44, no inf/nan.
    big = confidence_bce(torch.tensor([100.0, -100.0]), torch.tensor([1.0, 1.0]))
    assert big[0] == pytest.approx(0.0, abs=1e-6) and big[1] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="must match"):
        confidence_bce(logits, targets[:2])


def test_dspark_objective_hand_example():
    # Two blocks of K=2; block 1's second slot is unsupervised.
    terms = make_terms(ce=[1.0, 2.0, 3.0, 4.0], tv=[0.2, 0.4, 0.6, 0.8], labels_valid=[True, True, True, False])
    position = torch.tensor([0, 1, 0, 1])
    weights = torch.tensor([1.0, 0.5])
    conf_logits = torch.tensor([0.0, 1.0, -1.0, 5.0], requires_grad=True)
    out = dspark_objective(terms, conf_logits, position, weights)
    ce = (1.0 * 1 + 0.5 * 2 + 1.0 * 3) / 2
    tv = (1.0 * 0.2 + 0.5 * 0.4 + 1.0 * 0.6) / 2
    bce = confidence_bce(conf_logits.detach(), 1 - 0.5 * torch.tensor([0.2, 0.4, 0.6, 0.8]))
    conf = float(1.0 * bce[0] + 0.5 * bce[1] + 1.0 * bce[2]) / 2
    assert out.parts["ce"] == pytest.approx(ce) and out.parts["tv"] == pytest.approx(tv)
    assert out.parts["conf"] == pytest.approx(conf, rel=1e-6)
    assert float(out.total.detach()) == pytest.approx(0.1 * ce + 0.9 * tv + 1.0 * conf, rel=1e-6)
    assert out.parts["num_blocks"] == 2
    torch.testing.assert_close(out.per_position["ce"], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(out.per_position["tv"], torch.tensor([0.4, 0.4]))
    out.total.backward()
    # d total / d tv_row = 0.9 * w / num_blocks (the confidence label is detached).
    torch.testing.assert_close(terms.tv_N.grad, torch.tensor([0.45, 0.225, 0.45, 0.0]))
    assert conf_logits.grad[3] == 0


def test_losses_do_not_scale_with_batch_size():
    single = make_terms(ce=[1.0, 2.0], tv=[0.3, 0.1])
    doubled = make_terms(ce=[1.0, 2.0, 1.0, 2.0], tv=[0.3, 0.1, 0.3, 0.1])
    weights = position_weights(2)
    a = dspark_objective(single, None, torch.tensor([0, 1]), weights)
    b = dspark_objective(doubled, None, torch.tensor([0, 1, 0, 1]), weights)
    assert float(a.total.detach()) == pytest.approx(float(b.total.detach()))
    c = dspark_objective(doubled, None, torch.tensor([0, 1, 0, 1]), weights, num_blocks=4)
    assert float(c.total.detach()) == pytest.approx(float(a.total.detach()) / 2)


def test_dflash_objective_ce_only_and_optional_tv():
    terms = make_terms(ce=[1.0, 2.0], tv=[0.3, 0.1])
    position, weights = torch.tensor([0, 1]), torch.tensor([1.0, 0.25])
    out = dflash_objective(terms, position, weights)
    assert float(out.total.detach()) == pytest.approx(1.0 + 0.5)
    assert out.parts["tv"] == pytest.approx(0.3 + 0.025)  # logged, not trained
    with_tv = dflash_objective(terms, position, weights, tv_weight=2.0)
    assert float(with_tv.total.detach()) == pytest.approx(1.5 + 2.0 * 0.325)


def test_eagle3_objective_weights_steps():
    steps = [
        make_terms(ce=[1.0, 3.0], tv=[0.0, 0.0], soft_ce=[2.0, 4.0]),
        make_terms(ce=[5.0, 7.0], tv=[0.0, 0.0], soft_ce=[6.0, 9.0], labels_valid=[True, False]),
    ]
    out = eagle3_objective(steps, ttt_step_weights(2))
    assert float(out.total.detach()) == pytest.approx(3.0 + 0.8 * 6.0)
    assert out.parts["ce_step1"] == pytest.approx(5.0)
    torch.testing.assert_close(out.per_position["soft_ce"], torch.tensor([3.0, 6.0]))
    with pytest.raises(ValueError, match="step weights"):
        eagle3_objective(steps, ttt_step_weights(3))


def test_mtp_objective_lambda_over_depth():
    modules = [make_terms(ce=[1.0, 3.0], tv=[0.0, 0.0], soft_ce=[1.5, 3.5]),
               make_terms(ce=[4.0], tv=[0.0], soft_ce=[5.0])]
    assert float(mtp_objective(modules).total.detach()) == pytest.approx(0.3 / 2 * (2.0 + 4.0))
    assert float(mtp_objective(modules, 0.5, kl=True).total.detach()) == pytest.approx(0.5 / 2 * (2.5 + 5.0))


def test_objective_input_errors():
    terms = make_terms(ce=[1.0, 2.0], tv=[0.3, 0.1])
    with pytest.raises(ValueError, match="position_index_N"):
        dspark_objective(terms, None, torch.tensor([0, 2]), torch.ones(2))
    with pytest.raises(ValueError, match="confidence_logits_N"):
        dspark_objective(terms, torch.zeros(3), torch.tensor([0, 1]), torch.ones(2))
    missing = DistributionTerms(terms.ce_N, None, None, terms.draft_argmax_N, terms.target_argmax_N, terms.valid_N)
    with pytest.raises(ValueError, match="tv"):
        dspark_objective(missing, None, torch.tensor([0, 1]), torch.ones(2))


def test_logged_scalars_and_per_position_means_wait_for_a_reader(monkeypatch):
    """What only logging reads costs a step nothing: the parts stay on the device until `parts` is read (then one
    copy for all of them) and the per-position means are computed at their first read."""
    import deepspec.losses.objectives as objectives

    computed, copies = [], []
    real_mean, real_tolist = objectives.per_position_mean, torch.Tensor.tolist
    monkeypatch.setattr(objectives, "per_position_mean", lambda *a: computed.append(1) or real_mean(*a))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(1) or real_tolist(self))
    terms = make_terms(ce=[1.0, 2.0, 3.0, 4.0], tv=[0.2, 0.4, 0.6, 0.8])
    out = dspark_objective(terms, None, torch.tensor([0, 1, 0, 1]), torch.tensor([1.0, 0.5]))
    assert computed == [] and copies == []
    assert out.parts["ce"] == pytest.approx((1.0 + 1.0 + 3.0 + 2.0) / 2) and out.parts["num_blocks"] == 2
    assert copies == [1]
    assert out.parts["num_blocks"] == 2  # a second read is served by the first copy
    assert copies == [1]  # read once
    torch.testing.assert_close(out.per_position["tv"], torch.tensor([0.4, 0.6]))
    assert len(computed) == 2  # ce and tv, once
    assert "ce" in out.per_position  # a second read computes nothing
    assert len(computed) == 2

