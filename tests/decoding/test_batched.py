"""Batched decoding: every request's greedy output equals its own batch-1 greedy decoding (fixed,
threshold and scheduler modes, ragged lengths, early finish + join, compaction), batched DSpark
proposals equal batch-1 ones, and T=1 losslessness on a 4-token vocabulary: with the scheduler, and with real
DFlash/DSpark drafters of both block conventions.

Shape legend: K = draft tokens, V = vocabulary.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import transformers

from deepspec.decoding.batch_cache import BatchedTargetCache, prefill_requests
from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
from deepspec.decoding.loop import autoregressive_generate
from deepspec.decoding.profiling import make_verification_forward_fn, profile_target_sps, split_tokens_over_rows
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.proposers import NoDraftBatchProposer, PerRequestBatchProposer
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.scheduler import SPSTable, VerificationPolicy
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.block.proposer import BlockDrafterBatchProposer
from deepspec.drafters.build import build_drafter

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15], [99, 3, 4], [1000, 20, 30, 40, 50, 60, 70]]
MAX_NEW = [14, 3, 12, 10]  # request 1 finishes early; request 3 joins when a row frees up
TOY_SPS = SPSTable([1, 4, 8, 16, 32], [100.0, 95.0, 80.0, 55.0, 30.0])


def reference_greedy(model, prompt, max_new):
    return autoregressive_generate(TargetVerifier(model, []), prompt, max_new, GREEDY).token_ids


class OracleProposer:
    """Batch-1 proposer drafting the reference greedy continuation, corrupted at random positions;
    block sizes differ per request and confidences are random, so policies truncate raggedly."""

    def __init__(self, references: dict, seed: int):
        self.references, self.rng = references, random.Random(seed)

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH):
        self.prompt_len = prompt_ids_T.shape[0]
        self.reference = self.references[tuple(prompt_ids_T.tolist())]
        self.block = 2 + len(self.reference) % 4

    def propose(self, anchor_id, anchor_pos, sampling, generator):
        produced = anchor_pos - self.prompt_len + 1  # tokens emitted so far, anchor included
        ids = list(self.reference[produced: produced + self.block]) + [11] * self.block
        ids = ids[: self.block]
        if self.rng.random() < 0.6:
            j = self.rng.randrange(self.block)
            ids[j] = (ids[j] + 1) % 1000
        confidence = torch.tensor([[self.rng.uniform(0.05, 0.99) for _ in range(self.block)]])
        return DraftProposal(torch.tensor([ids]), None, confidence)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH):
        pass


def run_batched(model, proposer, policy, **settings):
    requests = [BatchRequest(p, m, request_id=f"req{i}") for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    return batched_speculative_generate(model, proposer, requests, GREEDY, policy=policy,
                                        settings=ServingSettings(max_concurrency=3, **settings))


@pytest.mark.parametrize("policy", [VerificationPolicy("fixed"), VerificationPolicy("threshold", threshold=0.4),
                                    VerificationPolicy("scheduler")], ids=["fixed", "threshold", "scheduler"])
@pytest.mark.float_exact
def test_greedy_equals_batch1_per_request(tiny_llama, policy):
    model = tiny_llama.model
    references = {tuple(p): reference_greedy(model, p, m) for p, m in zip(PROMPTS, MAX_NEW)}
    counter = itertools.count()
    proposer = PerRequestBatchProposer(lambda: OracleProposer(references, seed=next(counter)))
    out = run_batched(model, proposer, policy, sps=TOY_SPS, compact_every=3)
    for prompt, _max_new, result in zip(PROMPTS, MAX_NEW, out.requests):
        assert result.token_ids == references[tuple(prompt)], result.request_id
    assert [r.request_id for r in out.requests] == ["req0", "req1", "req2", "req3"]
    # Exercised: 3 rows at once, ragged lengths in one forward, some accepted drafts, the late join.
    assert max(len(r.request_ids) for r in out.rounds) == 3
    assert any(len(set(r.lengths)) > 1 for r in out.rounds)
    assert sum(sum(r.accepted) for r in out.rounds) > 0
    first_round_of = {rid: min(i for i, r in enumerate(out.rounds) if rid in r.request_ids) for rid in ("req3",)}
    assert first_round_of["req3"] > 0 and "req1" not in out.rounds[-1].request_ids
    for record in out.rounds:
        assert record.tokens_verified == sum(record.lengths) + len(record.request_ids)
        assert record.tokens_computed == len(record.request_ids) * (max(record.lengths) + 1)


@pytest.mark.float_exact
@pytest.mark.parametrize("fusion", ["none", "latest_context"])
def test_dspark_batched_proposals_equal_batch1(tiny_llama, tiny_drafter, fusion):
    """Greedy rounds of a request do not depend on its neighbours: same drafts at concurrency 3 and 1 (with anchor
    fusion too, whose latest-context entry must follow the cache's merges, row selections and compactions)."""
    drafter = tiny_drafter("dspark", tiny_llama, target_layer_ids=[0, 2], anchor_fusion=fusion).eval()
    if fusion != "none":
        with torch.no_grad():
            drafter.backbone.input_fusion.weight.normal_(0, 0.3)
    layer_ids = drafter.config.target_layer_ids

    def drafts_at(concurrency):
        seen = {}

        def record(trace):
            for rid, row, _length in zip(trace.request_ids, trace.draft.token_ids_BK.tolist(), trace.lengths):
                seen.setdefault(rid, []).append(row)

        requests = [BatchRequest(p, m, request_id=i) for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
        out = batched_speculative_generate(tiny_llama.model, BlockDrafterBatchProposer(drafter), requests, GREEDY,
                                           on_round=record,
                                           settings=ServingSettings(max_concurrency=concurrency, layer_ids=layer_ids,
                                                                    compact_every=2))
        return out, seen

    batched, drafts_batched = drafts_at(3)
    single, drafts_single = drafts_at(1)
    assert drafts_batched == drafts_single
    for prompt, max_new, result in zip(PROMPTS, MAX_NEW, batched.requests):
        assert result.token_ids == reference_greedy(tiny_llama.model, prompt, max_new)
    assert [r.token_ids for r in batched.requests] == [r.token_ids for r in single.requests]


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_reduced_vocab_block_drafters_batched_greedy_is_lossless(request, tiny_drafter, family, kind):
    """Batched greedy decoding with a reduced draft vocabulary (proposals mapped through d2t) equals each
    request's own greedy decoding."""
    from deepspec.drafters.draft_vocab import build_draft_vocab

    tiny_target = request.getfixturevalue(family)

    drafter = tiny_drafter(kind, tiny_target, target_layer_ids=[0, 2], draft_vocab_size=300).eval()
    counts = torch.zeros(drafter.config.target_vocab_size, dtype=torch.long)
    for prompt in PROMPTS:  # a vocabulary with some scattered ids, not the identity placeholder
        counts[torch.tensor(prompt)] += 1
    drafter.set_draft_vocab(*build_draft_vocab(counts, 300, always_keep=[0, 1, 2]))
    requests = [BatchRequest(p, m, request_id=i) for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    out = batched_speculative_generate(tiny_target.model, BlockDrafterBatchProposer(drafter), requests, GREEDY,
                                       settings=ServingSettings(max_concurrency=3,
                                                                layer_ids=drafter.config.target_layer_ids))
    for prompt, max_new, result in zip(PROMPTS, MAX_NEW, out.requests):
        assert result.token_ids == reference_greedy(tiny_target.model, prompt, max_new)


def test_cache_compaction_keeps_logits(tiny_llama):
    """Compaction gathers valid slots; the next forward's logits are unchanged (float32)."""
    model = tiny_llama.model
    cache = BatchedTargetCache(model)
    cache.add_rows(prefill_requests(model, [torch.tensor(p) for p in PROMPTS[:2]], []), [0, 1])
    cache.add_rows(prefill_requests(model, [torch.tensor(PROMPTS[2])], []), [0])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    real = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    cache.forward(ids, real, [])
    cache.commit(3, [1, 1, 1])
    probe = torch.tensor([[21], [22], [23]])
    ones = torch.ones(3, 1, dtype=torch.bool)
    import copy
    before = copy.deepcopy(cache)
    hidden_a, _ = before.forward(probe, ones, [])
    holes = cache.hole_fraction()
    cache.compact()
    assert cache.hole_fraction() < holes and cache.num_slots == 10
    hidden_b, _ = cache.forward(probe, ones, [])
    torch.testing.assert_close(hidden_a, hidden_b, rtol=0, atol=1e-5)


def test_bad_inputs(tiny_llama):
    proposer = PerRequestBatchProposer(lambda: None)
    with pytest.raises(ValueError, match="prompt_ids"):
        batched_speculative_generate(tiny_llama.model, proposer, [BatchRequest([], 3)], GREEDY)
    with pytest.raises(ValueError, match="max_concurrency"):
        batched_speculative_generate(tiny_llama.model, proposer, [BatchRequest([1], 3)], GREEDY,
                                     settings=ServingSettings(max_concurrency=0))
    # What the per-slot masks cannot serve: a recurrent layer (Qwen3-Next style), an implementation without masks.
    hybrid = tiny_vocab_target()
    hybrid.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\], whose state is not a per-token KV"):
        batched_speculative_generate(hybrid, proposer, [BatchRequest([1], 3)], GREEDY)
    flash = tiny_vocab_target()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation 'flash_attention_2' does not read"):
        batched_speculative_generate(flash, proposer, [BatchRequest([1], 3)], GREEDY)
    with pytest.raises(ValueError, match="spread"):
        split_tokens_over_rows(2, 3)
    assert split_tokens_over_rows(7, 3) == [3, 2, 2]


def test_profile_target_sps_is_stored_and_reused(tiny_llama, tmp_path):
    forward_fn = make_verification_forward_fn(tiny_llama.model, num_rows=2, context_len=8)
    forward_fn(5)  # the context length stays the same across calls
    table = profile_target_sps(tiny_llama.model, "tiny", tmp_path, num_rows=2, max_block=3, context_len=8,
                               repeats=1, warmup=0)
    assert table.batch_sizes[0] == 2 and table.batch_sizes[-1] == 8
    assert table.fingerprint["num_rows"] == 2 and (tmp_path / "sps_R2_ctx8.json").is_file()
    again = profile_target_sps(tiny_llama.model, "tiny", tmp_path, num_rows=2, max_block=3, context_len=8,
                               repeats=1, warmup=0)
    assert again.steps_per_second == table.steps_per_second  # reused, not re-profiled


# -- T = 1 losslessness with the scheduler ----------------------------------------------------

VOCAB = 4
NUM_CHECKED = 3


def tiny_vocab_target():
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=3, pad_token_id=3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharper, varied next-token laws
    return model


def exact_law(model, prompt):
    """P(first NUM_CHECKED tokens) by enumeration with full forwards."""
    law = torch.zeros((VOCAB,) * NUM_CHECKED, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=NUM_CHECKED):
        ids = torch.tensor([prompt + list(seq[:-1])])
        probs = torch.softmax(model(ids).logits[0, -NUM_CHECKED:].double(), dim=-1)
        law[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return law


class MarkovDraftProposer:
    """Sampled drafts: x_k ~ q(. | x_{k-1}); confidence c_k reads x_{k-1} (the appendix-A hazard)."""

    draft_VV = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25],
                             [0.7, 0.1, 0.1, 0.1]])
    confidence_V = torch.tensor([0.9, 0.2, 0.6, 0.05])

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH):
        pass

    def propose(self, anchor_id, anchor_pos, sampling, generator):
        prev, ids, probs, conf = anchor_id, [], [], []
        for _ in range(3):
            row = self.draft_VV[prev]
            conf.append(float(self.confidence_V[prev]))
            prev = int(torch.multinomial(row, 1, generator=generator))
            ids.append(prev)
            probs.append(row)
        return DraftProposal(torch.tensor([ids]), torch.stack(probs)[None], torch.tensor([conf]))

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH):
        pass


def test_scheduler_t1_lossless_statistically():
    model = tiny_vocab_target()
    prompt = [0, 2]
    law = exact_law(model, prompt)
    num_samples = 2000
    requests = [BatchRequest(prompt, NUM_CHECKED) for _ in range(num_samples)]
    generator = torch.Generator().manual_seed(0)
    out = batched_speculative_generate(model, PerRequestBatchProposer(MarkovDraftProposer), requests,
                                       SamplingParams(temperature=1.0), policy=VerificationPolicy("scheduler"),
                                       generator=generator,
                                       settings=ServingSettings(
                                           sps=SPSTable([1, 16, 32, 64], [100.0, 97.0, 60.0, 30.0]),
                                           max_concurrency=64, acceptance_backend="torch"))
    counts = torch.zeros_like(law)
    for result in out.requests:
        counts[tuple(result.token_ids)] += 1
    lengths = [n for r in out.rounds for n in r.lengths]
    assert 0 < sum(lengths) and min(lengths) < 3  # the scheduler truncated some rows and kept others
    expected = law * num_samples
    chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum())
    dof = law.numel() - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2={chi2:.1f}, dof={dof}"
    # The test has power: the draft chain's own law is rejected.
    draft_law = torch.zeros_like(law)
    for seq in itertools.product(range(VOCAB), repeat=NUM_CHECKED):
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)[seq[0]]
        draft_VV = MarkovDraftProposer.draft_VV
        draft_law[seq] = float(first) * float(draft_VV[seq[0], seq[1]]) * float(draft_VV[seq[1], seq[2]])
    wrong = draft_law * num_samples
    chi2_wrong = float(((counts - wrong) ** 2 / wrong.clamp_min(1e-3)).sum())
    assert chi2_wrong > dof + 6 * math.sqrt(2 * dof)


@pytest.mark.parametrize("kind,convention", [("dflash", "mask-predicts"), ("dflash", "anchor-predicts"),
                                             ("dspark", "anchor-predicts"), ("dspark", "mask-predicts")])
def test_block_drafter_t1_lossless_statistically(kind, convention):
    """A real block drafter (random weights, sampled drafts) in either block convention leaves the law of the
    first tokens the target's: the convention moves which slots draft, never what is emitted."""
    from deepspec.drafters.proposers import make_batch_proposer
    from deepspec.targets.load import LoadedTarget, load_tokenizer

    model = tiny_vocab_target()
    target = LoadedTarget(model=model, tokenizer=load_tokenizer("smollm2-135m"), name="tiny-vocab-llama",
                          path="<memory>", revision="seed3")
    torch.manual_seed(0)
    overrides = {"markov_rank": 4} if kind == "dspark" else {}
    drafter = build_drafter(kind, target, num_draft_layers=1, block_size=4, target_layer_ids=[0], mask_token_id=1,
                            block_convention=convention, **overrides).eval()
    prompt = [0, 2]
    law = exact_law(model, prompt)
    num_samples = 2000
    # Longer than the checked prefix, so the first round verifies every draft of the block.
    requests = [BatchRequest(prompt, NUM_CHECKED + 4) for _ in range(num_samples)]
    out = batched_speculative_generate(model, make_batch_proposer(drafter), requests, SamplingParams(temperature=1.0),
                                       generator=torch.Generator().manual_seed(0),
                                       settings=ServingSettings(max_concurrency=100, layer_ids=[0],
                                                                acceptance_backend="torch"))
    counts = torch.zeros_like(law)
    for result in out.requests:
        counts[tuple(result.token_ids[:NUM_CHECKED])] += 1
    accepted = [a for r in out.rounds for a in r.accepted]
    assert max(length for r in out.rounds for length in r.lengths) == drafter.config.num_drafts
    assert 0 < sum(accepted) and min(accepted) == 0  # both the accept and the residual path were taken
    expected = law * num_samples
    chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum())
    dof = law.numel() - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi2={chi2:.1f}, dof={dof}"


def test_make_batch_proposer_batched_or_per_request(tiny_drafter, tiny_llama):
    """Block drafters draft all rows at once; chain drafters (Eagle3) run one batch-1 proposer per row."""
    from deepspec.drafters.proposers import make_batch_proposer

    dspark = tiny_drafter("dspark", tiny_llama, seed=0, target_layer_ids=[0, 2])
    assert isinstance(make_batch_proposer(dspark), BlockDrafterBatchProposer)
    eagle = build_drafter("eagle3", tiny_llama).eval()
    proposer = make_batch_proposer(eagle, tiny_llama.model)
    assert isinstance(proposer, PerRequestBatchProposer)
    requests = [BatchRequest(p, m) for p, m in zip(PROMPTS[:3], MAX_NEW[:3])]
    out = batched_speculative_generate(tiny_llama.model, proposer, requests, GREEDY,
                                       settings=ServingSettings(max_concurrency=2,
                                                                layer_ids=eagle.config.target_layer_ids))
    for prompt, max_new, result in zip(PROMPTS, MAX_NEW, out.requests):
        assert result.token_ids == reference_greedy(tiny_llama.model, prompt, max_new)


def test_padded_prefill_equals_single_prefill(tiny_llama):
    prompts = [torch.tensor(p) for p in PROMPTS]
    together = prefill_requests(tiny_llama.model, prompts, [0, 2])
    for row, prompt in enumerate(prompts):
        alone = prefill_requests(tiny_llama.model, [prompt], [0, 2])
        length = len(prompt)
        torch.testing.assert_close(together.last_logits_nV[row], alone.last_logits_nV[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(together.features_nTF[row, :length], alone.features_nTF[0], rtol=0, atol=1e-5)
    assert together.valid_nT.sum(1).tolist() == [len(p) for p in PROMPTS]


def test_no_draft_baseline_is_plain_greedy(tiny_llama):
    requests = [BatchRequest(p, m) for p, m in zip(PROMPTS, MAX_NEW)]
    out = batched_speculative_generate(tiny_llama.model, NoDraftBatchProposer(), requests, GREEDY,
                                       settings=ServingSettings(max_concurrency=3))
    for prompt, max_new, result in zip(PROMPTS, MAX_NEW, out.requests):
        assert result.token_ids == reference_greedy(tiny_llama.model, prompt, max_new)
    assert all(n == 0 for r in out.rounds for n in r.lengths)


def test_round_metadata_describes_the_padded_verification():
    from deepspec.decoding.proposal import RoundMetadata

    meta = RoundMetadata.make_dummy([[5, 6, 7], [8], []], anchor_ids=[1, 2, 3])
    assert meta.num_rows == 3 and meta.width == 3 and meta.lengths_R == [3, 1, 0]
    assert meta.input_ids_RL.tolist() == [[1, 5, 6, 7], [2, 8, 2, 2], [3, 3, 3, 3]]  # padding: the anchor
    assert meta.real_RL.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    assert meta.num_draft_R.tolist() == [3, 1, 0] and meta.draft_probs_RKV is None
    assert meta.tokens_verified == 3 + 1 + 0 + 3 and meta.tokens_computed == 3 * 4
