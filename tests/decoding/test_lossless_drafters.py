"""Every drafter kind, untrained and random, must leave the output lossless: at T=0 speculative decoding
equals the target's own greedy decoding token for token (tiny targets of three families and the real
embedded SmolLM2); at T=1 a fixed seed reproduces the output and every round is well formed."""

import pytest
import torch

from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.build import build_drafter
from deepspec.drafters.proposers import make_proposer

# (label, kind, build overrides, proposer options); small widths keep the file fast.
DRAFTERS = [
    ("dspark-markov", "dspark", {"num_draft_layers": 1, "markov_rank": 16, "block_size": 5}, {}),
    ("dspark-rnn", "dspark", {"num_draft_layers": 2, "markov_rank": 16, "block_size": 4, "sequential_head": "rnn"}, {}),
    ("dflash", "dflash", {"num_draft_layers": 1, "block_size": 6}, {}),  # mask-predicts (its default)
    # The other block convention of each kind (anchor-predicts DFlash, mask-predicts DSpark).
    ("dflash-anchor", "dflash", {"num_draft_layers": 1, "block_size": 5, "block_convention": "anchor-predicts"}, {}),
    ("dspark-mask", "dspark", {"num_draft_layers": 1, "markov_rank": 16, "block_size": 5,
                               "block_convention": "mask-predicts"}, {}),
    # Reduced draft vocabularies (identity d2t: ids 0..Vd-1; prompt tokens beyond it take W1's "outside" row).
    ("dspark-reduced", "dspark", {"num_draft_layers": 1, "markov_rank": 16, "block_size": 5, "draft_vocab_size": 2000},
     {}),
    ("dflash-reduced", "dflash", {"num_draft_layers": 1, "block_size": 6, "draft_vocab_size": 2000}, {}),
    # Anchor fusion (slot inputs fused with the latest context; the CPU preset's backbone), W_in left at [I, I].
    ("dspark-fusion", "dspark", {"num_draft_layers": 2, "markov_rank": 16, "block_size": 5, "draft_vocab_size": 2000,
                                 "anchor_fusion": "latest_context"}, {}),
    ("eagle3-full", "eagle3", {}, {"num_draft_tokens": 4}),
    ("eagle3-reduced", "eagle3", {"draft_vocab_size": 2000}, {"num_draft_tokens": 4}),
    ("mtp", "mtp", {"num_mtp_modules": 2}, {}),
    ("mtp-recursive", "mtp", {"num_mtp_modules": 2}, {"num_draft_tokens": 4}),
    ("standalone", "standalone", {"num_draft_layers": 2}, {}),
    ("standalone-own", "standalone", {"num_draft_layers": 1, "share_target_embeddings": False}, {"num_draft_tokens": 3}),
]
GREEDY = SamplingParams(temperature=0.0)
REAL_TOKENS = 16  # new tokens per drafter on the real embedded target


def _build(target, kind, overrides, seed=0):
    torch.manual_seed(seed)
    return build_drafter(kind, target, **overrides)


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
@pytest.mark.parametrize("label,kind,overrides,options", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_greedy_identity_tiny_targets(request, family, label, kind, overrides, options):
    target = request.getfixturevalue(family)
    prompt = [1, 5, 77, 912, 33, 4001, 17, 250]
    reference = _greedy_reference(target.model, prompt, 24)
    drafter = _build(target, kind, overrides)
    result = _speculative(target, drafter, options, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert all(0 <= r.accepted <= r.proposed for r in result.rounds)
    assert 1 + sum(r.tau for r in result.rounds) >= len(result.token_ids)


@pytest.mark.float_exact
def test_greedy_identity_with_a_drafter_that_agrees(tiny_llama):
    """Exercise the accept path too, not only rejections: on a repetitive prompt the random target repeats
    itself and an untrained block drafter's proposals are sometimes accepted (tau > 1)."""
    prompt = [1, 5, 5, 5, 5, 5, 5, 5]
    reference = _greedy_reference(tiny_llama.model, prompt, 24)
    drafter = _build(tiny_llama, "dspark", {"num_draft_layers": 1, "markov_rank": 16, "block_size": 5})
    result = _speculative(tiny_llama, drafter, {}, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert max(r.accepted for r in result.rounds) >= 1, "no round accepted a draft: the accept path is untested"


@pytest.mark.parametrize("label,kind,overrides,options", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_sampled_rounds_reproducible_tiny(tiny_qwen3, label, kind, overrides, options):
    prompt = [1, 9, 8, 7, 6]
    drafter = _build(tiny_qwen3, kind, overrides)
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
def test_greedy_identity_real_target_every_drafter(smollm2, smollm2_prompt):
    prompt, _ = smollm2_prompt
    verifier = TargetVerifier(smollm2.model, [])
    reference = autoregressive_generate(verifier, prompt, REAL_TOKENS, GREEDY).token_ids
    assert reference == _greedy_reference(smollm2.model, prompt, REAL_TOKENS)
    for label, kind, overrides, options in DRAFTERS:
        if label == "mtp-recursive":
            continue  # same code path as on the tiny targets; keeps this file under ~2 minutes
        overrides = dict(overrides)
        if "draft_vocab_size" in overrides:
            overrides["draft_vocab_size"] = 4096
        drafter = _build(smollm2, kind, overrides)
        result = _speculative(smollm2, drafter, options, prompt, REAL_TOKENS, GREEDY)
        assert result.token_ids == reference, label


@pytest.mark.slow
def test_sampled_real_target_reproducible(smollm2, smollm2_prompt):
    prompt, eos = smollm2_prompt
    drafter = _build(smollm2, "dspark", {"num_draft_layers": 1, "markov_rank": 32, "block_size": 5})
    runs = [_speculative(smollm2, drafter, {}, prompt, REAL_TOKENS, SamplingParams(temperature=1.0),
                         torch.Generator().manual_seed(3), eos=eos) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(r.tau >= 1 and 0 <= r.accepted <= r.proposed <= 5 for r in runs[0].rounds)
    assert 1 + sum(r.tau for r in runs[0].rounds) >= len(runs[0].token_ids)


@pytest.mark.parametrize("label", ["dspark-fusion", "dflash", "eagle3-full"])
def test_bf16_autocast_drafter_stays_lossless(tiny_llama, label):
    """bf16 autocast of the drafter (make_proposer(autocast="bf16")) changes drafts, never the output: greedy
    speculative decoding still equals the fp32 target's greedy decoding token for token."""
    _, kind, overrides, options = next(d for d in DRAFTERS if d[0] == label)
    prompt = [1, 5, 77, 912, 33, 4001, 17, 250]
    reference = _greedy_reference(tiny_llama.model, prompt, 24)
    drafter = _build(tiny_llama, kind, overrides)
    verifier = TargetVerifier(tiny_llama.model, drafter.config.target_layer_ids)
    proposer = make_proposer(drafter, tiny_llama.model, autocast="bf16", **options)
    result = speculative_generate(verifier, proposer, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert tiny_llama.model.dtype == torch.float32  # the target verified in fp32
