"""The Triton acceptance kernels give exactly the reference's tokens and counts for the same noise.

Runs on CPU through the Triton interpreter: TRITON_INTERPRET=1 must be set when the kernels are
decorated, so this module sets it before importing `acceptance_triton` (reloading it if it was
imported earlier without the interpreter), then restores the environment so other test modules
keep their own backend choice; each test sets the variable again through a fixture.
Grids stay small (the interpreter runs one program at a time).

Shape legend: B = requests, K = draft tokens, K1 = K + 1 target rows, V = vocab.
"""

import importlib
import os

import pytest
import torch

_previous_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    acceptance_triton = pytest.importorskip("deepspec.decoding.acceptance_triton")
    if not acceptance_triton.INTERPRETED:
        acceptance_triton = importlib.reload(acceptance_triton)
finally:
    if _previous_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous_interpret

from deepspec.decoding.acceptance import AcceptanceNoise, accept_draft  # noqa: E402
from deepspec.decoding.sampling import SamplingParams, probs_from_logits  # noqa: E402

T1 = SamplingParams(temperature=1.0)  # plain sampling at T = 1, no filter


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _assert_same(args) -> None:
    reference = accept_draft(*args, backend="torch")
    kernel = accept_draft(*args, backend="triton")
    assert kernel.output_ids_BK1.dtype == torch.int64
    assert kernel.output_ids_BK1.tolist() == reference.output_ids_BK1.tolist()
    assert kernel.num_accepted_B.tolist() == reference.num_accepted_B.tolist()
    assert kernel.num_emitted_B.tolist() == reference.num_emitted_B.tolist()


def _random_case(batch, num_draft, vocab, seed, with_draft_probs, params):
    generator = torch.Generator().manual_seed(seed)
    target_logits_BK1V = torch.randn(batch, num_draft + 1, vocab, generator=generator) * 2.0
    draft_logits_BKV = target_logits_BK1V[:, :num_draft] + torch.randn(batch, num_draft, vocab, generator=generator)
    draft_probs_BKV = probs_from_logits(draft_logits_BKV, params) if with_draft_probs else None
    if with_draft_probs and not params.is_greedy:
        draft_ids_BK = torch.multinomial(draft_probs_BKV.reshape(-1, vocab), 1, generator=generator).view(batch, -1)
    else:
        draft_ids_BK = draft_logits_BKV.argmax(-1)
    # Ragged lengths including 0 (bonus/target token only); padding after them is -1.
    num_draft_B = torch.arange(batch) % (num_draft + 1)
    draft_ids_BK = torch.where(torch.arange(num_draft) < num_draft_B[:, None], draft_ids_BK, -1)
    noise = AcceptanceNoise.draw(batch, num_draft, vocab, generator)
    return draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise


@pytest.mark.parametrize("vocab", [1000, 4099])
@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_kernel_matches_reference(vocab, with_draft_probs, temperature):
    params = SamplingParams(temperature=temperature)
    _assert_same(_random_case(6, 3, vocab, seed=vocab + int(10 * temperature), with_draft_probs=with_draft_probs,
                              params=params))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=20),
                                    SamplingParams(temperature=0.8, top_k=50, top_p=0.7)])
def test_kernel_matches_reference_with_masked_vocab(params):
    _assert_same(_random_case(6, 3, 4099, seed=7, with_draft_probs=True, params=params))


def test_kernel_many_rejections_and_residual_samples():
    """Unrelated draft distribution: most requests reject and draw from the residual."""
    generator = torch.Generator().manual_seed(11)
    batch, num_draft, vocab = 8, 2, 1000
    target_logits_BK1V = torch.randn(batch, num_draft + 1, vocab, generator=generator) * 3.0
    draft_probs_BKV = torch.softmax(torch.randn(batch, num_draft, vocab, generator=generator) * 3.0, dim=-1)
    draft_ids_BK = draft_probs_BKV.argmax(-1)
    noise = AcceptanceNoise.draw(batch, num_draft, vocab, generator)
    args = (draft_ids_BK, draft_probs_BKV, target_logits_BK1V, torch.full((batch,), num_draft), T1,
            noise)
    assert (accept_draft(*args, backend="torch").num_accepted_B < num_draft).sum() >= batch // 2
    _assert_same(args)


def test_kernel_zero_draft_probability_and_degenerate_residual():
    params = SamplingParams(temperature=1.0, top_k=3)
    vocab = 1030
    generator = torch.Generator().manual_seed(2)
    target_logits_BK1V = torch.randn(3, 2, vocab, generator=generator)
    draft_probs_BKV = probs_from_logits(target_logits_BK1V[:, :1], params)
    top3_B3 = target_logits_BK1V[:, 0].topk(3).indices
    # Request 0: p_d == p_t and x outside top-k (both 0) -> rejected, all-zero residual -> p_t race.
    # Request 1: p_d(x) = 0 < p_t(x) -> accepted whatever u is.
    # Request 2: p_d == p_t, x inside top-k -> accepted (u * p < p).
    outside = int(torch.ones(vocab).index_fill_(0, top3_B3[0], 0).nonzero()[0])
    draft_ids_BK = torch.tensor([[outside], [int(top3_B3[1, 0])], [int(top3_B3[2, 1])]])
    draft_probs_BKV[1, 0] = 0.0
    draft_probs_BKV[1, 0, top3_B3[1, 1]] = 1.0
    noise = AcceptanceNoise.draw(3, 1, vocab, generator)
    noise.uniform_BK.fill_(0.9999)
    args = (draft_ids_BK, draft_probs_BKV, target_logits_BK1V, torch.ones(3, dtype=torch.long), params, noise)
    assert accept_draft(*args, backend="torch").num_accepted_B.tolist() == [0, 1, 1]
    _assert_same(args)


@pytest.mark.parametrize(("residual_mass", "expected_token"), [(1e-6, 1), (1e-9, 0)])
def test_kernel_small_residual_threshold_matches_reference(residual_mass, expected_token, small_residual_case):
    """The kernel applies the reference's residual threshold (1e-8): a 1e-6 residual is sampled (token 1),
    1e-9 falls back to p_t (token 0)."""
    args = small_residual_case(residual_mass, batch=8, vocab=1030)
    assert set(accept_draft(*args, backend="triton").output_ids_BK1[:, 0].tolist()) == {expected_token}
    _assert_same(args)


def test_kernel_without_drafts():
    generator = torch.Generator().manual_seed(4)
    logits_B1V = torch.randn(3, 1, 777, generator=generator)
    noise = AcceptanceNoise.draw(3, 0, 777, generator)
    for params in (T1, SamplingParams(temperature=0.0)):
        _assert_same((torch.zeros(3, 0, dtype=torch.long), None, logits_B1V, torch.zeros(3, dtype=torch.long), params,
                      noise))


def test_auto_backend_uses_triton_under_interpreter(monkeypatch):
    calls = []
    original = acceptance_triton.accept_draft_triton

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(acceptance_triton, "accept_draft_triton", spy)
    args = _random_case(2, 2, 300, seed=0, with_draft_probs=False, params=T1)
    auto = accept_draft(*args)
    assert calls == [1]
    assert auto.output_ids_BK1.tolist() == accept_draft(*args, backend="torch").output_ids_BK1.tolist()
