"""`deepspec plan` from overrides to report: the plan as configured and, with `measure`, the plan of what runs here
beside its measurement (component by component where the measurement separates them).

What runs here is one process on this machine's device (`cuda` when there is one, else `cpu`), so the plan beside
the measurement is the configuration's plan for that device and one rank, without the target's decoder layers
(the stand-in does not materialise them: measure.py).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import torch

from deepspec.planning.plan import GB, MB, format_flops, format_plan, plan_training_run

log = logging.getLogger(__name__)
HEADROOM = 0.95  # --measure refuses to start when the plan needs more than this share of the available memory

# plan components -> the measured quantity compared with them (measure.MeasuredRun)
COMPARED = [
    ("frozen_embedding_head", ["frozen_embedding_head"], "exact (materialised tensors)"),
    ("drafter_parameters", ["drafter_parameters"], "exact (parameters + buffers)"),
    ("optimizer_states", ["optimizer_states"], "exact (the optimizer's state tensors)"),
    ("gradients", ["gradients"], "live gradient tensors at the peak"),
    ("batch", ["batch"], "exact (the micro-batch's tensors)"),
    ("context_activations", ["context_activations"], "saved for backward by the fusion and context keys"),
    ("draft_layers_and_attention", ["draft_layer_activations", "block_attention"],
     "saved for backward by the draft layers"),
    ("heads_activations", ["heads_activations"], "saved for backward by the heads"),
    ("loss_and_temporaries", ["loss_saved", "loss_chunk", "draft_head_rows", "autocast_weight_copies"],
     "the rest of the peak: the loss chunk in flight and other temporaries"),
]


def compose(overrides: list[str]):
    """The typed training config of `overrides`; a bad override is one line (Hydra's report spans several)."""
    from deepspec.training.config import compose_train_config, resolve_config
    from deepspec.utils.errors import UsageError

    try:
        return resolve_config(compose_train_config(list(overrides)))
    except UsageError as e:
        raise UsageError(" ".join(str(e).split())) from None


def run_plan(overrides: list[str], *, world_size: int | None, device: str, device_memory_gb: float | None,
             samples: int | None, mean_tokens: float | None, measure: bool, steps: int) -> tuple[dict, str]:
    """(report, printed text) of `deepspec plan` (cli.py)."""
    from deepspec.utils.dist import Launch

    cfg = compose(overrides)
    world = world_size if world_size is not None else Launch.from_environ().world_size
    report = plan_training_run(cfg, world_size=world, device=device, device_memory_gb=device_memory_gb,
                               samples=samples, mean_tokens=mean_tokens)
    report["overrides"] = list(overrides)
    text = format_plan(report)
    if measure:
        measured = measure_here(cfg, steps, samples=samples, mean_tokens=mean_tokens)
        report = {"plan_as_configured": report, **measured,
                  "total_mb": measured["plan"]["total_mb"]}
        text += "\n\n" + format_plan(measured["plan"]) + "\n\n" + format_comparison(measured)
    return report, text


def measure_here(cfg, steps: int, *, samples: int | None = None, mean_tokens: float | None = None) -> dict:
    """The plan of `cfg` on this machine (one process) and `steps` optimizer steps of it, measured."""
    import psutil

    from deepspec.planning.measure import measure_training
    from deepspec.planning.target import planned_target_config
    from deepspec.training.config import plan_training

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_config, _ = planned_target_config(cfg.target)
    if cfg.target.num_hidden_layers is None:
        cfg = dataclasses.replace(cfg, target=dataclasses.replace(
            cfg.target, num_hidden_layers=int(target_config.num_hidden_layers)))
    plan = plan_training_run(cfg, world_size=1, device=device, samples=samples, mean_tokens=mean_tokens,
                             target_layers_materialised=False, fit=False)
    available = (torch.cuda.mem_get_info()[0] if device == "cuda" else psutil.virtual_memory().available)
    needed = plan["total_mb"] * MB
    if needed > HEADROOM * available:
        raise ValueError(f"--measure: the plan needs {needed / GB:,.1f} GiB and this machine has "
                         f"{available / GB:,.1f} GiB available; measure a smaller configuration "
                         "(trainer.micro_batch_size, data.cache.max_length, data.max_anchors_per_seq)")
    checked = plan_training(cfg, world_size=1, check_files=False)
    run = measure_training(cfg, target_config, steps=steps, accumulate=plan["config"]["grad_accum_steps"] > 1,
                           device=torch.device(device), precision=plan["config"]["precision"],
                           layer_ids=(checked.cache_layer_ids, checked.drafter_layer_ids),
                           length=plan["config"]["max_length"])
    return {"plan": plan, "measured": measured_report(run, plan, device), "machine": machine()}


def measured_report(run, plan: dict, device: str) -> dict:
    """The measurement as MB by the plan's components (COMPARED), with the peak and the step's CPU seconds."""
    exact, kinds, saved = run.exact_bytes, run.peak_by_kind, run.saved_by_region
    activations_at_peak = kinds.get("forward", 0) + kinds.get("backward", 0)
    saved_model = saved.get("context", 0) + saved.get("draft_layers", 0) + saved.get("heads", 0)
    values = {"frozen_embedding_head": exact["frozen_target"],
              "drafter_parameters": exact["drafter_parameters"] + exact["drafter_buffers"],
              "optimizer_states": exact["optimizer_states"], "gradients": kinds.get("gradients", 0),
              "batch": exact["batch"], "context_activations": saved.get("context", 0),
              "draft_layers_and_attention": saved.get("draft_layers", 0), "heads_activations": saved.get("heads", 0),
              "loss_and_temporaries": activations_at_peak - saved_model}
    planned = plan["memory"]["components"]
    components = {}
    for name, plan_names, how in COMPARED:
        components[name] = {"plan_mb": round(sum(planned[p]["mb"] for p in plan_names if p in planned), 1),
                            "measured_mb": round(values[name] / MB, 1), "how": how}
    cpu = run.micro_batch_cpu_s
    steady = cpu[1:] or cpu
    return {"total_mb": round(run.peak_tensor_bytes / MB, 1), "device": device,
            "peak_live_tensors_by_kind_mb": {k: round(v / MB, 1) for k, v in kinds.items()},
            "components": components,
            "peak_rss_mb": round(run.peak_rss_bytes / MB, 1), "baseline_rss_mb": round(run.baseline_rss_bytes / MB, 1),
            "micro_batch_cpu_s": [round(x, 2) for x in cpu], "step_cpu_s": round(statistics.median(steady), 2),
            "micro_batches_per_step": run.micro_batches_per_step, "steps": run.steps,
            "micro_batch": run.batch_counts, "flops_micro_batch": run.flops,
            "plan_flops_micro_batch": plan["flops"]["micro_batch"]["total"], "notes": run.notes,
            "saved_for_backward_mb": {k: round(v / MB, 1) for k, v in saved.items()}}


def machine() -> dict:
    import os

    from deepspec.utils.machine import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def format_comparison(measured: dict) -> str:
    m, mach = measured["measured"], measured["machine"]
    lines = [f"measured here: {mach['gpu'] or mach['cpu']} ({mach['torch_threads']} thread(s)), one process, "
             f"{m['steps']} optimizer steps x {m['micro_batches_per_step']} micro-batches; micro-batch: "
             f"{m['micro_batch'].get('context_tokens', 0):,} tokens, {m['micro_batch'].get('blocks', 0):,} blocks, "
             f"{m['micro_batch'].get('rows', 0):,} rows",
             f"  {'component':<28} {'plan MB':>12} {'measured MB':>12} {'measured/plan':>14}  how measured"]
    for name, row in m["components"].items():
        ratio = f"{row['measured_mb'] / row['plan_mb']:.3f}" if row["plan_mb"] else "-"
        lines.append(f"  {name:<28} {row['plan_mb']:>12,.1f} {row['measured_mb']:>12,.1f} {ratio:>14}  {row['how']}")
    plan_total = measured["plan"]["total_mb"]
    lines.append(f"  {'total (peak live tensors)':<28} {plan_total:>12,.1f} {m['total_mb']:>12,.1f} "
                 f"{m['total_mb'] / plan_total:>14.3f}  tracked tensor bytes at the peak")
    lines.append(f"  peak RSS {m['peak_rss_mb']:,.1f} MB (before the model was built: {m['baseline_rss_mb']:,.1f} MB); "
                 f"CPU-s per micro-batch {m['micro_batch_cpu_s']} (median after the first: {m['step_cpu_s']})")
    lines.append(f"  FLOPs per micro-batch: plan {format_flops(m['plan_flops_micro_batch'])}, torch's count "
                 f"{format_flops(m['flops_micro_batch'])}")
    for note in m["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
