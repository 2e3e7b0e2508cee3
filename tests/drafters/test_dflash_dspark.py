"""DFlash/DSpark block drafter: attention isolation, equivalences, inference parity (what every kind is tested for,
build, training step, save/load, decoding and export, is tests/drafters/test_every_kind.py)."""

from __future__ import annotations

import pytest
import torch

from deepspec.cache.memory import capture_samples
from deepspec.cache.reader import CachedSample
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.build import build_drafter, load_drafter
from deepspec.drafters.dflash.config import DFlashConfig
from deepspec.drafters.dspark.config import DSparkConfig

LAYER_IDS = [0, 1, 2]
SMALL = {"num_draft_layers": 2, "markov_rank": 8, "target_layer_ids": LAYER_IDS}


def make_samples(target, id_lists, layer_ids, prompt_len: int = 2):
    """CachedSamples from capture_features on `target`; the first `prompt_len` tokens are prompt."""
    masks = [[i >= prompt_len for i in range(len(ids))] for ids in id_lists]
    return capture_samples(target, id_lists, layer_ids, masks)


def random_ids(num_seqs: int, length: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(20, vocab, (length,), generator=g).tolist() for _ in range(num_seqs)]


@pytest.fixture(scope="module")
def family_setup(tiny_target):
    target = tiny_target
    torch.manual_seed(0)
    drafter = build_drafter("dspark", target, **SMALL).eval()
    samples = make_samples(target, random_ids(2, 20), LAYER_IDS)
    return target, drafter, samples


def builder(drafter, max_anchors=6, seed=0):
    return BlockBatchBuilder.for_drafter(drafter.config, max_anchors, seed)


def block_logits(drafter, batch):
    out = drafter(batch)
    logits = drafter.base_logits(out.hidden_NH)
    if out.bias is not None:
        logits = logits + out.bias[0] @ out.bias[1]
    return logits.view(-1, batch.num_drafts, logits.shape[-1])


def test_config_validation(tiny_llama):
    with pytest.raises(ValueError, match="block_size"):
        build_drafter("dspark", tiny_llama, block_size=3, **SMALL)
    with pytest.raises(ValueError, match="sequential_head"):
        build_drafter("dspark", tiny_llama, sequential_head="lstm", **SMALL)
    with pytest.raises(ValueError, match="sequential_head"):
        DFlashConfig(sequential_head="markov")
    with pytest.raises(ValueError, match="confidence_head"):
        DFlashConfig(confidence_head=True)
    with pytest.raises(ValueError, match="target_layer_ids"):
        build_drafter("dspark", tiny_llama, num_draft_layers=1, target_layer_ids=[3])
    assert DSparkConfig().block_size == 7
    # SmolLM2: the highest special token not used by the chat template (<empty_output>).
    drafter = build_drafter("dflash", tiny_llama, **{k: v for k, v in SMALL.items() if k != "markov_rank"})
    assert drafter.config.mask_token_id == 16
    assert drafter.sequential is None and drafter.confidence is None


@pytest.mark.float_exact
def test_attention_isolation(family_setup):
    """Changing context after the anchor or another block's tokens leaves a block's logits unchanged."""
    _, drafter, samples = family_setup
    with torch.no_grad():
        batch = builder(drafter).collate(samples[:1])
        reference = block_logits(drafter, batch)
        first_anchor = int(batch.anchor_positions_B[0])
        changed = builder(drafter).collate(samples[:1])
        later_features = changed.context_features_1TF[0, first_anchor:]
        later_features += torch.randn_like(later_features)
        changed.block_input_ids_1S[0, batch.block_size:] = 7  # every other block's tokens
        after = block_logits(drafter, changed)
        assert torch.equal(after[0], reference[0])
        # Sanity: context before the anchor does matter.
        if first_anchor > 0:
            changed.context_features_1TF[0, :first_anchor] += 1.0
            assert not torch.allclose(block_logits(drafter, changed)[0], reference[0])
        # Another sequence packed next to it changes nothing either (up to float32 summation order:
        # more keys change SDPA's reduction blocking, not the set of attended keys).
        packed = builder(drafter).collate(samples)
        torch.testing.assert_close(block_logits(drafter, packed)[: reference.shape[0]], reference, rtol=0, atol=1e-5)


@pytest.mark.float_exact
def test_dflash_equals_dspark_without_heads(tiny_qwen3):
    samples = make_samples(tiny_qwen3, random_ids(1, 16), LAYER_IDS)
    dspark = build_drafter("dspark", tiny_qwen3, sequential_head="none", confidence_head=False,
                           block_convention="mask-predicts", **SMALL).eval()
    dflash = build_drafter("dflash", tiny_qwen3, **SMALL).eval()
    dflash.load_state_dict(dspark.state_dict())
    batch = builder(dspark).collate(samples)
    with torch.no_grad():
        assert torch.equal(block_logits(dspark, batch), block_logits(dflash, batch))
    assert set(dspark.state_dict()) == set(dflash.state_dict())


@pytest.mark.float_exact
def test_markov_bias_uses_ground_truth_previous_token(family_setup):
    _, drafter, samples = family_setup
    batch = builder(drafter).collate(samples[:1])
    ids = samples[0].input_ids
    anchors = batch.anchor_positions_B
    expected_prev = ids[(anchors[:, None] + torch.arange(batch.block_size)).clamp(max=len(ids) - 1)].flatten()
    assert torch.equal(batch.prev_ids_N, expected_prev)
    with torch.no_grad():
        out = drafter(batch)
        expected_bias_NV = drafter.sequential.prev_embed.weight[expected_prev] @ drafter.sequential.out.weight.T
        torch.testing.assert_close(out.bias[0] @ out.bias[1], expected_bias_NV, rtol=0, atol=0)


def test_inference_draft_hidden_equals_training(family_setup):
    """Context K/V from the cache + one parallel block forward == the packed training forward."""
    _, drafter, samples = family_setup
    sample = samples[0]
    batch = builder(drafter, max_anchors=20).collate([sample])
    with torch.no_grad():
        train_hidden_BGH = drafter(batch).hidden_NH.view(-1, batch.block_size, drafter.config.hidden_size)
        cache = drafter.new_decode_state()
        num_tokens = sample.input_ids.shape[0]
        # Extend the cache in two pieces, as decoding would, then crop a rejected tail away and re-add it.
        drafter.extend_context(cache, sample.features[None, :9], torch.arange(9)[None])
        drafter.extend_context(cache, sample.features[None, 9:], torch.arange(9, num_tokens)[None])
        cache.crop(12)
        drafter.extend_context(cache, sample.features[None, 12:], torch.arange(12, num_tokens)[None])
        anchors = batch.anchor_positions_B
        hidden_BGH = drafter.draft_hidden(cache, sample.input_ids[anchors], anchors)
        # Not one computation: the cache grew in pieces and attends over other key counts than the packed
        # training forward (other SDPA/GEMM blocking). Seen: up to 1.7e-6 at |h| ~ 3.4 (7 float32 ulps) on
        # default/AVX2/AVX-512 kernels; 1e-5 leaves margin for other CPUs.
        torch.testing.assert_close(hidden_BGH, train_hidden_BGH, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(cache.length + 1)


@pytest.mark.float_exact
@pytest.mark.parametrize("convention", ["anchor-predicts", "mask-predicts"])
@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("fusion,adapter", [("none", "none"), ("latest_context", "none"), ("latest_context", "zero")])
def test_teacher_forced_propose_equals_training(tiny_qwen3, convention, head, fusion, adapter):
    """Train/serve parity in both block conventions, with and without anchor fusion and the output adapter:
    `propose`, fed the ground-truth tokens, gives at draft k the training forward's distribution and confidence
    logit of draft k (same slot, same previous token, the same fused context of the position before the anchor)."""
    ids = random_ids(1, 16, seed=3)
    samples = make_samples(tiny_qwen3, ids, LAYER_IDS)
    drafter = build_drafter("dspark", tiny_qwen3, sequential_head=head, block_convention=convention,
                            anchor_fusion=fusion, output_adapter=adapter, **SMALL).eval()
    with torch.no_grad():
        drafter.sequential.out.weight.normal_(0, 2.0)  # a bias that matters
        if fusion != "none":
            drafter.backbone.input_fusion.weight.normal_(0, 0.3)  # not the [I, I] start: any W_in must match
        if adapter != "none":
            drafter.backbone.output_adapter.weight.normal_(0, 0.3)  # trained away from its zero start
    sample, anchor = samples[0], 5
    only = torch.zeros(16, dtype=torch.bool)
    only[anchor: anchor + 2] = True  # one block, anchored at `anchor`
    single = CachedSample(sample_id="one", input_ids=sample.input_ids, loss_mask=only, features=sample.features,
                          final_hidden=sample.final_hidden)
    batch = builder(drafter).collate([single])
    num_drafts = drafter.config.num_drafts
    assert batch.num_drafts == num_drafts == (7 if convention == "anchor-predicts" else 6)
    truth = sample.input_ids[anchor + 1: anchor + 1 + num_drafts]

    def forced(logits_BV, k):
        return truth[k: k + 1], torch.softmax(logits_BV.float(), -1)

    with torch.no_grad():
        train_logits_KV = block_logits(drafter, batch)[0]
        train_conf_K = drafter(batch).confidence_logits_N
        cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None], torch.arange(16)[None])
        proposal = drafter.propose(cache, sample.input_ids[[anchor]], torch.tensor([anchor]), forced)
    assert proposal.token_ids_BK[0].tolist() == truth.tolist()
    torch.testing.assert_close(proposal.probs_BKV[0], torch.softmax(train_logits_KV.float(), -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(proposal.confidence_logits_BK[0], train_conf_K.float(), rtol=0, atol=1e-5)


@pytest.mark.float_exact
def test_inference_draft_hidden_bit_exact_single_block(family_setup, monkeypatch):
    """With one block the dense training layout ([all context; block]) equals the cached one: bit-identical.
    (The segmented layout, the CPU default, drops the masked keys: equal to rounding, test_attention.py.)"""
    _, drafter, samples = family_setup
    monkeypatch.setattr(drafter.config, "training_attention", "dense")
    sample = samples[0]
    num_tokens = sample.input_ids.shape[0]
    cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None], torch.arange(num_tokens)[None])
    for anchor in (0, 5, num_tokens - 2):
        only = torch.zeros(num_tokens, dtype=torch.bool)
        only[anchor: anchor + 2] = True  # the only valid anchor is `anchor`
        single = CachedSample(sample_id="one", input_ids=sample.input_ids, loss_mask=only, features=sample.features,
                              final_hidden=sample.final_hidden)
        batch = builder(drafter).collate([single])
        assert batch.anchor_positions_B.tolist() == [anchor]
        with torch.no_grad():
            train_hidden = drafter(batch).hidden_NH
            infer_hidden = drafter.draft_hidden(cache, sample.input_ids[[anchor]], torch.tensor([anchor]))[0]
        assert torch.equal(train_hidden, infer_hidden)


def _greedy(logits_BV, slot):
    return logits_BV.argmax(-1), None


def test_propose_matches_sequential_distribution(tiny_qwen3):
    """propose returns the distribution each token was drawn from, with the bias of the sampled x_{k-1}."""
    samples = make_samples(tiny_qwen3, random_ids(1, 12), LAYER_IDS)
    drafter = build_drafter("dspark", tiny_qwen3, **SMALL).eval()
    with torch.no_grad():  # make the Markov bias large so it matters
        drafter.sequential.out.weight.normal_(0, 3.0)
    sample = samples[0]
    cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None], torch.arange(12)[None])
    anchor_ids, anchor_pos = sample.input_ids[[12 - 1]], torch.tensor([11])
    generator = torch.Generator().manual_seed(0)

    def sampled(logits_BV, slot):
        probs = torch.softmax(logits_BV / 0.7, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs

    proposal = drafter.propose(cache, anchor_ids, anchor_pos, sampled)
    greedy = drafter.propose(cache, anchor_ids, anchor_pos, _greedy)
    assert greedy.probs_BKV is None and greedy.token_ids_BK.shape == (1, drafter.config.block_size)
    h_BGH = drafter.draft_hidden(cache, anchor_ids, anchor_pos)
    base = drafter.base_logits(h_BGH)
    prev = anchor_ids
    for k in range(drafter.config.block_size):
        logits = base[:, k] + drafter.sequential.prev_embed(prev) @ drafter.sequential.out.weight.T
        torch.testing.assert_close(proposal.probs_BKV[:, k], torch.softmax(logits / 0.7, -1))
        prev_ids = greedy.token_ids_BK[:, k - 1] if k else anchor_ids
        greedy_logits = base[:, k] + drafter.sequential.prev_embed(prev_ids) @ drafter.sequential.out.weight.T
        assert int(greedy.token_ids_BK[0, k]) == int(greedy_logits.argmax(-1))
        prev = proposal.token_ids_BK[:, k]
    assert proposal.confidence_BK.shape == (1, drafter.config.block_size)
    assert ((proposal.confidence_BK > 0) & (proposal.confidence_BK < 1)).all()


@pytest.mark.float_exact
def test_rnn_training_bias_equals_stepwise_recurrence(tiny_llama):
    """The parallel-over-blocks RNN unroll in training equals the left-to-right inference recurrence."""
    samples = make_samples(tiny_llama, random_ids(1, 16), LAYER_IDS)
    drafter = build_drafter("dspark", tiny_llama, sequential_head="rnn", **SMALL).eval()
    batch = builder(drafter).collate(samples)
    g = batch.block_size
    with torch.no_grad():
        out = drafter(batch)
        head = drafter.sequential
        hidden_BGH = out.hidden_NH.view(-1, g, out.hidden_NH.shape[-1])
        prev_BG = batch.prev_ids_N.view(-1, g)
        state = head.init_state(hidden_BGH.shape[0], hidden_BGH)
        expected = []
        for k in range(g):
            bias_in, state = head.step(state, hidden_BGH[:, k], prev_BG[:, k])
            expected.append(bias_in)
        torch.testing.assert_close(out.bias[0], torch.stack(expected, 1).reshape(-1, head.rank), rtol=0, atol=0)
        # The bias at slot 1 depends on the ground-truth previous token.
        changed = builder(drafter).collate(samples)
        changed.prev_ids_N.view(-1, g)[:, 1] = 5
        assert not torch.equal(drafter(changed).bias[0].view(-1, g, head.rank)[:, 1],
                               out.bias[0].view(-1, g, head.rank)[:, 1])


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_final_norm_init_sets_the_norms_scale_in_every_family(tiny_target, tmp_path, scale):
    """`final_norm_init=c`: every channel of the backbone's final norm multiplies by c, whether the family stores
    the scale (Llama, Qwen3) or its offset from one (Gemma 3); c = 0 zeroes the backbone's logits. The field is
    saved with the drafter and the weights reload as trained (a start, not an architecture)."""
    samples = make_samples(tiny_target, random_ids(1, 16), LAYER_IDS)
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_target, final_norm_init=scale, **SMALL).eval()
    probe = torch.randn(3, drafter.config.hidden_size)
    reference = build_drafter("dspark", tiny_target, **SMALL).backbone.norm  # the family's scale-one start
    with torch.no_grad():
        assert torch.allclose(drafter.backbone.norm(probe), scale * reference(probe), atol=1e-6)
        out = drafter(builder(drafter).collate(samples))
        if scale == 0.0:
            assert out.hidden_NH.abs().max() == 0
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny_target)
    assert loaded.config.final_norm_init == scale
    assert torch.equal(loaded.backbone.norm.weight, drafter.backbone.norm.weight)  # not re-applied on load
    with pytest.raises(ValueError, match="final_norm_init"):
        build_drafter("dspark", tiny_target, final_norm_init=-1.0, **SMALL)


def test_zero_output_adapter_starts_silent_and_learns_from_the_first_step(tiny_target, tmp_path):
    """`output_adapter="zero"`: the backbone's hidden output (the draft logits' and the confidence head's input) is
    zero at the start; the first backward reaches the adapter (a linear probe's outer-product gradient) but not the
    layers below it; after one optimizer step the backbone adds something and its layers get gradients. The adapter
    is saved and reloads as trained; an unknown value is refused."""
    samples = make_samples(tiny_target, random_ids(2, 16), LAYER_IDS)
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_target, output_adapter="zero", **SMALL)
    batch = builder(drafter).collate(samples)
    out = drafter(batch)
    assert out.hidden_NH.abs().max() == 0
    block_logits(drafter, batch).logsumexp(-1).sum().backward()
    adapter = drafter.backbone.output_adapter.weight
    assert adapter.grad.abs().sum() > 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in drafter.backbone.layers.parameters())
    torch.optim.SGD(drafter.parameters(), lr=0.1).step()
    drafter.zero_grad()
    out = drafter(batch)
    assert out.hidden_NH.abs().max() > 0
    block_logits(drafter, batch).logsumexp(-1).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.backbone.layers.parameters())
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, tiny_target)
    assert loaded.config.output_adapter == "zero"
    assert torch.equal(loaded.backbone.output_adapter.weight, adapter)  # not reset to zero on load
    with pytest.raises(ValueError, match="output_adapter"):
        build_drafter("dspark", tiny_target, output_adapter="identity", **SMALL)
