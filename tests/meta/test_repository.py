"""The checkout itself: the top-level conf/ is deepspec/conf (the same files, not a copy), every script runs, and
error messages put no "a" before a drafter kind's name ("a eagle3")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_top_level_conf_is_the_packaged_configs_not_a_copy():
    conf = REPO / "conf"
    assert conf.is_symlink() and os.readlink(conf) == "deepspec/conf"
    assert conf.resolve() == (REPO / "deepspec" / "conf").resolve()
    assert (conf / "train.yaml").is_file() and (conf / "target" / "smollm2-135m.yaml").is_file()


def test_every_script_has_its_run_bit():
    scripts = sorted((REPO / "scripts").glob("*.sh"))
    assert {p.name for p in scripts} >= {"bootstrap.sh", "gpu_check.sh", "fetch_gpu_wheels.sh"}
    if shutil.which("git") and (REPO / ".git").exists():  # what a clone gets: the mode recorded in git
        listed = subprocess.run(["git", "ls-files", "-s", "scripts"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.splitlines()
        modes = {Path(line.split("\t")[1]).name: line.split()[0] for line in listed if line.endswith(".sh")}
        assert modes == {p.name: "100755" for p in scripts}
    assert [p.name for p in scripts if not os.access(p, os.X_OK)] == []


@pytest.mark.parametrize("pattern", [r"\ba \{[^}]*kind[^}]*\}", r"\ba (eagle3|mtp)\b"])
def test_no_message_says_a_eagle3(pattern):
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in sorted((REPO / "deepspec").rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if re.search(pattern, line)]
    assert found == []


def test_the_readme_says_why_the_main_job_regenerates_otherwise_than_the_default(tmp_path, monkeypatch):
    """The documented default is the target's recommended sampling; a main job that departs from it says why."""
    from deepspec.pipeline import Pipeline, named_budget

    commands = []
    monkeypatch.setattr(Pipeline, "run", lambda self, name, cmd: commands.append(cmd))
    Pipeline(tmp_path, named_budget("default"), "smollm2-135m", ["dspark"], seed=0).regenerate()
    (cmd,) = commands
    greedy = "--greedy" in cmd or ("--temperature" in cmd and float(cmd[cmd.index("--temperature") + 1]) == 0)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    if greedy:
        assert "The main job is the exception: it regenerates greedily" in readme
    else:
        assert "--temperature" not in cmd  # the recommended sampling, as documented
