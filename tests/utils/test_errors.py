"""Which exceptions a command line reports as one line (a refusal) and which keep their traceback (a bug)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from deepspec.utils.config import merge_into_schema
from deepspec.utils.errors import UsageError, exit_code_of, one_line, reported_errors, take_debug_flag
from deepspec.utils.io import DiskFullError, read_json
from deepspec.utils.locks import LockHeldError


def raised(fn):
    try:
        fn()
    except Exception as e:  # the test inspects whatever was raised
        return e
    raise AssertionError("nothing raised")


def test_refusals_and_bugs_are_told_apart(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    assert exit_code_of(raised(lambda: read_json(bad_json))) == 1  # a ValueError DeepSpec raised, naming the file
    assert exit_code_of(raised(lambda: read_json(tmp_path / "missing.json"))) == 1
    assert exit_code_of(raised(lambda: open(tmp_path / "missing.txt"))) == 1  # an OSError names its path
    assert exit_code_of(LockHeldError("held by pid 1")) == 1
    assert exit_code_of(subprocess.CalledProcessError(1, ["deepspec", "cache"])) == 1
    assert exit_code_of(UsageError("invalid config: x")) == 2
    assert exit_code_of(raised(lambda: json.loads("{"))) is None  # a ValueError inside another library: a bug
    assert exit_code_of(raised(lambda: {}["key"])) is None
    assert exit_code_of(raised(lambda: None.x)) is None


def test_an_unknown_config_key_is_a_usage_error():
    from dataclasses import dataclass

    from omegaconf import OmegaConf

    @dataclass
    class Schema:
        a: int = 1

    error = raised(lambda: merge_into_schema({"b": 2}, lambda user: OmegaConf.structured(Schema)))
    assert isinstance(error, UsageError) and isinstance(error, ValueError) and "b" in str(error)


def test_reported_errors_print_one_line_and_exit(capsys, monkeypatch):
    monkeypatch.delenv("DEEPSPEC_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info, reported_errors("deepspec x"):
        raise FileExistsError("out: folder is not empty")
    assert exit_info.value.code == 1 and capsys.readouterr().err == "deepspec x: error: out: folder is not empty\n"
    with pytest.raises(KeyError), reported_errors("deepspec x"):
        raise KeyError("bug")
    monkeypatch.setenv("DEEPSPEC_DEBUG", "1")
    with pytest.raises(FileExistsError), reported_errors("deepspec x"):
        raise FileExistsError("shown with its traceback")


def test_the_debug_flag_is_taken_out_and_inherited(monkeypatch):
    for name in ("DEEPSPEC_DEBUG", "HYDRA_FULL_ERROR"):  # setenv first: the variables are restored (unset) after
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    assert take_debug_flag(["export", "--out", "e"]) == ["export", "--out", "e"]
    assert "DEEPSPEC_DEBUG" not in os.environ
    assert take_debug_flag(["cache", "--debug", "a=b"]) == ["cache", "a=b"]
    assert os.environ["DEEPSPEC_DEBUG"] == "1" and os.environ["HYDRA_FULL_ERROR"] == "1"


def test_a_full_disk_is_a_refusal_in_one_line_even_when_a_library_wrapped_it(capsys, monkeypatch):
    from safetensors import SafetensorError

    monkeypatch.delenv("DEEPSPEC_DEBUG", raising=False)
    named = DiskFullError("/runs/r/checkpoints/step-00000004", 10_000_000, "the last complete checkpoint is step-2")
    with pytest.raises(SystemExit) as exit_info, reported_errors("deepspec train"):
        raise named
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert err.startswith("deepspec train: error: /runs/r/checkpoints/step-00000004: no space left on device (it "
                          "needs about 10.0 MB") and "the last complete checkpoint is step-2" in err
    wrapped = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert exit_code_of(wrapped) == 1 and exit_code_of(OSError(28, "No space left on device")) == 1
    assert one_line(wrapped).startswith("no space left on device (SafetensorError: Error while serializing")
