"""docs/train-on-gpus.md, followed at tiny scale: every command block a CPU can run, as written, in order.

The page's ```bash blocks carry a `<!-- step: NAME -->` tag; `(not run: why)` in the tag marks the GPU-only ones.
The runnable blocks run in one temporary folder with the substitutions of the page's closing table (`REPLACE`,
`APPENDED`): a tiny random Qwen3 for Qwen3-8B, an OpenAI-compatible server on 127.0.0.1 answering with it for
vLLM/SGLang, two processes for eight GPUs, a few steps for ten epochs. Then every serving line is checked
against the folder the export step wrote (engine algorithm, path, number of drafted tokens)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "train-on-gpus.md"
TINY = "tiny-random-qwen3"
STEP = re.compile(r"<!-- step: ([a-z0-9-]+)( \(not run: [^)]+\))? -->\n```bash\n(.*?)\n```", re.DOTALL)
PAGE_URL = "http://127.0.0.1:8000/v1"

# (in the page, at tiny scale); "{work}" / "{url}" are the temporary folder and the test server.
REPLACE = [
    ("--verifier Qwen/Qwen3-8B", "--verifier deepspec-tests/tiny-random-qwen3"),
    ("Qwen/Qwen3-0.6B", "{work}/tiny-qwen3-draft"), ("Qwen/Qwen3-8B", TINY), ("qwen3-8b", TINY), (PAGE_URL, "{url}"),
    ("hf:mlabonne/open-perfectblend", "hf:open-perfectblend"),
    ("hf:HuggingFaceH4/MATH-500", "hf:MATH-500"),
    ("--nproc_per_node 8", "--nproc_per_node 2"), ("--num_gpus 8", "--num_gpus 2 --master_port {port}"),
    ("NNODES=2 RDZV_HOST=node1", "NNODES=1 NPROC_PER_NODE=2 RDZV_HOST=127.0.0.1 RDZV_PORT={port}"),
    ("--max-new-tokens 2048", "--max-new-tokens 16"), ("--concurrency 256", "--concurrency 2"),
    ("--batch-size 1024", "--batch-size 4"), ("max_length=4096", "max_length=128"),
    ("--num-prompts 80", "--num-prompts 1"), ("--max-new-tokens 1024", "--max-new-tokens 8"),
]
TINY_TRAIN = ("data.max_anchors_per_seq=8 data.max_tokens_per_row=64 trainer.global_batch_size=4 "
              "trainer.micro_batch_size=2 trainer.max_steps=2 trainer.progress_bar=false trainer.decode_eval_prompts=0 "
              "logger=jsonl calibration.max_prompts=4 calibration.max_new_tokens=16 calibration.min_samples=1")
# (what a command line starts with or contains, what is appended to it)
APPENDED = [
    (re.compile(r"(^|\s)(train\.py|recipes/train_\S+\.sh)\s"), TINY_TRAIN),
    (re.compile(r"^deepspec calibrate\s"), "--max-prompts 4 --max-new-tokens 16 --min-samples 1 --holdout 0"),
    (re.compile(r"\sdata_tools/cache_hiddens\.py\s"), "data.val_fraction=0.5"),
]
# Alternative launches of one run write beside it instead of resuming it.
OUT_DIR = {"train-deepspeed-launcher": "outputs/train/deepspeed-launcher",
           "train-multinode-torchrun": "outputs/train/multinode-torchrun"}
SGLANG_ARCHITECTURES = {"DSPARK": "DSparkDraftModel", "DFLASH": "DFlashDraftModel", "EAGLE3": "LlamaForCausalLMEagle3"}


def steps() -> list[tuple[str, str | None, str]]:
    """(name, why it is not run or None, commands) of every tagged block, in page order."""
    return [(name, why, code) for name, why, code in STEP.findall(PAGE.read_text(encoding="utf-8"))]


def logical_lines(code: str) -> list[str]:
    return [" ".join(part.strip() for part in line.split("\\\n")) for line in re.split(r"(?<!\\)\n", code)]


def tiny(name: str, code: str, work: Path, url: str) -> str:
    for page, scaled in REPLACE:
        code = code.replace(page, scaled.format(work=work, url=url, port=free_port()))
    lines = []
    for line in logical_lines(code):
        for pattern, extra in APPENDED:
            if pattern.search(line):
                line = f"{line} {extra}"
                if name in OUT_DIR and "train" in extra:
                    line += f" trainer.out_dir={OUT_DIR[name]}"
        lines.append(line)
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_every_command_block_is_a_tagged_step_and_every_substitution_is_used():
    text = PAGE.read_text(encoding="utf-8")
    assert len(re.findall(r"^```bash$", text, flags=re.MULTILINE)) == len(steps()), "a ```bash block without a tag"
    names = [name for name, _, _ in steps()]
    assert len(names) == len(set(names))
    runnable = {name for name, why, _ in steps() if not why}
    assert {"regenerate", "cache-estimate", "cache-build", "train", "train-deepspeed-launcher", "watch-training",
            "train-hybrid", "train-multinode-torchrun", "train-other-kinds", "calibrate", "evaluate",
            "export"} <= runnable
    assert set(OUT_DIR) <= runnable
    runnable_code = "\n".join(code for _, why, code in steps() if not why)
    assert [page for page, _ in REPLACE if page not in runnable_code] == []
    for pattern, _ in APPENDED:
        assert any(pattern.search(line) for line in logical_lines(runnable_code)), pattern.pattern


def test_the_tiny_commands_are_the_page_s_with_the_table_s_substitutions(tmp_path):
    (name, _, code), = [s for s in steps() if s[0] == "train-deepspeed-launcher"]
    command = shlex.split(tiny(name, code, tmp_path, "http://127.0.0.1:1/v1"))
    port = command[command.index("--master_port") + 1]
    assert command == [
        "deepspeed", "--no_local_rank", "--num_gpus", "2", "--master_port", port, "train.py", "experiment=paper",
        f"target={TINY}", "drafter=dspark", *TINY_TRAIN.split(), "trainer.out_dir=outputs/train/deepspeed-launcher"]


def test_the_page_picks_the_newest_complete_checkpoint_never_a_half_written_one(tmp_path, fake_checkpoint):
    """The `last` helper of the calibrate, evaluate and export steps, run as the page writes it, in a run folder
    where a crash left `step-*.tmp` half-written after the newest complete checkpoint."""
    helpers = {line for _, why, code in steps() if not why for line in logical_lines(code) if line.startswith("last()")}
    assert len(helpers) == 1, helpers  # one helper, the same in every step
    run = tmp_path / "outputs" / "train" / "dspark-qwen3-8b"
    fake_checkpoint(run, 2)
    fake_checkpoint(run, 4, complete=False)
    returncode, output = run_step(f"set -euo pipefail\n{helpers.pop()}\nlast dspark-qwen3-8b\n", tmp_path,
                                  environment(tmp_path), timeout=120)
    assert returncode == 0, output
    assert output.strip().splitlines()[-1] == "outputs/train/dspark-qwen3-8b/checkpoints/step-00000002/drafter"


class TinyTarget:
    """Answers /v1/chat/completions with the tiny target through DeepSpec's local backend, one request at a time
    (`respond` for the `chat_server` fixture); keeps every request body."""

    def __init__(self):
        from deepspec.targets.load import load_target

        self.target = load_target(TINY, device="cpu")
        self.lock = threading.Lock()
        self.requests = []

    def respond(self, handler, body):
        from deepspec.data.regenerate import LocalBackend, SamplingParams
        from deepspec.data.rendering import Rendering

        sampling = SamplingParams(temperature=body["temperature"], top_p=body["top_p"], top_k=body.get("top_k", 0))
        backend = LocalBackend(self.target.model, self.target.tokenizer,
                               rendering=Rendering(chat_template_kwargs=body.get("chat_template_kwargs") or {}))
        with self.lock:
            self.requests.append(body)
            (answer,) = backend.generate([body["messages"]], sampling, body["max_tokens"], seed=body["seed"])
        handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": answer.text},
                                         "finish_reason": answer.finish_reason}],
                            "usage": {"completion_tokens": answer.num_tokens}})


def write_datasets(work: Path) -> None:
    """Local copies of the page's two hub datasets, in their columns: Open-PerfectBlend's ShareGPT-style
    `conversations`, MATH-500's `problem` (test split)."""
    datasets = pytest.importorskip("datasets")
    from deepspec.data.sources import load_sharegpt_bundled

    conversations, _ = load_sharegpt_bundled(limit=40)
    rows = [[{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in conv.messages]
            for conv in conversations if 20 <= len(conv.messages[0]["content"]) <= 400][:8]
    datasets.Dataset.from_dict({"conversations": rows}).save_to_disk(str(work / "open-perfectblend"))
    datasets.Dataset.from_dict({"problem": ["What is 7 * 6?", "Solve x + 3 = 5."]}).save_to_disk(str(work / "MATH-500"))


def write_draft_model(work: Path) -> None:
    """A small causal LM with the target's tokenizer, as a Hugging Face folder: the tiny Qwen3 itself, saved."""
    from deepspec.targets.load import load_target

    draft = load_target(TINY, device="cpu")
    draft.model.save_pretrained(work / "tiny-qwen3-draft")
    draft.tokenizer.save_pretrained(work / "tiny-qwen3-draft")


def environment(work: Path) -> dict:
    shims = work / ".bin"
    shims.mkdir()
    (shims / "deepspec").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m deepspec.cli "$@"\n')
    (shims / "deepspec").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(PATH=os.pathsep.join([str(shims), str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    return env


def run_step(script: str, cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Run one step in its own process group, so that a timeout also ends the launchers' worker processes."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -1, f"timed out after {timeout} s\n{output}"
    return proc.returncode, output


@pytest.mark.slow
def test_the_walkthrough_runs_at_tiny_scale_and_its_serving_lines_match_the_exports(tmp_path, chat_server):
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("train.py", "data_tools", "recipes"):
        (work / name).symlink_to(REPO / name)
    write_datasets(work)
    write_draft_model(work)
    env = environment(work)
    target = TinyTarget()
    url = chat_server(target.respond, models=(TINY,)).url + "/v1"
    for name, why, code in steps():
        if why:
            continue
        script = "set -euo pipefail\n" + tiny(name, code, work, url) + "\n"
        returncode, output = run_step(script, work, env, timeout=1800)
        assert returncode == 0, f"step {name} failed:\n{script}\n{output[-4000:]}"
        if name == "regenerate":  # the answers came from the server, with the page's sampling settings
            assert target.requests and all(r["max_tokens"] == 16 and "seed" in r for r in target.requests)

    assert (work / "eval" / TINY / "table.md").is_file()
    served = {name: code for name, why, code in steps() if name.startswith("serve-") and why
              and not name.startswith("serve-target")}
    exported = {p.name for p in (work / "export").iterdir()}
    checked = set()
    for name, code in served.items():
        line = " ".join(logical_lines(code))
        if line.startswith("vllm serve"):
            spec = json.loads(re.search(r"--speculative-config '(\{.*\})'", line).group(1))
            folder = work / spec["model"]
            config = json.loads((folder / "config.json").read_text())
            if spec["method"] == "draft_model":
                assert config["deepspec_layout"] == "causal_lm"
                tokens = json.loads((folder / "deepspec_export.json").read_text())["drafter_config"][
                    "num_speculative_tokens"]
            else:
                assert config["speculators_config"]["algorithm"] == spec["method"], name
                tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
            assert spec["num_speculative_tokens"] == tokens, name
        else:
            args = shlex.split(line)
            folder = work / args[args.index("--speculative-draft-model-path") + 1]
            algorithm = args[args.index("--speculative-algorithm") + 1]
            config = json.loads((folder / "config.json").read_text())
            if algorithm == "STANDALONE":
                sidecar = json.loads((folder / "deepspec_export.json").read_text())
                k = sidecar["drafter_config"]["num_speculative_tokens"]
                assert [int(args[args.index(f"--speculative-{o}") + 1]) for o in ("num-steps", "num-draft-tokens")] \
                    == [k, k + 1]
                assert config["deepspec_layout"] == "causal_lm"
            else:
                assert config["architectures"] == [SGLANG_ARCHITECTURES[algorithm]], name
        checked.add(folder.name)
    assert exported - checked == {"dspark-hf"}  # every engine layout exported is served by a line
