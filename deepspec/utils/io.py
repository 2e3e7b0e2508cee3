"""Atomic file writes and JSON helpers. No pickle anywhere: data is JSON or safetensors.

A full disk: every atomic writer (and `reporting_disk_full` around the writes that are not atomic) turns the
write's ENOSPC into one `DiskFullError` naming the path being written, the bytes it needed where known, the
space left, and what survives; the temp file or folder is removed first, so nothing half-written is left to be
trusted. A stage around its writes adds what survives of its own work (the last complete checkpoint, the
cache shards finished so far) with the same context manager.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from deepspec.utils import faults

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# What libraries that wrap the OSError in their own type keep of it: safetensors' SafetensorError ("I/O error:
# No space left on device (os error 28)"), tokenizers, huggingface_hub.
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an exception it was raised from, is a write that found no space left."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        if not isinstance(error, OSError) and any(text in str(error) for text in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def existing_folder_of(path: str | os.PathLike) -> Path:
    """`path` itself if it exists, else its nearest existing parent: where a file that is not there yet would go."""
    folder = Path(path).resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free space on the disk that holds `path` (or would hold it); None if unknown."""
    folder = existing_folder_of(path)
    simulated = faults.simulated_free_bytes(folder)
    if simulated is not None:
        return simulated
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,} B"


class DiskFullError(OSError):
    """A write that found no space left (errno ENOSPC; an OSError, so a command reports it as one line, exit 1).

    `path`: what was being written; `needed_bytes`: its size where known; `survives`: what is intact and how to go
    on (else: the file or folder at `path` is as it was). The free space is read when the message is shown: what
    is left once the temp files are gone."""

    def __init__(self, path: str | os.PathLike | None, needed_bytes: int | None = None, survives: str = ""):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))
        self.path = None if path is None else Path(path)
        self.needed_bytes, self.survives = needed_bytes, survives

    def __str__(self) -> str:
        sizes = [] if self.needed_bytes is None else [f"it needs about {format_bytes(self.needed_bytes)}"]
        free = None if self.path is None else free_bytes(self.path)
        if free is not None:
            sizes.append(f"{format_bytes(free)} free there now")
        where = f"{self.path}: " if self.path is not None else ""
        survives = self.survives or ("nothing was written there" if self.path is None or not self.path.exists()
                                     else "it was left as it was")
        return (f"{where}no space left on device{' (' + ', '.join(sizes) + ')' if sizes else ''}; {survives}; "
                "free some space or write somewhere else, then rerun")


@contextmanager
def reporting_disk_full(path: str | os.PathLike | None = None, needed_bytes: int | None = None,
                        survives: str | Callable[[], str] = "") -> Iterator[None]:
    """Raise a write in the block that found the disk full as one `DiskFullError`. What is given here wins over
    what an inner writer said: `path` (the unit being written, e.g. a checkpoint, rather than a file in it),
    `needed_bytes`, `survives` (a callable is asked only on failure: e.g. the last complete checkpoint then)."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        note = survives() if callable(survives) else survives
        if isinstance(error, DiskFullError):
            if path is not None:
                error.path = Path(path)
                error.filename = str(path)
            error.needed_bytes = needed_bytes if needed_bytes is not None else error.needed_bytes
            error.survives = note or error.survives
            raise
        raise DiskFullError(path, needed_bytes, note) from error


@contextmanager
def atomic_path(path: str | os.PathLike, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temp path in the same folder; rename it onto `path` only if the block succeeds.

    A crash leaves either the old file or no file, never a half-written one; a full disk is a `DiskFullError`
    naming `path` (and `needed_bytes`, its size, where the caller knows it).
    """
    path = Path(path)
    existed = path.exists()
    with reporting_disk_full(path, needed_bytes, f"the existing {path.name} is unchanged" if existed
                             else f"{path.name} was not created"):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = _create_temp_file(path)
        mode = stat.S_IMODE(tmp_path.stat().st_mode)
        try:
            yield tmp_path
            faults.claim_space(path, tmp_path.stat().st_size)
            os.chmod(tmp_path, mode)  # a writer that recreated the file (safetensors' save_file: 0o600) gets it back
            os.replace(tmp_path, path)
        finally:
            if tmp_path.exists():
                tmp_path.unlink()


@contextmanager
def atomic_paths(paths: Iterable[str | os.PathLike],
                 before_rename: Callable[[dict], None] | None = None) -> Iterator[dict[Path, Path]]:
    """`atomic_path` for files that change together: yields {path: temp file beside it}; once the
    block succeeds and every temp file is complete, `before_rename(temps)` runs (a manifest
    recording them: deepspec.utils.checksums.recorded_writes), then each is renamed onto its path. A
    failure before the renames, a full disk included (a `DiskFullError` naming the folder of the
    first path), leaves every path as it was."""
    paths = [Path(p) for p in paths]
    temps: dict[Path, Path] = {}
    where = paths[0] if len(paths) == 1 else paths[0].parent
    with reporting_disk_full(where, survives="the files there are unchanged"):
        try:
            for path in paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                temps[path] = _create_temp_file(path)
            modes = {path: stat.S_IMODE(tmp.stat().st_mode) for path, tmp in temps.items()}
            yield temps
            for path, tmp in temps.items():  # every write done before any file is replaced
                faults.claim_space(path, tmp.stat().st_size)
                os.chmod(tmp, modes[path])  # a writer that recreated the file gets its mode back
            if before_rename is not None:
                before_rename(temps)
            for path, tmp in temps.items():
                os.replace(tmp, path)
        finally:
            for tmp in temps.values():
                if tmp.exists():
                    tmp.unlink()


def tree_bytes(folder: str | os.PathLike) -> int:
    """The bytes of the files under `folder`."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


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
    it is touched before the new folder is complete, and a failed block leaves it as it was (a full disk: a
    `DiskFullError` naming `path`). Without `overwrite` the new folder is put in place by one rename that fails
    if a non-empty `path` appeared meanwhile (another writer's: it is kept, this one refused). With it the swap is
    two renames: a crash between them leaves the old folder as `.<name>.<random>.old` beside it. A `path` that is
    a symbolic link is written through: the folder it points to is the one replaced, the link stays.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path}: exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path}: folder is not empty; refusing to mix or overwrite its files" +
                              (f" ({hint})" if hint else ""))
    existed = path.is_dir() and any(path.iterdir())
    with reporting_disk_full(path, survives=f"the existing {path.name} is unchanged (the partial new one was removed)"
                             if existed else f"{path.name} was not created (the partial one was removed)"):
        path.parent.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:8]
        tmp = path.with_name(f".{path.name}.{tag}.tmp")
        tmp.mkdir()  # not mkdtemp: the folder keeps the user's umask permissions after the rename
        try:
            yield tmp
            faults.claim_space(path, tree_bytes(tmp))
            give_ordinary_modes(tmp)
            if overwrite:
                _swap_in(tmp, path, path.with_name(f".{path.name}.{tag}.old"))
            else:
                _rename_into_place(tmp, path, hint)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def remove_abandoned_temps(path: str | os.PathLike) -> list[Path]:
    """Remove what a killed `atomic_dir(path)` left beside `path`: its temp folders and, where
    `path` is in place (the swap finished), the old folder it replaced; an old folder without `path`
    is the only copy and stays. Only for a caller that holds the lock every writer of `path` takes
    (no live writer owns them). Returns what went."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.[0-9a-f]{{8}}\.(tmp|old)$")
    removed = []
    for leftover in path.parent.iterdir():
        match = pattern.match(leftover.name)
        ours = match and leftover.is_dir() and not leftover.is_symlink()
        if ours and (match[1] == "tmp" or path.is_dir()):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _swap_in(tmp: Path, path: Path, old: Path) -> None:
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _rename_into_place(tmp: Path, path: Path, hint: str) -> None:
    """rename(2) replaces a missing or empty folder and fails on a non-empty one: what another writer made there
    after this one started is never replaced."""
    try:
        os.rename(tmp, path)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise FileExistsError(f"{path}: appeared, not empty, while this one was written (another writer into the same "
                              "folder?); it was kept and this one removed" + (f" ({hint})" if hint else "")) from None


def check_output_folder(path: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, an output folder (`option`: a flag `--out` or a config key `cache.out_dir`) that
    exists as a file."""
    if Path(path).exists() and not Path(path).is_dir():
        shown = f"{option} {path}" if option.startswith("-") else f"{option}={str(path)!r}"
        raise FileExistsError(f"{shown}: exists and is not a folder; choose another {option}")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path, len(text.encode("utf-8"))) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """`payload` as the whole new content of `path`: written to a temp file, fsynced, renamed."""
    with atomic_path(path, len(payload)) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())


def append_all(f, data: bytes, fsync: bool = False) -> None:
    """Append `data` to `f`, a file opened unbuffered in binary mode (`open(path, "ab", buffering=0)`), whole
    (write() may take part of it), then fsync if asked. Nothing waits in a buffer: a write that fails (a full
    disk) is not retried by close() behind the caller's back."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]
    if fsync:
        os.fsync(f.fileno())


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return _parse_json_file(Path(path))[0]


def read_json_with_sha256(path: str | os.PathLike) -> tuple[Any, str]:
    """(the parsed JSON, the sha256 of the very bytes parsed): the file is read once, so the digest is of what is
    used."""
    obj, data = _parse_json_file(Path(path))
    return obj, hashlib.sha256(data).hexdigest()


def _parse_json_file(path: Path) -> tuple[Any, bytes]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    try:
        return json.loads(data.decode("utf-8")), data
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: invalid JSON (not UTF-8 at byte {e.start})") from None
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
