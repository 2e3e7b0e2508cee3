"""Standalone drafter: config checks, tokenizer check, distillation objective, train/serve parity, KV-cache
cropping, save/load, wrapping a causal LM from a folder / GGUF, losslessness in both loops, calibration."""

from __future__ import annotations

import json

import pytest
import torch

from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
from deepspec.decoding.loop import speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.build import build_drafter, load_drafter
from deepspec.drafters.chain.batching import collate_autoregressive
from deepspec.drafters.proposers import make_batch_proposer, make_proposer
from deepspec.drafters.spec import capabilities_of
from deepspec.drafters.standalone.config import StandaloneConfig, StandaloneLoss
from deepspec.drafters.standalone.proposer import StandaloneBatchProposer, confidence_logits
from deepspec.targets.tokenizer_check import tokenizer_mismatch
from deepspec.training.objective import compute_training_loss

from .conftest import make_chain_samples

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 77, 912, 33, 4001, 17, 250]


def build(target, seed=0, **overrides):
    torch.manual_seed(seed)
    return build_drafter("standalone", target, **overrides).eval()


def make_samples(target, lengths, seed=0, prompt_len=3, top_k=None):
    return make_chain_samples(target, lengths, seed=seed, prompt_len=prompt_len, top_k=top_k)


def batch_of(samples, row=32):
    return collate_autoregressive(samples, cache_layer_ids=[], feature_layer_ids=[], max_tokens_per_row=row)


def greedy_reference(model, prompt, num_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


# -- config ------------------------------------------------------------------------------------------
def test_config_validation_names_fields(tiny_llama):
    with pytest.raises(ValueError, match=r"^num_speculative_tokens=0 must be >= 1"):
        StandaloneConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"^num_draft_layers=0 must be >= 1"):
        StandaloneConfig(num_draft_layers=0)
    with pytest.raises(ValueError, match=r"^draft_hidden_size=0 must be >= 1"):
        StandaloneConfig(draft_hidden_size=0)
    with pytest.raises(ValueError, match=r"init_from_target=True needs draft_hidden_size == the target's 64"):
        build(tiny_llama, init_from_target=True, draft_hidden_size=32)
    with pytest.raises(ValueError, match=r"init_from_target_layers=\[7, 0\] must name 2 target layers in \[0, 4\)"):
        build(tiny_llama, init_from_target=True, init_from_target_layers=[7, 0])
    with pytest.raises(ValueError, match=r"draft_num_key_value_heads=3 must divide the 4 attention heads"):
        build(tiny_llama, draft_num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"loss.kl_weight \+ loss.tv_weight \+ loss.ce_weight must be > 0"):
        StandaloneLoss(kl_weight=0.0)
    with pytest.raises(ValueError, match=r"loss.tv_weight=-1.0 must be >= 0"):
        StandaloneLoss(tv_weight=-1.0)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_built_drafter_is_the_target_family_with_frozen_shared_parts(family, request):
    target = request.getfixturevalue(family)
    drafter = build(target)
    assert type(drafter.lm).__name__ == type(target.model.model).__name__  # e.g. LlamaModel: the family's stack
    assert len(drafter.lm.layers) == 2 and drafter.config.lm_config["vocab_size"] == 1
    names = set(drafter.state_dict())
    assert not any("lm_head" in n for n in names)
    assert drafter.lm.embed_tokens is None and not any("embed" in n for n in names)  # the target's, shared
    trainable = {id(p) for p in drafter.parameters()}
    assert id(target.model.get_input_embeddings().weight) not in trainable
    assert capabilities_of(drafter).num_positions == 5 and capabilities_of(drafter).confidence_head
    own = build(target, share_target_embeddings=False, init_from_target=True)
    assert torch.equal(own.lm.get_output_embeddings().weight, target.model.get_output_embeddings().weight)
    torch.testing.assert_close(own.lm.model.layers[1].mlp.down_proj.weight,
                               target.model.model.layers[3].mlp.down_proj.weight)
    narrow = build(target, draft_hidden_size=32)
    assert narrow.embed_proj.weight.shape == (32, 64) and narrow.head_proj.weight.shape == (64, 32)
    assert narrow.config.lm_config["num_attention_heads"] == 2


# -- tokenizer check ---------------------------------------------------------------------------------
def test_tokenizer_check_names_the_first_differing_token(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = tiny_llama.tokenizer
    assert tokenizer_mismatch(tokenizer, tokenizer) is None
    tokenizer.save_pretrained(tmp_path / "extra")
    extra = AutoTokenizer.from_pretrained(tmp_path / "extra")
    extra.add_tokens(["<draft_only_token>"])
    message = tokenizer_mismatch(tokenizer, extra)
    assert message == (f"vocabulary size: target {len(tokenizer)}, draft {len(tokenizer) + 1} tokens (first token only "
                       f"the draft has: id {len(tokenizer)} '<draft_only_token>')")
    data = json.loads((tmp_path / "extra" / "tokenizer.json").read_text())
    renamed = {name: (100 if token_id == 101 else 101 if token_id == 100 else token_id)
               for name, token_id in data["model"]["vocab"].items()}
    data["model"]["vocab"] = renamed
    (tmp_path / "swapped").mkdir()
    for item in (tmp_path / "extra").iterdir():
        (tmp_path / "swapped" / item.name).write_bytes(item.read_bytes())
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(data))
    swapped = AutoTokenizer.from_pretrained(tmp_path / "swapped")
    a, b = tokenizer.convert_ids_to_tokens(100), tokenizer.convert_ids_to_tokens(101)
    assert tokenizer_mismatch(tokenizer, swapped) == f"token id 100: target {a!r}, draft {b!r}"


def _save_tiny_lm(target, folder, family="llama", vocab_size=None, seed=1):
    from deepspec.targets.tiny import build_tiny_model

    model = build_tiny_model(family, vocab_size=vocab_size or len(target.tokenizer), seed=seed)
    model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return model


def test_wrapping_a_causal_lm_from_a_folder(tiny_qwen3, tmp_path):
    """A wrapped model (another family than the target's) keeps its own embedding/head and computes exactly its
    own logits; a padded vocabulary is cut to the target's; a foreign tokenizer is refused."""
    source = _save_tiny_lm(tiny_qwen3, tmp_path / "draft", family="llama", vocab_size=len(tiny_qwen3.tokenizer) + 64)
    drafter = build(tiny_qwen3, base_model=str(tmp_path / "draft"))
    assert type(drafter.lm).__name__ == "LlamaForCausalLM" and drafter.config.base_model_revision == "local"
    ids = torch.tensor([PROMPT])
    hidden = drafter.hidden_states(drafter.embed(ids), torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    expected = source(ids).logits[0, :, : len(tiny_qwen3.tokenizer)]
    torch.testing.assert_close(drafter.logits(hidden[0]), expected, rtol=0, atol=1e-5)
    # The same model drafts for the target losslessly, and reloads from its own checkpoint.
    reference = greedy_reference(tiny_qwen3.model, PROMPT, 20)
    result = speculative_generate(TargetVerifier(tiny_qwen3.model, []), make_proposer(drafter), PROMPT, 20, GREEDY)
    assert result.token_ids == reference
    drafter.save_pretrained(tmp_path / "saved")
    reloaded = load_drafter(tmp_path / "saved", tiny_qwen3).eval()
    torch.testing.assert_close(reloaded.logits(hidden[0]), drafter.logits(hidden[0]), rtol=0, atol=0)
    from transformers import AutoTokenizer

    foreign = AutoTokenizer.from_pretrained(tmp_path / "draft")
    foreign.add_tokens(["<other>"])
    foreign.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match=r"drafter.base_model='.*draft' does not share the target's tokenizer "
                                         r"\(vocabulary size: .* id 49152 '<other>'\)"):
        build(tiny_qwen3, base_model=str(tmp_path / "draft"))


@pytest.mark.slow
def test_wrapping_the_embedded_target_as_its_own_drafter_accepts_everything(smollm2):
    """The embedded SmolLM2 (loaded from its GGUF through the target loader) drafting for itself: greedy
    drafts are always the target's argmax, so every round accepts all of them."""
    from deepspec.data.chat import prompt_ids
    from deepspec.targets.load import locate_embedded_gguf

    drafter = build(smollm2, base_model=str(locate_embedded_gguf("smollm2-135m")), num_speculative_tokens=4)
    assert drafter.config.base_model_revision == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    prompt = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name three colours."}])
    reference = greedy_reference(smollm2.model, prompt, 16)
    result = speculative_generate(TargetVerifier(smollm2.model, []), make_proposer(drafter), prompt, 16, GREEDY)
    assert result.token_ids == reference
    assert all(r.accepted == r.proposed for r in result.rounds)


# -- objective ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [None, 16])
def test_training_step_gradients_and_rows(tiny_llama, top_k):
    drafter = build(tiny_llama).train()
    samples = make_samples(tiny_llama, [11, 8, 6], top_k=top_k)
    batch = batch_of(samples)
    target_before = {k: v.clone() for k, v in tiny_llama.model.state_dict().items()}
    result = compute_training_loss(drafter, batch, StandaloneLoss(kl_weight=1.0, tv_weight=0.5, ce_weight=0.1))
    result.loss.total.backward()
    # Every token after the 3-token prompt is one row: (11 - 3) + (8 - 3) + (6 - 3).
    assert result.terms.num_rows == 16 and result.loss.parts["num_rows"] == 16
    assert set(result.loss.parts) >= {"kl", "tv", "ce", "total"}
    for name, param in drafter.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert all(p.grad is None for p in tiny_llama.model.parameters())
    assert all(torch.equal(v, target_before[k]) for k, v in tiny_llama.model.state_dict().items())


def test_rows_are_next_token_predictions_against_the_target(tiny_llama):
    drafter = build(tiny_llama)
    sample = make_samples(tiny_llama, [10])[0]
    batch = batch_of([sample], 10)
    result = compute_training_loss(drafter, batch, StandaloneLoss(kl_weight=1.0, tv_weight=1.0, ce_weight=1.0))
    rows = torch.arange(2, 9)  # row t predicts x[t+1]: rows 2..8 have assistant labels 3..9
    hidden = drafter.sequence_hidden(batch.input_ids_BT, batch.sequence_ids_BT, batch.position_ids_BT)[0]
    logits = drafter.logits(hidden[rows])
    target_p = torch.softmax(tiny_llama.model.lm_head(sample.final_hidden[rows]), dim=-1)
    torch.testing.assert_close(result.terms.ce_N, torch.nn.functional.cross_entropy(logits, sample.input_ids[rows + 1],
                                                                                     reduction="none"))
    torch.testing.assert_close(result.terms.tv_N, (torch.softmax(logits, -1) - target_p).abs().sum(-1))


def test_validation_chains_are_consecutive_rows(tiny_llama):
    """With metrics, each supervised row starts a chain of up to K consecutive supervised rows of its sequence."""
    drafter = build(tiny_llama, num_speculative_tokens=3)
    samples = make_samples(tiny_llama, [7, 6], prompt_len=3)  # 4 + 3 rows, packed into one row of 13 tokens
    result = compute_training_loss(drafter, batch_of(samples, 13), with_metrics=True)
    pairs = sorted(zip(result.block_index_N.tolist(), result.position_index_N.tolist()))
    starts = [2, 3, 4, 5, 9, 10, 11]  # flat rows with a supervised label; the second sequence starts at 7
    expected = sorted((s, k) for s in starts for k in range(3) if (s + k) in starts and (s < 7) == (s + k < 7))
    assert pairs == expected
    assert torch.isfinite(result.terms.tv_N).all()


# -- decoding ----------------------------------------------------------------------------------------
def test_proposals_equal_the_training_forward(tiny_gemma3):
    """Train/serve parity: the KV-cached drafts and their distributions are the teacher-forced training logits."""
    drafter = build(tiny_gemma3, num_speculative_tokens=4)
    ids = torch.tensor(PROMPT + [44, 45, 46, 47])
    hidden = drafter.hidden_states(drafter.embed(ids[None]), torch.ones(1, ids.shape[0], dtype=torch.long),
                                   torch.arange(ids.shape[0])[None])[0]
    logits = drafter.logits(hidden)
    proposer = StandaloneBatchProposer(drafter, num_draft_tokens=1)
    proposer.add_request(ids[:6], None, None)
    sampled = proposer.propose(ids[6:7], torch.tensor([6]), SamplingParams(temperature=1.0),
                               torch.Generator().manual_seed(0))
    torch.testing.assert_close(sampled.probs_BKV[0, 0], torch.softmax(logits[6], -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sampled.confidence_BK[0, 0], torch.softmax(logits[6], -1)[sampled.token_ids_BK[0, 0]])
    # Greedy chain of 4 from a fresh request: every draft is the argmax of a full forward over prompt + drafts.
    proposer = StandaloneBatchProposer(drafter)
    proposer.add_request(ids[:7], None, None)
    drafts = proposer.propose(ids[7:8], torch.tensor([7]), GREEDY, None).token_ids_BK[0].tolist()
    context = ids[:8].tolist()
    for draft in drafts:
        full = drafter.hidden_states(drafter.embed(torch.tensor([context])),
                                     torch.ones(1, len(context), dtype=torch.long), torch.arange(len(context))[None])
        assert draft == int(drafter.logits(full[0, -1:]).argmax())
        context.append(draft)


def test_draft_cache_holds_exactly_the_accepted_prefix(tiny_qwen3):
    """After each round the draft KV cache has one slot per token the target kept (minus the next anchor)."""
    drafter = build(tiny_qwen3, num_speculative_tokens=3)
    proposer = make_proposer(drafter)
    verifier = TargetVerifier(tiny_qwen3.model, [])
    seen = []

    class Spy:
        max_tokens = proposer.max_tokens

        def reset(self, *args):
            proposer.reset(*args)

        def propose(self, *args):
            return proposer.propose(*args)

        def on_accept(self, token_ids_N, *rest):
            proposer.on_accept(token_ids_N, *rest)
            cache = proposer.batch.cache
            seen.append((cache.num_slots + len(proposer.batch.pending[0]), verifier.length, cache.hole_fraction()))

    result = speculative_generate(verifier, Spy(), PROMPT, 30, GREEDY)
    assert result.token_ids == greedy_reference(tiny_qwen3.model, PROMPT, 30)
    assert seen and all(slots == target_len and holes == 0.0 for slots, target_len, holes in seen)
    assert any(r.accepted == r.proposed for r in result.rounds) and any(r.accepted < r.proposed for r in result.rounds)


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("overrides", [{"share_target_embeddings": False}, {"draft_hidden_size": 32}],
                         ids=["own", "narrow"])  # the default (shared) runs in tests/drafters/test_every_kind.py
def test_greedy_identity_batch1(request, family, overrides):
    target = request.getfixturevalue(family)
    drafter = build(target, **overrides)
    reference = greedy_reference(target.model, PROMPT, 24)
    result = speculative_generate(TargetVerifier(target.model, []), make_proposer(drafter), PROMPT, 24, GREEDY)
    assert result.token_ids == reference


@pytest.mark.float_exact
@pytest.mark.parametrize("family,policy", [("tiny_llama", "fixed"), ("tiny_qwen3", "fixed"),
                                           ("tiny_qwen3", "threshold"), ("tiny_qwen3", "scheduler")])
def test_batched_greedy_equals_the_target_per_request(request, family, policy):
    """Several requests of different lengths, joining and leaving, one drafter KV row each; the verification
    policies read the drafter's confidences (scheduler: Algorithm 1 with a toy SPS curve)."""
    from deepspec.decoding.scheduler import VerificationPolicy

    target = request.getfixturevalue(family)
    drafter = build(target, num_speculative_tokens=3, share_target_embeddings=False)
    with torch.no_grad():  # sharper drafts: confidences spread over ~0.05..0.4, so the policies cut rows differently
        drafter.lm.lm_head.weight.mul_(8.0)
    prompts = [PROMPT, [1, 9, 8, 7], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308], [1, 42], [1, 5, 5, 5, 5]]
    budgets = [17, 9, 23, 5, 14]
    requests = [BatchRequest(p, n, request_id=i) for i, (p, n) in enumerate(zip(prompts, budgets))]
    verification = VerificationPolicy(policy, threshold=0.2) if policy == "threshold" else VerificationPolicy(policy)
    out = batched_speculative_generate(target.model, make_batch_proposer(drafter), requests, GREEDY,
                                       policy=verification,
                                       settings=ServingSettings(max_concurrency=3,
                                                                sps=lambda batch: 100.0 / (1.0 + 0.2 * batch)))
    for prompt, budget, result in zip(prompts, budgets, out.requests):
        assert result.token_ids == greedy_reference(target.model, prompt, budget)
    if policy != "fixed":  # confidence-dependent lengths: ragged rows in one round
        assert any(len(set(r.lengths)) > 1 for r in out.rounds)


def test_sampled_runs_are_reproducible_and_well_formed(tiny_qwen3):
    drafter = build(tiny_qwen3)
    sampling = SamplingParams(temperature=1.0, top_k=20)

    def run():
        return speculative_generate(TargetVerifier(tiny_qwen3.model, []), make_proposer(drafter), [1, 9, 8, 7, 6], 16,
                                    sampling, generator=torch.Generator().manual_seed(7))

    first, second = run(), run()
    assert first.token_ids == second.token_ids and len(first.token_ids) == 16
    assert all(1 <= r.tau and r.accepted <= r.proposed <= 5 for r in first.rounds)


def test_threshold_policy_reads_the_drafts_own_probabilities(tiny_llama):
    """Confidence c_k = the draft model's probability of its token (temperature-scaled after calibration), so a
    static threshold verifies drafts up to the first one below it, and the output stays the target's."""
    from deepspec.decoding.policies import threshold_policy

    drafter = build(tiny_llama, num_speculative_tokens=4)
    proposer = make_proposer(drafter)
    reference = greedy_reference(tiny_llama.model, PROMPT, 20)
    result = speculative_generate(TargetVerifier(tiny_llama.model, []), proposer, PROMPT, 20, GREEDY,
                                  length_policy=threshold_policy(0.5))
    assert result.token_ids == reference
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 5.0, 0.0]])
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(torch.sigmoid(confidence_logits(logits, torch.tensor([0, 1]))), p[[0, 1], [0, 1]])
    drafter.config.calibration_temperatures = [2.0, 2.0, 2.0, 2.0]
    proposer.reset(torch.tensor(PROMPT), None, None)
    proposal = proposer.propose(PROMPT[-1], len(PROMPT), GREEDY, None)
    torch.testing.assert_close(proposal.confidence_BK, torch.sigmoid(proposal.confidence_logits_BK / 2.0))


def test_calibration_uses_empirical_labels(tiny_llama, tmp_path):
    """STS fits one temperature per draft position from rollouts; analytic (teacher-forced block) labels are refused."""
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.calibration.config import CalibrationSchema
    from deepspec.calibration.run import calibrate
    from deepspec.data.sources import Conversation

    convs = [Conversation(id=f"c{i}", messages=[{"role": "user", "content": f"question {i} " + "word " * i},
                                                 {"role": "assistant", "content": "answer " * (i + 3)}],
                          source="t", line=i)
             for i in range(12)]
    build_cache({"train": convs[:4], "validation": convs[4:]}, tiny_llama,
                BuildJob(CacheSchema(out_dir=str(tmp_path / "cache"), layer_ids=[], max_length=48,
                                     storage_dtype="fp32", progress=False)))
    drafter = build(tiny_llama, num_speculative_tokens=3)
    drafter.save_pretrained(tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"labels='analytic': the confidences of drafter kind 'standalone' are "
                                         r"labelled \['empirical'\] only"):
        calibrate(tmp_path / "drafter", tmp_path / "cache", tiny_llama, CalibrationSchema(labels="analytic"))
    result = calibrate(tmp_path / "drafter", tmp_path / "cache", tiny_llama,
                       CalibrationSchema(min_samples=5, max_new_tokens=24))
    assert result.label_kind == "hard" and len(result.temperatures) == 3
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["calibration_temperatures"] == pytest.approx(result.temperatures)
    assert saved["calibration_label_kind"] == "empirical"


def _tiny_vocab_target(tokenizer, vocab: int, seed: int):
    """A 2-layer random Llama over `vocab` tokens with a sharpened head (peaked, distinct next-token laws)."""
    import transformers

    from deepspec.targets.load import LoadedTarget

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
        model.model.embed_tokens.weight.mul_(50.0)
    # The tokenizer only fingerprints the target here (token ids never leave [0, vocab)).
    return LoadedTarget(model=model, tokenizer=tokenizer, name="tiny-vocab", path="<memory>", revision=f"seed{seed}")


@torch.no_grad()
def _joint_law(model, prompt, num_tokens, vocab):
    """Exact law of the next `num_tokens` sampled tokens: [vocab] * num_tokens, by enumerating every prefix."""
    law = torch.ones(())
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(num_tokens):
        ids = torch.cat([torch.tensor(prompt).expand(prefixes.shape[0], -1), prefixes], dim=1)
        step = torch.softmax(model(ids).logits[:, -1].double(), dim=-1).view(*([vocab] * prefixes.shape[1]), vocab)
        law = law[..., None] * step
        length = prefixes.shape[1] + 1
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * length).view(-1, length)
    return law


@pytest.mark.slow
def test_sampled_output_has_the_target_law(tiny_llama):
    """T=1 losslessness through the real batched loop: 40,000 requests of one prompt, each emitting 4 tokens (the
    first from the prefill, then rounds verifying up to 2 drafts of a standalone drafter whose own law differs
    from the target's). The empirical joint law of the 4 tokens must match the target's exact law (Pearson
    chi-square over bins with expectation >= 5, the rest pooled, below dof + 6 sqrt(2 dof))."""
    import math

    vocab, num_tokens, num_requests, prompt = 5, 4, 40_000, [0, 3]
    target = _tiny_vocab_target(tiny_llama.tokenizer, vocab, seed=11)
    drafter = build(target, share_target_embeddings=False, num_draft_layers=1, num_speculative_tokens=3, seed=5)
    with torch.no_grad():
        drafter.lm.lm_head.weight.copy_(torch.randn_like(drafter.lm.lm_head.weight) * 3.0)
    law = _joint_law(target.model, prompt, num_tokens, vocab).flatten()
    requests = [BatchRequest(prompt, num_tokens, request_id=i) for i in range(num_requests)]
    out = batched_speculative_generate(target.model, make_batch_proposer(drafter), requests,
                                       SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(2024),
                                       settings=ServingSettings(max_concurrency=num_requests))
    tokens = torch.tensor([r.token_ids for r in out.requests])
    assert tokens.shape == (num_requests, num_tokens)
    accepted = [a for r in out.requests for a in r.accepted]
    assert 0 < sum(accepted) < sum(p for r in out.requests for p in r.proposed)  # drafts accepted and rejected
    index = sum(tokens[:, i] * vocab ** (num_tokens - 1 - i) for i in range(num_tokens))
    counts = torch.bincount(index, minlength=vocab ** num_tokens).double()
    expected = law * num_requests
    large = expected >= 5
    assert counts[law == 0].sum() == 0
    observed = torch.cat([counts[large], counts[~large].sum()[None]])
    expect = torch.cat([expected[large], expected[~large].sum()[None]])
    stat = float(((observed - expect) ** 2 / expect).sum())
    dof = int(large.sum())
    assert stat < dof + 6 * math.sqrt(2 * dof), f"chi2={stat:.1f} with {dof} dof"
