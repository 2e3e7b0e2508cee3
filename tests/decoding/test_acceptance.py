"""Behaviour tests for the torch reference of accept_draft and its dispatcher.

Shape legend: B = requests, K = draft tokens, K1 = K + 1 target rows, V = vocab.
"""

import logging

import pytest
import torch

from deepspec.decoding import acceptance
from deepspec.decoding.acceptance import AcceptanceNoise, accept_draft
from deepspec.decoding.sampling import SamplingParams, probs_from_logits

T1 = SamplingParams(temperature=1.0)  # plain sampling at T = 1, no filter

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 8


def _logits_with_argmax(argmax_BK1: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """Target logits whose row-wise argmax is the given token (strongly peaked)."""
    ids_BK1 = torch.tensor(argmax_BK1)
    return torch.nn.functional.one_hot(ids_BK1, vocab).float() * 20.0


def _run(draft, argmax, num_draft, params=GREEDY, draft_probs=None, noise=None):
    draft_ids_BK = torch.tensor(draft)
    logits_BK1V = _logits_with_argmax(argmax)
    return accept_draft(draft_ids_BK, draft_probs, logits_BK1V, torch.tensor(num_draft), params, noise,
                        backend="torch")


def test_all_drafts_accepted_appends_bonus():
    result = _run([[1, 2, 3]], [[1, 2, 3, 4]], [3])
    assert result.output_ids_BK1.tolist() == [[1, 2, 3, 4]]
    assert result.num_accepted_B.tolist() == [3] and result.num_emitted_B.tolist() == [4]


def test_first_mismatch_stops_chain():
    result = _run([[1, 2, 3]], [[1, 5, 3, 4]], [3])
    assert result.output_ids_BK1.tolist() == [[1, 5, -1, -1]]
    assert result.num_accepted_B.tolist() == [1] and result.num_emitted_B.tolist() == [2]


def test_first_token_rejected_emits_target_token():
    result = _run([[6, 2]], [[1, 2, 3]], [2])
    assert result.output_ids_BK1.tolist() == [[1, -1, -1]]
    assert result.num_accepted_B.tolist() == [0]


def test_ragged_draft_lengths_use_their_own_bonus_row():
    # Request 1 drafted nothing: it emits only the target token of row 0.
    # Request 2 drafted one token (padding -1 after it): its bonus comes from row 1.
    result = _run([[1, 2, 3], [7, 7, 7], [4, -1, -1]], [[1, 2, 0, 5], [3, 7, 7, 7], [4, 6, 0, 0]], [2, 0, 1])
    assert result.output_ids_BK1.tolist() == [[1, 2, 0, -1], [3, -1, -1, -1], [4, 6, -1, -1]]
    assert result.num_accepted_B.tolist() == [2, 0, 1]


def test_greedy_speculative_rounds_equal_plain_greedy_decoding():
    """T=0 contract: any drafts give the target's greedy continuation token for token."""
    generator = torch.Generator().manual_seed(3)
    table_VV = torch.randn(VOCAB, VOCAB, generator=generator)  # next-token logits given the last token
    plain = [0]
    for _ in range(12):
        plain.append(int(table_VV[plain[-1]].argmax()))
    decoded = [0]
    while len(decoded) < 13:
        draft_1K = torch.randint(0, VOCAB, (1, 3), generator=generator)
        draft_1K[0, 0] = int(table_VV[decoded[-1]].argmax())  # often-right first guess
        previous_1K1 = torch.cat([torch.tensor([[decoded[-1]]]), draft_1K], dim=1)
        result = accept_draft(draft_1K, None, table_VV[previous_1K1], torch.tensor([3]), GREEDY, None,
                              backend="torch")
        decoded += result.output_ids_BK1[0, : int(result.num_emitted_B[0])].tolist()
    assert decoded[:13] == plain


def test_sampled_peaked_target_accepts_matching_one_hot_draft():
    generator = torch.Generator().manual_seed(0)
    noise = AcceptanceNoise.draw(1, 3, VOCAB, generator)
    noise.uniform_BK.fill_(0.999)
    result = _run([[1, 2, 3]], [[1, 2, 3, 4]], [3], params=T1, noise=noise)
    assert result.output_ids_BK1.tolist() == [[1, 2, 3, 4]]


def test_zero_draft_probability_is_always_accepted():
    """p_d(x) = 0 < p_t(x): the test u * 0 < p_t(x) accepts without dividing by zero."""
    logits_1K1V = torch.zeros(1, 2, VOCAB)
    draft_probs_1KV = torch.zeros(1, 1, VOCAB)
    draft_probs_1KV[0, 0, 5] = 1.0
    noise = AcceptanceNoise.draw(1, 1, VOCAB, torch.Generator().manual_seed(0))
    noise.uniform_BK.fill_(0.9999)
    result = accept_draft(torch.tensor([[2]]), draft_probs_1KV, logits_1K1V, torch.tensor([1]), T1,
                          noise, backend="torch")
    assert result.num_accepted_B.tolist() == [1]


def test_rejected_token_resamples_from_residual_only():
    """Recovered tokens come from max(0, p_t - p_d): never a token where p_d >= p_t."""
    generator = torch.Generator().manual_seed(5)
    batch = 2000
    target_V = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])
    draft_V = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.05, 0.05, 0.0, 0.0])
    logits_BK1V = target_V.log().expand(batch, 2, VOCAB)
    draft_ids_BK = torch.full((batch, 1), 1)  # over-proposed token: p_t/p_d = 0.6
    noise = AcceptanceNoise.draw(batch, 1, VOCAB, generator)
    result = accept_draft(draft_ids_BK, draft_V.expand(batch, 1, VOCAB), logits_BK1V, torch.full((batch,), 1),
                          T1, noise, backend="torch")
    rejected_B = result.num_accepted_B == 0
    assert 0.3 < rejected_B.float().mean() < 0.5  # analytic rejection probability 0.4
    assert set(result.output_ids_BK1[rejected_B, 0].tolist()) == {0}  # only token 0 has residual mass


def test_degenerate_residual_falls_back_to_target():
    """p_d == p_t and the draft token has probability 0 under both: rejected, residual is all zero."""
    params = SamplingParams(temperature=1.0, top_k=3)
    logits_1K1V = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]] * 2])
    draft_probs_1KV = probs_from_logits(logits_1K1V[:, :1], params)
    noise = AcceptanceNoise.draw(1, 1, VOCAB, torch.Generator().manual_seed(0))
    result = accept_draft(torch.tensor([[6]]), draft_probs_1KV, logits_1K1V, torch.tensor([1]), params, noise,
                          backend="torch")
    assert result.num_accepted_B.tolist() == [0]
    expected = int((probs_from_logits(logits_1K1V[0, 0], params) / noise.exponential_BV[0]).argmax())
    assert result.output_ids_BK1.tolist() == [[expected, -1]]


def test_residual_above_reference_threshold_is_sampled(small_residual_case):
    """A real residual of mass 1e-6 (between the reference's 1e-8 and the former 1e-5) is sampled: every
    rejected request emits the only token with residual mass, never the target's mode."""
    result = accept_draft(*small_residual_case(1e-6), backend="torch")
    assert result.num_accepted_B.eq(0).all()
    assert set(result.output_ids_BK1[:, 0].tolist()) == {1}


def test_residual_below_threshold_falls_back_to_target(small_residual_case):
    assert acceptance.RESIDUAL_MASS_EPS == 1e-8
    result = accept_draft(*small_residual_case(1e-9), backend="torch")
    assert result.num_accepted_B.eq(0).all()
    assert set(result.output_ids_BK1[:, 0].tolist()) == {0}


def test_same_noise_gives_same_tokens():
    """The emitted tokens are a function of the inputs and the noise only: not of the global RNG, not of the
    other requests in the batch; and the noise does matter (other noise, other tokens)."""
    generator = torch.Generator().manual_seed(9)
    logits_BK1V = torch.randn(4, 3, VOCAB, generator=generator)
    draft_ids_BK = torch.randint(0, VOCAB, (4, 2), generator=generator)
    num_draft_B = torch.tensor([2, 1, 0, 2])
    noise = AcceptanceNoise.draw(4, 2, VOCAB, generator)

    def accept(rows, noise):
        return accept_draft(draft_ids_BK[rows], None, logits_BK1V[rows], num_draft_B[rows], T1, noise,
                            backend="torch").output_ids_BK1

    everyone = slice(None)
    first = accept(everyone, noise)
    torch.rand(1000)  # the global RNG moves; the result must not
    assert torch.equal(accept(everyone, noise), first)
    for row in range(4):  # each request alone, with its own noise rows, emits what it emitted in the batch
        alone = AcceptanceNoise(noise.uniform_BK[row:row + 1], noise.exponential_BV[row:row + 1])
        assert torch.equal(accept(slice(row, row + 1), alone), first[row:row + 1])
    others = [accept(everyone, AcceptanceNoise.draw(4, 2, VOCAB, generator)) for _ in range(8)]
    assert any(not torch.equal(other, first) for other in others)


def test_noise_draw_shapes_and_ranges():
    noise = AcceptanceNoise.draw(3, 4, 10, torch.Generator().manual_seed(0))
    assert noise.uniform_BK.shape == (3, 4) and noise.exponential_BV.shape == (3, 10)
    assert ((noise.uniform_BK >= 0) & (noise.uniform_BK < 1)).all() and (noise.exponential_BV > 0).all()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"draft_ids_BK": torch.zeros(2, dtype=torch.long)}, "draft_ids_BK"),
        ({"target_logits_BK1V": torch.zeros(2, 2, VOCAB)}, "target_logits_BK1V"),
        ({"draft_probs_BKV": torch.zeros(2, 2, VOCAB + 1)}, "draft_probs_BKV"),
        ({"num_draft_B": torch.tensor([1, 3])}, "num_draft_B"),
        ({"num_draft_B": torch.tensor([1])}, "num_draft_B"),
        ({"noise": None}, "noise"),
        ({"noise": AcceptanceNoise(torch.zeros(2, 2), torch.ones(2, VOCAB + 1))}, "exponential_BV"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_inputs_raise_value_error(change, message):
    kwargs = dict(
        draft_ids_BK=torch.zeros(2, 2, dtype=torch.long),
        draft_probs_BKV=None,
        target_logits_BK1V=torch.zeros(2, 3, VOCAB),
        num_draft_B=torch.tensor([1, 2]),
        params=T1,
        noise=AcceptanceNoise(torch.zeros(2, 2), torch.ones(2, VOCAB)),
        backend="torch",
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        accept_draft(**kwargs)


def test_auto_backend_falls_back_to_torch_on_cpu_with_notice(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = (torch.tensor([[1, 2]]), None, _logits_with_argmax([[1, 2, 3]]), torch.tensor([2]), GREEDY, None)
    accept = acceptance.Acceptance("auto")  # one per decoding run: resolves the backend once
    with caplog.at_level(logging.INFO, logger="deepspec.decoding.acceptance"):
        auto = accept(*args)
        accept(*args)
    notices = [r for r in caplog.records if "PyTorch reference" in r.getMessage()]
    assert len(notices) == 1
    assert torch.equal(auto.output_ids_BK1, accept_draft(*args, backend="torch").output_ids_BK1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        accept_draft(*args, backend="triton")
