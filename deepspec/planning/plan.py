"""A training configuration's plan: per-rank memory by component, the step's tokens and FLOPs, the epoch and the
cache for a data size, and the largest micro-batch that fits a device (package docstring).

`plan_training_run(cfg, world_size=..., device=...)` runs the trainer's own checks that need no files
(`plan_training(check_files=False)`: batch divisibility, layer ids, the drafter's fields), resolves the numerics
the trainer would on that device (its `Placement` there, `placement.placement_on`; the target's dtype for the
drafter's parameters), counts parameters exactly on the meta device, and evaluates memory.py and flops.py on the
worst-case micro-batch (shapes.py). Data size: a finished cache in `data.cache_dir` (its meta.json), else
`samples` conversations of `mean_tokens` tokens (split by `data.source.val_fraction` / `test_fraction`); the cache's
bytes are the cache job's own estimate (`estimate_cache_size`, what `deepspec cache mode=estimate` prints).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from deepspec.planning.flops import plan_flops
from deepspec.planning.memory import ParameterCounts, plan_memory
from deepspec.planning.shapes import (
    DTYPE_BYTES,
    MicroBatch,
    Numerics,
    Widths,
    build_meta_drafter,
    drafter_widths,
    plan_micro_batch,
)
from deepspec.planning.target import planned_target_config

MB = 2**20
GB = 2**30
USABLE_FRACTION = 0.9  # of a device's memory: the rest for the CUDA context, NCCL buffers, allocator fragmentation
CUDA_DEVICE_GIB = 79.6  # an "80 GB" H100 as nvidia-smi reports it (81,559 MiB); every figure here is GiB
DEVICES = ("cuda", "cpu")


def resolve_numerics(cfg, world_size: int, device: str, grad_accum: int) -> Numerics:
    """How the trainer computes on `device` with this config (its `Placement` there: deepspec.training.placement)."""
    from deepspec.drafters.block.attention import resolve_training_attention
    from deepspec.training.placement import placement_on

    torch_device = torch.device(device)
    placement = placement_on(torch_device, cfg.trainer, cfg.deepspeed, world_size)
    # build_drafter gives the drafter the target's dtype; DeepSpeed's bf16 engine casts its parameters to bf16
    param_dtype = torch.bfloat16 if placement.precision == "bf16" else target_dtype(cfg.target, torch_device)
    autocast = placement.autocast_dtype is not None
    param_bytes = DTYPE_BYTES[param_dtype]
    return Numerics(device=device, world_size=world_size, precision=placement.precision,
                    zero_stage=placement.zero_stage, param_bytes=param_bytes,
                    activation_bytes=2 if autocast else param_bytes, batch_bytes=DTYPE_BYTES[placement.dtype],
                    attention=resolve_training_attention(getattr(cfg.drafter, "training_attention", "auto"),
                                                         torch_device),
                    grad_accum=grad_accum, autocast=autocast, weight_average=cfg.trainer.ema_decay > 0)


def target_dtype(target, device: torch.device) -> torch.dtype:
    """The dtype `load_target` gives the target on `device` (tiny test targets are always float32)."""
    from deepspec.targets.load import parse_dtype
    from deepspec.targets.tiny import is_tiny_target

    return torch.float32 if is_tiny_target(target.name) else parse_dtype(target.dtype, device)


def parameter_counts(target_config, drafter, target_bytes: int) -> ParameterCounts:
    """Exact counts from meta-device models (nothing allocated)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(target_config)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = sum(p.numel() for p in base.norm.parameters())
    outer = embedding.numel() + (0 if head is embedding else head.numel()) + norm
    total = sum(p.numel() for p in model.parameters())
    layers = drafter.backbone.layers
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    return ParameterCounts(target_embedding_head=outer, target_decoder_layers=total - outer,
                           target_layers=int(target_config.num_hidden_layers), target_bytes=target_bytes,
                           drafter=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                           drafter_tensors=sum(1 for p in drafter.parameters() if p.requires_grad),
                           drafter_buffer_bytes=sum(b.numel() * b.element_size() for b in drafter.buffers()),
                           drafter_linear_in_layers=linear)


def planned_length(cfg) -> tuple[int, str]:
    """Tokens of the longest sample: the finished cache's max_length (offline), else data.cache.max_length."""
    from deepspec.cache.format import read_meta

    meta_file = Path(cfg.data.cache_dir) / "meta.json"
    if cfg.data.features == "offline" and meta_file.is_file():
        meta = read_meta(cfg.data.cache_dir)
        if meta.max_length:
            return int(meta.max_length), f"{meta_file} max_length"
    if cfg.data.cache.max_length is None:
        raise ValueError("data.cache.max_length=null: set it to the longest sample's tokens to plan a step")
    return int(cfg.data.cache.max_length), "data.cache.max_length"


def data_plan(cfg, hidden: int, num_layers: int, samples: int | None, mean_tokens: float | None,
              length: int) -> dict:
    """Samples, steps per epoch and the cache's bytes (module docstring); a finished cache's own storage settings."""
    from deepspec.cache.format import read_meta
    from deepspec.cache.plan import estimate_cache_size

    c, source = cfg.data.cache, cfg.data.source
    meta_file = Path(cfg.data.cache_dir) / "meta.json"
    on_disk = None
    stored = (c.storage_dtype, c.content, c.top_k)  # the cache job's settings (`data.cache`)
    if samples is not None:
        if samples < 1 or mean_tokens is None or not mean_tokens > 0:
            raise ValueError(f"--samples {samples} --mean-tokens {mean_tokens}: both must be positive")
        tokens_per_sample = min(float(mean_tokens), length)
        total_tokens = int(round(samples * tokens_per_sample))
        train = int(round(samples * (1.0 - source.val_fraction - source.test_fraction)))
        where = f"--samples {samples} --mean-tokens {mean_tokens:g} (split by data.source fractions)"
    elif cfg.data.features == "offline" and meta_file.is_file():
        meta = read_meta(cfg.data.cache_dir)
        samples, total_tokens = int(meta.counts["samples"]), int(meta.counts["tokens"])
        train = int(meta.counts.get("per_split", {}).get("train", {}).get("samples", samples))
        on_disk = meta.counts.get("bytes_on_disk")
        stored = (meta.storage_dtype, meta.content, meta.top_k)
        hidden, num_layers = meta.hidden_size, len(meta.layer_ids)
        where = str(meta_file)
    else:
        return {"source": None, "note": "data size unknown: give --samples N --mean-tokens T, or a finished cache "
                                        "in data.cache_dir"}
    estimate = estimate_cache_size(total_tokens, samples, hidden, num_layers, *stored)
    steps = train // cfg.trainer.global_batch_size
    return {"source": where, "samples": samples, "train_samples": train, "tokens": total_tokens,
            "mean_tokens": round(total_tokens / max(samples, 1), 1), "steps_per_epoch": steps,
            "optimizer_steps": steps * cfg.trainer.epochs if cfg.trainer.max_steps is None
            else min(cfg.trainer.max_steps, steps * cfg.trainer.epochs),
            "cache": {**estimate, "written": cfg.data.features != "online", "bytes_on_disk": on_disk}}


def _mb(value: int) -> float:
    return round(value / MB, 1)


def memory_report(memory: dict) -> dict:
    return {"components": {c.name: {"mb": _mb(c.bytes), "what": c.what, "phase": c.phase}
                           for c in memory["components"]},
            "static_mb": _mb(memory["static_bytes"]), "step_peak_mb": _mb(memory["step_peak_bytes"]),
            "optimizer_peak_mb": _mb(memory["optimizer_peak_bytes"]),
            "phase_peaks_mb": {k: _mb(v) for k, v in memory["phase_peaks"].items()}, "peak_phase": memory["peak_phase"],
            "total_mb": _mb(memory["total_bytes"])}


def micro_batch_choices(cfg, world_size: int) -> list[int]:
    """Micro-batch sizes the run accepts: those dividing global_batch_size / world size."""
    per_rank, rest = divmod(cfg.trainer.global_batch_size, world_size)
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0] if not rest else []


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """What a plan evaluates: the checked configuration's widths, numerics and parameter counts, for any micro-batch
    size (`evaluate`)."""

    cfg: object  # TrainConfig
    world_size: int
    widths: Widths
    numerics: Numerics
    params: ParameterCounts
    length: int  # tokens of the longest sample
    target_layers_materialised: bool

    def evaluate(self, micro: int) -> tuple[MicroBatch, Numerics, dict]:
        """(worst-case micro-batch, numerics, memory plan) at micro-batch size `micro`."""
        cfg, widths = self.cfg, self.widths
        mb = plan_micro_batch(micro, self.length, cfg.data.max_anchors_per_seq, widths.block_size, widths.num_drafts)
        num = dataclasses.replace(self.numerics, grad_accum=cfg.trainer.global_batch_size // (micro * self.world_size))
        z = cfg.deepspeed
        buckets = z.reduce_bucket_size * (2 if z.overlap_comm else 1) if z.contiguous_gradients else 0
        memory = plan_memory(self.params, widths, num, mb, cfg.loss, bucket_elements=buckets,
                             target_layers_materialised=self.target_layers_materialised, features=cfg.data.features,
                             online_batch=cfg.data.online_batch, target_sharding=cfg.data.target_sharding)
        return mb, num, memory


def plan_training_run(cfg, *, world_size: int = 1, device: str = "cuda", device_memory_gb: float | None = None,
                      samples: int | None = None, mean_tokens: float | None = None,
                      target_layers_materialised: bool = True, fit: bool = True) -> dict:
    """The plan of `cfg` (a `TrainConfig`) on `world_size` ranks of `device` (module docstring), JSON-able."""
    from deepspec.training.config import plan_training

    check_plannable(cfg, world_size, device)
    target_config, target_source = planned_target_config(cfg.target)
    if cfg.target.num_hidden_layers is None:
        depth = int(target_config.num_hidden_layers)
        cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, num_hidden_layers=depth))
    checked = plan_training(cfg, world_size=world_size, check_files=False)
    length, length_source = planned_length(cfg)
    drafter = build_meta_drafter(cfg, target_config, checked.drafter_layer_ids)
    planned = PlannedRun(cfg=cfg, world_size=world_size, widths=drafter_widths(drafter, target_config),
                         numerics=resolve_numerics(cfg, world_size, device, checked.grad_accum_steps),
                         params=parameter_counts(target_config, drafter,
                                                 DTYPE_BYTES[target_dtype(cfg.target, torch.device(device))]),
                         length=length, target_layers_materialised=target_layers_materialised)
    mb, numerics, memory = planned.evaluate(cfg.trainer.micro_batch_size)
    widths, params = planned.widths, planned.params
    online = cfg.data.features != "offline"  # hybrid: epoch 0 only
    head = widths.target_vocab * widths.hidden
    flops = plan_flops(mb, widths, numerics, cfg.loss, params.target_decoder_layers + head if online else 0)
    per_step = numerics.grad_accum * world_size
    report = {
        "config": config_report(cfg, device, world_size, numerics, widths, target_source=target_source,
                                length=(length, length_source), feature_layers=checked.drafter_layer_ids),
        "widths": dataclasses.asdict(widths),
        "parameters": {"target": params.target_embedding_head + params.target_decoder_layers,
                       "target_embedding_head": params.target_embedding_head, "drafter": params.drafter},
        "micro_batch": {"sequences": mb.sequences, "context_tokens": mb.context_tokens, "blocks": mb.blocks,
                        "block_slots": mb.slots, "supervised_positions": mb.rows,
                        "attention_calls_per_layer": len(mb.segments) if numerics.attention == "segmented" else 1},
        "optimizer_step": {"micro_batches_per_rank": numerics.grad_accum, "ranks": world_size,
                           "sequences": cfg.trainer.micro_batch_size * per_step,
                           "context_tokens": mb.context_tokens * per_step, "supervised_positions": mb.rows * per_step},
        "flops": {"micro_batch": flops, "optimizer_step_total": flops["total"] * per_step},
        "memory": memory_report(memory),
        "data": data_plan(cfg, widths.hidden, widths.feature_layers, samples, mean_tokens, length),
    }
    report["total_mb"] = report["memory"]["total_mb"]
    if fit:
        report["fit"] = fit_report(planned, memory, device, device_memory_gb)
    return report


def check_plannable(cfg, world_size: int, device: str) -> None:
    """What `deepspec plan` plans: a block drafter on a known device kind and at least one rank."""
    from deepspec.drafters.block.model import BlockDrafter
    from deepspec.drafters.spec import get_drafter_spec

    if device not in DEVICES:
        raise ValueError(f"--device {device!r} must be one of {list(DEVICES)}")
    if world_size < 1:
        raise ValueError(f"--world-size {world_size} must be >= 1")
    if not issubclass(get_drafter_spec(cfg.drafter.kind).model_class, BlockDrafter):
        raise ValueError(f"drafter.kind={cfg.drafter.kind}: `deepspec plan` covers the block drafters (dspark, "
                         "dflash); chain and standalone drafters are not planned yet")


def config_report(cfg, device: str, world_size: int, numerics: Numerics, widths: Widths, *, target_source: str,
                  length: tuple[int, str], feature_layers: list[int]) -> dict:
    """The settings the plan was computed for, as the trainer resolves them. `length`: (tokens, where from)."""
    return {"target": cfg.target.name, "target_source": target_source, "drafter": cfg.drafter.kind,
            "features": cfg.data.features, "online_batch": cfg.data.online_batch,
            "target_sharding": cfg.data.target_sharding, "device": device, "world_size": world_size,
            "precision": numerics.precision, "deepspeed_stage": cfg.deepspeed.stage,
            "zero_stage_run": numerics.zero_stage, "parameter_bytes": numerics.param_bytes,
            "activation_bytes": numerics.activation_bytes, "attention": numerics.attention,
            "micro_batch_size": cfg.trainer.micro_batch_size, "global_batch_size": cfg.trainer.global_batch_size,
            "grad_accum_steps": numerics.grad_accum, "max_length": length[0], "max_length_source": length[1],
            "max_anchors_per_seq": cfg.data.max_anchors_per_seq, "block_size": widths.block_size,
            "num_drafts": widths.num_drafts, "draft_vocab": widths.vocab, "target_vocab": widths.target_vocab,
            "draft_layers": widths.draft_layers, "feature_layers": feature_layers,
            "loss_chunk_rows": cfg.loss.chunk_rows, "loss_checkpoint": cfg.loss.checkpoint}


def fit_report(planned: PlannedRun, memory: dict, device: str, device_memory_gb: float | None) -> dict:
    """Whether the plan fits a device of `device_memory_gb` GiB (default: an H100 for cuda, this machine's RAM for
    cpu), and the largest micro-batch size that does."""
    if device_memory_gb is None:
        device_memory_gb = CUDA_DEVICE_GIB if device == "cuda" else _machine_memory_gb()
    usable = device_memory_gb * GB * USABLE_FRACTION
    by_micro = {m: _mb(planned.evaluate(m)[2]["total_bytes"])
                for m in micro_batch_choices(planned.cfg, planned.world_size)}
    fitting = [m for m, total in by_micro.items() if total * MB <= usable]
    return {"device_memory_gb": device_memory_gb, "usable_gb": round(usable / GB, 1),
            "usable_fraction": USABLE_FRACTION, "fits": memory["total_bytes"] <= usable,
            "largest_micro_batch": max(fitting) if fitting else None, "total_mb_by_micro_batch": by_micro}


def _machine_memory_gb() -> float:
    import psutil

    return round(psutil.virtual_memory().total / GB, 1)


def format_flops(value: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} FLOP"


def format_plan(report: dict) -> str:
    """The plan as a readable table (the JSON holds the same numbers)."""
    c, mem, mbatch, step = report["config"], report["memory"], report["micro_batch"], report["optimizer_step"]
    online = "" if c["features"] == "offline" else (
        f" (data.online_batch={c['online_batch']}, data.target_sharding={c['target_sharding']})")
    lines = [f"plan: {c['drafter']} on {c['target']} ({c['target_source']}), features {c['features']}{online}",
             f"  {c['world_size']} x {c['device']}, precision {c['precision']}, deepspeed.stage={c['deepspeed_stage']} "
             f"(runs ZeRO stage {c['zero_stage_run']}), parameters {c['parameter_bytes']} B, activations "
             f"{c['activation_bytes']} B, attention {c['attention']}",
             f"  micro-batch {c['micro_batch_size']} x {c['max_length']:,} tokens ({c['max_length_source']}), "
             f"{c['max_anchors_per_seq']} anchors x block {c['block_size']} ({c['num_drafts']} drafts), vocabulary "
             f"{c['draft_vocab']:,}, {c['draft_layers']} draft layers, loss chunks of {c['loss_chunk_rows']} rows",
             f"  parameters: drafter {report['parameters']['drafter']:,}, target {report['parameters']['target']:,}",
             "",
             f"  {'memory per rank':<28} {'MiB':>12}  what"]
    for name, comp in mem["components"].items():
        lines.append(f"  {name:<28} {comp['mb']:>12,.1f}  {comp['what']}")
    lines += [f"  {'step peak':<28} {mem['step_peak_mb']:>12,.1f}",
              f"  {'optimizer-step peak':<28} {mem['optimizer_peak_mb']:>12,.1f}",
              *([f"  {'online-features peak':<28} {mem['phase_peaks_mb']['features']:>12,.1f}"]
                if "features" in mem["phase_peaks_mb"] else []),
              f"  {'total (the largest)':<28} {mem['total_mb']:>12,.1f}  = {mem['total_mb'] / 1024:,.2f} GiB "
              f"({mem['peak_phase']} phase)",
              "",
              f"  micro-batch: {mbatch['context_tokens']:,} context tokens, {mbatch['blocks']:,} blocks, "
              f"{mbatch['block_slots']:,} slots, {mbatch['supervised_positions']:,} supervised positions at most",
              f"  optimizer step: {step['sequences']} sequences ({step['micro_batches_per_rank']} micro-batches x "
              f"{step['ranks']} ranks), {step['context_tokens']:,} tokens, {step['supervised_positions']:,} positions",
              f"  FLOPs: {format_flops(report['flops']['micro_batch']['total'])} per micro-batch "
              f"(forward {format_flops(report['flops']['micro_batch']['forward_total'])}), "
              f"{format_flops(report['flops']['optimizer_step_total'])} per optimizer step"]
    data = report["data"]
    if data.get("source"):
        cache = data["cache"]
        # No full step: training would refuse the split; say what to change.
        short = ("" if data["steps_per_epoch"] else " (fewer train samples than trainer."
                 f"global_batch_size={c['global_batch_size']}: lower it, or cache more samples)")
        lines.append(f"  data ({data['source']}): {data['samples']:,} samples, {data['train_samples']:,} train, "
                     f"{data['steps_per_epoch']:,} steps per epoch{short}; cache "
                     f"{cache['total_bytes'] / GB:,.2f} GiB "
                     f"({cache['bytes_per_token']:,} B/token{'' if cache['written'] else ', not written online'})")
    else:
        lines.append(f"  data: {data['note']}")
    fit = report.get("fit")
    if fit:
        sizes = ", ".join(f"{m}: {total / 1024:,.1f} GiB" for m, total in fit["total_mb_by_micro_batch"].items())
        verdict = "fits" if fit["fits"] else "does NOT fit"
        lines.append(f"  fit: {verdict} in {fit['usable_gb']:,.1f} of {fit['device_memory_gb']:g} GiB "
                     f"({fit['usable_fraction']:.0%}); largest micro-batch that fits: {fit['largest_micro_batch']} "
                     f"(per micro-batch size: {sizes})")
    return "\n".join(lines)

