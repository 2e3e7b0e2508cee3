"""Shared fixtures: tiny random targets of several families (with the real SmolLM2 tokenizer), float32."""

from __future__ import annotations

import os

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
