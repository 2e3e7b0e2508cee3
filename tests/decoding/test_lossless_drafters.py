"""Drafter variants, untrained and random, must leave the output lossless: at T=0 speculative decoding equals the
target's own greedy decoding token for token (tiny targets of three families and the real embedded SmolLM2); at
T=1 a fixed seed reproduces the output and every round is well formed. Every kind's tiny test config runs the same
on the tiny targets in tests/drafters/test_every_kind.py; here are the variants on top of it (block conventions,
sequential heads, reduced vocabularies, anchor fusion, proposer options) and every kind on the real target."""

import pytest
import torch

from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.proposers import make_proposer

# (label, kind, overrides of the kind's tiny test config, proposer options).
VARIANTS = [
    ("dspark-rnn", "dspark", {"num_draft_layers": 2, "sequential_head": "rnn"}, {}),
    ("dspark-block5", "dspark", {"block_size": 5}, {}),
    # The other block convention of each kind (anchor-predicts DFlash, mask-predicts DSpark).
    ("dflash-anchor", "dflash", {"block_size": 5, "block_convention": "anchor-predicts"}, {}),
    ("dspark-mask", "dspark", {"block_size": 5, "block_convention": "mask-predicts"}, {}),
    # Reduced draft vocabularies (identity d2t: ids 0..Vd-1; prompt tokens beyond it take W1's "outside" row).
    ("dspark-reduced", "dspark", {"block_size": 5, "draft_vocab_size": 2000}, {}),
    ("dflash-reduced", "dflash", {"block_size": 6, "draft_vocab_size": 2000}, {}),
    # Anchor fusion (slot inputs fused with the latest context; the CPU preset's backbone), W_in left at [I, I].
    ("dspark-fusion", "dspark", {"num_draft_layers": 2, "block_size": 5, "draft_vocab_size": 2000,
                                 "anchor_fusion": "latest_context"}, {}),
    ("eagle3-chain4", "eagle3", {}, {"num_draft_tokens": 4}),
    ("eagle3-reduced", "eagle3", {"draft_vocab_size": 2000}, {"num_draft_tokens": 4}),
    ("mtp-recursive", "mtp", {}, {"num_draft_tokens": 4}),
    ("standalone-own", "standalone", {"share_target_embeddings": False}, {}),
]
# Every built-in kind's tiny test config as it is, then the variants.
TINY_AND_VARIANTS = [(kind, kind, {}, {}) for kind in ("dspark", "dflash", "eagle3", "mtp", "standalone")] + VARIANTS
GREEDY = SamplingParams(temperature=0.0)
REAL_TOKENS = 16  # new tokens per drafter on the real embedded target




def _greedy_reference(model, prompt, num_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def _speculative(target, drafter, options, prompt, num_tokens, sampling, generator=None, eos=()):
    verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
    proposer = make_proposer(drafter, target.model, **options)
    return speculative_generate(verifier, proposer, prompt, num_tokens, sampling, eos_token_ids=eos,
                                generator=generator)


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("label,kind,overrides,options", VARIANTS, ids=[d[0] for d in VARIANTS])
def test_greedy_identity_tiny_targets(request, tiny_drafter, family, label, kind, overrides, options):
    target = request.getfixturevalue(family)
    prompt = [1, 5, 77, 912, 33, 4001, 17, 250]
    reference = _greedy_reference(target.model, prompt, 24)
    drafter = tiny_drafter(kind, target, **overrides)
    result = _speculative(target, drafter, options, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert all(0 <= r.accepted <= r.proposed for r in result.rounds)
    assert 1 + sum(r.tau for r in result.rounds) >= len(result.token_ids)


@pytest.mark.float_exact
def test_greedy_identity_with_a_drafter_that_agrees(tiny_llama, tiny_drafter):
    """Exercise the accept path too, not only rejections: on a repetitive prompt the random target repeats
    itself and an untrained block drafter's proposals are sometimes accepted (tau > 1)."""
    prompt = [1, 5, 5, 5, 5, 5, 5, 5]
    reference = _greedy_reference(tiny_llama.model, prompt, 24)
    drafter = tiny_drafter("dspark", tiny_llama, markov_rank=16, block_size=5)
    result = _speculative(tiny_llama, drafter, {}, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert max(r.accepted for r in result.rounds) >= 1, "no round accepted a draft: the accept path is untested"


@pytest.mark.parametrize("label,kind,overrides,options", TINY_AND_VARIANTS, ids=[d[0] for d in TINY_AND_VARIANTS])
def test_sampled_rounds_reproducible_tiny(tiny_qwen3, tiny_drafter, label, kind, overrides, options):
    prompt = [1, 9, 8, 7, 6]
    drafter = tiny_drafter(kind, tiny_qwen3, **overrides)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    runs = [_speculative(tiny_qwen3, drafter, options, prompt, 16, sampling, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) == 16
    assert all(r.tau >= 1 and r.accepted <= r.proposed for r in runs[0].rounds)


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2):
    from deepspec.data.chat import end_of_turn_token_ids, prompt_ids

    ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Write a Python function that adds two numbers."}])
    return ids, sorted(end_of_turn_token_ids(smollm2.tokenizer))


@pytest.mark.slow
def test_greedy_identity_real_target_every_drafter(smollm2, smollm2_prompt, tiny_drafter):
    prompt, _ = smollm2_prompt
    verifier = TargetVerifier(smollm2.model, [])
    reference = autoregressive_generate(verifier, prompt, REAL_TOKENS, GREEDY).token_ids
    assert reference == _greedy_reference(smollm2.model, prompt, REAL_TOKENS)
    for label, kind, overrides, options in TINY_AND_VARIANTS:
        if label == "mtp-recursive":
            continue  # same code path as on the tiny targets; keeps this file under ~2 minutes
        overrides = dict(overrides)
        if "draft_vocab_size" in overrides:
            overrides["draft_vocab_size"] = 4096
        drafter = tiny_drafter(kind, smollm2, **overrides)
        result = _speculative(smollm2, drafter, options, prompt, REAL_TOKENS, GREEDY)
        assert result.token_ids == reference, label


@pytest.mark.slow
def test_sampled_real_target_reproducible(smollm2, smollm2_prompt, tiny_drafter):
    prompt, eos = smollm2_prompt
    drafter = tiny_drafter("dspark", smollm2, markov_rank=32, block_size=5)
    runs = [_speculative(smollm2, drafter, {}, prompt, REAL_TOKENS, SamplingParams(temperature=1.0),
                         torch.Generator().manual_seed(3), eos=eos) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(r.tau >= 1 and 0 <= r.accepted <= r.proposed <= 5 for r in runs[0].rounds)
    assert 1 + sum(r.tau for r in runs[0].rounds) >= len(runs[0].token_ids)


@pytest.mark.parametrize("label", ["dspark-fusion", "dflash", "eagle3"])
def test_bf16_autocast_drafter_stays_lossless(tiny_llama, tiny_drafter, label):
    """bf16 autocast of the drafter (make_proposer(autocast="bf16")) changes drafts, never the output: greedy
    speculative decoding still equals the fp32 target's greedy decoding token for token."""
    _, kind, overrides, options = next(d for d in TINY_AND_VARIANTS if d[0] == label)
    prompt = [1, 5, 77, 912, 33, 4001, 17, 250]
    reference = _greedy_reference(tiny_llama.model, prompt, 24)
    drafter = tiny_drafter(kind, tiny_llama, **overrides)
    verifier = TargetVerifier(tiny_llama.model, drafter.config.target_layer_ids)
    proposer = make_proposer(drafter, tiny_llama.model, autocast="bf16", **options)
    result = speculative_generate(verifier, proposer, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert tiny_llama.model.dtype == torch.float32  # the target verified in fp32
