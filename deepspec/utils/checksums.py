"""Checksum manifests of folders: record the sha256 and size of every file, later name each damaged one.

A manifest is `{"files": {relative path: {"sha256", "num_bytes"}}}` (posix paths, sorted). It is written
by the folder's writer after every other file and checked by its reader before trusting any of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from deepspec.utils.io import atomic_write_json, read_json, sha256_file

MANIFEST_FILE = "checksums.json"
TRAINER_STATE_FILE = "trainer_state.json"  # what marks a training checkpoint (deepspec.training.checkpoint)


def folder_manifest(folder: str | os.PathLike, exclude: Iterable[str] = ()) -> dict:
    """Manifest of every file under `folder`, except paths whose first component is in `exclude`."""
    folder = Path(folder)
    skipped = set(exclude)
    files = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and relative.parts[0] not in skipped:
            files[relative.as_posix()] = {"sha256": sha256_file(path), "num_bytes": path.stat().st_size}
    return {"files": files}


def manifest_problems(folder: str | os.PathLike, manifest: dict) -> list[str]:
    """Every listed file that is missing, of another size, or of another sha256, named by its path."""
    folder = Path(folder)
    problems = []
    for relative, expected in manifest["files"].items():
        path = folder / relative
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            problems.append(f"{folder}: recorded file {relative!r} is not a path inside the folder")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != expected["num_bytes"]:
            problems.append(f"{path}: {path.stat().st_size} B, {expected['num_bytes']} B recorded "
                            "(truncated or replaced)")
        elif sha256_file(path) != expected["sha256"]:
            problems.append(f"{path}: sha256 differs from the recorded one (damaged)")
    return problems


def covering_manifest(folder: str | os.PathLike) -> Path | None:
    """The checksums.json that records the files of `folder`: its own, else its parent's (a training checkpoint
    keeps one beside its drafter/ folder); None where neither has one."""
    folder = Path(folder).resolve()
    return next((root / MANIFEST_FILE for root in (folder, folder.parent) if (root / MANIFEST_FILE).is_file()), None)


def _read_manifest(manifest_path: Path) -> dict:
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{manifest_path}: not a checksum manifest (no 'files' mapping)")
    return manifest


def _entries_of(manifest: dict, root: Path, folder: Path) -> dict:
    """The manifest's entries of the files under `folder` (the manifest's own folder `root`, or a folder in it)."""
    prefix = "" if folder == root else folder.relative_to(root).as_posix() + "/"
    return {name: entry for name, entry in manifest["files"].items() if name.startswith(prefix)}


def check_drafter_checksums(folder: str | os.PathLike) -> None:
    """Refuse a saved drafter folder whose files differ from the checksums.json recorded with it, naming each damaged
    file, before any of them is parsed: what every command that reads a drafter (calibrate, evaluate, export, the
    benchmarks) calls first, through `deepspec.drafters.build.load_drafter`. A training checkpoint's drafter/
    (its parent holds trainer_state.json) without the checkpoint's checksums.json is refused too: nothing vouches
    for it. A folder of another origin without a manifest (an export, a save_pretrained) is read as it is."""
    folder = Path(folder).resolve()
    manifest_path = covering_manifest(folder)
    covered = {} if manifest_path is None else _entries_of(_read_manifest(manifest_path), manifest_path.parent, folder)
    if not covered:
        if (folder.parent / TRAINER_STATE_FILE).is_file():
            raise ValueError(f"{folder}: the training checkpoint {folder.parent} has no {MANIFEST_FILE} recording "
                             "these files (damaged, or not written by DeepSpec); use another checkpoint")
        return
    problems = manifest_problems(manifest_path.parent, {"files": covered})
    if problems:
        raise ValueError(f"{folder}: the checkpoint is damaged ({'; '.join(problems)}; recorded in {manifest_path}); "
                         "use another checkpoint (training resumes from the newest valid one), or retrain")


def record_written_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Record the sha256 and size of each of `paths` in the manifest that covers its folder (`covering_manifest`,
    recording files there already), where there is one; no other entry changes. For a writer that adds or rewrites
    its own files in a verified folder afterwards (calibration: the temperatures in drafter/config.json, its report
    beside them): only what it wrote itself is recorded, so damage it did not cause still shows. Returns the
    manifests updated."""
    by_manifest: dict[Path, list[Path]] = {}
    for path in map(lambda p: Path(p).resolve(), paths):
        manifest_path = covering_manifest(path.parent)
        # Only a manifest that records files of this folder already: never one that happens to sit above it.
        if manifest_path is not None and _entries_of(_read_manifest(manifest_path), manifest_path.parent, path.parent):
            by_manifest.setdefault(manifest_path, []).append(path)
    for manifest_path, written in by_manifest.items():
        manifest = _read_manifest(manifest_path)
        files = dict(manifest["files"])
        for path in written:
            files[path.relative_to(manifest_path.parent).as_posix()] = {"sha256": sha256_file(path),
                                                                        "num_bytes": path.stat().st_size}
        atomic_write_json(manifest_path, {**manifest, "files": dict(sorted(files.items()))})
    return list(by_manifest)
