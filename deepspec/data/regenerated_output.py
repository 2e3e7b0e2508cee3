"""The output file of a regeneration, before anything is appended: what an earlier run left, checked against the
input without touching it (`read_existing_output`), an output that is one of the inputs refused
(`check_output_path`), the settings a resume must keep (`check_meta`, from `<out>.meta.json`), and the cut of a
line a kill left half-written (`cut_partial_line`). deepspec.data.regenerate says what the records are.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepspec.utils.io import read_json
from deepspec.utils.redact import redact_url

log = logging.getLogger(__name__)


def meta_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".meta.json")


@dataclass
class ExistingOutput:
    """What an earlier run left in the output file (read only; nothing is modified here)."""

    num_done: int = 0  # complete records, checked to be the expected prefix of the input ids
    complete_bytes: int = 0  # bytes of those complete lines
    partial_bytes: int = 0  # a cut-off last line (killed mid-write): removed just before appending


def _record_prefix(record_id: str) -> bytes:
    """How every line a regeneration writes begins (json.dumps of a dict whose first key is "id")."""
    return ('{"id": ' + json.dumps(record_id, ensure_ascii=False)).encode("utf-8")


def read_existing_output(out_path: Path, expected_ids: Sequence[str]) -> ExistingOutput:
    """Check an existing `out_path` against the input without touching it: every complete line must be the
    regenerated record of the input at its position, and a cut-off last line must be the start of the next
    one (what a kill mid-write leaves). Anything else is a clear error naming `path:line`."""
    if not out_path.exists():
        return ExistingOutput()
    data = out_path.read_bytes()
    complete_end = data.rfind(b"\n") + 1
    try:
        # Records are separated by b"\n" only: str.splitlines() would also split at U+2028/U+0085, which
        # json.dumps(ensure_ascii=False) writes raw inside answers.
        lines = data[:complete_end].decode("utf-8").split("\n")[:-1]
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{out_path}:{line}: not valid UTF-8; not a regenerated output, refusing to resume "
                         "into it. Use another --out or delete it") from None
    if len(lines) > len(expected_ids):
        raise ValueError(f"{out_path}: has {len(lines)} lines but the input has only {len(expected_ids)} "
                         "conversations; it was written from different input. Use another --out or delete it")
    for k, text in enumerate(lines):
        try:
            got = json.loads(text)["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{out_path}:{k + 1}: not a regenerated record (invalid JSON or no 'id'); "
                             "cannot resume") from None
        if got != expected_ids[k]:
            raise ValueError(f"{out_path}:{k + 1}: id {got!r} but input position {k} has id {expected_ids[k]!r}; "
                             "the output was written from different input (other prompts, order or limit). "
                             "Use another --out or delete it")
    partial = data[complete_end:]
    if partial:
        expected = _record_prefix(expected_ids[len(lines)]) if len(lines) < len(expected_ids) else None
        n = min(len(partial), len(expected or b""))
        if expected is None or partial[:n] != expected[:n]:
            raise ValueError(f"{out_path}:{len(lines) + 1}: the last line has no line end and is not the start of "
                             "the next regenerated record; not a run of this input killed mid-write, so it is "
                             "left as it is. Use another --out or delete it")
    return ExistingOutput(num_done=len(lines), complete_bytes=complete_end, partial_bytes=len(partial))


def check_output_path(out_path: Path, input_paths: Sequence[str | Path]) -> None:
    """Refuse an output that is (or links to) one of the input files: appending would rewrite the input."""
    for candidate in (out_path, meta_path(out_path)):
        if not candidate.exists():
            continue
        for source in input_paths:
            source = Path(source)
            if source.exists() and os.path.samefile(candidate, source):
                raise ValueError(f"--out {out_path}: {candidate} is the input file {source} (or a link to it); "
                                 "regeneration never writes into its input. Choose another --out")


def check_meta(out_path: Path, meta: dict, existing: ExistingOutput) -> None:
    path = meta_path(out_path)
    if existing.complete_bytes + existing.partial_bytes and not path.is_file():
        raise ValueError(f"{out_path} exists and is not empty, but {path.name} (written before any record) is "
                         "missing: it is not a regeneration output, so it is left untouched. Use another --out "
                         "or delete it")
    if existing.num_done and path.is_file():
        old, new = _resume_settings(read_json(path)), _resume_settings(meta)
        changed = [k for k in new if old.get(k) != new[k]]
        if changed:
            raise ValueError(f"{path}: cannot resume with different settings: "
                             + ", ".join(f"{k} was {old.get(k)!r}, now {new[k]!r}" for k in changed))
        was, now = (m.get("backend", {}).get("url") for m in (read_json(path), meta))
        if was != now:  # a meta written before URLs were redacted may hold credentials: never shown
            log.info("%s: resuming against %s (the records before were answered by %s)", out_path,
                     *(redact_url(url) if isinstance(url, str) else url for url in (now, was)))


def _resume_settings(meta: dict) -> dict:
    """What a resume must keep of a meta file. Where a sampling value came from may change (e.g. now given on the
    command line), the value may not; the server's address may change (the same model served elsewhere, with the
    same settings and seeds, answers alike), the model it serves may not."""
    settings = {k: v for k, v in meta.items() if k not in ("num_input", "generation_source")}
    if isinstance(settings.get("backend"), dict):
        settings["backend"] = {k: v for k, v in settings["backend"].items() if k != "url"}
    return settings


def cut_partial_line(out_path: Path, existing: ExistingOutput) -> None:
    log.warning("%s: dropping a truncated last line (%d bytes) before resuming", out_path, existing.partial_bytes)
    with open(out_path, "r+b") as f:
        f.truncate(existing.complete_bytes)
        f.flush()
        os.fsync(f.fileno())
