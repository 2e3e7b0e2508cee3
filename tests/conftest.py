"""Shared fixtures: tiny random targets of several families (with the real SmolLM2 tokenizer), float32; a local
OpenAI-compatible chat server."""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
_EMPTY_THINK = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
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
def tiny_base_target_dir(tmp_path_factory) -> Path:
    """A tiny random base model saved as a model folder: tiny-random-llama with the SmolLM2 tokenizer without its
    chat template (what a base, not instruction-tuned, target looks like)."""
    target = make_tiny_target("llama")  # its own tokenizer object: dropping the template touches nothing else
    target.tokenizer.chat_template = None
    out = tmp_path_factory.mktemp("tiny_base_target")
    target.model.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out


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


# The tiny test config of every registered drafter kind, the one place a kind's test drafter is declared: the
# shared suite (tests/drafters/test_every_kind.py) runs every kind with it, and a kind without an entry fails
# there. Keys are the kind's `drafter.*` fields (its params dataclass); tests add overrides for their variants.
TINY_DRAFTERS = {
    "dspark": {"num_draft_layers": 1, "block_size": 4, "markov_rank": 8},
    "dflash": {"num_draft_layers": 1, "block_size": 4},
    "eagle3": {"ttt_steps": 2, "target_layer_ids": [0, 1, 2]},
    "mtp": {"num_mtp_modules": 2},
    "standalone": {"num_draft_layers": 1, "num_speculative_tokens": 3},
}


def tiny_drafter_params(kind: str, **overrides) -> dict:
    """`TINY_DRAFTERS[kind]` with `overrides` on top (build keywords)."""
    if kind not in TINY_DRAFTERS:
        raise KeyError(f"drafter kind {kind!r} has no tiny test config: add one to TINY_DRAFTERS in tests/conftest.py")
    return {**TINY_DRAFTERS[kind], **overrides}


def make_tiny_drafter(kind: str, target, seed: int = 0, **overrides):
    """A tiny drafter of `kind` on `target` (its tiny config plus `overrides`), built from torch seed `seed`."""
    from deepspec.drafters.build import build_drafter

    torch.manual_seed(seed)
    return build_drafter(kind, target, **tiny_drafter_params(kind, **overrides))


@pytest.fixture(scope="session")
def tiny_drafter():
    """`make_tiny_drafter` for test modules: `tiny_drafter(kind, target, seed=0, **overrides)`."""
    return make_tiny_drafter


@pytest.fixture(scope="session")
def tiny_drafter_configs():
    """`TINY_DRAFTERS` and `tiny_drafter_params` for test modules."""
    from types import SimpleNamespace

    return SimpleNamespace(configs=TINY_DRAFTERS, params=tiny_drafter_params)


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
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("llama")
    convs = make_conversations(20)
    out = tmp_path_factory.mktemp("tiny_cache")
    build_cache({"train": convs[:16], "validation": convs[16:]}, target,
                BuildJob(CacheSchema(out_dir=str(out), layer_ids=[0, 1, 2], max_length=64, batch_size=4,
                                     storage_dtype="fp32", progress=False)))
    return out


@pytest.fixture(scope="session")
def saved_eval_setup(tmp_path_factory, tiny_llama):
    """(root, target folder, prompts): tiny-random-llama saved to disk with a tiny DSpark (`root/dspark`) and an
    Eagle3 (`root/eagle`), and a two-prompt chat benchmark (`mt-bench.jsonl`), for evaluate and `bench speed`."""
    from deepspec.drafters.build import build_drafter

    root = tmp_path_factory.mktemp("eval_cli")
    target_dir = root / "target"
    tiny_llama.model.save_pretrained(target_dir)
    tiny_llama.tokenizer.save_pretrained(target_dir)
    make_tiny_drafter("dspark", tiny_llama, seed=0).save_pretrained(root / "dspark")
    build_drafter("eagle3", tiny_llama).save_pretrained(root / "eagle")
    prompts = root / "mt-bench.jsonl"
    prompts.write_text(json.dumps({"turns": ["Tell me a joke.", "Another one."]}) + "\n"
                       + json.dumps({"turns": ["Name three colours."]}) + "\n")
    return root, target_dir, prompts


class ChatServer:
    """An OpenAI-compatible endpoint on 127.0.0.1 (`url`, without /v1): each POST's JSON body goes to
    `respond(handler, body)`, which answers with `handler.reply(code, payload, raw=None)` or writes its own
    response through the handler; GET /v1/models lists `models`."""

    def __init__(self, respond, models=("tgt",)):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # the model listing regenerate checks before its first request
                if self.path.rstrip("/") == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in models]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                respond(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def reply(self, code, payload, raw=None):
                data = raw if raw is not None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def chat_server():
    """`chat_server(respond)` starts a `ChatServer`; every one started is closed after the test."""
    servers = []

    def start(respond, models=("tgt",)) -> ChatServer:
        servers.append(ChatServer(respond, models))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def write_fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    """The files a resume reads under `run_dir/checkpoints/step-XXXXXXXX`, with their checksums.json when
    `complete`; else what a crash mid-save leaves (a `.tmp` folder, no checksums)."""
    from deepspec.training.checkpoint import MANIFEST_FILE, REQUIRED_FILES
    from deepspec.utils.checksums import folder_manifest
    from deepspec.utils.io import atomic_write_json

    folder = run_dir / "checkpoints" / (f"step-{step:08d}" + ("" if complete else ".tmp"))
    for name in REQUIRED_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name} of step {step}")
    if complete:
        atomic_write_json(folder / MANIFEST_FILE, folder_manifest(folder))
    return folder


@pytest.fixture(scope="session")
def fake_checkpoint():
    """`write_fake_checkpoint` for test modules: `fake_checkpoint(run_dir, step, complete=True)`."""
    return write_fake_checkpoint


@pytest.fixture
def vllm_python() -> Path:
    """The python of vLLM's CPU build (`scripts/bootstrap_vllm.sh`); missing where it installs is a failure."""
    from deepspec.targets.engine import DEFAULT_VLLM_VENV, VLLM_PYTHON_ENV

    python = Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_VENV / "bin" / "python")
    if python.is_file():
        return python
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64") and sys.version_info >= (3, 11):
        pytest.fail(f"{python} is missing: run `bash scripts/bootstrap.sh` (it installs vLLM's CPU build)")
    pytest.skip("vLLM's CPU build installs on Linux x86_64/aarch64 with Python >= 3.11 only")
