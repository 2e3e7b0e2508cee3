"""Shared fixtures: tiny random targets of several families (with the real SmolLM2 tokenizer), float32."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)


from deepspec.targets.load import make_tiny_target  # noqa: E402
from deepspec.targets.tiny import TINY_FAMILIES  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    """The consumer libraries the interop tests (tests/export/consumers) ran against, in the CI log (-q too)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("speculators", "dflash", "specforge"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    terminalreporter.write_line("export consumers: " + ", ".join(f"{name} {v}" for name, v in found.items()))


# Qwen3-style: `enable_thinking=False` adds an empty think block after every assistant header (the generation
# prompt's and, in history, the answers'), as Qwen3's template does for its non-thinking mode.
_EMPTY_THINK = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
QWEN3_THINKING = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}" + _EMPTY_THINK + "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + _EMPTY_THINK + "{%- endif %}"
)


@pytest.fixture(scope="session")
def qwen3_style_tokenizer():
    """The SmolLM2 tokenizer with a tiny Qwen3-style template that reads `enable_thinking`."""
    from deepspec.targets.load import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")  # own copy: the template is changed
    tokenizer.chat_template = QWEN3_THINKING
    return tokenizer


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3():
    return make_tiny_target("gemma3")


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_target(request):
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target in float32 (converted once into the DeepSpec cache)."""
    from deepspec.targets.load import load_target

    return load_target("smollm2-135m", dtype="float32", device="cpu")


def make_conversations(n: int):
    from deepspec.data.sources import Conversation

    convs = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: tell me about " + "topic " * (i % 5 + 1)},
                    {"role": "assistant", "content": "Sure, here is an answer " + "with words " * (i % 7 + 3)}]
        convs.append(Conversation(id=f"conv{i}", messages=messages, source="test", line=i))
    return convs


@pytest.fixture(scope="session")
def conversations_factory():
    """`make_conversations` for test modules (pytest's importlib mode keeps conftest out of their imports)."""
    return make_conversations


def experiment_drafter_params(kind: str, experiment: str = "cpu") -> dict:
    """The build keywords of `kind`'s drafter in a training preset: `experiment=<experiment> drafter=<kind>`
    composed by Hydra as `deepspec train` composes it (deepspec/conf/experiment/<experiment>[/<kind>].yaml)."""
    from deepspec.training.config import compose_train_config, resolve_config

    cfg = resolve_config(compose_train_config([f"experiment={experiment}", f"drafter={kind}"]))
    return cfg.drafter.to_config_kwargs()


@pytest.fixture(scope="session")
def experiment_drafter():
    """`experiment_drafter_params` for test modules."""
    return experiment_drafter_params


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """16 train + 4 validation samples cached from tiny-random-llama (fp32 storage, layers 0..2: tiny targets
    have 4 layers)."""
    from deepspec.cache import build_cache
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("llama")
    convs = make_conversations(20)
    out = tmp_path_factory.mktemp("tiny_cache")
    build_cache({"train": convs[:16], "validation": convs[16:]}, target, out, [0, 1, 2], max_length=64,
                batch_size=4, storage_dtype="fp32", progress=False)
    return out
