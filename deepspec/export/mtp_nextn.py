"""MTP modules in DeepSeek-V3's NextN key layout, ready to be stitched next to the target's own weights.

DeepSeek-V3 stores its MTP module as one extra decoder layer after the L main layers
(`model.layers.{L}.*`, L = num_hidden_layers, with `num_nextn_predict_layers` in config.json); module
k (0-based) of a chain sits at `model.layers.{L + k}`. Per module: `enorm.weight`, `hnorm.weight`,
`eh_proj.weight` [H, 2H] over `[enorm(embedding); hnorm(hidden)]` (embedding first),
`shared_head.norm.weight`, `shared_head.head.weight` and `embed_tokens.weight` (copies of the target's
LM head / embedding), plus the decoder block's usual names (`self_attn.*`, `mlp.*`, `input_layernorm`,
`post_attention_layernorm`). Followed: deepseek-ai/DeepSeek-V3 `README_WEIGHTS.md` and
sgl-project/sglang `python/sglang/srt/models/deepseek_nextn.py` (names only).

The block is the *target family's* decoder layer. SGLang (0.5.23) reads NextN keys only through
`DeepseekV3ForCausalLMNextN` (`models/deepseek_nextn.py:46,127,326`: a `DeepseekV2DecoderLayer`, MLA/MoE), and
rewrites a draft's architecture to it only for `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` targets
(`configs/model_config.py:1032-1036`); other families have their own MTP classes and key names (e.g.
`Qwen3MoeForCausalLMMTP`, `:1155-1157`). So the export is refused for every target family but DeepSeek-V3's
(`TARGET_FAMILIES`), which DeepSpec's drafters do not build today: Qwen3 MTP modules go to the speculators
layout (`format="vllm"`, vllm_speculators.py). The writer below stays for a DeepSeek-V3 family. `config.json`
here is the target's text config plus `num_nextn_predict_layers`; `deepspec_export.json` records that h^0 is the
target's final hidden *after* its final norm (`final_hidden_norm: "post_norm"`), which an engine must
feed identically — checkable only on a serving GPU.

`standalone=True` writes SGLang's separate draft-checkpoint form instead (what
`DeepseekV3ForCausalLMNextN.load_weights` reads): module k at `model.layers.{k}`, `num_hidden_layers ==
num_nextn_predict_layers`; SGLang skips the stored `shared_head.head`/`embed_tokens` there and takes
the target's.
"""

from __future__ import annotations

from pathlib import Path

from deepspec.export.layout import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PrefixMap,
    drafter_state,
    export_architecture,
    pop_shared_copy,
    read_config,
    read_sidecar,
    read_tensors,
    rebuild_drafter,
    require,
    shared_target_tensor,
    write_config,
    write_sidecar,
    write_tensors,
)

LAYOUT = "nextn"
DESCRIPTION = "the NextN layout holds MTP modules"
# SGLang 0.5.23 configs/model_config.py:1032-1036: the target architectures whose drafts load as NextN.
TARGET_FAMILIES = {"mtp": {"deepseek_v3", "deepseek_v32"}}
LAYER_FAMILIES = {"mtp": None}  # the target check decides (DeepSeek-V3's NextN block is its own layer)


def nextn_map(num_target_layers: int, num_modules: int) -> PrefixMap:
    """`mtp_layers.{k}.` <-> `model.layers.{L + k}.` for each chained module k."""
    return PrefixMap(pairs=tuple((f"mtp_layers.{k}.", f"model.layers.{num_target_layers + k}.")
                                 for k in range(num_modules)))


def matches(config: dict) -> bool:
    return "num_nextn_predict_layers" in config and "speculators_model_type" not in config


def export(model, out_dir: Path, target=None, include_shared: bool = True, standalone: bool = False, **opts) -> Path:
    """`include_shared`: store the target's embedding / LM head per module (DeepSeek's NextN files do).

    `standalone`: number the modules from 0 (a separate draft checkpoint) instead of after the target's layers.
    """
    if opts:
        raise ValueError(f"nextn export: unknown option(s) {sorted(opts)}")
    export_architecture(model, LAYOUT, DESCRIPTION)
    model_type = model.config.target_config.get("model_type")
    if model_type not in TARGET_FAMILIES["mtp"]:
        raise ValueError(f"the NextN layout is read only for DeepSeek-V3 targets "
                         f"({sorted(TARGET_FAMILIES['mtp'])}: SGLang 0.5.23 configs/model_config.py:1032-1036, "
                         f"models/deepseek_nextn.py:127); the target is {model_type!r}, whose engine MTP class "
                         f"reads other keys. Qwen3 MTP modules: format='vllm' (speculators' MTP layout)")
    return write_nextn(model, out_dir, target, include_shared, standalone)


def write_nextn(model, out_dir: Path, target, include_shared: bool = True, standalone: bool = False) -> Path:
    """The NextN folder of `export`, without the target-family check (tests check the mapping on other families)."""
    config = model.config
    num_modules = config.num_mtp_modules
    first = 0 if standalone else config.target_num_layers
    tensors = nextn_map(first, num_modules).to_format(drafter_state(model))
    if include_shared:
        where = "the NextN layout (include_shared=True)"
        embedding = shared_target_tensor(target, "embedding", where)
        head = shared_target_tensor(target, "lm_head", where)
        for k in range(num_modules):
            tensors[f"model.layers.{first + k}.embed_tokens.weight"] = embedding
            tensors[f"model.layers.{first + k}.shared_head.head.weight"] = head
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tensors(out_dir / WEIGHTS_FILE, tensors)
    engine = dict(config.target_config)  # stitched: the target's own layer count L, modules start at index L
    engine["num_nextn_predict_layers"] = num_modules
    if standalone:
        engine["num_hidden_layers"] = num_modules
    write_config(out_dir / CONFIG_FILE, engine)
    write_sidecar(out_dir, LAYOUT, model, ("num_mtp_modules",),
                  extra={"first_nextn_layer_index": first, "final_hidden_norm": "post_norm",
                         "includes_shared_embedding_and_head": bool(include_shared)})
    return out_dir


def load(path: Path, target):
    path = Path(path)
    engine, sidecar = read_config(path), read_sidecar(path, LAYOUT)
    where = str(path / CONFIG_FILE)
    num_modules = int(require(engine, "num_nextn_predict_layers", where))
    num_layers = int(require(engine, "num_hidden_layers", where))
    declared = int(sidecar["drafter_config"]["target_config"]["num_hidden_layers"])
    first = sidecar.get("first_nextn_layer_index")
    # Stitched: modules follow the target's L layers; standalone: they are the checkpoint's only layers.
    if not ((first == num_layers == declared) or (first == 0 and num_layers == num_modules)):
        raise ValueError(f"{where}: num_hidden_layers={num_layers} fits neither a stitched layout ({declared} target "
                         f"layers) nor a standalone one; sidecar first_nextn_layer_index={first}")
    state = read_tensors(path / WEIGHTS_FILE)
    for k in range(num_modules):
        prefix = f"model.layers.{first + k}."
        pop_shared_copy(state, prefix + "embed_tokens.weight", target, "embedding", where)
        pop_shared_copy(state, prefix + "shared_head.head.weight", target, "lm_head", where)
    kwargs = dict(sidecar["drafter_config"], num_mtp_modules=num_modules)
    return rebuild_drafter("mtp", kwargs, nextn_map(first, num_modules).from_format(state), target, where)
