"""data.features = online | hybrid (deepspec.training.features): the same losses and weights as training from a
cache, hybrid's cache byte-identical to a `deepspec cache` build, kill-and-resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from deepspec.cache.pipeline import run_cache_job

LAYERS = "[0,1,2]"


def write_conversations(path: Path, convs, extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps({"id": c.id, "conversations": c.messages}) for c in convs]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, conversations_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("prompts") / "convs.jsonl", conversations_factory(24))


def source_overrides(prompts: Path, *extra: str) -> list[str]:
    """The online/hybrid data options; the cache job below gets the same values under its own names."""
    return [f"data.source.prompts={prompts}", "data.source.val_fraction=0.2", "data.cache.max_length=64",
            f"data.cache.layer_ids={LAYERS}", "data.cache.shard_size_mb=0.01", "trainer.decode_eval_prompts=0",
            *extra]


def build_reference_cache(prompts: Path, out_dir: Path, target: str = "tiny-random-llama") -> Path:
    """`deepspec cache` of the same data with one sample per forward (the online computation)."""
    from deepspec.cache.config import compose_cache_config

    cfg = compose_cache_config([f"target={target}", f"data.prompts={prompts}", "data.val_fraction=0.2",
                                f"cache.out_dir={out_dir}", f"cache.layer_ids={LAYERS}", "cache.max_length=64",
                                "cache.shard_size_mb=0.01", "cache.batch_size=1", "cache.progress=false"])
    job = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    assert run_cache_job(job) == 0
    return out_dir


@pytest.fixture(scope="module")
def reference_cache(prompts, tmp_path_factory) -> Path:
    return build_reference_cache(prompts, tmp_path_factory.mktemp("reference_cache") / "cache")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from deepspec.training.checkpoint import list_checkpoints

    return load_file(str(list_checkpoints(run_dir)[-1] / "drafter" / "model.safetensors"))


def assert_same_training(run_a: Path, run_b: Path, tt) -> None:
    assert tt.train_losses(run_a) == tt.train_losses(run_b)  # bit for bit: the same computation
    weights_a, weights_b = final_weights(run_a), final_weights(run_b)
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def cache_files(cache_dir: Path) -> dict[str, bytes]:
    """Every file of a cache folder but the locks (they record the writer's pid and start time)."""
    return {p.name: p.read_bytes() for p in sorted(cache_dir.iterdir()) if p.is_file() and not p.name.startswith(".lock")}


@pytest.fixture(scope="module")
def offline_run(tt, reference_cache, prompts, tmp_path_factory) -> Path:
    """6 steps (4 per epoch: 19 train samples, 4 per step) from the reference cache."""
    from deepspec.training import run

    out = tmp_path_factory.mktemp("offline_run")
    run(tt.compose(tt.train_overrides(reference_cache, out, "trainer.max_steps=6", "trainer.decode_eval_prompts=0")))
    return out


@pytest.mark.float_exact
def test_online_matches_offline_bit_for_bit(tt, offline_run, prompts, tmp_path):
    from deepspec.training import run

    result = run(tt.compose(tt.train_overrides(tmp_path / "no-cache", tmp_path / "run", "trainer.max_steps=6",
                                               "data.features=online", *source_overrides(prompts))))
    assert result["step"] == 6
    assert not (tmp_path / "no-cache").exists()  # online writes no cache
    assert_same_training(tmp_path / "run", offline_run, tt)


def test_online_source_returns_the_cached_records(reference_cache, prompts, tiny_llama):
    """reader[i] of the online source is the cache's sample i, tensor for tensor (bf16 storage, rounded alike)."""
    from deepspec.cache.reader import CacheReader
    from deepspec.training.config import TrainConfig
    from deepspec.training.features import load_conversations, make_feature_source

    cfg = TrainConfig()
    cfg.data.features, cfg.data.source.prompts, cfg.data.source.val_fraction = "online", str(prompts), 0.2
    cfg.data.cache.max_length = 64
    source = make_feature_source(cfg, tiny_llama, load_conversations(cfg.data.source), [0, 1, 2], 0, 1)
    reader = CacheReader(reference_cache, vocab_size=source.vocab_size)
    assert source.samples == [{k: s[k] for k in ("id", "split", "length", "position", "num_loss_tokens")}
                              for s in reader.samples]
    for i in (0, 7, len(reader) - 1):
        got, want = source[i], reader[i]
        for name in ("input_ids", "loss_mask", "features", "final_hidden", "target_lse"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.features.dtype == torch.float32 and got.sample_id == want.sample_id
    assert source.split("validation") == reader.split("validation")


def test_hybrid_writes_the_cache_of_a_cache_build_and_trains_the_same(tt, offline_run, reference_cache, prompts,
                                                                       tmp_path):
    from deepspec.training import run

    cache = tmp_path / "cache"
    run(tt.compose(tt.train_overrides(cache, tmp_path / "run", "trainer.max_steps=6", "data.features=hybrid",
                                      *source_overrides(prompts))))
    files = cache_files(cache)
    assert files == cache_files(reference_cache)  # byte-identical: shards, partial and global index, meta
    assert len([n for n in files if n.startswith("shard-")]) > 1
    assert not (cache / ".online-stage").exists()
    assert_same_training(tmp_path / "run", offline_run, tt)  # epoch 0 online, epoch 1 from the written cache


def test_hybrid_killed_mid_epoch_resumes_to_the_same_cache_and_weights(tt, offline_run, reference_cache, prompts,
                                                                        tmp_path):
    from deepspec.training import run

    cache = tmp_path / "cache"
    overrides = tt.train_overrides(cache, tmp_path / "run", "trainer.max_steps=6", "trainer.save_every=1",
                                   "data.features=hybrid", *source_overrides(prompts))
    stopped = run(tt.compose([*overrides, "faults.stop_after=2"]))
    assert stopped["stopped"] and stopped["step"] == 2
    staged = sorted(p.name for p in (cache / ".online-stage").glob("p*.safetensors"))
    assert len(staged) >= 8 and not (cache / "meta.json").exists()  # epoch 0 half done, no shard yet
    resumed = run(tt.compose(overrides))
    assert resumed["step"] == 6 and not resumed["stopped"]
    assert cache_files(cache) == cache_files(reference_cache)
    assert_same_training(tmp_path / "run", offline_run, tt)


def test_hybrid_reuses_a_finished_cache_and_refuses_another_targets(tt, reference_cache, prompts, tmp_path):
    from deepspec.training import run

    before = cache_files(reference_cache)
    run(tt.compose(tt.train_overrides(reference_cache, tmp_path / "run", "trainer.max_steps=1", "data.features=hybrid",
                                      *source_overrides(prompts))))
    assert cache_files(reference_cache) == before  # read, not rewritten
    # build_cache, not the cache job: the job tears down the process group this process's training runs share.
    from deepspec.cache import build_cache
    from deepspec.targets.load import make_tiny_target
    from deepspec.training.config import TrainConfig
    from deepspec.training.features import load_conversations

    source_cfg = TrainConfig().data.source
    source_cfg.prompts, source_cfg.val_fraction = str(prompts), 0.2
    other = tmp_path / "qwen3-cache"
    build_cache(load_conversations(source_cfg)[0], make_tiny_target("qwen3"), other, [0, 1, 2], max_length=64,
                progress=False)
    with pytest.raises(ValueError, match="config_hash"):
        run(tt.compose(tt.train_overrides(other, tmp_path / "run2", "data.features=hybrid",
                                          *source_overrides(prompts))))


def test_bad_line_fails_naming_it_and_writes_nothing(tt, conversations_factory, tmp_path):
    from deepspec.training import run

    bad = write_conversations(tmp_path / "bad.jsonl", conversations_factory(24), extra_lines=('{"id": "x", "conv',))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"bad\.jsonl:25: .*malformed or truncated|1 malformed or truncated"):
        run(tt.compose(tt.train_overrides(cache, tmp_path / "run", "data.features=hybrid", *source_overrides(bad))))
    assert not cache.exists()


def test_prompt_over_the_context_fails_naming_the_sample(tt, conversations_factory, tmp_path):
    from deepspec.data.sources import Conversation
    from deepspec.training import run

    convs = conversations_factory(24)
    convs.append(Conversation(id="too-long", messages=[{"role": "user", "content": "word " * 2100},
                                                       {"role": "assistant", "content": "ok"}], source="t", line=25))
    prompts = write_conversations(tmp_path / "long.jsonl", convs)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"'too-long'.*data\.cache\.max_length <= 2048"):
        run(tt.compose(tt.train_overrides(cache, tmp_path / "run", "data.features=hybrid",
                                          *source_overrides(prompts, "data.cache.max_length=null"))))
    assert not any(cache.glob("*.safetensors")) and not (cache / ".online-stage").exists()


def test_resume_with_another_target_fails_naming_the_checkpoint(tt, prompts, tmp_path):
    from deepspec.training import run

    overrides = [*source_overrides(prompts), "data.features=online", "trainer.max_steps=1"]
    run(tt.compose(tt.train_overrides(tmp_path / "none", tmp_path / "run", *overrides)))
    qwen = [o.replace("target=tiny-random-llama", "target=tiny-random-qwen3")
            for o in tt.train_overrides(tmp_path / "none", tmp_path / "run", *overrides, "trainer.max_steps=2")]
    with pytest.raises(ValueError, match=r"drafter/config\.json: target_fingerprint\.config_hash=.*another target"):
        run(tt.compose(qwen))


def test_config_checks_name_the_field(tt, prompts, tmp_path):
    from deepspec.training.config import plan_training, resolve_config

    def plan(*extra):
        return plan_training(resolve_config(tt.compose(tt.train_overrides(tmp_path / "c", tmp_path / "r", *extra))))

    with pytest.raises(ValueError, match="data.features='disk' must be one of"):
        plan("data.features=disk")
    with pytest.raises(ValueError, match="data.cache.storage_dtype"):
        plan("data.features=online", *source_overrides(prompts, "data.cache.storage_dtype=int4"))
    with pytest.raises(ValueError, match="data.cache.out_dir=.* not used"):
        plan("data.features=hybrid", *source_overrides(prompts, "data.cache.out_dir=/elsewhere"))
    assert plan("data.features=online", *source_overrides(prompts)).cache_layer_ids == [0, 1, 2]
    with pytest.raises(FileNotFoundError, match="data.features=online"):  # offline without a cache says how
        plan()


@pytest.mark.slow
@pytest.mark.float_exact
def test_online_matches_offline_on_the_embedded_target(tt, conversations_factory, tmp_path):
    """SmolLM2 (bf16 storage, 5 spread layers): 2 optimizer steps online and from a batch_size=1 cache agree."""
    from deepspec.cache.config import compose_cache_config
    from deepspec.training import run

    prompts = write_conversations(tmp_path / "convs.jsonl", conversations_factory(10))
    cfg = compose_cache_config(["target=smollm2-135m", f"data.prompts={prompts}", "data.val_fraction=0.2",
                                f"cache.out_dir={tmp_path / 'cache'}", "cache.max_length=64", "cache.batch_size=1",
                                "cache.progress=false"])
    assert run_cache_job(OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                                                resolve=True)) == 0

    def overrides(cache, out, *extra):
        return [o.replace("target=tiny-random-llama", "target=smollm2-135m")
                for o in tt.train_overrides(cache, out, "trainer.max_steps=2", "trainer.global_batch_size=2",
                                            "trainer.micro_batch_size=1", "trainer.decode_eval_prompts=0", *extra)]

    run(tt.compose(overrides(tmp_path / "cache", tmp_path / "offline")))
    run(tt.compose(overrides(tmp_path / "none", tmp_path / "online", "data.features=online",
                             f"data.source.prompts={prompts}", "data.source.val_fraction=0.2",
                             "data.cache.max_length=64")))
    assert_same_training(tmp_path / "online", tmp_path / "offline", tt)


@pytest.mark.slow
def test_two_process_hybrid_matches_one_process(tt, offline_run, reference_cache, prompts, tmp_path):
    """2 ranks (gloo), each computing its own micro batches' samples: the trajectory of the 1-process run from the
    cache (gradients averaged in another order: float tolerance, as tests/training/test_train_distributed.py), and
    a 2-rank cache holding exactly the reference cache's samples, tensor for tensor."""
    import subprocess

    from deepspec.cache.reader import CacheReader, verify_cache

    cache = tmp_path / "cache"
    cmd = tt.torchrun(2, *tt.train_overrides(cache, tmp_path / "run", "trainer.max_steps=6", "data.features=hybrid",
                                             *source_overrides(prompts)), f"hydra.run.dir={tmp_path / 'run'}")
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tt.train_losses(tmp_path / "run") == pytest.approx(tt.train_losses(offline_run), rel=1e-4)
    assert verify_cache(cache) == [] and sorted(p.name for p in cache.glob("index-r*.json")) == [
        "index-r0.json", "index-r1.json"]
    got, want = CacheReader(cache), CacheReader(reference_cache)
    assert [(s["id"], s["position"]) for s in got.samples] == [(s["id"], s["position"]) for s in want.samples]
    for i in range(len(want)):
        assert torch.equal(got[i].features, want[i].features) and torch.equal(got[i].target_lse, want[i].target_lse)


def test_cache_estimate_prints_bytes_per_token_total_and_the_disk(prompts, tmp_path, capsys):
    from deepspec.cache.config import compose_cache_config

    cfg = compose_cache_config(["target=tiny-random-llama", f"data.prompts={prompts}", "mode=estimate",
                                f"cache.out_dir={tmp_path / 'not' / 'yet'}", f"cache.layer_ids={LAYERS}"])
    assert run_cache_job(OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                                                resolve=True)) == 0
    printed = capsys.readouterr().out
    assert "B/token (bf16)" in printed and f"GiB free at {tmp_path}" in printed and ": fits" in printed
    assert not (tmp_path / "not").exists()


@pytest.mark.slow
def test_bench_features_reports_both_ways(prompts, tmp_path, monkeypatch):
    import os

    from deepspec.benchmarks.train_features import main

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "bench.json"
    assert main(["--target", "tiny-random-llama", "--prompts", str(prompts), "--num-samples", "12", "--max-length", "64",
                 "--out", str(out), "drafter.num_draft_layers=1", "drafter.block_size=4", "data.max_anchors_per_seq=8"]) == 0
    result = json.loads(out.read_text())
    assert result["offline"]["steps"] == result["online"]["steps"] >= 2
    # Same data and steps; the bench's cache is the default batched build, so equal up to float rounding only.
    assert result["offline"]["final_loss"] == pytest.approx(result["online"]["final_loss"], rel=1e-3)
    assert set(result["cpu_s_per_step"]) == {"offline", "online"} and result["online_over_cache_plus_offline"] > 0
    assert result["cache_build"]["bytes_per_token"] > 0 and result["peak_rss_mb"]["online"] > 0
