"""Single-process training on CPU: loss goes down, run folder contents, every drafter kind, consolidated
checkpoint reload, ZeRO-1/ZeRO-3, plain `python train.py` and a Hydra multirun sweep."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file


def test_dspark_run_lowers_loss_and_fills_the_run_folder(tt, reference_run):
    losses = tt.train_losses(reference_run)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (reference_run / "config.yaml").is_file()
    records = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "validation"][-1]
    assert len(val["top1_agreement"]) == 4 and len(val["expected_acceptance"]) == 4  # block size 4
    assert 1.0 <= val["tau_sim"] <= 5.0 and 1.0 <= val["tau_greedy_sim"] <= 5.0
    assert all(0.0 <= a <= 1.0 for a in val["expected_acceptance"])
    assert {"loss_ce", "loss_tv", "loss_conf"} <= set(val)
    train = [r for r in records if r["split"] == "train"][0]
    assert train["tokens_per_s"] > 0 and train["anchors_per_s"] > 0
    ckpt = reference_run / "checkpoints" / "step-00000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["batch_in_epoch"] == 4 and isinstance(state["rng"]["torch"], list)
    weights = load_file(str(ckpt / "drafter" / "model.safetensors"))
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    assert set(moments) == {f"{k}.{n}" for n in weights for k in ("exp_avg", "exp_avg_sq")}
    assert not any("embed_tokens" in n or "lm_head" in n for n in weights)  # no target weights


@pytest.mark.float_exact
def test_consolidated_checkpoint_reloads_to_identical_outputs(tt, tiny_cache, tmp_path):
    from deepspec.drafters.build import load_drafter
    from deepspec.training.loop import train
    from deepspec.training.session import build_session

    session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path, "trainer.max_steps=2")))
    try:
        summary = train(session)
        batch = session.data.collate(session.data.val_ids[:2], epoch=0)
        trained = session.drafter.eval()
        reloaded = load_drafter(f"{summary['checkpoint']}/drafter", session.target).eval()
        with torch.no_grad():
            expected, actual = trained(batch), reloaded(batch)
        head = session.target.model.get_output_embeddings().weight
        assert torch.equal(expected.hidden_NH @ head.T, actual.hidden_NH @ head.T)
        assert torch.equal(expected.confidence_logits_N, actual.confidence_logits_N)
    finally:
        session.engine.destroy()
        session.lock.close()


@pytest.mark.parametrize("drafter,zero", [("dflash", "zero1"), ("eagle3", "zero1"), ("mtp", "zero2"),
                                          ("standalone", "zero2")])
def test_every_drafter_kind_trains(tt, tiny_cache, tmp_path, drafter, zero):
    """Four optimizer steps of each kind through the real loop: the training loss goes down step over step
    (each kind's objective, batcher and optimizer wiring work together), validation reports its metrics."""
    from deepspec.training import run

    summary = run(tt.compose(tt.train_overrides(tiny_cache, tmp_path, f"deepspeed={zero}", "trainer.max_steps=4",
                                                drafter=drafter)))
    losses = tt.train_losses(tmp_path)
    assert summary["step"] == 4 and len(losses) == 4 and all(math.isfinite(v) and v > 0 for v in losses)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert summary["validation"]["tau_sim"] >= 1.0


def test_standalone_trains_from_a_top_k_cache_other_kinds_are_refused(tt, tmp_path):
    """A token-only cache (ids, mask, the target's top-k next-token log-probs): the standalone drafter distils
    from it under the same loop; a kind that reads hidden states is refused before any weights load."""
    from deepspec.cache import BuildJob, build_cache, read_meta
    from deepspec.cache.config import CacheSchema
    from deepspec.targets.load import make_tiny_target
    from deepspec.training import run
    from deepspec.training.config import plan_training, resolve_config

    convs = tt.make_conversations(12)
    cache = tmp_path / "cache"
    build_cache({"train": convs[:8], "validation": convs[8:]}, make_tiny_target("llama"),
                BuildJob(CacheSchema(out_dir=str(cache), layer_ids=[], max_length=64, batch_size=4,
                                     storage_dtype="fp32", progress=False, content="top_k_logprobs", top_k=32)))
    assert read_meta(cache).bytes_per_token == 4 + 1 + 32 * 8
    with pytest.raises(ValueError, match=r"stores top_k_logprobs \(cache.content\), but a dspark drafter trains "
                                         r"from \['hidden_states'\]"):
        plan_training(resolve_config(tt.compose(tt.train_overrides(cache, tmp_path / "dspark"))), world_size=1)
    summary = run(tt.compose(tt.train_overrides(cache, tmp_path / "run", "trainer.max_steps=3",
                                                "calibration.enabled=false", drafter="standalone")))
    losses = tt.train_losses(tmp_path / "run")
    assert summary["step"] == 3 and all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert len(summary["validation"]["expected_acceptance"]) == 3


@pytest.mark.slow
def test_plain_python_zero3_run_sets_up_its_own_process_group(tt, tiny_cache, tmp_path):
    cmd = [sys.executable, str(tt.REPO / "train.py"), *tt.train_overrides(tiny_cache, tmp_path, "deepspeed=zero3",
                                                                         "trainer.max_steps=2"),
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mpi4py" not in proc.stderr
    assert len(tt.train_losses(tmp_path)) == 2
    weights = load_file(str(tmp_path / "checkpoints" / "step-00000002" / "drafter" / "model.safetensors"))
    assert all(t.numel() > 0 for t in weights.values())  # gathered from the ZeRO-3 partitions


@pytest.mark.slow
def test_hydra_multirun_sweep_writes_one_run_per_job(tt, tiny_cache, tmp_path):
    overrides = tt.train_overrides(tiny_cache, None, "trainer.max_steps=1")
    overrides = [o for o in overrides if not o.startswith("drafter.num_draft_layers")]
    cmd = [sys.executable, str(tt.REPO / "train.py"), "-m", *overrides, "drafter.num_draft_layers=1,2",
           f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, layers in (("0", 1), ("1", 2)):
        config = json.loads((tmp_path / job / "checkpoints" / "step-00000001" / "drafter" / "config.json").read_text())
        assert config["num_draft_layers"] == layers
        assert len(tt.train_losses(tmp_path / job)) == 1


def test_metric_logger_writes_every_sink(tmp_path):
    from deepspec.training.config import LoggerSchema
    from deepspec.training.log import MetricLogger, read_metrics

    sinks = LoggerSchema(jsonl=True, tensorboard=True, wandb=True)  # wandb: WANDB_MODE=disabled in tests
    logger = MetricLogger(sinks, tmp_path, rank=0, run_config={"a": 1}, run_name="t", resume=False)
    logger.log({"loss": 2.5, "top1_agreement": torch.tensor([0.5, float("nan")])}, step=3, split="validation")
    logger.close()
    record = read_metrics(tmp_path, "validation")[0]
    assert record["step"] == 3 and record["loss"] == 2.5 and record["top1_agreement"] == [0.5, None]
    assert any((tmp_path / "tensorboard").iterdir())
    silent = MetricLogger(sinks, tmp_path / "rank1", rank=1, run_config={}, run_name="t", resume=False)
    silent.log({"loss": 1.0}, step=1, split="train")
    assert not (tmp_path / "rank1").exists()


@pytest.mark.parametrize("drafter", ["eagle3", "dspark", "dflash"])
def test_reduced_vocabulary_is_built_from_the_training_split(tt, tiny_cache, tmp_path, drafter):
    from deepspec.cache.reader import CacheReader
    from deepspec.drafters.draft_vocab import kept_target_ids
    from deepspec.training.session import build_session

    session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path, "trainer.max_steps=1",
                                                          "drafter.draft_vocab_size=64", drafter=drafter)))
    try:
        kept = set(kept_target_ids(session.drafter.d2t).tolist())
        reader = CacheReader(tiny_cache)
        counts = {}
        for index in reader.split("train"):
            ids, mask = reader.tokens(index)
            for tok in ids[mask].tolist():
                counts[tok] = counts.get(tok, 0) + 1
        special = set(session.target.tokenizer.all_special_ids)
        most_frequent = sorted(counts, key=lambda t: (-counts[t], t))[: 64 - len(special)]
        assert special <= kept and len(kept) == 64
        assert set(most_frequent) - special <= kept  # the most frequent assistant tokens are kept
        assert kept != set(range(64))  # not the identity placeholder
    finally:
        session.engine.destroy()
        session.lock.close()


@pytest.mark.parametrize("drafter", ["dspark", "dflash"])
def test_block_drafters_train_two_steps_with_a_reduced_vocabulary(tt, tiny_cache, tmp_path, drafter):
    """The real loop with drafter.draft_vocab_size: finite losses, validation metrics, and a checkpoint holding
    the vocabulary built before step 1 (d2t/t2d) and DSpark's heads in draft-vocabulary space."""
    from deepspec.drafters.build import load_drafter
    from deepspec.training.loop import train
    from deepspec.training.session import build_session

    session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path, "trainer.max_steps=2",
                                                          "trainer.val_every=2", "drafter.draft_vocab_size=64",
                                                          drafter=drafter)))
    try:
        summary = train(session)
        losses = tt.train_losses(tmp_path)
        assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
        assert 1.0 <= summary["validation"]["tau_sim"] <= 5.0
        reloaded = load_drafter(f"{summary['checkpoint']}/drafter", session.target)
        assert torch.equal(reloaded.d2t, session.drafter.d2t) and reloaded.d2t.any()  # not the identity placeholder
        if drafter == "dspark":
            assert reloaded.sequential.out.weight.shape[0] == 64
            assert reloaded.sequential.prev_embed.weight.shape[0] == 65
    finally:
        session.engine.destroy()
        session.lock.close()
