"""SGLang layout: Eagle3 as `LlamaForCausalLMEagle3`, DFlash as `DFlashDraftModel`, DSpark as `DSparkDraftModel`.

Every engine fact here names the version it was read in and the source line (details: docs/interop.md; all of it
is loaded and run by the real consumers in tests/export/consumers where a CPU build exists: SpecForge 0.2.0,
dflash 0.1.0; SGLang itself is read from source only).
- Eagle3 (SGLang 0.5.23 `models/llama_eagle3.py`): weights `fc.weight` [H, 3H] (three fused layers),
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v}_proj` over
  [embedding; hidden] (2H, embedding first), `o_proj`, `mlp.*`, `norm.weight`, `lm_head.weight` [draft_vocab, H],
  `d2t` (offsets, `hot_token_id = d2t + arange`, `:350-353`), `t2d` (skipped by SGLang). No q/k norms: Llama-shaped
  layers only, on Llama/Mistral/Qwen2/Qwen3 targets (`LAYER_FAMILIES`, `TARGET_FAMILIES`; a Qwen3 target's drafter
  is trained with `drafter.layer_family=llama`). Aux ids `eagle_config.eagle_aux_hidden_state_layer_ids` are "output
  of layer k" (DeepSpec's ids).
  A full vocabulary is written as an explicit identity draft vocabulary (`draft_vocab_size = V`, `lm_head` = the
  target's head, `d2t` = 0, `t2d` = all): SGLang reads it as the same model (hot ids = identity), and SpecForge
  0.2.0 can load it (it builds `nn.Linear(H, draft_vocab_size)`, `modeling/draft/llama3_eagle.py:1691-1693`, and
  its own exporter requires lm_head/d2t/t2d, `export/to_sglang.py:38`); `draft_vocab_size: null` would fail there.
- DFlash (SGLang 0.5.23 `models/dflash.py`, `speculative/dflash_utils.py`): weights `layers.{i}.*` (Qwen3-shaped:
  q/k norms, SiLU MLP, whatever the target: Llama/Mistral/Qwen3 targets with `drafter.layer_family=qwen3`),
  `fc.weight` [H, m*H], `hidden_norm.weight`, `norm.weight`; `dflash_config {block_size, mask_token_id, mask_token,
  target_layer_ids}` ("after layer k" = DeepSpec's ids), `num_target_layers`. Every DFlash reader is
  mask-predicts, with no flag: SGLang 0.5.14-0.5.23 `speculative/dflash_worker_v2.py` (0.5.23 `:2798-2812`,
  `draft_hidden[:, 1:, :]` -> `draft_tokens[:, 1:]`), SpecForge 0.2.0 `modeling/draft/dflash.py:415-429`, dflash
  0.1.0 `model.py:243-268`. So only mask-predicts DFlash drafters are written; anchor-predicts ones are refused.
- DSpark (SGLang 0.5.23 `models/dspark.py`, EntryClass `DSparkDraftModel` `:995`; SpecForge 0.2.0
  `modeling/draft/dspark.py`): the DFlash tensors + `markov_head.markov_w1.weight` [V, R],
  `markov_head.markov_w2.weight` [V, R], RNN `markov_head.joint_proj.*`, `confidence_head.proj.*` over
  [h; W1[x_prev]]. SGLang builds the heads from top-level fields (`build_markov_head` `:385-405` raises when
  `markov_rank` is 0; `build_confidence_head` `:487-510`), SpecForge from `dflash_config` (`:254-279`,
  `:345-364`): both are written. The block convention is the top-level `sample_from_anchor` (SGLang >= 0.5.19
  `speculative/dspark_components/dspark_config.py:29-31`, default true; false -> g + 1 query rows whose slot 0 is
  dropped, `dspark_draft.py:88-106`), written explicitly. SpecForge 0.2.0's `spec_generate` reads slots 1..g-1
  whatever the flag (`modeling/draft/dspark.py:326-343`), so it drafts correctly from mask-predicts DSpark only;
  SGLang 0.5.16-0.5.18 (no flag) reads anchor-predicts only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepspec.drafters.spec import ANCHOR_PREDICTS, MASK_PREDICTS, get_drafter_spec
from deepspec.export.layout import (
    WEIGHTS_FILE,
    PrefixMap,
    check_engine_families,
    check_fused_layer_count,
    check_layer_keys,
    drafter_state,
    engine_text_config,
    export_layout,
    layer_family_from_engine,
    pop_shared_copy,
    read_layout,
    rebuild_drafter,
    require,
    shared_target_tensor,
    write_tensors,
)
from deepspec.targets.layers import LAYER_ID_CONVENTION

log = logging.getLogger(__name__)

LAYOUT = "sglang"
DESCRIPTION = "the SGLang layout holds Eagle3, DFlash and DSpark drafters (MTP modules go to format='nextn')"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "DSparkDraftModel"
BLOCK_ARCHS = {"dflash": DFLASH_ARCH, "dspark": DSPARK_ARCH}  # drafter spec's architecture -> engine class
# The draft-layer family each engine class builds, whatever the target (the first is the one to train with,
# `drafter.layer_family`); the exporter checks the tensors too. LlamaForCausalLMEagle3 (models/llama_eagle3.py:45-85):
# Llama layers, no q/k norms, qkv without bias (Mistral's layers are the same tensors); DFlashDraftModel and
# DSparkDraftModel (models/dflash.py:199-250, dspark.py:967): Qwen3-shaped layers with q/k norms.
LAYER_FAMILIES = {"eagle3": ("llama", "mistral"), "dflash": ("qwen3",), "dspark": ("qwen3",)}
# The target families SGLang 0.5.23 serves with each class: the target model class must capture the auxiliary
# hidden states (model_executor/model_runner_components/attention_backend_setup.py:54-72).
TARGET_FAMILIES = {"eagle3": {"llama", "mistral", "qwen2", "qwen3"}, "dflash": {"llama", "mistral", "qwen3"},
                   "dspark": {"llama", "mistral", "qwen3"}}
_DFLASH_TARGETS = ("only LlamaForCausalLM (models/llama.py:943; MistralForCausalLM subclasses it, mistral.py:33) and "
                   "Qwen3ForCausalLM (qwen3.py:793) have set_dflash_layers_to_capture, which DFLASH/DSPARK need")
TARGET_REASONS = {
    # Gemma 3 has set_eagle3_layers_to_capture (gemma3_causal.py:917) but scales its embedding inside the forward
    # (:542-548, :570) and hands the draft the raw weight (get_embed, :944-945): the Eagle3 draft embeds tokens
    # sqrt(H) smaller than DeepSpec trained it with (the target's own embedding module).
    "eagle3": "set_eagle3_layers_to_capture exists for Llama/Mistral (models/llama.py:929), Qwen2 (qwen2.py:781) and "
              "Qwen3 (qwen3.py:778); Gemma 3's draft would embed tokens without Gemma's sqrt(hidden) scale "
              "(gemma3_causal.py:542-548, :944-945)",
    "dflash": _DFLASH_TARGETS,
    "dspark": _DFLASH_TARGETS,
}
# Engine classes whose fc reads a fixed number of target layers (llama_eagle3.py: Linear(3 * H, H)).
FUSED_LAYER_COUNTS = {"eagle3": 3}
# Engine classes that take the target's whole LM head (no d2t/t2d): reduced block drafters are refused
# (`block_engine_tensors`).
FULL_VOCABULARY_ONLY = {"dflash", "dspark"}

EAGLE3_MAP = PrefixMap(
    pairs=(("fc.", "fc."), ("midlayer.", "midlayer."), ("norm.", "norm."), ("lm_head.", "lm_head."),
           ("d2t", "d2t"), ("t2d", "t2d")),
    drop=frozenset({"draft_head_initialized"}),  # DeepSpec bookkeeping; a loaded head is initialised
)
# Shared with vLLM's qwen3_dflash.py, which uses the same names (see vllm_speculators.py).
BLOCK_MAP = PrefixMap(pairs=(
    ("backbone.fusion.proj.", "fc."),
    ("backbone.fusion.norm.", "hidden_norm."),
    ("backbone.layers.", "layers."),
    ("backbone.norm.", "norm."),
    ("sequential.prev_embed.", "markov_head.markov_w1."),  # W1 [V, R]
    ("sequential.out.", "markov_head.markov_w2."),  # W2 as Linear(R -> V): weight [V, R]
    ("sequential.gates.", "markov_head.joint_proj."),  # RNN: Linear(2R + H -> 3R), chunks (gate, cand, out)
    ("confidence.score.", "confidence_head.proj."),  # Linear(H + R -> 1) over [h; W1[x_prev]]
))

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LLAMA_EAGLE3_LAYER = {*(f"{p}.weight" for p in _PROJ), *_MLP, "input_layernorm.weight", "hidden_norm.weight",
                      "post_attention_layernorm.weight"}
QWEN3_DFLASH_LAYER = {*(f"{p}.weight" for p in _PROJ), *(f"{p}.bias" for p in _PROJ), *_MLP,
                      "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                      "post_attention_layernorm.weight"}
MARKOV_HEAD_TYPES = {"markov": "vanilla", "rnn": "rnn"}  # DeepSpec sequential_head -> markov_head_type
# Where every DFlash engine reads the block (the refusal message of an anchor-predicts DFlash export).
DFLASH_READERS = ("SGLang 0.5.23 speculative/dflash_worker_v2.py:2798-2812, SpecForge 0.2.0 modeling/draft/"
                  "dflash.py:415-429, dflash 0.1.0 model.py:243-268, vLLM 0.33.0 v1/worker/gpu/spec_decode/dflash/"
                  "speculator.py:64-89")


def specforge_dspark_note(config) -> str | None:
    """What SpecForge 0.2.0 makes of this drafter's SGLang export, when it is an anchor-predicts DSpark (said at
    export time and in the model card): its `spec_generate` ignores `sample_from_anchor`."""
    if type(config).drafter_kind != "dspark" or config.block_convention != ANCHOR_PREDICTS:
        return None
    return ("this DSpark drafter is anchor-predicts (sample_from_anchor: true in its SGLang layout): SGLang >= 0.5.19 "
            "reads the flag and drafts correctly, but SpecForge 0.2.0's spec_generate reads slots 1..g-1 whatever the "
            "flag says (modeling/draft/dspark.py:326-343), so served by SpecForge it drafts other tokens and few are "
            "accepted. To serve with SpecForge, train with drafter.block_convention=mask-predicts")


def to_sglang_layer_ids(config) -> list[int]:
    """SGLang's Eagle3 aux ids and DFlash target_layer_ids are 'output of layer k', like DeepSpec's."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"drafter layer_id_convention={config.layer_id_convention!r}; "
                         f"expected {LAYER_ID_CONVENTION!r}")
    return [int(i) for i in config.target_layer_ids]


def from_sglang_layer_ids(ids: list[int]) -> list[int]:
    return [int(i) for i in ids]


def matches(config: dict) -> bool:
    return "speculators_model_type" not in config and bool(
        {EAGLE3_ARCH, DFLASH_ARCH, DSPARK_ARCH} & set(config.get("architectures") or []))


# -- Eagle3 ------------------------------------------------------------------------------------
def identity_draft_vocab(target, where: str) -> dict[str, torch.Tensor]:
    """A full vocabulary as an explicit draft vocabulary: the target's head, d2t = 0 (offsets), t2d = all kept."""
    head = shared_target_tensor(target, "lm_head", where)
    vocab = head.shape[0]
    return {"lm_head.weight": head, "d2t": torch.zeros(vocab, dtype=torch.long),
            "t2d": torch.ones(vocab, dtype=torch.bool)}


def pop_identity_draft_vocab(state: dict[str, torch.Tensor], vocab: int, target, where: str) -> bool:
    """Remove an identity draft vocabulary (checking the head is the given target's); False if it is a reduced one."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None or d2t.shape[0] != vocab or bool(d2t.any()) or t2d is None or not bool(t2d.all()):
        return False
    pop_shared_copy(state, "lm_head.weight", target, "lm_head", where)
    del state["d2t"], state["t2d"]
    return True


def _export_eagle3(model, out_dir: Path, target) -> dict:
    config = model.config
    ids = to_sglang_layer_ids(config)
    check_served(config, "eagle3", f"SGLang's {EAGLE3_ARCH}")
    check_fused_layer_count(ids, FUSED_LAYER_COUNTS["eagle3"], f"SGLang's {EAGLE3_ARCH}")
    tensors = EAGLE3_MAP.to_format(drafter_state(model))
    check_layer_keys(tensors, "midlayer.", LLAMA_EAGLE3_LAYER, f"SGLang {EAGLE3_ARCH}")
    if config.draft_vocab_size is None:
        tensors.update(identity_draft_vocab(target, "the SGLang Eagle3 layout of a full-vocabulary drafter"))
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return engine_text_config(
        config, 1, architectures=[EAGLE3_ARCH],
        draft_vocab_size=int(tensors["lm_head.weight"].shape[0]), tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    )


def _load_eagle3(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    eagle = require(engine, "eagle_config", where)
    vocab = int(sidecar["drafter_config"]["target_config"]["vocab_size"])
    draft_vocab = engine.get("draft_vocab_size")
    state = dict(tensors)
    full = draft_vocab is None or pop_identity_draft_vocab(state, vocab, target, where)
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_sglang_layer_ids(require(eagle, "eagle_aux_hidden_state_layer_ids", where)),
                  draft_vocab_size=None if full else int(draft_vocab), layer_id_convention=LAYER_ID_CONVENTION,
                  layer_family=layer_family_from_engine(require(engine, "model_type", where), kwargs))
    state = EAGLE3_MAP.from_format(state)
    if "lm_head.weight" in state:
        state["draft_head_initialized"] = torch.tensor(True)  # keep the stored head, do not re-init from the target
    return rebuild_drafter("eagle3", kwargs, state, target, where)


# -- DFlash / DSpark ---------------------------------------------------------------------------
def block_engine_tensors(model, engine: str) -> dict[str, torch.Tensor]:
    """Block-drafter tensors in the DFlash naming, checked against the engine's Qwen3-shaped draft layer."""
    config = model.config
    if config.draft_vocab_size is not None:
        # These layouts write a full-vocabulary block drafter: SGLang's DFlash/DSpark loaders take the target's
        # LM head (they skip lm_head.*) and index W1 by target id; the vLLM DFlash layout stores the target's
        # whole head. None of them writes d2t/t2d, the kept head rows, or W1's "outside" row.
        raise ValueError(f"{engine} cannot represent a reduced draft vocabulary (drafter.draft_vocab_size="
                         f"{config.draft_vocab_size}, tensors d2t/t2d): export with format='hf', or train with "
                         f"drafter.draft_vocab_size=null for this layout")
    activation = config.draft_config_dict.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{engine} supports only SiLU MLPs; the draft layers use hidden_act={activation!r}")
    tensors = BLOCK_MAP.to_format(drafter_state(model))
    for index in range(config.num_draft_layers):
        check_layer_keys(tensors, f"layers.{index}.", QWEN3_DFLASH_LAYER, engine)
    return tensors


def require_convention(config, allowed: tuple[str, ...], engine: str, readers: str) -> None:
    """Refuse to write a block drafter whose convention the engine does not read (it would draft every slot
    one position off)."""
    if config.block_convention not in allowed:
        raise ValueError(f"{engine} reads block drafters as {' / '.join(allowed)} ({readers}); this drafter is "
                         f"{config.block_convention}: a block trained that way would propose the wrong token at every "
                         f"slot there. Retrain with drafter.block_convention={allowed[0]}, or export format='hf'")


def dspark_fields(config, engine: str) -> dict:
    """DSpark head fields in the names SGLang, SpecForge, speculators and vLLM read (refusing heads none has)."""
    if config.sequential_head == "none":
        raise ValueError(f"{engine} needs a sequential head (SGLang 0.5.23 models/dspark.py:385-405 raises when "
                         f"markov_rank is 0, and no engine has a confidence head with its own W1): this drafter has "
                         f"sequential_head='none'; export it as format='hf'")
    return {
        "markov_rank": int(config.markov_rank),
        "markov_head_type": MARKOV_HEAD_TYPES[config.sequential_head],
        "enable_confidence_head": bool(config.confidence_head),
        "confidence_head_with_markov": bool(config.confidence_head),  # the confidence head reads W1 of the Markov head
    }


def dspark_kwargs(fields: dict, where: str) -> dict:
    head_type = fields.get("markov_head_type", "vanilla")
    inverse = {v: k for k, v in MARKOV_HEAD_TYPES.items()}
    if head_type not in inverse or not fields.get("markov_rank"):
        raise ValueError(f"{where}: markov_head_type={head_type!r}, markov_rank={fields.get('markov_rank')!r}: "
                         f"DeepSpec reads DSpark drafters with a {sorted(inverse)} head of rank >= 1")
    if fields.get("enable_confidence_head") and not fields.get("confidence_head_with_markov", True):
        raise ValueError(f"{where}: a confidence head without the Markov embedding is not one DeepSpec implements")
    return {"sequential_head": inverse[head_type], "markov_rank": int(fields["markov_rank"]),
            "confidence_head": bool(fields.get("enable_confidence_head"))}


def convention_from_flag(sample_from_anchor) -> str:
    """The block convention an engine's `sample_from_anchor` means."""
    if not isinstance(sample_from_anchor, bool):
        raise ValueError(f"sample_from_anchor={sample_from_anchor!r} must be true or false")
    return ANCHOR_PREDICTS if sample_from_anchor else MASK_PREDICTS


BLOCK_ENGINE_FIELDS = ("target_layer_ids", "block_size", "mask_token_id", "num_draft_layers", "layer_id_convention",
                       "block_convention", "layer_family")
DSPARK_ENGINE_FIELDS = ("sequential_head", "markov_rank", "confidence_head")
EAGLE3_ENGINE_FIELDS = ("target_layer_ids", "draft_vocab_size", "layer_id_convention", "layer_family")


def check_served(config, architecture: str, engine: str) -> None:
    """The draft layers are of the family the engine class builds, and the engine serves the drafter's target."""
    check_engine_families(config, engine, LAYER_FAMILIES[architecture], TARGET_FAMILIES[architecture],
                          TARGET_REASONS[architecture])


def _export_block(model, out_dir: Path, target, architecture: str) -> dict:
    config = model.config
    arch = BLOCK_ARCHS[architecture]
    engine_name = f"SGLang {arch}"
    check_served(config, architecture, engine_name)
    if architecture == "dflash":
        require_convention(config, (MASK_PREDICTS,), engine_name, DFLASH_READERS)
    heads = dspark_fields(config, engine_name) if architecture == "dspark" else {}
    tensors = block_engine_tensors(model, engine_name)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    dflash_config = {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": to_sglang_layer_ids(config),
        **heads,  # SpecForge's DSparkDraftModel reads its heads here
    }
    if target is not None:
        dflash_config["mask_token"] = target.tokenizer.convert_ids_to_tokens(config.mask_token_id)
    engine = engine_text_config(config, config.num_draft_layers, architectures=[arch], block_size=config.block_size,
                                num_target_layers=config.target_num_layers, dflash_config=dflash_config)
    if architecture == "dspark":
        # SGLang builds the heads and reads the convention at the top level.
        engine.update(heads, sample_from_anchor=config.block_convention == ANCHOR_PREDICTS)
        note = specforge_dspark_note(config)
        if note:
            log.warning("SGLang layout: %s", note)
    return engine


def _load_block(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    kind = sidecar["drafter_kind"]
    architecture = get_drafter_spec(kind).export_layouts.get(LAYOUT)
    expected_arch = BLOCK_ARCHS.get(architecture)
    if expected_arch not in engine.get("architectures", []):
        raise ValueError(f"{where}: architectures={engine.get('architectures')} "
                         f"but the sidecar says drafter_kind={kind!r}")
    dflash = require(engine, "dflash_config", where)
    num_target_layers = int(require(engine, "num_target_layers", where))
    declared = sidecar["drafter_config"]["target_config"]["num_hidden_layers"]
    if num_target_layers != declared:
        raise ValueError(f"{where}: num_target_layers={num_target_layers} but the target config has {declared} layers")
    # DFlashDraftModel is mask-predicts in every engine; DSpark says which with its top-level flag.
    convention = (MASK_PREDICTS if architecture == "dflash"
                  else convention_from_flag(require(engine, "sample_from_anchor", where)))
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_sglang_layer_ids(require(dflash, "target_layer_ids", where)),
                  block_size=int(require(dflash, "block_size", where)),
                  mask_token_id=int(require(dflash, "mask_token_id", where)),
                  num_draft_layers=int(require(engine, "num_hidden_layers", where)),
                  layer_id_convention=LAYER_ID_CONVENTION, block_convention=convention,
                  layer_family=layer_family_from_engine(require(engine, "model_type", where), kwargs))
    if architecture == "dspark":
        kwargs.update(dspark_kwargs(engine, where))
    return rebuild_drafter(kind, kwargs, BLOCK_MAP.from_format(tensors), target, where)


# drafter spec's architecture -> (writer, drafter-config fields the engine config carries)
ARCHITECTURES = {
    "eagle3": (_export_eagle3, EAGLE3_ENGINE_FIELDS),
    "dflash": (lambda model, out_dir, target: _export_block(model, out_dir, target, "dflash"), BLOCK_ENGINE_FIELDS),
    "dspark": (lambda model, out_dir, target: _export_block(model, out_dir, target, "dspark"),
               BLOCK_ENGINE_FIELDS + DSPARK_ENGINE_FIELDS),
}


# -- entry points ------------------------------------------------------------------------------
def export(model, out_dir: Path, target=None, **opts) -> Path:
    return export_layout(model, out_dir, target, opts, LAYOUT, DESCRIPTION, ARCHITECTURES)


def load(path: Path, target):
    engine, sidecar, tensors, where = read_layout(path, LAYOUT)
    if EAGLE3_ARCH in engine.get("architectures", []):
        return _load_eagle3(engine, tensors, sidecar, target, where)
    return _load_block(engine, tensors, sidecar, target, where)
