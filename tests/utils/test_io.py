"""Atomic writes give the modes an ordinary open()/mkdir() gives: the umask decides, not mkstemp's 0o600."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager

import pytest

from deepspec.utils.io import atomic_dir, atomic_path, atomic_write_json


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
