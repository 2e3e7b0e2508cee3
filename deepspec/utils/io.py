"""Atomic file writes and JSON helpers. No pickle anywhere: data is JSON or safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path in the same folder; rename it onto `path` only if the block succeeds.

    A crash leaves either the old file or no file, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = _create_temp_file(path)
    mode = stat.S_IMODE(tmp_path.stat().st_mode)
    try:
        yield tmp_path
        os.chmod(tmp_path, mode)  # a writer that recreated the file (safetensors' save_file: 0o600) gets it back
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def ordinary_file_mode(folder: str | os.PathLike) -> int:
    """The mode an ordinary open() gives a new file in `folder`: 0o666 less the umask, read from a probe file
    (os.umask would change the umask of every thread for a moment)."""
    probe = _create_temp_file(Path(folder) / "mode-probe")
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def give_ordinary_modes(folder: str | os.PathLike) -> None:
    """Give every file under `folder` the mode an ordinary open() would (executables: run bits where it gives read):
    safetensors' save_file, hence save_pretrained, writes 0o600 whatever the umask, and a serving container
    or a training job running as another user could not read the folder."""
    mode = ordinary_file_mode(folder)
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            executable = path.lstat().st_mode & 0o111
            os.chmod(path, mode | (mode & 0o444) >> 2 if executable else mode)


def _create_temp_file(path: Path, attempts: int = 100) -> Path:
    """A new empty `.<name>.<random>.tmp` beside `path`, with the mode an ordinary open() gives (0o666 less the
    umask). Not mkstemp: its 0o600 would survive the rename, and a serving container running as another user
    could not read an export or a cache."""
    for _ in range(attempts):
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"{path.parent}: no free temp file name for {path.name} after {attempts} tries")


@contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False, hint: str = "") -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; if the block succeeds it replaces `path` whole.

    An existing non-empty `path` is refused unless `overwrite` (`hint` says how to allow it); nothing of
    it is touched before the new folder is complete, and a failed block leaves it as it was. The swap is
    two renames: a crash between them leaves the old folder as `.<name>.<random>.old` beside it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path}: exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path}: folder is not empty; refusing to mix or overwrite its files" +
                              (f" ({hint})" if hint else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.with_name(f".{path.name}.{tag}.tmp")
    tmp.mkdir()  # not mkdtemp: the folder keeps the user's umask permissions after the rename
    try:
        yield tmp
        give_ordinary_modes(tmp)
        old = path.with_name(f".{path.name}.{tag}.old")
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_output_folder(path: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, an output folder (`option`: a flag `--out` or a config key `cache.out_dir`) that
    exists as a file."""
    if Path(path).exists() and not Path(path).is_dir():
        shown = f"{option} {path}" if option.startswith("-") else f"{option}={str(path)!r}"
        raise FileExistsError(f"{shown}: exists and is not a folder; choose another {option}")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """`payload` as the whole new content of `path`: written to a temp file, fsynced, renamed."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Stable hash of a JSON-serialisable object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def emit_report(report: dict, path: str | Path) -> None:
    """A benchmark's result: written to `path` atomically and printed to stdout as one indented JSON object."""
    atomic_write_json(path, report)
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
