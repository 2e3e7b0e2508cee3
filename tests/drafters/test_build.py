"""Loading a saved drafter: the target it was trained for is checked, and the refusal names the way out."""

from __future__ import annotations

import pytest

from deepspec.drafters.build import build_drafter, load_drafter


def test_target_mismatch_refusal_names_the_cli_flag(tiny_llama, tiny_qwen3, tmp_path):
    build_drafter("dflash", tiny_llama, num_draft_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"target_fingerprint.config_hash=.* does not match the given target .* pass "
                                         r"--allow-target-mismatch \(deepspec evaluate, deepspec bench speed\)"):
        load_drafter(tmp_path, tiny_qwen3)
    assert load_drafter(tmp_path, tiny_qwen3, strict_target=False) is not None


def test_a_checkpoint_is_verified_before_it_loads(tiny_llama, tmp_path):
    """load_drafter, what every command reading a drafter goes through, checks a training checkpoint's
    checksums.json first: a damaged file is named, and a checkpoint whose checksums.json is gone is refused too."""
    import json

    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest
    from deepspec.utils.io import atomic_write_json

    step_dir = tmp_path / "step-00000002"
    build_drafter("dflash", tiny_llama, num_draft_layers=1).save_pretrained(step_dir / "drafter")
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 2}))
    atomic_write_json(step_dir / MANIFEST_FILE, folder_manifest(step_dir))
    assert load_drafter(step_dir / "drafter", tiny_llama) is not None
    config = step_dir / "drafter" / "config.json"
    config.write_text(config.read_text().replace('"num_draft_layers": 1', '"num_draft_layers": 2'))
    with pytest.raises(ValueError, match=rf"the checkpoint is damaged \({config}: sha256 differs"):
        load_drafter(step_dir / "drafter", tiny_llama)
    (step_dir / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match=rf"the training checkpoint {step_dir} has no checksums.json"):
        load_drafter(step_dir / "drafter", tiny_llama)
