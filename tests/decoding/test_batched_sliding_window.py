"""Batched decoding of sliding-window targets: Gemma 3 (sliding and full layers), a Mistral-style target (every
layer sliding) and Qwen3 with `use_sliding_window`, each with a window shorter than the sequences decoded.

- the cache: with holes, ragged rows, joins and compaction, every forward's logits are the row's own (a plain
  forward of its kept tokens, transformers' own masks), with sdpa and eager attention; compaction leaves the
  sliding layers about one window of slots per row;
- greedy: every request's output equals the target's own greedy `generate`, token for token (fixed, threshold
  and scheduler verification, ragged lengths, early finish and join, compaction every two rounds);
- T=1: on a 4-token Gemma 3 with a 3-token window, a real DSpark drafter's sampled rounds leave the law of the
  first tokens the target's (and the test tells that law from the same model's without its window).

Shape legend: R = rows, L = slots appended per forward, V = vocabulary.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
import transformers

from deepspec.decoding.batch_cache import SLIDING_ATTENTION, BatchedTargetCache, prefill_requests
from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.proposers import PerRequestBatchProposer
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.scheduler import SPSTable, VerificationPolicy
from deepspec.targets.family import text_config

GREEDY = SamplingParams(temperature=0.0)
TOY_SPS = SPSTable([1, 4, 8, 16, 32], [100.0, 95.0, 80.0, 55.0, 30.0])
PROMPT_LENGTHS = [5, 23, 9, 31, 14]
MAX_NEW = [30, 12, 40, 25, 33]  # request 1 finishes early; requests 3 and 4 join when rows free up


def tiny_sliding_model(kind: str, vocab_size: int = 2048, attn_implementation: str = "sdpa"):
    """A random float32 target whose window (8 or 16 tokens) is shorter than the sequences decoded."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=16, num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], **common)
    elif kind == "mistral":  # no layer_types: the window applies to every layer
        config = transformers.MistralConfig(sliding_window=8, num_hidden_layers=3, **common)
    else:  # qwen3: the layers from max_window_layers on slide
        config = transformers.Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                          num_hidden_layers=3, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=attn_implementation)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["gemma3", "mistral", "qwen3"])
def sliding_model(request):
    model = tiny_sliding_model(request.param)
    assert SLIDING_ATTENTION in (getattr(text_config(model.config), "layer_types", None) or [SLIDING_ATTENTION])
    return model


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits after each of `ids`: one forward without a cache (transformers' own sliding masks)."""
    return model(torch.tensor([ids])).logits[0]


def target_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def slots_of(cache: BatchedTargetCache, layer_type: str) -> int:
    return next(axis.num_slots for axis in cache.axes if axis.layer_type == layer_type)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_cache_with_holes_gives_each_rows_own_logits_and_keeps_one_window(attn_implementation):
    model = tiny_sliding_model("gemma3", attn_implementation=attn_implementation)
    window = text_config(model.config).sliding_window
    rng = random.Random(0)
    kept = [[rng.randrange(3, 2048) for _ in range(n)] for n in (30, 7, 19)]
    cache = BatchedTargetCache(model)
    cache.add_rows(prefill_requests(model, [torch.tensor(ids) for ids in kept[:2]], []), [0, 1])
    cache.add_rows(prefill_requests(model, [torch.tensor(kept[2])], []), [0])
    for step in range(12):
        width = rng.randint(1, 6)
        real_R = [rng.randint(1, width) for _ in kept]
        ids_RL = torch.tensor([[rng.randrange(3, 2048) for _ in range(width)] for _ in kept])
        real_RL = torch.arange(width)[None] < torch.tensor(real_R)[:, None]
        hidden_RLH, _ = cache.forward(ids_RL, real_RL)
        logits_RLV = model.get_output_embeddings()(hidden_RLH)
        for row, (ids, num_real) in enumerate(zip(kept, real_R)):
            new = ids_RL[row, :num_real].tolist()
            # One row of a padded, holed batch against the row alone: float32 rounding only.
            torch.testing.assert_close(logits_RLV[row, :num_real], plain_logits(model, ids + new)[len(ids):],
                                       rtol=0, atol=2e-5)
        num_kept_R = [rng.randint(1, n) for n in real_R]  # a rejection leaves a hole in most rows
        cache.commit(width, num_kept_R)
        for ids, n, row_ids in zip(kept, num_kept_R, ids_RL.tolist()):
            ids.extend(row_ids[:n])
        if step % 3 == 2:
            holes = cache.hole_fraction()
            cache.compact()
            assert slots_of(cache, SLIDING_ATTENTION) <= window - 1  # what the next query can still see
            assert slots_of(cache, "full_attention") == max(len(ids) for ids in kept)
            assert cache.hole_fraction() < holes
    assert min(len(ids) for ids in kept) > window + 6  # every row's window really slid


class OracleProposer:
    """Batch-1 proposer drafting the reference continuation, corrupted at random positions; block sizes differ
    per request and confidences are random, so the policies truncate raggedly and rows reject at random."""

    def __init__(self, references: dict, seed: int):
        self.references, self.rng = references, random.Random(seed)

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH):
        self.prompt_len = prompt_ids_T.shape[0]
        self.reference = self.references[tuple(prompt_ids_T.tolist())]
        self.block = 2 + self.prompt_len % 4

    def propose(self, anchor_id, anchor_pos, sampling, generator):
        produced = anchor_pos - self.prompt_len + 1  # tokens emitted so far, anchor included
        ids = (list(self.reference[produced: produced + self.block]) + [11] * self.block)[: self.block]
        if self.rng.random() < 0.6:
            j = self.rng.randrange(self.block)
            ids[j] = (ids[j] + 1) % 1000
        confidence = torch.tensor([[self.rng.uniform(0.05, 0.99) for _ in range(self.block)]])
        return DraftProposal(torch.tensor([ids]), None, confidence)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH):
        pass


@pytest.mark.float_exact
@pytest.mark.parametrize("policy", [VerificationPolicy("fixed"), VerificationPolicy("threshold", threshold=0.4),
                                    VerificationPolicy("scheduler")], ids=["fixed", "threshold", "scheduler"])
def test_greedy_equals_the_targets_own_generate(sliding_model, policy):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]
    references = {tuple(p): target_greedy(sliding_model, p, m) for p, m in zip(prompts, MAX_NEW)}
    counter = itertools.count()
    proposer = PerRequestBatchProposer(lambda: OracleProposer(references, seed=next(counter)))
    requests = [BatchRequest(p, m, request_id=i) for i, (p, m) in enumerate(zip(prompts, MAX_NEW))]
    out = batched_speculative_generate(sliding_model, proposer, requests, GREEDY, policy=policy,
                                       settings=ServingSettings(sps=TOY_SPS, max_concurrency=3, compact_every=2))
    for prompt, result in zip(prompts, out.requests):
        assert result.token_ids == references[tuple(prompt)], result.request_id
    # Exercised: ragged lengths in one forward, accepted and rejected drafts, the late joins.
    assert any(len(set(r.lengths)) > 1 for r in out.rounds)
    accepted = [a for r in out.rounds for a in r.accepted]
    assert sum(accepted) > 0 and min(accepted) == 0
    assert any(4 in r.request_ids for r in out.rounds[1:]) and 1 not in out.rounds[-1].request_ids


# -- T = 1: the target's law -----------------------------------------------------------------------

VOCAB = 4
NUM_CHECKED = 3
STAT_PROMPTS = [[0, 2, 1, 1, 2, 0], [1, 3]]  # one longer than the window, one that grows past it


def tiny_vocab_gemma3(window: int = 3):
    torch.manual_seed(3)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=3, pad_token_id=3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharper, varied next-token laws
    return model


def exact_law(model, prompt):
    """P(first NUM_CHECKED tokens) by enumeration with plain forwards."""
    law = torch.zeros((VOCAB,) * NUM_CHECKED, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=NUM_CHECKED):
        probs = torch.softmax(plain_logits(model, prompt + list(seq[:-1]))[-NUM_CHECKED:].double(), dim=-1)
        law[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return law


def chi2(counts, law):
    expected = law * counts.sum()
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-3)).sum())


def test_block_drafter_t1_keeps_the_sliding_targets_law():
    from deepspec.drafters.build import build_drafter
    from deepspec.drafters.proposers import make_batch_proposer
    from deepspec.targets.load import LoadedTarget, load_tokenizer

    model = tiny_vocab_gemma3()
    target = LoadedTarget(model=model, tokenizer=load_tokenizer("smollm2-135m"), name="tiny-vocab-gemma3",
                          path="<memory>", revision="seed3")
    torch.manual_seed(0)
    drafter = build_drafter("dspark", target, num_draft_layers=1, block_size=4, target_layer_ids=[0],
                            mask_token_id=1, markov_rank=4).eval()
    num_samples = 1500  # per prompt
    # Longer than the checked prefix, so rounds go on past it with holes left by earlier rejections.
    requests = [BatchRequest(prompt, NUM_CHECKED + 6, request_id=(i, n))
                for n in range(num_samples) for i, prompt in enumerate(STAT_PROMPTS)]
    out = batched_speculative_generate(model, make_batch_proposer(drafter), requests, SamplingParams(temperature=1.0),
                                       generator=torch.Generator().manual_seed(0),
                                       settings=ServingSettings(max_concurrency=100, layer_ids=[0],
                                                                acceptance_backend="torch", compact_every=2))
    accepted = [a for r in out.rounds for a in r.accepted]
    assert 0 < sum(accepted) and min(accepted) == 0  # both the accept and the residual path were taken
    dof = VOCAB ** NUM_CHECKED - 1
    bound = dof + 6 * math.sqrt(2 * dof)
    windowless = copy.deepcopy(model)
    windowless.config.sliding_window = 64  # the same weights attending to everything
    for i, prompt in enumerate(STAT_PROMPTS):
        counts = torch.zeros((VOCAB,) * NUM_CHECKED, dtype=torch.float64)
        for result in out.requests:
            if result.request_id[0] == i:
                counts[tuple(result.token_ids[:NUM_CHECKED])] += 1
        law = exact_law(model, prompt)
        assert chi2(counts, law) < bound, f"prompt {i}: chi2={chi2(counts, law):.1f}, dof={dof}"
        if len(prompt) > model.config.sliding_window:  # the test has power: the window changes the law
            assert chi2(counts, exact_law(windowless, prompt)) > bound
