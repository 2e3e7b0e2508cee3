"""Packed training attention of block drafters without the dense [N, T + N] mask: the segmented path (CPU
default) and flex attention with a BlockMask (CUDA default; eager on CPU here) equal the dense-mask reference
to float32 rounding, values and gradients, on packed batches of several sequences and families."""

from __future__ import annotations

import pytest
import torch

from deepspec.cache.memory import capture_samples
from deepspec.drafters.block import attention
from deepspec.drafters.block.attention import PackedBlocks, packed_block_mask
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.build import build_drafter

LAYER_IDS = [0, 1, 2]


def packed_batch(target, drafter, lengths=(23, 9, 17), anchors=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(20, 1000, (n,), generator=g).tolist() for n in lengths]
    samples = capture_samples(target, ids, LAYER_IDS)
    builder = BlockBatchBuilder.for_drafter(drafter.config, anchors, seed)
    return builder.collate(samples)


def hidden_in_mode(drafter, batch, mode):
    drafter.config.training_attention = mode
    try:
        return drafter.block_hidden(batch)
    finally:
        drafter.config.training_attention = "auto"


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_segmented_equals_dense_values_and_gradients(tiny_target, monkeypatch, softcap):
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_target, num_draft_layers=2, markov_rank=8, block_size=5,
                            target_layer_ids=LAYER_IDS).train()
    if softcap:  # the explicit-scores path (Gemma 2-style attention soft-capping)
        for layer in drafter.backbone.layers:
            layer.self_attn.attn_logit_softcapping = softcap
    monkeypatch.setattr(attention, "SEGMENT_ROWS", 10)  # two blocks per segment: many segments, ragged last one
    batch = packed_batch(tiny_target, drafter)
    params = list(drafter.backbone.parameters())  # what the attention layout reaches (the heads come after)
    results = {}
    for mode in ("dense", "segmented"):
        hidden_NH = hidden_in_mode(drafter, batch, mode)
        loss = (hidden_NH * torch.linspace(-1, 1, hidden_NH.shape[-1])).square().sum()
        results[mode] = (hidden_NH.detach(), torch.autograd.grad(loss, params))
    torch.testing.assert_close(results["segmented"][0], results["dense"][0], rtol=1e-5, atol=1e-5)
    # Gradients to float32 rounding of their own scale (both paths sit ~5e-7 of it from a float64 run).
    for a, b in zip(results["segmented"][1], results["dense"][1]):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex attention on CPU warns that it is slow
def test_flex_block_mask_equals_dense(tiny_target):
    """flex attention (eager on CPU: forward only, CPU flex has no backward) with the BlockMask of the rule."""
    torch.manual_seed(1)
    drafter = build_drafter("dflash", tiny_target, num_draft_layers=2, block_size=4, target_layer_ids=LAYER_IDS).eval()
    batch = packed_batch(tiny_target, drafter, lengths=(30, 11))
    with torch.no_grad():
        dense = hidden_in_mode(drafter, batch, "dense")
        flex = hidden_in_mode(drafter, batch, "flex")
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_segments_see_exactly_the_rule_and_never_build_the_dense_mask(monkeypatch):
    monkeypatch.setattr(attention, "SEGMENT_ROWS", 6)  # two blocks of 3 per segment
    ctx_seq = torch.tensor([0] * 7 + [1] * 5)
    ctx_pos = torch.cat([torch.arange(7), torch.arange(5)])
    blk_seq = torch.tensor([0, 0, 0, 1, 1])
    anchors = torch.tensor([0, 5, 3, 4, 2])  # an anchor at 0 has no context at all; not sorted inside a sequence
    blocks = PackedBlocks(ctx_seq, ctx_pos, blk_seq, anchors, block_size=3)
    segments = blocks.segments()
    assert [(s.rows, s.keys) for s in segments] == [(slice(0, 6), slice(0, 5)), (slice(6, 9), slice(0, 3)),
                                                    (slice(9, 15), slice(7, 11))]
    assert "dense" not in blocks._built
    dense = packed_block_mask(ctx_seq, ctx_pos, blk_seq, anchors, 3)
    num_context = ctx_seq.shape[0]
    for segment in segments:
        rows = range(segment.rows.start, segment.rows.stop)
        expected = torch.cat([dense[segment.rows, segment.keys], dense[segment.rows][:, num_context:][:, segment.rows]],
                             dim=1)
        assert torch.equal(segment.mask_RK, expected)
        # Nothing the rule allows lies outside the gathered keys.
        outside = dense[list(rows)].clone()
        outside[:, segment.keys] = False
        outside[:, num_context + segment.rows.start:num_context + segment.rows.stop] = False
        assert not outside.any()


def test_non_contiguous_context_is_refused():
    blocks = PackedBlocks(torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]), torch.tensor([0]), torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="contiguous"):
        blocks.segments()


def test_training_attention_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="training_attention='sparse'"):
        build_drafter("dflash", tiny_llama, block_size=4, training_attention="sparse")
    assert attention.resolve_training_attention("auto", torch.device("cpu")) == "segmented"
    assert attention.resolve_training_attention("auto", torch.device("cuda")) == "flex"
    assert attention.resolve_training_attention("dense", torch.device("cuda")) == "dense"


def test_grouped_query_attention_saves_keys_and_values_once_per_key_value_head(tiny_qwen3):
    """A training attention call keeps its keys/values for backward at the key/value heads (SDPA's own grouped-
    query broadcast), not repeated for every query head: at Qwen3 widths (32 query over 8 key/value heads) the
    repeats were 4x the keys/values of every segment (2.2 GB of a Qwen3-4B step at 4,096 tokens x 512 anchors)."""
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, block_size=4,
                            target_layer_ids=LAYER_IDS).train()
    attn = drafter.backbone.layers[0].self_attn
    query_heads = drafter.config.target_text_config.num_attention_heads
    kv_heads = drafter.config.target_text_config.num_key_value_heads
    assert query_heads > kv_heads  # the tiny Qwen3 groups its query heads
    batch = packed_batch(tiny_qwen3, drafter)
    saved_heads = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_heads.append(t.shape) or t, lambda t: t):
        hidden_in_mode(drafter, batch, "segmented")
    layout = PackedBlocks(batch.context_seq_id_T, batch.context_positions_1T[0], batch.block_seq_id_B,
                          batch.anchor_positions_B, batch.block_size)
    key_lengths = {(seg.keys.stop - seg.keys.start) + (seg.rows.stop - seg.rows.start) for seg in layout.segments()}
    keys = [shape for shape in saved_heads
            if len(shape) == 4 and shape[-1] == attn.head_dim and shape[2] in key_lengths]
    assert keys and all(shape[1] == kv_heads for shape in keys), keys
