"""Eagle3 drafter: TTT own-hidden recursion and mask, packing, train/serve parity, reduced vocab and its
save/load."""

from __future__ import annotations

import pytest
import torch

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.decoding.sampling import SamplingParams, draft_sampler
from deepspec.drafters.build import build_drafter, load_drafter
from deepspec.drafters.chain.batching import (
    collate_autoregressive,
    labels_at_shift,
    packed_causal_mask,
    shift_within_sequence,
)
from deepspec.drafters.draft_vocab import build_draft_vocab, kept_target_ids
from deepspec.drafters.eagle3.config import Eagle3Config
from deepspec.targets.features import capture_features
from deepspec.training.objective import compute_training_loss

from .conftest import make_chain_samples

LAYER_IDS = [0, 1, 2]
GREEDY = draft_sampler(SamplingParams(temperature=0.0))


def sample_at_t1(generator):
    return draft_sampler(SamplingParams(temperature=1.0), generator)


def make_samples(target, lengths, layer_ids=LAYER_IDS, seed=0, prompt_len=3):
    return make_chain_samples(target, lengths, layer_ids, seed=seed, prompt_len=prompt_len)


def one_row_batch(sample, layer_ids=LAYER_IDS):
    return collate_autoregressive([sample], cache_layer_ids=layer_ids, feature_layer_ids=layer_ids,
                                  max_tokens_per_row=sample.length)


def build(target, **overrides):
    torch.manual_seed(0)
    settings = {"target_layer_ids": LAYER_IDS, "ttt_steps": 3}
    settings.update(overrides)
    return build_drafter("eagle3", target, **settings).eval()


def ttt(drafter, batch, num_steps=None):
    return drafter.ttt_forward(batch.input_ids_BT, batch.features_BTF, batch.sequence_ids_BT, batch.position_ids_BT,
                               num_steps)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_shapes_and_objective_per_family(family, request):
    target = request.getfixturevalue(family)
    drafter = build(target, draft_vocab_size=512)
    samples = make_samples(target, [12, 9])
    batch = collate_autoregressive(samples, cache_layer_ids=LAYER_IDS, feature_layer_ids=LAYER_IDS,
                                   max_tokens_per_row=32)
    steps = ttt(drafter, batch)
    assert len(steps) == 3 and all(h.shape == (1, 21, 64) for h in steps)
    assert drafter.midlayer.self_attn.q_proj.in_features == 128  # [embedding; hidden]
    result = compute_training_loss(drafter, batch)
    assert torch.isfinite(result.loss.total)
    assert sorted(set(result.position_index_N.tolist())) == [0, 1, 2]
    assert result.terms.num_rows == result.position_index_N.shape[0] == result.block_index_N.shape[0]
    # Step s at row t >= 0 predicts x[t+2+s], supervised when t+2+s is a response position in [3, L-1].
    counts = torch.bincount(result.position_index_N, minlength=3).tolist()
    assert counts == [sum(length - max(3, 2 + s) for length in (12, 9)) for s in range(3)]


def test_step_uses_its_own_previous_hidden(tiny_llama):
    """Reconstruct step 1 by hand: keys = step-0 keys (causal) + own key; hidden input = step-0 output."""
    drafter = build(tiny_llama)
    batch = one_row_batch(make_samples(tiny_llama, [10])[0])
    steps = ttt(drafter, batch, 2)
    ids_T, num_tokens = batch.input_ids_BT[0], batch.input_ids_BT.shape[1]
    positions_1T = batch.position_ids_BT
    embed = drafter.target_parts.embed
    with torch.no_grad():
        cache = DraftKVCache()
        causal = packed_causal_mask(batch.sequence_ids_BT)
        shifted1 = torch.cat([ids_T[1:], ids_T.new_zeros(1)])[None]
        step0 = drafter.layer_forward(embed(shifted1), drafter.fuse_features(batch.features_BTF), positions_1T, causal,
                                      cache)
        torch.testing.assert_close(step0, steps[0], rtol=0, atol=1e-6)
        shifted2 = torch.cat([ids_T[2:], ids_T.new_zeros(2)])[None]
        eye = torch.eye(num_tokens, dtype=torch.bool)[None, None]
        mask = torch.cat([causal, eye], dim=-1)
        own = drafter.layer_forward(embed(shifted2), step0, positions_1T + 1, mask, cache)
        torch.testing.assert_close(own, steps[1], rtol=0, atol=1e-6)
        # Feeding the target's feature of the next position instead (the non-TTT input) gives another result.
        cache.crop(num_tokens)
        fused_next = drafter.fuse_features(torch.cat([batch.features_BTF[:, 1:], batch.features_BTF[:, -1:]], 1))
        other = drafter.layer_forward(embed(shifted2), fused_next, positions_1T + 1, mask, cache)
        assert (other - steps[1]).abs().max() > 1e-3


@pytest.mark.float_exact
def test_feature_perturbation_reaches_step1_only_through_own_hidden(tiny_llama):
    drafter = build(tiny_llama)
    batch = one_row_batch(make_samples(tiny_llama, [10])[0])
    t = 4
    base = [h.detach() for h in ttt(drafter, batch, 2)]
    batch.features_BTF[0, t + 1] += 1.0  # the feature a drafter without TTT would use to predict x[t+3]
    moved = [h.detach() for h in ttt(drafter, batch, 2)]
    assert (moved[0][0, t + 1] - base[0][0, t + 1]).abs().max() > 1e-3  # step 0 sees it at row t+1
    torch.testing.assert_close(moved[1][0, : t + 1], base[1][0, : t + 1], rtol=0, atol=0)  # step 1 row t does not
    batch.features_BTF[0, t + 1] -= 1.0
    batch.features_BTF[0, t] += 1.0  # row t's own feature: step 0 there, and step 1 there via its own hidden
    moved = [h.detach() for h in ttt(drafter, batch, 2)]
    assert (moved[0][0, t] - base[0][0, t]).abs().max() > 1e-3
    assert (moved[1][0, t] - base[1][0, t]).abs().max() > 1e-3
    torch.testing.assert_close(moved[1][0, :t], base[1][0, :t], rtol=0, atol=0)
    # Gradient form of the same statement: d step1[t] / d features[t+1:] == 0.
    feats = batch.features_BTF.clone().requires_grad_(True)
    steps = drafter.ttt_forward(batch.input_ids_BT, feats, batch.sequence_ids_BT, batch.position_ids_BT, 2)
    steps[1][0, t].sum().backward()
    assert feats.grad[0, t + 1:].abs().max() == 0 and feats.grad[0, t].abs().max() > 0


def test_packing_equals_separate_sequences(tiny_qwen3):
    drafter = build(tiny_qwen3)
    samples = make_samples(tiny_qwen3, [9, 7, 5])
    packed = collate_autoregressive(samples, cache_layer_ids=LAYER_IDS, feature_layer_ids=LAYER_IDS,
                                    max_tokens_per_row=16)
    assert packed.input_ids_BT.shape == (2, 16)
    assert packed.padded_fraction == pytest.approx(1 - 21 / 32)
    packed_steps = ttt(drafter, packed)
    for index, sample in enumerate(samples):
        alone = ttt(drafter, one_row_batch(sample))
        where = packed.sequence_ids_BT == index
        for step in range(3):
            torch.testing.assert_close(packed_steps[step][where], alone[step][0], rtol=1e-5, atol=1e-5)
    # Padded (one sample per row) collation gives the same losses as packing.
    padded = collate_autoregressive(samples, cache_layer_ids=LAYER_IDS, feature_layer_ids=LAYER_IDS,
                                    max_tokens_per_row=16, pack=False)
    assert padded.input_ids_BT.shape == (3, 9)
    loss_packed = compute_training_loss(drafter, packed).loss.total
    loss_padded = compute_training_loss(drafter, padded).loss.total
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)


@pytest.mark.float_exact
def test_feature_subset_of_cached_layers(tiny_llama):
    cached = [0, 1, 2]
    sample = make_samples(tiny_llama, [8], layer_ids=cached)[0]
    batch = collate_autoregressive([sample], cache_layer_ids=cached, feature_layer_ids=[2, 0], max_tokens_per_row=8)
    direct = capture_features(tiny_llama.model, sample.input_ids[None], None, [2, 0]).features_BTF
    torch.testing.assert_close(batch.features_BTF, direct, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"feature_layer_ids\[0\]=3"):
        collate_autoregressive([sample], cache_layer_ids=cached, feature_layer_ids=[3], max_tokens_per_row=8)


def test_propose_matches_ttt_under_teacher_forcing(tiny_gemma3):
    """Inference chain with its KV cache = training TTT at the last committed row (train/serve parity)."""
    drafter = build(tiny_gemma3, ttt_steps=4, draft_vocab_size=700)
    sample = make_samples(tiny_gemma3, [14])[0]
    steps = ttt(drafter, one_row_batch(sample))
    ids = sample.input_ids
    n = 8  # rows 0..n-1 committed (features f_0..f_{n-1}, next tokens x_1..x_n)
    seen = []

    def forced(logits_BV, k):
        seen.append(logits_BV)
        return ids[n + 1 + k].expand(1), torch.softmax(logits_BV, -1)

    # Commit in two rounds to exercise the cache crop; drafts of round one are discarded.
    state = drafter.new_decode_state()
    drafter.propose(state, sample.features[None, :5], ids[None, 1:6], GREEDY, num_draft=2)
    assert state.cache.get_seq_length() == 5
    draft = drafter.propose(state, sample.features[None, 5:n], ids[None, 6:n + 1], forced, num_draft=4)
    assert state.num_committed == n and state.cache.get_seq_length() == n
    for k in range(4):
        expected = drafter.target_vocab_logits(steps[k][0, n - 1])
        kept = torch.isfinite(expected)
        torch.testing.assert_close(seen[k][0][kept], expected[kept], rtol=1e-5, atol=1e-5)
    assert draft.probs_BKV.shape == (1, 4, drafter.config.target_vocab_size)
    assert draft.token_ids_BK[0].tolist() == ids[n + 1: n + 5].tolist()


def test_reduced_vocab_proposals_in_target_vocab(tiny_llama):
    drafter = build(tiny_llama, draft_vocab_size=300)
    samples = make_samples(tiny_llama, [12, 10])
    d2t, t2d = build_draft_vocab(samples, 300, vocab_size=drafter.config.target_vocab_size, always_keep=[0, 1, 2])
    drafter.set_draft_vocab(d2t, t2d)
    kept = kept_target_ids(d2t)
    torch.testing.assert_close(drafter.lm_head.weight, drafter.target_parts.lm_head_weight[kept])
    sample = samples[0]
    gen = torch.Generator().manual_seed(3)
    next_ids = torch.cat([sample.input_ids[1:], sample.input_ids[:1]])[None]
    draft = drafter.propose(drafter.new_decode_state(), sample.features[None], next_ids, sample_at_t1(gen), num_draft=5)
    assert bool(t2d[draft.token_ids_BK].all())
    probs = draft.probs_BKV[0]
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert probs[:, ~t2d].abs().max() == 0
    again = drafter.propose(drafter.new_decode_state(), sample.features[None], next_ids,
                            sample_at_t1(torch.Generator().manual_seed(3)), num_draft=5)
    assert torch.equal(again.token_ids_BK, draft.token_ids_BK)
    greedy = drafter.propose(drafter.new_decode_state(), sample.features[None], next_ids, GREEDY, num_draft=3)
    assert greedy.probs_BKV is None and bool(t2d[greedy.token_ids_BK].all())


def test_full_vocab_uses_frozen_target_head(tiny_llama):
    drafter = build(tiny_llama)
    assert drafter.lm_head is None and drafter.draft_head_weight() is drafter.target_parts.lm_head_weight
    assert "lm_head.weight" not in drafter.state_dict()


@pytest.mark.float_exact
def test_save_load_round_trip(tiny_llama, tmp_path):
    drafter = build(tiny_llama, draft_vocab_size=256)
    samples = make_samples(tiny_llama, [12])
    d2t, t2d = build_draft_vocab(samples, 256, vocab_size=drafter.config.target_vocab_size, always_keep=[2])
    drafter.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        drafter.lm_head.weight.normal_()  # trained head must be loaded, not re-initialised from the target
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny_llama).eval()
    assert isinstance(loaded.config, Eagle3Config) and loaded.config.ttt_steps == 3
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)
    batch = one_row_batch(samples[0])
    for a, b in zip(ttt(drafter, batch), ttt(loaded, batch)):
        torch.testing.assert_close(loaded.draft_logits(b), drafter.draft_logits(a), rtol=0, atol=0)


def test_config_validation(tiny_llama):
    with pytest.raises(ValueError, match="exactly one draft layer"):
        build(tiny_llama, num_draft_layers=2)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build(tiny_llama, draft_vocab_size=10**6)
    with pytest.raises(ValueError, match="ttt_steps"):
        build(tiny_llama, ttt_steps=0)
    with pytest.raises(ValueError, match=r"target_layer_ids\[0\]=3"):
        build(tiny_llama, target_layer_ids=[3])


def test_shifts_and_labels_never_cross_sequences():
    ids = torch.tensor([[10, 11, 12, 20, 21, 0]])
    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    mask = torch.tensor([[False, True, True, False, True, False]])
    shifted, same = shift_within_sequence(ids, seq, 1, 0)
    assert shifted.tolist() == [[11, 12, 0, 21, 0, 0]] and same.tolist() == [[True, True, False, True, False, False]]
    # Label x[t+2] only where it is an assistant token of the same sequence.
    assert labels_at_shift(ids, mask, seq, 2).tolist() == [[12, -100, -100, -100, -100, -100]]
    assert labels_at_shift(ids, mask, seq, 1).tolist() == [[11, 12, -100, 21, -100, -100]]
    with pytest.raises(ValueError, match="shift"):
        shift_within_sequence(ids, seq, -1, 0)
