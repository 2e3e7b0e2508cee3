"""The suite every registered drafter kind runs, with its tiny test config (`TINY_DRAFTERS`, tests/conftest.py):
a kind gets all of it by registering. Everything goes through the kind's spec and the protocols the stages use
(batcher, objective, proposers, save_pretrained / load_drafter, the export layouts), never through its classes:

- build: the spec's classes, the kind's capabilities, no parameter shared with the frozen target;
- forward shapes: one training batch of the kind's batcher, rows and draft positions of the objective;
- train step: gradients reach every trainable parameter and no target one, the target is unchanged, a few
  steps on one batch lower the loss;
- save/load: the reloaded drafter has the same config and tensors (its own aligned storage, independent of the
  file), the same loss and the same proposals;
- lossless greedy decoding: the batch-1 loop and the batched loop give the target's own greedy output token for
  token (every target family, Gemma 3's sliding-window layers included);
- export: every layout the kind's capabilities allow for the target (`formats_for`) reads back to the same
  proposals;
- draft layers of another family (`drafter.layer_family`: a Llama target with Qwen3 layers, a Qwen3 target with
  Llama layers, for every kind built from layers at the target's widths): that family's layers at the target's
  widths next to the target's own frozen parts, a train step, lossless greedy decoding, save/load and every
  layout `formats_for` allows with that family (the engine layouts the option exists for among them).

Proposals are compared through the decoding loop itself: sampled rounds (T=1, a seeded generator) record every
`DraftProposal` (tokens, the distribution they were drawn from, confidences), which must be bit-identical.

Shape legend: N = rows of the objective.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deepspec.cache.memory import capture_samples
from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
from deepspec.decoding.loop import speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.base import describe_params
from deepspec.drafters.build import load_drafter
from deepspec.drafters.proposers import make_batch_proposer, make_proposer
from deepspec.drafters.spec import BatchSettings, drafter_kinds, get_drafter_spec, spec_of
from deepspec.export import export_drafter, formats_for, load_checkpoint, load_exported
from deepspec.training.objective import compute_training_loss

KINDS = drafter_kinds()
FAMILIES = ["tiny_llama", "tiny_qwen3", "tiny_gemma3"]
IDS = [[1, 5, 77, 912, 33, 4001, 17, 300, 42, 9, 8, 7, 6, 5, 4, 3, 2000, 1500],
       [7, 8, 9, 10, 11, 12, 13, 14, 15, 99, 3, 4, 1000, 20, 30, 40]]
PROMPTS = [[1, 5, 77, 912, 33, 4001, 17, 250], [1, 9, 8, 7, 6]]
GREEDY = SamplingParams(temperature=0.0)
ALLOCATOR_ALIGNMENT = 64  # c10's CPU allocator aligns every allocation to 64 bytes
VERIFIER = "deepspec-tests/tiny-random"  # the vLLM layout's verifier: a hub id, written as given


def randomised(drafter):
    """Every weight drawn anew (norms around 1), so each saved tensor matters to the outputs."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return drafter.eval()


def training_batch(drafter, target):
    """One batch of the kind's batcher from in-memory samples of `target` (the layers the drafter reads)."""
    layer_ids = list(drafter.config.target_layer_ids)
    samples = capture_samples(target, IDS, layer_ids)
    settings = BatchSettings(cache_layer_ids=layer_ids, feature_layer_ids=layer_ids, max_anchors_per_seq=6,
                             max_tokens_per_row=40)
    batcher = spec_of(drafter).make_batcher(drafter.config, settings)
    return samples, batcher, batcher.collate(samples, 0)


def prepared(drafter, samples, target):
    """The kind's data-dependent initialisation (draft vocabulary, bigram-started heads), as training runs it."""
    from types import SimpleNamespace

    prepare = spec_of(drafter).prepare_for_training
    if prepare is not None:
        prepare(drafter, (SimpleNamespace(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in samples),
                target.tokenizer)
    return drafter


class Recording:
    """A batch-1 proposer that keeps every proposal it returns."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, []
        self.max_tokens = inner.max_tokens

    def reset(self, *args):
        self.inner.reset(*args)

    def propose(self, *args):
        proposal = self.inner.propose(*args)
        self.proposals.append(proposal)
        return proposal

    def on_accept(self, *args):
        self.inner.on_accept(*args)


def sampled_proposals(drafter, target) -> list:
    """(tokens, draft probabilities, confidences) of every round of a sampled run over PROMPTS."""
    out = []
    for index, prompt in enumerate(PROMPTS):
        proposer = Recording(make_proposer(drafter, target.model))
        speculative_generate(TargetVerifier(target.model, drafter.config.target_layer_ids), proposer, prompt, 10,
                             SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(index))
        out += [(p.token_ids_BK, p.probs_BKV, p.confidence_BK) for p in proposer.proposals]
    return out


def assert_same_proposals(expected: list, actual: list) -> None:
    assert len(expected) == len(actual) and expected
    for round_index, (a, b) in enumerate(zip(expected, actual)):
        for name, x, y in zip(("tokens", "probs", "confidence"), a, b):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"round {round_index}: {name}"


def config_fields(drafter) -> dict:
    """The drafter's config as its config.json says it (where it was loaded from aside)."""
    fields = json.loads(drafter.config.to_json_string())
    fields.pop("_name_or_path", None)
    return fields


def greedy_reference(model, prompt, num_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_a_tiny_test_config_of_its_own_fields(kind, tiny_drafter_configs):
    assert kind in tiny_drafter_configs.configs, f"add a tiny test config of {kind!r} to TINY_DRAFTERS"
    fields = set(vars(get_drafter_spec(kind).params_class()))
    assert set(tiny_drafter_configs.configs[kind]) <= fields  # valid `drafter.*` overrides too


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_build_and_forward_shapes(kind, family, request, tiny_drafter):
    target = request.getfixturevalue(family)
    drafter = tiny_drafter(kind, target)
    spec = get_drafter_spec(kind)
    assert type(drafter) is spec.model_class and type(drafter.config) is spec.config_class
    assert spec_of(drafter) is spec and drafter.config.drafter_kind == kind
    target_tensors = {id(p) for p in target.model.parameters()}
    assert not any(id(p) in target_tensors for p in drafter.parameters())  # the target's parts stay the target's
    capabilities = spec.capabilities(drafter.config)
    samples, batcher, batch = training_batch(drafter, target)
    counts = batcher.counts(batch)
    assert counts.tokens == sum(len(ids) for ids in IDS) and counts.anchors > 0
    result = compute_training_loss(drafter.eval(), batch, with_metrics=True)
    assert result.loss.total.dim() == 0 and torch.isfinite(result.loss.total)
    rows = result.terms.num_rows
    assert rows > 0 and result.position_index_N.shape == result.block_index_N.shape == (rows,)
    # every draft position the kind trains is supervised, and no other
    assert set(result.position_index_N.tolist()) == set(range(capabilities.num_positions))


def assert_trains(drafter, target, num_steps: int = 6) -> list[float]:
    """A few AdamW steps on one batch: gradients reach every trainable parameter and no target one, the loss falls,
    the target is unchanged. Returns the losses."""
    samples, _, batch = training_batch(drafter, target)
    drafter = prepared(drafter, samples, target).train()
    target_before = {name: value.clone() for name, value in target.model.state_dict().items()}
    trainable = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    losses = []
    for step in range(num_steps):
        optimizer.zero_grad()
        loss = compute_training_loss(drafter, batch).loss.total
        loss.backward()
        if step == 0:
            missing = [name for name, p in trainable if p.grad is None or not torch.isfinite(p.grad).all()]
            assert missing == [], f"no finite gradient reaches {missing[:5]}"
            assert all(p.grad is None for p in target.model.parameters())
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(value, target_before[name]) for name, value in target.model.state_dict().items())
    return losses


@pytest.mark.parametrize("kind", KINDS)
def test_train_step_reaches_every_trainable_parameter_and_lowers_the_loss(kind, tiny_llama, tiny_drafter):
    assert_trains(tiny_drafter(kind, tiny_llama), tiny_llama)


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind, family, request, tiny_drafter, tmp_path):
    target = request.getfixturevalue(family)
    drafter = randomised(tiny_drafter(kind, target))
    _, _, batch = training_batch(drafter, target)
    expected_loss = compute_training_loss(drafter, batch, with_metrics=True).loss.total
    expected = sampled_proposals(drafter, target)
    drafter.save_pretrained(tmp_path)
    embedding_shape = list(target.model.get_input_embeddings().weight.shape)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if list(f.get_slice(k).get_shape()) == embedding_shape]
    loaded = {"load_drafter": load_drafter(tmp_path, target), "load_checkpoint": load_checkpoint(tmp_path, target)}
    saved = drafter.state_dict()
    for how, reloaded in loaded.items():
        reloaded.eval()
        assert type(reloaded) is type(drafter) and config_fields(reloaded) == config_fields(drafter), how
        assert reloaded.state_dict().keys() == saved.keys()
        assert all(torch.equal(value, saved[name]) for name, value in reloaded.state_dict().items()), how
        # its own storage (copied out of the file mapping, aligned as torch allocates), so the same numbers
        tensors = [*reloaded.named_parameters(), *reloaded.named_buffers()]
        assert [n for n, t in tensors
                if not t.untyped_storage().resizable() or t.data_ptr() % ALLOCATOR_ALIGNMENT] == []
    # Rewriting the file in place (a checkpoint overwritten) leaves the loaded drafters unchanged.
    weights = tmp_path / "model.safetensors"
    header_end = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with weights.open("r+b") as handle:
        handle.seek(header_end)
        handle.write(bytes(weights.stat().st_size - header_end))
    for how, reloaded in loaded.items():
        assert torch.equal(compute_training_loss(reloaded, batch, with_metrics=True).loss.total, expected_loss), how
        assert_same_proposals(expected, sampled_proposals(reloaded, target))
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing", target)


@pytest.mark.float_exact
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_is_the_targets_own(kind, family, request, tiny_drafter):
    target = request.getfixturevalue(family)
    drafter = tiny_drafter(kind, target).eval()
    references = [greedy_reference(target.model, prompt, 20) for prompt in PROMPTS]
    for prompt, reference in zip(PROMPTS, references):
        verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
        result = speculative_generate(verifier, make_proposer(drafter, target.model), prompt, 20, GREEDY)
        assert result.token_ids == reference
        assert all(0 <= r.accepted <= r.proposed for r in result.rounds)
    requests = [BatchRequest(prompt, 20) for prompt in PROMPTS]
    out = batched_speculative_generate(target.model, make_batch_proposer(drafter, target.model), requests, GREEDY,
                                       settings=ServingSettings(max_concurrency=2,
                                                                layer_ids=drafter.config.target_layer_ids))
    assert [r.token_ids for r in out.requests] == references


@pytest.mark.float_exact
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_through_every_layout_it_allows(kind, family, request, tiny_drafter, tmp_path):
    target = request.getfixturevalue(family)
    drafter = randomised(tiny_drafter(kind, target))
    capabilities = spec_of(drafter).capabilities(drafter.config)
    layouts = formats_for(kind, target.model.config.model_type, len(drafter.config.target_layer_ids),
                          reduced_vocab=False, engine_unread=False, num_positions=capabilities.num_positions)
    assert "hf" in layouts
    expected = sampled_proposals(drafter, target)
    for layout in layouts:
        out = export_drafter(drafter, tmp_path / layout, layout, target=target,
                             **({"verifier": VERIFIER} if layout == "vllm" else {}))
        loaded = load_exported(out, target).eval()
        assert type(loaded) is type(drafter), layout
        assert spec_of(loaded).capabilities(loaded.config) == capabilities, layout
        assert_same_proposals(expected, sampled_proposals(loaded, target))


# -- draft layers of another family (`drafter.layer_family`) -------------------------------------------------------
LAYER_FAMILY_KINDS = ["dflash", "dspark", "eagle3", "mtp"]  # the kinds whose layers run at the target's widths
CROSS_FAMILIES = [("tiny_llama", "qwen3"), ("tiny_qwen3", "llama")]  # (target, draft layers' family)
# What each (kind, draft layers' family) exports to with the tiny configs: the engine layouts the option is for
# (Qwen3-layer DFlash/DSpark on a Llama target: SGLang and vLLM; Llama-layer EAGLE-3 on a Qwen3 target: SGLang's
# LlamaForCausalLMEagle3, and vLLM's Eagle3LlamaForCausalLM). The tiny MTP has 2 modules: speculators' holds 1.
CROSS_LAYOUTS = {
    ("dflash", "qwen3"): ["hf", "sglang", "vllm"], ("dspark", "qwen3"): ["hf", "sglang", "vllm"],
    ("eagle3", "qwen3"): ["hf", "vllm"], ("mtp", "qwen3"): ["hf"],
    ("dflash", "llama"): ["hf"], ("dspark", "llama"): ["hf"],
    ("eagle3", "llama"): ["hf", "sglang", "vllm"], ("mtp", "llama"): ["hf"],
}


def draft_layers(drafter) -> list:
    return [m for m in drafter.modules() if type(m).__name__.endswith("DecoderLayer")]


def cross_family_drafter(kind, target, layer_family, tiny_drafter):
    """The kind's tiny drafter with `layer_family` layers (checked: the option is in effect)."""
    from deepspec.targets.family import get_family

    drafter = tiny_drafter(kind, target, layer_family=layer_family)
    assert {type(layer) for layer in draft_layers(drafter)} == {get_family(layer_family).decoder_layer_cls}
    return drafter


@pytest.mark.parametrize("family,layer_family", CROSS_FAMILIES)
@pytest.mark.parametrize("kind", LAYER_FAMILY_KINDS)
def test_layer_family_builds_that_familys_layers_at_the_targets_widths(kind, family, layer_family, request,
                                                                       tiny_drafter):
    from deepspec.targets.family import get_family

    target = request.getfixturevalue(family)
    drafter = tiny_drafter(kind, target, layer_family=layer_family)
    own = tiny_drafter(kind, target)  # the same kind with the target's family, as every drafter had it
    text = target.model.config
    layers = draft_layers(drafter)
    assert drafter.config.layer_family == layer_family and own.config.layer_family is None
    assert layers and all(type(layer) is get_family(layer_family).decoder_layer_cls for layer in layers)
    assert all(type(layer) is get_family(text.model_type).decoder_layer_cls for layer in draft_layers(own))
    head_dim = text.head_dim
    for layer in layers:  # the target's widths (Eagle3's q/k/v read [embedding; hidden]: 2H)
        attention = layer.self_attn
        assert attention.q_proj.out_features == text.num_attention_heads * head_dim
        assert attention.k_proj.out_features == text.num_key_value_heads * head_dim
        assert attention.o_proj.out_features == text.hidden_size == layer.mlp.down_proj.out_features
        assert layer.mlp.up_proj.out_features == text.intermediate_size
    # The only parameters that differ: Qwen3's q/k norms (head_dim each), per draft layer.
    sign = 1 if layer_family == "qwen3" else -1
    assert (describe_params(drafter)["trainable_params"] - describe_params(own)["trainable_params"]
            == sign * 2 * head_dim * len(layers))
    # The target's own parts are shared, frozen and unchanged.
    assert drafter.target_parts.embed_tokens is target.model.get_input_embeddings()
    assert drafter.target_parts.lm_head_weight is target.model.get_output_embeddings().weight
    _, _, batch = training_batch(drafter, target)
    assert torch.isfinite(compute_training_loss(drafter.eval(), batch).loss.total)


@pytest.mark.parametrize("family,layer_family", CROSS_FAMILIES)
@pytest.mark.parametrize("kind", LAYER_FAMILY_KINDS)
def test_layer_family_trains(kind, family, layer_family, request, tiny_drafter):
    target = request.getfixturevalue(family)
    assert_trains(cross_family_drafter(kind, target, layer_family, tiny_drafter), target)


@pytest.mark.float_exact
@pytest.mark.parametrize("family,layer_family", CROSS_FAMILIES)
@pytest.mark.parametrize("kind", LAYER_FAMILY_KINDS)
def test_layer_family_decoding_is_the_targets_own(kind, family, layer_family, request, tiny_drafter):
    target = request.getfixturevalue(family)
    drafter = cross_family_drafter(kind, target, layer_family, tiny_drafter).eval()
    for prompt in PROMPTS:
        verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
        result = speculative_generate(verifier, make_proposer(drafter, target.model), prompt, 12, GREEDY)
        assert result.token_ids == greedy_reference(target.model, prompt, 12)


def engine_layer_model_type(folder) -> str:
    """The model_type of the draft-layer config an engine layout holds (vLLM: transformer_layer_config)."""
    config = json.loads((folder / "config.json").read_text())
    return config.get("transformer_layer_config", config)["model_type"]


@pytest.mark.float_exact
@pytest.mark.parametrize("family,layer_family", CROSS_FAMILIES)
@pytest.mark.parametrize("kind", LAYER_FAMILY_KINDS)
def test_layer_family_round_trips_through_save_and_every_layout(kind, family, layer_family, request, tiny_drafter,
                                                                tmp_path):
    target = request.getfixturevalue(family)
    drafter = randomised(cross_family_drafter(kind, target, layer_family, tiny_drafter))
    expected = sampled_proposals(drafter, target)
    drafter.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["layer_family"] == layer_family
    reloaded = load_drafter(tmp_path / "saved", target).eval()
    assert config_fields(reloaded) == config_fields(drafter)
    assert all(torch.equal(value, drafter.state_dict()[name]) for name, value in reloaded.state_dict().items())
    assert_same_proposals(expected, sampled_proposals(reloaded, target))
    capabilities = spec_of(drafter).capabilities(drafter.config)
    layouts = formats_for(kind, target.model.config.model_type, len(drafter.config.target_layer_ids),
                          num_positions=capabilities.num_positions, layer_family=layer_family)
    assert layouts == CROSS_LAYOUTS[(kind, layer_family)]
    for layout in layouts:
        out = export_drafter(drafter, tmp_path / layout, layout, target=target,
                             **({"verifier": VERIFIER} if layout == "vllm" else {}))
        if layout != "hf":  # the engine builds its draft layers from this config: the draft family's
            assert engine_layer_model_type(out) == layer_family, layout
        loaded = load_exported(out, target).eval()
        assert type(loaded) is type(drafter) and loaded.config.layer_family == layer_family, layout
        assert_same_proposals(expected, sampled_proposals(loaded, target))
