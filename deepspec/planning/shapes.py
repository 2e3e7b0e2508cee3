"""What a plan computes from: the widths of the target and the drafter, the shape of the largest micro-batch, and
the run's resolved numerics (device, precision, ZeRO stage, dtypes).

Widths come from the configs alone: the target's text config (planning/target.py) and the drafter built on the
meta device from the run's drafter section (`build_meta_drafter`: its HF config and its exact parameter count, no
memory). The micro-batch is the worst case a rank meets: `micro_batch_size` sequences of `max_length` tokens whose
every token is an assistant token, so each gets min(`data.max_anchors_per_seq`, length - 1) blocks; its anchors are
spread evenly over the sequence (the sampled ones are uniform over it) and its attention segments are the ones
`PackedBlocks` builds for them.

Shape legend: T = context tokens, B = blocks, S = block slots (B x G), N = draft rows (B x K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Numerics:
    """How one rank of the run computes (as the trainer resolves it on `device`)."""

    device: str  # cuda | cpu
    world_size: int
    precision: str  # fp32 | bf16 (trainer.precision resolved)
    zero_stage: int  # the stage DeepSpeed runs (0: one fp32 process without ZeRO, engine.zero_stage)
    param_bytes: int  # the drafter's parameters take the target's dtype (build_drafter)
    activation_bytes: int  # autocast bf16 -> 2, else the parameters' dtype
    batch_bytes: int  # the batch's float tensors on the device (the step's dtype)
    attention: str  # segmented | flex | dense (training_attention resolved on the device)
    grad_accum: int
    autocast: bool
    weight_average: bool = False  # trainer.ema_decay > 0: an fp32 average of the drafter's weights


@dataclass(frozen=True)
class Widths:
    """Target and drafter widths a step's memory and FLOPs depend on (V: the drafter's vocabulary)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # the draft vocabulary (the target's when not reduced)
    target_vocab: int
    feature_layers: int  # m: cached target layers the context fuses
    draft_layers: int
    block_size: int
    num_drafts: int
    rank: int  # DSpark's Markov/confidence rank (0: none)
    sequential_head: str  # markov | rnn | none
    confidence_head: bool
    anchor_fusion: bool
    output_adapter: bool  # the H x H map after the final norm (drafters/block/config.py)
    reduced_vocab: bool


@dataclass(frozen=True)
class MicroBatch:
    """The worst-case micro-batch of one rank (module docstring)."""

    sequences: int
    tokens_per_sequence: int
    blocks_per_sequence: int
    block_size: int
    num_drafts: int
    segments: tuple[tuple[int, int], ...]  # (query rows, context keys) of each segmented attention call

    @property
    def context_tokens(self) -> int:  # T
        return self.sequences * self.tokens_per_sequence

    @property
    def blocks(self) -> int:  # B
        return self.sequences * self.blocks_per_sequence

    @property
    def slots(self) -> int:  # S
        return self.blocks * self.block_size

    @property
    def rows(self) -> int:  # N: supervised draft positions at most
        return self.blocks * self.num_drafts

    def anchor_positions(self) -> list[int]:
        """The evenly spread anchors of one sequence."""
        return even_anchors(self.tokens_per_sequence, self.blocks_per_sequence)


def even_anchors(length: int, count: int) -> list[int]:
    """`count` anchors spread evenly over the candidates 0..length-2 (every position when count >= length - 1)."""
    candidates = max(length - 1, 0)
    if count >= candidates:
        return list(range(candidates))
    return [round(i * (candidates - 1) / max(count - 1, 1)) for i in range(count)]


def plan_micro_batch(sequences: int, length: int, max_anchors: int, block_size: int, num_drafts: int) -> MicroBatch:
    """The worst-case micro-batch, with the attention segments `PackedBlocks` cuts for its anchors."""
    from deepspec.drafters.block.attention import PackedBlocks

    anchors = even_anchors(length, max_anchors)
    blocks = len(anchors)
    segments: tuple[tuple[int, int], ...] = ()
    if blocks:
        layout = PackedBlocks(context_seq_id_T=torch.zeros(length, dtype=torch.long),
                              context_pos_T=torch.arange(length), block_seq_id_B=torch.zeros(blocks, dtype=torch.long),
                              anchor_pos_B=torch.tensor(anchors), block_size=block_size)
        one = tuple((s.rows.stop - s.rows.start, s.keys.stop - s.keys.start) for s in layout.segments())
        segments = one * sequences
    return MicroBatch(sequences=sequences, tokens_per_sequence=length, blocks_per_sequence=blocks,
                      block_size=block_size, num_drafts=num_drafts, segments=segments)


def build_meta_drafter(cfg, target_config, layer_ids: list[int]):
    """The run's drafter on the meta device (its config validated, its parameters counted, nothing allocated)."""
    from deepspec.drafters.base import target_config_dict
    from deepspec.drafters.spec import get_drafter_spec
    from deepspec.training.config import drafter_overrides

    spec = get_drafter_spec(cfg.drafter.kind)
    settings = drafter_overrides(cfg, layer_ids)
    settings.setdefault("mask_token_id", None)
    if settings["mask_token_id"] is None:  # the tokenizer's choice changes no shape: any id of the vocabulary
        settings["mask_token_id"] = int(target_config.vocab_size) - 1
    config = spec.config_class(target_config=target_config_dict(target_config), **settings)
    with torch.device("meta"):
        return spec.model_class(config)


def drafter_widths(drafter, target_config) -> Widths:
    """The widths of a (meta-built) block drafter."""
    from deepspec.drafters.base import draft_layer_config

    config = drafter.config
    layer = draft_layer_config(config)
    hidden = int(layer.hidden_size)
    heads = int(layer.num_attention_heads)
    head_dim = int(getattr(layer, "head_dim", None) or hidden // heads)
    sequential = getattr(config, "sequential_head", "none")
    confidence = bool(getattr(config, "confidence_head", False))
    return Widths(hidden=hidden, intermediate=int(layer.intermediate_size), heads=heads,
                  kv_heads=int(getattr(layer, "num_key_value_heads", None) or heads), head_dim=head_dim,
                  vocab=int(config.draft_vocab_size or config.target_vocab_size),
                  target_vocab=int(config.target_vocab_size), feature_layers=len(config.target_layer_ids),
                  draft_layers=int(config.num_draft_layers), block_size=int(config.block_size),
                  num_drafts=int(config.num_drafts),
                  rank=int(getattr(config, "markov_rank", 0)) if sequential != "none" or confidence else 0,
                  sequential_head=sequential, confidence_head=confidence,
                  anchor_fusion=getattr(config, "anchor_fusion", "none") == "latest_context",
                  output_adapter=getattr(config, "output_adapter", "none") != "none",
                  reduced_vocab=config.draft_vocab_size is not None)
