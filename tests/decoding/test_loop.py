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


class UniformDraftProposer:
    """Drafts one token uniformly from a small candidate set per anchor (the target's top-6 after that anchor,
    a superset of its top-4 support), and says so: p_d is uniform over the set. Some drafts are accepted, some
    rejected (then the residual is sampled), so both paths of the rejection rule are exercised."""

    max_tokens = 1

    def __init__(self, candidates: dict[int, torch.Tensor], vocab: int, seed: int = 0):
        self.candidates, self.vocab = candidates, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.drafted: list[int] = []

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH):
        pass

    def propose(self, anchor_id, anchor_pos, sampling, generator):
        if anchor_id not in self.candidates:  # a later round (its budget verifies nothing): draft nothing
            return DraftProposal(torch.zeros(1, 0, dtype=torch.long), None, None)
        options = self.candidates[anchor_id]
        token = int(options[torch.randint(0, len(options), (1,), generator=self.gen)])
        probs_1KV = torch.zeros(1, 1, self.vocab)
        probs_1KV[0, 0, options] = 1.0 / len(options)
        self.drafted.append(token)
        return DraftProposal(torch.tensor([[token]]), probs_1KV, None)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH):
        pass


def test_sampled_first_token_law_matches_target(tiny_llama):
    """T=1 with a uniform draft over a 1-round budget: the first generated-after-anchor token follows p_t."""
    model = tiny_llama.model
    prompt = [1, 42]
    vocab = model.config.vocab_size
    verifier = TargetVerifier(model, layer_ids=[])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        p_anchor = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], sampling)
        anchors = torch.nonzero(p_anchor).flatten().tolist()
        next_logits = {a: model(torch.tensor([prompt + [a]])).logits[0, -1] for a in anchors}
    p_next = {a: probs_from_logits(logits, sampling) for a, logits in next_logits.items()}
    proposer = UniformDraftProposer({a: torch.topk(logits, 6).indices for a, logits in next_logits.items()}, vocab)
    gen = torch.Generator().manual_seed(0)
    counts = {a: torch.zeros(vocab) for a in anchors}
    accepted = 0
    num = 2000
    for _ in range(num):
        # Budget 3: anchor (the prefill's sample), then one round verifying the single draft.
        res = speculative_generate(verifier, proposer, prompt, 3, sampling, generator=gen)
        counts[res.token_ids[0]][res.token_ids[1]] += 1
        accepted += res.rounds[0].accepted
        assert res.rounds[0].proposed == 1
    assert 0 < accepted < num  # both the accept and the residual path were taken
    for anchor in anchors:
        n = counts[anchor].sum()
        if n < 100:
            continue
        p, freq = p_next[anchor], counts[anchor] / n
        support = torch.nonzero(p).flatten()
        sigma = (p * (1 - p) / n).sqrt()
        assert torch.all((freq[support] - p[support]).abs() <= 6 * sigma[support] + 1e-9), anchor
        assert counts[anchor].sum() == counts[anchor][support].sum()  # never a token outside the target's support


def test_decoded_tau_pools_rounds_over_prompts_and_is_one_without_drafts(tiny_llama):
    from deepspec.decoding.lookup import PromptLookupProposer
    from deepspec.decoding.loop import decoded_tau
    from deepspec.decoding.proposers import NoDraftProposer

    verifier = TargetVerifier(tiny_llama.model, [0])
    greedy = SamplingParams(temperature=0.0)
    prompts = [[1, 5, 7, 5, 7, 5, 7], [3, 4, 3, 4, 3, 4]]
    plain = decoded_tau(verifier, NoDraftProposer(), prompts, 12, greedy)
    assert plain["tau"] == 1.0 and plain["num_rounds"] == plain["num_tokens"]
    pooled = decoded_tau(verifier, PromptLookupProposer(4), prompts, 12, greedy)
    runs = [speculative_generate(verifier, PromptLookupProposer(4), p, 12, greedy) for p in prompts]
    rounds = [r for run in runs for r in run.rounds]
    assert pooled["num_rounds"] == len(rounds)
    assert pooled["tau"] == pytest.approx(sum(r.tau for r in rounds) / len(rounds))
    # a pooled mean, not a mean of per-prompt means (the prompts run different numbers of rounds)
    assert pooled["num_tokens"] == sum(r.tau for r in rounds)
