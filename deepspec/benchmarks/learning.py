"""Learning curves: how fast each drafter kind learns on one feature cache, against drafter-free floors.

A run is a drafter kind trained with one of the training presets, the experiments of deepspec/conf/experiment
(`KIND` = `KIND:cpu`, the quickstart's; `KIND:EXPERIMENT`, e.g. `dspark:paper`). Every run is trained by the
real trainer (`deepspec.training.run`, the same code as `deepspec train`) at an
equal budget: the same cache, optimizer steps, sequences per step and anchors per sequence. It validates every
`eval_every` steps; each validation record of its `metrics.jsonl` holds the slot-wise top-1 agreement, the
simulated tau (T=1 from TV, T=0 from top-1 agreement), the decoded tau of the real loop on held-out prompts
(`trainer.decode_eval_prompts`, both temperatures) and the training cost so far (`tokens_seen`: context tokens;
`train_cpu_s`: CPU seconds of the training steps, validation excluded).

Floors on the same data: the bigram table and prompt lookup (deepspec.benchmarks.floors), simulated on the
validation blocks the block drafters are validated on and decoded with their proposers
(deepspec.decoding.lookup) on the same prompts.

After training, each block drafter's final checkpoint is probed with the input ablations of
deepspec.benchmarks.ablation on the validation blocks (slot-0 agreement with a random anchor, a shifted and a
swapped context): a drafter whose slot 0 does not move when its anchor does has not learned to draft.

The result is one JSON-able dict (`run_learning_benchmark`) and a PNG of the curves (`plot_learning_curves`):
tau and slot-0 agreement against training tokens and against CPU seconds, floors as horizontal lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List

import torch

from deepspec.benchmarks.floors import cache_bigram_table, floor_validation
from deepspec.decoding.lookup import BigramProposer, PromptLookupProposer
from deepspec.decoding.loop import decoded_tau
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.utils.errors import command_line

log = logging.getLogger(__name__)

CURVE_KEYS = ("top1_agreement", "expected_acceptance", "tau_sim", "tau_greedy_sim", "tokens_seen", "train_cpu_s",
              "loss_ce", "loss_tv")


@dataclass
class LearningSettings:
    cache_dir: str
    out_dir: str
    kinds: List[str] = field(default_factory=lambda: ["dspark", "dflash", "eagle3"])
    steps: int = 200
    eval_every: int = 50
    batch: int = 4  # sequences per optimizer step
    anchors_per_seq: int = 16  # block drafters: training anchors per sequence
    val_anchors_per_seq: int | None = None  # block drafters: validation anchors per sequence (None: anchors_per_seq)
    decode_prompts: int = 4
    decode_max_new_tokens: int = 64
    temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])
    seed: int = 0
    overrides: List[str] = field(default_factory=list)  # extra `deepspec train` overrides for every kind

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "batch", "anchors_per_seq", "decode_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.val_anchors_per_seq is not None and self.val_anchors_per_seq < 1:
            raise ValueError(f"val_anchors_per_seq={self.val_anchors_per_seq} must be >= 1")
        if self.decode_prompts < 0:
            raise ValueError(f"decode_prompts={self.decode_prompts} must be >= 0")

    @property
    def validation_anchors(self) -> int:
        return self.anchors_per_seq if self.val_anchors_per_seq is None else self.val_anchors_per_seq


DEFAULT_EXPERIMENT = "cpu"


def parse_run(run: str) -> tuple[str, str]:
    """`KIND` or `KIND:EXPERIMENT` -> (kind, experiment)."""
    from deepspec.utils.config import config_options

    kind, _, experiment = run.partition(":")
    experiment = experiment or DEFAULT_EXPERIMENT
    experiments = config_options("experiment")
    if experiment not in experiments:
        raise ValueError(f"run {run!r}: unknown experiment {experiment!r}; expected one of {experiments}")
    return kind, experiment


def train_overrides(settings: LearningSettings, run: str, target: str, run_dir: Path) -> list[str]:
    """`deepspec train` overrides of one run: its experiment and a benchmark's run (debug=benchmark, applied over
    the experiment), then the equal budget and the learning curve's schedule, then the user's."""
    s = settings
    kind, experiment = parse_run(run)
    return [f"experiment={experiment}", "debug=benchmark", f"target={target}", f"drafter={kind}",
            f"data.cache_dir={s.cache_dir}", f"data.max_anchors_per_seq={s.anchors_per_seq}",
            f"data.val_anchors_per_seq={s.validation_anchors}", f"trainer.max_steps={s.steps}",
            f"trainer.global_batch_size={s.batch}", f"trainer.micro_batch_size={s.batch}",
            f"trainer.val_every={s.eval_every}", "trainer.val_at_start=true", f"trainer.save_every={s.steps}",
            "trainer.keep_last=1", f"trainer.log_every={max(s.eval_every // 5, 1)}", f"trainer.seed={s.seed}",
            f"trainer.decode_eval_prompts={s.decode_prompts}",
            f"trainer.decode_eval_max_new_tokens={s.decode_max_new_tokens}",
            f"trainer.decode_eval_temperatures=[{','.join(str(float(t)) for t in s.temperatures)}]",
            f"trainer.out_dir={run_dir}", *s.overrides]


def floors(settings: LearningSettings, target, reader, prompts: list[list[int]], eos_token_ids) -> dict:
    """Simulated and decoded floors on the validation split (module docstring)."""
    from deepspec.drafters.block.batching import BlockBatchBuilder
    from deepspec.drafters.block.config import choose_mask_token_id
    from deepspec.drafters.spec import ANCHOR_PREDICTS

    head_VH = target.model.get_output_embeddings().weight.detach()
    cpu0 = time.process_time()
    table_V = cache_bigram_table((reader[i] for i in reader.split("train")), head_VH)
    table_cpu_s = time.process_time() - cpu0
    # The block drafters' validation blocks: block 7, the same anchors per sequence and seed; seven drafts per
    # block (anchor-predicts: draft k predicts x[a + k + 1], the same rows in either convention).
    builder = BlockBatchBuilder(7, choose_mask_token_id(target.tokenizer, head_VH.shape[0]),
                                settings.validation_anchors, settings.seed, block_convention=ANCHOR_PREDICTS)
    simulated = floor_validation([reader[i] for i in reader.split("validation")], builder.collate, table_V, head_VH)
    verifier = TargetVerifier(target.model, [])
    proposers = {"bigram": lambda: BigramProposer(table_V, 7), "prompt_lookup": lambda: PromptLookupProposer(7)}
    out = {}
    for name, make in proposers.items():
        decoded = {}
        for temperature in settings.temperatures:
            result = decoded_tau(verifier, make(), prompts, settings.decode_max_new_tokens,
                                 SamplingParams(temperature=float(temperature)), eos_token_ids=eos_token_ids,
                                 seed=settings.seed)
            decoded[f"T{float(temperature):g}"] = result["tau"]
        out[name] = {"validation": simulated.get(name), "decoded_tau": decoded}
    out["bigram"]["table_cpu_s"] = round(table_cpu_s, 2)
    out["bigram"]["known_tokens"] = int((table_V >= 0).sum())
    return out


def final_ablation(settings: LearningSettings, checkpoint: Path, target, reader) -> dict | None:
    """Input ablations (deepspec.benchmarks.ablation) of a block drafter's final checkpoint on the validation
    blocks (the validation anchors); None for chain drafters."""
    from deepspec.benchmarks.ablation import ablation_agreement
    from deepspec.drafters.block.batching import BlockBatchBuilder
    from deepspec.drafters.build import load_drafter
    from deepspec.drafters.spec import capabilities_of

    drafter = load_drafter(checkpoint / "drafter", target)
    if capabilities_of(drafter).block_convention is None:
        return None
    builder = BlockBatchBuilder.for_drafter(drafter.config, settings.validation_anchors, settings.seed)
    samples = [reader[i] for i in reader.split("validation")]
    batches = (builder.collate(samples[i:i + 4]) for i in range(0, len(samples) - 1, 4))
    return ablation_agreement(drafter, batches, seed=settings.seed)


def drafter_against_floors(cache_dir: str | Path, run_dir: str | Path, checkpoint: str | Path,
                           anchors_per_seq: int, seed: int = 0) -> dict:
    """A trained block drafter's last validation slot-0 agreement next to the bigram floor (table from the cache's
    train split, scored on the same validation blocks: `anchors_per_seq` is the run's validation anchors) and prompt
    lookup, the ratio to the bigram, and its input ablations: what the quickstart prints after training."""
    from deepspec.cache.pipeline import load_cache_target
    from deepspec.cache.reader import CacheReader
    from deepspec.drafters.block.batching import BlockBatchBuilder
    from deepspec.drafters.block.config import choose_mask_token_id
    from deepspec.drafters.spec import ANCHOR_PREDICTS
    from deepspec.training.log import read_metrics

    reader = CacheReader(cache_dir)
    target = load_cache_target({"name": reader.meta.target})
    head_VH = target.model.get_output_embeddings().weight.detach()
    table_V = cache_bigram_table((reader[i] for i in reader.split("train")), head_VH)
    builder = BlockBatchBuilder(7, choose_mask_token_id(target.tokenizer, head_VH.shape[0]), anchors_per_seq, seed,
                                block_convention=ANCHOR_PREDICTS)
    simulated = floor_validation([reader[i] for i in reader.split("validation")], builder.collate, table_V, head_VH)
    records = read_metrics(run_dir, "validation")
    if not records or "bigram" not in simulated:
        raise ValueError(f"{run_dir}: no validation record in metrics.jsonl or no validation block in {cache_dir} "
                         "(a validation split too small)")
    slot0 = float(records[-1]["top1_agreement"][0])
    bigram = float(simulated["bigram"]["top1_agreement"][0])
    settings = LearningSettings(cache_dir=str(cache_dir), out_dir="", anchors_per_seq=anchors_per_seq, seed=seed)
    return {"drafter_slot0": slot0, "bigram_slot0": bigram, "prompt_lookup_slot0":
            float(simulated["prompt_lookup"]["top1_agreement"][0]), "ratio_to_bigram": slot0 / max(bigram, 1e-9),
            "ablation": final_ablation(settings, Path(checkpoint), target, reader)}


FLOOR_SETTINGS = ("cache_dir", "anchors_per_seq", "val_anchors_per_seq", "seed", "decode_prompts",
                  "decode_max_new_tokens", "temperatures")


def reusable_floors(previous: Path, settings: dict) -> dict | None:
    """The floors of an earlier benchmark in the same folder when they were measured with the same cache and
    floor settings (the bigram table over a large train split costs minutes), else None."""
    import json

    if not previous.is_file():
        return None
    try:
        old = json.loads(previous.read_text())
    except ValueError:
        return None
    same = all(old.get("settings", {}).get(k) == settings.get(k) for k in FLOOR_SETTINGS)
    if same and old.get("floors"):
        log.info("floors reused from %s (same cache and floor settings)", previous)
        return old["floors"]
    return None


def curve(run_dir: Path) -> list[dict]:
    """The validation records of one run: step, cost and metrics (NaN/None-free lists)."""
    from deepspec.training.log import read_metrics

    points = []
    for record in read_metrics(run_dir, "validation"):
        point = {"step": record["step"]}
        point.update({k: record[k] for k in CURVE_KEYS if k in record})
        point.update({k: v for k, v in record.items() if k.startswith(("tau_decoded_", "tau_gap_"))})
        points.append(point)
    return points


def run_learning_benchmark(settings: LearningSettings) -> dict:
    """Floors, then every kind trained at the same budget; writes `<out_dir>/learning.json` + `learning.png`."""
    from deepspec.cache.pipeline import load_cache_target
    from deepspec.cache.reader import CacheReader
    from deepspec.data.chat import end_of_turn_token_ids
    from deepspec.training import run
    from deepspec.training.config import compose_train_config
    from deepspec.training.validation import heldout_prompts
    from deepspec.utils.io import atomic_write_text

    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = CacheReader(settings.cache_dir)
    target = load_cache_target({"name": reader.meta.target})
    eos = tuple(sorted(end_of_turn_token_ids(target.tokenizer)))
    prompts = heldout_prompts(reader, reader.split("validation"), settings.decode_prompts, 512)
    result = {"settings": {**asdict(settings), "target": reader.meta.target, "torch_threads": torch.get_num_threads(),
                           "num_train": len(reader.split("train")), "num_validation": len(reader.split("validation")),
                           "num_decode_prompts": len(prompts)},
              "floors": None, "drafters": {}}
    result["floors"] = reusable_floors(out_dir / "learning.json", result["settings"]) or floors(
        settings, target, reader, prompts, eos)
    log.info("floors: %s", {k: v["decoded_tau"] for k, v in result["floors"].items()})
    for label in settings.kinds:
        run_dir = out_dir / label.replace(":", "-")
        overrides = train_overrides(settings, label, reader.meta.target, run_dir)
        wall0 = time.perf_counter()
        summary = run(compose_train_config(overrides))
        result["drafters"][label] = {"overrides": overrides, "wall_s": round(time.perf_counter() - wall0, 1),
                                     "curve": curve(run_dir)}
        if summary.get("checkpoint"):
            result["drafters"][label]["ablation"] = final_ablation(settings, Path(summary["checkpoint"]), target,
                                                                   reader)
        atomic_write_text(out_dir / "learning.json", _json(result))  # partial results survive an interruption
    atomic_write_text(out_dir / "learning.json", _json(result))
    plot_learning_curves(result, out_dir / "learning.png")
    return result


def _json(result: dict) -> str:
    import json

    from deepspec.evaluation.runner import finite_or_none

    return json.dumps(finite_or_none(result), indent=1) + "\n"


def plot_learning_curves(result: dict, path: str | Path) -> Path:
    """2 x 2 panels: decoded (solid) and simulated (dashed) tau at T=0, and slot-0 agreement, against training
    tokens (left) and CPU seconds (right); floors as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, x_key in enumerate(("tokens_seen", "train_cpu_s")):
        tau_ax, agree_ax = axes[0][col], axes[1][col]
        for index, (kind, data) in enumerate(result["drafters"].items()):
            points = [p for p in data["curve"] if x_key in p]
            xs = [p[x_key] for p in points]
            color = f"C{index}"
            tau_ax.plot(xs, [p.get("tau_decoded_T0") for p in points], "-o", color=color, label=f"{kind} decoded")
            tau_ax.plot(xs, [p.get("tau_greedy_sim") for p in points], "--", color=color, label=f"{kind} simulated")
            agree_ax.plot(xs, [p["top1_agreement"][0] for p in points], "-o", color=color, label=kind)
        for index, (name, floor) in enumerate(result["floors"].items()):
            style = dict(color="0.4" if name == "bigram" else "0.7", linestyle=":" if index else "-.")
            if floor["decoded_tau"].get("T0") is not None:
                tau_ax.axhline(floor["decoded_tau"]["T0"], label=f"{name} decoded", **style)
            if floor["validation"]:
                agree_ax.axhline(floor["validation"]["top1_agreement"][0], label=name, **style)
        label = "training tokens (context)" if x_key == "tokens_seen" else "training CPU seconds"
        tau_ax.set(xlabel=label, ylabel="tau at T=0 (tokens per round)")
        agree_ax.set(xlabel=label, ylabel="slot-0 top-1 agreement")
        for ax in (tau_ax, agree_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    settings = result["settings"]
    fig.suptitle(f"{settings['target']}: {settings['steps']} steps x {settings['batch']} sequences x "
                 f"{settings['anchors_per_seq']} anchors ({settings['torch_threads']} thread)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    defaults = LearningSettings(cache_dir="", out_dir="")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True,
                        help="a finished feature cache (deepspec cache) with a validation split")
    parser.add_argument("--out", default="outputs/bench_learning",
                        help="folder for learning.json, learning.png and the runs")
    parser.add_argument("--kinds", "--runs", nargs="+", default=defaults.kinds,
                        help="runs: KIND (experiment=cpu, the quickstart's preset) or KIND:EXPERIMENT, e.g. dspark "
                             "dspark:paper (deepspec/conf/experiment)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences per optimizer step")
    parser.add_argument("--anchors", type=int, default=defaults.anchors_per_seq, help="anchors per sequence")
    parser.add_argument("--val-anchors", type=int, default=None,
                        help="validation anchors per sequence (default: --anchors); more, a less noisy validation")
    parser.add_argument("--decode-prompts", type=int, default=defaults.decode_prompts)
    parser.add_argument("--decode-max-new-tokens", type=int, default=defaults.decode_max_new_tokens)
    parser.add_argument("--temperatures", type=float, nargs="+", default=defaults.temperatures)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("overrides", nargs="*",
                        help="extra `deepspec train` overrides for every kind, e.g. optim.lr=3e-3")
    return parser


@command_line("deepspec bench learning")
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = LearningSettings(cache_dir=args.cache, out_dir=args.out, kinds=list(args.kinds), steps=args.steps,
                                eval_every=args.eval_every, batch=args.batch, anchors_per_seq=args.anchors,
                                val_anchors_per_seq=args.val_anchors,
                                decode_prompts=args.decode_prompts, decode_max_new_tokens=args.decode_max_new_tokens,
                                temperatures=list(args.temperatures), seed=args.seed, overrides=list(args.overrides))
    result = run_learning_benchmark(settings)
    print(json.dumps({"floors": result["floors"],
                      "drafters": {k: v["curve"][-1] if v["curve"] else None for k, v in result["drafters"].items()},
                      "out": args.out}))


if __name__ == "__main__":
    main()
