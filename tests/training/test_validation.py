"""Decoded tau at validation: which prompts, when it is on, and what the training log reports."""

from __future__ import annotations

import json

import pytest
import torch


def test_heldout_prompts_are_the_tokens_before_the_first_answer_token(tiny_cache):
    from deepspec.cache.reader import CacheReader
    from deepspec.training.validation import heldout_prompts

    reader = CacheReader(tiny_cache)
    ids = reader.split("validation")
    prompts = heldout_prompts(reader, ids, 3, max_prompt_tokens=512)
    assert len(prompts) == 3
    for prompt, i in zip(prompts, ids):
        tokens_T, mask_T = reader.tokens(i)
        first = int(torch.nonzero(mask_T).flatten()[0])
        assert prompt == tokens_T[:first].tolist() and not mask_T[:first].any()
    shortest = min(len(p) for p in heldout_prompts(reader, ids, len(ids), 512))
    assert heldout_prompts(reader, ids, 3, max_prompt_tokens=shortest - 1) == []  # every prompt is longer


def test_decoding_at_validation_is_off_by_default_on_large_targets():
    from deepspec.training.validation import DEFAULT_DECODE_EVAL_PROMPTS, decode_eval_prompt_count

    small, large = torch.nn.Linear(4, 4), torch.nn.Module()
    large.weight = torch.nn.Parameter(torch.empty(10**9, device="meta"))  # 1B parameters, no memory
    assert decode_eval_prompt_count(None, small) == DEFAULT_DECODE_EVAL_PROMPTS
    assert decode_eval_prompt_count(None, large) == 0
    assert decode_eval_prompt_count(2, large) == 2 and decode_eval_prompt_count(0, small) == 0


@pytest.mark.parametrize("bad", ["trainer.decode_eval_prompts=-1", "trainer.decode_eval_max_new_tokens=0",
                                 "trainer.decode_eval_temperatures=[-1.0]"])
def test_decode_eval_settings_are_checked(tt, tiny_cache, tmp_path, bad):
    from deepspec.training.config import resolve_config

    with pytest.raises(ValueError, match=bad.split("=")[0]):
        resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path, bad)))


def test_validation_logs_decoded_tau_next_to_simulated_tau(tt, reference_run):
    records = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "validation"][-1]
    block = len(val["top1_agreement"])
    assert val["decode_num_prompts"] == 4  # tiny target: on by default
    for key, simulated in (("T0", "tau_greedy_sim"), ("T1", "tau_sim")):
        assert 1.0 <= val[f"tau_decoded_{key}"] <= block + 1
        assert val[f"tau_gap_{key}"] == pytest.approx(val[f"tau_decoded_{key}"] - val[simulated])
    train_cpu = [r["train_cpu_s"] for r in records if r["split"] == "train"]
    assert train_cpu[0] > 0 and all(b > a for a, b in zip(train_cpu, train_cpu[1:]))
    assert val["train_cpu_s"] == train_cpu[-1] and val["tokens_seen"] > 0


def test_a_rank_without_validation_samples_reduces_a_state_as_long_as_the_others(tt, tiny_cache, tmp_path, monkeypatch):
    """One validation sample on two ranks: rank 1 has no batch of its own. Its all-reduced state must have the
    length of rank 0's (a shorter one broke the collective: gloo 'Received data size doesn't match')."""
    from deepspec.training import validation
    from deepspec.training.session import build_session

    session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "run")))
    try:
        session.data.val_ids = session.data.val_ids[:1]
        reduced = {}
        for rank in (0, 1):
            monkeypatch.setattr(validation.dist, "all_reduce",
                                lambda state, rank=rank: reduced.__setitem__(rank, state))
            validation.run_validation(session.engine, session.data, session.num_positions, rank, 2,
                                      session.placement.device, session.placement.dtype)
        assert reduced[0].shape == reduced[1].shape
        assert float(reduced[1][-1]) == 0 and float(reduced[0][-1]) == 1  # batches: rank 1 had none of its own
    finally:
        session.engine.destroy()
        session.lock.close()


def test_validation_anchors_are_set_apart_from_training_anchors(tt, tiny_cache, tmp_path):
    """data.val_anchors_per_seq: a denser validation (more blocks per sequence) with training's batches unchanged."""
    from deepspec.training.session import build_session
    from deepspec.training.validation import run_validation

    blocks = {}
    for val_anchors in (None, 8):
        extra = ["data.max_anchors_per_seq=2"] + ([f"data.val_anchors_per_seq={val_anchors}"] if val_anchors else [])
        session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path / f"run{val_anchors}", *extra)))
        try:
            data = session.data
            train_batch = data.collate(data.train_ids[:2], epoch=0)
            assert int(train_batch.stats["num_blocks"]) <= 2 * 2
            metrics = run_validation(session.engine, data, session.num_positions, 0, 1, session.placement.device,
                                     session.placement.dtype)
            blocks[val_anchors] = metrics["num_blocks"]
        finally:
            session.engine.destroy()
            session.lock.close()
    assert blocks[None] <= 2 * len(session.data.val_ids) < blocks[8] <= 8 * len(session.data.val_ids)
