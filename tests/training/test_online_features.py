"""data.features = online | hybrid (deepspec.cache.source): the same losses and weights as training from a
cache, hybrid's cache byte-identical to a `deepspec cache` build, kill-and-resume, bad input."""

from __future__ import annotations

import json
import re
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


def train_overrides(tt, *args, **kwargs) -> list[str]:
    """The tiny run, with DSpark's Markov head started at random: the bigram start counts the target's argmax next
    tokens where a cache stores them and the data's next tokens where it does not (online, before training), so only
    a random start is the same both ways; these tests compare the features, not the start."""
    return [*tt.train_overrides(*args, **kwargs), "drafter.markov_init=random"]


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
    return {p.name: p.read_bytes() for p in sorted(cache_dir.iterdir())
            if p.is_file() and not p.name.startswith(".lock")}


@pytest.fixture(scope="module")
def offline_run(tt, reference_cache, prompts, tmp_path_factory) -> Path:
    """6 steps (4 per epoch: 19 train samples, 4 per step) from the reference cache."""
    from deepspec.training import run

    out = tmp_path_factory.mktemp("offline_run")
    run(tt.compose(train_overrides(tt, reference_cache, out, "trainer.max_steps=6", "trainer.decode_eval_prompts=0")))
    return out


@pytest.mark.float_exact
def test_online_matches_offline_bit_for_bit(tt, offline_run, prompts, tmp_path):
    from deepspec.training import run

    result = run(tt.compose(train_overrides(tt, tmp_path / "no-cache", tmp_path / "run", "trainer.max_steps=6",
                                               "data.features=online", "data.online_batch=sample",
                                               *source_overrides(prompts))))
    assert result["step"] == 6
    assert not (tmp_path / "no-cache").exists()  # online writes no cache
    assert_same_training(tmp_path / "run", offline_run, tt)


def test_online_source_returns_the_cached_records(reference_cache, prompts, tiny_llama):
    """reader[i] of the online source is the cache's sample i, tensor for tensor (bf16 storage, rounded alike)."""
    from deepspec.cache.reader import CacheReader
    from deepspec.training.config import TrainConfig
    from deepspec.training.data import feature_source_config

    cfg = TrainConfig()
    cfg.data.features, cfg.data.source.prompts, cfg.data.source.val_fraction = "online", str(prompts), 0.2
    cfg.data.cache.max_length = 64
    source = feature_source_config(cfg).prepare().open(tiny_llama, [0, 1, 2])
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
    run(tt.compose(train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "data.features=hybrid",
                                      "data.online_batch=sample", *source_overrides(prompts))))
    files = cache_files(cache)
    assert files == cache_files(reference_cache)  # byte-identical: shards, partial and global index, meta
    assert len([n for n in files if n.startswith("shard-")]) > 1
    assert not (cache / ".online-stage").exists()
    assert_same_training(tmp_path / "run", offline_run, tt)  # epoch 0 online, epoch 1 from the written cache


def test_hybrid_killed_mid_epoch_resumes_to_the_same_cache_and_weights(tt, offline_run, reference_cache, prompts,
                                                                        tmp_path):
    from deepspec.training import run

    cache = tmp_path / "cache"
    overrides = train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "trainer.save_every=1",
                                   "data.features=hybrid", "data.online_batch=sample", *source_overrides(prompts))
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
    run(tt.compose(train_overrides(tt, reference_cache, tmp_path / "run", "trainer.max_steps=1", "data.features=hybrid",
                                      *source_overrides(prompts))))
    assert cache_files(reference_cache) == before  # read, not rewritten
    # build_cache, not the cache job: the job tears down the process group this process's training runs share.
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.cache.source import load_conversations
    from deepspec.targets.load import make_tiny_target
    from deepspec.training.config import TrainConfig

    source_cfg = TrainConfig().data.source
    source_cfg.prompts, source_cfg.val_fraction = str(prompts), 0.2
    other = tmp_path / "qwen3-cache"
    build_cache(load_conversations(source_cfg)[0], make_tiny_target("qwen3"),
                BuildJob(CacheSchema(out_dir=str(other), layer_ids=[0, 1, 2], max_length=64, progress=False)))
    with pytest.raises(ValueError, match="config_hash"):
        run(tt.compose(train_overrides(tt, other, tmp_path / "run2", "data.features=hybrid",
                                          *source_overrides(prompts))))


def test_bad_line_fails_naming_it_and_writes_nothing(tt, conversations_factory, tmp_path):
    from deepspec.training import run

    bad = write_conversations(tmp_path / "bad.jsonl", conversations_factory(24), extra_lines=('{"id": "x", "conv',))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"bad\.jsonl:25: .*malformed or truncated|1 malformed or truncated"):
        run(tt.compose(train_overrides(tt, cache, tmp_path / "run", "data.features=hybrid", *source_overrides(bad))))
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
        run(tt.compose(train_overrides(tt, cache, tmp_path / "run", "data.features=hybrid",
                                          *source_overrides(prompts, "data.cache.max_length=null"))))
    assert not any(cache.glob("*.safetensors")) and not (cache / ".online-stage").exists()


def test_resume_with_another_target_fails_naming_the_checkpoint(tt, prompts, tmp_path):
    from deepspec.training import run

    overrides = [*source_overrides(prompts), "data.features=online", "trainer.max_steps=1"]
    run(tt.compose(train_overrides(tt, tmp_path / "none", tmp_path / "run", *overrides)))
    qwen = [o.replace("target=tiny-random-llama", "target=tiny-random-qwen3")
            for o in train_overrides(tt, tmp_path / "none", tmp_path / "run", *overrides, "trainer.max_steps=2")]
    with pytest.raises(ValueError, match=r"drafter/config\.json: target_fingerprint\.config_hash=.*another target"):
        run(tt.compose(qwen))


def test_config_checks_name_the_field(tt, prompts, tmp_path):
    from deepspec.training.config import plan_training, resolve_config

    def plan(*extra):
        return plan_training(resolve_config(tt.compose(train_overrides(tt, tmp_path / "c", tmp_path / "r", *extra))))

    with pytest.raises(ValueError, match="data.features='disk' must be one of"):
        plan("data.features=disk")
    with pytest.raises(ValueError, match="data.cache.storage_dtype"):
        plan("data.features=online", *source_overrides(prompts, "data.cache.storage_dtype=int4"))
    with pytest.raises(ValueError, match="data.cache.out_dir=.* not used"):
        plan("data.features=hybrid", *source_overrides(prompts, "data.cache.out_dir=/elsewhere"))
    with pytest.raises(ValueError,
                       match="data.cache.engine=vllm: data.features=online computes the features"):
        plan("data.features=online", *source_overrides(prompts, "data.cache.engine=vllm"))
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
                for o in train_overrides(tt, cache, out, "trainer.max_steps=2", "trainer.global_batch_size=2",
                                            "trainer.micro_batch_size=1", "trainer.decode_eval_prompts=0", *extra)]

    run(tt.compose(overrides(tmp_path / "cache", tmp_path / "offline")))
    run(tt.compose(overrides(tmp_path / "none", tmp_path / "online", "data.features=online",
                             "data.online_batch=sample", f"data.source.prompts={prompts}",
                             "data.source.val_fraction=0.2",
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
    cmd = tt.torchrun(2, *train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "data.features=hybrid",
                                             "data.online_batch=sample", *source_overrides(prompts)),
                      f"hydra.run.dir={tmp_path / 'run'}")
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


# --- batched online features -------------------------------------------------------------------------------------
def feature_source(tt, prompts: Path, cache_dir: Path, target, *extra: str):
    """(feature source, TrainingData) of a training config: what a run builds, without the drafter or a run."""
    from deepspec.training.config import plan_training, resolve_config
    from deepspec.training.data import TrainingData, feature_source_config

    cfg = resolve_config(tt.compose(train_overrides(tt, cache_dir, cache_dir.parent / "unused-run",
                                                       *source_overrides(prompts), *extra)))
    plan = plan_training(cfg, world_size=1)
    source = feature_source_config(cfg).prepare().open(target, plan.cache_layer_ids)
    t = cfg.trainer
    return source, TrainingData(cfg.data, source, plan.cache_layer_ids, plan.drafter_layer_ids, seed=t.seed,
                                global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                                val_max_samples=t.val_max_samples)


def build_with_batches(prompts: Path, target, out_dir: Path, batches) -> Path:
    """`build_cache` of the prompts (the training options above) computing its samples in `batches` (PlannedSamples)."""
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.cache.source import load_conversations
    from deepspec.training.config import TrainConfig

    source_cfg = TrainConfig().data.source
    source_cfg.prompts, source_cfg.val_fraction = str(prompts), 0.2
    splits, source = load_conversations(source_cfg)
    options = CacheSchema(out_dir=str(out_dir), layer_ids=[0, 1, 2], max_length=64, shard_size_mb=0.01, progress=False)
    build_cache(splits, target, BuildJob(options, source=source, batches=batches))
    return out_dir


def assert_within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both rounded to bf16 from fp32 forwards of other shapes: one bf16 step apart at most (the spacing at the larger
    of the two, 2^(exponent - 7)), plus the fp32 forwards' own difference where a value is near zero (measured at
    <= 2.3 fp32 eps of its row's largest value; 8 allowed)."""
    larger = torch.maximum(got.abs(), want.abs()).clamp_min(torch.finfo(torch.bfloat16).tiny)
    step = torch.exp2(torch.floor(torch.log2(larger)) - 7)
    forward = 8 * torch.finfo(torch.float32).eps * want.abs().amax(dim=-1, keepdim=True)
    assert bool(((got - want).abs() <= step + forward).all()), float(((got - want).abs() / (step + forward)).max())


def test_online_micro_batches_are_one_forward_each_and_equal_a_cache_of_the_same_batches(tt, prompts, tiny_llama,
                                                                                          reference_cache, tmp_path):
    """A micro-batch is one padded forward: bit for bit the cache built with those batches; against one sample
    per forward (the reference cache) within one bf16 step."""
    from deepspec.cache.reader import CacheReader

    source, _ = feature_source(tt, prompts, tmp_path / "none", tiny_llama, "data.features=online")
    micro_batches = [[0, 5], [3, 9], [12, 1], [7, 18]]
    chosen = {i for b in micro_batches for i in b}
    batches = [[source.planned[i] for i in b] for b in micro_batches]
    batches += [[s] for i, s in enumerate(source.planned) if i not in chosen]
    same_batches = CacheReader(build_with_batches(prompts, tiny_llama, tmp_path / "cache", batches))
    one_sample = CacheReader(reference_cache)
    before = source.num_forwards
    got = {i: sample for ids in micro_batches for i, sample in zip(ids, source.batch(ids))}
    assert source.num_forwards - before == len(micro_batches)
    assert {s.length for s in source.batch([0, 5])} != {64}  # padded: the lengths differ
    for i, sample in got.items():
        want, single = same_batches[i], one_sample[i]
        for name in ("input_ids", "loss_mask", "features", "final_hidden", "target_lse"):
            assert torch.equal(getattr(sample, name), getattr(want, name)), (i, name)
        assert_within_one_bf16_step(sample.features, single.features)
        assert_within_one_bf16_step(sample.final_hidden, single.final_hidden)


def test_online_skips_the_log_normaliser_the_drafter_does_not_read(tt, prompts, tiny_llama, tmp_path):
    from deepspec.cache.online import OnlineFeatures

    source, _ = feature_source(tt, prompts, tmp_path / "none", tiny_llama, "data.features=online")
    lean = OnlineFeatures(source.conversations_by_split, tiny_llama, [0, 1, 2], options=source.options,
                          rendering=source.rendering, target_lse=False)
    full, without = source.batch([2, 4]), lean.batch([2, 4])
    assert all(s.target_lse is None for s in without) and all(s.target_lse is not None for s in full)
    assert all(torch.equal(a.features, b.features) and torch.equal(a.final_hidden, b.final_hidden)
               for a, b in zip(full, without))


def test_online_validation_samples_are_computed_once_per_run(tt, prompts, tmp_path):
    from deepspec.training.loop import train
    from deepspec.training.session import build_session

    session = build_session(tt.compose(train_overrides(tt,
        tmp_path / "none", tmp_path / "run", "trainer.max_steps=4", "trainer.val_every=1", "data.features=online",
        "calibration.enabled=false", *source_overrides(prompts))))
    try:
        train(session)
        train_forwards = 4 * 2  # 4 steps of 2 micro-batches (global batch 4, micro-batch 2)
        val_batches = -(-len(session.data.val_ids) // 2)
        assert val_batches >= 2
        assert session.data.reader.num_forwards == train_forwards + val_batches  # 4 validations, computed at the first
    finally:
        session.engine.destroy()
        session.lock.close()


def hybrid_batches(tt, prompts: Path, tiny_llama, tmp_path: Path, *extra: str):
    """The batches a one-process hybrid run of these options computes its cache in (epoch 0's micro-batches,
    validation's, the rest), as PlannedSamples."""
    source, _ = feature_source(tt, prompts, tmp_path / "plan-only", tiny_llama, "data.features=hybrid", *extra)
    assert not (tmp_path / "plan-only").exists()  # planning writes nothing
    return [[source.planned[i] for i in batch] for batch in source.plan]


@pytest.fixture(scope="module")
def batched_reference(tt, prompts, tiny_llama, tmp_path_factory) -> Path:
    """`build_cache` with the batches of a one-process micro-batched hybrid run of `source_overrides`."""
    tmp = tmp_path_factory.mktemp("batched_reference")
    return build_with_batches(prompts, tiny_llama, tmp / "cache", hybrid_batches(tt, prompts, tiny_llama, tmp))


@pytest.fixture(scope="module")
def batched_offline_run(tt, batched_reference, tmp_path_factory) -> Path:
    from deepspec.training import run

    out = tmp_path_factory.mktemp("batched_offline_run")
    run(tt.compose(train_overrides(tt, batched_reference, out, "trainer.max_steps=6", "trainer.decode_eval_prompts=0")))
    return out


@pytest.fixture(scope="module")
def batched_hybrid_run(tt, prompts, tmp_path_factory) -> Path:
    """6 steps of micro-batched hybrid (epoch 0 online, epoch 1 from the cache it wrote): folder with cache/, run/."""
    from deepspec.training import run

    tmp = tmp_path_factory.mktemp("batched_hybrid")
    run(tt.compose(train_overrides(tt, tmp / "cache", tmp / "run", "trainer.max_steps=6", "data.features=hybrid",
                                      *source_overrides(prompts))))
    return tmp


def test_micro_batched_hybrid_writes_the_cache_of_its_batches_and_trains_as_from_it(
        tt, batched_hybrid_run, batched_reference, batched_offline_run, reference_cache):
    from deepspec.cache.reader import CacheReader, verify_cache

    cache = batched_hybrid_run / "cache"
    assert verify_cache(cache) == []  # a valid cache: `deepspec cache mode=verify` says OK
    assert cache_files(cache) == cache_files(batched_reference)  # byte for byte the build of the same batches
    assert not (cache / ".online-stage").exists()
    assert_same_training(batched_hybrid_run / "run", batched_offline_run, tt)
    got, one_sample = CacheReader(cache), CacheReader(reference_cache)
    assert [s["id"] for s in got.samples] == [s["id"] for s in one_sample.samples]
    for i in range(len(got)):
        assert_within_one_bf16_step(got[i].features, one_sample[i].features)


# --- staged samples: checksums, damage, settings, clean-up ----------------------------------------------------
def damage(path: Path, how: str) -> None:
    if how == "truncate":  # `truncate -s 20000` (or less of a smaller file): a file cut short
        with open(path, "r+b") as f:
            f.truncate(min(20000, path.stat().st_size // 2))
    else:  # one flipped byte of the tensor data (past the header)
        data = bytearray(path.read_bytes())
        data[len(data) - 100] ^= 0x01
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_staged_sample_is_named_and_recomputed(tt, prompts, batched_hybrid_run, how, tmp_path, caplog):
    """Killed after step 2, a staged sample damaged: the rerun names it in one warning, computes it again, and ends
    with the uninterrupted run's cache (verify OK) and weights."""
    from deepspec.cache.reader import verify_cache
    from deepspec.training import run

    cache = tmp_path / "cache"
    overrides = train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "trainer.save_every=1",
                                   "data.features=hybrid", *source_overrides(prompts))
    assert run(tt.compose([*overrides, "faults.stop_after=2"]))["stopped"]
    staged = sorted((cache / ".online-stage").glob("p*.safetensors"))
    assert len(staged) >= 8
    victim = max(staged, key=lambda p: p.stat().st_size)
    damage(victim, how)
    with caplog.at_level("WARNING"):
        assert run(tt.compose(overrides))["step"] == 6
    named = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert len(named) == 1 and "damaged staged sample" in named[0] and "\n" not in named[0]
    assert verify_cache(cache) == []
    assert cache_files(cache) == cache_files(batched_hybrid_run / "cache")  # what the target computes, not the file
    assert_same_training(tmp_path / "run", batched_hybrid_run / "run", tt)


def header_is_padded(path: Path) -> bool:
    data = path.read_bytes()
    return data[7 + int.from_bytes(data[:8], "little")] == ord(" ")


def change_byte(path: Path, region: str) -> None:
    """One byte of a staged or shard file changed in `region`: `header padding` (a space to a tab: JSON reads it
    alike), `sums` (the first fp8 sum's "0.0" to " .0": the same float), `last bytes` (7 before the end, flipped)."""
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    if region == "header padding":
        assert data[header_end - 1] == ord(" ")
        data[header_end - 1] = ord("\t")
    elif region == "sums":
        data[data.index(b"0.0")] = ord(" ")
    else:
        data[len(data) - 7] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damage_in_any_part_of_a_staged_file_is_named_and_recomputed(tt, prompts, batched_hybrid_run, tmp_path,
                                                                      caplog):
    """Killed after step 2, three staged samples changed by one byte each, where the file's sha256 record does not
    reach (the header's padding, the text of the fp8 sums) and at its end: the rerun names each file once and
    computes it again, ending with the uninterrupted run's cache and weights. Then a byte changed in each of
    several shards of that finished cache: the next run refuses it, naming the damaged shard it reads first."""
    from deepspec.cache.reader import verify_cache
    from deepspec.training import run

    cache = tmp_path / "cache"
    overrides = train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "trainer.save_every=1",
                                "data.features=hybrid", *source_overrides(prompts))
    assert run(tt.compose([*overrides, "faults.stop_after=2"]))["stopped"]
    staged = sorted((cache / ".online-stage").glob("p*.safetensors"))
    padded = next(p for p in staged if header_is_padded(p))
    victims = {"header padding": padded, **dict(zip(["sums", "last bytes"], [p for p in staged if p != padded]))}
    for region, path in victims.items():
        change_byte(path, region)
    with caplog.at_level("WARNING"):
        assert run(tt.compose(overrides))["step"] == 6
    for region, path in victims.items():
        named = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
        assert len(named) == 1 and "damaged staged sample" in named[0], (region, named)
    assert verify_cache(cache) == []
    assert cache_files(cache) == cache_files(batched_hybrid_run / "cache")  # what the target computes, not the file
    assert_same_training(tmp_path / "run", batched_hybrid_run / "run", tt)

    shards = sorted(cache.glob("shard-*.safetensors"))
    for k, shard in enumerate(shards):
        change_byte(shard, "header padding" if k % 2 == 0 and header_is_padded(shard) else "last bytes")
    names = "|".join(re.escape(str(shard)) for shard in shards)
    with pytest.raises(ValueError, match=rf"^({names}): sha256 [0-9a-f]+\.\.\. differs from .*the shard is corrupt"):
        run(tt.compose(train_overrides(tt, cache, tmp_path / "run-2", "trainer.max_steps=1", "data.features=hybrid",
                                       *source_overrides(prompts))))
    assert not (tmp_path / "run-2" / "checkpoints").exists()


def test_stage_and_finished_cache_settings_are_compared_field_by_field(tt, prompts, reference_cache, tmp_path):
    from deepspec.training import run

    # A finished bf16 cache is not read by a run that asks for fp32 features.
    with pytest.raises(ValueError, match=r"finished cache there .*storage_dtype: 'bf16' vs now 'fp32'"):
        run(tt.compose(train_overrides(tt, reference_cache, tmp_path / "r1", "data.features=hybrid",
                                          *source_overrides(prompts, "data.cache.storage_dtype=fp32"))))
    cache = tmp_path / "cache"
    overrides = [*source_overrides(prompts), "data.features=hybrid", "trainer.max_steps=6"]
    run(tt.compose(train_overrides(tt, cache, tmp_path / "r2", *overrides, "faults.stop_after=1")))
    assert (cache / ".online-stage" / "settings.json").is_file() and not any(cache.glob("index-r*.json"))
    staged = sorted(p.name for p in (cache / ".online-stage").iterdir())
    for extra, named in ((["data.cache.storage_dtype=fp32"], r"storage_dtype: 'bf16' vs now 'fp32'"),
                         (["trainer.micro_batch_size=1"], r"batching\.micro_batch_size: 2 vs now 1"),
                         (["data.online_batch=sample"], r"batching\.online_batch: 'micro_batch' vs now 'sample'"),
                         (["trainer.seed=1"], r"batching\.order_seed: 0 vs now 1")):
        with pytest.raises(ValueError, match=r"\.online-stage/settings\.json \(samples staged by an earlier hybrid "
                                             r"run\) used other settings \(.*" + named):
            run(tt.compose(train_overrides(tt, cache, tmp_path / "r3", *overrides, *extra)))
        assert sorted(p.name for p in (cache / ".online-stage").iterdir()) == staged  # refused: nothing changed


def test_a_finished_build_removes_the_stage_and_says_so(tt, prompts, tmp_path, capsys, caplog):
    """A killed hybrid run's stage is removed by the `deepspec cache` build that finishes the folder, and a leftover
    stage in a finished cache by the next hybrid run there; each removal is reported with what it held."""
    from deepspec.training import run

    cache = tmp_path / "cache"
    run(tt.compose(train_overrides(tt, cache, tmp_path / "r1", "data.features=hybrid", "trainer.max_steps=6",
                                      "faults.stop_after=2", *source_overrides(prompts))))
    num_staged = len(list((cache / ".online-stage").glob("p*.safetensors")))
    assert num_staged >= 8
    build_reference_cache(prompts, cache)
    printed = capsys.readouterr().out
    assert f"removed {cache / '.online-stage'} ({num_staged} staged sample(s)" in printed
    assert not (cache / ".online-stage").exists()
    (cache / ".online-stage").mkdir()
    (cache / ".online-stage" / "p000000003.safetensors").write_bytes(b"x" * 100)
    with caplog.at_level("WARNING"):
        run(tt.compose(train_overrides(tt, cache, tmp_path / "r2", "data.features=hybrid", "trainer.max_steps=1",
                                          *source_overrides(prompts))))
    assert not (cache / ".online-stage").exists()
    assert any(f"removed {cache / '.online-stage'} (1 staged sample(s)" in r.getMessage() for r in caplog.records)


def assert_same_samples(got_dir: Path, want_dir: Path) -> None:
    """Two caches of the same samples (any shard layout), tensor for tensor."""
    from deepspec.cache.reader import CacheReader

    got, want = CacheReader(got_dir), CacheReader(want_dir)
    assert [(s["id"], s["position"]) for s in got.samples] == [(s["id"], s["position"]) for s in want.samples]
    for i in range(len(want)):
        for name in ("input_ids", "features", "final_hidden", "target_lse"):
            assert torch.equal(getattr(got[i], name), getattr(want[i], name)), (i, name)


@pytest.mark.slow
def test_two_process_micro_batched_hybrid_computes_only_its_own_batches(tt, prompts, tiny_llama, batched_reference,
                                                                         batched_offline_run, tmp_path):
    """2 ranks (gloo): each rank computes its own micro-batches of epoch 0 (one forward each), and the cache holds
    exactly the one-process run's samples (the batches do not depend on the number of ranks)."""
    import re
    import subprocess

    from deepspec.cache.reader import verify_cache

    cache = tmp_path / "cache"
    cmd = tt.torchrun(2, *train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "data.features=hybrid",
                                             *source_overrides(prompts)), f"hydra.run.dir={tmp_path / 'run'}")
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    computed = re.findall(r"rank (\d): (\d+) samples computed in (\d+) target forwards in epoch 0",
                          proc.stdout + proc.stderr)
    _, data = feature_source(tt, prompts, tmp_path / "plan-only", tiny_llama, "data.features=hybrid")
    train_batches = data.expected_batches()[0]  # chunk k is rank k % 2's
    assert sorted(computed) == [(str(rank), str(sum(len(b) for b in train_batches[rank::2])),
                                 str(len(train_batches[rank::2]))) for rank in (0, 1)], computed
    assert verify_cache(cache) == []
    assert_same_samples(cache, batched_reference)
    assert tt.train_losses(tmp_path / "run") == pytest.approx(tt.train_losses(batched_offline_run), rel=1e-4)


@pytest.mark.slow
def test_zero3_sharded_target_computes_the_unsharded_features(tt, prompts, tmp_path):
    """A target loaded from a checkpoint straight into ZeRO-3 partitions over 2 ranks (gloo): hybrid training keeps
    the ranks in lockstep through epoch 0, validation and the cache build, and the cache holds the unsharded
    target's features, bit for bit (the same arithmetic on gathered weights)."""
    import subprocess

    from deepspec.cache.reader import verify_cache
    from deepspec.targets.load import load_target

    target_dir = tmp_path / "tiny-llama"
    tiny = load_target("tiny-random-llama", device="cpu")
    tiny.model.save_pretrained(target_dir)
    tiny.tokenizer.save_pretrained(target_dir)
    target = load_target(str(target_dir), device="cpu")
    overrides = [f"target.name={target_dir}", "target.num_hidden_layers=4"]
    batches = hybrid_batches(tt, prompts, target, tmp_path, *overrides)
    reference = build_with_batches(prompts, target, tmp_path / "reference", batches)

    cache = tmp_path / "cache"
    cmd = tt.torchrun(2, *train_overrides(tt, cache, tmp_path / "run", "trainer.max_steps=6", "trainer.val_every=2",
                                             "data.features=hybrid", "data.target_sharding=zero3", *overrides,
                                             *source_overrides(prompts)), f"hydra.run.dir={tmp_path / 'run'}")
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "partitioned with ZeRO-3" in proc.stdout + proc.stderr
    assert verify_cache(cache) == []
    assert_same_samples(cache, reference)
    from deepspec.training import run  # the drafter trained on whole copies of the embedding and head: as unsharded

    run(tt.compose(train_overrides(tt, reference, tmp_path / "offline", "trainer.max_steps=6", "trainer.val_every=2",
                                      *overrides)))
    assert tt.train_losses(tmp_path / "run") == pytest.approx(tt.train_losses(tmp_path / "offline"), rel=1e-4)


def test_online_target_forwards_are_the_steps_target_phase(tt, prompts, tiny_llama, tmp_path, monkeypatch):
    """A step's profile (`trainer.phase_times`) charges the online target's forward to `target`, inside `data`."""
    import deepspec.cache.online as online
    from deepspec.utils.phases import PhaseTimer, phase

    source, _ = feature_source(tt, prompts, tmp_path / "none", tiny_llama, "data.features=online")
    capture, inside = online.capture_batch, []

    def timed_capture(*args, **kwargs):  # what the forward costs, on the clock the timer reads
        import time

        start = time.process_time()
        out = capture(*args, **kwargs)
        inside.append(time.process_time() - start)
        return out

    monkeypatch.setattr(online, "capture_batch", timed_capture)
    with PhaseTimer() as timer:
        with phase("data"):
            source.batch([0, 5])
        phases = timer.take()["phase_cpu_s"]
    assert len(inside) == 1 and phases.get("target", 0.0) >= inside[0] > 0  # charged to target, not to data
