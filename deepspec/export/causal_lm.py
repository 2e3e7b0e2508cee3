"""Plain causal-LM layout of a standalone drafter: a transformers model folder any engine loads as a draft model.

`config.json` is the draft LM's own config (`architectures`: its `*ForCausalLM` class, `vocab_size` = the
target's), `model.safetensors` its weights in that class's layout (written by transformers' `save_pretrained`,
which also handles tied embeddings), plus the target's tokenizer and `generation_config.json`. DeepSpec's
fields go to `deepspec_export.json`; `config.json` only gains the marker `deepspec_layout: "causal_lm"`.

Shared (frozen target) embedding and head are materialised, since a plain model carries its own:
  embedding  E'[v] = P_in (s_t E[v]) / s_d   (P_in = `embed_proj`, identity at the target's width; s_t, s_d the
                                                 target's and the exported class's embedding scales, Gemma: sqrt(H))
  LM head    W'    = W_t P_out               (P_out = `head_proj`, identity at the target's width)
so the exported model computes the drafter's logits. A wrapped model whose embedding has padding rows past the
target's vocabulary is cut to it: vLLM's draft_model method requires equal vocabulary sizes.

Reading it back (`load`) wraps the folder as a standalone drafter (`base_model=<folder>`, the tokenizer check
included): the round trip every test runs. Engine facts (versions and lines): deepspec/export/README.md.

Shape legend: V = target vocabulary, H = target hidden, W = draft width.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from deepspec.export.layout import (
    CONFIG_FILE,
    export_architecture,
    read_config,
    read_sidecar,
    write_config,
    write_sidecar,
)
from deepspec.utils.io import atomic_write_text

log = logging.getLogger(__name__)

LAYOUT = "causal_lm"
DESCRIPTION = "the causal_lm layout holds standalone drafters (a plain transformers causal LM)"
# Any family transformers / the engines implement, for the draft LM and the target (None: no restriction).
LAYER_FAMILIES = {"causal_lm": None}
TARGET_FAMILIES = {"causal_lm": None}
MARKER = "deepspec_layout"


def matches(config: dict) -> bool:
    return config.get(MARKER) == LAYOUT


def _embed_scale(embedding: torch.nn.Module) -> float:
    scale = getattr(embedding, "embed_scale", 1.0)
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


@torch.no_grad()
def causal_lm_of(model, target) -> torch.nn.Module:
    """The drafter as a plain `*ForCausalLM` over the target's vocabulary (module docstring)."""
    from deepspec.drafters.standalone.model import lm_text_config

    config, vocab = model.config, model.config.target_vocab_size
    fields = dict(config.lm_config, vocab_size=vocab)
    if config.share_target_embeddings:  # the draft LM's own config had a placeholder vocabulary
        target_fields = config.target_config
        fields.update({k: target_fields.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")})
    lm_config = lm_text_config(fields)
    lm_config.architectures = [AutoModelForCausalLM._model_mapping[type(lm_config)].__name__]
    exported = AutoModelForCausalLM.from_config(lm_config).to(model.dtype)
    if not config.share_target_embeddings:
        exported.load_state_dict(_fit_vocab_rows(model.lm, vocab), strict=True)
        return exported.eval()
    missing, unexpected = exported.base_model.load_state_dict(model.lm.state_dict(), strict=False)
    embedding = exported.get_input_embeddings()
    if unexpected or [k for k in missing if not k.startswith("embed")]:
        raise ValueError(f"causal_lm export: the draft layers do not fit {type(exported).__name__} "
                         f"(missing {missing}, unexpected {unexpected})")
    parts = model.target_parts
    rows_VH = parts.embed_tokens.weight * _embed_scale(parts.embed_tokens)
    rows_VW = model.embed_proj(rows_VH.to(model.dtype)) if config.projects_embeddings else rows_VH
    head_VW = parts.lm_head_weight @ model.head_proj.weight if config.projects_embeddings else parts.lm_head_weight
    exported.get_output_embeddings().weight = torch.nn.Parameter(head_VW.to(model.dtype).clone())
    embedding.weight.copy_(rows_VW / _embed_scale(embedding))
    exported.config.tie_word_embeddings = bool(torch.equal(embedding.weight, exported.get_output_embeddings().weight))
    if exported.config.tie_word_embeddings:
        exported.tie_weights()
    return exported.eval()


def _fit_vocab_rows(lm, vocab: int) -> dict[str, torch.Tensor]:
    """The causal LM's state dict with its embedding / LM head cut to `vocab` rows (padding rows dropped)."""
    per_token = [lm.get_input_embeddings().weight, lm.get_output_embeddings().weight]
    state = {}
    for key, tensor in lm.state_dict(keep_vars=True).items():
        if any(tensor is weight for weight in per_token):
            if tensor.shape[0] < vocab:
                raise ValueError(f"the draft model's vocabulary ({tensor.shape[0]} rows) is smaller than the target's "
                                 f"{vocab}: an engine's draft model needs the target's vocabulary size")
            tensor = tensor[:vocab]
        state[key] = tensor.detach()
    return state


def export(model, out_dir: Path, target=None, **opts) -> Path:
    if opts:
        raise ValueError(f"causal_lm export: unknown option(s) {sorted(opts)}")
    export_architecture(model, LAYOUT, DESCRIPTION)
    if target is None:
        raise ValueError("the causal_lm layout holds the target's tokenizer (and, for a drafter sharing the target's "
                         "embedding and head, their materialised copies): pass target=... (--target)")
    out_dir = Path(out_dir)
    exported = causal_lm_of(model, target)
    exported.save_pretrained(out_dir)
    config = read_config(out_dir)
    config[MARKER] = LAYOUT
    write_config(out_dir / CONFIG_FILE, config)
    target.tokenizer.save_pretrained(out_dir)
    write_sidecar(out_dir, LAYOUT, model, engine_fields=("lm_config",),
                  extra={"architecture": config["architectures"][0]})
    atomic_write_text(out_dir / "README.md", usage(model, config["architectures"][0]))
    return out_dir


def usage(model, architecture: str) -> str:
    k = model.config.num_speculative_tokens
    target = model.config.target_name or "<target>"
    return (f"# Standalone draft model ({architecture})\n\n"
            f"Drafter for `{target}` exported by DeepSpec (same tokenizer; {k} draft tokens per round).\n\n"
            "```bash\n"
            f"vllm serve {target} --speculative-config "
            f"'{{\"method\": \"draft_model\", \"model\": \"<this folder>\", \"num_speculative_tokens\": {k}}}'\n"
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE \\\n"
            f"    --speculative-draft-model-path <this folder> --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n"
            "```\n\n"
            "```python\n"
            "from transformers import AutoModelForCausalLM\n"
            "draft = AutoModelForCausalLM.from_pretrained(\"<this folder>\")\n"
            "```\n")


def load(path: Path, target):
    """The exported folder wrapped as a standalone drafter (tokenizer check included)."""
    from deepspec.drafters.build import build_drafter

    sidecar = read_sidecar(path, LAYOUT)["drafter_config"]
    keep = {k: sidecar[k] for k in ("num_speculative_tokens", "calibration_temperatures", "calibration_label_kind")
            if sidecar.get(k) is not None}
    return build_drafter("standalone", target, base_model=str(path), **keep).eval()
