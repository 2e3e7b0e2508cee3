"""HF configs of the block drafters: DSpark (backbone + sequential head + confidence head) and DFlash.

DFlash is DSpark with the sequential stage and the confidence head switched off; `DFlashConfig`
fixes those fields so a DFlash checkpoint never carries DSpark-only fields with a non-default
meaning. Loss weights are not drafter fields: they live in `deepspec.training.objective.LossConfig`.

Mask token rule (`choose_mask_token_id`): the highest-id special token of the tokenizer's added
vocabulary that is neither bos/eos/pad/unk nor produced by the chat template; if there is none, the
last row of the target vocabulary. For SmolLM2 this is id 16 (`<empty_output>`). The chosen id is
recorded in `config.json`.
"""

from __future__ import annotations

from deepspec.drafters.base import DrafterConfig

SEQUENTIAL_HEADS = ("markov", "rnn", "none")
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 4, 16


class DSparkConfig(DrafterConfig):
    """Block drafter config. `block_size` g: anchor + (g-1) mask slots, g predictions per block."""

    model_type = "deepspec_dspark"
    drafter_kind = "dspark"

    def __init__(self, block_size: int = 7, num_draft_layers: int = 5, mask_token_id: int | None = None,
                 sequential_head: str = "markov", markov_rank: int = 256, confidence_head: bool = True,
                 calibration_temperatures: list[float] | None = None, init_from_target_layers: list[int] | None = None,
                 **kwargs):
        self.block_size = int(block_size)
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.sequential_head = sequential_head
        self.markov_rank = int(markov_rank)
        self.confidence_head = bool(confidence_head)
        self.calibration_temperatures = None if calibration_temperatures is None else [float(t) for t in calibration_temperatures]
        # Target layers copied into the draft layers when init_from_target (default: the last
        # num_draft_layers target layers, see `default_init_layers`).
        self.init_from_target_layers = None if init_from_target_layers is None else [int(i) for i in init_from_target_layers]
        super().__init__(num_draft_layers=num_draft_layers, **kwargs)
        self.validate_architecture()

    def validate_architecture(self) -> None:
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size={self.block_size} must lie in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers={self.num_draft_layers} must be >= 1")
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(f"sequential_head={self.sequential_head!r} must be one of {SEQUENTIAL_HEADS}")
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank} must be >= 1")
        temps = self.calibration_temperatures
        if temps is not None and (len(temps) != self.block_size or any(t <= 0 for t in temps)):
            raise ValueError(f"calibration_temperatures must hold {self.block_size} positive values, got {temps}")
        if self.target_config:
            vocab = self.target_vocab_size
            if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab:
                raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target vocabulary [0, {vocab})")
            if self.init_from_target_layers is not None:
                layers = self.init_from_target_layers
                if len(layers) != self.num_draft_layers or any(not 0 <= i < self.target_num_layers for i in layers):
                    raise ValueError(f"init_from_target_layers={layers} must name {self.num_draft_layers} target layers "
                                     f"in [0, {self.target_num_layers})")

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


class DFlashConfig(DSparkConfig):
    """DFlash: the DSpark backbone alone (no sequential stage, no confidence head)."""

    model_type = "deepspec_dflash"
    drafter_kind = "dflash"

    def __init__(self, sequential_head: str = "none", confidence_head: bool = False,
                 calibration_temperatures: list[float] | None = None, **kwargs):
        if sequential_head != "none":
            raise ValueError(f"DFlash has no sequential head: sequential_head must be 'none', got {sequential_head!r}")
        if confidence_head:
            raise ValueError("DFlash has no confidence head: confidence_head must be False")
        if calibration_temperatures is not None:
            raise ValueError("DFlash has no confidence head to calibrate: calibration_temperatures must be None")
        super().__init__(sequential_head="none", confidence_head=False, calibration_temperatures=None, **kwargs)


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
