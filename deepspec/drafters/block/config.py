"""HF config base of the block drafters (DFlash, DSpark): block size, mask token, block convention,
target-layer initialisation.

Block convention (`block_convention` in config.json). A block is [anchor, mask x (g-1)] at
positions a..a+g-1; draft k (0-based) always predicts x[a + k + 1]. The convention says which slot holds it:
- "anchor-predicts" (the DSpark paper's reference code): draft k is slot k; g drafts per block;
- "mask-predicts" (the DFlash engines: dflash, SpecForge, SGLang, vLLM): slot 0 (the anchor) predicts
  nothing, draft k is slot k + 1 (the mask at position a + k + 1 predicts its own position's token);
  g - 1 drafts per block.
`first_draft_slot` / `num_drafts` are the two numbers every stage reads; a kind sets its default
(`default_block_convention`: DFlash mask-predicts, DSpark anchor-predicts).

Reduced draft vocabulary (`draft_vocab_size`, null = the full target vocabulary): the draft head is the
frozen target head's rows of the kept ids (no parameters), DSpark's W2 / W1 live in that space (W1 has one
more row for every previous token outside it); built from the training split (draft_vocab.py).

Training attention (`training_attention`): how the packed blocks attend (attention.py). "segmented" (exact,
keys gathered per chunk of blocks: O(N x context), the CPU default), "flex" (flex attention with a BlockMask,
the CUDA default), "dense" (the [N, T + N] boolean mask, the reference); "auto" picks by device.

Anchor fusion (`anchor_fusion`): "none" (the paper: slot inputs are the token embeddings) or
"latest_context" (EAGLE-style): every slot's input is `W_in [norm(emb(token)); H_ctx(a - 1)]`, the block's
token fused with the fused target context of the position just before the anchor (the last accepted one),
`W_in` started at [I, I]. Without it a trained backbone was measured to ignore both (docs/results.md: randomising the
anchor or shifting the context by one position left slot-0 agreement unchanged); the anchor reached the output
only through DSpark's Markov bias. No serving engine reads it: engine exports refuse it.

Final norm start (`final_norm_init`): null keeps the family's initialisation (or the target's final norm with
`init_from_target`); a number c sets every channel's scale of the backbone's final norm to c before training. With
c = 0 the backbone's contribution to the draft logits (and to the confidence head's hidden input) starts at zero
and grows as the norm learns, so DSpark's Markov head alone decides the first drafts: a bigram-started head then
starts at the bigram table's agreement instead of being swamped by a random backbone's logits. It is a start,
not an architecture: the weights stay the family's own, so every export layout reads them unchanged.

Output adapter (`output_adapter`): "none" (the paper) or "zero": a bias-free H x H linear map after the final norm,
started at zero. The backbone's contribution to the draft logits (and to the confidence head's hidden input) starts
at zero, so a bigram-started DSpark's first drafts are its Markov head's alone (the bigram floor), and it grows from
the first step: the map's gradient is the outer product of the logits' error (through the frozen head) and the
normed hidden, a linear probe's, while a zero final-norm scale gets only that product's diagonal, of no consistent
sign, and leaves the backbone unused for hundreds of steps (docs/results.md). It is an architecture: no serving
engine reads it, and engine exports refuse it like the anchor fusion (`engine_unread_extensions`).

Mask token rule (`choose_mask_token_id`): the highest-id special token of the tokenizer's added
vocabulary that is neither bos/eos/pad/unk nor produced by the chat template; if there is none, the
last row of the target vocabulary. For SmolLM2 this is id 16 (`<empty_output>`). The chosen id is
recorded in `config.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from deepspec.drafters.base import DrafterConfig
from deepspec.drafters.block.attention import TRAINING_ATTENTION
from deepspec.drafters.params import DrafterParams, LossParams
from deepspec.drafters.spec import ANCHOR_PREDICTS, MASK_PREDICTS
from deepspec.losses.position_weights import DEFAULT_POSITION_GAMMA

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 4, 16
# convention -> the slot holding draft 0 (slots before it are inputs only)
FIRST_DRAFT_SLOT = {ANCHOR_PREDICTS: 0, MASK_PREDICTS: 1}
BLOCK_CONVENTIONS = tuple(FIRST_DRAFT_SLOT)
ANCHOR_FUSIONS = ("none", "latest_context")
OUTPUT_ADAPTERS = ("none", "zero")
# Block-drafter extensions no serving engine's class reads; "none" is the paper's architecture for each.
ENGINE_UNREAD_EXTENSIONS = ("anchor_fusion", "output_adapter")


class BlockDrafterConfig(DrafterConfig):
    """Block drafter config. `block_size` g: anchor + (g-1) mask slots; `num_drafts` predictions per block."""

    model_type = "deepspec_block"
    drafter_kind = "block"
    default_block_convention = ANCHOR_PREDICTS  # a kind's default when config.json does not name one

    def __init__(self, block_size: int = 7, num_draft_layers: int = 5, mask_token_id: int | None = None,
                 init_from_target_layers: list[int] | None = None, block_convention: str | None = None,
                 draft_vocab_size: int | None = None, training_attention: str = "auto",
                 anchor_fusion: str = "none", final_norm_init: float | None = None,
                 output_adapter: str = "none", **kwargs):
        self.block_size = int(block_size)
        self.output_adapter = output_adapter
        self.anchor_fusion = anchor_fusion
        self.final_norm_init = None if final_norm_init is None else float(final_norm_init)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.training_attention = training_attention
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        # Target layers copied into the draft layers when init_from_target (default: the last
        # num_draft_layers target layers, see `default_init_layers`).
        self.init_from_target_layers = (None if init_from_target_layers is None
                                        else [int(i) for i in init_from_target_layers])
        self.block_convention = self.default_block_convention if block_convention is None else block_convention
        super().__init__(num_draft_layers=num_draft_layers, **kwargs)
        self.validate_architecture()

    @property
    def first_draft_slot(self) -> int:
        """The block slot holding draft 0 (0: anchor-predicts, 1: mask-predicts)."""
        return FIRST_DRAFT_SLOT[self.block_convention]

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: g (anchor-predicts) or g - 1 (mask-predicts)."""
        return self.block_size - self.first_draft_slot

    def validate_architecture(self) -> None:
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size={self.block_size} must lie in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers={self.num_draft_layers} must be >= 1")
        if self.block_convention not in BLOCK_CONVENTIONS:
            raise ValueError(f"block_convention={self.block_convention!r} must be one of {BLOCK_CONVENTIONS}")
        if self.anchor_fusion not in ANCHOR_FUSIONS:
            raise ValueError(f"anchor_fusion={self.anchor_fusion!r} must be one of {ANCHOR_FUSIONS}")
        if self.output_adapter not in OUTPUT_ADAPTERS:
            raise ValueError(f"output_adapter={self.output_adapter!r} must be one of {OUTPUT_ADAPTERS}")
        if self.training_attention not in TRAINING_ATTENTION:
            raise ValueError(f"training_attention={self.training_attention!r} must be one of {TRAINING_ATTENTION}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be >= 1 (or null for the full vocabulary)")
        norm = self.final_norm_init
        if norm is not None and not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"final_norm_init={self.final_norm_init} must be finite and >= 0 "
                             "(or null for the default)")
        self.validate_heads()
        if self.target_config:
            vocab = self.target_vocab_size
            if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
                raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocabulary [0, {vocab})")
            if self.draft_vocab_size is not None and self.draft_vocab_size > vocab:
                raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, {vocab}] "
                                 f"(or null for the full vocabulary)")
            if self.init_from_target_layers is not None:
                layers = self.init_from_target_layers
                if len(layers) != self.num_draft_layers or any(not 0 <= i < self.target_num_layers for i in layers):
                    raise ValueError(f"init_from_target_layers={layers} must name {self.num_draft_layers} "
                                     f"target layers in [0, {self.target_num_layers})")

    def validate_heads(self) -> None:
        """Checks of the fields a subclass adds on top of the block backbone (none here)."""

    def default_init_layers(self) -> list[int]:
        """Target layers copied into draft layers by `init_from_target`: the last num_draft_layers."""
        if self.init_from_target_layers is not None:
            return list(self.init_from_target_layers)
        first = max(self.target_num_layers - self.num_draft_layers, 0)
        return [min(first + i, self.target_num_layers - 1) for i in range(self.num_draft_layers)]

    def complete_from_target(self, target) -> None:
        """Fill target-derived defaults (the mask token) from a `LoadedTarget`."""
        if self.mask_token_id is None:
            self.mask_token_id = choose_mask_token_id(target.tokenizer, self.target_vocab_size)
        self.validate_architecture()


@dataclass
class BlockParams(DrafterParams):
    """`drafter:` fields every block drafter has (conf/drafter/<kind>.yaml may override any of them)."""

    num_draft_layers: int = 5
    block_size: int = 7  # anchor + (g-1) mask slots (4..16)
    # anchor-predicts: g drafts per block (slot j predicts x[a+j+1]); mask-predicts: g-1 (slot 0 predicts
    # nothing, slot j predicts x[a+j]). Each kind's params set its default (block/config.py docstring).
    block_convention: str = BlockDrafterConfig.default_block_convention
    mask_token_id: Optional[int] = None  # null: the tokenizer rule in block/config.py
    init_from_target_layers: Optional[List[int]] = None  # null: the last num_draft_layers target layers
    draft_vocab_size: Optional[int] = None  # null: the full target vocabulary; else the most frequent tokens
    training_attention: str = "auto"  # auto | segmented | flex | dense (how packed blocks attend in training)
    anchor_fusion: str = "none"  # none (the paper) | latest_context (slot inputs fused with H_ctx(a-1); config.py)
    # The final norm's scale at the start (config.py): null = the family's default, or the target's norm with
    # init_from_target; 0 = the backbone's logits start at zero (a bigram-started DSpark starts at its floor).
    final_norm_init: Optional[float] = None
    # none (the paper) | zero: an H x H map after the final norm, started at zero (config.py; engines do not read it)
    output_adapter: str = "none"


@dataclass
class BlockLoss(LossParams):
    """Position-weighted block losses: w_k = exp(-(k-1)/gamma), L = sum_valid w_k term / num_blocks."""

    ce_weight: float = 1.0
    tv_weight: float = 0.0
    conf_weight: float = 0.0
    gamma: float = DEFAULT_POSITION_GAMMA  # DeepSpec's reference code; the paper writes gamma = block size

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_weights(ce_weight=self.ce_weight, tv_weight=self.tv_weight, conf_weight=self.conf_weight)
        if self.gamma <= 0:
            raise ValueError(f"loss.gamma={self.gamma} must be > 0")


def engine_unread_extensions(config) -> dict[str, str]:
    """The extensions a drafter's config (an HF config, or its config.json as a dict) turns on that no serving
    engine reads: {field: value}, empty for the paper's architecture."""
    def get(key):
        return config.get(key, "none") if isinstance(config, dict) else getattr(config, key, "none")

    return {key: get(key) for key in ENGINE_UNREAD_EXTENSIONS if get(key) != "none"}


def choose_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The mask token rule in the module docstring."""
    reserved = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            tokenizer.unk_token_id) if i is not None}
    used_by_template: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "a"}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=True)
        if isinstance(rendered, dict) or hasattr(rendered, "keys"):
            rendered = rendered["input_ids"]
        used_by_template = {int(i) for i in rendered}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [int(i) for i, tok in added.items()
                  if getattr(tok, "special", False) and int(i) < vocab_size
                  and int(i) not in reserved and int(i) not in used_by_template]
    return max(candidates) if candidates else vocab_size - 1
