"""PNG plots of evaluation results (matplotlib, Agg backend; no display needed).

* `plot_position_curves`: per-position conditional acceptance and prefix survival (paper fig. 2), one
  panel per domain, one line per drafter; a domain's curve is the mean over its benchmarks of the
  per-benchmark rates (positions a benchmark never reached are skipped in that mean).
* `plot_threshold_sweep`: paper fig. 5 per drafter with a sweep: bars of accepted and rejected drafts
  per step, tokens per step, and the acceptance rate (right axis), one panel per domain.
Inputs are the results dict of `runner.evaluate` (see tables.py).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from deepspec.evaluation.prompt_sets import DOMAINS


def _domains(results: dict) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for bench in results["settings"]["benchmarks"]:
        grouped.setdefault(bench["domain"], []).append(bench["name"])
    return {d: grouped[d] for d in DOMAINS if d in grouped}


def domain_curve(per_bench: dict, names: list[str], key: str) -> list[float | None]:
    """Mean over benchmarks of a per-position list (None entries skipped); None where no benchmark has data."""
    curves = [per_bench[n][key] for n in names if n in per_bench and per_bench[n].get(key)]
    length = max((len(c) for c in curves), default=0)
    out = []
    for k in range(length):
        values = [c[k] for c in curves if k < len(c) and c[k] is not None]
        out.append(sum(values) / len(values) if values else None)
    return out


def plot_position_curves(results: dict, path: str | Path) -> Path:
    domains = _domains(results)
    keys = (("conditional_acceptance", "Cond. acceptance"), ("prefix_survival", "Prefix survival"))
    fig, axes = plt.subplots(len(keys), len(domains), figsize=(4 * len(domains), 6.5), squeeze=False)
    for col, (domain, names) in enumerate(domains.items()):
        for row, (key, label) in enumerate(keys):
            ax = axes[row][col]
            for drafter, entry in results["drafters"].items():
                curve = domain_curve(entry.get("benchmarks", {}), names, key)
                points = [(k + 1, v) for k, v in enumerate(curve) if v is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=drafter)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("Draft position")
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(domain.capitalize())
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _domain_sweep(per_bench: dict, names: list[str]) -> list[dict] | None:
    """Benchmark-averaged sweep (per-step quantities averaged; acceptance rate from the averaged counts)."""
    sweeps = [per_bench[n]["threshold_sweep"] for n in names if n in per_bench and per_bench[n].get("threshold_sweep")]
    if not sweeps:
        return None
    out = []
    for index, point in enumerate(sweeps[0]):
        entry = {"threshold": point["threshold"]}
        for key in ("tokens_per_step", "accepted_per_step", "rejected_per_step", "verified_per_step"):
            entry[key] = sum(s[index][key] for s in sweeps) / len(sweeps)
        verified = entry["verified_per_step"]
        entry["acceptance_rate"] = entry["accepted_per_step"] / verified if verified else None
        out.append(entry)
    return out


def plot_threshold_sweep(results: dict, path: str | Path, drafter: str) -> Path | None:
    """Fig. 5 for one drafter; returns None (writes nothing) when it has no sweep."""
    entry = results["drafters"][drafter]
    domains = _domains(results)
    panels = {d: _domain_sweep(entry.get("benchmarks", {}), names) for d, names in domains.items()}
    panels = {d: s for d, s in panels.items() if s}
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for col, (domain, sweep) in enumerate(panels.items()):
        ax = axes[0][col]
        xs = [p["threshold"] for p in sweep]
        width = 0.8 * (xs[1] - xs[0]) if len(xs) > 1 else 0.08
        accepted = [p["accepted_per_step"] for p in sweep]
        ax.bar(xs, accepted, width=width, label="Accepted drafts")
        ax.bar(xs, [p["rejected_per_step"] for p in sweep], width=width, bottom=accepted, hatch="//",
               alpha=0.6, label="Rejected drafts")
        ax.plot(xs, [p["tokens_per_step"] for p in sweep], color="black", marker=".", label="Tokens per step")
        ax.set_xlabel("Confidence threshold")
        ax.set_title(domain.capitalize())
        if col == 0:
            ax.set_ylabel("Per step")
        rate_ax = ax.twinx()
        rates = [(x, p["acceptance_rate"]) for x, p in zip(xs, sweep) if p["acceptance_rate"] is not None]
        if rates:
            rate_ax.plot(*zip(*rates), color="tab:red", marker="o", label="Acceptance rate")
        rate_ax.set_ylim(0, 1.05)
        if col == len(panels) - 1:
            rate_ax.set_ylabel("Acceptance rate")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles + [plt.Line2D([], [], color="tab:red", marker="o")], labels + ["Acceptance rate"],
               loc="upper center", ncol=4, fontsize=8)
    fig.suptitle(drafter, y=0.02, fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 0.9))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: str | Path) -> list[Path]:
    """positions.png plus one threshold_sweep_<drafter>.png per drafter with a sweep."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_position_curves(results, out / "positions.png")]
    for drafter in results["drafters"]:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in drafter)
        sweep = plot_threshold_sweep(results, out / f"threshold_sweep_{safe}.png", drafter)
        if sweep is not None:
            written.append(sweep)
    return written
