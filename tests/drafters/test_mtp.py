"""MTP drafter: label alignment (module k predicts x[t+k+1]), chaining, NextN names, train/serve parity."""

from __future__ import annotations

import pytest
import torch

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.decoding.sampling import SamplingParams, draft_sampler
from deepspec.drafters.build import build_drafter
from deepspec.drafters.chain.batching import (
    collate_autoregressive,
    packed_causal_mask,
)
from deepspec.drafters.mtp.config import MTPLoss
from deepspec.training.objective import compute_training_loss

from .conftest import make_chain_samples


def make_samples(target, lengths, seed=0, prompt_len=3):
    return make_chain_samples(target, lengths, seed=seed, prompt_len=prompt_len)


def batch_of(samples, row=32):
    return collate_autoregressive(samples, cache_layer_ids=[], feature_layer_ids=[], max_tokens_per_row=row)


def build(target, **overrides):
    torch.manual_seed(0)
    settings = {"target_layer_ids": [], "num_mtp_modules": 2}
    settings.update(overrides)
    return build_drafter("mtp", target, **settings).eval()


def chain(drafter, batch):
    return drafter.chain_forward(batch.input_ids_BT, batch.final_hidden_BTH, batch.sequence_ids_BT,
                                 batch.position_ids_BT)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_shapes_and_nextn_names(family, request):
    target = request.getfixturevalue(family)
    drafter = build(target)
    names = set(drafter.state_dict())
    for k in range(2):
        for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert f"mtp_layers.{k}.{key}" in names
    assert drafter.mtp_layers[0].eh_proj.in_features == 128
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the frozen target
    samples = make_samples(target, [11, 8])
    outs = chain(drafter, batch_of(samples))
    assert [h.shape for h in outs] == [(1, 19, 64)] * 2
    assert torch.isfinite(compute_training_loss(drafter, batch_of(samples)).loss.total)


def test_module_k_predicts_t_plus_k_plus_1(tiny_llama):
    drafter = build(tiny_llama)
    sample = make_samples(tiny_llama, [12])[0]
    batch = batch_of([sample], 12)
    result = compute_training_loss(drafter, batch)
    outs = chain(drafter, batch)
    ids = sample.input_ids
    for index in range(2):
        k = index + 1
        rows = result.block_index_N[result.position_index_N == index]
        # Supervised rows: labels x[t+k+1] at response positions 3..11.
        assert rows.tolist() == list(range(max(0, 3 - k - 1), 12 - k - 1))
        logits = drafter.module_logits(index, outs[index][0, rows])
        expected_ce = torch.nn.functional.cross_entropy(logits, ids[rows + k + 1], reduction="none")
        torch.testing.assert_close(result.terms.ce_N[result.position_index_N == index], expected_ce,
                                   rtol=1e-5, atol=1e-5)
        # KL target: the target's own distribution for x[t+k+1] comes from its final hidden at t+k.
        p_t = torch.softmax(drafter.target_parts.logits(sample.final_hidden[rows + k]), -1)
        soft_ce = -(p_t * torch.log_softmax(logits, -1)).sum(-1)
        torch.testing.assert_close(result.terms.soft_ce_N[result.position_index_N == index], soft_ce,
                                   rtol=1e-4, atol=1e-4)


def test_inputs_alignment_and_chaining(tiny_qwen3):
    drafter = build(tiny_qwen3)
    sample = make_samples(tiny_qwen3, [12])[0]
    batch = batch_of([sample], 12)
    base = [h.detach() for h in chain(drafter, batch)]
    # Changing token x[j] first affects module 1 at row j-1 (its input x[t+1]) and module 2 at row j-2.
    j = 7
    batch.input_ids_BT[0, j] = 5
    moved = [h.detach() for h in chain(drafter, batch)]
    changed = [torch.nonzero((m - b).abs().amax(-1)[0] > 1e-6).squeeze(1).tolist() for m, b in zip(moved, base)]
    assert changed[0][0] == j - 1 and changed[1][0] == j - 2
    batch.input_ids_BT[0, j] = sample.input_ids[j]
    # Module 2 = eh_proj([enorm(Emb(x[t+2])); hnorm(h^1_t)]) -> block: rebuilt from module 1's output.
    ids = sample.input_ids
    shifted2 = torch.cat([ids[2:], ids.new_zeros(2)])[None]
    with torch.no_grad():
        rebuilt = drafter.module_forward(1, drafter.target_parts.embed(shifted2), base[0], batch.position_ids_BT,
                                         packed_causal_mask(batch.sequence_ids_BT), DraftKVCache())
        torch.testing.assert_close(rebuilt, base[1], rtol=0, atol=1e-6)
        from_target = drafter.module_forward(1, drafter.target_parts.embed(shifted2), batch.final_hidden_BTH,
                                             batch.position_ids_BT, packed_causal_mask(batch.sequence_ids_BT),
                                             DraftKVCache())
        assert (from_target - base[1]).abs().max() > 1e-3


@pytest.mark.parametrize("rounds", [[9], [4, 5], [2, 3, 4]])
def test_propose_matches_training_chain(tiny_llama, rounds):
    """Teacher-forced drafts over several commit rounds equal the training forward at the newest row."""
    drafter = build(tiny_llama, num_mtp_modules=3)
    sample = make_samples(tiny_llama, [14])[0]
    outs = chain(drafter, batch_of([sample], 14))
    ids, n = sample.input_ids, sum(rounds)
    state, start = drafter.new_decode_state(), 0
    for size in rounds:
        seen: list[torch.Tensor] = []

        def forced(logits_BV, k, end=start + size, seen=seen):
            seen.append(logits_BV)
            return ids[end + 1 + k].expand(1), None

        draft = drafter.propose(state, sample.final_hidden[None, start:start + size],
                                ids[None, start + 1:start + size + 1], forced)
        start += size
    assert state.num_committed == [n, n - 1, n - 2]
    assert [c.get_seq_length() for c in state.caches] == [n, n - 1, n - 2]
    for index in range(3):
        torch.testing.assert_close(seen[index][0], drafter.module_logits(index, outs[index][0, n - 1]),
                                   rtol=1e-5, atol=1e-5)
    assert draft.token_ids_BK[0].tolist() == ids[n + 1:n + 4].tolist() and draft.probs_BKV is None


def test_recursive_extension_beyond_d(tiny_llama):
    drafter = build(tiny_llama, num_mtp_modules=1)
    sample = make_samples(tiny_llama, [10])[0]
    greedy_sampler = draft_sampler(SamplingParams(temperature=0.0))
    state = drafter.new_decode_state()
    draft = drafter.propose(state, sample.final_hidden[None, :6], sample.input_ids[None, 1:7], greedy_sampler,
                            num_draft=4)
    assert draft.token_ids_BK.shape == (1, 4)
    assert state.caches[0].get_seq_length() == 6  # speculative keys cropped
    # The first draft is module 1 at the newest row; later ones re-apply it on its own hidden.
    outs = chain(drafter, batch_of([sample], 10))
    assert draft.token_ids_BK[0, 0] == drafter.module_logits(0, outs[0][0, 5]).argmax()
    short = drafter.propose(drafter.new_decode_state(), sample.final_hidden[None, :6], sample.input_ids[None, 1:7],
                            greedy_sampler)
    assert short.token_ids_BK.shape == (1, 1) and short.token_ids_BK[0, 0] == draft.token_ids_BK[0, 0]


def test_init_from_target_copies_last_layer_and_final_norm(tiny_qwen3):
    drafter = build(tiny_qwen3, init_from_target=True)
    target_layer = tiny_qwen3.model.model.layers[-1]
    for block in drafter.mtp_layers:
        assert torch.equal(block.self_attn.q_proj.weight, target_layer.self_attn.q_proj.weight)
        assert torch.equal(block.mlp.up_proj.weight, target_layer.mlp.up_proj.weight)
        assert torch.equal(block.shared_head.norm.weight, tiny_qwen3.model.model.norm.weight)
        assert block.self_attn.q_proj.weight.data_ptr() != target_layer.self_attn.q_proj.weight.data_ptr()


def test_config_validation(tiny_llama):
    with pytest.raises(ValueError, match="num_mtp_modules"):
        build(tiny_llama, num_mtp_modules=0)
    with pytest.raises(ValueError, match="module_loss_weight"):
        MTPLoss(module_loss_weight=0.0)
