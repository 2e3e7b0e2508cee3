"""SGLang layout: Eagle3 as `LlamaForCausalLMEagle3`, DFlash as `DFlashDraftModel`, DSpark as DFlash + heads.

Followed files (sgl-project/sglang, read for field names and tensor layouts only):
- `python/sglang/srt/models/llama_eagle3.py`: weights `fc.weight` [H, 3H] (exactly three fused layers),
  `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v}_proj`
  with 2H inputs ([embedding; hidden], embedding first), `o_proj`, `mlp.{gate,up,down}_proj`, `norm.weight`,
  `lm_head.weight` [draft_vocab_size, H], `d2t` (offsets: target = draft + d2t[draft]), `t2d` (ignored by the
  loader). No q/k norms: only Llama-shaped layers fit. `draft_vocab_size: null` with
  `tie_word_embeddings: false` makes SGLang take the target's LM head (our full-vocabulary case); the
  embedding is always the target's (`set_embed`), so it is not stored.
- `set_eagle3_layers_to_capture` in the target models: capture id = config id + 1 "before layer", i.e.
  `eagle_config.eagle_aux_hidden_state_layer_ids` are "output of layer k" ids — DeepSpec's convention.
- `python/sglang/srt/models/dflash.py` + `speculative/dflash_utils.py`: weights `layers.{i}.*` (Qwen3-shaped:
  q/k norms, SiLU MLP), `fc.weight` [H, m*H], `hidden_norm.weight` (applied after fc), `norm.weight`; config
  `architectures: ["DFlashDraftModel"]`, `dflash_config {block_size, mask_token_id, mask_token,
  target_layer_ids}` ("after layer k", HF style — DeepSpec's convention), `num_target_layers`.

DeepSpec block drafters draft from the anchor (slot j predicts x[anchor + j + 1]); upstream DFlash
checkpoints leave slot 0 unscored. The config records `dflash_config.sample_from_anchor: true` (the name
SGLang's DSpark code paths use); whether a given SGLang build honours it can only be checked on a GPU
server. DSpark has no upstream SGLang loader: it is written as `DSparkDraftModel` (the DFlash tensors plus
`markov_head.*` / `confidence_head.*` named as in vllm-project/speculators `models/dspark/markov_head.py`
and `confidence_head.py`) with a `dspark_config` block.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepspec.drafters.spec import get_drafter_spec
from deepspec.export.layout import (
    WEIGHTS_FILE,
    PrefixMap,
    check_fused_layer_count,
    check_layer_keys,
    drafter_state,
    engine_text_config,
    export_layout,
    read_layout,
    rebuild_drafter,
    require,
    write_tensors,
)
from deepspec.targets.layers import LAYER_ID_CONVENTION

LAYOUT = "sglang"
DESCRIPTION = "the SGLang layout holds Eagle3, DFlash and DSpark drafters (MTP modules go to format='nextn')"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "DSparkDraftModel"  # no upstream SGLang loader (see module docstring)
BLOCK_ARCHS = {"dflash": DFLASH_ARCH, "dspark": DSPARK_ARCH}  # drafter spec's architecture -> engine class
# Target families whose draft layers each engine class can hold (LlamaForCausalLMEagle3: no q/k norms, no
# biases; DFlashDraftModel: Qwen3-shaped layers). The exporter checks the tensors themselves either way.
SERVED_FAMILIES = {"eagle3": {"llama", "mistral"}, "dflash": {"qwen3"}, "dspark": {"qwen3"}}
# Engine classes whose fc reads a fixed number of target layers (llama_eagle3.py: Linear(3 * H, H)).
FUSED_LAYER_COUNTS = {"eagle3": 3}

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
    ("confidence.prev_embed.", "confidence_head.prev_embed."),  # DeepSpec-only: confidence head without Markov head
))

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LLAMA_EAGLE3_LAYER = {*(f"{p}.weight" for p in _PROJ), *_MLP, "input_layernorm.weight", "hidden_norm.weight",
                      "post_attention_layernorm.weight"}
QWEN3_DFLASH_LAYER = {*(f"{p}.weight" for p in _PROJ), *(f"{p}.bias" for p in _PROJ), *_MLP,
                      "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight",
                      "post_attention_layernorm.weight"}
MARKOV_HEAD_TYPES = {"markov": "vanilla", "rnn": "rnn"}  # DeepSpec sequential_head -> speculators markov_head_type


def to_sglang_layer_ids(config) -> list[int]:
    """SGLang's Eagle3 aux ids and DFlash target_layer_ids are 'output of layer k', like DeepSpec's."""
    if config.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"drafter layer_id_convention={config.layer_id_convention!r}; expected {LAYER_ID_CONVENTION!r}")
    return [int(i) for i in config.target_layer_ids]


def from_sglang_layer_ids(ids: list[int]) -> list[int]:
    return [int(i) for i in ids]


def matches(config: dict) -> bool:
    return "speculators_model_type" not in config and bool(
        {EAGLE3_ARCH, DFLASH_ARCH, DSPARK_ARCH} & set(config.get("architectures") or []))


# -- Eagle3 ------------------------------------------------------------------------------------
def _export_eagle3(model, out_dir: Path) -> dict:
    config = model.config
    ids = to_sglang_layer_ids(config)
    check_fused_layer_count(ids, FUSED_LAYER_COUNTS["eagle3"], f"SGLang's {EAGLE3_ARCH}")
    tensors = EAGLE3_MAP.to_format(drafter_state(model))
    check_layer_keys(tensors, "midlayer.", LLAMA_EAGLE3_LAYER, f"SGLang {EAGLE3_ARCH}")
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    return engine_text_config(
        config, 1, architectures=[EAGLE3_ARCH],
        draft_vocab_size=config.draft_vocab_size,  # null -> SGLang loads the LM head from the target
        tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    )


def _load_eagle3(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    eagle = require(engine, "eagle_config", where)
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_sglang_layer_ids(require(eagle, "eagle_aux_hidden_state_layer_ids", where)),
                  draft_vocab_size=engine.get("draft_vocab_size"), layer_id_convention=LAYER_ID_CONVENTION)
    state = EAGLE3_MAP.from_format(tensors)
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
    if config.target_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{engine} supports only SiLU MLPs; the target uses hidden_act={config.target_config['hidden_act']!r}")
    tensors = BLOCK_MAP.to_format(drafter_state(model))
    for index in range(config.num_draft_layers):
        check_layer_keys(tensors, f"layers.{index}.", QWEN3_DFLASH_LAYER, engine)
    return tensors


def dspark_fields(config) -> dict:
    """DSpark head fields in vllm-project/speculators' names (+ DeepSpec's calibration temperatures)."""
    return {
        "markov_rank": config.markov_rank if config.sequential_head != "none" else 0,
        "markov_head_type": MARKOV_HEAD_TYPES.get(config.sequential_head),
        "enable_confidence_head": bool(config.confidence_head),
        "confidence_head_with_markov": bool(config.confidence_head and config.sequential_head != "none"),
        "confidence_rank": config.markov_rank,
        "calibration_temperatures": config.calibration_temperatures,
    }


def dspark_kwargs(fields: dict) -> dict:
    head_type = fields.get("markov_head_type")
    inverse = {v: k for k, v in MARKOV_HEAD_TYPES.items()}
    if head_type is not None and head_type not in inverse:
        raise ValueError(f"markov_head_type={head_type!r} is not one DeepSpec implements ({sorted(inverse)})")
    return {
        "sequential_head": inverse[head_type] if head_type is not None and fields.get("markov_rank") else "none",
        "markov_rank": int(fields.get("confidence_rank") or fields.get("markov_rank") or 1),
        "confidence_head": bool(fields.get("enable_confidence_head")),
        "calibration_temperatures": fields.get("calibration_temperatures"),
    }


BLOCK_ENGINE_FIELDS = ("target_layer_ids", "block_size", "mask_token_id", "num_draft_layers", "layer_id_convention")
DSPARK_ENGINE_FIELDS = ("sequential_head", "markov_rank", "confidence_head", "calibration_temperatures")


def _export_block(model, out_dir: Path, target, architecture: str) -> dict:
    config = model.config
    arch = BLOCK_ARCHS[architecture]
    tensors = block_engine_tensors(model, f"SGLang {arch}")
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    dflash_config = {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": to_sglang_layer_ids(config),
        "sample_from_anchor": True,  # slot 0 (the anchor) already predicts the next token
    }
    if target is not None:
        dflash_config["mask_token"] = target.tokenizer.convert_ids_to_tokens(config.mask_token_id)
    engine = engine_text_config(config, config.num_draft_layers, architectures=[arch], block_size=config.block_size,
                                num_target_layers=config.target_num_layers, dflash_config=dflash_config)
    if architecture == "dspark":
        engine["dspark_config"] = dspark_fields(config)
    return engine


def _load_block(engine: dict, tensors: dict, sidecar: dict, target, where: str):
    kind = sidecar["drafter_kind"]
    architecture = get_drafter_spec(kind).export_layouts.get(LAYOUT)
    expected_arch = BLOCK_ARCHS.get(architecture)
    if expected_arch not in engine.get("architectures", []):
        raise ValueError(f"{where}: architectures={engine.get('architectures')} but the sidecar says drafter_kind={kind!r}")
    dflash = require(engine, "dflash_config", where)
    if dflash.get("sample_from_anchor") is not True:
        raise ValueError(f"{where}: dflash_config.sample_from_anchor must be true: DeepSpec block drafters predict "
                         f"x[anchor + j + 1] at slot j (checkpoints with the original DFlash labels are not DeepSpec's)")
    num_target_layers = int(require(engine, "num_target_layers", where))
    declared = sidecar["drafter_config"]["target_config"]["num_hidden_layers"]
    if num_target_layers != declared:
        raise ValueError(f"{where}: num_target_layers={num_target_layers} but the target config has {declared} layers")
    kwargs = dict(sidecar["drafter_config"])
    kwargs.update(target_layer_ids=from_sglang_layer_ids(require(dflash, "target_layer_ids", where)),
                  block_size=int(require(dflash, "block_size", where)),
                  mask_token_id=int(require(dflash, "mask_token_id", where)),
                  num_draft_layers=int(require(engine, "num_hidden_layers", where)),
                  layer_id_convention=LAYER_ID_CONVENTION)
    if architecture == "dspark":
        kwargs.update(dspark_kwargs(require(engine, "dspark_config", where)))
    return rebuild_drafter(kind, kwargs, BLOCK_MAP.from_format(tensors), target, where)


# drafter spec's architecture -> (writer, drafter-config fields the engine config carries)
ARCHITECTURES = {
    "eagle3": (lambda model, out_dir, target: _export_eagle3(model, out_dir),
               ("target_layer_ids", "draft_vocab_size", "layer_id_convention")),
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
