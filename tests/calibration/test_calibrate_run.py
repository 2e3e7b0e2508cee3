"""`calibrate` end to end on a tiny target: files next to the drafter, temperatures in its config
(used by `propose` after reloading), empirical labels, after-training hook, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.cache import BuildJob, CacheReader, build_cache
from deepspec.cache.config import CacheSchema
from deepspec.calibration.cli import build_parser
from deepspec.calibration.config import CalibrationSchema
from deepspec.calibration.run import calibrate, calibrate_after_training, fit_prompt_lookup
from deepspec.calibration.sts import CalibrationResult
from deepspec.data.sources import Conversation
from deepspec.drafters.build import build_drafter, load_drafter

LAYERS = [0, 1, 2]
ANALYTIC = CalibrationSchema(labels="analytic", min_samples=5, max_anchors_per_seq=200)


def conversations(n: int, offset: int = 0) -> list[Conversation]:
    return [Conversation(id=f"c{offset + i}", messages=[
        {"role": "user", "content": "Tell me " + "xyz " * (i + 2)},
        {"role": "assistant", "content": "Sure " + "token " * (8 + 3 * i)}], source="test", line=i)
        for i in range(n)]


@pytest.fixture(scope="module")
def cache_dir(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    build_cache({"train": conversations(2), "validation": conversations(4, offset=10), "test": []}, tiny_llama,
                BuildJob(CacheSchema(out_dir=str(path), layer_ids=LAYERS, max_length=80, batch_size=2,
                                     storage_dtype="fp32", shard_size_mb=1.0, progress=False)))
    return path


@pytest.fixture(scope="module")
def saved_drafter(tiny_drafter):
    """(target, path) -> DSpark's tiny test drafter, overconfident, saved at path."""

    def save(target, path):
        drafter = tiny_drafter("dspark", target, seed=1, target_layer_ids=LAYERS).eval()
        with torch.no_grad():
            drafter.sequential.out.weight.normal_(0, 2.0)
            drafter.confidence.score.weight.normal_(0, 0.5)
            drafter.confidence.score.bias.fill_(2.0)  # overconfident on purpose: STS has something to fix
        drafter.save_pretrained(path)
        return drafter

    return save


def test_calibrate_writes_files_and_config(saved_drafter, tiny_llama, cache_dir, tmp_path):
    drafter_dir = tmp_path / "drafter"
    saved_drafter(tiny_llama, drafter_dir)
    result = calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
    assert (drafter_dir / "calibration.json").is_file() and (drafter_dir / "reliability.png").is_file()
    assert CalibrationResult.load(drafter_dir / "calibration.json").temperatures == result.temperatures
    assert result.label_kind == "analytic" and result.notes[0].startswith("labels: analytic")
    assert len(result.temperatures) == 4 and result.ece_after[0] <= result.ece_before[0] + 1e-12
    assert result.mean_ece_after < result.mean_ece_before
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["calibration_temperatures"] == pytest.approx(result.temperatures)
    assert config["calibration_label_kind"] == "analytic"
    # With the temperatures, prompt lookup's acceptance on the same validation split (the lookup-or-drafter choice).
    assert config["prompt_lookup_acceptance"] == fit_prompt_lookup(load_drafter(drafter_dir, tiny_llama),
                                                                   CacheReader(cache_dir)).to_dict()
    assert sum(map(sum, config["prompt_lookup_acceptance"]["reached"])) > 0
    assert not [p for p in drafter_dir.iterdir() if p.name.startswith(".calibrate")]  # staging removed
    # Reloaded, the drafter's proposals use the temperatures: c_k = sigmoid(z_k / T_k).
    reloaded = load_drafter(drafter_dir, tiny_llama).eval()
    sample = CacheReader(cache_dir)[CacheReader(cache_dir).split("validation")[0]]
    context = reloaded.extend_context(reloaded.new_decode_state(), sample.features[None, :6], torch.arange(6)[None])
    raw = []
    handle = reloaded.confidence.register_forward_hook(lambda _m, _i, out: raw.append(out))
    proposal = reloaded.propose(context, sample.input_ids[[6]], torch.tensor([6]),
                                lambda logits, s: (logits.argmax(-1), None))
    handle.remove()
    expected = torch.sigmoid(torch.stack(raw, 1) / torch.tensor(result.temperatures, dtype=torch.float32))
    torch.testing.assert_close(proposal.confidence_BK, expected)


def test_a_full_disk_leaves_the_saved_drafter_unchanged(saved_drafter, tiny_llama, cache_dir, tmp_path):
    from deepspec.utils.faults import full_disk
    from deepspec.utils.io import DiskFullError

    drafter_dir = tmp_path / "drafter"
    saved_drafter(tiny_llama, drafter_dir)
    before = {p.name: p.read_bytes() for p in drafter_dir.iterdir()}
    report = tmp_path / "report"  # the report's size, measured: the disk holds it and not the new config.json too
    calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC, out=report, write_config=False)
    report_bytes = sum(p.stat().st_size for p in report.iterdir())
    with full_disk(tmp_path, free_bytes=report_bytes + 100):
        with pytest.raises(DiskFullError) as error:
            calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
        message = str(error.value)
    assert message.startswith(f"{drafter_dir}: no space left on device (")
    assert "the drafter's config.json and the calibration report are as they were" in message
    # The report and the temperatures are one change: neither is written.
    assert {p.name: p.read_bytes() for p in drafter_dir.iterdir()} == before


def saved_checkpoint(saved_drafter, target, step_dir):
    """A training checkpoint's layout around the tiny drafter: drafter/, trainer_state.json, checksums.json."""
    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest
    from deepspec.utils.io import atomic_write_json

    saved_drafter(target, step_dir / "drafter")
    atomic_write_json(step_dir / "trainer_state.json", {"step": 3})
    atomic_write_json(step_dir / MANIFEST_FILE, folder_manifest(step_dir))
    return step_dir / "drafter"


def test_calibrate_refuses_a_damaged_checkpoint_and_records_nothing(saved_drafter, tiny_llama, cache_dir, tmp_path):
    """One bit flipped in the weights: refused before any file is parsed, naming the file; the damaged weights are
    not saved again and no checksum is re-recorded (export and resume go on refusing it)."""
    from deepspec.export import export_drafter
    from deepspec.training.checkpoint import checkpoint_problems

    drafter_dir = saved_checkpoint(saved_drafter, tiny_llama, tmp_path / "checkpoints" / "step-00000003")
    weights = drafter_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 2] ^= 0x80  # the first weight doubled or halved
    weights.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in drafter_dir.parent.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=rf"the checkpoint is damaged \({weights}: sha256 differs"):
        calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
    assert {p: p.read_bytes() for p in drafter_dir.parent.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match=rf"the checkpoint is damaged \({weights}: sha256 differs"):
        export_drafter(drafter_dir.parent, tmp_path / "exported", "hf")
    assert any(str(weights) in problem for problem in checkpoint_problems(drafter_dir.parent))


def test_calibrate_in_place_rewrites_and_records_only_its_own_files(saved_drafter, tiny_llama, cache_dir, tmp_path):
    """The weights are read, never saved again; the checksums.json entries of what calibrate did not write stay
    as training recorded them, so damage that calibrate did not cause still shows."""
    from deepspec.utils.checksums import MANIFEST_FILE, manifest_problems
    from deepspec.utils.io import read_json

    step_dir = tmp_path / "checkpoints" / "step-00000003"
    drafter_dir = saved_checkpoint(saved_drafter, tiny_llama, step_dir)
    recorded = read_json(step_dir / MANIFEST_FILE)["files"]
    weights_stat = (drafter_dir / "model.safetensors").stat()
    calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
    now = (drafter_dir / "model.safetensors").stat()
    assert (now.st_ino, now.st_mtime_ns) == (weights_stat.st_ino, weights_stat.st_mtime_ns)  # not rewritten
    files = read_json(step_dir / MANIFEST_FILE)["files"]
    own = {"drafter/config.json", "drafter/calibration.json", "drafter/reliability.png"}
    assert set(files) == set(recorded) | own
    assert {k: v for k, v in files.items() if k not in own} == {k: v for k, v in recorded.items() if k not in own}
    assert files["drafter/config.json"] != recorded["drafter/config.json"]
    assert manifest_problems(step_dir, {"files": files}) == []
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["calibration_label_kind"] == "analytic" and len(config["calibration_temperatures"]) == 4


@pytest.mark.parametrize("killed", ["before the files are renamed", "before checksums.json records them"])
def test_a_calibrate_killed_while_writing_leaves_a_checkpoint_that_verifies(saved_drafter, tiny_llama, cache_dir,
                                                                              tmp_path, monkeypatch, killed):
    """A kill while calibrate replaces config.json (and its report) leaves the old or the new files, each vouched
    for by checksums.json: export, calibrate and resume go on taking the checkpoint, and a rerun finishes it."""
    import deepspec.utils.checksums as checksums
    from deepspec.export import export_drafter
    from deepspec.training.checkpoint import checkpoint_problems, latest_checkpoint

    class Killed(BaseException):
        """What a kill -9 at that point leaves (nothing on the way catches a BaseException)."""

    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest
    from deepspec.utils.io import atomic_write_json

    step_dir = tmp_path / "checkpoints" / "step-00000003"
    drafter_dir = saved_checkpoint(saved_drafter, tiny_llama, step_dir)
    (step_dir / "optimizer.safetensors").write_bytes(b"moments")  # the rest of what a resume reads
    atomic_write_json(step_dir / MANIFEST_FILE, folder_manifest(step_dir, exclude=(MANIFEST_FILE,)))
    old_config = (drafter_dir / "config.json").read_bytes()
    real_update = checksums._update_manifest

    def update(manifest_path, pending=None, done=()):
        if done and killed == "before checksums.json records them":
            raise Killed
        real_update(manifest_path, pending, done)
        if pending and killed == "before the files are renamed":
            raise Killed

    monkeypatch.setattr(checksums, "_update_manifest", update)
    with pytest.raises(Killed):
        calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
    monkeypatch.undo()
    calibrated = json.loads((drafter_dir / "config.json").read_text()).get("calibration_temperatures") is not None
    assert calibrated == (killed == "before checksums.json records them")
    assert calibrated or (drafter_dir / "config.json").read_bytes() == old_config
    assert checkpoint_problems(step_dir) == [] and latest_checkpoint(tmp_path) == step_dir
    export_drafter(step_dir, tmp_path / "exported", "hf")
    calibrate(drafter_dir, cache_dir, tiny_llama, ANALYTIC)
    manifest = json.loads((step_dir / "checksums.json").read_text())
    assert "pending" not in manifest and checkpoint_problems(step_dir) == []


def test_calibrate_empirical_labels_and_separate_out(saved_drafter, tiny_llama, cache_dir, tmp_path):
    drafter_dir, out = tmp_path / "drafter", tmp_path / "report"
    saved_drafter(tiny_llama, drafter_dir)
    before = (drafter_dir / "config.json").read_text()
    settings = CalibrationSchema(min_samples=5, holdout=0.0, max_prompts=4, max_new_tokens=12)  # empirical by default
    result = calibrate(drafter_dir, cache_dir, tiny_llama, settings, out=out, write_config=False)
    assert result.label_kind == "hard" and result.notes[0].startswith("labels: empirical")
    assert result.heldout == {}  # holdout 0: every rollout fitted on
    assert (out / "calibration.json").is_file() and (out / "reliability.png").is_file()
    assert (drafter_dir / "config.json").read_text() == before  # write_config=False leaves it alone


def test_calibrate_errors(saved_drafter, tiny_llama, cache_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        calibrate(tmp_path / "missing", cache_dir, tiny_llama)
    drafter_dir = tmp_path / "drafter"
    saved_drafter(tiny_llama, drafter_dir)
    with pytest.raises(ValueError, match="labels"):
        calibrate(drafter_dir, cache_dir, tiny_llama, CalibrationSchema(labels="soft"))
    with pytest.raises(ValueError, match="min_samples"):
        calibrate(drafter_dir, cache_dir, tiny_llama, CalibrationSchema(min_samples=100_000))
    dflash_dir = tmp_path / "dflash"
    dflash = build_drafter("dflash", tiny_llama, num_draft_layers=1, target_layer_ids=LAYERS, block_size=4)
    dflash.save_pretrained(dflash_dir)
    with pytest.raises(ValueError, match="no confidence head"):
        calibrate(dflash_dir, cache_dir, tiny_llama)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--drafter", str(drafter_dir), "--cache", str(cache_dir), "--labels", "soft"])


def test_calibrate_after_training_updates_run(saved_drafter, tiny_llama, cache_dir, tmp_path):
    """Empirical labels by default (rollouts with the training target), analytic by config."""
    run_dir = tmp_path / "run"
    drafter = saved_drafter(tiny_llama, run_dir / "final")
    settings = CalibrationSchema(min_samples=5, max_new_tokens=32)
    assert settings.labels == "empirical"
    with pytest.raises(ValueError, match="need the target"):
        calibrate_after_training(run_dir, drafter, CacheReader(cache_dir), settings)
    result = calibrate_after_training(run_dir, drafter, CacheReader(cache_dir), settings, target=tiny_llama)
    assert result.label_kind == "hard" and result.heldout["num_groups"] == {"fit": 2, "heldout": 2}
    assert (run_dir / "calibration" / "calibration.json").is_file()
    assert drafter.config.calibration_temperatures == result.temperatures
    saved = json.loads((run_dir / "final" / "config.json").read_text())
    assert saved["calibration_temperatures"] == pytest.approx(result.temperatures)
    assert saved["calibration_label_kind"] == "empirical"
    analytic = calibrate_after_training(run_dir, drafter, CacheReader(cache_dir),
                                        CalibrationSchema(labels="analytic", min_samples=5))
    assert analytic.label_kind == "analytic"
    with pytest.raises(ValueError, match="calibration.labels='soft'"):
        CalibrationSchema(labels="soft")
    assert calibrate_after_training(run_dir, drafter, None, CalibrationSchema(enabled=False)) is None
    dflash = build_drafter("dflash", tiny_llama, num_draft_layers=1, target_layer_ids=LAYERS, block_size=4)
    assert calibrate_after_training(run_dir, dflash, None, CalibrationSchema()) is None


def test_cli_main_prints_summary(saved_drafter, tiny_llama, cache_dir, tmp_path, capsys):
    from deepspec.calibration.cli import main

    target_dir = tmp_path / "target"
    tiny_llama.model.save_pretrained(target_dir)
    tiny_llama.tokenizer.save_pretrained(target_dir)
    drafter_dir = tmp_path / "drafter"
    saved_drafter(tiny_llama, drafter_dir)
    capsys.readouterr()  # drop save_pretrained's progress output
    assert main(["--drafter", str(drafter_dir), "--cache", str(cache_dir), "--target", str(target_dir),
                 "--min-samples", "5", "--max-new-tokens", "32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    saved = json.loads((drafter_dir / "config.json").read_text())
    assert summary["temperatures"] == pytest.approx(saved["calibration_temperatures"])
    assert summary["labels"] == "empirical" and summary["label_kind"] == "hard"  # the default
    assert summary["mean_ece_after"] < summary["mean_ece_before"]  # on the fit rollouts
    heldout = summary["heldout"]
    assert heldout["holdout"] == 0.5 and len(heldout["ece_before"]) == len(heldout["ece_after"]) == 4
    assert heldout["num_groups"] == {"fit": 2, "heldout": 2} and min(heldout["num_rows"].values()) > 0
    assert heldout["mean_ece_before"] == pytest.approx(sum(heldout["ece_before"]) / 4)


def test_training_callback_writes_into_last_checkpoint(saved_drafter, tiny_llama, cache_dir, tmp_path):
    from types import SimpleNamespace

    from deepspec.training.hooks import calibrate_after_training_hook as training_callback
    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest, manifest_problems
    from deepspec.utils.io import atomic_write_json, read_json

    checkpoint = tmp_path / "checkpoints" / "step-00000010"
    drafter = saved_drafter(tiny_llama, checkpoint / "drafter")
    atomic_write_json(checkpoint / MANIFEST_FILE, folder_manifest(checkpoint))  # as the checkpoint writer does
    session = SimpleNamespace(placement=SimpleNamespace(rank=0),
                              cfg=SimpleNamespace(calibration=CalibrationSchema(labels="analytic"),
                                                  deepspeed=SimpleNamespace(stage=2)),
                              out_dir=tmp_path, drafter=drafter, data=SimpleNamespace(reader=CacheReader(cache_dir)),
                              target=tiny_llama)
    other_rank = SimpleNamespace(placement=SimpleNamespace(rank=1))
    assert training_callback(other_rank, checkpoint) is None  # other ranks do nothing
    with pytest.raises(ValueError, match="min_samples"):  # default 50 is more than this tiny split has
        training_callback(session, checkpoint)
    session.cfg = SimpleNamespace(calibration=CalibrationSchema(min_samples=5, max_new_tokens=32),
                                  deepspeed=SimpleNamespace(stage=2))  # empirical: rollouts with session.target
    result = training_callback(session, checkpoint)
    saved = json.loads((checkpoint / "drafter" / "config.json").read_text())
    assert saved["calibration_temperatures"] == pytest.approx(result.temperatures)
    assert (tmp_path / "calibration" / "calibration.json").is_file()
    # The rewritten config.json is re-recorded: the calibrated checkpoint still verifies (resume uses it).
    assert manifest_problems(checkpoint, read_json(checkpoint / MANIFEST_FILE)) == []


def test_calibration_skipped_after_training_gives_the_advice_of_its_own_failure(saved_drafter, tiny_llama,
                                                                                cache_dir, tmp_path, caplog,
                                                                                monkeypatch):
    """Training goes on when calibration fails; the warning adds the rerun command, the fix is the error's own:
    more data or a lower min_samples only where samples were too few."""
    from types import SimpleNamespace

    import deepspec.calibration.run as calibration_run
    from deepspec.training.hooks import calibrate_confidence

    checkpoint = tmp_path / "checkpoints" / "step-00000010"
    drafter = saved_drafter(tiny_llama, checkpoint / "drafter")
    session = SimpleNamespace(placement=SimpleNamespace(rank=0),
                              cfg=SimpleNamespace(calibration=CalibrationSchema(labels="analytic"),
                                                  deepspeed=SimpleNamespace(stage=2)),
                              out_dir=tmp_path, drafter=drafter, data=SimpleNamespace(reader=CacheReader(cache_dir)),
                              target=tiny_llama)
    with caplog.at_level("WARNING", logger="deepspec.training.hooks"):
        calibrate_confidence(session, checkpoint)  # the default min_samples=50 is more than this split has
    too_few = caplog.records[-1].getMessage()
    assert "need at least min_samples=50 (more validation data, or a lower min_samples: --min-samples, " \
           "calibration.min_samples)" in too_few
    assert f"once that is addressed: `deepspec calibrate --drafter {checkpoint}/drafter --cache ...`" in too_few

    def refuse(*args, **kwargs):
        raise ValueError("this target cannot be decoded in batches")

    monkeypatch.setattr(calibration_run, "calibrate_after_training", refuse)
    with caplog.at_level("WARNING", logger="deepspec.training.hooks"):
        calibrate_confidence(session, checkpoint)
    other = caplog.records[-1].getMessage()
    assert "this target cannot be decoded in batches" in other
    assert "min_samples" not in other and "min-samples" not in other and "validation" not in other


def test_fit_and_report_measures_ece_on_rollouts_not_fitted_on():
    """Synthetic overconfident head (true survival probability sigmoid(z / 3) per position): the temperatures
    are fitted on half the rollouts; the held-out metrics are those of the other half alone, where STS cuts
    the ECE too."""
    from deepspec.calibration.collect import CollectedConfidence
    from deepspec.calibration.run import fit_and_report
    from deepspec.calibration.sts import evaluate_temperatures

    generator = torch.Generator().manual_seed(0)
    num_rollouts, rounds, positions = 40, 60, 3
    logits_NK = torch.randn(num_rollouts * rounds, positions, generator=generator) + 2.0
    accepted_NK = torch.rand(logits_NK.shape, generator=generator) < torch.sigmoid(logits_NK / 3.0)
    survival_NK = torch.cumprod(accepted_NK.float(), dim=1)
    group_N = torch.arange(num_rollouts).repeat_interleave(rounds)
    collected = CollectedConfidence(logits_NK, survival_NK, torch.ones_like(accepted_NK), "empirical", {}, group_N)
    result = fit_and_report(collected, CalibrationSchema(holdout=0.5, seed=3, num_bins=10))
    assert result.heldout["num_groups"] == {"fit": 20, "heldout": 20}
    assert result.temperatures[0] == pytest.approx(3.0, rel=0.25)
    _, held = collected.split(0.5, seed=3)
    expected = evaluate_temperatures(held.confidence_logits_NK, held.survival_NK, held.valid_NK,
                                     result.temperatures, 10)
    assert result.heldout["ece_after"] == pytest.approx(expected["ece_after"])
    assert result.heldout["mean_ece_after"] < 0.5 * result.heldout["mean_ece_before"]
    assert fit_and_report(collected, CalibrationSchema(holdout=0.0, num_bins=10)).heldout == {}
