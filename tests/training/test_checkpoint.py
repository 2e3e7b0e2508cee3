"""Checkpoints record a checksum per file; resume verifies them and falls back past a damaged newest one."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from deepspec.training.checkpoint import checkpoint_problems, latest_checkpoint, list_checkpoints


@pytest.fixture(scope="module")
def killed_run(tt, tiny_cache, tmp_path_factory):
    """A run killed after step 3 with a checkpoint at every step: step-00000001..3."""
    from deepspec.training import run

    out = tmp_path_factory.mktemp("killed_run")
    result = run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=1", "faults.stop_after=3")))
    assert result["stopped"] and [p.name for p in list_checkpoints(out)] == [f"step-0000000{s}" for s in (1, 2, 3)]
    return out


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    "flipped byte in the weights": ("drafter/model.safetensors", flip_byte),
    "truncated safetensors": ("optimizer.safetensors", truncate),
    "truncated trainer_state.json": ("trainer_state.json", truncate),
    "missing optimizer file": ("optimizer.safetensors", lambda path: path.unlink()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_checkpoint_is_named_and_skipped(killed_run, tmp_path, caplog, damage):
    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    name, apply = DAMAGES[damage]
    damaged = out / "checkpoints" / "step-00000003" / name
    assert checkpoint_problems(out / "checkpoints" / "step-00000003") == []
    apply(damaged)
    with caplog.at_level(logging.WARNING, logger="deepspec.training.checkpoint"):
        assert latest_checkpoint(out) == out / "checkpoints" / "step-00000002"
    assert f"checkpoint {out / 'checkpoints' / 'step-00000003'} is damaged" in caplog.text
    assert str(damaged) in caplog.text


def test_resume_past_a_damaged_checkpoint_matches_the_uninterrupted_run(tt, killed_run, tiny_cache, reference_run,
                                                                        tmp_path, caplog):
    from deepspec.training import run

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    flip_byte(out / "checkpoints" / "step-00000003" / "drafter" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="deepspec.training.checkpoint"):
        result = run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=1")))
    assert result["step"] == 4 and "step-00000003 is damaged" in caplog.text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == [1, 2, 3, 4]  # steps 3 was logged before the kill and again after resume: once now
    assert [r["loss"] for r in records if r["split"] == "train"] == pytest.approx(tt.train_losses(reference_run),
                                                                                  rel=1e-6, abs=1e-7)
    assert checkpoint_problems(out / "checkpoints" / "step-00000003") == []  # replaced by a valid one


def test_pruning_never_leaves_only_a_damaged_checkpoint(tt, killed_run, tiny_cache, tmp_path):
    from deepspec.training import run

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    for step in (2, 3):
        truncate(out / "checkpoints" / f"step-0000000{step}" / "optimizer.safetensors")
    # Resumes from step 1, saves step 2 with keep_last=1 and is killed: the damaged step 3 does not count.
    run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=1", "trainer.keep_last=1",
                                      "faults.stop_after=2")))
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002", "step-00000003"]
    assert latest_checkpoint(out) == out / "checkpoints" / "step-00000002"


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(killed_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    for step in (1, 2, 3):
        (out / "checkpoints" / f"step-0000000{step}" / "checksums.json").unlink()
    with pytest.raises(ValueError, match=r"no valid checkpoint to resume from \(damaged: step-00000003, "
                                         r"step-00000002, step-00000001.*trainer.resume=false"):
        latest_checkpoint(out)


def test_a_full_disk_at_a_save_keeps_the_last_checkpoint_and_the_rerun_resumes_from_it(tt, killed_run, tiny_cache,
                                                                                     reference_run, tmp_path):
    from deepspec.training import run
    from deepspec.utils.faults import full_disk
    from deepspec.utils.io import DiskFullError

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    overrides = tt.train_overrides(tiny_cache, out, "trainer.save_every=1")
    with full_disk(out, free_bytes=1_000_000):  # room for config.yaml, not for a checkpoint (~10 MB)
        with pytest.raises(DiskFullError) as error:
            run(tt.compose(overrides))
        message = str(error.value)
    assert message.startswith(f"{out / 'checkpoints' / 'step-00000004'}: no space left on device (it needs about ")
    assert ("the partial step-00000004.tmp was removed; the last complete checkpoint is step-00000003, unchanged "
            "(rerunning the same command resumes from it)") in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-0000000{s}" for s in (1, 2, 3)]
    assert checkpoint_problems(out / "checkpoints" / "step-00000003") == []
    assert run(tt.compose(overrides))["step"] == 4  # with space again: resumes from step 3, as after a kill
    assert tt.train_losses(out) == pytest.approx(tt.train_losses(reference_run), rel=1e-6, abs=1e-7)


def test_a_fresh_start_moves_the_earlier_run_aside_and_a_later_resume_takes_its_own(tt, killed_run, tiny_cache,
                                                                                    tmp_path, caplog):
    """trainer.resume=false in a folder holding another run's checkpoints: they go (with its metrics.jsonl) to
    previous-<time>/, saying so, so the next resume continues this run, not the earlier one."""
    from deepspec.training import run

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    earlier_metrics = (out / "metrics.jsonl").read_text()
    fresh = tt.train_overrides(tiny_cache, out, "trainer.save_every=2", "trainer.resume=false")
    with caplog.at_level(logging.WARNING, logger="deepspec.training.checkpoint"):
        result = run(tt.compose([*fresh, "faults.stop_after=2"]))
    assert result["stopped"] and result["step"] == 2
    [aside] = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert ("trainer.resume=false: the earlier run's checkpoints (step-00000001, step-00000002, step-00000003) and "
            f"metrics.jsonl moved to {aside}") in caplog.text
    assert [p.name for p in list_checkpoints(aside)] == ["step-00000001", "step-00000002", "step-00000003"]
    assert (aside / "metrics.jsonl").read_text() == earlier_metrics
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002"]  # this run's only
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepspec.training.session"):
        assert run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=2")))["step"] == 4
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} (step 2" in caplog.text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]


def test_a_resume_with_another_drafter_shape_names_the_settings_that_differ(tt, killed_run, tiny_cache, tmp_path):
    from deepspec.training import run

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    with pytest.raises(ValueError) as error:
        run(tt.compose(tt.train_overrides(tiny_cache, out, "drafter.markov_rank=16")))
    message = str(error.value)
    assert message.startswith(f"{out / 'checkpoints' / 'step-00000003'}: this checkpoint's drafter has another "
                              "shape than this run's (drafter.markov_rank=8 there, 16 here; e.g. ")
    assert "\n" not in message and "trainer.resume=false" in message
    assert [p.name for p in list_checkpoints(out)] == [f"step-0000000{s}" for s in (1, 2, 3)]  # nothing changed


def test_a_damaged_metrics_line_never_blocks_a_resume(tt, killed_run, tiny_cache, tmp_path, caplog):
    """A byte that is not UTF-8 in metrics.jsonl: the line is dropped, named in a warning, and the run resumes."""
    from deepspec.training import run

    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    lines = (out / "metrics.jsonl").read_bytes().split(b"\n")
    lines[1] = lines[1][:10] + b"\xff" + lines[1][11:]
    (out / "metrics.jsonl").write_bytes(b"\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="deepspec.training.log"):
        assert run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=1")))["step"] == 4
    assert f"{out / 'metrics.jsonl'}: dropped 1 line(s) that are no metrics record" in caplog.text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 3, 4]  # step 2's line was the damaged one
