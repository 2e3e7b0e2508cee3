"""Random-weight targets with real architectures' shapes and a synthetic tokenizer, built without network.

For checks and benchmarks where the weights do not matter but the shapes do (kernel sizes, memory,
verification cost): `make_random_target(shape)` builds a frozen random model in memory;
`write_random_target(shape, dir)` saves it as a plain Hugging Face folder (config.json, safetensors,
tokenizer files) that every entry point loads as a local target (`target.name=DIR`, `--target DIR`).

Shapes (`RANDOM_SHAPES`): `qwen3-0.6b`, `qwen3-4b`, `qwen3-8b`, `qwen3-14b`, `llama-3.2-1b`, `llama-3.1-8b` and
`gemma-3-12b` (its text model) copy the architecture fields of those models' published config.json (hidden size,
layers, heads, head dim, MLP width, vocabulary, RoPE, tied embeddings): the packaged target configs name theirs
(`target.shape`), so `deepspec plan` knows a named target's widths without network. `tiny-qwen3` / `tiny-llama`
are the 4-layer test shapes of `targets.tiny` over a 512-entry synthetic vocabulary (for CPU dry runs of the same
code paths). `make_standin_target(config, materialised_layers=k)` keeps a config's full depth but gives weights to
its first k decoder layers only (the others stay on the meta device).

The synthetic tokenizer (the real ones cannot be fetched offline): byte-level BPE with no merges, so
any text encodes one token per UTF-8 byte (ids 0..255); the ids above are unreachable filler entries
(each a string of 2-3 byte symbols, so every id decodes) up to the model's vocabulary, then the
special tokens `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) and one reserved token in the
last rows, with a plain ChatML chat template (prefix-consistent, no injected system prompt). Token
statistics are therefore nothing like a real tokenizer's; vocabulary size and chat plumbing are real.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

from deepspec.targets.tiny import tiny_config
from deepspec.utils.io import give_ordinary_modes

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_0|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
NUM_BYTES = 256
TINY_VOCAB = 512
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool, vocab_size: int | None):
    """A dense Qwen3 of the published family settings (head dim 128, 8 KV heads, RoPE theta 1e6)."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab_size or 151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tied)


def _llama3(hidden: int, intermediate: int, layers: int, head_dim: int, tied: bool, rope_factor: float,
            vocab_size: int | None):
    """A Llama 3.x of the published family settings (32 heads, 8 KV heads, llama3 RoPE scaling from 8k)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size or 128256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=head_dim, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": rope_factor, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def _gemma_3_12b(vocab_size: int | None):
    """The text model of Gemma 3 12B (what a drafter reads; its vision tower is not part of the shape)."""
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=vocab_size or 262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


RANDOM_SHAPES: dict[str, Callable] = {
    "qwen3-0.6b": lambda vocab_size: _qwen3(1024, 3072, 28, 16, True, vocab_size),
    "qwen3-4b": lambda vocab_size: _qwen3(2560, 9728, 36, 32, True, vocab_size),
    "qwen3-8b": lambda vocab_size: _qwen3(4096, 12288, 36, 32, False, vocab_size),
    "qwen3-14b": lambda vocab_size: _qwen3(5120, 17408, 40, 40, False, vocab_size),
    "llama-3.2-1b": lambda vocab_size: _llama3(2048, 8192, 16, 64, True, 32.0, vocab_size),
    "llama-3.1-8b": lambda vocab_size: _llama3(4096, 14336, 32, 128, False, 8.0, vocab_size),
    "gemma-3-12b": _gemma_3_12b,
    "tiny-qwen3": lambda vocab_size: tiny_config("qwen3", vocab_size or TINY_VOCAB),
    "tiny-llama": lambda vocab_size: tiny_config("llama", vocab_size or TINY_VOCAB),
}


def _filler_symbols(count: int) -> list[str]:
    """`count` distinct strings of 2-3 byte-level symbols (decodable, never produced without merges)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    combos = itertools.chain(itertools.product(alphabet, repeat=2), itertools.product(alphabet, repeat=3))
    return ["".join(c) for c in itertools.islice(combos, count)]


def synthetic_tokenizer(vocab_size: int):
    """A byte-level tokenizer of exactly `vocab_size` ids with a ChatML template (see module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    num_regular = vocab_size - len(SPECIAL_TOKENS)
    if num_regular < NUM_BYTES:
        raise ValueError(f"vocab_size={vocab_size} must be >= {NUM_BYTES + len(SPECIAL_TOKENS)} "
                         f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens)")
    byte_symbols = _byte_symbols()
    assert set(byte_symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    for symbol in _filler_symbols(num_regular - NUM_BYTES):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise AssertionError(f"synthetic tokenizer has {len(tokenizer)} ids, expected {vocab_size}")
    return tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's printable symbol for each byte value 0..255 (the ByteLevel pre-tokenizer's mapping): printable
    Latin-1 bytes stand for themselves, the others get chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(NUM_BYTES, 2 * NUM_BYTES))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(NUM_BYTES)]


def shaped_config(shape: str, vocab_size: int | None = None):
    """The transformers config of `shape` (a key of RANDOM_SHAPES); `vocab_size` overrides its vocabulary."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {sorted(RANDOM_SHAPES)}")
    return RANDOM_SHAPES[shape](vocab_size)


def make_random_target(shape: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0, vocab_size: int | None = None):
    """A frozen random-weight target of `shape` on `device` (weights initialised there) with the synthetic
    tokenizer, as a `LoadedTarget` (name `random-<shape>`, revision `seed<seed>`)."""
    return make_standin_target(shaped_config(shape, vocab_size), name=f"random-{shape}", device=device, dtype=dtype,
                               seed=seed)


def make_standin_target(config, *, name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        seed: int = 0, materialised_layers: int | None = None):
    """A frozen random-weight target of the transformers `config` with the synthetic tokenizer (`LoadedTarget`,
    revision `seed<seed>`). `materialised_layers`: only the first that many decoder layers get weights; the others
    are built on the meta device (shapes, no storage), so the model keeps the config's depth and widths but holds
    the memory of its embedding, head, final norm and those layers only: enough for whatever reads no later layer
    (training from cached features reads the embedding and the head alone). None: every layer."""
    import copy

    import transformers

    from deepspec.targets.family import get_family
    from deepspec.targets.features import decoder_layers
    from deepspec.targets.load import LoadedTarget

    config = copy.deepcopy(config)
    depth = int(config.num_hidden_layers)
    kept = depth if materialised_layers is None else int(materialised_layers)
    if not 0 <= kept <= depth:
        raise ValueError(f"materialised_layers={materialised_layers} must lie in [0, {depth}]")
    tokenizer = synthetic_tokenizer(config.vocab_size)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    layer_types = getattr(config, "layer_types", None)
    config.num_hidden_layers = kept
    if layer_types is not None:
        config.layer_types = list(layer_types[:kept])
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a 1B model's init on CPU takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if kept < depth:
        model.config.num_hidden_layers = depth
        if layer_types is not None:
            model.config.layer_types = list(layer_types)
        layer_cls = get_family(model.config).decoder_layer_cls
        with torch.device("meta"):
            decoder_layers(model).extend(layer_cls(model.config, i).to(dtype) for i in range(kept, depth))
    model.eval().requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name, path="<memory>", revision=f"seed{seed}")


def write_random_target(shape: str, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu", seed: int = 0, vocab_size: int | None = None) -> Path:
    """Save a random target of `shape` as a Hugging Face folder at `out_dir` (written beside it, then
    renamed into place; an existing folder is replaced). Returns `out_dir`."""
    out = Path(out_dir)
    target = make_random_target(shape, device=device, dtype=dtype, seed=seed, vocab_size=vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()  # not mkdtemp: its 0o700 would survive the rename (the umask decides, as for any folder)
    try:
        target.model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        give_ordinary_modes(tmp)
        (tmp / "DEEPSPEC_SOURCE").write_text(f"random weights (seed {seed}) in the shape of {shape}; "
                                             "synthetic byte-level tokenizer (deepspec.targets.synthetic)\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
