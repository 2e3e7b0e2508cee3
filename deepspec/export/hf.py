"""Hugging Face layout: DeepSpec's own `save_pretrained` folder, plus the target's tokenizer and a model card.

The folder is what `deepspec.drafters.build.load_drafter(path, target)` (or the drafter class's
`from_pretrained`) reads: `config.json` holds the drafter kind (`model_type` and `drafter_kind`), the
target id/revision/fingerprint, the layer ids and their convention, block size, mask token,
calibration temperatures and the draft-vocabulary size; `model.safetensors` holds the drafter's own
tensors (including the `d2t` offsets / `t2d` mask of a reduced draft vocabulary: Eagle3, DFlash, DSpark).
The target's embedding and LM head are not
stored: the user passes the target at load time. The state-dict adapter is the identity here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from deepspec.drafters.spec import capabilities_of
from deepspec.export.layout import CONFIG_FILE, WEIGHTS_FILE, export_architecture, read_config, write_config
from deepspec.export.model_card import ModelCardInputs, render_model_card
from deepspec.utils.io import atomic_write_text

log = logging.getLogger(__name__)

LAYOUT = "hf"
DESCRIPTION = "the HF layout holds DeepSpec drafters"
# Any draft-layer family on any target family (None: no restriction; formats_for reads both).
LAYER_FAMILIES = {"deepspec": None}
TARGET_FAMILIES = {"deepspec": None}


def matches(config: dict) -> bool:
    return str(config.get("model_type", "")).startswith("deepspec_")


def export(model, out_dir: Path, target=None, card: ModelCardInputs | None = None, **opts) -> Path:
    if opts:
        raise ValueError(f"hf export: unknown option(s) {sorted(opts)}")
    export_architecture(model, LAYOUT, DESCRIPTION)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if not (out_dir / WEIGHTS_FILE).is_file():
        raise RuntimeError(f"save_pretrained did not write {out_dir / WEIGHTS_FILE}")
    config = read_config(out_dir)
    config["drafter_kind"] = type(model.config).drafter_kind  # explicit, besides model_type
    if capabilities_of(model).draft_vocab and model.config.draft_vocab_size is not None:
        # Where the reduced vocabulary lives and how to read it (SGLang/vLLM semantics).
        config["draft_vocab_mapping"] = {
            "tensors": ["d2t", "t2d"],
            "d2t": "int64 [draft_vocab_size] offsets: target_id = draft_id + d2t[draft_id]",
            "t2d": "bool [vocab_size] mask of the target ids kept in the draft vocabulary",
        }
    write_config(out_dir / CONFIG_FILE, config)
    if target is not None:
        # Convenience for users: the target's tokenizer and generation defaults next to the drafter.
        target.tokenizer.save_pretrained(out_dir)
        generation_config = getattr(target.model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(out_dir)
    else:
        log.warning("hf export without a target: no tokenizer files (and no generation_config.json) were written; "
                    "pass --target (target=...) to include the target's tokenizer")
    atomic_write_text(out_dir / "README.md", render_model_card(model.config, card or ModelCardInputs()))
    return out_dir


def load(path: Path, target):
    from deepspec.drafters.build import load_drafter

    return load_drafter(path, target)


def push_to_hub(folder: str | Path, repo_id: str, api=None, private: bool = False,
                commit_message: str = "Upload DeepSpec drafter") -> str:
    """Upload an exported folder with `huggingface_hub.HfApi().upload_folder`; returns the repo id.

    `api` may be any object with `create_repo` and `upload_folder` (tests pass a recorder, no network).
    """
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} not found: export the drafter before pushing it")
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"push_to_hub: repo_id={repo_id!r} must look like 'org/name'")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=commit_message)
    log.info("pushed %s to https://huggingface.co/%s", folder, repo_id)
    return repo_id
