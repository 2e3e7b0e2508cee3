"""Atomic writes give the modes an ordinary open()/mkdir() gives (the umask decides, not mkstemp's 0o600), and a
full disk is one error naming the path, the bytes it needed, the space left and what survives."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager

import pytest

from deepspec.utils.faults import full_disk
from deepspec.utils.io import (
    DiskFullError,
    atomic_dir,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    is_disk_full,
    reporting_disk_full,
)


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                     (0o002, 0o664, 0o775)], ids=["022", "077", "002"])
def test_atomic_writes_honour_the_umask(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        with atomic_path(tmp_path / "b.bin") as tmp, open(tmp, "wb") as f:
            f.write(b"\0")
        with atomic_dir(tmp_path / "folder") as tmp:
            (tmp / "c.txt").write_text("c")
        plain = tmp_path / "plain.txt"
        plain.write_text("an ordinary open()")
    assert mode(plain) == file_mode
    assert [mode(tmp_path / name) for name in ("a.json", "b.bin", "folder/c.txt")] == [file_mode] * 3
    assert mode(tmp_path / "folder") == dir_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin", "folder", "plain.txt"]  # no temp left


def test_atomic_path_leaves_the_old_file_when_the_block_fails(tmp_path):
    path = tmp_path / "kept.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("new")
        raise RuntimeError("crash")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_an_atomic_folder_never_replaces_one_another_writer_made_meanwhile(tmp_path):
    out = tmp_path / "folder"
    with pytest.raises(FileExistsError, match=rf"{out}: appeared, not empty, while this one was written"):
        with atomic_dir(out) as tmp:
            (tmp / "mine.txt").write_text("mine")
            out.mkdir()  # another writer puts its folder in place first
            (out / "theirs.txt").write_text("theirs")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    with atomic_dir(tmp_path / "empty") as tmp:  # an empty folder there is replaced, as before
        (tmp_path / "empty").mkdir()
        (tmp / "mine.txt").write_text("mine")
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["mine.txt"]


def test_files_a_writer_creates_0600_get_the_ordinary_mode(tmp_path):
    """safetensors' save_file (and so save_pretrained) writes 0o600 whatever the umask; run bits are kept."""
    import torch
    from safetensors.torch import save_file

    with umask(0o022):
        with atomic_path(tmp_path / "w.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        with atomic_dir(tmp_path / "folder") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o700)
    assert mode(tmp_path / "w.safetensors") == 0o644 and mode(tmp_path / "folder/model.safetensors") == 0o644
    assert mode(tmp_path / "folder/run.sh") == 0o755


def test_a_full_disk_names_the_path_the_bytes_and_what_survives(tmp_path):
    kept = tmp_path / "kept.json"
    atomic_write_json(kept, {"old": True})
    with full_disk(tmp_path, free_bytes=5):  # the free space is read when the message is shown
        with pytest.raises(DiskFullError) as new_file:
            atomic_write_text(tmp_path / "new.txt", "0123456789")
        assert str(new_file.value) == (f"{tmp_path / 'new.txt'}: no space left on device (it needs about 10 B, 5 B "
                                       "free there now); new.txt was not created; free some space or write somewhere "
                                       "else, then rerun")
        with pytest.raises(DiskFullError) as old_file:
            atomic_write_json(kept, {"old": False})
        assert "the existing kept.json is unchanged" in str(old_file.value)
        atomic_write_text(tmp_path / "small.txt", "1234")  # fits
    assert new_file.value.errno == errno.ENOSPC and new_file.value.filename == str(tmp_path / "new.txt")
    assert kept.read_text() == '{\n  "old": true\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "small.txt"]  # no temp file left


@pytest.mark.parametrize("existed", [False, True], ids=["new", "overwrite"])
def test_a_full_disk_leaves_an_atomic_folder_as_it_was(tmp_path, existed):
    out = tmp_path / "export"
    if existed:
        out.mkdir()
        (out / "old.txt").write_text("the previous export")
    with full_disk(tmp_path, free_bytes=3):
        with pytest.raises(DiskFullError) as error, atomic_dir(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"12345678")
        survives = "the existing export is unchanged" if existed else "export was not created"
        assert str(error.value).startswith(f"{out}: no space left on device (3 B free there now); {survives}")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["export"] if existed else [])
    assert not existed or (out / "old.txt").read_text() == "the previous export"


def test_what_a_library_raises_for_a_full_disk_becomes_one_disk_full_error(tmp_path):
    from safetensors import SafetensorError

    raised = [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
              SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")]
    for error in raised:
        with pytest.raises(DiskFullError, match="shard.bin: no space left"), atomic_path(tmp_path / "shard.bin"):
            raise error
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError) as other, atomic_path(tmp_path / "x.bin"):
        raise OSError(errno.EACCES, "Permission denied")
    assert not isinstance(other.value, DiskFullError) and not is_disk_full(other.value)
    try:
        raise RuntimeError("save failed") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)


def test_the_unit_being_written_names_the_failure_and_says_what_survives(tmp_path):
    """An outer writer (a checkpoint) speaks for the files inside it: its path, its size and its survivors."""
    checkpoint = tmp_path / "checkpoints" / "step-00000004"
    with full_disk(tmp_path):
        with pytest.raises(DiskFullError) as error:
            with reporting_disk_full(checkpoint, 2_500_000, lambda: "the last complete checkpoint is step-00000002"):
                atomic_write_text(tmp_path / "checkpoints" / "step-00000004.tmp" / "trainer_state.json", "{}")
        assert str(error.value).startswith(f"{checkpoint}: no space left on device (it needs about 2.5 MB, 0 B free "
                                           "there now); the last complete checkpoint is step-00000002;")
    with pytest.raises(DiskFullError, match=r"^no space left on device \(it needs about 1\.0 kB\); nothing was"):
        with reporting_disk_full(needed_bytes=1000):
            raise OSError(errno.ENOSPC, "No space left on device")
