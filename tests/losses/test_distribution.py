"""Chunked distribution terms == one-shot reference (values, gradients), ranges, memory behaviour."""

import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F

from deepspec.losses.distribution import (
    DistributionTerms,
    ReducedVocab,
    TermsOptions,
    distribution_terms,
    distribution_terms_naive,
    row_terms_from_logits,
)

torch.set_num_threads(1)
N, H, V, R = 11, 8, 37, 4
LSE_TERMS = ("ce", "tv")  # soft CE is infinite against the target's mass outside a reduced vocabulary


def make_inputs(seed=0, reduced_vocab=None, with_bias=False, head_grad=False):
    g = torch.Generator().manual_seed(seed)
    vocab_draft = reduced_vocab or V
    draft_hidden = torch.randn(N, H, generator=g).requires_grad_(True)
    draft_head = (torch.randn(vocab_draft, H, generator=g) * 0.5).requires_grad_(head_grad)
    target_hidden = torch.randn(N, H, generator=g)
    target_head = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, vocab_draft, (N,), generator=g)
    labels[[2, 7]] = -100
    kwargs = {}
    if with_bias:
        bias_in = torch.randn(N, R, generator=g).requires_grad_(True)
        bias_out = (torch.randn(R, vocab_draft, generator=g) * 0.5).requires_grad_(True)
        kwargs["draft_bias"] = (bias_in, bias_out)
    if reduced_vocab:
        kwargs["reduced"] = ReducedVocab(torch.randperm(V, generator=g)[:reduced_vocab])
    return (draft_hidden, draft_head, target_hidden, target_head, labels), kwargs


def grads_of(terms: DistributionTerms, tensors):
    loss = 0.3 * terms.ce_N.sum() + 0.9 * terms.tv_N.sum() + 0.5 * terms.soft_ce_N.sum()
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def leaf_tensors(args, kwargs):
    leaves = [t for t in args if t.requires_grad]
    if "draft_bias" in kwargs:
        leaves += list(kwargs["draft_bias"])
    return leaves


@pytest.mark.parametrize("chunk_rows", [1, 3, 4, 11, 512])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduced_vocab", [None, 23])
def test_chunked_matches_naive(chunk_rows, with_bias, reduced_vocab):
    args, kwargs = make_inputs(with_bias=with_bias, reduced_vocab=reduced_vocab, head_grad=with_bias)
    chunked = distribution_terms(*args, **kwargs, options=TermsOptions(chunk_rows=chunk_rows))
    naive = distribution_terms_naive(*args, **kwargs)
    for name in ("ce", "tv", "soft_ce"):
        # Chunked vs whole rows: other GEMM blocking and reduction order. A float32 log-sum-exp over the
        # vocabulary carries ~log2(V) ulps (~1e-6 relative; seen: 1.4e-6 at |x| ~ 8): 1e-5 bounds that.
        torch.testing.assert_close(chunked.term(name), naive.term(name), atol=1e-5, rtol=1e-5)
    assert torch.equal(chunked.draft_argmax_N, naive.draft_argmax_N)
    assert torch.equal(chunked.target_argmax_N, naive.target_argmax_N)
    assert torch.equal(chunked.valid_N, naive.valid_N)
    leaves = leaf_tensors(args, kwargs)
    for grad_chunked, grad_naive in zip(grads_of(chunked, leaves), grads_of(naive, leaves)):
        torch.testing.assert_close(grad_chunked, grad_naive, atol=1e-5, rtol=1e-5)  # same reason


def test_terms_match_closed_forms():
    args, kwargs = make_inputs(with_bias=True)
    draft_hidden, draft_head, target_hidden, target_head, labels = args
    terms = distribution_terms(*args, **kwargs, options=TermsOptions(chunk_rows=4))
    bias_in, bias_out = kwargs["draft_bias"]
    logits = draft_hidden @ draft_head.T + bias_in @ bias_out
    p_d, p_t = logits.softmax(-1), (target_hidden @ target_head.T).softmax(-1)
    valid = labels != -100
    torch.testing.assert_close(terms.ce_N[valid], F.cross_entropy(logits[valid], labels[valid], reduction="none"))
    assert torch.all(terms.ce_N[~valid] == 0)
    torch.testing.assert_close(terms.tv_N, (p_d - p_t).abs().sum(-1))
    torch.testing.assert_close(terms.soft_ce_N, -(p_t * logits.log_softmax(-1)).sum(-1))
    assert torch.all((terms.tv_N >= 0) & (terms.tv_N <= 2))


def test_reduced_vocab_renormalises_target():
    args, kwargs = make_inputs(reduced_vocab=5)
    terms = distribution_terms(*args, **kwargs)
    draft_hidden, draft_head, target_hidden, target_head, _ = args
    p_t = (target_hidden @ target_head[kwargs["reduced"].target_vocab_index].T).softmax(-1)
    p_d = (draft_hidden @ draft_head.T).softmax(-1)
    torch.testing.assert_close(terms.tv_N, (p_d - p_t).abs().sum(-1))
    assert torch.equal(terms.target_argmax_N, p_t.argmax(-1))


def test_tv_zero_when_distributions_coincide_and_two_when_disjoint():
    hidden = torch.randn(N, H, requires_grad=True)
    head = torch.randn(V, H)
    labels = torch.randint(0, V, (N,))
    terms = distribution_terms(hidden, head, hidden.detach(), head, labels, options=TermsOptions(chunk_rows=3))
    torch.testing.assert_close(terms.tv_N, torch.zeros(N), atol=1e-6, rtol=0)
    # Soft CE against itself is the entropy.
    p = (hidden @ head.T).softmax(-1)
    torch.testing.assert_close(terms.soft_ce_N, -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    # Nearly one-hot on different tokens: TV close to 2.
    draft_logits = torch.full((2, 6), -30.0)
    target_logits = torch.full((2, 6), -30.0)
    draft_logits[:, 0] = 30.0
    target_logits[:, 3] = 30.0
    _, tv, _ = row_terms_from_logits(draft_logits, target_logits, torch.tensor([0, -100]))
    torch.testing.assert_close(tv, torch.full((2,), 2.0))


def test_no_gradient_into_target_and_frozen_head():
    args, kwargs = make_inputs(with_bias=True)
    target_hidden = args[2].requires_grad_(True)
    target_head = args[3].requires_grad_(True)
    terms = distribution_terms(*args, **kwargs, options=TermsOptions(chunk_rows=5))
    (terms.tv_N.sum() + terms.ce_N.sum()).backward()
    assert target_hidden.grad is None and target_head.grad is None
    assert args[1].grad is None  # frozen shared LM head
    assert args[0].grad is not None and kwargs["draft_bias"][0].grad is not None
    assert kwargs["draft_bias"][1].grad is not None


def test_need_subset_and_missing_term_error():
    args, _ = make_inputs()
    terms = distribution_terms(*args, options=TermsOptions(need=("ce",)))
    assert terms.tv_N is None and terms.soft_ce_N is None
    with pytest.raises(ValueError, match="tv"):
        terms.term("tv")


def _largest_saved_numel(fn):
    largest = [0]

    def pack(tensor):
        largest[0] = max(largest[0], tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = fn()
    (terms.ce_N.sum() + terms.tv_N.sum() + terms.soft_ce_N.sum()).backward()
    return largest[0]


def test_chunked_path_saves_no_full_vocab_tensor():
    num_rows, vocab = 64, 257
    hidden = torch.randn(num_rows, H, requires_grad=True)
    head = torch.randn(vocab, H)
    target_hidden = torch.randn(num_rows, H)
    labels = torch.randint(0, vocab, (num_rows,))
    naive = _largest_saved_numel(lambda: distribution_terms_naive(hidden, head, target_hidden, head, labels))
    chunked = _largest_saved_numel(lambda: distribution_terms(hidden, head, target_hidden, head, labels,
                                                              options=TermsOptions(chunk_rows=8)))
    assert naive >= num_rows * vocab
    assert chunked < num_rows * vocab and chunked <= max(8 * vocab, vocab * H)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda a, k: (a[0][:, :3],) + a[1:], "draft_head_VH hidden size"),
        (lambda a, k: a[:4] + (torch.full((N,), V),), "labels_N"),
        (lambda a, k: a[:2] + (a[2][:3],) + a[3:], "target_hidden_NH"),
        (lambda a, k: a[:3] + (a[3][:5],) + a[4:], "target vocabulary"),
    ],
)
def test_bad_inputs_raise(change, field):
    args, kwargs = make_inputs()
    with pytest.raises(ValueError, match=field):
        distribution_terms(*change(args, kwargs), **kwargs)


def test_unchecked_path_asserts_row_counts_only():
    """check_values=False (a training step) skips the ValueErrors and keeps the asserts on row counts: labels with a
    row fewer would gather fewer CE rows without an error."""
    from deepspec.losses.term_checks import check_terms_inputs

    args, kwargs = make_inputs(with_bias=True)
    short_labels = args[:4] + (args[4][:-1],)
    with pytest.raises(ValueError, match="labels_N"):
        check_terms_inputs(*short_labels, **kwargs)
    with pytest.raises(AssertionError):
        distribution_terms(*short_labels, **kwargs, options=TermsOptions(check_values=False))
    checked = distribution_terms(*args, **kwargs)
    unchecked = distribution_terms(*args, **kwargs, options=TermsOptions(check_values=False))
    assert torch.equal(checked.tv_N, unchecked.tv_N) and torch.equal(checked.ce_N, unchecked.ce_N)


def test_bad_options_raise():
    args, _ = make_inputs()
    with pytest.raises(ValueError, match="chunk_rows"):
        distribution_terms(*args, options=TermsOptions(chunk_rows=0))
    with pytest.raises(ValueError, match="need"):
        distribution_terms(*args, options=TermsOptions(need=("kl",)))
    with pytest.raises(ValueError, match="bias_out_RV"):
        distribution_terms(*args, draft_bias=(torch.randn(N, R), torch.randn(R, V + 1)))
    with pytest.raises(ValueError, match="target_vocab_index"):
        distribution_terms(*args, reduced=ReducedVocab(torch.arange(V - 1)))
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="use_triton"):
            distribution_terms(*args, options=TermsOptions(use_triton=True))


def test_no_grad_mode_and_empty_input():
    args, _ = make_inputs()
    with torch.no_grad():
        terms = distribution_terms(*args, options=TermsOptions(chunk_rows=4))
    assert terms.tv_N.shape == (N,) and not terms.tv_N.requires_grad
    empty = distribution_terms(args[0][:0], args[1], args[2][:0], args[3], args[4][:0])
    assert empty.tv_N.shape == (0,) and empty.draft_argmax_N.dtype == torch.long
    assert math.isfinite(float(distribution_terms(*args).ce_N.detach().sum()))


@pytest.mark.parametrize("naive", [False, True])
def test_bf16_drafter_reads_fp32_target_head(naive):
    """bf16 training against a target kept in fp32 (trainer.precision=bf16 on a float32 target): the draft
    rows are bf16, the frozen heads fp32. The product runs in fp32 (the head is never rounded to bf16), so
    the terms equal those of the same bf16 values promoted by hand, and the gradient comes back in bf16."""
    (draft_hidden, draft_head, target_hidden, target_head, labels), _ = make_inputs()
    hidden_bf16 = draft_hidden.detach().to(torch.bfloat16).requires_grad_(True)
    target_bf16 = target_hidden.to(torch.bfloat16)
    promoted = hidden_bf16.detach().float().requires_grad_(True)
    fn = distribution_terms_naive if naive else distribution_terms
    mixed = fn(hidden_bf16, draft_head, target_bf16, target_head, labels)
    by_hand = fn(promoted, draft_head, target_bf16.float(), target_head, labels)
    for name in ("ce", "tv", "soft_ce"):
        assert torch.equal(mixed.term(name), by_hand.term(name)), name
    (grad_mixed,) = grads_of(mixed, [hidden_bf16])
    (grad_by_hand,) = grads_of(by_hand, [promoted])
    assert grad_mixed.dtype == torch.bfloat16
    assert torch.equal(grad_mixed, grad_by_hand.to(torch.bfloat16))


# -- exact target side of a reduced draft vocabulary (target_lse_N) ---------------------------------------
def make_lse_inputs(seed=0, kept=9, with_bias=True):
    """Kept ids ascending (as d2t describes them); the target concentrated enough that some rows' argmax is
    outside the draft vocabulary and some inside."""
    (draft_hidden, _, target_hidden, target_head, _), _ = make_inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    target_hidden = target_hidden * 3
    index = torch.sort(torch.randperm(V, generator=g)[:kept]).values
    draft_head = (torch.randn(kept, H, generator=g) * 0.5)
    labels = torch.randint(0, kept, (N,), generator=g)
    labels[[2, 7]] = -100
    kwargs = {"reduced": ReducedVocab(index, torch.logsumexp(target_hidden @ target_head.T, dim=-1))}
    if with_bias:
        kwargs["draft_bias"] = (torch.randn(N, R, generator=g).requires_grad_(True),
                                (torch.randn(R, kept, generator=g) * 0.5).requires_grad_(True))
    return (draft_hidden, draft_head, target_hidden, target_head, labels), kwargs


def test_lse_target_probabilities_equal_the_full_softmax_restricted():
    from deepspec.losses.distribution import outside_mass

    (_, _, target_hidden, target_head, _), kwargs = make_lse_inputs()
    index, lse = kwargs["reduced"].target_vocab_index, kwargs["reduced"].target_lse_N
    p_full_NV = torch.softmax(target_hidden @ target_head.T, dim=-1)
    p_kept_NK = torch.exp(target_hidden @ target_head[index].T - lse[:, None])
    torch.testing.assert_close(p_kept_NK, p_full_NV[:, index], rtol=1e-5, atol=1e-7)
    outside = torch.ones(V, dtype=torch.bool)
    outside[index] = False
    torch.testing.assert_close(outside_mass(target_hidden @ target_head[index].T, lse), p_full_NV[:, outside].sum(-1),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 512])
def test_lse_tv_equals_full_vocabulary_tv_of_the_zero_extended_draft(chunk_rows):
    tensors, kwargs = make_lse_inputs()
    draft_hidden, draft_head, target_hidden, target_head, labels = tensors
    index = kwargs["reduced"].target_vocab_index
    terms = distribution_terms(*tensors, **kwargs, options=TermsOptions(need=LSE_TERMS, chunk_rows=chunk_rows))
    bias_in, bias_out = kwargs["draft_bias"]
    p_kept_NK = torch.softmax(draft_hidden @ draft_head.T + bias_in @ bias_out, dim=-1)
    p_draft_NV = torch.zeros(N, V).index_copy(1, index, p_kept_NK)  # zeros outside the draft vocabulary
    p_target_NV = torch.softmax(target_hidden @ target_head.T, dim=-1)
    full_tv_N = (p_draft_NV - p_target_NV).abs().sum(-1)
    torch.testing.assert_close(terms.tv_N, full_tv_N, rtol=1e-5, atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[index] = False
    assert float(p_target_NV[:, outside].sum(-1).max()) > 0.5, "the target should put mass outside the draft vocabulary"
    # CE of kept labels is the plain draft CE; the argmaxes are exact over the whole vocabulary.
    valid = labels != -100
    expected_ce = -torch.log(p_kept_NK[valid, labels[valid]])
    torch.testing.assert_close(terms.ce_N[valid], expected_ce, rtol=1e-5, atol=1e-6)
    draft_id_of = torch.full((V,), -1, dtype=torch.long)
    draft_id_of[index] = torch.arange(index.shape[0])
    assert torch.equal(terms.target_argmax_N, draft_id_of[p_target_NV.argmax(-1)])
    assert (terms.target_argmax_N == -1).any() and (terms.target_argmax_N >= 0).any()
    assert torch.equal(terms.draft_argmax_N, p_kept_NK.argmax(-1))


def test_lse_unresolved_argmax_marks_maybe_outside_rows():
    tensors, kwargs = make_lse_inputs(with_bias=False)
    exact = distribution_terms(*tensors, **kwargs, options=TermsOptions(need=LSE_TERMS))
    quick_side = dataclasses.replace(kwargs["reduced"], exact_target_argmax=False)
    quick = distribution_terms(*tensors, reduced=quick_side, options=TermsOptions(need=LSE_TERMS))
    assert torch.equal(quick.tv_N, exact.tv_N)
    kept_rows = quick.target_argmax_N >= 0  # a kept token beat the whole outside mass: exact already
    assert torch.equal(quick.target_argmax_N[kept_rows], exact.target_argmax_N[kept_rows])
    assert (exact.target_argmax_N[~kept_rows] >= 0).any() and (exact.target_argmax_N[~kept_rows] == -1).any()


def test_lse_chunked_matches_naive_values_and_gradients():
    tensors, kwargs = make_lse_inputs()
    leaves = (tensors[0], *kwargs["draft_bias"])
    chunked = distribution_terms(*tensors, **kwargs, options=TermsOptions(need=LSE_TERMS, chunk_rows=3))
    naive = distribution_terms_naive(*tensors, **kwargs, need=LSE_TERMS)
    for name in ("ce", "tv"):
        torch.testing.assert_close(chunked.term(name), naive.term(name), rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked.target_argmax_N, naive.target_argmax_N)
    loss = lambda t: (t.ce_N + 0.7 * t.tv_N).sum()  # noqa: E731
    for a, b in zip(torch.autograd.grad(loss(chunked), leaves), torch.autograd.grad(loss(naive), leaves)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_lse_with_the_full_vocabulary_kept_is_the_plain_terms():
    """Keeping every id, the outside mass is ~0 and the exact path equals the ordinary full-vocabulary terms."""
    (draft_hidden, _, target_hidden, target_head, labels), _ = make_inputs()
    lse = torch.logsumexp(target_hidden @ target_head.T, dim=-1)
    exact = distribution_terms(draft_hidden, target_head, target_hidden, target_head, labels,
                               reduced=ReducedVocab(torch.arange(V), lse), options=TermsOptions(need=LSE_TERMS))
    plain = distribution_terms(draft_hidden, target_head, target_hidden, target_head, labels,
                               options=TermsOptions(need=("ce", "tv")))
    torch.testing.assert_close(exact.tv_N, plain.tv_N, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exact.ce_N, plain.ce_N)
    assert torch.equal(exact.target_argmax_N, plain.target_argmax_N)


def test_lse_input_checks():
    tensors, kwargs = make_lse_inputs(with_bias=False)
    index, lse = kwargs["reduced"].target_vocab_index, kwargs["reduced"].target_lse_N
    with pytest.raises(ValueError, match="soft_ce is infinite"):
        distribution_terms(*tensors, **kwargs, options=TermsOptions(need=("ce", "tv", "soft_ce")))
    with pytest.raises(ValueError, match="target_lse_N must be"):
        distribution_terms(*tensors, reduced=ReducedVocab(index, lse[:3]), options=TermsOptions(need=LSE_TERMS))
    with pytest.raises(ValueError, match="ascending"):
        distribution_terms(*tensors, reduced=ReducedVocab(index.flip(0), lse), options=TermsOptions(need=LSE_TERMS))
def _top_k_of_target(target_hidden, target_head, k):
    logp_NV = torch.log_softmax((target_hidden @ target_head.T).float(), dim=-1)
    top = torch.topk(logp_NV, k, dim=-1)
    return top.indices, top.values


@pytest.mark.parametrize("chunk_rows", [3, 512])
def test_top_k_terms_with_the_whole_vocabulary_equal_the_full_terms(chunk_rows):
    """k = V: the coarsened distributions are the distributions, so TV and soft CE are exact (values, gradients)."""
    from deepspec.losses.distribution import top_k_target_terms

    (draft_hidden, draft_head, target_hidden, target_head, labels), _ = make_inputs(seed=3)
    ids, logprobs = _top_k_of_target(target_hidden, target_head, V)
    full = distribution_terms(draft_hidden, draft_head, target_hidden, target_head, labels)
    top = top_k_target_terms(draft_hidden, draft_head, ids, logprobs, labels,
                             options=TermsOptions(chunk_rows=chunk_rows))
    for name in ("ce", "tv", "soft_ce"):
        torch.testing.assert_close(top.term(name), full.term(name), rtol=1e-5, atol=1e-5)
    assert torch.equal(top.target_argmax_N, full.target_argmax_N)
    assert torch.equal(top.draft_argmax_N, full.draft_argmax_N)
    grad_full = grads_of(full, [draft_hidden])
    grad_top = grads_of(top, [draft_hidden])
    torch.testing.assert_close(grad_top[0], grad_full[0], rtol=1e-4, atol=1e-5)


def test_top_k_terms_are_lower_bounds_and_match_the_coarsened_closed_form():
    from deepspec.losses.distribution import top_k_target_terms

    (draft_hidden, draft_head, target_hidden, target_head, labels), _ = make_inputs(seed=5)
    k = 4
    ids, logprobs = _top_k_of_target(target_hidden, target_head, k)
    full = distribution_terms(draft_hidden, draft_head, target_hidden, target_head, labels)
    top = top_k_target_terms(draft_hidden, draft_head, ids, logprobs, labels)
    assert (top.tv_N <= full.tv_N + 1e-6).all() and (top.tv_N < full.tv_N - 1e-4).any()
    torch.testing.assert_close(top.ce_N, full.ce_N)
    p_d = torch.softmax(draft_hidden @ draft_head.T, dim=-1).double()
    p_t = torch.softmax(target_hidden @ target_head.T, dim=-1).double()
    in_top = torch.zeros_like(p_d, dtype=torch.bool).scatter_(1, ids, True)
    rest_d, rest_t = (p_d * ~in_top).sum(-1), (p_t * ~in_top).sum(-1)
    coarse_tv = ((p_d - p_t).abs() * in_top).sum(-1) + (rest_d - rest_t).abs()
    coarse_soft_ce = -(p_t * p_d.log() * in_top).sum(-1) - rest_t * rest_d.log()
    torch.testing.assert_close(top.tv_N.double(), coarse_tv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(top.soft_ce_N.double(), coarse_soft_ce, rtol=1e-5, atol=1e-6)
    # KL(coarse p_t || coarse p_d) <= KL(p_t || p_d): coarsening loses information.
    coarse_entropy = -(p_t * p_t.log() * in_top).sum(-1) - rest_t * rest_t.log()
    full_entropy = -(p_t * p_t.log()).sum(-1)
    assert ((top.soft_ce_N.double() - coarse_entropy) <= (full.soft_ce_N.double() - full_entropy) + 1e-6).all()


def test_top_k_terms_refuse_bad_shapes_and_ids():
    from deepspec.losses.distribution import top_k_target_terms

    (draft_hidden, draft_head, target_hidden, target_head, labels), _ = make_inputs()
    ids, logprobs = _top_k_of_target(target_hidden, target_head, 3)
    with pytest.raises(ValueError, match=r"must both be \[11, K\]"):
        top_k_target_terms(draft_hidden, draft_head, ids[:5], logprobs[:5], labels)
    with pytest.raises(ValueError, match=r"top_k_ids_NK must be vocabulary ids in \[0, 37\)"):
        top_k_target_terms(draft_hidden, draft_head, ids + V, logprobs, labels)


def test_take_selects_rows_with_repeats():
    (draft_hidden, draft_head, target_hidden, target_head, labels), _ = make_inputs()
    terms = distribution_terms(draft_hidden.detach(), draft_head, target_hidden, target_head, labels)
    index = torch.tensor([4, 4, 0, 10])
    taken = terms.take(index)
    for name in ("ce_N", "tv_N", "soft_ce_N", "draft_argmax_N", "target_argmax_N", "valid_N"):
        assert torch.equal(getattr(taken, name), getattr(terms, name)[index])


def _saved_bytes(fn, need=("ce", "tv")):
    """Bytes of the tensors autograd keeps for backward (distinct storages), and the terms."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = fn()
    return sum(storages.values()), terms


def test_checkpoint_decision_follows_the_memory_budget():
    from deepspec.losses.distribution import SAVED_BYTES_PER_LOGIT, checkpoint_decision

    rows, vocab = 448, 49_152  # a 4 x 16-anchor DSpark step at full SmolLM2 vocabulary: ~336 MB saved
    assert not checkpoint_decision("auto", rows, vocab, budget_mb=1024).checkpoint
    assert checkpoint_decision("auto", rows * 8, vocab, budget_mb=1024).checkpoint
    assert checkpoint_decision("always", 1, 1).checkpoint and not checkpoint_decision("never", 10**6, 10**6).checkpoint
    decision = checkpoint_decision("auto", rows, vocab, budget_mb=100)
    assert decision.checkpoint and decision.saved_mb == rows * vocab * SAVED_BYTES_PER_LOGIT / 2**20
    assert "checkpoint_budget_mb=100" in decision.note and "checkpointed" in decision.note
    with pytest.raises(ValueError, match="loss.checkpoint"):
        checkpoint_decision("sometimes", 1, 1)


@pytest.mark.parametrize("with_bias", [False, True])
def test_checkpointing_changes_memory_not_numbers(with_bias):
    """never / always / auto give bit-identical terms and gradients (the recomputed forward is the same
    computation); without checkpointing autograd keeps about SAVED_BYTES_PER_LOGIT per logit, which is what
    `auto` budgets for, and with it no [N, V] tensor."""
    from deepspec.losses.distribution import SAVED_BYTES_PER_LOGIT

    num_rows, vocab = 96, 1031
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(num_rows, H, generator=g, requires_grad=True)
    head = torch.randn(vocab, H, generator=g)
    target_hidden = torch.randn(num_rows, H, generator=g)
    labels = torch.randint(0, vocab, (num_rows,), generator=g)
    kwargs = {}
    if with_bias:
        kwargs["draft_bias"] = (torch.randn(num_rows, R, generator=g, requires_grad=True),
                                torch.randn(R, vocab, generator=g, requires_grad=True))
    leaves = [hidden, *kwargs.get("draft_bias", ())]
    results = {}
    for mode, budget in (("never", 0.0), ("always", 0.0), ("auto", 1e9), ("auto", 0.0)):
        # _saved_bytes calls it at once; the defaults only make the binding to this iteration explicit.
        options = TermsOptions(chunk_rows=32, need=("ce", "tv"), checkpoint=mode, checkpoint_budget_mb=budget)
        saved, terms = _saved_bytes(lambda options=options: distribution_terms(
            hidden, head, target_hidden, head, labels, **kwargs, options=options))
        grads = torch.autograd.grad(0.1 * terms.ce_N.sum() + 0.9 * terms.tv_N.sum(), leaves)
        results[(mode, budget)] = (saved, terms, grads)
        assert terms.checkpoint.checkpoint == (mode == "always" or (mode == "auto" and budget == 0.0))
    reference = results[("always", 0.0)]
    for _saved, terms, grads in results.values():
        assert torch.equal(terms.ce_N, reference[1].ce_N) and torch.equal(terms.tv_N, reference[1].tv_N)
        assert all(torch.equal(a, b) for a, b in zip(grads, reference[2]))
    logits = num_rows * vocab
    never_saved = results[("never", 0.0)][0]
    assert never_saved >= 2 * 4 * logits  # at least two fp32 [N, V] tensors are kept without checkpointing
    assert never_saved <= SAVED_BYTES_PER_LOGIT * logits * 1.25  # ... and the budget rule does not undercount
    assert results[("always", 0.0)][0] < 4 * logits / 2  # checkpointed: only chunk inputs, no [N, V] tensor
    assert results[("auto", 1e9)][0] == never_saved and results[("auto", 0.0)][0] == reference[0]


def test_soft_ce_is_computed_only_when_asked():
    args, kwargs = make_inputs()
    terms = distribution_terms(*args, **kwargs, options=TermsOptions(chunk_rows=4, need=("ce", "tv")))
    assert terms.soft_ce_N is None
    full = distribution_terms(*args, **kwargs, options=TermsOptions(chunk_rows=4))
    assert torch.equal(terms.tv_N, full.tv_N) and torch.equal(terms.ce_N, full.ce_N)


def _meta_inputs(reduced: bool):
    """The loss's inputs on the meta device: shapes without values, so reading any value raises."""
    meta, vocab = torch.device("meta"), 23 if reduced else V
    args = (torch.empty(N, H, device=meta, requires_grad=True), torch.empty(vocab, H, device=meta, requires_grad=True),
            torch.empty(N, H, device=meta), torch.empty(V, H, device=meta),
            torch.empty(N, dtype=torch.long, device=meta))
    kwargs = {"draft_bias": (torch.empty(N, R, device=meta, requires_grad=True),
                             torch.empty(R, vocab, device=meta, requires_grad=True))}
    if reduced:
        kwargs["reduced"] = ReducedVocab(torch.empty(vocab, dtype=torch.long, device=meta),
                                         torch.empty(N, device=meta), exact_target_argmax=False)
    return args, kwargs


@pytest.mark.parametrize("reduced", [False, True])
def test_training_loss_path_reads_no_value_from_the_device(reduced):
    """A training step's loss (the terms, then the block and stepwise objectives, then backward) reads no value back
    to the host: no host sync per loss call. Its checks are shapes and dtypes; `check_values=True` (the debug switch,
    `loss.check_values`) keeps the value checks, which read the device."""
    from deepspec.losses.objectives import dspark_objective, eagle3_objective
    from deepspec.losses.position_weights import position_weights, ttt_step_weights

    args, kwargs = _meta_inputs(reduced)
    terms = distribution_terms(*args, **kwargs,
                               options=TermsOptions(need=("ce", "tv"), checkpoint="never", check_values=False))
    block = dspark_objective(terms, torch.empty(N, device="meta", requires_grad=True),
                             torch.empty(N, dtype=torch.long, device="meta"), position_weights(4), check_values=False)
    block.total.backward()
    if not reduced:  # Eagle3's steps (soft CE needs the full target distribution)
        steps = [distribution_terms(*args, options=TermsOptions(check_values=False)) for _ in range(2)]
        eagle3_objective(steps, ttt_step_weights(2)).total.backward()
    with pytest.raises((RuntimeError, NotImplementedError)):  # the debug checks read the labels' values
        distribution_terms(*args, **kwargs, options=TermsOptions(need=("ce", "tv")))


def test_training_passes_the_value_checks_switch(monkeypatch):
    """`loss.check_values` (off by default) reaches the terms through the kind's loss keywords."""
    from deepspec.drafters.dspark.config import DSparkLoss

    assert DSparkLoss().terms_options().check_values is False
    assert DSparkLoss(check_values=True).terms_options().check_values is True
