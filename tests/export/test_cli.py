"""`deepspec export` end to end on a tiny drafter checkpoint (a save_pretrained folder)."""

from __future__ import annotations

import json
import logging

import pytest

from deepspec.cli import build_parser, main
from deepspec.drafters.build import load_drafter
from deepspec.export import load_exported


class RecordingHubApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory, tiny_qwen3):
    """The tiny Qwen3 target saved to disk, so the CLI can load it by path; loaded back as the CLI will."""
    from deepspec.targets.load import load_target

    folder = tmp_path_factory.mktemp("target")
    tiny_qwen3.model.save_pretrained(folder)
    tiny_qwen3.tokenizer.save_pretrained(folder)
    return str(folder), load_target(str(folder), device="cpu")


@pytest.mark.float_exact
def test_cli_export_hf_end_to_end(saved_target, probe, tmp_path):
    target_path, target = saved_target
    model = probe.make_drafter("dspark", target, num_draft_layers=1, markov_rank=8)
    expected = probe.outputs(model, target)
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"tau": {"dspark": {"gsm8k": 3.75}}}))
    api = RecordingHubApi()
    out = tmp_path / "out"
    argv = ["export", "--checkpoint", str(checkpoint), "--format", "hf", "--out", str(out), "--target", target_path,
            "--tau-table", str(results), "--push-to-hub", "org/tiny-dspark"]
    assert main(argv, hub_api=api) == 0
    probe.assert_same(expected, probe.outputs(load_drafter(out, target), target))
    card = (out / "README.md").read_text()
    assert "| dspark | 3.75 |" in card and "| global_step | 7 |" in card
    assert f"deepspec export --checkpoint {checkpoint}" in card
    assert api.calls[-1][0] == "upload_folder" and api.calls[-1][1]["folder_path"] == str(out)


@pytest.mark.float_exact
def test_cli_export_sglang_and_missing_target(saved_target, probe, tmp_path):
    target_path, target = saved_target
    model = probe.make_drafter("dflash", target, num_draft_layers=1)
    expected = probe.outputs(model, target)
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    out = tmp_path / "sglang"
    assert main(["export", "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(out),
                 "--target", target_path]) == 0
    probe.assert_same(expected, probe.outputs(load_exported(out, target), target))
    with pytest.raises(ValueError, match="pass target="):  # the speculators layout stores the target embedding
        main(["export", "--checkpoint", str(checkpoint), "--format", "vllm", "--out", str(tmp_path / "v")])
    # The verifier speculators resolves: the target's folder by default, --verifier when given.
    assert main(["export", "--checkpoint", str(checkpoint), "--format", "vllm", "--out", str(tmp_path / "v"),
                 "--target", target_path, "--verifier", "org/served-name"]) == 0
    verifier = json.loads((tmp_path / "v" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "org/served-name"
    with pytest.raises(ValueError, match="unknown option"):
        main(["export", "--checkpoint", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "h"),
              "--verifier", "org/served-name"])
    with pytest.raises(ValueError, match="model card of the 'hf' layout"):
        main(["export", "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(tmp_path / "s2"),
              "--tau-table", str(tmp_path / "r.json")])


def test_export_into_a_non_empty_folder_needs_overwrite_and_replaces_it_whole(saved_target, probe, tmp_path):
    target_path, target = saved_target
    model = probe.make_drafter("dflash", target, num_draft_layers=1)
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    (out / "config.json").write_text("{}")
    argv = ["export", "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(out), "--target", target_path]
    with pytest.raises(FileExistsError, match=rf"{out}: folder is not empty.*pass --overwrite"):
        main(argv)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "config.json").read_text() == "{}" and list(tmp_path.glob(".out.*")) == []
    assert main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "config.json", "deepspec_export.json",
                                                   "model.safetensors"]
    probe.assert_same(probe.outputs(model, target), probe.outputs(load_exported(out, target), target))
    with pytest.raises(ValueError, match=rf"--out {checkpoint} holds the checkpoint"):
        main(["export", "--checkpoint", str(checkpoint), "--format", "hf", "--out", str(checkpoint), "--overwrite"])
    assert (checkpoint / "model.safetensors").is_file()


def test_a_second_export_into_the_same_folder_at_once_is_refused(saved_target, probe, tmp_path, monkeypatch):
    """Two exports into one new --out at the same time: the second is refused at once, naming the first, and the
    folder holds the first one's export whole."""
    import os
    import threading

    import deepspec.export.sglang as sglang
    from deepspec.export import export_drafter
    from deepspec.utils.locks import LockHeldError

    _, target = saved_target
    first = probe.make_drafter("dflash", target, num_draft_layers=1)
    second = probe.make_drafter("dflash", target, seed=1, num_draft_layers=1)
    out, inside, release, finished = tmp_path / "out", threading.Event(), threading.Event(), []
    real_export = sglang.export

    def export_and_wait(model, out_dir, target=None, **opts):
        real_export(model, out_dir, target=target, **opts)
        if model is first:  # the first export is written, not yet in place, when the second one starts
            inside.set()
            release.wait(120)

    monkeypatch.setattr(sglang, "export", export_and_wait)
    thread = threading.Thread(target=lambda: finished.append(export_drafter(first, out, "sglang", target=target)))
    thread.start()
    try:
        assert inside.wait(120)
        with pytest.raises(LockHeldError, match=rf"the export into {out} is being written by another run: pid "
                                                rf"{os.getpid()} "):
            export_drafter(second, out, "sglang", target=target)
    finally:
        release.set()
        thread.join(120)
    assert finished == [out] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder, no lock
    probe.assert_same(probe.outputs(first, target), probe.outputs(load_exported(out, target), target))


@pytest.mark.parametrize("overwrite", [False, True], ids=["empty-target", "overwrite"])
def test_an_out_that_is_a_symbolic_link_is_written_through(saved_target, probe, tmp_path, overwrite):
    """The export goes into the folder the link points to; the link stays, nothing is left beside it."""
    target_path, target = saved_target
    model = probe.make_drafter("dflash", target, num_draft_layers=1)
    checkpoint, real, link = tmp_path / "ckpt", tmp_path / "storage" / "exports", tmp_path / "out"
    model.save_pretrained(checkpoint)
    real.mkdir(parents=True)
    if overwrite:
        (real / "old.txt").write_text("the previous export")
    link.symlink_to(real, target_is_directory=True)
    argv = ["export", "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(link), "--target",
            target_path, *["--overwrite"] * overwrite]
    assert main(argv) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["checksums.json", "config.json", "deepspec_export.json",
                                                   "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out", "storage"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["exports"]
    probe.assert_same(probe.outputs(model, target), probe.outputs(load_exported(link, target), target))


def test_failed_export_leaves_the_old_folder_untouched(saved_target, probe, tmp_path, monkeypatch):
    import deepspec.export.sglang as sglang

    _, target = saved_target
    model = probe.make_drafter("dflash", target, num_draft_layers=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous export")

    def write_then_fail(model, out_dir, target=None, **opts):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(sglang, "export", write_then_fail)
    from deepspec.export import export_drafter

    with pytest.raises(RuntimeError, match="disk full"):
        export_drafter(model, out, "sglang", target=target, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["old.txt"] and list(tmp_path.glob(".out.*")) == []


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_full_disk_leaves_the_old_export_untouched(saved_target, probe, tmp_path, overwrite):
    from deepspec.utils.faults import full_disk
    from deepspec.utils.io import DiskFullError

    target_path, target = saved_target
    checkpoint, out = tmp_path / "ckpt", tmp_path / "out"
    probe.make_drafter("dflash", target, num_draft_layers=1).save_pretrained(checkpoint)
    if overwrite:
        out.mkdir()
        (out / "old.txt").write_text("the previous export")
    argv = ["export", "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(out), "--target", target_path]
    with full_disk(tmp_path, free_bytes=1000):
        with pytest.raises(DiskFullError) as error:
            main(argv + ["--overwrite"] * overwrite)
        message = str(error.value)
    survives = "the existing out is unchanged" if overwrite else "out was not created"
    assert message.startswith(f"{out}: no space left on device (it needs about ")
    assert f"1.0 kB free there now); {survives} (the partial " in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] + ["out"] * overwrite
    assert not overwrite or [p.name for p in out.iterdir()] == ["old.txt"]


def test_hf_export_without_target_says_no_tokenizer_was_written(saved_target, probe, tmp_path, caplog):
    _, target = saved_target
    checkpoint = tmp_path / "ckpt"
    probe.make_drafter("dflash", target, num_draft_layers=1).save_pretrained(checkpoint)
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING, logger="deepspec.export.hf"):
        assert main(["export", "--checkpoint", str(checkpoint), "--format", "hf", "--out", str(out)]) == 0
    assert "no tokenizer files" in caplog.text and "--target" in caplog.text
    assert not list(out.glob("tokenizer*"))


def test_cli_parser_rejects_bad_arguments():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "--checkpoint", "c", "--format", "onnx", "--out", "o"])
    with pytest.raises(SystemExit):  # --checkpoint is required unless --verify (checked when run)
        main(["export", "--format", "hf", "--out", "o"])
    args = parser.parse_args(["export", "--checkpoint", "c", "--format", "nextn", "--out", "o"])
    assert args.format == "nextn" and args.target is None and args.push_to_hub is None


@pytest.mark.parametrize("extension,value,module", [("anchor_fusion", "latest_context", "input_fusion"),
                                                    ("output_adapter", "zero", "output_adapter")])
def test_extensions_no_engine_reads_are_refused_by_engine_layouts_and_kept_by_hf(tiny_qwen3, tmp_path, extension,
                                                                                 value, module):
    """No serving engine reads the anchor fusion or the output adapter: the SGLang/vLLM layouts refuse them (nothing
    written), formats_for leaves them out, and the HF folder round-trips them."""
    import torch

    from deepspec.drafters.block.config import engine_unread_extensions
    from deepspec.drafters.build import build_drafter
    from deepspec.export import export_drafter, formats_for, load_exported

    drafter = build_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, **{extension: value})
    assert engine_unread_extensions(drafter.config) == {extension: value}
    assert engine_unread_extensions(drafter.config.to_dict()) == {extension: value}
    with torch.no_grad():
        getattr(drafter.backbone, module).weight.normal_()  # trained: neither [I, I] nor zero
    for fmt in ("sglang", "vllm"):
        with pytest.raises(ValueError, match=extension):
            export_drafter(drafter, tmp_path / fmt, format=fmt, target=tiny_qwen3)
        assert not (tmp_path / fmt).exists()
    assert "sglang" in formats_for("dspark", "qwen3") and not {"sglang", "vllm"} & set(
        formats_for("dspark", "qwen3", engine_unread=True))
    export_drafter(drafter, tmp_path / "hf", format="hf", target=tiny_qwen3)
    loaded = load_exported(tmp_path / "hf", tiny_qwen3)
    assert getattr(loaded.config, extension) == value
    assert torch.equal(getattr(loaded.backbone, module).weight, getattr(drafter.backbone, module).weight)
