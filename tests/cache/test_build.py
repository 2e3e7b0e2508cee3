"""The build job (deepspec.cache.build): one object names the folder and the layers once; the build's bytes and
resume are in test_cache.py, test_integrity.py and test_cache_distributed.py."""

from __future__ import annotations

import inspect

import pytest

from deepspec.cache import BuildJob, build_cache, read_meta
from deepspec.cache.config import CacheSchema
from deepspec.data.sources import Conversation


def test_build_cache_takes_the_folder_and_layers_from_its_job_only(tiny_llama, tmp_path):
    assert list(inspect.signature(build_cache).parameters) == ["conversations_by_split", "target", "job"]
    job = BuildJob(CacheSchema(out_dir=str(tmp_path / "cache"), layer_ids=[2], max_length=None, progress=False))
    assert (job.out_dir, job.layer_ids) == (tmp_path / "cache", [2])
    convs = [Conversation(id=f"c{i}", source="t", line=i, messages=[{"role": "user", "content": "Hi " * (i + 1)},
                                                                   {"role": "assistant", "content": "Hello"}])
             for i in range(2)]
    build_cache({"train": convs}, tiny_llama, job)
    assert read_meta(tmp_path / "cache").layer_ids == [2]


def test_a_job_refuses_unresolved_layers_and_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"cache.layer_ids=None: a build job takes the resolved layer ids"):
        BuildJob(CacheSchema())
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        BuildJob(CacheSchema(layer_ids=[0]), rank=2, world_size=2)


def test_truncation_is_counted_for_the_samples_cached_only(tiny_llama, tmp_path, capsys):
    """Long prompt-only text records are cut, then skipped (nothing to learn from): they are skipped records, not
    truncated samples; only the cached sample that was cut is counted, in the note and in meta.json."""
    from deepspec.data.rendering import Rendering
    from deepspec.data.sources import TextRecord

    def text(i, prompt, completion):
        return Conversation(id=f"t{i}", messages=[], source="t.jsonl", line=i, text=TextRecord(prompt, completion))

    long_words = "one two three four five six seven eight nine ten " * 4
    records = [text(i, long_words, None) for i in range(3)]  # prompts alone, longer than max_length
    records += [text(3, "Once", long_words), text(4, "Short", " story."), text(5, "Brief", " tale.")]
    records.append(text(6, long_words, " and so on"))  # its completion lies past max_length: skipped, said why
    job = BuildJob(CacheSchema(out_dir=str(tmp_path / "cache"), layer_ids=[0], max_length=16, storage_dtype="fp32",
                               progress=False), rendering=Rendering(format="text"))
    build_cache({"train": records}, tiny_llama, job)
    meta = read_meta(tmp_path / "cache")
    assert meta.counts["samples"] == 3 and meta.counts["skipped"] == {"no_loss_tokens": 4}
    assert meta.counts["truncated_to_max_length"] == 1
    assert "note: 1 of 3 samples were longer than cache.max_length=16" in capsys.readouterr().out
    assert meta.counts["problems"][-1] == ("'t6' (t.jsonl:6): no_loss_tokens: every token to learn from lies past "
                                           "the first 16 kept (cache.max_length, or the target's context)")


def test_a_sample_past_the_target_s_context_is_cut_to_it_counted_and_named(tmp_path, capsys, monkeypatch):
    """cache.max_length=null and one 20,000-word turn: the sample keeps the target's context of tokens (a forward
    over the whole of it would grow without bound), counted in meta.json and named in the warning; no forward is
    ever wider than the context."""
    import deepspec.cache.build as build
    from deepspec.cache import CacheReader
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("llama")  # its own model: the context is shortened for this test only
    target.model.config.max_position_embeddings = 48
    widths, capture = [], build.capture_batch

    def recording_capture(model, batch, *args, **kwargs):
        widths.append(max(s.length for s in batch))
        return capture(model, batch, *args, **kwargs)

    monkeypatch.setattr(build, "capture_batch", recording_capture)
    convs = [Conversation(id=f"c{i}", source="chat.jsonl", line=i + 1, messages=[
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello " * (3 + i)}])
        for i in range(3)]
    convs.append(Conversation(id="huge", source="chat.jsonl", line=4, messages=[
        {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "because " * 20_000}]))
    out = tmp_path / "cache"
    build_cache({"train": convs}, target, BuildJob(CacheSchema(out_dir=str(out), layer_ids=[0], max_length=None,
                                                               storage_dtype="fp32", progress=False)))
    printed = capsys.readouterr().out
    assert ("warning: 1 samples were longer than the target's context of 48 tokens (max_position_embeddings): "
            "'huge' (chat.jsonl:4) (20") in printed and "they keep only their first 48 tokens" in printed
    assert read_meta(out).counts["longer_than_target_context"] == 1
    reader = CacheReader(out)
    assert max(reader[i].input_ids.shape[0] for i in range(len(reader))) == 48
    assert max(widths) <= 48
