"""The standalone drafter's configs: the HF config saved with a checkpoint, the `drafter:` params, the `loss:` section.

Two ways to get the draft language model (`StandaloneConfig.lm_config` records the one chosen, so a saved
drafter rebuilds without its source):
- wrap a causal LM that shares the target's tokenizer (`base_model`: a hub id, a folder, a .gguf file or an
  embedded target name, loaded like targets are by `deepspec.targets.load`); its own embedding and LM head;
- build one of the target's family: `num_draft_layers` decoder layers at `draft_hidden_size` (default the
  target's width), with the target's embedding and LM head shared frozen (`share_target_embeddings`, held
  outside the module tree like every drafter's; a width other than the target's adds two projections) or
  its own (initialised from the target's when the widths agree).

Loss (position-free: every supervised token is one row): `kl_weight * KL(p_t || p_d) + tv_weight * TV +
ce_weight * CE`, each the mean over the batch's rows; KL is trained as the soft cross entropy (the same
gradient; the target entropy is constant).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Optional

from deepspec.drafters.base import DrafterConfig
from deepspec.drafters.params import DrafterParams, LossParams


class StandaloneConfig(DrafterConfig):
    """A separate causal LM drafting autoregressively with its own KV cache."""

    model_type = "deepspec_standalone"
    drafter_kind = "standalone"

    def __init__(self, base_model: str | None = None, base_model_revision: str | None = None,
                 draft_hidden_size: int | None = None, draft_intermediate_size: int | None = None,
                 draft_num_attention_heads: int | None = None, draft_num_key_value_heads: int | None = None,
                 share_target_embeddings: bool = True, init_from_target_layers: list[int] | None = None,
                 num_speculative_tokens: int = 5, lm_config: dict | None = None,
                 calibration_temperatures: list[float] | None = None, calibration_label_kind: str | None = None,
                 num_draft_layers: int = 2, **kwargs):
        self.base_model = base_model or None
        self.base_model_revision = base_model_revision
        self.draft_hidden_size = None if draft_hidden_size is None else int(draft_hidden_size)
        self.draft_intermediate_size = None if draft_intermediate_size is None else int(draft_intermediate_size)
        self.draft_num_attention_heads = None if draft_num_attention_heads is None else int(draft_num_attention_heads)
        self.draft_num_key_value_heads = None if draft_num_key_value_heads is None else int(draft_num_key_value_heads)
        # A wrapped model always has its own embedding and head (its config says whether they are tied).
        self.share_target_embeddings = bool(share_target_embeddings) and not self.base_model
        self.init_from_target_layers = (None if init_from_target_layers is None
                                        else [int(i) for i in init_from_target_layers])
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.lm_config = None if lm_config is None else dict(lm_config)
        self.calibration_temperatures = (None if calibration_temperatures is None
                                         else [float(t) for t in calibration_temperatures])
        self.calibration_label_kind = calibration_label_kind
        super().__init__(num_draft_layers=num_draft_layers, **kwargs)
        if self.lm_config is None and self.target_config and not self.base_model:
            self.lm_config = built_lm_config(self)
        self.validate_architecture()

    def validate_architecture(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers={self.num_draft_layers} must be >= 1")
        for name in ("draft_hidden_size", "draft_intermediate_size", "draft_num_attention_heads",
                     "draft_num_key_value_heads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if (self.calibration_temperatures is not None
                and len(self.calibration_temperatures) != self.num_speculative_tokens):
            raise ValueError(f"calibration_temperatures has {len(self.calibration_temperatures)} entries for "
                             f"num_speculative_tokens={self.num_speculative_tokens}")
        if self.layer_family is not None:
            raise ValueError(f"layer_family={self.layer_family!r}: a standalone drafter is a causal LM of its own "
                             "(its lm_config), not layers at the target's widths; wrap a base_model of the family "
                             "you want, or set drafter.layer_family=null")
        if self.base_model and self.init_from_target:
            raise ValueError(f"init_from_target=True copies target layers into a built drafter; base_model="
                             f"{self.base_model!r} brings its own weights")
        if self.target_config and self.init_from_target:
            if self.draft_width != self.hidden_size:
                raise ValueError(f"init_from_target=True needs draft_hidden_size == the target's {self.hidden_size}, "
                                 f"got {self.draft_width}")
            layers = self.default_init_layers()
            if len(layers) != self.num_draft_layers or any(not 0 <= i < self.target_num_layers for i in layers):
                raise ValueError(f"init_from_target_layers={layers} must name {self.num_draft_layers} target layers "
                                 f"in [0, {self.target_num_layers})")

    @property
    def draft_width(self) -> int:
        """The draft LM's hidden size."""
        if self.lm_config is not None:
            return int(self.lm_config["hidden_size"])
        return self.draft_hidden_size or self.hidden_size

    @property
    def projects_embeddings(self) -> bool:
        """A shared target embedding/head of another width is reached through two projections."""
        return self.share_target_embeddings and self.draft_width != self.hidden_size

    def default_init_layers(self) -> list[int]:
        """Target layers copied by `init_from_target`: explicit, else spread from the first to the last layer."""
        if self.init_from_target_layers is not None:
            return list(self.init_from_target_layers)
        last, count = self.target_num_layers - 1, self.num_draft_layers
        return [round(i * last / (count - 1)) for i in range(count)] if count > 1 else [last]

    def complete_from_target(self, target) -> None:
        """Wrapping a `base_model`: load its config and tokenizer (no weights yet), refuse a tokenizer other than
        the target's (naming the first differing token) and record the draft LM's config."""
        if not self.base_model or self.lm_config is not None:
            return
        from deepspec.targets.family import text_config
        from deepspec.targets.load import load_target_config, load_tokenizer, resolve_target
        from deepspec.targets.tokenizer_check import check_same_tokenizer

        check_same_tokenizer(target.tokenizer, load_tokenizer(self.base_model, self.base_model_revision),
                             f"drafter.base_model={self.base_model!r}")
        self.base_model_revision = resolve_target(self.base_model, self.base_model_revision)[2]
        self.lm_config = wrapped_lm_config(text_config(load_target_config(self.base_model, self.base_model_revision)))
        self.validate_architecture()


def built_lm_config(config: StandaloneConfig) -> dict:
    """The draft LM's config for a built drafter: the target's text config at the chosen depth and width.

    Head dimension stays the target's; heads follow the width (and the target's query/key-value ratio) unless
    given; the MLP scales with the width unless given; every layer attends fully (no sliding window: the draft
    sees its whole context). With shared embeddings the draft LM's own embedding is a one-row placeholder
    (vocab_size 1): tokens enter as the target's embeddings, logits leave through the target's head.
    """
    target = copy.deepcopy(config.target_config)
    width = config.draft_hidden_size or int(target["hidden_size"])
    target_heads = int(target["num_attention_heads"])
    head_dim = int(target.get("head_dim") or int(target["hidden_size"]) // target_heads)
    heads = config.draft_num_attention_heads or max(width // head_dim, 1)
    kv_ratio = target_heads // int(target.get("num_key_value_heads") or target_heads)
    kv_heads = config.draft_num_key_value_heads or max(heads // max(kv_ratio, 1), 1)
    if heads % kv_heads:
        raise ValueError(f"draft_num_key_value_heads={kv_heads} must divide the {heads} attention heads")
    intermediate = config.draft_intermediate_size or max(round(int(target["intermediate_size"]) * width
                                                               / int(target["hidden_size"])), 1)
    lm = dict(target, hidden_size=width, intermediate_size=intermediate, num_attention_heads=heads,
              num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=config.num_draft_layers)
    if "layer_types" in lm:
        lm["layer_types"] = ["full_attention"] * config.num_draft_layers
    if config.share_target_embeddings:
        lm.update(vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    return lm


def wrapped_lm_config(lm_text_config) -> dict:
    """A wrapped model's config as a plain dict; a sliding attention window is widened to the whole context.

    Within the window the model is unchanged (the mask is the same causal one); past it the draft attends to
    more context than it was trained with, which can only change its proposals, never the output (every token
    is still the target's), and it lets the draft KV cache be cropped like the target's.
    """
    lm = {k: v for k, v in lm_text_config.to_dict().items()
          if k not in ("_name_or_path", "transformers_version", "quantization_config", "dtype", "torch_dtype")}
    if lm.get("sliding_window") and any(t != "full_attention" for t in lm.get("layer_types") or []):
        lm["sliding_window"] = max(int(lm["sliding_window"]), int(lm.get("max_position_embeddings") or 0))
    return lm


@dataclass
class StandaloneParams(DrafterParams):
    kind: str = "standalone"
    target_layer_ids: Optional[List[int]] = field(default_factory=list)  # reads no target features
    num_draft_layers: int = 2  # built drafter: decoder layers of the target's family
    base_model: Optional[str] = None  # wrap this causal LM (hub id, folder, .gguf, embedded name); null: build one
    base_model_revision: Optional[str] = None
    draft_hidden_size: Optional[int] = None  # built drafter width (null: the target's)
    draft_intermediate_size: Optional[int] = None  # null: the target's MLP width scaled with the width
    draft_num_attention_heads: Optional[int] = None  # null: width / the target's head dim
    draft_num_key_value_heads: Optional[int] = None  # null: the target's query/key-value ratio
    share_target_embeddings: bool = True  # built drafter: the target's embedding and LM head, frozen, shared
    init_from_target_layers: Optional[List[int]] = None  # init_from_target: target layers copied (null: spread)
    num_speculative_tokens: int = 5  # drafts per round (and the positions validation/calibration score)


@dataclass
class StandaloneLoss(LossParams):
    kl_weight: float = 1.0  # forward KL(p_t || p_d), trained as the soft cross entropy
    tv_weight: float = 0.0  # total variation ||p_d - p_t||_1 (what sampled acceptance reads)
    ce_weight: float = 0.0  # cross entropy against the cached (target-generated) token

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_weights(kl_weight=self.kl_weight, tv_weight=self.tv_weight, ce_weight=self.ce_weight)
        if self.kl_weight + self.tv_weight + self.ce_weight <= 0:
            raise ValueError("loss.kl_weight + loss.tv_weight + loss.ce_weight must be > 0")
