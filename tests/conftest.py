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
