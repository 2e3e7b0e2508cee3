"""A frozen target too large for one device: its weights partitioned across the ranks with DeepSpeed ZeRO-3.

Why ZeRO-3 and not tensor parallelism (transformers' `tp_plan`, DeepSpeed's AutoTP): online features are data
parallel, each rank runs the target on its own micro-batches, and ZeRO-3 keeps that. Each rank holds 1/world of every
weight; just before a module runs, its weights are all-gathered, and freed after it. The arithmetic on a rank is then
the unsharded target's on gathered copies of the same weights, so the features are the unsharded target's (bit for
bit on the same kernels). Tensor parallelism would run every rank on the same batch and add partial sums in another
order: features within rounding only, and ranks no longer computing their own micro-batches.

What it costs and asks: every forward all-gathers each weight once (the target's bytes, per forward, per rank), and
the gathers are collective, so every rank must run the same forwards in the same order. Callers keep the ranks in
lockstep (`any_rank`): a rank with nothing to compute while another computes runs its batch anyway (or a one-token
dummy) and discards the result. Weights used outside a module's forward (the LM head in the target's log-normaliser)
are gathered explicitly (`gathered`).

Loading: `zero3_loading(world_size)` is kept alive while a hub/local checkpoint loads, so transformers builds the model
under `deepspeed.zero.Init` and each rank only ever holds its partition of the weights (`HfDeepSpeedConfig`); a
target built in memory (tiny test targets) is partitioned when `partition_target` wraps it.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

ZERO3 = "zero3"


def zero3_config(dtype: torch.dtype) -> dict:
    """DeepSpeed's config for a frozen model: stage 3 parameter partitioning, no optimizer, nothing kept whole."""
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True}
    return config


def zero3_loading(dtype: torch.dtype):
    """A context under which `from_pretrained` loads straight into ZeRO-3 partitions (transformers reads a live
    `HfDeepSpeedConfig`)."""
    from transformers.integrations import HfDeepSpeedConfig

    @contextlib.contextmanager
    def loading():
        keep_alive = HfDeepSpeedConfig(zero3_config(dtype))  # transformers holds only a weak reference to it
        try:
            yield keep_alive
        finally:
            del keep_alive

    return loading()


def partition_target(target, dtype: torch.dtype):
    """`target` (a `LoadedTarget`) with its model's weights partitioned across the process group (ZeRO-3
    inference: `deepspeed.initialize` without an optimizer); the same object, `target.sharding == "zero3"`.

    A drafter reads the target's input embedding and LM head inside its own forward and backward, where no
    gather can hold them: `target.frozen_copies` keeps whole copies of both (`FrozenTargetParts` takes them), the
    only weights a rank holds whole."""
    import deepspeed

    target.model.requires_grad_(False)
    deepspeed.initialize(model=target.model, config=zero3_config(dtype))
    target.model.eval()
    target.sharding = ZERO3
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight
    embed_copy = whole_copy(embed)
    tied = any(head is p for p in embed.parameters())
    with gathered([head], partitioned=not tied):
        head_copy = embed_copy.weight if tied else head.detach().clone()
    target.frozen_copies = {"input_embeddings": embed_copy, "lm_head_weight": head_copy}
    local = sum(p.ds_tensor.numel() for p in target.model.parameters() if hasattr(p, "ds_tensor"))
    full = sum(p.ds_numel for p in target.model.parameters() if hasattr(p, "ds_numel"))
    log.info("target %s partitioned with ZeRO-3: this rank holds %d of %d weights", target.name, local, full)
    return target


def whole_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen module of the same class holding whole copies of `module`'s own weights and buffers, outside ZeRO-3
    (no hooks, no partition attributes): for leaf modules such as an embedding (a collective gather)."""
    copy = type(module).__new__(type(module))
    torch.nn.Module.__init__(copy)
    for key, value in vars(module).items():  # the module's settings (sizes, padding index, scale), not ZeRO's state
        if not key.startswith(("_", "ds_")) and isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
            setattr(copy, key, value)
    params = dict(module.named_parameters(recurse=False))
    with gathered(list(params.values()), partitioned=True):
        for name, param in params.items():
            copy.register_parameter(name, torch.nn.Parameter(param.detach().clone(), requires_grad=False))
    for name, buffer in module.named_buffers(recurse=False):
        copy.register_buffer(name, buffer.detach().clone(), persistent=name not in module._non_persistent_buffers_set)
    return copy.eval()


def is_partitioned(target) -> bool:
    return getattr(target, "sharding", "none") == ZERO3


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter], partitioned: bool):
    """`params` whole for the block (a collective gather under ZeRO-3; nothing otherwise)."""
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def max_over_ranks(value: int, collective: bool, device: torch.device | str = "cpu") -> int:
    """The largest `value` of the process group's ranks (an all-reduce on `device`, the backend's); `value` itself
    when not `collective`."""
    if not collective:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool, collective: bool, device: torch.device | str = "cpu") -> bool:
    """`flag` of any rank (see `max_over_ranks`)."""
    return bool(max_over_ranks(int(flag), collective, device))
