"""Drafter proposers (built by the spec): DSpark's sequential head conditions slot k on the sampled slot k-1,
calibrated confidence is passed through, draft counts are checked, Eagle3's reduced vocabulary is respected."""

import pytest
import torch

from deepspec.decoding.sampling import SamplingParams, process_logits
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.build import build_drafter
from deepspec.drafters.proposers import make_proposer

PROMPT = [1, 5, 77, 912, 33, 4001, 17]


def _reset(proposer, target, drafter, prompt=PROMPT):
    verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
    scored = verifier.score(torch.tensor([prompt]))
    proposer.reset(torch.tensor(prompt), scored.features_BTF[0], scored.final_hidden_BTH[0])
    return scored


def test_registered_kinds_cover_every_drafter():
    from deepspec.drafters.spec import drafter_kinds, get_drafter_spec

    for kind in drafter_kinds():
        spec = get_drafter_spec(kind)
        assert callable(spec.proposer) and callable(spec.batch_proposer)


@pytest.mark.parametrize("overrides", [{}, {"sequential_head": "rnn"}])
def test_dspark_sampled_draft_probs(tiny_drafter, tiny_llama, overrides):
    drafter = tiny_drafter("dspark", tiny_llama, seed=0, block_size=5, **overrides)
    proposer = make_proposer(drafter, tiny_llama.model)
    _reset(proposer, tiny_llama, drafter)
    params = SamplingParams(temperature=1.0, top_k=8)
    proposal = proposer.propose(3, len(PROMPT), params, torch.Generator().manual_seed(0))
    tokens, probs = proposal.token_ids_BK[0], proposal.probs_BKV[0]
    assert proposal.num_tokens == 5 and probs.shape == (5, tiny_llama.model.config.vocab_size)
    assert torch.all(probs[torch.arange(5), tokens] > 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert torch.all((probs > 0).sum(-1) == 8)
    # Recompute slot k's distribution by hand from the parallel logits plus the bias of the SAMPLED x_{k-1}.
    cache = proposer.batch.cache
    hidden = drafter.draft_hidden(cache, torch.tensor([3]), torch.tensor([len(PROMPT)]))
    base = drafter.base_logits(hidden)[0]
    seq = drafter.sequential
    state = seq.init_state(1, hidden)
    prev = torch.tensor([3])
    for k in range(5):
        bias_in, state = seq.step(state, hidden[:, k], prev)
        logits = base[k] + (bias_in @ seq.bias_out_RV)[0]
        torch.testing.assert_close(probs[k], torch.softmax(process_logits(logits, params), -1), atol=1e-5, rtol=1e-4)
        prev = tokens[k:k + 1]


def test_dspark_slot_distribution_depends_on_previous_sampled_token(tiny_drafter, tiny_llama):
    drafter = tiny_drafter("dspark", tiny_llama, seed=1)
    with torch.no_grad():  # a strong Markov bias makes the dependence unmistakable
        drafter.sequential.out.weight.mul_(50)
    proposer = make_proposer(drafter, tiny_llama.model)
    _reset(proposer, tiny_llama, drafter)
    params = SamplingParams(temperature=1.0)
    seen = {}
    for seed in range(12):
        p = proposer.propose(3, len(PROMPT), params, torch.Generator().manual_seed(seed))
        seen.setdefault(int(p.token_ids_BK[0, 0]), p.probs_BKV[0, 1])
    assert len(seen) >= 2, "slot 0 should sample different tokens across seeds"
    first, second = list(seen.values())[:2]
    # slot 1's law changes with the sampled slot-0 token (compare log-probs: the vocabulary is large)
    assert (first.log() - second.log()).abs().max() > 0.05


def test_dspark_confidence_is_calibrated(tiny_drafter, tiny_llama):
    torch.manual_seed(2)
    temps = [0.5, 1.0, 2.0, 4.0]
    raw = tiny_drafter("dspark", tiny_llama)
    calibrated = tiny_drafter("dspark", tiny_llama, calibration_temperatures=temps)
    calibrated.load_state_dict(raw.state_dict())
    confs = []
    for drafter in (raw, calibrated):
        proposer = make_proposer(drafter, tiny_llama.model)
        _reset(proposer, tiny_llama, drafter)
        confs.append(proposer.propose(3, len(PROMPT), SamplingParams(temperature=0.0), None).confidence_BK[0])
    logits = torch.logit(confs[0].double())
    torch.testing.assert_close(confs[1].double(), torch.sigmoid(logits / torch.tensor(temps, dtype=torch.double)),
                               atol=1e-5, rtol=1e-4)


def test_num_draft_tokens_option(tiny_drafter, tiny_llama):
    drafter = tiny_drafter("dflash", tiny_llama, block_size=6)
    proposer = make_proposer(drafter, tiny_llama.model, num_draft_tokens=3)
    _reset(proposer, tiny_llama, drafter)
    assert proposer.propose(3, len(PROMPT), SamplingParams(temperature=0.0), None).num_tokens == 3
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_proposer(drafter, tiny_llama.model, num_draft_tokens=7)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_proposer(drafter, tiny_llama.model, num_draft_tokens=0)


def test_eagle3_reduced_vocab_probs_stay_in_draft_vocab(tiny_llama):
    torch.manual_seed(3)
    drafter = build_drafter("eagle3", tiny_llama, draft_vocab_size=300)
    proposer = make_proposer(drafter, tiny_llama.model, num_draft_tokens=3)
    _reset(proposer, tiny_llama, drafter)
    proposal = proposer.propose(3, len(PROMPT), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    kept = drafter.target_vocab_index()
    outside = torch.ones(proposal.probs_BKV.shape[-1], dtype=torch.bool)
    outside[kept] = False
    assert proposal.num_tokens == 3 and proposal.confidence_BK is None
    assert torch.all(proposal.probs_BKV[0][:, outside] == 0)
    assert torch.all(torch.isin(proposal.token_ids_BK[0], kept))
    torch.testing.assert_close(proposal.probs_BKV[0].sum(-1), torch.ones(3))


def test_unknown_drafter_is_rejected():
    with pytest.raises(ValueError, match="drafter_kind"):
        make_proposer(torch.nn.Linear(2, 2))
