"""DFlash/DSpark with a reduced draft vocabulary: the head is the frozen target head's kept rows, DSpark's heads
live in draft-vocabulary space, the loss is exact through the cached log-normaliser, proposals map back to target
ids with the distribution they were drawn from (zeros outside), save/load keeps d2t/t2d."""

from __future__ import annotations

import math

import pytest
import torch

from deepspec.cache.memory import capture_samples
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.build import build_drafter, load_drafter
from deepspec.drafters.draft_vocab import build_draft_vocab, kept_target_ids
from deepspec.losses.distribution import IGNORE_INDEX
from deepspec.training.objective import compute_training_loss

LAYER_IDS = [0, 1, 2]
VOCAB_D = 40
KINDS = {"dspark": {"num_draft_layers": 1, "markov_rank": 8, "block_size": 4},
         "dspark-rnn": {"num_draft_layers": 1, "markov_rank": 8, "block_size": 4, "sequential_head": "rnn"},
         "dflash": {"num_draft_layers": 1, "block_size": 4}}


def token_lists(seed=0, num=2, length=24):
    g = torch.Generator().manual_seed(seed)
    # A small alphabet, so the draft vocabulary covers most (not all) of the labels.
    return [torch.randint(20, 80, (length,), generator=g).tolist() for _ in range(num)]


def reduced_drafter(target, label, samples, size=VOCAB_D, seed=0):
    torch.manual_seed(seed)
    kind = label.split("-")[0]
    drafter = build_drafter(kind, target, target_layer_ids=LAYER_IDS, draft_vocab_size=size, **KINDS[label])
    d2t, t2d = build_draft_vocab(samples, size, vocab_size=drafter.config.target_vocab_size, always_keep=[0, 1, 2])
    drafter.set_draft_vocab(d2t, t2d)
    return drafter


def batch_of(drafter, samples, anchors=8):
    return BlockBatchBuilder(drafter.config.block_size, drafter.config.mask_token_id, anchors, 0).collate(samples)


@pytest.fixture(scope="module")
def samples(tiny_qwen3):
    return capture_samples(tiny_qwen3, token_lists(), LAYER_IDS)


@pytest.mark.parametrize("label", sorted(KINDS))
def test_draft_head_is_the_target_head_restricted_and_adds_no_parameters(tiny_target, label):
    samples = capture_samples(tiny_target, token_lists(), LAYER_IDS)
    drafter = reduced_drafter(tiny_target, label, samples)
    torch.manual_seed(0)
    full = build_drafter(label.split("-")[0], tiny_target, target_layer_ids=LAYER_IDS, **KINDS[label])
    head_VH = tiny_target.model.get_output_embeddings().weight
    kept = kept_target_ids(drafter.d2t)
    assert torch.equal(drafter.draft_head_weight(), head_VH[kept])
    assert drafter.draft_head_weight().requires_grad is False and head_VH.requires_grad is False
    hidden_XH = torch.randn(5, head_VH.shape[1])
    torch.testing.assert_close(drafter.base_logits(hidden_XH), (hidden_XH @ head_VH.T)[:, kept], rtol=1e-5, atol=1e-5)
    # Backbone parameters are the same; only DSpark's W1 / W2 shrink to the draft vocabulary (W1 + one row).
    own = {n: tuple(p.shape) for n, p in drafter.named_parameters()}
    reference = {n: tuple(p.shape) for n, p in full.named_parameters()}
    assert own.keys() == reference.keys()
    for name, shape in own.items():
        if name.endswith("prev_embed.weight"):
            assert shape == (VOCAB_D + 1, drafter.config.markov_rank)
        elif name == "sequential.out.weight":
            assert shape == (VOCAB_D, drafter.config.markov_rank)
        else:
            assert shape == reference[name], name
    assert sum(map(math.prod, own.values())) < sum(map(math.prod, reference.values())) or label == "dflash"
    assert {"d2t", "t2d"} <= set(drafter.state_dict()) and "d2t" not in full.state_dict()


def test_full_vocabulary_keeps_the_target_head_itself(tiny_llama):
    drafter = build_drafter("dspark", tiny_llama, target_layer_ids=LAYER_IDS, **KINDS["dspark"])
    assert drafter.draft_head_weight() is tiny_llama.model.get_output_embeddings().weight
    ids = torch.tensor([3, 70, 4000])
    assert torch.equal(drafter.draft_rows(ids), ids)
    assert drafter.sequential.out.weight.shape[0] == drafter.config.target_vocab_size


def test_draft_rows_and_a_new_vocabulary(tiny_qwen3, samples):
    drafter = reduced_drafter(tiny_qwen3, "dspark", samples)
    kept = kept_target_ids(drafter.d2t)
    outside = torch.nonzero(~drafter.t2d).squeeze(1)[:4]
    assert torch.equal(drafter.draft_rows(kept), torch.arange(VOCAB_D))
    assert drafter.draft_rows(outside).tolist() == [VOCAB_D] * 4
    before = drafter.draft_head_weight().clone()
    d2t, t2d = build_draft_vocab(torch.arange(drafter.config.target_vocab_size).flip(0), VOCAB_D)  # the lowest ids
    drafter.set_draft_vocab(d2t, t2d)
    assert not torch.equal(drafter.draft_head_weight(), before)  # the derived gather follows d2t
    assert torch.equal(drafter.draft_head_weight(), drafter.target_parts.lm_head_weight[:VOCAB_D])
    assert drafter.draft_rows(torch.tensor([0, VOCAB_D - 1, VOCAB_D])).tolist() == [0, VOCAB_D - 1, VOCAB_D]


@pytest.mark.parametrize("label", sorted(KINDS))
def test_two_training_steps(tiny_qwen3, samples, label):
    """Two AdamW steps: finite loss and gradients on exactly the trainable parameters, the shared target
    untouched; labels outside the draft vocabulary stay supervised rows (TV, metrics) with CE 0."""
    drafter = reduced_drafter(tiny_qwen3, label, samples, size=20).train()  # leaves some labels outside
    batch = batch_of(drafter, samples)
    head_before = drafter.target_parts.lm_head_weight.clone()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        result = compute_training_loss(drafter, batch, with_metrics=True)
        assert math.isfinite(float(result.loss.total.detach()))
        result.loss.total.backward()
        for name, param in drafter.named_parameters():
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert torch.equal(drafter.target_parts.lm_head_weight, head_before)
    terms = result.terms
    outside_N = (batch.labels_N != IGNORE_INDEX) & ~drafter.t2d[batch.labels_N.clamp(min=0)]
    assert outside_N.any(), "some labels should fall outside the draft vocabulary"
    assert torch.equal(terms.valid_N, batch.labels_N != IGNORE_INDEX)
    assert (terms.ce_N[outside_N] == 0).all() and (terms.tv_N[outside_N] > 0).all()


def test_loss_terms_equal_the_full_vocabulary_computation(tiny_qwen3, samples):
    """The training TV equals the full-vocabulary TV of the zero-extended draft, row by row."""
    drafter = reduced_drafter(tiny_qwen3, "dspark", samples).eval()
    batch = batch_of(drafter, samples)
    with torch.no_grad():
        terms = compute_training_loss(drafter, batch, with_metrics=True).terms
        out = drafter(batch)
        head_VH = drafter.target_parts.lm_head_weight
        kept = kept_target_ids(drafter.d2t)
        bias_in, bias_out = out.bias
        p_kept = torch.softmax(out.hidden_NH @ head_VH[kept].T + bias_in @ bias_out, dim=-1)
        p_draft = torch.zeros(p_kept.shape[0], head_VH.shape[0]).index_copy(1, kept, p_kept)
        p_target = torch.softmax(batch.target_hidden_NH @ head_VH.T, dim=-1)
    torch.testing.assert_close(terms.tv_N, (p_draft - p_target).abs().sum(-1), rtol=1e-4, atol=1e-5)


def test_a_cache_without_the_log_normaliser_is_refused(tiny_qwen3, samples):
    from dataclasses import replace

    drafter = reduced_drafter(tiny_qwen3, "dflash", samples)
    batch = batch_of(drafter, [replace(s, target_lse=None) for s in samples])
    assert batch.target_lse_N is None
    with pytest.raises(ValueError, match="log-normaliser.*draft_vocab_size=null"):
        compute_training_loss(drafter, batch)
    torch.manual_seed(0)
    full = build_drafter("dflash", tiny_qwen3, target_layer_ids=LAYER_IDS, **KINDS["dflash"])
    assert math.isfinite(float(compute_training_loss(full, batch).loss.total.detach()))  # the full head needs none


@pytest.mark.parametrize("label", ["dspark", "dspark-rnn", "dflash"])
def test_propose_maps_draft_ids_and_hands_over_zero_extended_probs(tiny_qwen3, samples, label):
    drafter = reduced_drafter(tiny_qwen3, label, samples).eval()
    if drafter.sequential is not None:
        with torch.no_grad():  # a strong sequential bias, so slot k visibly depends on the sampled x_{k-1}
            drafter.sequential.out.weight.normal_(0, 3.0)
    sample = samples[0]
    num = 12
    cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None, :num], torch.arange(num)[None])
    anchor_ids, anchor_pos = sample.input_ids[[num - 1]], torch.tensor([num - 1])
    kept = kept_target_ids(drafter.d2t)
    generator = torch.Generator().manual_seed(0)

    def sampled(logits_BV, slot):
        probs = torch.softmax(logits_BV, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs

    proposal = drafter.propose(cache, anchor_ids, anchor_pos, sampled)
    greedy = drafter.propose(cache, anchor_ids, anchor_pos, lambda logits, slot: (logits.argmax(-1), None))
    assert torch.isin(proposal.token_ids_BK, kept).all() and torch.isin(greedy.token_ids_BK, kept).all()
    probs = proposal.probs_BKV[0]
    assert probs.shape == (4, drafter.config.target_vocab_size)
    assert (probs[:, ~drafter.t2d] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    # Slot k by hand: the kept rows of the head plus the bias of the SAMPLED previous token's row.
    with torch.no_grad():
        hidden = drafter.draft_hidden(cache, anchor_ids, anchor_pos)
        base = hidden[0] @ drafter.target_parts.lm_head_weight[kept].T
        head = drafter.sequential
        state = None if head is None else head.init_state(1, hidden)
        prev = anchor_ids
        for k in range(4):
            logits = base[k]
            if head is not None:
                bias_in, state = head.step(state, hidden[:, k], drafter.draft_rows(prev))
                logits = logits + (bias_in @ head.bias_out_RV)[0]
            torch.testing.assert_close(probs[k, kept], torch.softmax(logits, -1), rtol=1e-5, atol=1e-6)
            prev = proposal.token_ids_BK[:, k]


def test_sampled_tokens_follow_the_handed_over_distribution(tiny_qwen3, samples):
    """In law: over many rows of one context, slot 0's tokens follow probs_BKV[:, 0] and slot 1's, given the
    sampled slot-0 token, follow probs_BKV[:, 1] of that row (chi-square, 6-sigma bounds)."""
    from deepspec.decoding.sampling import SamplingParams, draft_sampler

    drafter = reduced_drafter(tiny_qwen3, "dspark", samples, size=12).eval()
    with torch.no_grad():
        drafter.sequential.out.weight.normal_(0, 2.0)
    rows, num = 6000, 10
    sample = samples[0]
    cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None, :num].expand(rows, -1, -1),
                                   torch.arange(num).expand(rows, -1))
    proposal = drafter.propose(cache, sample.input_ids[num - 1].expand(rows), torch.full((rows,), num - 1),
                               draft_sampler(SamplingParams(temperature=1.0), torch.Generator().manual_seed(5)))
    tokens, probs = proposal.token_ids_BK, proposal.probs_BKV
    kept = kept_target_ids(drafter.d2t)

    def assert_law(tokens_R, probs_V):
        counts = torch.bincount(tokens_R, minlength=probs_V.shape[0])[kept].double()
        expected = probs_V[kept].double() * tokens_R.shape[0]
        sigma = (expected * (1 - probs_V[kept].double())).sqrt()
        assert ((counts - expected).abs() <= 6 * sigma + 1e-9).all()
        live = expected > 5
        chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
        dof = int(live.sum()) - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof)

    assert torch.allclose(probs[:, 0], probs[:1, 0].expand_as(probs[:, 0]), atol=1e-6)  # same context, same law
    assert_law(tokens[:, 0], probs[0, 0])
    first = int(torch.mode(tokens[:, 0]).values)
    given = tokens[:, 0] == first
    assert_law(tokens[given, 1], probs[given.nonzero()[0, 0], 1])


@pytest.mark.float_exact
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_save_load_round_trip(tiny_gemma3, tmp_path, kind):
    samples = capture_samples(tiny_gemma3, token_lists(1), LAYER_IDS)
    drafter = reduced_drafter(tiny_gemma3, kind, samples).eval()
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny_gemma3).eval()
    assert loaded.config.draft_vocab_size == VOCAB_D
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    batch = batch_of(drafter, samples)
    with torch.no_grad():
        a, b = drafter(batch), loaded(batch)
    assert torch.equal(drafter.base_logits(a.hidden_NH), loaded.base_logits(b.hidden_NH))
