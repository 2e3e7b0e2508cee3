"""Checksum manifests: a writer records only the files it wrote, and only where the manifest covers their folder."""

from __future__ import annotations

from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest, manifest_problems, record_written_files
from deepspec.utils.io import atomic_write_json, read_json, sha256_file


def test_written_files_are_recorded_only_in_a_manifest_that_covers_their_folder(tmp_path):
    step = tmp_path / "step-00000002"
    (step / "drafter").mkdir(parents=True)
    (step / "drafter" / "config.json").write_text("{}")
    (step / "optimizer.safetensors").write_bytes(b"moments")
    atomic_write_json(step / MANIFEST_FILE, folder_manifest(step))
    recorded = read_json(step / MANIFEST_FILE)["files"]
    (step / "drafter" / "config.json").write_text('{"calibration_temperatures": [1.5]}')
    (step / "drafter" / "calibration.json").write_text("{}")
    (step / "optimizer.safetensors").write_bytes(b"damaged")  # not this writer's: stays recorded as it was
    (step / "report").mkdir()
    (step / "report" / "calibration.json").write_text("{}")  # a folder the manifest records nothing of
    updated = record_written_files([step / "drafter" / "config.json", step / "drafter" / "calibration.json",
                                    step / "report" / "calibration.json"])
    assert updated == [(step / MANIFEST_FILE).resolve()]
    files = read_json(step / MANIFEST_FILE)["files"]
    assert sorted(files) == ["drafter/calibration.json", "drafter/config.json", "optimizer.safetensors"]
    assert files["drafter/config.json"]["sha256"] == sha256_file(step / "drafter" / "config.json")
    assert files["optimizer.safetensors"] == recorded["optimizer.safetensors"]
    assert manifest_problems(step, {"files": files}) == [
        f"{step / 'optimizer.safetensors'}: sha256 differs from the recorded one (damaged)"]
    assert record_written_files([tmp_path / "elsewhere.json"]) == []  # no manifest covers it: nothing to record
