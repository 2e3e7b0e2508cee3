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


def refresh_manifest_entries(changed_folder: str | os.PathLike) -> Path | None:
    """Re-record the files of `changed_folder` in the manifest of the folder holding it, if there is one.

    For writers that legitimately rewrite part of a verified folder afterwards (calibration stores its
    temperatures in a checkpoint's drafter/config.json): without this the folder would read as damaged.
    Only entries of files inside `changed_folder` are touched. Returns the manifest path updated, if any.
    """
    changed_folder = Path(changed_folder).resolve()
    root = changed_folder.parent
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        return None
    manifest = read_json(manifest_path)
    prefix = changed_folder.relative_to(root).as_posix() + "/"
    files = {name: entry for name, entry in manifest["files"].items() if not name.startswith(prefix)}
    for path in sorted(changed_folder.rglob("*")):
        if path.is_file():
            files[path.relative_to(root).as_posix()] = {"sha256": sha256_file(path), "num_bytes": path.stat().st_size}
    atomic_write_json(manifest_path, {**manifest, "files": dict(sorted(files.items()))})
    return manifest_path
