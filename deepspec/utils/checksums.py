"""Checksum manifests of folders: record the sha256 and size of every file, later name each damaged one.

A manifest is `{"files": {relative path: {"sha256", "num_bytes"}}}` (posix paths, sorted). It is
written by the folder's writer after every other file and checked by its reader before trusting any
of them: a training checkpoint's (deepspec.training.checkpoint) and an export's (deepspec.export). A
writer that later replaces files of a verified folder (calibration) does so through
`recorded_writes`, which keeps the manifest true at every instant: while the files are replaced it
also lists their new content under `"pending"`, and a file that matches either its recorded or its
pending entry is intact.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deepspec.utils.io import atomic_paths, atomic_write_json, read_json, sha256_file

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
            files[relative.as_posix()] = _entry(path)
    return {"files": files}


def manifest_problems(folder: str | os.PathLike, manifest: dict) -> list[str]:
    """Every listed file that is missing, of another size, or of another sha256, named by its path.
    A file being replaced (`recorded_writes`: listed under "pending" too) is intact with either
    content."""
    folder = Path(folder)
    pending = manifest.get("pending") or {}
    problems = []
    for relative, expected in manifest["files"].items():
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            problems.append(f"{folder}: recorded file {relative!r} is not a path inside the folder")
            continue
        problem = _file_problem(folder / relative, expected)
        if problem and relative in pending:
            problem = problem if _file_problem(folder / relative, pending[relative]) else None
        if problem:
            problems.append(problem)
    return problems


def _file_problem(path: Path, expected: dict) -> str | None:
    if not path.is_file():
        return f"{path}: missing"
    if path.stat().st_size != expected["num_bytes"]:
        return (f"{path}: {path.stat().st_size} B, {expected['num_bytes']} B recorded "
                "(truncated or replaced)")
    if sha256_file(path) != expected["sha256"]:
        return f"{path}: sha256 differs from the recorded one (damaged)"
    return None


def _entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "num_bytes": path.stat().st_size}


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
    """Refuse a saved drafter folder whose files differ from the checksums.json recorded with it,
    naming each damaged file, before any of them is parsed: what every command that reads a drafter
    (calibrate, evaluate, export, the benchmarks) calls first, through
    `deepspec.drafters.build.load_drafter` or `deepspec.export.load_exported`. A training
    checkpoint's drafter/ (its parent holds trainer_state.json) without the checkpoint's
    checksums.json is refused too: nothing vouches for it. A folder without a manifest (an export
    written before exports recorded one, a save_pretrained) is read as it is."""
    folder = Path(folder).resolve()
    manifest_path = covering_manifest(folder)
    manifest = None if manifest_path is None else _read_manifest(manifest_path)
    covered = {} if manifest is None else _entries_of(manifest, manifest_path.parent, folder)
    if not covered:
        if (folder.parent / TRAINER_STATE_FILE).is_file():
            raise ValueError(f"{folder}: the training checkpoint {folder.parent} has no {MANIFEST_FILE} recording "
                             "these files (damaged, or not written by DeepSpec); use another checkpoint")
        return
    pending = manifest.get("pending") or {}
    problems = manifest_problems(manifest_path.parent, {"files": covered, "pending": pending})
    if not problems:
        return
    damage = f"{'; '.join(problems)}; recorded in {manifest_path}"
    if (manifest_path.parent / TRAINER_STATE_FILE).is_file():
        raise ValueError(f"{folder}: the checkpoint is damaged ({damage}); use another checkpoint "
                         "(training resumes from the newest valid one), or retrain")
    raise ValueError(f"{folder}: the export is damaged ({damage}); copy it again from where it "
                     "came from, or export it again from its checkpoint")


def _records_folder(path: Path) -> Path | None:
    """The manifest that covers `path`'s folder and records files there already, else None: never
    one that happens to sit above it."""
    manifest_path = covering_manifest(path.parent)
    if manifest_path is None:
        return None
    recorded = _entries_of(_read_manifest(manifest_path), manifest_path.parent, path.parent)
    return manifest_path if recorded else None


@contextmanager
def recorded_writes(paths: Iterable[str | os.PathLike]) -> Iterator[dict[Path, Path]]:
    """Replace several files of a verified folder as one change: yields {path: temp file beside it}
    for the block to write; then, where a manifest covers a path's folder (`covering_manifest`,
    recording files there already), the manifest first lists each temp file's content as its path's
    pending one, the temp files are renamed onto the paths, and the manifest records the new
    contents alone. A kill at any point leaves every file with its old or its new content and the
    manifest vouching for it: never a file the manifest calls damaged (calibration rewrites
    drafter/config.json this way). Only what the block wrote is recorded, so damage it did not cause
    still shows."""
    paths = [Path(p) for p in paths]
    manifests: dict[Path, list[Path]] = {}  # manifest -> the paths it records, resolved
    for path in paths:
        manifest_path = _records_folder(path.resolve())
        if manifest_path is not None:
            manifests.setdefault(manifest_path, []).append(path.resolve())

    def record_pending(temps: dict[Path, Path]) -> None:  # every temp complete, none renamed yet
        by_resolved = {path.resolve(): temp for path, temp in temps.items()}
        for manifest_path, written in manifests.items():
            pending = {_relative(p, manifest_path): _entry(by_resolved[p]) for p in written}
            _update_manifest(manifest_path, pending=pending)

    with atomic_paths(paths, before_rename=record_pending) as temps:
        yield temps
    for manifest_path, written in manifests.items():  # every temp file renamed onto its path
        _update_manifest(manifest_path, done=[_relative(path, manifest_path) for path in written])


def _relative(path: Path, manifest_path: Path) -> str:
    return path.relative_to(manifest_path.parent).as_posix()


def _update_manifest(manifest_path: Path, pending: dict | None = None,
                     done: Iterable[str] = ()) -> None:
    """Add `pending` entries, or make the pending entries `done` the recorded ones. Entries an
    earlier writer left pending (killed before it finished) are settled first by what the file now
    holds."""
    manifest = _read_manifest(manifest_path)
    root = manifest_path.parent
    files, left = dict(manifest["files"]), dict(manifest.get("pending") or {})
    for relative, entry in list(left.items()):
        if relative in done:
            files[relative] = left.pop(relative)
        elif _file_problem(root / relative, entry) is None:
            files[relative] = left.pop(relative)  # the earlier writer's rename happened
        elif relative not in files or _file_problem(root / relative, files[relative]) is None:
            left.pop(relative)  # it did not
    left.update(pending or {})
    updated = {key: value for key, value in manifest.items() if key != "pending"}
    updated["files"] = dict(sorted(files.items()))
    if left:
        updated["pending"] = dict(sorted(left.items()))
    atomic_write_json(manifest_path, updated)
