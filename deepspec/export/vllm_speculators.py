"""vLLM "speculators" layout for Eagle3 and DFlash (the format vLLM reads via `speculators_model_type`).

Followed files (read for field names and tensor layouts only):
- vllm-project/speculators `src/speculators/models/eagle3/config.py` + `core.py`: `speculators_model_type:
  "eagle3"`, `architectures: ["Eagle3Speculator"]`, `transformer_layer_config` (the draft layer's HF config),
  `draft_vocab_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids`, `speculators_config
  {algorithm, proposal_methods[{proposal_type: "greedy", speculative_tokens, verifier_accept_k,
  accept_tolerance}], default_proposal_method, verifier {name_or_path, architectures}}`; weights
  `embed_tokens.weight`, `fc.weight` [H, 3H], `layers.0.*` (2H attention input, `hidden_norm`), `norm.weight`,
  `lm_head.weight` [draft_vocab_size, H], `d2t`, `t2d`.
- vllm-project/vllm `vllm/transformers_utils/configs/speculators/algos.py`: `update_eagle3` (defaults
  `norm_before_residual` to true when absent, so it is written explicitly: DeepSpec keeps the residual on the
  un-normed hidden stream = false; llama -> Eagle3LlamaForCausalLM, qwen3 -> Eagle3Qwen3ForCausalLM) and
  `update_dflash` (`aux_hidden_state_layer_ids` required, +1 "input of layer" semantics for the runner).
  vLLM captures aux hidden states *entering* decoder layer k, so an id here = DeepSpec id + 1
  (`deepspec.targets.layers.to_input_of_layer`); the speculators default [2, L//2, L-3] is in that sense.
- vllm-project/vllm `vllm/model_executor/models/qwen3_dflash.py`: DFlash weights `layers.{i}.*` (Qwen3-shaped),
  `fc.weight`, `hidden_norm.weight`, `norm.weight` — the same names as SGLang's (`sglang.BLOCK_MAP`).
- vllm-project/speculators `src/speculators/models/dflash/config.py`: `speculators_model_type: "dflash"`,
  `block_size`, `aux_hidden_state_layer_ids`, `mask_token_id`, `draft_vocab_size`, `shift_label` (true: slot j
  predicts x[anchor + j + 1], DeepSpec's block convention).

The target's embedding (and LM head where the draft has none) is stored, because speculators checkpoints
carry them; re-reading checks they equal the given target's. DSpark is not exported here (see `export`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepspec.export.layout import (
    WEIGHTS_FILE,
    PrefixMap,
    check_fused_layer_count,
    check_layer_keys,
    drafter_state,
    engine_text_config,
    export_layout,
    pop_shared_copy,
    read_layout,
    rebuild_drafter,
    require,
    shared_target_tensor,
    write_tensors,
)
from deepspec.export.sglang import BLOCK_MAP, LLAMA_EAGLE3_LAYER, block_engine_tensors
from deepspec.targets.layers import (
    LAYER_ID_CONVENTION,
    from_input_of_layer,
    to_input_of_layer,
)

LAYOUT = "vllm"
DESCRIPTION = "the vLLM speculators format holds Eagle3 and DFlash drafters (MTP modules go to format='nextn')"
EAGLE3_MODEL_TYPES = ("llama", "qwen3")  # vLLM's update_eagle3 architecture map
EAGLE3_MAP = PrefixMap(
    pairs=(("fc.", "fc."), ("midlayer.", "layers.0."), ("norm.", "norm."), ("lm_head.", "lm_head."),
           ("d2t", "d2t"), ("t2d", "t2d")),
    drop=frozenset({"draft_head_initialized"}),
)
QWEN3_EAGLE3_LAYER = LLAMA_EAGLE3_LAYER | {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def to_vllm_layer_ids(config) -> list[int]:
    """DeepSpec 'output of layer l' -> vLLM 'input of layer l + 1'."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"drafter layer_id_convention={config.layer_id_convention!r}; expected {LAYER_ID_CONVENTION!r}")
    return to_input_of_layer(config.target_layer_ids)


def matches(config: dict) -> bool:
    return "speculators_model_type" in config


def _verifier(config, target) -> dict:
    from deepspec.targets.load import EMBEDDED_TARGETS

    name = config.target_name
    if name in EMBEDDED_TARGETS:
        name = EMBEDDED_TARGETS[name].hub_id  # engines load the original model, not DeepSpec's embedded copy
    if not name:
        raise ValueError("vLLM speculators need speculators_config.verifier.name_or_path: the drafter config has no target_name")
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


def _export_eagle3(model, out_dir: Path, target) -> dict:
    config = model.config
    model_type = config.target_config["model_type"]
    if model_type not in EAGLE3_MODEL_TYPES:
        raise ValueError(f"vLLM's speculators Eagle3 supports model_type {EAGLE3_MODEL_TYPES}; the target is {model_type!r}")
    ids = to_vllm_layer_ids(config)
    check_fused_layer_count(config.target_layer_ids, FUSED_LAYER_COUNTS["eagle3"], "vLLM's Eagle3 (llama_eagle3.py)")
    tensors = EAGLE3_MAP.to_format(drafter_state(model))
    check_layer_keys(tensors, "layers.0.", QWEN3_EAGLE3_LAYER if model_type == "qwen3" else LLAMA_EAGLE3_LAYER,
                     "vLLM speculators Eagle3")
    where = "the vLLM speculators Eagle3 layout"
    tensors["embed_tokens.weight"] = shared_target_tensor(target, "embedding", where)
    if "lm_head.weight" not in tensors:  # full vocabulary: the draft head is the target's
        tensors["lm_head.weight"] = shared_target_tensor(target, "lm_head", where)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": engine_text_config(config, 1, tie_word_embeddings=False),
        "draft_vocab_size": config.draft_vocab_size or config.target_vocab_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": _speculators_config("eagle3", config.ttt_steps, _verifier(config, target)),
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
                  layer_id_convention=LAYER_ID_CONVENTION)
    return rebuild_drafter("eagle3", kwargs, state, target, where)


def _export_dflash(model, out_dir: Path, target) -> dict:
    config = model.config
    tensors = block_engine_tensors(model, "vLLM DFlash (qwen3_dflash)")
    where = "the vLLM speculators DFlash layout"
    tensors["embed_tokens.weight"] = shared_target_tensor(target, "embedding", where)
    tensors["lm_head.weight"] = shared_target_tensor(target, "lm_head", where)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": engine_text_config(config, config.num_draft_layers),
        "draft_vocab_size": config.target_vocab_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "aux_hidden_state_layer_ids": to_vllm_layer_ids(config),
        "shift_label": True,  # slot j predicts x[anchor + j + 1] (the anchor is the first prediction slot)
        "sample_from_anchor": True,
        # Every slot of the block is a draft (anchor-first), so a round proposes block_size tokens.
        "speculators_config": _speculators_config("dflash", config.block_size, _verifier(config, target)),
    }


def _load_dflash(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    if engine.get("shift_label") is not True:
        raise ValueError(f"{where}: shift_label must be true: DeepSpec block drafters predict x[anchor + j + 1] at slot j")
    layer_config = require(engine, "transformer_layer_config", where)
    state = dict(tensors)
    pop_shared_copy(state, "embed_tokens.weight", target, "embedding", where)
    pop_shared_copy(state, "lm_head.weight", target, "lm_head", where)
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_input_of_layer(require(engine, "aux_hidden_state_layer_ids", where)),
                  block_size=int(require(engine, "block_size", where)),
                  mask_token_id=int(require(engine, "mask_token_id", where)),
                  num_draft_layers=int(require(layer_config, "num_hidden_layers", where)),
                  layer_id_convention=LAYER_ID_CONVENTION)
    return rebuild_drafter("dflash", kwargs, BLOCK_MAP.from_format(state), target, where)


def _export_dspark(model, out_dir: Path, target) -> dict:
    raise ValueError("vLLM speculators export of DSpark is not implemented: DeepSpec does not yet map its "
                     "Markov/confidence heads onto a speculators 'dspark' checkpoint; use format='sglang' or 'hf'")


# Target families each speculators model holds (DSpark: not mapped yet).
SERVED_FAMILIES = {"eagle3": set(EAGLE3_MODEL_TYPES), "dflash": {"qwen3"}, "dspark": set()}
# Engine classes whose fc reads a fixed number of target layers: vLLM's llama_eagle3.py builds
# Linear(3 * target_hidden_size, H) (the speculators package itself reads any count; vLLM serves the folder).
FUSED_LAYER_COUNTS = {"eagle3": 3}

# drafter spec's architecture -> (writer, drafter-config fields the engine config carries)
ARCHITECTURES = {
    "eagle3": (_export_eagle3, ("target_layer_ids", "draft_vocab_size", "layer_id_convention")),
    "dflash": (_export_dflash, ("target_layer_ids", "block_size", "mask_token_id", "num_draft_layers",
                                "layer_id_convention")),
    "dspark": (_export_dspark, ()),
}


def export(model, out_dir: Path, target=None, **opts) -> Path:
    return export_layout(model, out_dir, target, opts, LAYOUT, DESCRIPTION, ARCHITECTURES)


def load(path: Path, target):
    engine, sidecar, tensors, where = read_layout(path, LAYOUT)
    model_type = engine.get("speculators_model_type")
    if model_type != sidecar["drafter_kind"]:
        raise ValueError(f"{where}: speculators_model_type={model_type!r} but the sidecar says {sidecar['drafter_kind']!r}")
    if model_type == "eagle3":
        return _load_eagle3(engine, tensors, sidecar, target, where)
    if model_type == "dflash":
        return _load_dflash(engine, tensors, sidecar, target, where)
    raise ValueError(f"{where}: speculators_model_type={model_type!r} is not one DeepSpec reads (eagle3, dflash)")
