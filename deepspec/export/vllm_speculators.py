"""vLLM "speculators" layout (vllm-project/speculators' checkpoint format, `speculators_model_type`): Eagle3,
DFlash, DSpark, MTP.

Every engine fact here names the version it was read in and the source line (details: docs/interop.md).
speculators 0.9.0 itself loads and runs every folder in tests/export/consumers; vLLM 0.33.0 is read from source.
- Common: `speculators_config {algorithm, proposal_methods[{proposal_type: "greedy", speculative_tokens,
  verifier_accept_k, accept_tolerance}], default_proposal_method, verifier {name_or_path, architectures}}`.
  speculators resolves `verifier.name_or_path` when it loads a folder (`model.py:127-210`: a local directory is read
  directly, anything else goes to `hf_hub_download`, `utils/loading.py:152-170`), so it must be a hub id or a local
  path: the target's hub id (an embedded target's original model), its local folder, or `verifier=` given to the
  export; a target that exists only in memory (tiny random targets) is refused without `verifier=`. vLLM 0.33.0
  serves the folder directly only with a remote hub id (`transformers_utils/config.py:859-873`; a local verifier
  needs `--model` and `--speculative-config`).
- Layer ids: vLLM captures the hidden state *entering* decoder layer k, so an id here = DeepSpec id + 1
  (`deepspec.targets.layers.to_input_of_layer`); vLLM derives `target_layer_ids = aux - 1` for DFlash/DSpark
  (`transformers_utils/configs/speculators/algos.py:90-126`, `:152-209`).
- Eagle3 (speculators `models/eagle3/config.py`, `core.py`; vLLM `update_eagle3`, `algos.py:15-50`):
  `architectures: ["Eagle3Speculator"]`, `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`
  (vLLM defaults it to true when absent: written false, DeepSpec's residual is on the un-normed hidden),
  `eagle_aux_hidden_state_layer_ids`; weights `embed_tokens`, `fc` [H, 3H], `layers.0.*`, `norm`, `lm_head`,
  `d2t`, `t2d`. vLLM maps the layer config's llama -> Eagle3LlamaForCausalLM, qwen3 -> Eagle3Qwen3ForCausalLM
  (`LAYER_FAMILIES`: the draft layers' family, `drafter.layer_family`, whatever the target's).
- DFlash (speculators `models/dflash/config.py:73-82`, vLLM `v1/worker/gpu/spec_decode/dflash/speculator.py:64-89`):
  `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids`, `draft_vocab_size`, `sample_from_anchor` (false:
  mask-predicts; vLLM 0.33.0 raises on true, `:83-88`), `speculative_tokens = block_size - 1`; tensors as SGLang's
  DFlash (vLLM `models/qwen3_dflash.py:851-884`) + the target's `embed_tokens` / `lm_head`. Anchor-predicts DFlash
  drafters are refused.
- DSpark (speculators `models/dspark/config.py:28-38`, `core.py`, `model_definitions.py`; vLLM `update_dspark`
  `algos.py:152-209`, `models/qwen3_dspark.py`): `architectures: ["DSparkSpeculator"]`, the DFlash fields +
  top-level `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov` and
  `sample_from_anchor`, always written (speculators defaults it to true, vLLM's updater to false, `algos.py:188`);
  `speculative_tokens` = drafts per block. speculators steps an RNN head over slot 0 too when mask-predicts
  (`models/dspark/core.py:157-168` prev ids + `model_definitions.py` `block_bias`), SGLang and SpecForge start it at
  slot 1 (DeepSpec's): a mask-predicts RNN DSpark is refused here.
- MTP (speculators `models/mtp/config.py`, `model_definitions.py:86-116`, `core.py:99-156`): `architectures:
  ["MTPDraftModel"]`, `num_nextn_predict_layers` = 1 (validated), `transformer_layer_config` = the target's config
  (its `num_hidden_layers` picks the verifier's final hidden, `core.py:142-144`); weights `mtp_layers.0.
  {token_layernorm, hidden_layernorm, input_proj [H, 2H] over [emb; hidden], final_layernorm}` + the Qwen3 decoder
  layer's own names; the embedding and head are the verifier's (not stored). Layer classes exist for the Qwen3
  family only (`model_definitions.py:148-205`): one module, Qwen3 targets; others are refused. speculators chains
  later drafts by re-applying the module to its post-norm output (`core.py:274`), unlike DeepSpec, so only the
  first draft (= the proposal of a 1-module drafter) is the same. vLLM 0.33.0 has no "mtp" speculators type
  (`SUPPORTED_SPECULATORS_TYPES`, `configs/speculators/base.py:51-56`): this layout is read by speculators.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from deepspec.drafters.spec import ANCHOR_PREDICTS, MASK_PREDICTS
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
from deepspec.export.sglang import (
    BLOCK_ENGINE_FIELDS,
    BLOCK_MAP,
    DFLASH_READERS,
    DSPARK_ENGINE_FIELDS,
    EAGLE3_ENGINE_FIELDS,
    LLAMA_EAGLE3_LAYER,
    QWEN3_DFLASH_LAYER,
    block_engine_tensors,
    convention_from_flag,
    dspark_fields,
    dspark_kwargs,
    require_convention,
)
from deepspec.targets.layers import (
    LAYER_ID_CONVENTION,
    from_input_of_layer,
    to_input_of_layer,
)

LAYOUT = "vllm"
DESCRIPTION = "the vLLM speculators format holds Eagle3, DFlash, DSpark and (one-module, Qwen3-layer) MTP drafters"
# The draft-layer family each speculators model builds (the first is the one to train with, `drafter.layer_family`),
# read from transformer_layer_config: vLLM's update_eagle3 maps its model_type llama/qwen3 to Eagle3LlamaForCausalLM /
# Eagle3Qwen3ForCausalLM (0.32.0 transformers_utils/configs/speculators/algos.py:39-46); DFlash/DSpark layers are
# Qwen3-shaped whatever it says (models/qwen3_dflash.py:183-292, 324-390; speculators models/dflash/
# model_definitions.py:47-165); speculators' MTP picks its layer class by it, Qwen3 only here (models/mtp/core.py:126).
LAYER_FAMILIES = {"eagle3": ("llama", "qwen3"), "dflash": ("qwen3",), "dspark": ("qwen3",), "mtp": ("qwen3",)}
# The target families each is served on. vLLM 0.32.0 hands eagle3/dflash/dspark drafters the target's auxiliary hidden
# states only from a model class with the SupportsEagle3 interface (v1/worker/gpu/model_runner.py:300-307, :407;
# spec_decode/eagle/eagle3_utils.py:19-20): LlamaForCausalLM (models/llama.py:464-471; MistralForCausalLM subclasses it,
# mistral.py:236), Qwen2ForCausalLM (qwen2.py:458-460), Qwen3ForCausalLM (qwen3.py:280-282), not Gemma3ForCausalLM
# (gemma3.py:367). speculators' MTP takes the verifier's embedding and head as plain weights (speculators 0.9.0
# models/mtp/core.py:91-93, 146-155; model.py:127-153): right for those families, not for Gemma 3's scaled embedding.
_AUX_TARGETS = {"llama", "mistral", "qwen2", "qwen3"}
TARGET_FAMILIES = {"eagle3": _AUX_TARGETS, "dflash": _AUX_TARGETS, "dspark": _AUX_TARGETS, "mtp": _AUX_TARGETS}
_AUX_REASON = ("vLLM 0.32.0's Gemma3ForCausalLM (models/gemma3.py:367) does not implement SupportsEagle3, which "
               "hands a drafter the target's hidden states")
TARGET_REASONS = {"eagle3": _AUX_REASON, "dflash": _AUX_REASON, "dspark": _AUX_REASON,
                  "mtp": "speculators' MTP embeds tokens with the verifier's raw embedding weight, without Gemma's "
                         "sqrt(hidden) scale"}
EAGLE3_MAP = PrefixMap(
    pairs=(("fc.", "fc."), ("midlayer.", "layers.0."), ("norm.", "norm."), ("lm_head.", "lm_head."),
           ("d2t", "d2t"), ("t2d", "t2d")),
    drop=frozenset({"draft_head_initialized"}),
)
QWEN3_EAGLE3_LAYER = LLAMA_EAGLE3_LAYER | {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
EAGLE3_LAYERS = {"llama": LLAMA_EAGLE3_LAYER, "qwen3": QWEN3_EAGLE3_LAYER}  # draft layer family -> its tensors
# DeepSpec's MTP module names -> speculators' (the family decoder layer's own names are the same on both sides).
MTP_MAP = PrefixMap(pairs=(
    ("mtp_layers.0.enorm.", "mtp_layers.0.token_layernorm."),
    ("mtp_layers.0.hnorm.", "mtp_layers.0.hidden_layernorm."),
    ("mtp_layers.0.eh_proj.", "mtp_layers.0.input_proj."),
    ("mtp_layers.0.shared_head.norm.", "mtp_layers.0.final_layernorm."),
    ("mtp_layers.0.", "mtp_layers.0."),
))
MTP_LAYER = QWEN3_DFLASH_LAYER | {"token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                  "final_layernorm.weight"}


def to_vllm_layer_ids(config) -> list[int]:
    """DeepSpec 'output of layer l' -> vLLM 'input of layer l + 1'."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"drafter layer_id_convention={config.layer_id_convention!r}; "
                         f"expected {LAYER_ID_CONVENTION!r}")
    return to_input_of_layer(config.target_layer_ids)


def matches(config: dict) -> bool:
    return "speculators_model_type" in config


# -- the verifier ---------------------------------------------------------------------------------------
def verifier_name_or_path(config, target, verifier: str | None) -> str:
    """What `speculators_config.verifier.name_or_path` says: `verifier` when given, else the target's hub id
    (embedded targets: the original model) or its local folder; refused when speculators could resolve neither."""
    from deepspec.targets.load import EMBEDDED_TARGETS
    from deepspec.targets.tiny import is_tiny_target

    if verifier is not None:
        path = Path(verifier).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"verifier={verifier!r} is a folder without config.json: not a model folder")
            return str(path.resolve())
        if verifier.startswith((".", "/", "~")) or verifier.count("/") != 1:
            raise ValueError(f"verifier={verifier!r} is neither an existing model folder nor a hub id 'org/name'")
        return verifier
    name = config.target_name
    if name in EMBEDDED_TARGETS:
        return EMBEDDED_TARGETS[name].hub_id  # engines load the original model, not DeepSpec's converted copy
    how = ("pass verifier=<hub id or folder> (--verifier): speculators loads the verifier's embedding and head "
           "from verifier.name_or_path when it reads the folder (speculators 0.9.0 model.py:127-210)")
    if not name or is_tiny_target(name):
        raise ValueError(f"the target {name!r} exists only in memory, so no hub id or folder names it; {how}")
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        raise ValueError(f"the target {name!r} is a GGUF file, which speculators cannot read; {how}")
    if path.is_dir():
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ValueError(f"the target {name!r} is neither a hub id nor an existing folder here; {how}")
    return name


def _verifier(config, target, verifier: str | None) -> dict:
    name = verifier_name_or_path(config, target, verifier)
    model = getattr(target, "model", None)
    # The checkpoint's declared architectures, else the class the target was instantiated as.
    architectures = getattr(getattr(model, "config", None), "architectures", None) or (
        [type(model).__name__] if model is not None else None)
    if not architectures:
        raise ValueError("vLLM speculators need speculators_config.verifier.architectures: pass the target "
                         "(--target) so its architectures can be recorded")
    return {"name_or_path": name, "architectures": list(architectures)}


def _speculators_config(algorithm: str, speculative_tokens: int, verifier: dict) -> dict:
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": verifier,
    }


# -- Eagle3 ---------------------------------------------------------------------------------------------
def _export_eagle3(model, out_dir: Path, target, verifier: str | None) -> dict:
    config = model.config
    check_served(config, "eagle3", "vLLM's speculators Eagle3")
    ids = to_vllm_layer_ids(config)
    check_fused_layer_count(config.target_layer_ids, FUSED_LAYER_COUNTS["eagle3"], "vLLM's Eagle3 (llama_eagle3.py)")
    tensors = EAGLE3_MAP.to_format(drafter_state(model))
    check_layer_keys(tensors, "layers.0.", EAGLE3_LAYERS[config.draft_layer_family], "vLLM speculators Eagle3")
    where = "the vLLM speculators Eagle3 layout"
    tensors["embed_tokens.weight"] = shared_target_tensor(target, "embedding", where)
    if "lm_head.weight" not in tensors:  # full vocabulary: the draft head is the target's
        tensors["lm_head.weight"] = shared_target_tensor(target, "lm_head", where)
    verifier_entry = _verifier(config, target, verifier)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": engine_text_config(config, 1, tie_word_embeddings=False),
        "draft_vocab_size": config.draft_vocab_size or config.target_vocab_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": _speculators_config("eagle3", config.ttt_steps, verifier_entry),
    }


def _load_eagle3(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    if engine.get("norm_before_residual") is not False:
        raise ValueError(f"{where}: norm_before_residual must be false for a DeepSpec Eagle3 layer")
    ids = from_input_of_layer(require(engine, "eagle_aux_hidden_state_layer_ids", where))
    vocab = int(sidecar["drafter_config"]["target_config"]["vocab_size"])
    draft_vocab = int(require(engine, "draft_vocab_size", where))
    state = dict(tensors)
    pop_shared_copy(state, "embed_tokens.weight", target, "embedding", where)
    reduced = "d2t" in state
    if not reduced:
        if draft_vocab != vocab:
            raise ValueError(f"{where}: draft_vocab_size={draft_vocab} < vocab {vocab} but no d2t tensor")
        pop_shared_copy(state, "lm_head.weight", target, "lm_head", where)
    state = EAGLE3_MAP.from_format(state)
    if reduced:
        state["draft_head_initialized"] = torch.tensor(True)
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=ids, draft_vocab_size=draft_vocab if reduced else None,
                  layer_id_convention=LAYER_ID_CONVENTION, layer_family=engine_layer_family(engine, kwargs, where))
    return rebuild_drafter("eagle3", kwargs, state, target, where)


# -- DFlash / DSpark ------------------------------------------------------------------------------------
def _export_block(model, out_dir: Path, target, verifier: str | None, algorithm: str) -> dict:
    config = model.config
    engine_name = f"vLLM speculators {algorithm}"
    check_served(config, algorithm, engine_name)
    if algorithm == "dflash":
        require_convention(config, (MASK_PREDICTS,), engine_name, DFLASH_READERS)
        heads = {}
    else:
        heads = dspark_fields(config, engine_name)
        if heads["markov_head_type"] == "rnn" and config.block_convention == MASK_PREDICTS:
            raise ValueError(f"{engine_name}: speculators 0.9.0 steps a mask-predicts RNN head over the anchor "
                             "slot too (models/dspark/core.py:157-168), DeepSpec (like SGLang 0.5.23 and SpecForge "
                             "0.2.0) starts it at slot 1; export this drafter as format='sglang' or 'hf'")
    tensors = block_engine_tensors(model, engine_name)
    where = f"the vLLM speculators {algorithm} layout"
    tensors["embed_tokens.weight"] = shared_target_tensor(target, "embedding", where)
    tensors["lm_head.weight"] = shared_target_tensor(target, "lm_head", where)
    verifier_entry = _verifier(config, target, verifier)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return {
        "architectures": ["DFlashSpeculator" if algorithm == "dflash" else "DSparkSpeculator"],
        "speculators_model_type": algorithm,
        "transformer_layer_config": engine_text_config(config, config.num_draft_layers),
        "draft_vocab_size": config.target_vocab_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "aux_hidden_state_layer_ids": to_vllm_layer_ids(config),
        "sample_from_anchor": config.block_convention == ANCHOR_PREDICTS,
        **heads,
        "speculators_config": _speculators_config(algorithm, config.num_drafts, verifier_entry),
    }


def _load_block(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    kind = engine["speculators_model_type"]
    layer_config = require(engine, "transformer_layer_config", where)
    # speculators' default when the flag is absent: DFlash false (config.py:73-82), DSpark true (dspark/config.py:28-38)
    convention = convention_from_flag(engine.get("sample_from_anchor", kind == "dspark"))
    if kind == "dflash" and convention != MASK_PREDICTS:
        raise ValueError(f"{where}: sample_from_anchor=true: no DFlash engine reads that ({DFLASH_READERS})")
    state = dict(tensors)
    pop_shared_copy(state, "embed_tokens.weight", target, "embedding", where)
    pop_shared_copy(state, "lm_head.weight", target, "lm_head", where)
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_input_of_layer(require(engine, "aux_hidden_state_layer_ids", where)),
                  block_size=int(require(engine, "block_size", where)),
                  mask_token_id=int(require(engine, "mask_token_id", where)),
                  num_draft_layers=int(require(layer_config, "num_hidden_layers", where)),
                  layer_id_convention=LAYER_ID_CONVENTION, block_convention=convention,
                  layer_family=engine_layer_family(engine, kwargs, where))
    if kind == "dspark":
        kwargs.update(dspark_kwargs(engine, where))
    return rebuild_drafter(kind, kwargs, BLOCK_MAP.from_format(state), target, where)


# -- MTP ------------------------------------------------------------------------------------------------
def _export_mtp(model, out_dir: Path, target, verifier: str | None) -> dict:
    config = model.config
    check_served(config, "mtp", "speculators' MTP (layer classes for the Qwen3 family only, "
                                "models/mtp/model_definitions.py:148-205)")
    if config.num_mtp_modules != 1:
        raise ValueError(f"speculators' MTP holds exactly one module (num_nextn_predict_layers must be 1); "
                         f"this drafter has num_mtp_modules={config.num_mtp_modules}")
    tensors = MTP_MAP.to_format(drafter_state(model))
    check_layer_keys(tensors, "mtp_layers.0.", MTP_LAYER, "speculators MTP")
    verifier_entry = _verifier(config, target, verifier)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "num_nextn_predict_layers": 1,
        # The draft layers' config at the target's depth: num_hidden_layers = the target's (h^0 = its last).
        "transformer_layer_config": config.draft_config_dict,
        "speculators_config": _speculators_config("mtp", 1, verifier_entry),
    }


def _load_mtp(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    if int(require(engine, "num_nextn_predict_layers", where)) != 1:
        raise ValueError(f"{where}: num_nextn_predict_layers must be 1 (speculators' MTP holds one module)")
    kwargs = dict(sidecar["drafter_config"], num_mtp_modules=1)
    kwargs["layer_family"] = engine_layer_family(engine, kwargs, where)
    return rebuild_drafter("mtp", kwargs, MTP_MAP.from_format(tensors), target, where)


def check_served(config, architecture: str, engine: str) -> None:
    """The draft layers are of the family the speculators model builds, and it serves the drafter's target."""
    check_engine_families(config, engine, LAYER_FAMILIES[architecture], TARGET_FAMILIES[architecture],
                          TARGET_REASONS[architecture])


def engine_layer_family(engine: dict, sidecar_config: dict, where: str) -> str | None:
    """`layer_family` as the folder's transformer_layer_config says it (its model_type)."""
    layer_config = require(engine, "transformer_layer_config", where)
    return layer_family_from_engine(require(layer_config, "model_type", where), sidecar_config)


# Engine classes whose fc reads a fixed number of target layers: vLLM's llama_eagle3.py builds
# Linear(3 * target_hidden_size, H) (the speculators package itself reads any count; vLLM serves the folder).
FUSED_LAYER_COUNTS = {"eagle3": 3}
# Engine classes that hold a fixed number of draft positions: speculators' MTP holds one module
# (num_nextn_predict_layers = 1, `_export_mtp`).
FIXED_POSITIONS = {"mtp": 1}
# Engine classes that take the target's whole LM head (no d2t/t2d): reduced block drafters are refused
# (`block_engine_tensors`).
FULL_VOCABULARY_ONLY = {"dflash", "dspark"}

# drafter spec's architecture -> (writer(model, out_dir, target, verifier), drafter-config fields the engine carries)
ARCHITECTURES = {
    "eagle3": (_export_eagle3, EAGLE3_ENGINE_FIELDS),
    "dflash": (partial(_export_block, algorithm="dflash"), BLOCK_ENGINE_FIELDS),
    "dspark": (partial(_export_block, algorithm="dspark"), BLOCK_ENGINE_FIELDS + DSPARK_ENGINE_FIELDS),
    "mtp": (_export_mtp, ("num_mtp_modules", "layer_family")),
}
_READERS = {"eagle3": _load_eagle3, "dflash": _load_block, "dspark": _load_block, "mtp": _load_mtp}


def export(model, out_dir: Path, target=None, verifier: str | None = None, **opts) -> Path:
    """`verifier`: what `speculators_config.verifier.name_or_path` names (a hub id or a local model folder);
    default: the target's hub id or folder (`verifier_name_or_path`)."""
    architectures = {name: (partial(write, verifier=verifier), fields)
                     for name, (write, fields) in ARCHITECTURES.items()}
    return export_layout(model, out_dir, target, opts, LAYOUT, DESCRIPTION, architectures)


def load(path: Path, target):
    engine, sidecar, tensors, where = read_layout(path, LAYOUT)
    model_type = engine.get("speculators_model_type")
    if model_type != sidecar["drafter_kind"]:
        raise ValueError(f"{where}: speculators_model_type={model_type!r} "
                         f"but the sidecar says {sidecar['drafter_kind']!r}")
    if model_type not in _READERS:
        raise ValueError(f"{where}: speculators_model_type={model_type!r} "
                         f"is not one DeepSpec reads ({sorted(_READERS)})")
    return _READERS[model_type](engine, tensors, sidecar, target, where)
