"""A target with only its head loaded: the final norm and the LM head, the decoder layers left
unmaterialised.

What DeepSpec needs of a target whose decoder runs elsewhere (a serving engine computes the hidden
states, `cache.engine=vllm`): its config and tokenizer (fingerprint, rendering), the final norm
(applied to the last layer's output the engine returns) and the LM head (the log-normaliser and
top-k of every cached token). The model is built on the meta device and only those weights are read
from the checkpoint's safetensors files, so a target of hundreds of GB costs DeepSpec the size of
its head. A checkpoint that names them differently is refused, naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from deepspec.targets.features import decoder_stack
from deepspec.targets.load import (
    LoadedTarget,
    load_target_config,
    load_tokenizer,
    parse_dtype,
    resolve_target,
)
from deepspec.targets.tiny import is_tiny_target


def _checkpoint_files(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of a saved model folder (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update({name: path for name in f.keys()})
    return files


def _read_tensor(files: dict[str, Path], name: str, folder: Path) -> torch.Tensor:
    from safetensors import safe_open

    if name not in files:
        raise ValueError(f"{folder}: no tensor {name!r} in its safetensors files (the head-only "
                         "load reads the final norm and the LM head by their transformers names)")
    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)


def load_target_head(name_or_path: str, dtype: str | None = None, device: str | None = None,
                     revision: str | None = None) -> LoadedTarget:
    """`name_or_path` (an embedded name or a local safetensors folder) with only its final norm
    and its LM head loaded (module docstring); everything else stays on the meta device."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if is_tiny_target(name_or_path):
        raise ValueError(f"target.name={name_or_path}: a tiny random target is built in memory; an "
                         "engine loads its target from a folder (save it with save_pretrained and "
                         "name the folder)")
    path, _, rev = resolve_target(name_or_path, revision)
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"target.name={name_or_path!r}: the engine loads the target from a local "
                         "folder with safetensors weights (download it first, e.g. `hf download ID "
                         "--local-dir DIR`)")
    torch_dtype = parse_dtype(dtype, device)
    config = load_target_config(name_or_path, revision)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.eval().requires_grad_(False)
    # Tied weights appear once, by their first name (the embedding's: what the checkpoint holds).
    names = {id(p): n for n, p in model.named_parameters()}
    files = _checkpoint_files(folder)
    for module in (decoder_stack(model).norm, model.get_output_embeddings()):
        for leaf, param in list(module.named_parameters(recurse=False)):
            tensor = _read_tensor(files, names[id(param)], folder)
            tensor = tensor.to(device=device, dtype=torch_dtype)
            setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return LoadedTarget(model=model, tokenizer=load_tokenizer(name_or_path, revision),
                        name=name_or_path, path=str(folder), revision=rev)
