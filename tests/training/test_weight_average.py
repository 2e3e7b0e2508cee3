"""trainer.ema_decay: the average of the weights is what checkpoints' drafter/ hold, training itself is untouched,
and a killed run resumes both the weights and their average."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from deepspec.training.averaging import WeightAverage, check_weight_average
from deepspec.training.checkpoint import DRAFTER_DIR, TRAINING_WEIGHTS_FILE, list_checkpoints


def _weights(checkpoint, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / name))


def test_average_follows_the_weights_and_swaps_back_exactly():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[1].bias.requires_grad_(False)  # frozen parameters are not averaged
    average = WeightAverage(module, decay=0.75)
    assert "1.bias" not in average.names
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    average.update()
    for name, value in average.state_dict().items():
        assert torch.allclose(value, start[name] + 0.25)  # 0.75 * w0 + 0.25 * (w0 + 1)
    own = {n: p.detach().clone() for n, p in module.named_parameters()}
    with average.swapped_in():
        assert torch.allclose(module[0].weight, start["0.weight"] + 0.25)
        assert torch.equal(module[1].bias, own["1.bias"])
    for name, param in module.named_parameters():
        assert torch.equal(param, own[name])
    with pytest.raises(ValueError, match="lacks the averaged weights of .*0.weight"):
        average.load_state_dict({"0.bias": torch.zeros(4)}, "somewhere.safetensors")


def test_configuration_is_checked():
    from deepspec.training.config import TrainerSchema

    with pytest.raises(ValueError, match="trainer.ema_decay=1.0 must be in"):
        TrainerSchema(ema_decay=1.0)
    with pytest.raises(ValueError, match="ZeRO stage 1 or 2, not 3"):
        check_weight_average(0.9, zero_stage=3)
    check_weight_average(0.9, zero_stage=2)
    check_weight_average(0.0, zero_stage=3)


def test_zero3_is_refused_before_any_weight_loads(tt, tiny_cache, tmp_path):
    from deepspec.training.config import plan_training, resolve_config

    overrides = tt.train_overrides(tiny_cache, tmp_path, "trainer.ema_decay=0.9", "deepspeed=zero3")
    cfg = resolve_config(tt.compose(overrides))
    with pytest.raises(ValueError, match="trainer.ema_decay > 0 needs the whole drafter"):
        plan_training(cfg, world_size=1, check_files=False)


def test_checkpoints_hold_the_average_and_training_is_untouched(tt, tiny_cache, reference_run, tmp_path):
    from deepspec.training import run

    run(tt.compose(tt.train_overrides(tiny_cache, tmp_path, "trainer.ema_decay=0.5", "trainer.save_every=1",
                                      "trainer.keep_last=4")))
    assert tt.train_losses(tmp_path) == pytest.approx(tt.train_losses(reference_run), rel=1e-6, abs=1e-7)
    third, fourth = list_checkpoints(tmp_path)[-2:]
    trained = _weights(fourth, TRAINING_WEIGHTS_FILE)
    reference = _weights(list_checkpoints(reference_run)[-1], f"{DRAFTER_DIR}/model.safetensors")
    averaged_3, averaged_4 = (_weights(c, f"{DRAFTER_DIR}/model.safetensors") for c in (third, fourth))
    moved = 0
    for name, weights in trained.items():
        assert torch.allclose(weights, reference[name], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(averaged_4[name], 0.5 * averaged_3[name] + 0.5 * weights, rtol=1e-5, atol=1e-6), name
        moved += not torch.allclose(averaged_4[name], weights)
    assert moved > 0  # the average is not the weights


def test_killed_run_resumes_weights_and_average(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    settings = ("trainer.ema_decay=0.5", "trainer.save_every=2")
    run(tt.compose(tt.train_overrides(tiny_cache, whole, *settings)))
    overrides = tt.train_overrides(tiny_cache, resumed, *settings)
    assert run(tt.compose([*overrides, "faults.stop_after=3"]))["stopped"]
    run(tt.compose(overrides))
    assert tt.train_losses(resumed) == pytest.approx(tt.train_losses(whole), rel=1e-6, abs=1e-7)
    for name in (TRAINING_WEIGHTS_FILE, f"{DRAFTER_DIR}/model.safetensors"):
        expected = _weights(list_checkpoints(whole)[-1], name)
        for key, value in _weights(list_checkpoints(resumed)[-1], name).items():
            assert torch.allclose(value, expected[key], rtol=1e-5, atol=1e-6), (name, key)
