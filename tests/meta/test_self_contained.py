"""The checkout stands alone: nothing in it reads a path outside it, and no text in it points where a reader cannot
follow (tracker issue numbers, documents that are not in the repository, tools of the machines it was built on).

A fresh clone has nothing beside it, so a test or script that opens `../something` above the checkout or an absolute
developer path passes where that folder happens to exist and fails for every user. The checks are textual: they read
every file a clone gets (tracked by git when the checkout is a git repository, else every file under the source
folders). This file is the one place that names what it looks for, so it does not read itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a user's clone holds besides the package: the places any code, test, script or document lives.
SOURCE_ROOTS = ("README.md", "CHANGELOG.md", "CITATION.cff", "pyproject.toml", "train.py", "conf", "data_tools",
                "deepspec", "docs", "eval", "recipes", "requirements", "scripts", "tests")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json", ".jsonl", ".cff", ".cfg", ".ini", ""}


def repository_files() -> list[Path]:
    if shutil.which("git") and (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split("\0")
        paths = [REPO / name for name in listed if name]
    else:
        paths = [p for root in SOURCE_ROOTS for p in ([REPO / root] if (REPO / root).is_file()
                                                       else sorted((REPO / root).rglob("*")))]
    return [p for p in paths if p.is_file() and not p.is_symlink() and p.suffix in TEXT_SUFFIXES
            and "__pycache__" not in p.parts and p != Path(__file__).resolve()]


def lines_of(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    for number, line in enumerate(text.splitlines(), start=1):
        yield number, line


# An absolute path on a developer's machine.
ABSOLUTE = re.compile(r"[\"'`( =](/work|/home|/root|/mnt|/scratch|/Users)/")
# A relative path that climbs must land inside the checkout: a document's link resolved from the document's folder,
# a path in code from the checkout's root (where commands and tests run).
CLIMBING = re.compile(r"((?:\.\./)+)([\w.-]*)")
# Path(__file__)...parents[N]: N must stay inside the checkout (for a file `depth` folders deep, parents[depth - 1]
# is the checkout's root).
FILE_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")


def outside_paths(line: str, folder: Path, document: bool = False) -> list[str]:
    """What `line`, in a file of `folder` (a Markdown `document`: its links are relative to it), names outside the
    checkout."""
    found = [m.group(1) + "/..." for m in ABSOLUTE.finditer(line)]
    base = folder if document else REPO
    for match in CLIMBING.finditer(line):
        landed = (base / match.group(1) / match.group(2)).resolve()
        if landed != REPO and REPO not in landed.parents:
            found.append(match.group(0))
    depth = len(folder.relative_to(REPO).parts) + 1
    found += [f"parents[{m.group(1)}]" for m in FILE_PARENTS.finditer(line) if int(m.group(1)) > depth - 1]
    return found


def test_nothing_reads_a_path_outside_the_checkout():
    found = []
    for path in repository_files():
        relative = path.relative_to(REPO)
        if relative.name == "CHANGELOG.md":  # history
            continue
        found += [f"{relative}:{number}: {what} in {line.strip()[:120]}" for number, line in lines_of(path)
                  for what in outside_paths(line, path.parent, document=path.suffix == ".md")]
    assert found == [], "paths outside the checkout:\n" + "\n".join(found)


def test_the_outside_path_check_catches_what_it_should():
    tests_dir = REPO / "tests" / "meta"
    assert outside_paths('open("../sibling/data.jsonl")', tests_dir)  # run from the checkout's root: beside it
    assert outside_paths('    sibling = Path(__file__).resolve().parents[3] / "sibling"', tests_dir)
    assert outside_paths("cp /home/someone/venv/x .", tests_dir)
    assert not outside_paths("[the results](../../docs/results.md)", tests_dir, document=True)  # a link to docs/
    assert outside_paths("[notes](../../../notes.md)", tests_dir, document=True)
    assert not outside_paths("a path such as `../x`, an absolute path", REPO / "deepspec" / "cache", document=True)


# Tracker numbers, notes of the developers that are not in the repository, the tools of the machines it was built on.
UNFOLLOWABLE = re.compile(r"issue[ -]#?[0-9]+|DESIGN §|device tool|workplace|\b(DESIGN|STYLE|ENVIRONMENT)\.md\b",
                          re.IGNORECASE)
CHECKED_ROOTS = ("README.md", "docs", "deepspec", "recipes", "scripts", "tests", "data_tools", "eval", "train.py",
                 "requirements", "pyproject.toml", "CITATION.cff")


def test_no_reference_a_reader_cannot_follow():
    """The same as `grep -rniE PATTERN README.md docs deepspec recipes scripts tests` (+ the other source folders)
    finding nothing; CHANGELOG.md alone tells history and may name them."""
    found = []
    for path in repository_files():
        relative = path.relative_to(REPO)
        if relative.parts[0] not in CHECKED_ROOTS:
            continue
        found += [f"{relative}:{number}: {line.strip()[:140]}" for number, line in lines_of(path)
                  if UNFOLLOWABLE.search(line)]
    assert found == [], "references a reader cannot follow:\n" + "\n".join(found)


def test_the_reference_check_catches_what_it_should():
    for line in ("the preset before Issue 19", "the issue-19 measurement", "DESIGN §11", "the device tool's list",
                 "see STYLE.md", "this workplace"):
        assert UNFOLLOWABLE.search(line), line
    assert not UNFOLLOWABLE.search("an issue with the tokenizer; design choices")
