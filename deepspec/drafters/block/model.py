"""The block drafter (paper §3.1-3.2): what DFlash is, and what DSpark extends with its heads.

`BlockDrafter` = `BlockBackbone` (context fusion, family draft layers with context K/V injection,
final norm) + the heads a subclass builds (`build_heads`: DFlash none; DSpark a sequential head and a
confidence head, deepspec/drafters/dspark/). The frozen target embedding/LM head are outside the
module tree (`DrafterModel.attach_target`).

Training: `forward(batch)` runs every packed block of a `BlockBatch` in one pass and keeps the rows of the
draft slots (the block convention, `config.first_draft_slot`: all g slots for anchor-predicts, slots 1..g-1 for
mask-predicts); the heads then run over the drafts only.
Inference: `extend_context` appends accepted tokens' context K/V to a `DraftKVCache`
(`new_decode_state()`); `draft_hidden` runs one parallel forward of [anchor, mask * (g-1)] (all g slots);
`propose` samples the K = `config.num_drafts` drafts left to right through the sequential head (when there is
one) and returns the distributions tokens were actually drawn from.

Reduced draft vocabulary (`config.draft_vocab_size`, d2t/t2d from draft_vocab.py): the draft head is the
frozen target head's rows of the kept ids (a gather, kept while the head and d2t are unchanged; no
parameters), so every draft logit, the sequential bias and sampling live in the draft vocabulary (Vd).
The heads' previous-token input is a row index (`draft_rows`): the draft id of a kept token, Vd for any
token outside the draft vocabulary (W1 has Vd + 1 rows). `propose` maps sampled draft ids to target ids
(`target = draft + d2t[draft]`) and hands verification the distribution the token was drawn from over the
whole target vocabulary: zeros outside the draft vocabulary.

Shape legend: B = batch (blocks at inference), C = new context tokens, F = num_layers * H,
G = block size, K = drafts per block, H = hidden, S = block slots (blocks * G), N = draft rows (blocks * K),
R = rank, V = vocabulary (Vd: draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import DraftSampler
from deepspec.drafters.base import DrafterModel
from deepspec.drafters.block.attention import PackedBlocks, cached_block_mask, resolve_training_attention
from deepspec.drafters.block.backbone import BlockBackbone
from deepspec.drafters.block.batching import BlockBatch
from deepspec.drafters.block.config import BlockDrafterConfig
from deepspec.drafters.draft_vocab import DraftVocabMixin


@dataclass
class BlockOutput:
    hidden_NH: torch.Tensor  # hidden of the draft slots after the final norm (one row per draft)
    bias: tuple[torch.Tensor, torch.Tensor] | None  # (bias_in_NR, bias_out_RV) of the sequential head
    confidence_logits_N: torch.Tensor | None


class BlockDrafter(DraftVocabMixin, DrafterModel):
    config_class = BlockDrafterConfig

    def __init__(self, config: BlockDrafterConfig):
        super().__init__(config)
        config.validate_architecture()
        if config.mask_token_id is None:
            raise ValueError("mask_token_id is not set: build the drafter with build_drafter(kind, target)")
        self.backbone = BlockBackbone(config)
        # Built after the backbone so parameters are created (and initialised) in the same order for every kind.
        self.sequential, self.confidence = self.build_heads(config)
        self.register_draft_vocab(config)
        object.__setattr__(self, "_derived", {})  # tensors derived from the vocabulary (module docstring)
        self.post_init()
        self.backbone.reset_input_fusion()  # after post_init's random init (from_pretrained loads over it)
        self.backbone.reset_output_adapter()

    def build_heads(self, config: BlockDrafterConfig) -> tuple[nn.Module | None, nn.Module | None]:
        """(sequential head, confidence head) on top of the backbone; the plain block drafter has neither."""
        return None, None

    # -- initialisation ----------------------------------------------------------------------
    def initialize_from(self, target) -> None:
        """The target's layers (`init_from_target`), then the final norm's start (`final_norm_init`, config.py)."""
        super().initialize_from(target)
        if self.config.final_norm_init is not None:
            self.backbone.set_final_norm_scale(self.config.final_norm_init)

    @torch.no_grad()
    def init_from_target_model(self, target_model) -> None:
        """Copy target decoder layers (config.default_init_layers()) and the final norm into the drafter.

        The final norm matters most: the drafter shares the frozen LM head, so its output scale must
        match the target's for its logits to be as sharp.
        """
        from deepspec.targets.features import decoder_layers

        target_layers = decoder_layers(target_model)
        for draft_layer, index in zip(self.backbone.layers, self.config.default_init_layers()):
            draft_layer.load_state_dict(target_layers[index].state_dict())
        base = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
        self.backbone.norm.load_state_dict(base.norm.state_dict())

    # -- shared pieces ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self.backbone.fusion.proj.weight.dtype
        return self.target_parts.embed(ids).to(dtype)

    # -- vocabulary ---------------------------------------------------------------------------
    def _derive(self, name: str, key: tuple, make):
        """`make()` once per `key` (the storage and version of what it is derived from), kept out of the module."""
        cached = self._derived.get(name)
        if cached is None or cached[0] != key:
            cached = (key, make())
            self._derived[name] = cached
        return cached[1]

    def draft_head_weight(self) -> torch.Tensor:
        """The draft head: the frozen target head [V, H], or its rows of the draft vocabulary [Vd, H]."""
        head_VH = self.target_parts.lm_head_weight
        if not self.reduced_vocab:
            return head_VH
        key = (head_VH.data_ptr(), head_VH._version, head_VH.device, self.d2t.data_ptr(), self.d2t._version)
        return self._derive("head", key, lambda: head_VH.detach().index_select(0, self.target_vocab_index()))

    def draft_rows(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft id of each target token, Vd for every token outside the draft vocabulary (identity with the
        full vocabulary): the heads' previous-token rows of W1, and the CE labels."""
        if not self.reduced_vocab:
            return target_ids
        t2d_V = self.t2d

        def make():
            rows_V = torch.cumsum(t2d_V.long(), dim=0) - 1
            return torch.where(t2d_V, rows_V, torch.full_like(rows_V, self.config.draft_vocab_size))

        return self._derive("rows", (t2d_V.data_ptr(), t2d_V._version), make)[target_ids]

    def to_target_vocab(self, token_B: torch.Tensor, probs_BV: torch.Tensor | None):
        """Sampled draft ids -> target ids; the distribution -> the target vocabulary, zeros outside Vd."""
        if not self.reduced_vocab:
            return token_B, probs_BV
        kept_Vd = self.target_vocab_index()
        if probs_BV is not None:
            full_BV = probs_BV.new_zeros(probs_BV.shape[0], self.config.target_vocab_size)
            probs_BV = full_BV.index_copy_(1, kept_Vd, probs_BV)
        return kept_Vd[token_B], probs_BV

    def base_logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        """Parallel draft logits U_k from the frozen LM head (its draft-vocabulary rows; no sequential bias)."""
        return self.target_parts.logits(hidden_XH, self.draft_head_weight())

    def _prev_embed(self, prev_rows: torch.Tensor) -> torch.Tensor | None:
        return None if self.sequential is None else self.sequential.prev_embed(prev_rows)

    # -- training -----------------------------------------------------------------------------
    def block_hidden(self, batch: BlockBatch) -> torch.Tensor:
        """Hidden states [N, H] of the draft slots of every packed block (context computed once per sequence)."""
        if (batch.block_size, batch.first_draft_slot) != (self.config.block_size, self.config.first_draft_slot):
            raise ValueError(f"batch of blocks of {batch.block_size} drafting from slot {batch.first_draft_slot}, but "
                             f"the drafter's block_size={self.config.block_size}, block_convention="
                             f"{self.config.block_convention!r}")
        context_1TH = self.backbone.fusion(batch.context_features_1TF.to(self.dtype))
        context = self.backbone.context_kv_of(context_1TH, batch.context_positions_1T)
        mode = resolve_training_attention(self.config.training_attention, batch.context_features_1TF.device)
        blocks = PackedBlocks(batch.context_seq_id_T, batch.context_positions_1T[0], batch.block_seq_id_B,
                              batch.anchor_positions_B, batch.block_size, mode)
        inputs_1SH = self.backbone.fuse_inputs(self.embed(batch.block_input_ids_1S),
                                               self._packed_latest_context(context_1TH, batch))
        hidden_1SH = self.backbone(inputs_1SH, batch.block_positions_1S, context, blocks)
        hidden_BGH = hidden_1SH[0].view(-1, batch.block_size, hidden_1SH.shape[-1])
        return hidden_BGH[:, batch.first_draft_slot:].reshape(-1, hidden_1SH.shape[-1])

    def _packed_latest_context(self, context_1TH: torch.Tensor, batch: BlockBatch) -> torch.Tensor | None:
        """H_ctx(a - 1) of every block, repeated over its slots [1, S, H] (anchor fusion only). Sequences are
        packed back to back from position 0 in id order (batching.py), so (sequence s, position p) is row offset[s] + p,
        offset[s] the first row of s in the sorted `context_seq_id_T` (a search of fixed size: no host sync)."""
        if self.backbone.input_fusion is None:
            return None
        offsets_B = torch.searchsorted(batch.context_seq_id_T, batch.block_seq_id_B)
        before_B = batch.anchor_positions_B - 1
        rows_B = offsets_B + before_B.clamp(min=0)
        latest_BH = context_1TH[0].index_select(0, rows_B) * (before_B >= 0)[:, None].to(context_1TH.dtype)
        return latest_BH.repeat_interleave(batch.block_size, dim=0)[None]

    def forward(self, batch: BlockBatch) -> BlockOutput:
        hidden_NH = self.block_hidden(batch)
        prev_rows_N = self.draft_rows(batch.prev_ids_N)
        bias = None
        if self.sequential is not None:
            bias_in_NR = self.sequential.bias_factors(hidden_NH, prev_rows_N, batch.num_drafts)
            bias = (bias_in_NR, self.sequential.bias_out_RV)
        confidence_logits_N = None
        if self.confidence is not None:
            confidence_logits_N = self.confidence(hidden_NH, self._prev_embed(prev_rows_N), prev_rows_N)
        return BlockOutput(hidden_NH=hidden_NH, bias=bias, confidence_logits_N=confidence_logits_N)

    # -- inference ----------------------------------------------------------------------------
    def new_decode_state(self) -> DraftKVCache:
        """The per-request (or per-batch) inference state: the context K/V of accepted tokens."""
        return DraftKVCache()

    @torch.no_grad()
    def extend_context(self, cache: DraftKVCache, features_BCF: torch.Tensor, positions_BC: torch.Tensor,
                       valid_BC: torch.Tensor | None = None) -> DraftKVCache:
        """Append accepted tokens' context K/V (computed once per token) to `cache`; with anchor fusion also their
        fused context H_ctx, as one more cache entry after the layers' (so every cache edit keeps it aligned)."""
        context_BCH = self.backbone.fusion(features_BCF.to(self.dtype))
        context = self.backbone.context_kv_of(context_BCH, positions_BC)
        if valid_BC is None:
            valid_BC = torch.ones(positions_BC.shape, dtype=torch.bool, device=positions_BC.device)
        keys, values = [k for k, _ in context], [v for _, v in context]
        if self.backbone.input_fusion is not None:
            keys.append(context_BCH[:, None])
            values.append(context_BCH[:, None])
        cache.append(keys, values, positions_BC, valid_BC)
        return cache

    def _cached_latest_context(self, cache: DraftKVCache, anchor_pos_B: torch.Tensor) -> torch.Tensor | None:
        """H_ctx of the newest cached position before each anchor [B, H] (zeros where there is none)."""
        if self.backbone.input_fusion is None:
            return None
        entry = len(self.backbone.layers)
        if entry not in cache.keys:  # nothing cached yet (a one-token prompt): no earlier context
            return torch.zeros(anchor_pos_B.shape[0], self.config.hidden_size, dtype=self.dtype,
                               device=anchor_pos_B.device)
        visible_BC = cache.visible_BC(anchor_pos_B)
        context_BCH = cache.keys[entry][:, 0]
        newest_B = torch.where(visible_BC, cache.positions_BC, -1).argmax(dim=1)
        latest_BH = context_BCH[torch.arange(context_BCH.shape[0], device=newest_B.device), newest_B]
        return latest_BH * visible_BC.any(dim=1)[:, None].to(latest_BH.dtype)

    def draft_hidden(self, cache: DraftKVCache, anchor_ids_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """One parallel forward of [anchor, mask * (g-1)] per row -> h_BGH."""
        g = self.config.block_size
        batch = anchor_ids_B.shape[0]
        ids_BG = torch.full((batch, g), self.config.mask_token_id, dtype=torch.long, device=anchor_ids_B.device)
        ids_BG[:, 0] = anchor_ids_B
        positions_BG = anchor_pos_B[:, None] + torch.arange(g, device=anchor_pos_B.device)[None, :]
        context = cache.layer_kv(len(self.backbone.layers))
        mask = cached_block_mask(cache.visible_BC(anchor_pos_B), g)
        latest_BH = self._cached_latest_context(cache, anchor_pos_B)
        latest_BGH = None if latest_BH is None else latest_BH[:, None].expand(-1, g, -1)
        return self.backbone(self.backbone.fuse_inputs(self.embed(ids_BG), latest_BGH), positions_BG, context, mask)

    def confidence_probability(self, logit_B: torch.Tensor, slot: int) -> torch.Tensor:
        """The conditional acceptance probability of `slot` from its confidence logit (uncalibrated here)."""
        return torch.sigmoid(logit_B)

    @torch.no_grad()
    def propose(self, cache: DraftKVCache, anchor_ids_B: torch.Tensor, anchor_pos_B: torch.Tensor,
                sampler: DraftSampler, num_draft: int | None = None) -> DraftProposal:
        """Draft one block per row: K = `config.num_drafts` tokens from the draft slots (the block convention);
        draft k's distribution includes the sequential bias of the sampled x_{k-1} (draft 0: the anchor).

        Every draft is drawn (the sampler's draws do not depend on `num_draft`); the proposal keeps the first
        `num_draft` (default: all K). With a confidence head it carries the calibrated confidences and the raw
        confidence logits.
        """
        hidden_BGH = self.draft_hidden(cache, anchor_ids_B, anchor_pos_B)
        hidden_BKH = hidden_BGH[:, self.config.first_draft_slot:]
        base_BKV = self.base_logits(hidden_BKH)
        batch, num_drafts = base_BKV.shape[:2]
        prev_B = anchor_ids_B
        state = None if self.sequential is None else self.sequential.init_state(batch, hidden_BKH)
        tokens, probs, confidences, confidence_logits = [], [], [], []
        for slot in range(num_drafts):  # draft index k (the sampler's and the temperatures' position)
            hidden_BH = hidden_BKH[:, slot]
            logits_BV = base_BKV[:, slot]
            prev_rows_B = self.draft_rows(prev_B)
            if self.sequential is not None:
                bias_in_BR, state = self.sequential.step(state, hidden_BH, prev_rows_B)
                logits_BV = logits_BV + bias_in_BR @ self.sequential.bias_out_RV
            if self.confidence is not None:
                logit_B = self.confidence(hidden_BH, self._prev_embed(prev_rows_B), prev_rows_B)
                confidence_logits.append(logit_B)
                confidences.append(self.confidence_probability(logit_B, slot))
            token_B, probs_BV = self.to_target_vocab(*sampler(logits_BV, slot))
            tokens.append(token_B)
            probs.append(probs_BV)
            prev_B = token_B
        probs_BKV = None if any(p is None for p in probs) else torch.stack(probs, dim=1)
        confidence_BK = torch.stack(confidences, dim=1) if confidences else None
        logits_BK = torch.stack(confidence_logits, dim=1).float() if confidence_logits else None
        proposal = DraftProposal(torch.stack(tokens, dim=1), probs_BKV, confidence_BK, confidence_logits_BK=logits_BK)
        return proposal if num_draft is None else proposal.truncate(num_draft)
