"""Anchor sampling, labels, packing and masks of the block batch builder."""

from __future__ import annotations

import pytest
import torch

from deepspec.cache.reader import CachedSample
from deepspec.drafters.block.attention import cached_block_mask, packed_block_mask
from deepspec.drafters.block.batching import BlockBatchBuilder, draft_slots, supervised_prefix
from deepspec.drafters.spec import ANCHOR_PREDICTS as ANCHOR
from deepspec.drafters.spec import MASK_PREDICTS as MASK_CONVENTION
from deepspec.losses.distribution import IGNORE_INDEX

MASK = 16


def synthetic(sample_id, ids, loss_mask, hidden=4, layers=2):
    ids = torch.as_tensor(ids)
    num = ids.shape[0]
    feats = torch.arange(num * hidden * layers, dtype=torch.float32).view(num, hidden * layers)
    final = torch.arange(num, dtype=torch.float32)[:, None].repeat(1, hidden)
    return CachedSample(sample_id=sample_id, input_ids=ids, loss_mask=torch.as_tensor(loss_mask, dtype=torch.bool),
                        features=feats, final_hidden=final)


def test_anchor_candidates_and_labels():
    # prompt 100,101 | response 10..15 | prompt 102 | response 20, 21
    ids = [100, 101, 10, 11, 12, 13, 14, 15, 102, 20, 21]
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1]
    builder = BlockBatchBuilder(block_size=4, mask_token_id=MASK, max_anchors_per_seq=100, block_convention=ANCHOR)
    sample = synthetic("a", ids, mask)
    assert builder.candidate_anchors(sample.loss_mask).tolist() == [2, 3, 4, 5, 6, 9]
    batch = builder.collate([sample])
    g = 4
    labels_BG = batch.labels_N.view(-1, g)
    # anchor 2: predicts x[3], x[4], x[5], x[6]
    assert labels_BG[0].tolist() == [11, 12, 13, 14]
    # anchor 5: x[6]=14, x[7]=15, x[8] is prompt -> ignored, and so is x[9]=20 behind it (cut at the first
    # unsupervised slot); anchor 6: x[7]=15, then nothing although x[9], x[10] are response tokens
    assert labels_BG[3].tolist() == [14, 15, IGNORE_INDEX, IGNORE_INDEX]
    assert labels_BG[4].tolist() == [15, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    # anchor 9: x[10], then past the end
    assert labels_BG[5].tolist() == [21, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    inputs_BG = batch.block_input_ids_1S[0].view(-1, g)
    assert inputs_BG[:, 0].tolist() == [10, 11, 12, 13, 14, 20] and (inputs_BG[:, 1:] == MASK).all()
    assert batch.block_positions_1S[0].view(-1, g)[1].tolist() == [3, 4, 5, 6]
    # target hidden for slot j is the cached final hidden at a + j (its value encodes the position here)
    assert batch.target_hidden_NH[:, 0].view(-1, g)[0].tolist() == [2, 3, 4, 5]
    assert batch.prev_ids_N.view(-1, g)[0].tolist() == [10, 11, 12, 13]
    assert batch.stats["num_blocks"] == 6 and batch.stats["num_label_tokens"] == 4 + 4 + 3 + 2 + 1 + 1
    assert batch.stats["padded_fraction"] == pytest.approx(1 - 15 / 24)
    assert batch.position_index_N.tolist()[:5] == [0, 1, 2, 3, 0]


def test_mask_predicts_supervises_the_masks_at_their_own_positions():
    """mask-predicts: slot 0 (the anchor) predicts nothing; the mask at slot j (position a + j) predicts x[a + j],
    with the target's distribution for that token (final hidden at a + j - 1) and x[a + j - 1] as previous token.
    The inputs are the same blocks as anchor-predicts, the drafts one fewer."""
    ids = [100, 101, 10, 11, 12, 13, 14, 15, 102, 20, 21]
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1]
    sample = synthetic("a", ids, mask)
    g = 4
    anchor = BlockBatchBuilder(g, MASK, 100, block_convention=ANCHOR).collate([sample])
    batch = BlockBatchBuilder(g, MASK, 100, block_convention=MASK_CONVENTION).collate([sample])
    assert draft_slots(g, MASK_CONVENTION).tolist() == [1, 2, 3] and draft_slots(g, ANCHOR).tolist() == [0, 1, 2, 3]
    assert batch.first_draft_slot == 1 and batch.num_drafts == 3 and anchor.num_drafts == 4
    assert torch.equal(batch.block_input_ids_1S, anchor.block_input_ids_1S)
    assert torch.equal(batch.block_positions_1S, anchor.block_positions_1S)
    labels_BK = batch.labels_N.view(-1, 3)
    positions_BG = batch.block_positions_1S[0].view(-1, g)
    # anchor 2: the masks at positions 3, 4, 5 predict x[3], x[4], x[5]
    assert positions_BG[0, 1:].tolist() == [3, 4, 5] and labels_BK[0].tolist() == [11, 12, 13]
    # anchor 6: x[8] is prompt, and x[9] behind it is cut (`supervised_prefix` acts on drafts in both conventions)
    assert labels_BK[4].tolist() == [15, IGNORE_INDEX, IGNORE_INDEX]
    assert labels_BK[5].tolist() == [21, IGNORE_INDEX, IGNORE_INDEX]  # anchor 9: past the end
    # Draft k is anchor-predicts' draft k: same label, target row and previous token, only its slot moves.
    assert torch.equal(labels_BK, anchor.labels_N.view(-1, 4)[:, :3])
    assert batch.target_hidden_NH[:, 0].view(-1, 3)[0].tolist() == [2, 3, 4]
    assert batch.prev_ids_N.view(-1, 3)[0].tolist() == [10, 11, 12]
    assert batch.position_index_N.tolist()[:4] == [0, 1, 2, 0] and batch.block_index_N.tolist()[:4] == [0, 0, 0, 1]
    assert batch.stats["num_label_tokens"] == 3 + 3 + 3 + 2 + 1 + 1
    with pytest.raises(ValueError, match="block_convention"):
        BlockBatchBuilder(g, MASK, block_convention="anchor_predicts")


def test_supervised_prefix_cuts_at_first_unsupervised_slot():
    supervised_BG = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    assert supervised_prefix(supervised_BG).int().tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_anchor_sampling_deterministic_and_resampled():
    sample = synthetic("s7", list(range(30, 90)), [1] * 60)
    builder = BlockBatchBuilder(block_size=7, mask_token_id=MASK, max_anchors_per_seq=8, seed=3,
                                block_convention=ANCHOR)
    a0 = builder.sample_anchors(sample, epoch=0)
    assert a0.numel() == 8 and torch.equal(a0, a0.unique())
    def anchors(seed):
        return BlockBatchBuilder(7, MASK, 8, seed=seed, block_convention=ANCHOR).sample_anchors(sample, epoch=0)

    assert torch.equal(a0, anchors(seed=3))
    assert not torch.equal(a0, builder.sample_anchors(sample, epoch=1))
    assert not torch.equal(a0, anchors(seed=4))


def test_packing_and_token_budget():
    s1 = synthetic("x", [5, 6, 7, 8, 9], [0, 1, 1, 1, 1])
    s2 = synthetic("y", [1, 2, 3], [1, 1, 1])
    s3 = synthetic("z", [4, 4], [0, 0])  # no anchor: skipped
    builder = BlockBatchBuilder(block_size=4, mask_token_id=MASK, block_convention=ANCHOR)
    batch = builder.collate([s1, s2])
    assert batch.context_features_1TF.shape == (1, 8, 8)
    assert batch.context_seq_id_T.tolist() == [0] * 5 + [1] * 3
    assert batch.context_positions_1T[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.block_seq_id_B.tolist() == [0, 0, 0, 1, 1]
    groups = list(builder.group_by_tokens([s1, s2, s1], token_budget=8))
    assert [len(g) for g in groups] == [2, 1]
    assert len(list(builder.batches([s3, s1, s2], epoch=0, token_budget=100))) == 1
    with pytest.raises(ValueError, match="token_budget"):
        list(builder.group_by_tokens([s1], 0))
    bad = synthetic("bad", [1, 2, 3], [1, 1, 1])
    bad.final_hidden = bad.final_hidden[:2]
    with pytest.raises(ValueError, match="final_hidden"):
        builder.collate([bad])


def test_packed_mask_rule():
    ctx_seq = torch.tensor([0, 0, 0, 1, 1])
    ctx_pos = torch.tensor([0, 1, 2, 0, 1])
    mask = packed_block_mask(ctx_seq, ctx_pos, torch.tensor([0, 1]), torch.tensor([2, 1]), block_size=2)
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    cached = cached_block_mask(torch.tensor([[True, False, True]]), 2)
    assert cached.shape == (1, 1, 2, 5) and cached[0, 0, 1].tolist() == [True, False, True, True, True]
