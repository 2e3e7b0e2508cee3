"""What grows with what (`deepspec bench scaling`): CPU-seconds per micro-batch and peak memory of a block-drafter
training step while one of sequence length, anchors per sequence, draft vocabulary and draft layers grows and the
others stay at the paper's values (max_length 4,096, 512 anchors, the full vocabulary, 5 layers; DSpark, block 7).

Each point is `deepspec plan --measure` of that configuration (deepspec/planning/measure.py: the trainer's model,
objective and DeepSpeed engine over a synthetic cache, a random-weight target of the named widths) in its own
process, one thread: 2 optimizer steps of one micro-batch each (the second has AdamW's states; its CPU time is the
point's), the peak of live tensors and the process's peak RSS, beside the plan's total and FLOPs. Each series is
fitted in log-log space (least squares): a slope above 1 grows faster than linearly. Memory is fitted twice: the
whole peak, and what a micro-batch adds to the static part (peak minus parameters, gradients, optimizer states and
the frozen target parts), the part a longer or wider step scales.

Each measured point is written as it completes to `<out>.points.json`, so a run stopped by a failed or killed point
(out of memory on a shared machine) resumes where it stopped when run again with the same options: the points of
the same overrides are not measured again. The finished report removes that file.

The fixed values can be scaled down (`--fixed-length`, `--fixed-anchors`, `--fixed-layers`, `--widths`) where a
full point cannot run on the machine at hand; the JSON records what was used. Prints one JSON object, writes it
(`--out`) and draws `--figure` (a PNG).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from deepspec.utils.errors import command_line
from deepspec.utils.machine import cpu_model

SERIES = {  # name -> (the override it sets, default points)
    "max_length": ("data.cache.max_length", [512, 1024, 2048, 4096]),
    "anchors": ("data.max_anchors_per_seq", [16, 64, 256, 512]),
    "draft_vocab": ("drafter.draft_vocab_size", [8192, 32768, 151936]),
    "draft_layers": ("drafter.num_draft_layers", [1, 2, 3, 5]),
}
SUPERLINEAR = 1.1  # a fitted slope above this grows faster than linearly (below: within measurement noise of 1)


def point_overrides(base: list[str], fixed: dict, name: str, value: int, full_vocab: int) -> list[str]:
    """`deepspec train` overrides of one point: the fixed values, with `name` set to `value`."""
    values = {**fixed, name: value}
    vocab = values["draft_vocab"]
    return [*base, f"data.cache.max_length={values['max_length']}",
            f"data.max_anchors_per_seq={values['anchors']}",
            f"drafter.draft_vocab_size={'null' if vocab is None or vocab >= full_vocab else vocab}",
            f"drafter.num_draft_layers={values['draft_layers']}"]


def run_point(overrides: list[str], timeout_s: float) -> dict:
    """One point in its own process (`--point` worker): the measurement's JSON."""
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as folder:
        out = Path(folder) / "point.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        # no finished cache: the planned length is data.cache.max_length, not an existing cache's
        cmd = [sys.executable, "-m", "deepspec.cli", "plan", *overrides, f"data.cache_dir={folder}/no-cache",
               "--measure", "--steps", "2", "--device", "cpu", "--out", str(out)]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
        report = json.loads(out.read_text())
    measured, plan = report["measured"], report["plan"]
    static = sum(plan["memory"]["components"][k]["mb"] for k in ("frozen_embedding_head", "drafter_parameters",
                                                                 "optimizer_states", "gradients"))
    return {"step_cpu_s": measured["step_cpu_s"], "peak_mb": measured["total_mb"],
            "peak_rss_mb": measured["peak_rss_mb"], "plan_mb": plan["total_mb"],
            "micro_batch_mb": round(measured["total_mb"] - static, 1), "flops": measured["flops_micro_batch"],
            "plan_flops": plan["flops"]["micro_batch"]["total"], "micro_batch": measured["micro_batch"],
            "overrides": overrides}


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x) (None with fewer than two usable points)."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    var = sum((p[0] - mx) ** 2 for p in pairs)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pairs) / var, 3) if var else None


def fit_series(points: list[dict], xs: list[int]) -> dict:
    slopes = {key: loglog_slope(xs, [p[key] for p in points])
              for key in ("step_cpu_s", "peak_mb", "micro_batch_mb", "flops")}
    return {"slopes": slopes,
            "faster_than_linear": sorted(k for k, v in slopes.items() if v is not None and v > SUPERLINEAR)}


def plot_scaling(result: dict, path: Path) -> Path:
    """Two panels, log-log: CPU-s per micro-batch and the micro-batch's memory against each series' growth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, (name, series) in enumerate(result["series"].items()):
        xs = [x / series["values"][0] for x in series["values"]]
        for ax, key in zip(axes, ("step_cpu_s", "micro_batch_mb")):
            ys = [p[key] for p in series["points"]]
            slope = series["fit"]["slopes"][key]
            ax.plot(xs, ys, "-o", color=f"C{index}",
                    label=f"{name} {series['values'][0]:,}->{series['values'][-1]:,} (slope {slope})")
    for ax, label in zip(axes, ("CPU-s per micro-batch", "MB above the static part (peak live tensors)")):
        ax.set(xscale="log", yscale="log", xlabel="growth of the varied value (x its first point)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fixed, widths = result["fixed"], result["widths"]
    fig.suptitle(f"DSpark at {widths} widths, one thread; fixed: max_length {fixed['max_length']:,}, "
                 f"{fixed['anchors']} anchors, vocabulary {fixed['draft_vocab'] or 'full'}, "
                 f"{fixed['draft_layers']} layers", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspec bench scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="qwen3-4b", help="target shape (deepspec/targets/synthetic.py)")
    parser.add_argument("--fixed-length", type=int, default=4096)
    parser.add_argument("--fixed-anchors", type=int, default=512)
    parser.add_argument("--fixed-layers", type=int, default=5)
    parser.add_argument("--fixed-vocab", type=int, default=None, help="fixed draft vocabulary (default: the full one)")
    for name, (_, values) in SERIES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=values,
                            help=f"points of the {name} series")
    parser.add_argument("--series", nargs="+", choices=sorted(SERIES), default=list(SERIES))
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per point")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_scaling.json"))
    parser.add_argument("--figure", type=Path, default=Path("outputs/bench_scaling.png"))
    parser.add_argument("overrides", nargs="*", help="extra `deepspec train` overrides for every point")
    return parser


@command_line("deepspec bench scaling")
def main(argv: list[str] | None = None) -> int:
    from deepspec.targets.synthetic import shaped_config
    from deepspec.utils.io import atomic_write_json, emit_report, read_json

    args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    full_vocab = int(shaped_config(args.widths).vocab_size)
    fixed = {"max_length": args.fixed_length, "anchors": args.fixed_anchors, "draft_layers": args.fixed_layers,
             "draft_vocab": args.fixed_vocab}
    base = ["experiment=paper", "drafter=dspark", "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
            f"target.shape={args.widths}", "target.name=random-" + args.widths, "target.dtype=bfloat16",
            "target.num_hidden_layers=null", "target.layer_ids=null", *args.overrides]
    points_file = args.out.with_name(args.out.name + ".points.json")
    measured: dict[str, dict] = read_json(points_file) if points_file.is_file() else {}
    if measured:
        print(f"deepspec bench scaling: resuming: {len(measured)} point(s) measured before, in {points_file}",
              file=sys.stderr)
    result = {"widths": args.widths, "fixed": fixed, "base_overrides": base, "series": {},
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "threads_per_process": 1}}
    for name in args.series:
        values = sorted(getattr(args, name))
        points = []
        for value in values:
            overrides = point_overrides(base, fixed, name, value, full_vocab)
            key = " ".join(overrides)  # every option of the point: a rerun with other options measures again
            if key not in measured:  # the fixed point is shared by every series
                measured[key] = run_point(overrides, args.timeout)
                atomic_write_json(points_file, measured)
            points.append(measured[key])
        result["series"][name] = {"override": SERIES[name][0], "values": values, "points": points,
                                  "fit": fit_series(points, values)}
    result["faster_than_linear"] = {name: s["fit"]["faster_than_linear"] for name, s in result["series"].items()}
    result["figure"] = str(plot_scaling(result, args.figure))
    emit_report(result, args.out)
    points_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
