"""The checkout stands alone: nothing in it reads a path outside it, and no text in it points where a reader cannot
follow (tracker issue numbers, design notes that are not in the repository, tools of the machines it was built on).

A fresh clone has nothing beside it, so a test or script that opens `../something` or an absolute developer path
passes where that folder happens to exist and fails for every user. The checks are textual: they read every file
a clone gets (tracked by git when the checkout is a git repository, else every file under the source folders)."""

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
            and "__pycache__" not in p.parts]


def lines_of(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    for number, line in enumerate(text.splitlines(), start=1):
        yield number, line


# A folder beside the checkout, or an absolute path on a developer's machine.
OUTSIDE = re.compile(r"\.\./(shared|notes|work)\b|[\"'`( =](/work|/home|/root|/mnt|/scratch|/Users)/|"
                     r"\bparents\[\d+\]\s*/\s*[\"']shared[\"']")
# Path(__file__)...parents[N]: N must stay inside the checkout (for a file `depth` folders deep, parents[depth - 1]
# is the checkout's root).
FILE_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")


def test_nothing_reads_a_path_outside_the_checkout():
    found = []
    for path in repository_files():
        relative = path.relative_to(REPO)
        if relative.name == "CHANGELOG.md" or path == Path(__file__).resolve():  # history; this file's examples
            continue
        depth = len(relative.parts)
        for number, line in lines_of(path):
            if OUTSIDE.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
            for match in FILE_PARENTS.finditer(line):
                if int(match.group(1)) > depth - 1:
                    found.append(f"{relative}:{number}: parents[{match.group(1)}] leaves the checkout")
    assert found == [], "paths outside the checkout:\n" + "\n".join(found)


def test_the_outside_path_check_catches_what_it_should():
    """The two patterns above, on the lines a test once used (so the check cannot silently match nothing)."""
    assert OUTSIDE.search('open("../shared/eval_datasets/x.jsonl")')
    assert OUTSIDE.search('    shared = Path(__file__).resolve().parents[3] / "shared" / "eval_datasets"')
    assert OUTSIDE.search("cp /work/venvs/x .")
    assert not OUTSIDE.search("a path such as `../x`, an absolute path")
    assert int(FILE_PARENTS.search("Path(__file__).resolve().parents[3]").group(1)) == 3


# Tracker numbers, the developers' design notes and their sections, the tools of the machines the project was
# built on. Built from parts so that this file does not match itself.
UNFOLLOWABLE = re.compile("|".join([r"issue[ -]#?[0-9]+", "DESIGN " + "\u00a7", "device " + "tool", "work" + "place",
                                    r"\b(DESIGN|STYLE|ENVIRONMENT)\.md\b"]), re.IGNORECASE)
CHECKED_ROOTS = ("README.md", "docs", "deepspec", "recipes", "scripts", "tests", "data_tools", "eval", "train.py",
                 "requirements", "pyproject.toml", "CITATION.cff")


def test_no_reference_a_reader_cannot_follow():
    """The same as `grep -rniE PATTERN README.md docs deepspec recipes scripts conf tests` (+ the other source
    folders; conf/ is deepspec/conf) finding nothing; CHANGELOG.md alone tells history and may name them."""
    found = []
    for path in repository_files():
        relative = path.relative_to(REPO)
        if relative.parts[0] not in CHECKED_ROOTS:
            continue
        found += [f"{relative}:{number}: {line.strip()[:140]}" for number, line in lines_of(path)
                  if UNFOLLOWABLE.search(line)]
    assert found == [], "references a reader cannot follow:\n" + "\n".join(found)


def test_the_reference_check_catches_what_it_should():
    for line in ("the preset before Iss" + "ue 19", "the iss" + "ue-19 measurement", "DESIGN " + "\u00a711",
                 "the device " + "tool's list", "see STYLE" + ".md", "this work" + "place"):
        assert UNFOLLOWABLE.search(line), line
    assert not UNFOLLOWABLE.search("an issue with the tokenizer; design choices")
