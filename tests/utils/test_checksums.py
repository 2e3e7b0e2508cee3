"""Checksum manifests: a writer records only the files it wrote, and only where the manifest covers their folder;
a kill while it replaces them leaves old or new files, both vouched for."""

from __future__ import annotations

import pytest

import deepspec.utils.io as io
from deepspec.utils import checksums
from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest, manifest_problems, recorded_writes
from deepspec.utils.io import atomic_write_json, read_json, sha256_file


def _write(temps, contents: dict) -> None:
    for path, text in contents.items():
        temps[path].write_text(text)


def test_written_files_are_recorded_only_in_a_manifest_that_covers_their_folder(tmp_path):
    step = tmp_path / "step-00000002"
    (step / "drafter").mkdir(parents=True)
    (step / "drafter" / "config.json").write_text("{}")
    (step / "optimizer.safetensors").write_bytes(b"moments")
    atomic_write_json(step / MANIFEST_FILE, folder_manifest(step))
    recorded = read_json(step / MANIFEST_FILE)["files"]
    (step / "optimizer.safetensors").write_bytes(b"damaged")  # not this writer's: stays recorded as it was
    (step / "report").mkdir()
    written = {step / "drafter" / "config.json": '{"calibration_temperatures": [1.5]}',
               step / "drafter" / "calibration.json": "{}",
               step / "report" / "calibration.json": "{}"}  # a folder the manifest records nothing of
    with recorded_writes(written) as temps:
        _write(temps, written)
    manifest = read_json(step / MANIFEST_FILE)
    files = manifest["files"]
    assert "pending" not in manifest
    assert sorted(files) == ["drafter/calibration.json", "drafter/config.json", "optimizer.safetensors"]
    assert files["drafter/config.json"]["sha256"] == sha256_file(step / "drafter" / "config.json")
    assert files["optimizer.safetensors"] == recorded["optimizer.safetensors"]
    assert manifest_problems(step, manifest) == [
        f"{step / 'optimizer.safetensors'}: sha256 differs from the recorded one (damaged)"]
    with recorded_writes([tmp_path / "elsewhere.json"]) as temps:  # no manifest covers it: nothing to record
        temps[tmp_path / "elsewhere.json"].write_text("{}")
    assert (tmp_path / "elsewhere.json").read_text() == "{}" and not (tmp_path / MANIFEST_FILE).exists()


class Killed(BaseException):
    """What a kill -9 at that point leaves (a BaseException: nothing on the way catches it)."""


@pytest.mark.parametrize("when", ["pending recorded", "first file renamed", "files renamed"])
def test_a_kill_while_files_are_replaced_leaves_old_or_new_files_that_verify(tmp_path, monkeypatch, when):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text('{"old": true}')
    (folder / "calibration.json").write_text('{"old": true}')
    (folder / "model.safetensors").write_bytes(b"weights")
    atomic_write_json(folder / MANIFEST_FILE, folder_manifest(folder))
    new = {folder / "config.json": '{"new": true}', folder / "calibration.json": '{"new": 1}'}
    renames, real_replace = [], io.os.replace

    def replace(src, dst):
        ours = dst in [str(path) for path in new] or dst in new
        if when == "first file renamed" and ours and renames:
            raise Killed
        real_replace(src, dst)
        if ours:
            renames.append(dst)

    real_update = checksums._update_manifest

    def update(manifest_path, pending=None, done=()):
        real_update(manifest_path, pending, done)
        if pending and when == "pending recorded":
            raise Killed

    def update_done(manifest_path, pending=None, done=()):
        if done and when == "files renamed":
            raise Killed
        update(manifest_path, pending, done)

    monkeypatch.setattr(io.os, "replace", replace)
    monkeypatch.setattr(checksums, "_update_manifest", update_done)
    with pytest.raises(Killed):
        with recorded_writes(new) as temps:
            _write(temps, new)
    monkeypatch.undo()
    manifest = read_json(folder / MANIFEST_FILE)
    assert manifest_problems(folder, manifest) == []
    states = {path.name: path.read_text() for path in new}
    expected = {"pending recorded": ["old", "old"], "first file renamed": ["new", "old"],
                "files renamed": ["new", "new"]}[when]
    assert sorted("new" if "new" in text else "old" for text in states.values()) == sorted(expected)
    checksums.check_drafter_checksums(folder)  # what every reader runs: no refusal
    # The next writer settles what the killed one left pending; damage after that still shows.
    with recorded_writes([folder / "config.json"]) as temps:
        temps[folder / "config.json"].write_text('{"newer": true}')
    manifest = read_json(folder / MANIFEST_FILE)
    assert "pending" not in manifest and manifest_problems(folder, manifest) == []
    (folder / "calibration.json").write_text(states["calibration.json"].replace("1", "2").replace("e", "f"))
    assert manifest_problems(folder, read_json(folder / MANIFEST_FILE)) == [
        f"{folder / 'calibration.json'}: sha256 differs from the recorded one (damaged)"]
