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
import shutil
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
    (["regenerate", "--prompts", "p.jsonl", "--limit", "0", "--out", "a.jsonl"],  # not "no usable conversation"
     "deepspec regenerate: error: --limit 0 reads no conversation: give a positive number, or leave it out"),
    (["cache", "data.limit=0", TINY], "deepspec cache: error: invalid cache job config: data.limit=0 reads no "
                                      "conversation: set a positive number of conversations to read, or null"),
    (["plan", "drafter=dsprk"], "deepspec plan: error: invalid training config: drafter=dsprk: there is no drafter "
                                "config 'dsprk'; choose one of dflash, dspark, eagle3, mtp, standalone"),
    (["train", "drafter=dspark", "drafter.block_size=1", TINY, "data.cache_dir=missing", "trainer.out_dir=t"],
     "deepspec train: error: drafter.block_size=1 must lie in [4, 16]"),  # a setting no drafter can have
], ids=["hydra-train", "hydra-cache", "export", "regenerate", "regenerate-limit-0", "cache-limit-0", "plan-typo",
        "train-block-size"])
def test_a_usage_error_exits_2_without_a_traceback(driver, argv, message):
    rc, _, err = driver.run(argv)
    assert rc == 2 and message in err and "Traceback" not in err, (rc, err[-3000:])
    assert "search path" not in err, err[-3000:]  # Hydra's internals are not the user's


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


# -- Hydra: its errors in one line, its run folder, --help ------------------------------------------------------
HYDRA_ERRORS = {  # argv -> the one line's message (Hydra's key, what is wrong, the fix)
    ("train", "drafter.bogus_key=3"): "drafter.bogus_key=3: 'drafter' (DSparkParams) has no setting 'bogus_key'; "
                                      "`deepspec train --cfg job` prints every setting",
    ("train", "trainer.max_steps=abc"): "trainer.max_steps=abc: Value 'abc' of type 'str' could not be converted to "
                                        "Integer",
    ("train", "trainer.max_steps=="): "trainer.max_steps==: not a valid override (extraneous input '='); write "
                                      "key=value, with quotes around a value that holds '=', spaces or brackets",
    ("train", "drafter=nosuchdrafter"): "drafter=nosuchdrafter: there is no drafter config 'nosuchdrafter'; choose one "
                                        "of dflash, dspark, eagle3, mtp, standalone",
    ("cache", "target=no-such-target"): "target=no-such-target: there is no target config 'no-such-target'; choose "
                                        "one of gemma3, llama3.1-8b, ",
    ("cache", "cache.bogus=1"): "cache.bogus=1: 'cache' (CacheSchema) has no setting 'bogus'; `deepspec cache --cfg "
                                "job` prints every setting",
    ("train", "trainer.max_step=3"): "'trainer' (TrainerSchema) has no setting 'max_step'; did you mean "
                                     "trainer.max_steps?",
    ("train", "deepspeed.extra.bucket=3"): "deepspeed.extra.bucket=3: 'deepspeed.extra' has no key 'bucket'; to add "
                                           "one, write +deepspeed.extra.bucket=3",
}


@pytest.mark.parametrize("command,override", sorted(HYDRA_ERRORS), ids=[o for _, o in sorted(HYDRA_ERRORS)])
def test_a_bad_override_is_one_line_naming_the_key_and_the_fix(driver, command, override):
    rc, _, err = driver.run([command, override])
    assert_one_line_refusal(rc, err, command, HYDRA_ERRORS[command, override], code=2)
    assert err.strip().count("\n") == 0 and "HYDRA_FULL_ERROR" not in err, err


def test_debug_shows_hydras_whole_report_of_a_bad_override(driver):
    rc, _, err = driver.run(["train", "drafter.bogus_key=3", "--debug"])
    assert rc == 2 and "Traceback" in err and "deepspec train: error" not in err, err[-3000:]
    assert "Key 'bogus_key' not in 'DSparkParams'" in err and "full_key: drafter.bogus_key" in err, err[-3000:]


TINY_RUN = [TINY, "data.cache_dir={cache}", "drafter.num_draft_layers=1", "drafter.block_size=4",
            "drafter.markov_rank=8", "data.max_anchors_per_seq=8", "data.max_tokens_per_row=64",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.progress_bar=false",
            "calibration.enabled=false"]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_second_writer_changes_nothing_in_the_holders_folder(driver, tiny_cache, tmp_path):
    from deepspec.utils.locks import exclusive_lock

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"the holder's {name}\n")
    argv = ["train", *(a.format(cache=tiny_cache) for a in TINY_RUN), f"trainer.out_dir={run_dir}"]
    with exclusive_lock(run_dir / ".lock-train-r0", "the holder's run"):
        before = folder_bytes(run_dir)
        rc, _, err = driver.run([*argv, "trainer.max_steps=500", "optim.lr=1e-3"])
        assert_one_line_refusal(rc, err, "train", "is being written by another run")
        assert folder_bytes(run_dir) == before
    rc, _, err = driver.run([*argv, "trainer.max_steps=1", "optim.lr=1e-3"])  # the lock free: it records itself
    assert rc == 0, err[-3000:]
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "- trainer.max_steps=1\n- optim.lr=1e-3\n" in overrides, overrides
    assert "max_steps: 1\n" in (run_dir / ".hydra" / "config.yaml").read_text()


@pytest.mark.parametrize("refusal,message", [
    ("data.cache_dir=missing", "no finished cache there"),  # refused before the run's lock is taken
    ("trainer.global_batch_size=64", "16 'train' samples, fewer than trainer.global_batch_size=64"),  # after it
], ids=["before-the-lock", "after-the-lock"])
def test_a_run_refused_during_set_up_leaves_no_new_folder(driver, tiny_cache, refusal, message):
    argv = ["train", *(a.format(cache=tiny_cache) for a in TINY_RUN), refusal]
    rc, _, err = driver.run([*argv, "trainer.out_dir=run"])
    cwd = driver.root / f"case{driver.count}"
    assert_one_line_refusal(rc, err, "train", message)
    assert sorted(p.name for p in cwd.iterdir()) == ["stderr", "stdout"]
    rc, _, err = driver.run(argv)  # Hydra's default run folder
    assert_one_line_refusal(rc, err, "train", message)
    assert not (driver.root / f"case{driver.count}" / "outputs" / "train" / "dspark-tiny-random-llama").exists()
    rc, _, err = driver.run([*argv, "trainer.out_dir=mine"], setup="os.mkdir('mine')")  # the user's empty folder
    assert_one_line_refusal(rc, err, "train", message)
    assert sorted(p.name for p in (driver.root / f"case{driver.count}").iterdir()) == ["mine", "stderr", "stdout"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 15 MB disk (a tmpfs: root only) that a tiny run fills at its second checkpoint (~10 MB each)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=15m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_disk_at_a_checkpoint_is_one_line_and_the_rerun_resumes(driver, tiny_cache, small_disk):
    from deepspec.training.checkpoint import checkpoint_problems

    run_dir = small_disk / "run"
    argv = ["train", *(a.format(cache=tiny_cache) for a in TINY_RUN), f"trainer.out_dir={run_dir}",
            "trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_last=2"]
    rc, _, err = driver.run(argv)
    assert_one_line_refusal(rc, err, "train", f"{run_dir / 'checkpoints' / 'step-00000004'}: no space left on device "
                                              "(it needs about ")
    assert ("the partial step-00000004.tmp was removed; the last complete checkpoint is step-00000002, unchanged "
            "(rerunning the same command resumes from it)") in err, err[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002"]
    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    rc, out, err = driver.run(argv)
    assert rc == 0 and f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} (step 2" in out, err[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert checkpoint_problems(run_dir / "checkpoints" / "step-00000004") == []


@pytest.mark.parametrize("command", ["cache", "train"])
def test_hydra_help_lists_choices_not_schemas(driver, command):
    rc, out, err = driver.run([command, "--help"])
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert rc == 0 and out.startswith(f"deepspec {command} is powered by Hydra."), (out[:500], err[-2000:])
    assert "target: gemma3, " in groups and "smollm2-135m" in groups and "base_" not in groups, groups


# -- a damaged training checkpoint: every command that reads it refuses it, naming the file ---------------------
@pytest.fixture(scope="module")
def damaged_run(driver, tiny_cache, tmp_path_factory) -> Path:
    """A real 1-step training run whose checkpoint's drafter weights have one bit flipped (a weight doubled or
    halved: the exponent's lowest bit), as a bad disk or a copy gone wrong leaves it; checksums.json as written."""
    run_dir = tmp_path_factory.mktemp("damaged") / "run"
    rc, _, err = driver.run(["train", *(a.format(cache=tiny_cache) for a in TINY_RUN), f"trainer.out_dir={run_dir}",
                             "trainer.max_steps=1"])
    assert rc == 0, err[-3000:]
    weights = run_dir / "checkpoints" / "step-00000001" / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    first_value = 8 + int.from_bytes(data[:8], "little")  # after the safetensors header: float32, little-endian
    data[first_value + 2] ^= 0x80  # bit 23 of the first value: the lowest exponent bit
    weights.write_bytes(bytes(data))
    return run_dir


DAMAGED_CASES = {  # command -> argv ({ckpt}: the damaged step folder, {cache}: a cache of the same target)
    "calibrate": ["calibrate", "--drafter", "{ckpt}/drafter", "--cache", "{cache}", "--labels", "analytic",
                  "--min-samples", "5"],
    "evaluate": ["evaluate", "--target", "tiny-random-llama", "--drafter", "{ckpt}/drafter", "--benchmarks",
                 "b.jsonl", "--num-prompts", "1", "--max-new-tokens", "4", "--out", "eval"],
    "bench speed": ["bench", "speed", "--target", "tiny-random-llama", "--drafter", "{ckpt}/drafter", "--benchmark",
                    "b.jsonl", "--num-prompts", "1", "--max-new-tokens", "4", "--out", "speed.json"],
    "bench calibration": ["bench", "calibration", "--drafter", "{ckpt}/drafter", "--cache", "{cache}", "--labels",
                          "analytic", "--min-samples", "5", "--out", "calibration.json"],
    "bench scheduler": ["bench", "scheduler", "--tiny", "--drafter", "{ckpt}/drafter", "--concurrency", "1",
                        "--requests-per-slot", "1", "--max-new-tokens", "4", "--profile-repeats", "1",
                        "--out", "scheduler.json"],
    "export": ["export", "--checkpoint", "{ckpt}", "--format", "hf", "--out", "exported"],
}


@pytest.mark.parametrize("command", sorted(DAMAGED_CASES))
def test_a_damaged_checkpoint_is_refused_by_every_command_that_reads_it(driver, damaged_run, tiny_cache, tmp_path,
                                                                        command):
    run_dir = tmp_path / "run"
    shutil.copytree(damaged_run, run_dir)
    checkpoint = run_dir / "checkpoints" / "step-00000001"
    before = folder_bytes(checkpoint)
    argv = [a.format(ckpt=checkpoint, cache=tiny_cache) for a in DAMAGED_CASES[command]]
    rc, _, err = driver.run(argv, files={"b.jsonl": PROMPTS})
    weights = (checkpoint / "drafter" / "model.safetensors").resolve()
    assert_one_line_refusal(rc, err, command, f"the checkpoint is damaged ({weights}: sha256 differs from the "
                                              "recorded one (damaged); recorded in ")
    assert folder_bytes(checkpoint) == before  # nothing rewritten, no checksum re-recorded


def test_a_resume_refuses_a_damaged_only_checkpoint_naming_the_file(driver, damaged_run, tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(damaged_run, run_dir)
    before = folder_bytes(run_dir / "checkpoints")
    rc, _, err = driver.run(["train", *(a.format(cache=tiny_cache) for a in TINY_RUN), f"trainer.out_dir={run_dir}",
                             "trainer.max_steps=2"])
    weights = run_dir / "checkpoints" / "step-00000001" / "drafter" / "model.safetensors"
    assert_one_line_refusal(rc, err, "train", "no valid checkpoint to resume from (damaged: step-00000001; "
                                              f"step-00000001: {weights}: sha256 differs from the recorded one")
    assert folder_bytes(run_dir / "checkpoints") == before
