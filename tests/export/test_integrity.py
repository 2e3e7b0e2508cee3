"""An export's checksums.json: written with every layout, checked by every DeepSpec reader (one line naming a
damaged file, never a traceback or a normal result), `deepspec export --verify`; what a killed export left goes
at the next one; a full disk's message counts what the layout stores besides the drafter's weights."""

from __future__ import annotations

import json

import pytest

from deepspec.cli import main
from deepspec.drafters.build import load_drafter
from deepspec.export import export_bytes, export_drafter, load_exported
from deepspec.utils.checksums import MANIFEST_FILE


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_qwen3):
    """A tiny DSpark drafter exported in the hf and the sglang layouts (read-only: tests damage copies)."""
    from deepspec.drafters.build import build_drafter

    model = build_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8)
    root = tmp_path_factory.mktemp("exported")
    for fmt in ("hf", "sglang"):
        export_drafter(model, root / fmt, fmt, target=tiny_qwen3)
    return root


def _copy(exported, layout: str, tmp_path):
    import shutil

    return shutil.copytree(exported / layout, tmp_path / layout)


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "a byte in the middle of the weights": lambda folder: _flip(folder / "model.safetensors",
                                                                (folder / "model.safetensors").stat().st_size // 2),
    "the first byte of the weights": lambda folder: _flip(folder / "model.safetensors", 0),
    "the weights truncated": lambda folder: (folder / "model.safetensors").write_bytes(
        (folder / "model.safetensors").read_bytes()[:1000]),
    "config.json cut to 300 bytes": lambda folder: (folder / "config.json").write_bytes(
        (folder / "config.json").read_bytes()[:300]),
}
DAMAGED_FILE = {"config.json cut to 300 bytes": "config.json"}


def test_every_layout_holds_a_manifest_of_its_files_and_verifies(exported, capsys):
    for layout in ("hf", "sglang"):
        manifest = json.loads((exported / layout / MANIFEST_FILE).read_text())
        files = sorted(p.name for p in (exported / layout).iterdir() if p.name != MANIFEST_FILE)
        assert sorted(manifest["files"]) == files and "model.safetensors" in files
        assert main(["export", "--verify", str(exported / layout)]) == 0
        assert capsys.readouterr().out.strip() == f"{exported / layout}: {len(files)} files match {MANIFEST_FILE}"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_export_is_one_line_naming_the_file_for_every_reader(exported, tiny_qwen3, tmp_path, damage):
    """What evaluate, calibrate and the benchmarks read (load_drafter, load_exported), what export reads
    (--checkpoint), and --verify: each refuses with the damaged file's name, before parsing it."""
    hf, sglang = _copy(exported, "hf", tmp_path), _copy(exported, "sglang", tmp_path)
    for folder in (hf, sglang):
        DAMAGE[damage](folder)
    named = str(hf / DAMAGED_FILE.get(damage, "model.safetensors"))
    readers = {"load_drafter": lambda: load_drafter(hf, tiny_qwen3),
               "load_exported (hf)": lambda: load_exported(hf, tiny_qwen3),
               "load_exported (sglang)": lambda: load_exported(sglang, tiny_qwen3),
               "export --checkpoint": lambda: main(["export", "--checkpoint", str(hf), "--format", "hf", "--out",
                                                    str(tmp_path / "again")]),
               "export --verify": lambda: main(["export", "--verify", str(hf)])}
    for reader, read in readers.items():
        with pytest.raises(ValueError) as error:
            read()
        message = str(error.value)
        folder = sglang if "sglang" in reader else hf
        assert "\n" not in message and str(folder / DAMAGED_FILE.get(damage, "model.safetensors")) in message, reader
        assert "the export is damaged" in message, reader
    assert named and not (tmp_path / "again").exists()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_export_without_a_manifest_is_still_one_line_naming_the_file(exported, tiny_qwen3, tmp_path, damage):
    """An export written before exports recorded checksums: a damaged file that does not parse is named (a flipped
    byte inside the tensors no reader can see without a manifest)."""
    hf = _copy(exported, "hf", tmp_path)
    (hf / MANIFEST_FILE).unlink()
    DAMAGE[damage](hf)
    if damage == "a byte in the middle of the weights":
        load_drafter(hf, tiny_qwen3)  # parses: only a manifest tells
        with pytest.raises(ValueError, match=rf"^{hf}: no {MANIFEST_FILE} \(not an export, or one written before"):
            main(["export", "--verify", str(hf)])
        return
    named = hf / DAMAGED_FILE.get(damage, "model.safetensors")
    for read in (lambda: load_drafter(hf, tiny_qwen3), lambda: load_exported(hf, tiny_qwen3)):
        with pytest.raises(ValueError) as error:
            read()
        assert str(error.value).startswith(f"{named}:") and "\n" not in str(error.value)


def test_verify_names_files_added_since_and_takes_no_export_options(exported, tmp_path, capsys):
    hf = _copy(exported, "hf", tmp_path)
    (hf / "notes.txt").write_text("added after the export")
    assert main(["export", "--verify", str(hf)]) == 0
    assert capsys.readouterr().out.strip().endswith("; not recorded (added since, not checked): notes.txt")
    with pytest.raises(SystemExit) as usage:
        main(["export", "--verify", str(hf), "--out", str(tmp_path / "x")])
    assert usage.value.code == 2 and "--verify checks an export and takes no --out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["export", "--format", "hf", "--out", str(tmp_path / "x")])
    assert usage.value.code == 2 and "required: --checkpoint (or --verify DIR)" in capsys.readouterr().err


def test_what_a_killed_export_left_goes_at_the_next_export(tiny_qwen3, tmp_path):
    from deepspec.drafters.build import build_drafter

    model = build_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    out = tmp_path / "out"
    (tmp_path / ".out.0123abcd.tmp").mkdir()  # kill -9 while the export was written
    (tmp_path / ".out.0123abcd.tmp" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".out.lock").write_text('{"pid": 1}')  # and its lock file
    (tmp_path / ".other.0123abcd.tmp").mkdir()  # another folder's: not this export's to remove
    export_drafter(model, out, "sglang", target=tiny_qwen3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.0123abcd.tmp", "out"]


def test_a_full_disk_message_counts_what_the_layout_stores_beside_the_weights(tiny_qwen3):
    """vLLM's layout stores the target's embedding and head beside the drafter's tensors, the hf one the tokenizer:
    the size a full disk's message gives counts them."""
    from deepspec.drafters.build import build_drafter

    model = build_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    matrix = tiny_qwen3.model.get_input_embeddings().weight
    assert export_bytes(model, "vllm") == weights  # no target: nothing of it is stored
    assert export_bytes(model, "vllm", tiny_qwen3) == weights + 2 * matrix.numel() * matrix.element_size()
    assert export_bytes(model, "hf", tiny_qwen3) > weights + 3_000_000  # the SmolLM2 tokenizer.json
