"""Calibrate a saved drafter with a confidence head (DSpark, standalone) end to end: collect -> STS -> files next to it.

`calibrate(...)` writes, into `out` (default: the drafter directory):
  * `calibration.json` - the `CalibrationResult` (temperatures, per-position ECE before/after,
    AUROC, Brier, reliability bins, sample counts, label kind, notes) and, under `heldout`, the same
    metrics on the held-out rollouts the temperatures were not fitted on (`fit_and_report`);
  * `reliability.png` - one reliability diagram per position (before/after);
and stores the temperatures in the drafter's own `config.json` (`calibration_temperatures`,
`calibration_label_kind`; with them prompt lookup's acceptance on the same validation split,
`prompt_lookup_acceptance`, which lets decoding choose per round between prompt lookup and the drafter),
written atomically, so decoding (`BlockDrafter.propose` divides the confidence logit by T_k) uses
them and a crash never leaves a half-written config. Nothing else of the saved drafter is rewritten:
its weights are read (their checksums verified first, `load_drafter`), never saved again, and where
a checksums.json (a training checkpoint's, an export's) covers the folder only the files written
here are recorded in it, in the same change as the files themselves (`recorded_writes`: a kill
leaves the old or the new files, both vouched for).

`calibrate_after_training(run_dir, drafter, cache, settings, target=...)` calibrates an in-memory drafter
right after training (the training run's `calibration:` section, `CalibrationSchema`: empirical labels from
rollouts with the target by default, analytic by config), results under `run_dir/calibration/`, the
temperatures set on the drafter and written into its saved directories. Training calls it at the end of a run
(`deepspec.training.hooks`); this package never imports training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from deepspec.calibration.collect import (
    CollectedConfidence,
    check_labels,
    collect_analytic,
    collect_empirical_from_cache,
    require_confidence_head,
    validation_indices,
)
from deepspec.calibration.config import CalibrationSchema
from deepspec.calibration.plots import save_reliability_diagrams
from deepspec.calibration.sts import CalibrationResult, evaluate_temperatures, sequential_temperature_scaling
from deepspec.decoding.lookup import LookupAcceptance
from deepspec.drafters.spec import capabilities_of
from deepspec.utils.checksums import recorded_writes
from deepspec.utils.io import atomic_write_json, read_json, reporting_disk_full

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
RELIABILITY_FILE = "reliability.png"
# What calibration writes into a saved drafter's config.json (store_temperatures); nothing else there changes.
CALIBRATION_CONFIG_FIELDS = ("calibration_temperatures", "calibration_label_kind", "prompt_lookup_acceptance")


def fit_collected(collected: CollectedConfidence, num_bins: int, min_samples: int) -> CalibrationResult:
    """STS on collected pairs; the result's notes say which labels were used and how many rows."""
    result = sequential_temperature_scaling(collected.confidence_logits_NK, collected.survival_NK, collected.valid_NK,
                                            num_bins=num_bins, min_samples=min_samples,
                                            label_kind=collected.label_kind)
    detail = ", ".join(f"{k}={v}" for k, v in collected.info.items())
    result.notes.insert(0, f"labels: {collected.labels} (STS label_kind={collected.label_kind}); {detail}")
    return result


def fit_and_report(collected: CollectedConfidence, settings: CalibrationSchema) -> CalibrationResult:
    """STS fitted on the rollouts (sequences) not held out (`settings.holdout`); ECE before/after also on the
    held-out ones (`result.heldout`): the honest measure, the fit half's ECE after is optimistic by construction."""
    holdout, num_bins = settings.holdout, settings.num_bins
    fit, report = collected.split(holdout, settings.seed)
    result = fit_collected(fit, num_bins=num_bins, min_samples=settings.min_samples)
    if report is not None:
        metrics = evaluate_temperatures(report.confidence_logits_NK, report.survival_NK, report.valid_NK,
                                        result.temperatures, num_bins)
        groups = {name: int(part.group_N.unique().numel()) if part.group_N is not None else None
                  for name, part in (("fit", fit), ("heldout", report))}
        result.heldout = {"holdout": holdout, "num_groups": groups,
                          "num_rows": {"fit": int(fit.valid_NK.shape[0]), "heldout": int(report.valid_NK.shape[0])},
                          "mean_ece_before": float(sum(metrics["ece_before"]) / len(metrics["ece_before"])),
                          "mean_ece_after": float(sum(metrics["ece_after"]) / len(metrics["ece_after"])), **metrics}
        result.notes.append(f"held out {groups['heldout']} of {groups['fit'] + groups['heldout']} "
                            f"rollouts/sequences: mean ECE {result.heldout['mean_ece_before']:.4f} -> "
                            f"{result.heldout['mean_ece_after']:.4f} on them")
    return result


def collect_labels(drafter, cache, target, settings: CalibrationSchema, *,
                   max_validation_samples: int | None = None, max_concurrency: int = 8) -> CollectedConfidence:
    """(confidence logit, prefix survival) pairs of `settings.labels` kind on the cache's validation split."""
    s = settings
    if check_labels(s.labels) == "analytic":
        return collect_analytic(drafter, cache, max_anchors_per_seq=s.max_anchors_per_seq,
                                max_samples=max_validation_samples, seed=s.seed)
    if target is None:
        raise ValueError("empirical calibration labels need the target (rollouts of the decoding loop); "
                         "pass it, or use labels='analytic'")
    return collect_empirical_from_cache(drafter, target, cache, max_prompts=s.max_prompts,
                                        max_new_tokens=s.max_new_tokens, max_concurrency=max_concurrency,
                                        seed=s.seed)


def write_result(result: CalibrationResult, out_dir: str | Path, title: str | None = None,
                 config_update: tuple[Path, dict] | None = None) -> dict[str, Path]:
    """calibration.json and reliability.png into `out_dir` and, with `config_update`
    (`calibrated_config`), the drafter's new config.json, as one change (`recorded_writes`): where a
    checksums.json covers a folder it vouches for the old or the new files at every instant, so a
    kill never leaves a checkpoint that reads as damaged."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"json": out_dir / CALIBRATION_FILE, "png": out_dir / RELIABILITY_FILE}
    config = [] if config_update is None else [config_update[0]]
    with recorded_writes([*report.values(), *config]) as temps:
        result.save(temps[report["json"]])
        save_reliability_diagrams(result, temps[report["png"]], title=title)
        if config_update is not None:
            atomic_write_json(temps[config_update[0]], config_update[1])
    return report


def calibrated_config(drafter, drafter_dir: str | Path, result: CalibrationResult,
                      labels: str) -> tuple[Path, dict]:
    """Set the temperatures on `drafter.config`; (`drafter_dir`'s config.json, its new content: the
    saved one with the temperatures and, where it is set, prompt lookup's acceptance). Only these
    fields change: the weights and every other setting stay as they were saved (and verified when
    the drafter was loaded)."""
    drafter_dir = Path(drafter_dir)
    num_positions = capabilities_of(drafter).num_positions
    if len(result.temperatures) != num_positions:
        raise ValueError(f"{len(result.temperatures)} temperatures for a drafter with {num_positions} draft positions")
    drafter.config.calibration_temperatures = [float(t) for t in result.temperatures]
    drafter.config.calibration_label_kind = labels
    config_file = drafter_dir / "config.json"
    saved = read_json(config_file)
    if not isinstance(saved, dict):
        raise ValueError(f"{config_file}: not a drafter config (a JSON object)")
    fields = {name: getattr(drafter.config, name, None) for name in CALIBRATION_CONFIG_FIELDS}
    return config_file, {**saved, **fields}


def store_temperatures(drafter, drafter_dir: str | Path, result: CalibrationResult,
                       labels: str) -> Path:
    """Write the temperatures into `drafter_dir`'s config.json (`calibrated_config`), atomically;
    where a checksums.json covers the folder, the new config.json is recorded in it in the same
    change (`recorded_writes`). Returns the config file."""
    config_file, updated = calibrated_config(drafter, drafter_dir, result, labels)
    with reporting_disk_full(drafter_dir, survives="its config.json is unchanged (the temperatures were not stored)"):
        with recorded_writes([config_file]) as temps:
            atomic_write_json(temps[config_file], updated)
    return config_file


def fit_prompt_lookup(drafter, cache, max_samples: int | None = None) -> LookupAcceptance:
    """Prompt lookup's acceptance at T = 0 on the cache's validation split (`LookupAcceptance.fit`, teacher-forced:
    the target's argmax after each position where the cache stores the target's outputs, else the data's next
    token), for as many drafts per round as the drafter proposes. Stored next to the temperatures, it lets
    decoding choose per round between prompt lookup and the drafter (deepspec/decoding/combined.py)."""
    head_VH = drafter.target_parts.lm_head_weight.detach()

    def sequences():
        for i in validation_indices(cache, max_samples):
            ids_T, mask_T = cache.tokens(i)
            next_T = cache.target_next_tokens(i, head_VH)
            if next_T is None:
                next_T = torch.cat([ids_T[1:], ids_T.new_zeros(1)])
            anchor_T = torch.zeros_like(mask_T)
            anchor_T[:-1] = mask_T[:-1] & mask_T[1:]
            yield ids_T, next_T, anchor_T

    table = LookupAcceptance.fit(sequences(), capabilities_of(drafter).num_positions)
    log.info("prompt lookup on the validation split: first-draft acceptance %s after a match of 1..%d tokens "
             "(%s lookups)", [round(table.conditional(n, 1)[0], 3) for n in range(1, table.max_ngram + 1)],
             table.max_ngram, [row[0] for row in table.reached])
    return table


def _load_target(target, device: str | None):
    if isinstance(target, str):
        from deepspec.targets.load import load_target

        return load_target(target, dtype="float32", device=device)
    if not hasattr(target, "model") or not hasattr(target, "tokenizer"):
        raise ValueError(f"target must be a target name/path or a LoadedTarget, got {type(target).__name__}")
    return target


def open_cache_for_target(cache_dir: str | Path, target):
    from deepspec.cache import CacheReader

    fingerprint = target.fingerprint()
    # Compare what changes the features, not the name the target was loaded under.
    expected = {k: fingerprint[k] for k in ("config_hash", "tokenizer_hash") if k in fingerprint}
    return CacheReader(cache_dir, expected_fingerprint=expected)


def check_same_rendering(drafter, cache, drafter_dir, cache_dir) -> None:
    """The cache's prompts are rendered as the drafter's training data were (format, chat template, options): its
    rollouts stop where that rendering says, and a drafter is calibrated on the data it drafts for."""
    from deepspec.data.rendering import Rendering

    theirs, ours = Rendering.from_record(drafter.config), Rendering.from_record(cache.meta)
    if theirs.record() != ours.record():
        raise ValueError(f"the cache {cache_dir} was rendered {ours.describe()}, but the drafter {drafter_dir} was "
                         f"trained on data rendered {theirs.describe()}: calibrate on a cache of its own rendering")


def calibrate(drafter_dir: str | Path, cache_dir: str | Path, target, settings: CalibrationSchema | None = None,
              *, out: str | Path | None = None, max_validation_samples: int | None = None,
              max_concurrency: int = 8, device: str | None = None, write_config: bool = True) -> CalibrationResult:
    """Calibrate the drafter saved in `drafter_dir` on the validation split of the cache at `cache_dir`.

    `target`: a `LoadedTarget` or a target name/path (loaded in float32). `settings` (default: the
    `CalibrationSchema` defaults; `enabled` is training's switch and not read here): `labels` "empirical" (T=1
    rollouts of the decoding loop on up to `max_prompts` validation prompts, `max_new_tokens` each) or
    "analytic" (cumulative ``1 - TV/2`` from the cache); a `holdout` share of the rollouts is not fitted on
    and reports ECE before/after (`result.heldout`). Files go to `out` (default `drafter_dir`); with
    `write_config` the temperatures are stored in the drafter's config.json.
    """
    settings = settings or CalibrationSchema()
    labels = check_labels(settings.labels)
    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file():
        raise FileNotFoundError(f"{drafter_dir / 'config.json'} not found: not a saved drafter directory")
    if not Path(cache_dir).is_dir():
        raise FileNotFoundError(f"cache directory {cache_dir} not found")
    target = _load_target(target, device)
    from deepspec.drafters.build import load_drafter

    drafter = load_drafter(drafter_dir, target).eval()
    require_confidence_head(drafter)
    cache = open_cache_for_target(cache_dir, target)
    check_same_rendering(drafter, cache, drafter_dir, cache_dir)
    collected = collect_labels(drafter, cache, target, settings, max_validation_samples=max_validation_samples,
                               max_concurrency=max_concurrency)
    result = fit_and_report(collected, settings)
    drafter.config.prompt_lookup_acceptance = fit_prompt_lookup(drafter, cache, max_validation_samples).to_dict()
    config_update = (calibrated_config(drafter, drafter_dir, result, labels) if write_config
                     else None)
    with reporting_disk_full(survives="the drafter's config.json and the calibration report are as "
                             "they were"):
        write_result(result, out or drafter_dir, title=f"{drafter_dir.name}: STS ({labels} labels)",
                     config_update=config_update)
    _log_result(f"calibrated {drafter_dir}", result)
    return result


def _log_result(what: str, result: CalibrationResult) -> None:
    heldout = (f"; held out: {result.heldout['mean_ece_before']:.4f} -> {result.heldout['mean_ece_after']:.4f}"
               if result.heldout else "")
    log.info("%s: mean ECE %.4f -> %.4f (fit)%s, temperatures %s", what, result.mean_ece_before,
             result.mean_ece_after, heldout, [round(t, 4) for t in result.temperatures])


def calibrate_after_training(run_dir: str | Path, drafter, cache, settings: CalibrationSchema | None = None,
                             drafter_dirs: Sequence[str | Path] | None = None, target=None
                             ) -> CalibrationResult | None:
    """Calibrate `drafter` (in memory) on `cache`'s validation split at the end of training.

    `settings`: the run's `calibration:` section (`CalibrationSchema`); empirical labels roll out with
    `target` (the training run's LoadedTarget). Drafters without a confidence head are skipped (returns
    None). The temperatures are stored in every directory of `drafter_dirs` (default: `run_dir` and
    `run_dir/final` where they hold a saved drafter of this kind).
    """
    settings = settings or CalibrationSchema()
    if not settings.enabled:
        log.info("calibration after training disabled by config")
        return None
    if not capabilities_of(drafter).confidence_head:
        log.info("no confidence head on drafter kind %r: nothing to calibrate", drafter.config.drafter_kind)
        return None
    run_dir = Path(run_dir)
    collected = collect_labels(drafter, cache, target, settings)
    result = fit_and_report(collected, settings)
    write_result(result, run_dir / "calibration", title=f"{run_dir.name}: STS ({settings.labels} labels)")
    drafter.config.calibration_temperatures = [float(t) for t in result.temperatures]
    drafter.config.calibration_label_kind = settings.labels
    drafter.config.prompt_lookup_acceptance = fit_prompt_lookup(drafter, cache).to_dict()
    if drafter_dirs is None:
        model_type = drafter.config.model_type
        drafter_dirs = [d for d in (run_dir, run_dir / "final") if (d / "config.json").is_file()
                        and f'"{model_type}"' in (d / "config.json").read_text()]
    for directory in drafter_dirs:
        store_temperatures(drafter, directory, result, settings.labels)
    _log_result("calibration after training", result)
    return result
