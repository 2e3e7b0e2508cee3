"""Samples computed before the cache build that shards them (hybrid training's epoch 0, deepspec.cache.hybrid).

A staged sample is one file `<cache_dir>/.online-stage/p<position>.safetensors`: the sample's stored tensors (as a
shard stores them, `stored_sample_tensors`) and one metadata record, `deepspec_stage` (JSON: its fp8 error sums and
`sha256`, the digest of every tensor's name, dtype, shape and bytes and of those sums). Tensors and record are one
file written by one atomic rename (fsynced, as shards are), so a digest is always the one of the tensors it was
written with. One metadata key, as in shards: safetensors writes the keys of its metadata map in an arbitrary order,
and one key makes the file's bytes a function of its tensors and record alone.

Reading a staged sample back checks every byte of the file: the digest covers the tensors' bytes, names, dtypes and
shapes and the sums; safetensors' parse refuses a header length or offsets that do not tile the data to its last
byte; and the header must be in the one form it is written in (compact JSON, spaces up to a multiple of 8 bytes, the
record as sorted JSON), so a byte that still parses to the same values (a padding space turned into a tab) is found
too. A file that does not parse (truncated), whose digest differs (a flipped byte of a tensor), whose header is not
in that form or whose tokens are not the sample's is damaged: one warning line names it, the file is deleted and the
read answers None, so the caller computes the sample again. A damaged staged sample is never trusted and never fatal.

`settings.json` records what the staged samples were computed with (the cache settings without the world size, and
the forward batching), sealed (`format.sealed`): the caller compares it with its own, field by field, and a record
whose seal fails is damaged like one that does not parse (named; its samples are computed again). Staged samples
are consumed by the build (each deleted once a durable shard holds it), and a finished build removes the whole
folder (`remove_stage`, called by `merge_cache`), saying what it removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from deepspec.cache import format as fmt
from deepspec.utils.io import atomic_write_bytes, atomic_write_json, read_json

log = logging.getLogger(__name__)

SETTINGS_NAME = "settings.json"
RECORD_KEY = "deepspec_stage"  # the one metadata key of a staged sample: fp8 error sums and sha256

# (stored tensors, fp8 squared error, fp8 squared reference) of one sample computed before the build wrote it.
StagedSample = tuple[dict[str, torch.Tensor], float, float]


def staged_digest(tensors: dict[str, torch.Tensor], sq_error: float, sq_reference: float) -> str:
    """sha256 over the tensors (name, dtype, shape, bytes; sorted by name) and the fp8 sums' exact reprs."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    h.update(f"{sq_error!r}|{sq_reference!r}".encode())
    return h.hexdigest()


class SampleStage:
    """The stage folder of one cache folder: write, checked read, consume."""

    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir) / fmt.STAGE_DIR
        self.num_damaged = 0  # staged samples found damaged (and recomputed) by this process
        self.untrusted = False  # the stage's record is damaged: none of its samples is read, `prepare` removes them
        self.prepared = False

    def path(self, position: int) -> Path:
        return self.dir / f"p{position:09d}.safetensors"

    @property
    def settings_path(self) -> Path:
        return self.dir / SETTINGS_NAME

    def read_settings(self) -> dict | None:
        """What the staged samples were computed with; None when nothing is staged. A stage whose record is
        unreadable cannot be matched to any settings: named here, never read, and removed by `prepare` (its
        samples are computed again). Reads only: a run refused later (a held lock) has changed nothing."""
        if not self.dir.is_dir():
            return None
        if self.settings_path.is_file():
            try:
                settings = read_json(self.settings_path)
                # A stage written before records were sealed has none; a flipped seal name then differs as a field.
                why = fmt.seal_problem(settings, required=False)
                if why is None:
                    return {k: v for k, v in settings.items() if k != fmt.RECORD_SEAL}
            except ValueError as err:
                why = str(err)
        elif any(self.dir.glob("p*.safetensors")):
            why = f"staged samples without their {SETTINGS_NAME}"
        else:
            return None
        log.warning("%s: damaged stage record (%s); its staged samples are discarded and computed again",
                    self.settings_path, why)
        self.untrusted = True
        return None

    def prepare(self, settings: dict) -> None:
        """Before the first write (the writer's lock held): an untrusted stage removed, a killed run's temp files
        removed, the settings recorded."""
        if self.prepared:
            return
        if self.untrusted:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.untrusted = False
        elif self.dir.is_dir():
            for tmp in self.dir.glob(".*.tmp"):  # atomic writes name them '.<final name>.<random>.tmp'
                tmp.unlink(missing_ok=True)
        if not self.settings_path.is_file():
            atomic_write_json(self.settings_path, fmt.sealed(settings))
        self.prepared = True

    def write(self, position: int, staged: StagedSample) -> None:
        atomic_write_bytes(self.path(position), staged_file_bytes(staged))

    def read(self, position: int, input_ids_T: torch.Tensor, sample_id: str = "") -> StagedSample | None:
        """The staged sample at `position` if it is there and intact (its tokens `input_ids_T`), else None."""
        path = self.path(position)
        if self.untrusted:
            return None
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        problem, staged = _parse(payload, input_ids_T)
        if problem is None:
            return staged
        self.num_damaged += 1
        log.warning("%s: damaged staged sample%s (%s); deleted, it is computed again", path,
                    f" {sample_id!r}" if sample_id else "", problem)
        path.unlink(missing_ok=True)
        return None

    def discard(self, positions) -> None:
        for position in positions:
            self.path(position).unlink(missing_ok=True)


def staged_file_bytes(staged: StagedSample) -> bytes:
    """The file of a staged sample: its tensors and the one record (float reprs round-trip exactly through JSON,
    so the fp8 error sums of the merged meta.json are the build's)."""
    tensors, sq_error, sq_reference = staged
    record = {"fp8_sq_error": sq_error, "fp8_sq_reference": sq_reference,
              "sha256": staged_digest(tensors, sq_error, sq_reference)}
    return safetensors_save(dict(tensors), metadata={RECORD_KEY: json.dumps(record, sort_keys=True)})


def _parse(payload: bytes, input_ids_T: torch.Tensor) -> tuple[str | None, StagedSample | None]:
    """(problem, None) for a damaged file, (None, staged sample) for an intact one: every byte checked."""
    try:
        header_bytes = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8:8 + header_bytes])
        metadata = header.get("__metadata__") or {}
        if RECORD_KEY not in metadata:
            raise ValueError(f"no {RECORD_KEY!r} record in its metadata")
        record = json.loads(metadata[RECORD_KEY])
        tensors = safetensors_load(payload)  # refuses offsets that do not tile the data exactly, to its last byte
        sq_error, sq_reference = float(record["fp8_sq_error"]), float(record["fp8_sq_reference"])
        recorded = str(record["sha256"])
    except Exception as err:  # whatever fails to parse is damage, reported as such, never a crash
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"unreadable: {first_line[:200]}", None
    digest = staged_digest(tensors, sq_error, sq_reference)
    if digest != recorded:
        return f"sha256 {digest[:16]}... differs from the recorded {recorded[:16]}...", None
    problem = _form_problem(payload[8:8 + header_bytes], header, metadata[RECORD_KEY], record)
    if problem:
        return problem, None
    ids = tensors.get(fmt.TENSOR_INPUT_IDS)
    if ids is None or not torch.equal(ids, input_ids_T):
        return "its tokens are not the sample's as rendered now", None
    return None, (tensors, sq_error, sq_reference)


def _form_problem(header_text: bytes, header: dict, record_text: str, record: dict) -> str | None:
    """Whether the header is in the one form it is written in: compact JSON (what its parse writes back, in its
    order) padded with spaces to a multiple of 8 bytes, the record sorted JSON. A changed byte there that still
    parses to the same values (a padding space to a tab) is found here; one that changes a value fails the parse,
    the digest or the tokens. Only the header is compared: the digest has covered the data, at no copy."""
    if record_text != json.dumps(record, sort_keys=True):
        return f"its {RECORD_KEY} record is not in the form it is written in"
    compact = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    written = compact + b" " * (-len(compact) % 8)
    if header_text == written:
        return None
    at = next((k for k, (a, b) in enumerate(zip(header_text, written)) if a != b), min(len(header_text), len(written)))
    part = "its padding" if at >= len(compact) else "its JSON"
    return f"byte {8 + at} of its header ({part}) is not the one written"


def remove_stage(cache_dir: str | Path, why: str) -> str | None:
    """Delete the stage folder of `cache_dir` (a finished cache has no use for it); the report line, or None when
    there was none."""
    stage_dir = Path(cache_dir) / fmt.STAGE_DIR
    if not stage_dir.is_dir():
        return None
    files = [p for p in stage_dir.rglob("*") if p.is_file()]
    num_samples = sum(1 for p in files if p.suffix == ".safetensors")
    num_bytes = sum(p.stat().st_size for p in files)
    shutil.rmtree(stage_dir, ignore_errors=True)
    return (f"removed {stage_dir} ({num_samples} staged sample(s), {len(files)} file(s), {num_bytes / 2**20:.1f} MB): "
            f"{why}")
