"""The batch-1 loop against the target's own greedy decoding, with adversarial proposers."""

import pytest
import torch

from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import SamplingParams, probs_from_logits
from deepspec.decoding.verifier import TargetVerifier


class OracleThenNoiseProposer:
    """Proposes the target's greedy continuation for the first `good` tokens, then random tokens.

    It knows the reference output, so acceptance lengths are predictable: the loop must accept
    exactly `good` tokens per round (plus the bonus) and stay token-identical to greedy decoding.
    """

    def __init__(self, reference: list[int], good: int, block: int, vocab: int, seed: int = 0):
        self.reference, self.good, self.max_tokens, self.vocab = reference, good, block, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH):
        self.prompt_len = len(prompt_ids_T)

    def propose(self, anchor_id, anchor_pos, sampling, generator):
        emitted = anchor_pos - self.prompt_len + 1  # tokens generated so far, anchor included
        ids = []
        for j in range(self.max_tokens):
            ref_idx = emitted + j
            if j < self.good and ref_idx < len(self.reference):
                ids.append(self.reference[ref_idx])
            else:
                ids.append(int(torch.randint(0, self.vocab, (1,), generator=self.gen)))
        return DraftProposal(torch.tensor([ids]), None, None)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH):
        pass


def _reference_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.float_exact
def test_greedy_equals_target_generate(tiny_llama):
    model = tiny_llama.model
    prompt = [1, 5, 77, 912, 33, 4001]
    ref = _reference_greedy(model, prompt, 24)
    verifier = TargetVerifier(model, layer_ids=[0, 2])
    ar = autoregressive_generate(verifier, prompt, 24, SamplingParams(temperature=0.0))
    assert ar.token_ids == ref
    for good in (0, 2, 5):
        proposer = OracleThenNoiseProposer(ref, good=good, block=5, vocab=model.config.vocab_size)
        res = speculative_generate(verifier, proposer, prompt, 24, SamplingParams(temperature=0.0))
        assert res.token_ids == ref
        # every full round accepts exactly `good` drafts (the last round may be cut by max_new_tokens)
        assert all(r.accepted == min(good, r.proposed) for r in res.rounds[:-1])


def test_cache_is_cropped_exactly(tiny_qwen3):
    model = tiny_qwen3.model
    prompt = [1, 9, 8, 7]
    ref = _reference_greedy(model, prompt, 12)
    verifier = TargetVerifier(model, layer_ids=[1])
    proposer = OracleThenNoiseProposer(ref, good=1, block=4, vocab=model.config.vocab_size)
    res = speculative_generate(verifier, proposer, prompt, 12, SamplingParams(temperature=0.0))
    # The cache holds the prompt plus every emitted token except the final anchor.
    assert verifier.length == len(prompt) + len(res.token_ids) - 1
    assert res.token_ids == ref


def test_sampled_first_token_law_matches_target(tiny_llama):
    """T=1 with a uniform draft over a 1-round budget: the first generated-after-anchor token follows p_t."""
    model = tiny_llama.model
    prompt = [1, 42]
    verifier = TargetVerifier(model, layer_ids=[])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    p_first = probs_from_logits(logits, sampling)
    support = torch.nonzero(p_first).flatten()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(p_first)
    num = 2000
    for _ in range(num):
        res = autoregressive_generate(verifier, prompt, 1, sampling, generator=gen)
        counts[res.token_ids[0]] += 1
    freq = counts / num
    sigma = (p_first * (1 - p_first) / num).sqrt()
    assert torch.all((freq[support] - p_first[support]).abs() <= 6 * sigma[support] + 1e-9)
    assert counts.sum() == counts[support].sum()
