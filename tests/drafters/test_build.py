"""Loading a saved drafter: the target it was trained for is checked, and the refusal names the way out."""

from __future__ import annotations

import pytest

from deepspec.drafters.build import build_drafter, load_drafter


def test_target_mismatch_refusal_names_the_cli_flag(tiny_llama, tiny_qwen3, tmp_path):
    build_drafter("dflash", tiny_llama, num_draft_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"target_fingerprint.config_hash=.* does not match the given target .* pass "
                                         r"--allow-target-mismatch \(eval/evaluate.py, eval/bench_speed.py\)"):
        load_drafter(tmp_path, tiny_qwen3)
    assert load_drafter(tmp_path, tiny_qwen3, strict_target=False) is not None
