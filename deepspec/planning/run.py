"""`deepspec plan` from overrides to report: the plan as configured and, with `measure`, the plan of what runs here
beside its measurement (component by component where the measurement separates them).

What runs here is one process on this machine's device (`cuda` when there is one, else `cpu`), so the plan beside
the measurement is the configuration's plan for that device and one rank, without the target's decoder layers
(the stand-in does not materialise them: measure.py). Before anything is built, a measurement whose process would
not fit the memory available now (the plan's live tensors and what the process holds beyond them,
`PROCESS_OVERHEAD`) is refused in one line naming the largest `trainer.micro_batch_size` that fits, and
`--device` where the plan as configured is for another device than the one measured here.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import torch

from deepspec.planning.plan import GB, MB, format_flops, format_plan, plan_training_run

log = logging.getLogger(__name__)
HEADROOM = 0.95  # --measure refuses to start when it needs more than this share of the available memory
# What --measure's process holds beyond its starting size per byte of live tensors the plan counts, and besides them:
# freed blocks the allocator keeps, fragmentation, the libraries the engine loads. From --measure's own runs on CPU
# (peak RSS less the RSS before the model was built, at Qwen3-4B and tiny widths: docs/results.md); unmeasured on
# GPUs, where the live tensors alone count.
PROCESS_OVERHEAD = {"cpu": (1.2, 150 * 2**20), "cuda": (1.0, 0)}

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
        measured = measure_here(cfg, steps, samples=samples, mean_tokens=mean_tokens, requested_device=device)
        report = {"plan_as_configured": report, **measured,
                  "total_mb": measured["plan"]["total_mb"]}
        text += "\n\n" + format_plan(measured["plan"]) + "\n\n" + format_comparison(measured)
    return report, text


def measure_here(cfg, steps: int, *, samples: int | None = None, mean_tokens: float | None = None,
                 requested_device: str | None = None) -> dict:
    """The plan of `cfg` on this machine (one process) and `steps` optimizer steps of it, measured; refused before
    anything is allocated when it cannot fit (`check_fits_here`). `requested_device`: the `--device` of the plan
    as configured (a refusal names `--device` where it is not the device measured here)."""
    from deepspec.planning.measure import measure_training
    from deepspec.planning.target import planned_target_config
    from deepspec.training.config import plan_training
    from deepspec.training.placement import placement_on

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_config, _ = planned_target_config(cfg.target)
    if cfg.target.num_hidden_layers is None:
        cfg = dataclasses.replace(cfg, target=dataclasses.replace(
            cfg.target, num_hidden_layers=int(target_config.num_hidden_layers)))
    plan = plan_training_run(cfg, world_size=1, device=device, samples=samples, mean_tokens=mean_tokens,
                             target_layers_materialised=False, fit=False)
    check_fits_here(cfg, plan, device, available_memory(device), requested_device or device)
    checked = plan_training(cfg, world_size=1, check_files=False)
    run = measure_training(cfg, target_config, steps=steps, accumulate=plan["config"]["grad_accum_steps"] > 1,
                           placement=placement_on(torch.device(device), cfg.trainer, cfg.deepspeed, world_size=1),
                           layer_ids=(checked.cache_layer_ids, checked.drafter_layer_ids),
                           length=plan["config"]["max_length"])
    return {"plan": plan, "measured": measured_report(run, plan, device), "machine": machine()}


def available_memory(device: str) -> int:
    """Bytes this process can still take on `device`: the GPU's free memory, or the machine's available RAM."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available


def process_bytes(total_mb: float, device: str) -> float:
    """What --measure's process takes on `device` for a plan of `total_mb` MB of live tensors (PROCESS_OVERHEAD)."""
    per_byte, fixed = PROCESS_OVERHEAD[device]
    return total_mb * MB * per_byte + fixed


def check_fits_here(cfg, plan: dict, device: str, available: int, requested_device: str) -> None:
    """Refuse a measurement this machine cannot hold, in one line naming the micro-batch size that fits."""
    needed = process_bytes(plan["total_mb"], device)
    usable = HEADROOM * available
    if needed <= usable:
        return
    device_flag = f" --device {device}" if requested_device != device else ""
    micro = cfg.trainer.micro_batch_size
    by_micro = plan_training_run(cfg, world_size=1, device=device, target_layers_materialised=False,
                                 device_memory_gb=available / GB)["fit"]["total_mb_by_micro_batch"]
    fitting = [m for m, total_mb in by_micro.items() if m < micro and process_bytes(total_mb, device) <= usable]
    if fitting:
        best = max(fitting)
        advice = (f"trainer.micro_batch_size={best} fits ({process_bytes(by_micro[best], device) / GB:,.1f} GiB): "
                  f"rerun with trainer.micro_batch_size={best}{device_flag}")
    else:
        advice = ("no micro-batch size fits: measure a smaller configuration (data.cache.max_length, "
                  "data.max_anchors_per_seq, drafter.num_draft_layers)" + (f" with{device_flag}" * bool(device_flag)))
    raise ValueError(f"--measure: trainer.micro_batch_size={micro} needs about {needed / GB:,.1f} GiB on this "
                     f"machine's {device} ({plan['total_mb'] / 1024:,.1f} GiB of live tensors as planned, and what "
                     f"the process holds beyond them) and {available / GB:,.1f} GiB is available "
                     f"({HEADROOM:.0%} usable); {advice}")


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
