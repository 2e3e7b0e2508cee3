"""data_tools/cache_hiddens.py: Hydra composition, estimate / build / verify modes, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from deepspec.cache import CacheReader, read_meta
from deepspec.cache.pipeline import run_cache_job

ROOT = Path(__file__).resolve().parents[2]


def job_config(*overrides: str) -> dict:
    from deepspec.cache.config import compose_cache_config

    cfg = compose_cache_config(list(overrides))
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


@pytest.fixture()
def prompts(tmp_path) -> Path:
    path = tmp_path / "answers.jsonl"
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "why " * (i + 1)},
                                                  {"from": "gpt", "value": "because " * (3 * i + 2)}]}
               for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "{truncated line\n")
    return path


def tiny_job(prompts: Path, out_dir: Path, *extra: str) -> dict:
    return job_config("target=tiny-random-qwen3", f"data.prompts={prompts}", f"cache.out_dir={out_dir}",
                      "cache.layer_ids=[0,2]", "cache.shard_size_mb=0.01", "cache.progress=false", *extra)


def test_default_config_composes_for_the_embedded_target():
    cfg = job_config()
    assert {k: cfg["target"][k] for k in ("name", "dtype", "device")} == {
        "name": "smollm2-135m", "dtype": "auto", "device": None}
    assert cfg["mode"] == "build" and cfg["cache"]["storage_dtype"] == "bf16" and cfg["cache"]["layer_ids"] is None
    assert cfg["cache"]["out_dir"] == "outputs/cache/smollm2-135m"


def test_estimate_then_build_then_verify(prompts, tmp_path, capsys):
    out_dir = tmp_path / "cache"
    assert run_cache_job(tiny_job(prompts, out_dir, "mode=estimate", "cache.storage_dtype=fp8")) == 0
    estimate = capsys.readouterr().out
    assert not out_dir.exists()  # estimate-only writes nothing
    assert run_cache_job(tiny_job(prompts, out_dir, "cache.storage_dtype=fp8")) == 0
    reader = CacheReader(out_dir)
    meta = read_meta(out_dir)
    assert f"6 samples, {reader.num_tokens:,} tokens x {meta.bytes_per_token:,} B/token (fp8)" in estimate
    assert meta.target == "tiny-random-qwen3" and meta.layer_ids == [0, 2] and meta.storage_dtype == "fp8"
    assert meta.counts["skipped"] == {"input_malformed": 1} and meta.counts["samples"] == 6
    assert meta.source["load_report"]["num_malformed"] == 1 and 0 < meta.fp8_rel_error < 0.05
    assert run_cache_job(tiny_job(prompts, out_dir, "mode=verify")) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")


def test_invalid_config_fails_before_loading(prompts, tmp_path):
    with pytest.raises(ValueError, match="mode='bogus'"):
        run_cache_job(tiny_job(prompts, tmp_path, "mode=bogus"))
    with pytest.raises(ValueError, match="cache.storage_dtype='fp4'"):
        run_cache_job(tiny_job(prompts, tmp_path, "cache.storage_dtype=fp4"))
    with pytest.raises(ValueError, match=r"cache.layer_ids\[1\]=7 is out of range"):
        run_cache_job(tiny_job(prompts, tmp_path, "cache.layer_ids=[0,7]"))


def test_verify_script_names_corrupt_shard_and_exits_nonzero(prompts, tmp_path):
    out_dir = tmp_path / "cache"
    assert run_cache_job(tiny_job(prompts, out_dir)) == 0
    shard = max(out_dir.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, str(ROOT / "data_tools" / "cache_hiddens.py"), "mode=verify",
                             f"cache.out_dir={out_dir}"], check=False, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"{shard.name}: sha256 mismatch" in result.stdout and "1 problem(s)" in result.stdout


@pytest.fixture()
def no_target(monkeypatch):
    """Loading the target fails the test: input problems must be found before it."""
    import deepspec.cache.pipeline as pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the prompts were read")

    monkeypatch.setattr(pipeline, "load_cache_target", refuse)


def test_empty_or_missing_prompts_fail_before_the_target_loads(tmp_path, no_target):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out_dir = tmp_path / "cache"
    with pytest.raises(ValueError, match=rf"data.prompts='{empty}': no usable conversation"):
        run_cache_job(tiny_job(empty, out_dir))
    with pytest.raises(FileNotFoundError, match="missing.jsonl: prompt file not found"):
        run_cache_job(tiny_job(tmp_path / "missing.jsonl", out_dir, "mode=estimate"))
    assert not out_dir.exists()


def test_truncation_and_prompts_longer_than_the_context_are_printed(prompts, tmp_path, capsys, monkeypatch):
    import deepspec.cache.build as build
    import deepspec.cache.pipeline as pipeline

    out_dir = tmp_path / "cache"
    assert run_cache_job(tiny_job(prompts, out_dir, "cache.max_length=40")) == 0
    printed = capsys.readouterr().out
    counts = read_meta(out_dir).counts
    assert counts["truncated_to_max_length"] > 0
    assert (f"note: {counts['truncated_to_max_length']} of 6 samples were longer than cache.max_length=40 "
            "(longest ") in printed
    # A target whose context (max_position_embeddings) is shorter than 4 of the 6 samples (37..57 tokens): they are
    # cut to it, counted and named, at estimate and build.
    for module in (pipeline, build):
        monkeypatch.setattr(module, "target_context_length", lambda target: 44)
    assert run_cache_job(tiny_job(prompts, tmp_path / "short", "cache.max_length=null", "mode=estimate")) == 0
    printed = capsys.readouterr().out
    assert ("4 samples were longer than the target's context of 44 tokens (max_position_embeddings): 'c2' "
            "(answers.jsonl:3) (45 tokens), ") in printed
    assert run_cache_job(tiny_job(prompts, tmp_path / "short", "cache.max_length=null")) == 0
    assert "they keep only their first 44 tokens" in capsys.readouterr().out
    assert read_meta(tmp_path / "short").counts["longer_than_target_context"] == 4
    reader = CacheReader(tmp_path / "short")
    assert max(reader[i].input_ids.shape[0] for i in range(len(reader))) == 44


def test_a_limit_of_zero_is_refused_naming_the_field():
    from deepspec.cache.config import CacheDataSchema
    from deepspec.training.config import OnlineDataSchema

    with pytest.raises(ValueError, match=r"^data.limit=0 reads no conversation: set a positive number"):
        CacheDataSchema(limit=0)
    with pytest.raises(ValueError, match=r"^data.source.limit=0 reads no conversation"):
        OnlineDataSchema(limit=0)  # training's data.source
    assert CacheDataSchema(limit=1).limit == 1 and CacheDataSchema().limit is None


@pytest.mark.parametrize("seed,empty", [(3, "validation"), (0, "train")])
def test_a_split_left_empty_is_named_in_a_warning(tmp_path, caplog, seed, empty):
    """One conversation with data.val_fraction=0.5: one of the two splits gets none (which one, the seeded hash of
    its id decides); the build says so, naming the field, instead of leaving a cache without validation samples."""
    import logging

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi there"},
                                                                {"role": "assistant", "content": "hello"}]}) + "\n")
    with caplog.at_level(logging.WARNING, logger="deepspec.cache.pipeline"):
        assert run_cache_job(tiny_job(prompts, tmp_path / "cache", "data.val_fraction=0.5", f"data.seed={seed}")) == 0
    named = [r.getMessage() for r in caplog.records if "gave none of the 1 conversation(s)" in r.getMessage()]
    field = "data.val_fraction=0.5" if empty == "validation" else "data.val_fraction=0.5 and data.test_fraction=0.0"
    assert len(named) == 1 and named[0].startswith(f"{field}") and f"to the '{empty}' split" in named[0], named
    assert CacheReader(tmp_path / "cache").split(empty) == []


def test_layer_ids_fall_back_to_target_then_the_default_spread():
    from deepspec.cache.pipeline import resolve_layer_ids

    assert resolve_layer_ids({"layer_ids": [2, 5]}, {"layer_ids": [1, 9]}, 30) == [2, 5]
    assert resolve_layer_ids({"layer_ids": None}, {"layer_ids": [1, 9]}, 30) == [1, 9]
    assert resolve_layer_ids({"layer_ids": None, "num_feature_layers": 5}, {}, 30) == [1, 8, 14, 21, 27]
    with pytest.raises(ValueError, match=r"target.layer_ids\[0\]=40"):
        resolve_layer_ids({"layer_ids": None}, {"layer_ids": [40]}, 30)


def test_sigterm_keeps_the_written_shards_and_the_rerun_resumes_after_them(tmp_path):
    """`deepspec cache` sent SIGTERM mid-build: it drops the unfinished shard, says what is kept and how to resume in
    one line, exits 143; the rerun resumes after the kept shards and ends with the uninterrupted build's shards."""
    import os
    import signal
    import time

    prompts = tmp_path / "answers.jsonl"
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "why " * (i % 7 + 1)},
                                                  {"from": "gpt", "value": "because " * (i % 11 + 2)}]}
               for i in range(400)]  # about one shard each: a build of seconds, long enough to stop in the middle
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out_dir, reference = tmp_path / "cache", tmp_path / "reference"
    overrides = ["target=tiny-random-qwen3", f"data.prompts={prompts}", f"cache.out_dir={out_dir}",
                 "cache.layer_ids=[0,2]", "cache.shard_size_mb=0.01", "cache.batch_size=1", "cache.progress=false"]
    command = [sys.executable, "-m", "deepspec.cli", "cache", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    partial = out_dir / "index-r0.json"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 300
            while not (partial.is_file() and len(json.loads(partial.read_text())["shards"]) >= 2):
                assert proc.poll() is None and time.monotonic() < deadline, "no second shard before the signal"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 143
        finally:
            proc.kill()
    kept = json.loads(partial.read_text())["shards"]
    num_kept = sum(len(entry["samples"]) for entry in kept)
    assert 2 <= len(kept) and num_kept < 400 and not (out_dir / "meta.json").exists()
    assert sorted(p.name for p in out_dir.glob("shard-*")) == sorted(entry["file"] for entry in kept)  # no partial one
    errors = [line for line in (tmp_path / "stderr").read_text().splitlines() if "error:" in line]
    assert errors == [f"deepspec cache: error: stopped by SIGTERM: rank 0 dropped the samples of its unfinished shard "
                      f"(a rerun computes them); the {len(kept)} complete shard(s) listed in index-r0.json "
                      f"({num_kept} samples) are kept (rerunning the same command resumes after them)"]
    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and f"({num_kept} samples resumed)" in rerun.stdout, rerun.stderr[-3000:]
    assert run_cache_job(job_config(*overrides[:2], f"cache.out_dir={reference}", *overrides[3:])) == 0

    def shard_checksums(cache: Path) -> dict:
        shards = json.loads((cache / "index.json").read_text())["shards"]
        return {name: entry["sha256"] for name, entry in shards.items()}

    assert shard_checksums(out_dir) == shard_checksums(reference)
