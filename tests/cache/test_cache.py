"""Feature cache: exact round trip, no padding stored, resume, verify, fingerprint refusal, skips, fp8."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open

from deepspec.cache import (
    BuildJob,
    CacheReader,
    build_cache,
    bytes_per_token,
    check_cache_compatible,
    merge_cache,
    read_meta,
    verify_cache,
)
from deepspec.cache.config import CacheSchema
from deepspec.cache.format import partial_index_name, sealed, write_index_and_meta
from deepspec.data.chat import render_conversation
from deepspec.data.rendering import Rendering
from deepspec.data.sources import Conversation, load_jsonl
from deepspec.targets.features import capture_features
from deepspec.utils.faults import FaultInjection

LAYERS = [0, 1, 2]  # tiny targets have 4 layers: valid ids 0..2


def make_conversations(n: int = 8) -> list[Conversation]:
    convs = []
    for i in range(n):
        messages = [{"role": "user", "content": "Tell me about topic " + "x " * (3 * i)},
                    {"role": "assistant", "content": "Here is an answer " + "word " * (4 * i + 1)}]
        if i % 3 == 0:  # some multi-turn samples
            messages += [{"role": "user", "content": "and more?"}, {"role": "assistant", "content": "more " * i}]
        convs.append(Conversation(id=f"conv{i}", messages=messages, source="test", line=i))
    return convs


def splits_of(convs):
    return {"train": convs[:5], "validation": convs[5:7], "test": convs[7:]}


JOB_FIELDS = {f.name for f in dataclasses.fields(BuildJob)}


def job(out_dir, layer_ids, **kwargs) -> BuildJob:
    """A build job into `out_dir` from `layer_ids`: `kwargs` are cache options (`CacheSchema`) and `BuildJob` fields."""
    options = CacheSchema(out_dir=str(out_dir), layer_ids=layer_ids,
                          **{k: v for k, v in kwargs.items() if k not in JOB_FIELDS})
    return BuildJob(options, **{k: v for k, v in kwargs.items() if k in JOB_FIELDS})


def build(target, out_dir, **kwargs):
    options = {"max_length": 96, "batch_size": 1, "storage_dtype": "bf16", "shard_size_mb": 0.02, "progress": False}
    options.update(kwargs)
    return build_cache(options.pop("splits", splits_of(make_conversations())), target, job(out_dir, LAYERS, **options))


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("storage_dtype", ["bf16", "fp32"])
def test_cached_features_equal_fresh_forward_bit_for_bit(request, tmp_path, family, storage_dtype):
    target = request.getfixturevalue(family)
    stats = build(target, tmp_path, storage_dtype=storage_dtype)
    reader = CacheReader(tmp_path, dtype=None)
    convs = make_conversations()
    assert len(reader) == stats.num_samples == 8 and stats.num_shards > 1
    assert [reader[i].sample_id for i in range(len(reader))] == [c.id for c in convs]
    stored = torch.bfloat16 if storage_dtype == "bf16" else torch.float32
    for i, conv in enumerate(convs):
        sample = reader[i]
        rendered = render_conversation(target.tokenizer, conv.messages)
        length = min(len(rendered.input_ids), 96)
        assert sample.length == length
        assert sample.input_ids.tolist() == rendered.input_ids[:length]
        assert sample.loss_mask.tolist() == [bool(m) for m in rendered.loss_mask[:length]]
        fresh = capture_features(target.model, sample.input_ids[None], None, LAYERS)
        assert sample.features.dtype == stored and sample.final_hidden.dtype == stored
        assert torch.equal(sample.features, fresh.features_BTF[0].to(stored))
        assert torch.equal(sample.final_hidden, fresh.final_hidden_BTH[0].to(stored))
    assert reader.split("train") == [0, 1, 2, 3, 4] and reader.split("validation") == [5, 6]
    assert reader.split("test") == [7]
    assert CacheReader(tmp_path)[2].features.dtype == torch.float32  # upcast by default


def test_batched_capture_stores_no_padding(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path, batch_size=3, storage_dtype="fp32", shard_size_mb=1.0)
    reader = CacheReader(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    lengths = [min(len(render_conversation(tiny_llama.tokenizer, c.messages).input_ids), 96)
               for c in make_conversations()]
    assert reader.lengths() == lengths and reader.num_tokens == sum(lengths)
    stored_rows = 0
    for shard in index["shards"]:
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            stored_rows += f.get_slice("features").get_shape()[0]
            assert f.get_slice("final_hidden").get_shape()[0] == f.get_slice("input_ids").get_shape()[0]
    assert stored_rows == sum(lengths)  # pad positions never reach the disk
    for i in range(len(reader)):
        sample = reader[i]
        fresh = capture_features(tiny_llama.model, sample.input_ids[None], None, LAYERS)
        torch.testing.assert_close(sample.features, fresh.features_BTF[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(sample.final_hidden, fresh.final_hidden_BTH[0], rtol=0, atol=1e-5)


def test_meta_records_conventions_and_counts(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path, source={"prompts": "unit-test", "seed": 3})
    meta = read_meta(tmp_path)
    fingerprint = tiny_llama.fingerprint()
    assert meta.layer_id_convention == "output_of_layer" and meta.final_hidden_norm == "post_norm"
    assert meta.layer_ids == LAYERS and meta.hidden_size == 64 and meta.num_target_layers == 4
    assert (meta.config_hash, meta.tokenizer_hash, meta.target) == (
        fingerprint["config_hash"], fingerprint["tokenizer_hash"], "tiny-random-llama")
    assert meta.counts["samples"] == 8 and meta.counts["per_split"]["validation"]["samples"] == 2
    assert meta.source["prompts"] == "unit-test" and meta.source["seed"] == 3
    assert meta.bytes_per_token == 2 * 64 * (3 + 1) + 5 + 4  # + the fp32 target log-normaliser (format v2)
    index = json.loads((tmp_path / "index.json").read_text())
    assert all(len(s["sha256"]) == 64 for s in index["shards"].values())
    assert meta.counts["bytes_on_disk"] == sum((tmp_path / n).stat().st_size for n in index["shards"])


def test_bytes_per_token_formula():
    assert bytes_per_token(576, 5, "bf16") == 2 * 576 * 6 + 5 + 4 == 6921
    assert bytes_per_token(576, 5, "fp32") == 4 * 576 * 6 + 5 + 4
    assert bytes_per_token(576, 5, "fp8") == 576 * 5 + 4 * 5 + 2 * 576 + 5 + 4


def test_resume_after_injected_failure_matches_uninterrupted_run(tiny_llama, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    build(tiny_llama, reference, batch_size=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        build(tiny_llama, resumed, batch_size=2, faults=FaultInjection(stop_after=2))
    partial = json.loads((resumed / partial_index_name(0)).read_text())
    assert len(partial["shards"]) == 2 and not partial["complete"] and not (resumed / "meta.json").exists()
    (resumed / ".shard-r00-00002.safetensors.abc123.tmp").write_bytes(b"half written")  # killed mid-write
    (resumed / "shard-r00-00007.safetensors").write_bytes(b"renamed but never indexed")
    stats = build(tiny_llama, resumed, batch_size=2)
    assert stats.num_resumed_samples == sum(len(s["samples"]) for s in partial["shards"]) > 0
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert (resumed / "index.json").read_text() == (reference / "index.json").read_text()
    for name in json.loads((reference / "index.json").read_text())["shards"]:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes()
    assert verify_cache(resumed) == []


def test_a_full_disk_names_the_shard_keeps_the_complete_ones_and_the_rerun_matches(tiny_llama, tmp_path):
    from deepspec.utils.faults import full_disk
    from deepspec.utils.io import DiskFullError

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    build(tiny_llama, reference, batch_size=2)
    first_shard = (reference / "shard-r00-00000.safetensors").stat().st_size
    with full_disk(tmp_path, free_bytes=first_shard + 4000):  # the first shard and its partial index fit
        with pytest.raises(DiskFullError) as error:
            build(tiny_llama, resumed, batch_size=2)
        message = str(error.value)
    kept = json.loads((resumed / partial_index_name(0)).read_text())["shards"]
    assert message.startswith(f"{resumed / 'shard-r00-00001.safetensors'}: no space left on device (it needs about ")
    assert (f"the 1 complete shard(s) listed in {partial_index_name(0)} ({len(kept[0]['samples'])} samples) are kept "
            "(rerunning the same command resumes after them)") in message
    assert sorted(p.name for p in resumed.iterdir() if not p.name.startswith(".lock")) == [
        partial_index_name(0), "shard-r00-00000.safetensors"]  # no temp file, no unlisted shard
    stats = build(tiny_llama, resumed, batch_size=2)
    assert stats.num_resumed_samples == len(kept[0]["samples"])
    assert (resumed / "index.json").read_text() == (reference / "index.json").read_text()
    for name in json.loads((reference / "index.json").read_text())["shards"]:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes()
    assert verify_cache(resumed) == []


FIRST_WRITER = """
import sys, time
import deepspec.cache.capture as capture
from deepspec.cache import build_cache
from tests_cache_support import build_args
real_capture, calls = capture.capture_features, []
def capture_then_hang(*args, **kwargs):  # a slow first writer: hangs once it has written a shard
    calls.append(1)
    if len(calls) == 3:
        print("writing", flush=True)
        time.sleep(600)
    return real_capture(*args, **kwargs)
capture.capture_features = capture_then_hang
build_cache(*build_args(sys.argv[1]))
"""

SUPPORT = """
from deepspec.cache import BuildJob
from deepspec.cache.config import CacheSchema
from deepspec.data.sources import Conversation
from deepspec.targets.load import make_tiny_target

def build_args(out_dir):
    convs = []
    for i in range(8):
        messages = [{"role": "user", "content": "Tell me about topic " + "x " * (3 * i)},
                    {"role": "assistant", "content": "Here is an answer " + "word " * (4 * i + 1)}]
        convs.append(Conversation(id=f"conv{i}", messages=messages, source="test", line=i))
    options = CacheSchema(out_dir=str(out_dir), layer_ids=[0, 1, 2], batch_size=2, shard_size_mb=0.001, progress=False)
    return ({"train": convs}, make_tiny_target("llama"), BuildJob(options))
"""


def test_second_writer_is_refused_naming_the_holder_and_loses_nothing(tmp_path):
    """Two builds into one folder used to delete each other's temp files; now the second fails at once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from deepspec.utils.locks import LockHeldError

    (tmp_path / "tests_cache_support.py").write_text(SUPPORT)
    support = {}
    exec(SUPPORT, support)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "cache"
    first = subprocess.Popen([sys.executable, "-c", FIRST_WRITER, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "writing\n" in iter(first.stdout.readline, "")  # mid-build, holding the rank-0 lock
        files = {p.name: p.read_bytes() for p in out.iterdir()}
        assert len([name for name in files if name.startswith("shard-")]) == 2
        with pytest.raises(LockHeldError, match=rf"{out / '.lock-r0'}: rank 0 of the feature cache {out} is being "
                                                rf"written by another run: pid {first.pid} on "):
            build_cache(*support["build_args"](out))  # same settings
        assert {p.name: p.read_bytes() for p in out.iterdir()} == files  # nothing deleted or rewritten
    finally:
        first.kill()
        first.wait(timeout=30)
    assert first.returncode != 0


def test_resume_redoes_a_corrupt_shard(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    before = CacheReader(tmp_path)
    features_before = [before[i].features for i in range(len(before))]
    shard = sorted(tmp_path.glob("shard-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    stats = build(tiny_llama, tmp_path)
    assert 0 < stats.num_resumed_samples < 8
    after = CacheReader(tmp_path)
    assert len(after) == 8 and verify_cache(tmp_path) == []  # redone into a new shard, nothing duplicated
    assert all(torch.equal(after[i].features, features_before[i]) for i in range(8))


def test_template_options_render_every_sample_and_are_recorded(tiny_llama, qwen3_style_tokenizer, tmp_path):
    """Qwen3 non-thinking mode: every sample's ids and loss mask are the rendering with the options; meta.json
    records them and a resume with other options is refused."""
    import dataclasses

    target = dataclasses.replace(tiny_llama, tokenizer=qwen3_style_tokenizer)
    options = {"enable_thinking": False}
    build(target, tmp_path, rendering=Rendering(chat_template_kwargs=options))
    assert read_meta(tmp_path).chat_template_kwargs == options
    reader = CacheReader(tmp_path)
    for i, conv in enumerate(make_conversations()):
        rendered = render_conversation(qwen3_style_tokenizer, conv.messages, chat_template_kwargs=options)
        assert reader[i].input_ids.tolist() == rendered.input_ids[:96]
        assert reader[i].loss_mask.tolist() == [bool(m) for m in rendered.loss_mask[:96]]
        assert "<think>" in qwen3_style_tokenizer.decode(reader[i].input_ids)
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \{'enable_thinking': False\} vs now \{\}"):
        build(target, tmp_path)


def test_resume_refuses_other_settings(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    with pytest.raises(ValueError, match="storage_dtype: 'bf16' vs now 'fp32'"):
        build(tiny_llama, tmp_path, storage_dtype="fp32")


def test_two_ranks_in_process_merge_to_the_single_process_cache(tiny_llama, tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    build(tiny_llama, single, storage_dtype="fp32")
    for rank in (0, 1):
        stats = build(tiny_llama, sharded, storage_dtype="fp32", rank=rank, world_size=2)
        assert stats.meta is None  # no process group: the explicit merge step joins the ranks
    with pytest.raises(FileNotFoundError):
        CacheReader(sharded)
    merge_cache(sharded)
    a, b = CacheReader(single), CacheReader(sharded)
    assert [s["id"] for s in a.samples] == [s["id"] for s in b.samples]
    assert {s["shard"][:9] for s in b.samples} == {"shard-r00", "shard-r01"}
    for i in range(len(a)):
        assert torch.equal(a[i].features, b[i].features) and torch.equal(a[i].input_ids, b[i].input_ids)
    assert read_meta(sharded).counts == {**read_meta(single).counts, "shards": read_meta(sharded).counts["shards"],
                                         "bytes_on_disk": read_meta(sharded).counts["bytes_on_disk"]}


def test_verify_names_the_corrupt_shard(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    assert verify_cache(tmp_path) == []
    shards = sorted(tmp_path.glob("shard-*.safetensors"))
    data = bytearray(shards[1].read_bytes())
    data[len(data) // 2] ^= 0x01
    shards[1].write_bytes(bytes(data))
    problems = verify_cache(tmp_path)
    assert len(problems) == 1 and shards[1].name in problems[0] and "sha256" in problems[0]
    (tmp_path / shards[0].name).unlink()
    assert any(shards[0].name in p and "missing" in p for p in verify_cache(tmp_path))


def test_a_changed_byte_anywhere_in_a_shard_is_refused_before_use_naming_it(tiny_llama, tmp_path):
    """A finished shard's sha256 is of the whole file: one byte changed in its header's JSON, the spaces that pad
    it (to a tab, which JSON reads alike), its tensor data or its last bytes, and the reader refuses the shard
    before any sample of it is used, as verify does."""
    import shutil

    built = tmp_path / "built"
    build(tiny_llama, built)
    for region in ("header", "header padding", "tensor data", "last bytes"):
        cache = tmp_path / region.replace(" ", "-")
        shutil.copytree(built, cache)
        shard = sorted(cache.glob("shard-*.safetensors"))[1]
        data = bytearray(shard.read_bytes())
        header_end = 8 + int.from_bytes(data[:8], "little")
        at = {"header": 12, "header padding": header_end - 1, "tensor data": header_end + 64,
              "last bytes": len(data) - 7}[region]
        if region == "header padding":
            assert data[at] == ord(" "), "this shard's header has no padding: pick another shard"
        data[at] = ord("\t") if region == "header padding" else data[at] ^ 0xFF
        shard.write_bytes(bytes(data))
        reader = CacheReader(cache)
        first = next(i for i, s in enumerate(reader.samples) if s["shard"] == shard.name)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: (sha256|size) .* the shard is corrupt"):
            reader[first]
        problems = verify_cache(cache)
        assert len(problems) == 1 and shard.name in problems[0], region


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_index_pointing_outside_the_cache_is_refused(tiny_llama, tmp_path, escape):
    """A shard name that leaves the cache folder is refused by verify and the reader, naming index.json and
    the entry, even where the file it points to is a valid shard with the recorded checksum."""
    cache = tmp_path / "cache"
    build(tiny_llama, cache)
    index_path = cache / "index.json"
    index = json.loads(index_path.read_text())
    real = sorted(index["shards"])[0]
    outside = tmp_path / "elsewhere" / real
    outside.parent.mkdir()
    outside.write_bytes((cache / real).read_bytes())
    bad = "/".join(["..", "elsewhere", real]) if escape == "relative" else str(outside)  # climbs out of the cache
    index["shards"][bad] = index["shards"].pop(real)
    for sample in index["samples"]:
        sample["shard"] = bad if sample["shard"] == real else sample["shard"]
    (cache / real).unlink()
    index_path.write_text(json.dumps(index))
    where = rf"{index_path}: (shards|samples\[0\]\.shard): shard name '{bad}' is not a shard file name"
    problems = verify_cache(cache)
    assert problems and all(bad in p for p in problems)
    assert any(re.match(where, p) for p in problems), problems
    with pytest.raises(ValueError, match=where):
        CacheReader(cache)


def test_partial_index_pointing_outside_is_refused_before_deleting(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    partial_path = tmp_path / partial_index_name(0)
    partial = json.loads(partial_path.read_text())
    partial["shards"][0]["file"] = "/etc/hostname"
    partial_path.write_text(json.dumps(sealed(partial)))  # as the writer seals it
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=rf"{partial_path}: shards\[0\].file: shard name '/etc/hostname'"):
        build(tiny_llama, tmp_path)
    with pytest.raises(ValueError, match=rf"{partial_path}: shards\[0\].file: shard name '/etc/hostname'"):
        merge_cache(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_fingerprint_mismatch_is_refused_naming_field(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    good = {**tiny_llama.fingerprint(), "layer_ids": LAYERS}
    assert len(CacheReader(tmp_path, expected_fingerprint=good)) == 8
    with pytest.raises(ValueError, match=r"tokenizer_hash: cache has '[0-9a-f]+', configured 'deadbeef'"):
        CacheReader(tmp_path, expected_fingerprint={**good, "tokenizer_hash": "deadbeef"})
    with pytest.raises(ValueError, match=r"layer_ids: cache has \[0, 1, 2\], configured \[1, 2\]"):
        check_cache_compatible(read_meta(tmp_path), tiny_llama.fingerprint(), layer_ids=[1, 2])
    with pytest.raises(ValueError, match="target: cache has 'tiny-random-llama', configured 'tiny-random-qwen3'"):
        check_cache_compatible(read_meta(tmp_path), {**good, "target": "tiny-random-qwen3"})


def test_malformed_input_and_unmaskable_samples_are_counted(tiny_llama, tmp_path):
    path = tmp_path / "prompts.jsonl"
    good = [{"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    lines = [json.dumps(r) for r in good] + [
        "{broken json",
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
        json.dumps({"id": "prompt-only", "turns": ["no answer here"]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    convs, report = load_jsonl(path)
    # The loader drops leading answers, so build a conversation the chat template cannot render directly.
    convs.append(Conversation(id="assistant-first", messages=[{"role": "assistant", "content": "hi"}],
                              source="test", line=None))
    source = {"prompts": str(path), "load_report": {"num_malformed": report.num_malformed,
                                                    "num_unknown_role": report.num_unknown_role}}
    stats = build(tiny_llama, tmp_path / "cache", splits={"train": convs}, source=source)
    assert stats.skipped == {"no_assistant_tokens": 1, "render_error": 1}
    counts = read_meta(tmp_path / "cache").counts
    assert counts["skipped"] == {"input_malformed": 1, "input_unknown_role": 1, "no_assistant_tokens": 1,
                                 "render_error": 1}
    assert counts["num_skipped"] == 4 and counts["samples"] == 3
    assert any("prompt-only" in p for p in counts["problems"])


def test_fp8_error_is_reported_and_small(tiny_qwen3, tmp_path):
    stats = build(tiny_qwen3, tmp_path, storage_dtype="fp8")
    meta = read_meta(tmp_path)
    assert meta.fp8_rel_error == pytest.approx(stats.fp8_rel_error) and 0.0 < meta.fp8_rel_error < 0.05
    reader, raw = CacheReader(tmp_path), CacheReader(tmp_path, dtype=None)
    sq_error = sq_ref = 0.0
    for i in range(len(reader)):
        sample = reader[i]
        fresh = capture_features(tiny_qwen3.model, sample.input_ids[None], None, LAYERS).features_BTF[0]
        sq_error += float((sample.features.double() - fresh.double()).square().sum())
        sq_ref += float(fresh.double().square().sum())
        raw_sample = raw[i]
        assert raw_sample.features.dtype == torch.float8_e4m3fn
        assert raw_sample.features_scale.shape == (sample.length, 3)
        assert raw_sample.final_hidden.dtype == torch.bfloat16
    assert (sq_error / sq_ref) ** 0.5 == pytest.approx(meta.fp8_rel_error, rel=1e-3)
    shard_bytes = sum(p.stat().st_size for p in tmp_path.glob("shard-*.safetensors"))
    payload = meta.bytes_per_token * reader.num_tokens
    assert payload <= shard_bytes < payload * 1.05  # only safetensors headers on top of the payload


def test_bad_arguments_raise_naming_the_field(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="cache.storage_dtype='int4'"):
        build(tiny_llama, tmp_path, storage_dtype="int4")
    with pytest.raises(ValueError, match=r"cache.layer_ids\[0\]=3 is out of range"):
        build_cache(splits_of(make_conversations()), tiny_llama, job(tmp_path, [3], progress=False))
    with pytest.raises(ValueError, match="unknown splits"):
        build(tiny_llama, tmp_path, splits={"dev": make_conversations(2)})
    build(tiny_llama, tmp_path)
    with pytest.raises(ValueError, match="split 'dev'"):
        CacheReader(tmp_path).split("dev")


@pytest.mark.slow
def test_embedded_target_round_trip(smollm2, tmp_path):
    from deepspec.targets.layers import spread_layer_ids

    layer_ids = spread_layer_ids(smollm2.num_layers, 5)  # the cache default
    convs = make_conversations(3)
    build_cache({"train": convs}, smollm2, job(tmp_path, layer_ids, max_length=64, batch_size=1, progress=False))
    meta = read_meta(tmp_path)
    assert meta.layer_ids == [1, 8, 14, 21, 27] and meta.hidden_size == 576 and meta.num_target_layers == 30
    assert meta.bytes_per_token == 6921
    reader = CacheReader(tmp_path, expected_fingerprint={**smollm2.fingerprint(), "layer_ids": layer_ids}, dtype=None)
    sample = reader[1]
    fresh = capture_features(smollm2.model, sample.input_ids[None], None, layer_ids)
    assert torch.equal(sample.features, fresh.features_BTF[0].to(torch.bfloat16))
    assert torch.equal(sample.final_hidden, fresh.final_hidden_BTH[0].to(torch.bfloat16))
    assert verify_cache(tmp_path) == []


# -- the target's log-normaliser ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("storage_dtype", ["bf16", "fp32"])
def test_target_lse_is_the_log_normaliser_of_the_stored_final_hidden(request, tmp_path, family, storage_dtype):
    target = request.getfixturevalue(family)
    build(target, tmp_path, storage_dtype=storage_dtype)
    reader = CacheReader(tmp_path, dtype=None)
    head_VH = target.model.get_output_embeddings().weight
    for i in (0, 3, 7):
        sample = reader[i]
        assert sample.target_lse.dtype == torch.float32 and sample.target_lse.shape == sample.input_ids.shape
        # Of the logits the losses recompute from the stored (possibly bf16) final hidden.
        expected = torch.logsumexp(sample.final_hidden.float() @ head_VH.T, dim=-1)
        torch.testing.assert_close(sample.target_lse, expected, rtol=1e-6, atol=1e-5)
        if storage_dtype == "fp32":  # nothing rounded: the target's own full-vocabulary normaliser
            logits = target.model(sample.input_ids[None]).logits[0]
            torch.testing.assert_close(sample.target_lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("version", [1, 3])
def test_a_cache_of_another_format_version_is_refused_naming_the_file(tiny_llama, tmp_path, version):
    build(tiny_llama, tmp_path)
    for name in ("meta.json", "index.json"):
        data = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({**data, "format_version": version}))
    with pytest.raises(ValueError, match=rf"meta.json: cache format_version={version}, this DeepSpec reads version 2"):
        read_meta(tmp_path)
    from deepspec.cache.format import read_index

    with pytest.raises(ValueError, match=rf"index.json: format_version={version}, this DeepSpec reads version 2"):
        read_index(tmp_path)


def test_verify_reports_a_shard_without_the_log_normaliser(tiny_llama, tmp_path):
    import hashlib

    from safetensors.torch import load_file, save

    build(tiny_llama, tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    for name, info in index["shards"].items():  # shards without target_lse, checksums and sizes redone
        tensors = load_file(str(tmp_path / name))
        del tensors["target_lse"]
        payload = save(tensors, metadata={"deepspec_cache": json.dumps({"format_version": 2})})
        (tmp_path / name).write_bytes(payload)
        info.update(sha256=hashlib.sha256(payload).hexdigest(), num_bytes=len(payload))
    write_index_and_meta(tmp_path, index, read_meta(tmp_path))
    problems = verify_cache(tmp_path)
    assert problems and all("tensor 'target_lse' missing" in p for p in problems)


def test_resume_refuses_a_partial_build_of_another_format_version(tiny_llama, tmp_path):
    with pytest.raises(RuntimeError, match="injected failure"):
        build(tiny_llama, tmp_path, faults=FaultInjection(stop_after=1))
    partial_path = tmp_path / partial_index_name(0)
    partial = json.loads(partial_path.read_text())
    del partial["settings"]["format_version"]  # not this version's build
    partial_path.write_text(json.dumps(sealed(partial)))
    with pytest.raises(ValueError, match="format_version"):
        build(tiny_llama, tmp_path)
def test_final_hidden_only_cache_stores_no_features(tiny_llama, tmp_path):
    """cache.layer_ids=[]: ids, mask, the final hidden state and the target's log-normaliser only, at 4H + 9 bytes
    per token (fp32)."""
    build_cache(splits_of(make_conversations()), tiny_llama, job(tmp_path, [], max_length=96, batch_size=2,
                                                                 storage_dtype="fp32", shard_size_mb=1.0,
                                                                 progress=False))
    meta = read_meta(tmp_path)
    assert meta.layer_ids == [] and meta.content == "hidden_states"
    assert meta.bytes_per_token == bytes_per_token(64, 0, "fp32") == 4 * 64 + 9
    index = json.loads((tmp_path / "index.json").read_text())
    for shard in index["shards"]:
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            assert sorted(f.keys()) == ["final_hidden", "input_ids", "loss_mask", "target_lse"]
    reader = CacheReader(tmp_path)
    sample = reader[3]
    fresh = capture_features(tiny_llama.model, sample.input_ids[None], None, [])
    assert sample.features.shape == (sample.length, 0)
    torch.testing.assert_close(sample.final_hidden, fresh.final_hidden_BTH[0], rtol=0, atol=1e-5)
    assert verify_cache(tmp_path) == []


@pytest.mark.parametrize("storage_dtype,logprob_dtype", [("bf16", torch.float16), ("fp32", torch.float32)])
def test_top_k_cache_holds_the_target_next_token_law(tiny_qwen3, tmp_path, storage_dtype, logprob_dtype):
    """cache.content=top_k_logprobs: the k most likely next tokens of the target and their log-probabilities
    (normalised over the whole vocabulary), no hidden states, k x (4 + 2|4) + 5 bytes per token."""
    from deepspec.targets.features import target_logits

    k = 8
    build_cache(splits_of(make_conversations()), tiny_qwen3,
                job(tmp_path, [], max_length=96, batch_size=3, storage_dtype=storage_dtype, shard_size_mb=1.0,
                    progress=False, content="top_k_logprobs", top_k=k))
    meta = read_meta(tmp_path)
    assert (meta.content, meta.top_k, meta.layer_ids) == ("top_k_logprobs", k, [])
    assert meta.bytes_per_token == 4 + 1 + k * (4 + logprob_dtype.itemsize)
    index = json.loads((tmp_path / "index.json").read_text())
    assert meta.counts["bytes_on_disk"] < meta.bytes_per_token * meta.counts["tokens"] + 2048 * len(index["shards"])
    raw = CacheReader(tmp_path, dtype=None)[4]
    assert raw.top_k_logprobs.dtype == logprob_dtype and raw.final_hidden is None
    sample = CacheReader(tmp_path)[4]
    fresh = capture_features(tiny_qwen3.model, sample.input_ids[None], None, [])
    logp_TV = torch.log_softmax(target_logits(tiny_qwen3.model, fresh.final_hidden_BTH[0]), dim=-1)
    top = torch.topk(logp_TV, k, dim=-1)
    assert torch.equal(sample.top_k_ids, top.indices)
    tolerance = 0 if logprob_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(sample.top_k_logprobs, top.values, rtol=tolerance, atol=tolerance)
    assert verify_cache(tmp_path) == []


def test_top_k_cache_refuses_layers_and_a_bad_k(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"cache.layer_ids=\[0\]: a top_k_logprobs cache stores no hidden states"):
        build_cache(splits_of(make_conversations(2)), tiny_llama, job(tmp_path, [0], content="top_k_logprobs", top_k=4))
    with pytest.raises(ValueError, match=r"cache.top_k=0 must be an int >= 1"):
        build_cache(splits_of(make_conversations(2)), tiny_llama, job(tmp_path, [], content="top_k_logprobs", top_k=0))
    with pytest.raises(ValueError, match=r"cache.content='logits' is not one of"):
        build_cache(splits_of(make_conversations(2)), tiny_llama, job(tmp_path, [], content="logits"))


def test_cache_files_get_the_mode_an_ordinary_open_gives(tiny_llama, tmp_path):
    """Shards, index and meta are readable by other users under umask 022 (a training or serving job running
    as another user), not mkstemp's 0o600."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        build(tiny_llama, tmp_path / "cache", splits={"train": make_conversations(2)})
    finally:
        os.umask(old)
    files = sorted((tmp_path / "cache").iterdir())
    assert any(p.name.startswith("shard-") for p in files) and {"index.json", "meta.json"} <= {p.name for p in files}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o644 for p in files}
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o755


def _rewrite_shard_ids(cache_dir, sample_index: int, tensor: str, position: tuple, value: int):
    """Put `value` into `tensor` at `position` of sample `sample_index` and re-record the shard's checksum, as a
    writer bug would (the checksum is right, the ids are not). Returns (shard name, sample id)."""
    import hashlib

    from safetensors.torch import load_file, save

    index_path = cache_dir / "index.json"
    index = json.loads(index_path.read_text())
    entry = index["samples"][sample_index]
    shard = cache_dir / entry["shard"]
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(shard))
    tensors[tensor][(entry["offset"] + position[0], *position[1:])] = value
    payload = save(tensors, metadata=metadata)
    shard.write_bytes(payload)
    index["shards"][entry["shard"]].update(sha256=hashlib.sha256(payload).hexdigest(), num_bytes=len(payload))
    write_index_and_meta(cache_dir, index, read_meta(cache_dir))
    return entry["shard"], entry["id"]


def test_verify_and_the_reader_range_check_input_ids(tiny_llama, tmp_path):
    build(tiny_llama, tmp_path)
    vocab = tiny_llama.model.config.vocab_size
    assert read_meta(tmp_path).vocab_size == vocab and verify_cache(tmp_path) == []
    shard, sample_id = _rewrite_shard_ids(tmp_path, 3, "input_ids", (2,), 1_000_000)
    problems = verify_cache(tmp_path)
    length = CacheReader(tmp_path, vocab_size=2**31 - 1)[3].length
    assert problems == [f"{shard}: sample 3 (id {sample_id!r}) token 2 has input id 1000000, outside the target "
                        f"vocabulary [0, {vocab}) (out of range: 1 of its {length} input ids)"]
    with pytest.raises(ValueError, match=rf"{shard}: sample 3 \(id '{sample_id}'\) token 2 has input id 1000000"):
        CacheReader(tmp_path)[3]
    assert CacheReader(tmp_path)[2].length > 0  # the other samples still read


def test_verify_and_the_reader_range_check_top_k_ids(tiny_qwen3, tmp_path):
    build_cache(splits_of(make_conversations()), tiny_qwen3,
                job(tmp_path, [], max_length=96, batch_size=3, storage_dtype="fp32", shard_size_mb=1.0,
                    progress=False, content="top_k_logprobs", top_k=4))
    vocab = tiny_qwen3.model.config.vocab_size
    shard, sample_id = _rewrite_shard_ids(tmp_path, 5, "top_k_ids", (1, 3), vocab + 7)
    problems = verify_cache(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: sample 5 (id {sample_id!r}) token 1 top-k entry 3 "
                                                          f"has top-k id {vocab + 7}, outside the target vocabulary")
    with pytest.raises(ValueError, match=rf"sample 5 \(id '{sample_id}'\) token 1 top-k entry 3 has top-k id"):
        CacheReader(tmp_path)[5]
