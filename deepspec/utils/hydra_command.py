"""A Hydra entry point held to the command-line contract of deepspec.utils.errors, and its run folder.

- Hydra's report of a bad override or config (`drafter.bogus_key=3`, `trainer.max_steps=abc`, `drafter=nosuch`)
  is one line `<prog>: error: ...` naming Hydra's key and the fix, exit 2; `--debug` shows Hydra's exception
  with its cause and traceback instead, exit 2 too. Hydra raises these (HYDRA_FULL_ERROR is set while the
  command runs) and `run` words them.
- The run record (`.hydra/{config,hydra,overrides}.yaml`) is written by the job once it holds its run's lock
  (`write_run_record`), not by Hydra before the job starts (`hydra.output_subdir: null` in the config): a second
  writer refused by the lock changes nothing in the holder's folder.
- A run folder Hydra made for this command is removed again when the job fails before anything but a lock file
  was written there: a run refused during set-up leaves no folder behind.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deepspec.utils.errors import FAILURE_EXIT, USAGE_EXIT, debug_requested, one_line, reported_errors, take_debug_flag
from deepspec.utils.io import atomic_write_text, check_output_folder
from deepspec.utils.locks import remove_free_lock

RUN_RECORD_DIR = ".hydra"
_HYDRA_RAISES = "HYDRA_FULL_ERROR"  # Hydra raises its errors instead of printing them and exiting 1


class HydraCommand:
    """A Hydra entry point's error reporting and run folder: `job()` inside the task function (Hydra would print a
    traceback of anything raised there), `run(hydra_main)` around it (`--debug` taken out of sys.argv, Hydra's
    own errors worded in one line, see the module docstring).
    `run_dir_keys`: config keys Hydra's run folder is made from (train.yaml: trainer.out_dir); Hydra creates that
    folder before the job starts, so one given on the command line that exists as a file is refused here."""

    def __init__(self, prog: str, run_dir_keys: tuple[str, ...] = ()):
        self.prog, self.run_dir_keys, self.started = prog, run_dir_keys, False
        self.started_ns = time.time_ns()

    @contextmanager
    def job(self) -> Iterator[None]:
        from hydra.core.hydra_config import HydraConfig

        self.started = True
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        made_here = _made_since(run_dir, self.started_ns)
        try:
            with reported_errors(self.prog):
                yield
        except BaseException:
            if made_here:
                remove_unused_run_folder(run_dir)
            raise

    def run(self, hydra_main: Callable[[], object]) -> None:
        sys.argv = [sys.argv[0], *take_debug_flag(sys.argv[1:])]
        self.started_ns = time.time_ns()
        with reported_errors(self.prog):
            for arg in sys.argv[1:]:
                key, _, value = arg.lstrip("+").partition("=")
                if key in self.run_dir_keys and value not in ("", "null"):
                    check_output_folder(value, key)
        wants_help = any(arg in ("--help", "-h") for arg in sys.argv[1:])
        captured = io.StringIO()
        try:
            with (contextlib.redirect_stdout(captured) if wants_help else contextlib.nullcontext()), _hydra_raises():
                hydra_main()
        except SystemExit as e:
            if e.code == FAILURE_EXIT and not self.started:  # Hydra's own exits before the job: a usage error
                raise SystemExit(USAGE_EXIT) from None
            raise
        except Exception as error:
            reported = None if self.started else hydra_error(error, self.prog, sys.argv[1:])
            if reported is None:
                raise
            code, line = reported
            sys.stdout.flush()
            if debug_requested():  # Hydra's whole report: its exception, the cause and the traceback
                traceback.print_exc()
            else:
                print(f"{self.prog}: error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(code) from None
        finally:
            if wants_help:
                sys.stdout.write(without_schema_options(captured.getvalue()))

    @staticmethod
    def write_run_record(run_dir: str | os.PathLike, job_cfg) -> None:
        """Hydra's record of the running job (`job_cfg`: the task function's config, Hydra's config, the command
        line's overrides) into `run_dir/.hydra/`, as Hydra writes it; call it once the run holds its folder's lock."""
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}
        folder = Path(run_dir) / RUN_RECORD_DIR
        atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(job_cfg))
        atomic_write_text(folder / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
        atomic_write_text(folder / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


@contextmanager
def _hydra_raises() -> Iterator[None]:
    old = os.environ.get(_HYDRA_RAISES)
    os.environ[_HYDRA_RAISES] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_HYDRA_RAISES, None)
        else:
            os.environ[_HYDRA_RAISES] = old


def _made_since(folder: Path, since_ns: int) -> bool:
    """Whether `folder` is empty and was made after `since_ns` (by Hydra, for this command): a folder that existed
    keeps its older modification time when Hydra "makes" it again."""
    try:
        return not any(folder.iterdir()) and folder.stat().st_mtime_ns >= since_ns
    except OSError:
        return False


def remove_unused_run_folder(folder: Path) -> None:
    """Remove `folder` if it holds nothing but lock files no live process holds (a run that never started)."""
    try:
        entries = list(folder.iterdir())
        if any(not (p.name.startswith(".lock-") and p.is_file()) for p in entries):
            return
        if all(remove_free_lock(p) for p in entries):
            folder.rmdir()
    except OSError:  # another run started there meanwhile: its folder now
        pass


# -- Hydra's errors in one line --------------------------------------------------------------------------------
def hydra_error(error: BaseException, prog: str, argv: list[str]) -> tuple[int, str] | None:
    """(exit status, one line) for an error Hydra raised before the job started; None for a bug."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(error, OverrideParseException):
        return USAGE_EXIT, _parse_error_line(error)
    if isinstance(error, MissingConfigException):
        return USAGE_EXIT, missing_config_line(error, argv)
    if isinstance(error, HydraException) and isinstance(error.__cause__, OmegaConfBaseException):
        return USAGE_EXIT, _override_error_line(error, error.__cause__, prog, argv)
    if isinstance(error, (HydraException, OmegaConfBaseException, ValueError)):
        return USAGE_EXIT, " ".join(_lines(error))
    if isinstance(error, OSError):
        return FAILURE_EXIT, one_line(error)
    return None


def _lines(error: BaseException) -> list[str]:
    return [line.strip() for line in str(error).splitlines() if line.strip()]


def _override_of(key: str, argv: list[str], error: BaseException | None = None) -> str:
    """The command-line override that set `key` (as typed; the one Hydra's message quotes when several did), else
    the key alone."""
    candidates = [arg for arg in argv if arg.lstrip("+~").partition("=")[0] == key]
    quoted = [arg for arg in candidates if error is not None and arg.lstrip("+~") in str(error)]
    return (quoted or candidates or [key])[-1]


def _parse_error_line(error) -> str:
    reason = _lines(error)[1] if len(_lines(error)) > 1 else "not an override"
    reason = re.sub(r" expecting \{.*\}$", "", reason)  # the grammar's list of every token it could take
    return (f"{error.override}: not a valid override ({reason}); write key=value, with quotes around a value that "
            "holds '=', spaces or brackets (key='a=b')")


def missing_config_line(error, argv: list[str]) -> str:
    """A config group option that does not exist (`drafter=dsprk`): one line naming the choices."""
    missing = error.missing_cfg_file or ""
    group, _, name = missing.rpartition("/")
    if not group or error.options is None:
        return " ".join(_lines(error)[:1]) + " (a config file of that name is not in deepspec/conf)"
    options = [o for o in error.options if not o.startswith("base_")]  # the typed schemas are not choices
    override = _override_of(group, argv)
    where = f"{override}: " if override != group else f"{_lines(error)[0]}: "
    return f"{where}there is no {group} config {name!r}; choose one of {', '.join(options)}"


def _override_error_line(error, cause, prog: str, argv: list[str]) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = cause.full_key or ""
    override = _override_of(key, argv, error)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.key is not None:
        section = key.rpartition(".")[0]
        place = f"'{section}'" if section else "the config"
        if cause.object_type is dict or cause.object_type is None:  # a free-form mapping takes new keys with '+'
            return f"{override}: {place} has no key {cause.key!r}; to add one, write +{override.lstrip('+~')}"
        known = [str(k) for k in (cause.parent_node.keys() if cause.parent_node is not None else ()) if k != "hydra"]
        close = difflib.get_close_matches(str(cause.key), known, n=1)
        hint = f"did you mean {section + '.' if section else ''}{close[0]}? " if close else ""
        return (f"{override}: {place} ({cause.object_type.__name__}) has no setting {cause.key!r}; {hint}"
                f"`{prog} --cfg job` prints every setting")
    return f"{override}: {_lines(cause)[0]}"


def without_schema_options(help_text: str) -> str:
    """Hydra's `--help` with the typed schemas (`base_target`, `base_dspark`, ...: ConfigStore entries the YAML
    files extend) left out of its list of group options: they are not choices."""
    lines, in_groups = [], False
    for line in help_text.splitlines(keepends=True):
        if line.startswith("== "):
            in_groups = line.startswith("== Configuration groups ==")
        elif in_groups and ": " in line:
            group, options = line.rstrip("\n").split(": ", 1)
            line = f"{group}: " + ", ".join(o for o in options.split(", ") if not o.startswith("base_")) + "\n"
        lines.append(line)
    return "".join(lines)
