"""A bigram-started DSpark starts at its floor: with a zero start of the backbone's output (an output adapter at
zero, `drafter.output_adapter=zero`, or a final norm at zero, `drafter.final_norm_init=0`) the backbone adds nothing
to the first drafts, the Markov head is fitted to the target's argmax after each token (read from the cache), so
slot 0 proposes the bigram table's token wherever the table's choice is unique; `trainer.val_at_start` records it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from deepspec.benchmarks.floors import anchor_positions, cache_bigram_table, floor_validation
from deepspec.cache.reader import CacheReader, argmax_next_tokens
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.spec import ANCHOR_PREDICTS

BIGRAM = ["drafter.markov_init=bigram", "drafter.markov_rank=256"]
STARTS = {"zero adapter": ["drafter.output_adapter=zero", *BIGRAM], "zero norm": ["drafter.final_norm_init=0", *BIGRAM]}
start = pytest.mark.parametrize("start", list(STARTS.values()), ids=list(STARTS))


def _prepared_drafter(tt, cache, tmp_path, *extra):
    from deepspec.training.config import plan_training, resolve_config
    from deepspec.training.session import build_data_and_drafter

    cfg = resolve_config(tt.compose(tt.train_overrides(cache, tmp_path / "run", *extra)))
    torch.manual_seed(0)
    return build_data_and_drafter(cfg, plan_training(cfg, world_size=1), torch.device("cpu"))


def _unique_best(reader, head_VH) -> dict[int, int]:
    """anchor token -> the target's argmax seen most often after it in the train split, where that is unique."""
    counts: dict[int, Counter] = {}
    for i in reader.split("train"):
        s = reader[i]
        argmax_T = argmax_next_tokens(s.final_hidden, head_VH)
        for a in anchor_positions(s.loss_mask).tolist():
            counts.setdefault(int(s.input_ids[a]), Counter())[int(argmax_T[a])] += 1
    best = {}
    for token, seen in counts.items():
        (first, n1), *rest = seen.most_common(2)
        if not rest or rest[0][1] < n1:
            best[token] = first
    return best


@start
def test_a_zero_start_makes_the_backbone_add_nothing(tt, tiny_cache, tmp_path, start):
    data, target, drafter = _prepared_drafter(tt, tiny_cache, tmp_path, *start)
    batch = data.collate(data.val_ids[:2], epoch=0)
    out = drafter(batch)
    assert out.hidden_NH.abs().max() == 0  # zero base logits, zero hidden input to the confidence head
    assert drafter.sequential.prev_embed.weight.abs().sum() > 0  # the Markov head holds the bigram fit


@start
@pytest.mark.parametrize("draft_vocab", [None, 512])
def test_slot0_of_a_bigram_started_dspark_is_the_bigram_table(tt, tiny_cache, tmp_path, draft_vocab, start):
    extra = [] if draft_vocab is None else [f"drafter.draft_vocab_size={draft_vocab}"]
    data, target, drafter = _prepared_drafter(tt, tiny_cache, tmp_path, *start, *extra)
    reader = CacheReader(tiny_cache)
    head_VH = target.model.get_output_embeddings().weight.detach()
    best = _unique_best(reader, head_VH)
    kept = (set(range(head_VH.shape[0])) if draft_vocab is None
            else set(drafter.target_vocab_index().tolist()))
    compared = 0
    cache = drafter.new_decode_state()
    for token, expected in best.items():
        if token not in kept or expected not in kept:
            continue  # outside the draft vocabulary: the head cannot name it (one shared row / no column)
        proposal = drafter.propose(cache, torch.tensor([token]), torch.tensor([0]), _greedy())
        assert int(proposal.token_ids_BK[0, 0]) == expected, token
        compared += 1
    assert compared >= 5


def _greedy():
    from deepspec.decoding.sampling import SamplingParams, draft_sampler

    return draft_sampler(SamplingParams(temperature=0.0))


@start
def test_the_step0_validation_is_recorded_at_the_bigram_floor(tt, tiny_cache, tiny_llama, tmp_path, start):
    from deepspec.drafters.block.config import choose_mask_token_id
    from deepspec.training import run
    from deepspec.training.log import read_metrics

    run(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "run", *start, "trainer.val_at_start=true",
                                      "trainer.max_steps=1", "trainer.decode_eval_prompts=0")))
    records = read_metrics(tmp_path / "run", "validation")
    assert [r["step"] for r in records] == [0, 1]
    reader = CacheReader(tiny_cache)
    head_VH = tiny_llama.model.get_output_embeddings().weight.detach()  # the cache's target
    table_V = cache_bigram_table((reader[i] for i in reader.split("train")), head_VH)
    mask_token = choose_mask_token_id(tiny_llama.tokenizer, head_VH.shape[0])
    builder = BlockBatchBuilder(4, mask_token, 8, 0, block_convention=ANCHOR_PREDICTS)  # the trainer's blocks
    floor = floor_validation([reader[i] for i in reader.split("validation")], builder.collate, table_V, head_VH)
    slot0, floor0 = records[0]["top1_agreement"][0], floor["bigram"]["top1_agreement"][0]
    assert records[0]["num_blocks"] == floor["bigram"]["num_blocks"]
    assert slot0 == pytest.approx(floor0, abs=0.1), (slot0, floor0)  # ties in the table may go either way


def test_the_reader_gives_the_targets_argmax_where_the_next_token_is_supervised(tiny_cache, tiny_llama):
    from deepspec.cache.reader import UNKNOWN_NEXT

    reader = CacheReader(tiny_cache)
    head_VH = tiny_llama.model.get_output_embeddings().weight.detach()
    for i in reader.split("train")[:3]:
        sample = reader[i]
        next_T = reader.target_next_tokens(i, head_VH)
        counted_T = torch.zeros_like(sample.loss_mask)
        counted_T[:-1] = sample.loss_mask[1:]
        assert counted_T.any() and (~counted_T).any()
        assert torch.equal(next_T[counted_T], argmax_next_tokens(sample.final_hidden, head_VH)[counted_T])
        assert (next_T[~counted_T] == UNKNOWN_NEXT).all()
