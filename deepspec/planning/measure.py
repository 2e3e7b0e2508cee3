"""`deepspec plan --measure`: a few training steps of the planned configuration on this machine, measured.

The run is the trainer's own code path from a batch on: the drafter built by `build_drafter` from the run's
config, the kind's batcher (`TrainingData`), `TrainingModule` (drafter forward + objective, the run's autocast)
under the DeepSpeed engine `build_engine` makes for this machine (one process), `engine.backward`, `engine.step`.
What stands in for the real thing:
- the target is a random-weight model of the planned target's exact config (widths, vocabulary, depth:
  `make_standin_target`) whose decoder layers stay on the meta device: training from cached features reads its
  embedding and LM head only, which are materialised (the trainer itself loads the whole target; the plan's
  "target decoder layers" row is what that adds, not measured here);
- the features come from `SyntheticCache`: samples of exactly the planned length, every token an assistant token
  (so each sequence gets min(anchors, length - 1) blocks), features / final hidden states random in the cache's
  storage dtype and read back as float32, as `CacheReader` returns them;
- the optimizer sees 2 micro-batches per step when the planned run accumulates gradients (the memory of
  accumulating 2 or 64 micro-batches is the same: the gradients persist across forwards), else 1;
- the drafter's data-dependent start runs on the synthetic samples (its values do not change memory), and
  `drafter.init_from_target` is off (the target's layers are not materialised).
Memory is `TensorMemory`'s peak of live tensor bytes (with its split by kind) and `RssWatcher`'s peak RSS over the
steps; the parameter, gradient, optimizer-state, frozen-target and batch bytes are counted exactly from the objects.

Shape legend: T = tokens of a sample, F = feature layers x hidden, H = hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import torch

from deepspec.cache.format import feature_torch_dtype, final_hidden_torch_dtype
from deepspec.cache.reader import CachedSample, SampleIndex
from deepspec.planning.tracking import GRADIENTS, RssWatcher, SavedActivations, TensorMemory, tensor_bytes

log = logging.getLogger(__name__)


class SyntheticCache(SampleIndex):
    """An in-memory stand-in for a feature cache: `num_train` + `num_val` samples of `length` tokens, every token an
    assistant token, random ids / features / final hidden states (stored dtype, read back as float32), and an upper
    bound of the target's log-normaliser (`lse_bound`: its true value needs the whole [T, V] logits)."""

    def __init__(self, *, num_train: int, num_val: int, length: int, hidden_size: int, num_feature_layers: int,
                 vocab_size: int, storage_dtype: str, lse_bound: float, seed: int = 0):
        self.samples = ([{"length": length, "split": "train"}] * num_train
                        + [{"length": length, "split": "validation"}] * num_val)
        self.length, self.hidden_size, self.num_feature_layers = length, hidden_size, num_feature_layers
        self.vocab_size, self.storage_dtype, self.lse_bound, self.seed = vocab_size, storage_dtype, lse_bound, seed

    def _generator(self, i: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + i)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids_T = torch.randint(0, self.vocab_size, (self.length,), generator=self._generator(i))
        return ids_T, torch.ones(self.length, dtype=torch.bool)

    def __getitem__(self, i: int) -> CachedSample:
        ids_T, mask_T = self.tokens(i)
        generator = self._generator(i)
        width = self.hidden_size * self.num_feature_layers
        features_TF = torch.randn(self.length, width, generator=generator).to(feature_torch_dtype(self.storage_dtype))
        hidden_TH = torch.randn(self.length, self.hidden_size, generator=generator)
        hidden_TH = hidden_TH.to(final_hidden_torch_dtype(self.storage_dtype))
        return CachedSample(sample_id=f"synthetic-{i}", input_ids=ids_T, loss_mask=mask_T, features=features_TF.float(),
                            final_hidden=hidden_TH.float(), target_lse=torch.full((self.length,), self.lse_bound))


# submodules of a block drafter that open a saved-activation region (tracking.SavedActivations); the drafter's own
# code (the fusion's use, the context keys computed with each layer's projections) is "context"
SAVED_REGIONS = {"backbone": "draft_layers", "backbone.fusion": "context", "sequential": "heads",
                 "confidence": "heads"}


def _flop_counter():
    """torch's FLOP counter, told about the CPU flash attention kernels (it knows the CUDA ones only)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):  # shapes (the counter passes them)
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    return flop_counter.FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})


def zero_master_partitions(optimizer) -> list[torch.Tensor]:
    """The fp32 master partitions a DeepSpeed ZeRO optimizer keeps (stage 1/2 and stage 3 names); none without ZeRO."""
    groups = getattr(optimizer, "single_partition_of_fp32_groups", None) or getattr(
        optimizer, "fp32_partitioned_groups_flat", None) or []
    return [t for t in groups if isinstance(t, torch.Tensor)]


def zero_gradient_buffers(optimizer) -> list[torch.Tensor]:
    """The gradient partition a DeepSpeed ZeRO-2 optimizer accumulates into (absent without ZeRO)."""
    buffer = getattr(optimizer, "grads_in_partition", None)
    return [buffer] if isinstance(buffer, torch.Tensor) else []


def head_lse_bound(head_VH: torch.Tensor, hidden_norm: float) -> float:
    """An upper bound of log sum_v exp(h . w_v) for |h| <= hidden_norm: log V + hidden_norm max_v |w_v|."""
    return math.log(head_VH.shape[0]) + hidden_norm * float(head_VH.float().norm(dim=1).max())


@dataclasses.dataclass
class MeasuredRun:
    """What `measure_training` saw (bytes; CPU seconds of this process per micro-batch)."""

    peak_tensor_bytes: int
    peak_by_kind: dict
    peak_rss_bytes: int
    baseline_rss_bytes: int  # before the stand-in target and the drafter were built
    exact_bytes: dict  # parameters, gradients, optimizer states, frozen target, batch: counted from the objects
    micro_batch_cpu_s: list
    micro_batches_per_step: int
    steps: int
    batch_counts: dict  # context tokens, blocks/anchors and supervised rows of one micro-batch
    saved_by_region: dict  # bytes autograd saved in the first micro-batch's forward: context, draft layers, heads, loss
    flops: int  # torch's FLOP count of the first micro-batch (forward and backward)
    notes: list


def measure_training(cfg, target_config, *, steps: int, accumulate: bool, placement,
                     layer_ids: tuple[list[int], list[int]], length: int) -> MeasuredRun:
    """Run `steps` optimizer steps of `cfg` (one process) at `placement` (deepspec.training.placement) with a stand-in
    target of `target_config` (module docstring). `layer_ids`: (cached, drafter) layer ids; `length`: tokens per
    sample."""
    import psutil

    notes = []
    baseline_rss = psutil.Process().memory_info().rss
    micro = cfg.trainer.micro_batch_size
    per_step = 2 if accumulate else 1
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, global_batch_size=micro * per_step))
    if cfg.drafter.init_from_target:
        notes.append("drafter.init_from_target ignored: the stand-in target's layers are not materialised")
        cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, init_from_target=False))
    target, data, drafter = _standin_run(cfg, target_config, placement.device, layer_ids, length,
                                         num_train=micro * per_step * steps)
    engine = _measured_engine(cfg, drafter, placement, per_step, steps)
    frozen = [t for t in target.model.parameters() if t.device.type != "meta"]
    tracker = TensorMemory()
    tracker.track("frozen_target", frozen)
    tracker.track("drafter_parameters", [*drafter.parameters(), *drafter.buffers()])
    masters = zero_master_partitions(engine.optimizer)
    tracker.track("optimizer", masters)  # ZeRO's fp32 copies exist from the engine's start
    tracker.watch_gradients(drafter.parameters())
    engine.train()
    order = data.epoch_order(0)
    with RssWatcher() as rss:
        steps_seen = _measured_steps(engine, data, order, drafter, tracker, frozen, placement, steps, per_step)
    tracker.remove_hooks()
    exact = _exact_bytes(engine, drafter, masters, frozen, steps_seen["batch_bytes"])
    engine.destroy()
    return MeasuredRun(peak_tensor_bytes=tracker.peak_bytes, peak_by_kind=tracker.peak_by_kind,
                       peak_rss_bytes=rss.peak_bytes, baseline_rss_bytes=baseline_rss, exact_bytes=exact,
                       micro_batch_cpu_s=steps_seen["cpu_s"], micro_batches_per_step=per_step, steps=steps,
                       batch_counts=steps_seen["counts"], saved_by_region=steps_seen["saved"],
                       flops=steps_seen["flops"], notes=notes)


def _standin_run(cfg, target_config, device: torch.device, layer_ids: tuple[list[int], list[int]], length: int,
                 num_train: int):
    """(stand-in target, data over a `SyntheticCache`, drafter with its data-dependent start) of the measured run."""
    from deepspec.drafters.build import build_drafter
    from deepspec.planning.plan import target_dtype
    from deepspec.targets.synthetic import make_standin_target
    from deepspec.training.config import drafter_overrides
    from deepspec.training.data import TrainingData
    from deepspec.training.session import prepare_for_training

    cache_layer_ids, drafter_layer_ids = layer_ids
    t = cfg.trainer
    target = make_standin_target(target_config, name=f"random-{target_config.model_type}", device=device,
                                 dtype=target_dtype(cfg.target, device), seed=t.seed, materialised_layers=0)
    head_VH = target.model.get_output_embeddings().weight
    reader = SyntheticCache(num_train=num_train, num_val=1, length=length,
                            hidden_size=int(target_config.hidden_size), num_feature_layers=len(cache_layer_ids),
                            vocab_size=int(target_config.vocab_size), storage_dtype=cfg.data.cache.storage_dtype,
                            lse_bound=head_lse_bound(head_VH, 6.0 * math.sqrt(int(target_config.hidden_size))),
                            seed=t.seed)
    data = TrainingData(cfg.data, reader, cache_layer_ids, drafter_layer_ids, seed=t.seed,
                        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                        val_max_samples=t.val_max_samples)
    torch.manual_seed(t.seed)
    drafter = build_drafter(cfg.drafter.kind, target, **drafter_overrides(cfg, drafter_layer_ids)).to(device)
    prepare_for_training(drafter, reader, data.train_ids, target.tokenizer)
    data.attach_drafter(drafter.config, target.tokenizer.pad_token_id)
    return target, data, drafter


def _measured_engine(cfg, drafter, placement, per_step: int, steps: int):
    """The trainer's engine for one process: `TrainingModule` (the run's autocast) under `build_engine`."""
    from deepspec.training.engine import build_engine
    from deepspec.training.session import TrainingModule
    from deepspec.utils.dist import Launch, init_distributed

    module = TrainingModule(drafter, cfg.loss, placement.autocast_dtype)
    init_distributed(Launch(), placement.device)
    return build_engine(module, cfg.deepspeed, cfg.optim, placement, micro_batch_size=cfg.trainer.micro_batch_size,
                        grad_accum_steps=per_step, total_steps=steps)


def _measured_steps(engine, data, order: list[int], drafter, tracker: TensorMemory, frozen: list, placement,
                    steps: int, per_step: int) -> dict:
    """Run the steps of epoch 0's `order` under `tracker`: each micro-batch's CPU seconds and counts, and the first
    one's saved activations by region and FLOPs."""
    cpu_s, counts, saved, flops, batch_bytes = [], {}, {}, 0, 0
    for step in range(steps):
        for micro_step in range(per_step):
            start = time.process_time()
            batch = data.collate(data.micro_batch_ids(order, step, micro_step, 0, 1), 0).to(placement.device,
                                                                                              placement.dtype)
            batch_tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
            tracker.track("batch", batch_tensors)
            first = step == 0 and micro_step == 0
            regions = SavedActivations(drafter, SAVED_REGIONS, root="context", outside="loss",
                                       exclude=[*drafter.parameters(), *frozen, *batch_tensors])
            counter = _flop_counter() if first else contextlib.nullcontext()
            with counter:
                with tracker.kind("forward"), regions if first else contextlib.nullcontext():
                    loss, _ = engine(batch)
                with tracker.kind("backward"):
                    engine.backward(loss)
                for buffer in zero_gradient_buffers(engine.optimizer):
                    tracker.relabel(buffer, GRADIENTS)
            if first:
                saved, flops = dict(regions.bytes), counter.get_total_flops()
            with tracker.kind("optimizer"):
                engine.step()
            cpu_s.append(time.process_time() - start)
            batch_bytes = tensor_bytes(batch_tensors)
            counts = {"context_tokens": int(batch.stats["num_context_tokens"]),
                      "blocks": int(batch.stats["num_blocks"]), "rows": int(batch.labels_N.numel())}
            del batch, batch_tensors, loss
            log.info("measured micro-batch %d of step %d: %.1f CPU-s", micro_step + 1, step + 1, cpu_s[-1])
    return {"cpu_s": cpu_s, "counts": counts, "saved": saved, "flops": flops, "batch_bytes": batch_bytes}


def _exact_bytes(engine, drafter, masters: list, frozen: list, batch_bytes: int) -> dict:
    """The bytes counted from the objects: parameters, buffers, gradients, optimizer states, frozen target, batch."""
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps a torch optimizer
    states = [*masters, *(t for state in optimizer.state.values() for t in state.values()
                          if isinstance(t, torch.Tensor))]
    return {"drafter_parameters": tensor_bytes(drafter.parameters()),
            "drafter_buffers": tensor_bytes(drafter.buffers()),
            "gradients": sum(p.numel() * p.element_size() for p in trainable),  # one per trainable parameter
            "optimizer_states": tensor_bytes(states),
            "frozen_target": tensor_bytes(frozen), "batch": batch_bytes}
