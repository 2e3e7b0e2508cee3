"""The LICENSE file is the license pyproject.toml declares, and CITATION.cff describes this version of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml with tomllib")

REPO = Path(__file__).resolve().parents[2]


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_the_license_file_is_the_declared_license_in_full():
    assert project()["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # All nine sections of the terms and the appendix: the full text, not a pointer to it.
    sections = re.findall(r"^\s+(\d)\. [A-Z][a-z]+", text, flags=re.MULTILINE)
    assert sections == [str(n) for n in range(1, 10)]
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_the_citation_file_matches_the_package():
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text(encoding="utf-8"))
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["version"] == project()["version"]
    assert citation["license"] == project()["license"]["text"]
    assert all(set(author) & {"name", "family-names"} for author in citation["authors"])
    titles = [reference["title"] for reference in citation["references"]]
    for method in ("DSpark", "DFlash", "EAGLE-3", "DeepSeek-V3", "Speculative Decoding", "Speculative Sampling"):
        assert any(method in title for title in titles), method
    for reference in citation["references"]:
        assert reference["year"] and reference["authors"], reference["title"]
        for identifier in reference.get("identifiers", []):
            assert re.fullmatch(r"arXiv:\d{4}\.\d{5}", identifier["value"]), identifier
            assert reference["url"] == "https://arxiv.org/abs/" + identifier["value"].removeprefix("arXiv:")
