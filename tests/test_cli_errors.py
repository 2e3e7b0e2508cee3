"""Every `deepspec` subcommand refuses a missing input and a refused output with one line on stderr, exit 1 (a
usage error: 2) and no traceback; `--debug` / DEEPSPEC_DEBUG=1 and real bugs still print the traceback.

Each case is its own process: a driver process imports DeepSpec once (~6 s of torch and transformers) and
forks one child per case, which runs `deepspec.cli.main()` on its sys.argv as the console script would (an
uncaught exception goes to sys.excepthook, SystemExit's code is the exit status). One fresh interpreter checks
the driver's fidelity (`test_a_fresh_console_script_prints_one_line`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
import json, os, signal, sys
import deepspec.cli, deepspec.data.cli, deepspec.cache.cli, deepspec.cache.pipeline, deepspec.training.cli
import deepspec.training, deepspec.calibration.cli, deepspec.evaluation.cli, deepspec.export, hydra
from deepspec.cli import main

print("ready", flush=True)
for line in sys.stdin:
    case = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.alarm(case["timeout"])
        os.chdir(case["cwd"])
        os.environ.update(case["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(os.path.join(case["cwd"], name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["deepspec", *case["argv"]]
        exec(case.get("setup", ""))
        try:
            code = main()  # reads sys.argv, as the console script does
        except SystemExit as e:
            code = e.code
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        if not isinstance(code, int):
            if code is not None:
                print(code, file=sys.stderr)
            code = 0 if code is None else 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def child_env() -> dict:
    """The test's environment without a debug request of its own (cases that want one pass it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSPEC_DEBUG", "HYDRA_FULL_ERROR")}
    return dict(env, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")


class Driver:
    def __init__(self, root: Path):
        self.root, self.count = root, 0
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=child_env(), cwd=root)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, argv: list[str], env: dict | None = None, setup: str = "", files=()) -> tuple[int, str, str]:
        """Run `deepspec *argv` in a fresh folder holding `files` (name -> text; a name ending in / is a
        non-empty folder); returns (exit code, stdout, stderr)."""
        self.count += 1
        cwd = self.root / f"case{self.count}"
        cwd.mkdir()
        for name, text in dict(files).items():
            path = cwd / name.rstrip("/") / ("kept.txt" if name.endswith("/") else "")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        case = {"argv": argv, "cwd": str(cwd), "env": env or {}, "setup": setup, "timeout": 240}
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return rc, (cwd / "stdout").read_text(), (cwd / "stderr").read_text()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = Driver(tmp_path_factory.mktemp("cli_errors"))
    yield d
    d.close()


PROMPTS = json.dumps({"id": "p0", "turns": ["Say hello."]}) + "\n"
TINY = "target=tiny-random-llama"
# (subcommand, case) -> (argv, files in the working folder, the message the one line carries)
CASES = {
    ("regenerate", "missing input"): (["regenerate", "--prompts", "missing.jsonl", "--out", "a.jsonl", "--target",
                                       "tiny-random-llama"], {}, "missing.jsonl: prompt file not found"),
    ("regenerate", "refused output"): (["regenerate", "--prompts", "p.jsonl", "--out", "p.jsonl", "--target",
                                        "tiny-random-llama"], {"p.jsonl": PROMPTS}, "never writes into its input"),
    ("cache", "missing input"): (["cache", "data.prompts=missing.jsonl", TINY, "cache.out_dir=c"], {},
                                 "missing.jsonl: prompt file not found"),
    ("cache", "refused output"): (["cache", "data.prompts=p.jsonl", TINY, "cache.out_dir=taken"],
                                  {"p.jsonl": PROMPTS, "taken": "a file"},
                                  "cache.out_dir='taken': exists and is not a folder"),
    ("train", "missing input"): (["train", "data.cache_dir=missing", TINY, "trainer.out_dir=t"], {},
                                 "data.cache_dir='missing': no finished cache there"),
    ("train", "refused output"): (["train", "data.cache_dir={cache}", TINY, "trainer.out_dir=taken"],
                                  {"taken": "a file"}, "trainer.out_dir='taken': exists and is not a folder"),
    ("calibrate", "missing input"): (["calibrate", "--drafter", "missing", "--cache", "missing"], {},
                                     "missing/config.json not found"),
    ("calibrate", "refused output"): (["calibrate", "--drafter", "missing", "--cache", "missing", "--out", "taken"],
                                      {"taken": "a file"}, "--out taken: exists and is not a folder"),
    ("evaluate", "missing input"): (["evaluate", "--drafter", "missing", "--benchmarks", "b.jsonl", "--target",
                                     "tiny-random-llama"], {}, "--drafter 'missing': missing is not a saved drafter"),
    ("evaluate", "refused output"): (["evaluate", "--drafter", "missing", "--benchmarks", "b.jsonl", "--out",
                                      "taken"], {"taken": "a file"}, "--out taken: exists and is not a folder"),
    ("export", "missing input"): (["export", "--checkpoint", "missing", "--format", "hf", "--out", "e"], {},
                                  "checkpoint directory missing does not exist"),
    ("export", "refused output"): (["export", "--checkpoint", "missing", "--format", "sglang", "--out", "full"],
                                   {"full/": "x"}, "full: folder is not empty; refusing to mix or overwrite"),
}


def assert_one_line_refusal(rc: int, err: str, command: str, message: str, code: int = 1) -> None:
    lines = [line for line in err.splitlines() if f"deepspec {command}: error:" in line]
    assert rc == code and "Traceback" not in err, (rc, err[-3000:])
    assert len(lines) == 1 and message in lines[0], err[-3000:]


@pytest.mark.parametrize("command,case", sorted(CASES), ids=[f"{c}-{k.replace(' ', '-')}" for c, k in sorted(CASES)])
def test_a_refusal_is_one_line_and_exit_1(driver, tiny_cache, command, case):
    argv, files, message = CASES[command, case]
    rc, _, err = driver.run([a.format(cache=tiny_cache) for a in argv], files=files)
    assert_one_line_refusal(rc, err, command, message)


BASE_MODEL_CASES = {  # (argv, files, message); {base}: a tiny base model folder, its tokenizer without a template
    "cache-no-chat-template": (["cache", TINY, "target.name={base}", "data.prompts=p.jsonl", "cache.out_dir=out"],
                               {"p.jsonl": PROMPTS}, "the tokenizer of '{base}' has no chat template (a base model?): "
                               "set data.format=text to use plain text, or give a chat template with "
                               "target.chat_template=<template text or file>"),
    "cache-every-sample-skipped": (["cache", TINY, "data.prompts=p.jsonl", "cache.out_dir=out"],
                                   {"p.jsonl": PROMPTS + json.dumps({"id": "p1", "turns": ["Hi."]}) + "\n"},
                                   "data.prompts='p.jsonl': all 2 records were skipped, nothing was written (2 "
                                   "no_assistant_tokens, the first 'p0' (p.jsonl:1): all-zero loss mask"),
    "regenerate-no-chat-template": (["regenerate", "--prompts", "p.jsonl", "--out", "out", "--target", "{base}"],
                                    {"p.jsonl": PROMPTS}, "has no chat template (a base model?): set --format text "
                                    "to use plain text, or give a chat template with --chat-template"),
    "regenerate-every-record-skipped": (["regenerate", "--prompts", "p.jsonl", "--out", "out", "--target",
                                         "tiny-random-llama"], {"p.jsonl": json.dumps({"id": "t0", "text": "Once"})},
                                        "--prompts p.jsonl: all 1 records were skipped, nothing was written (1 "
                                        "text_record, the first 't0' (p.jsonl:1): a plain-text record; the chat "
                                        "format answers user turns). Plain-text records need the text format: set "
                                        "--format text."),
}


@pytest.mark.parametrize("case", sorted(BASE_MODEL_CASES))
def test_every_sample_skipped_or_no_chat_template_is_one_line_and_leaves_nothing(driver, tiny_base_target_dir, case):
    """A base model in the chat format, or input whose every record is skipped: exit 1, one line naming the cause
    and the fix, and no output that a later stage could take for a finished one."""
    argv, files, message = BASE_MODEL_CASES[case]
    rc, _, err = driver.run([a.format(base=tiny_base_target_dir) for a in argv], files=files)
    assert_one_line_refusal(rc, err, argv[0], message.format(base=tiny_base_target_dir))
    cwd = driver.root / f"case{driver.count}"
    assert sorted(p.name for p in cwd.iterdir()) == sorted([*files, "stderr", "stdout"]), err[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["train", "drafter.bogus_key=3"], "bogus_key"),  # Hydra's own report (several lines, its format)
    (["cache", "cache.bogus_key=3"], "bogus_key"),
    (["export", "--checkpoint", "c", "--format", "bogus", "--out", "e"], "invalid choice: 'bogus'"),  # argparse
    (["regenerate", "--prompts", "p.jsonl"], "the following arguments are required: --out"),
], ids=["hydra-train", "hydra-cache", "export", "regenerate"])
def test_a_usage_error_exits_2_without_a_traceback(driver, argv, message):
    rc, _, err = driver.run(argv)
    assert rc == 2 and message in err and "Traceback" not in err, (rc, err[-3000:])


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_debug_shows_the_traceback_of_a_refusal(driver, how):
    argv = ["export", "--checkpoint", "missing", "--format", "hf", "--out", "e"]
    argv = {"flag-before": ["--debug", *argv], "flag-after": [*argv, "--debug"], "env": argv}[how]
    rc, _, err = driver.run(argv, env={"DEEPSPEC_DEBUG": "1"} if how == "env" else None)
    assert rc == 1 and "Traceback" in err and "FileNotFoundError: checkpoint directory missing" in err, err[-3000:]


def test_debug_shows_the_traceback_of_a_hydra_job(driver):
    rc, _, err = driver.run(["train", "data.cache_dir=missing", TINY, "trainer.out_dir=t", "--debug"])
    assert rc == 1 and "Traceback" in err and "no finished cache there" in err, err[-3000:]


@pytest.mark.parametrize("bug", [
    "raise KeyError('a bug')",
    "import json; json.loads('{')",  # a ValueError, but raised inside another library: not a refusal
])
def test_a_bug_keeps_its_traceback(driver, bug):
    setup = (f"import deepspec.export\ndef broken(*args, **kwargs):\n    {bug}\n"
             "deepspec.export.export_drafter = broken\n")
    rc, _, err = driver.run(["export", "--checkpoint", "c", "--format", "hf", "--out", "e"], setup=setup)
    assert rc == 1 and "Traceback" in err and "deepspec export: error" not in err, err[-3000:]


def test_a_bug_in_a_hydra_job_keeps_its_traceback(driver):
    setup = ("import deepspec.cache.pipeline as p\ndef broken(cfg):\n    raise KeyError('a bug')\n"
             "p.run_cache_job = broken\n")
    rc, _, err = driver.run(["cache", TINY], setup=setup)
    assert rc == 1 and "Traceback" in err and "KeyError: 'a bug'" in err, err[-3000:]


def test_a_fresh_console_script_prints_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deepspec.cli", "export", "--checkpoint", "missing", "--format",
                           "hf", "--out", "e"], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert_one_line_refusal(proc.returncode, proc.stderr, "export", "checkpoint directory missing does not exist")


# -- Hydra's run folder and --help, in the same processes -------------------------------------------------
def test_train_with_an_out_dir_writes_no_hydra_folder_into_the_cwd(driver):
    rc, _, err = driver.run(["train", "data.cache_dir=missing", TINY, "trainer.out_dir=run"])
    cwd = driver.root / f"case{driver.count}"
    assert rc == 1 and not (cwd / "outputs").exists(), (sorted(p.name for p in cwd.iterdir()), err[-2000:])
    assert (cwd / "run" / ".hydra" / "config.yaml").is_file()  # Hydra's record goes with the run
    rc, _, err = driver.run(["train", "data.cache_dir=missing", TINY])  # without it: Hydra's default run folder
    cwd = driver.root / f"case{driver.count}"
    assert rc == 1 and (cwd / "outputs" / "train" / "dspark-tiny-random-llama" / ".hydra").is_dir(), err[-2000:]


@pytest.mark.parametrize("command", ["cache", "train"])
def test_hydra_help_lists_choices_not_schemas(driver, command):
    rc, out, err = driver.run([command, "--help"])
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert rc == 0 and out.startswith(f"deepspec {command} is powered by Hydra."), (out[:500], err[-2000:])
    assert "target: gemma3, " in groups and "smollm2-135m" in groups and "base_" not in groups, groups
