"""Atomic file writes and JSON helpers. No pickle anywhere: data is JSON or safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


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
        old = path.with_name(f".{path.name}.{tag}.old")
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
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
