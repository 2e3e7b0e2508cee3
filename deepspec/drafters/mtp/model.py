"""MTP drafter: DeepSeek-V3-style chained multi-token-prediction modules trained post hoc on a frozen target.

Module k (1..D) at row t (DeepSeek-V3 §2.2 alignment, k = 1..D; the target itself predicts x[t+1]):
    h^k_t = Block_k( eh_proj_k([enorm_k(Emb(x[t+k])); hnorm_k(h^{k-1}_t)]) )   (embedding first)
    p^k_t = softmax( LMHead( shared_head.norm_k(h^k_t) ) )  predicts x[t+k+1]
with h^0_t = the target's final hidden state at t. DeepSpec's cache stores the final hidden *after*
the target's final norm (`final_hidden_norm = "post_norm"`), so h^0 is post-norm here (DeepSeek feeds
its last layer's pre-norm output; hnorm re-normalises either way). Block_k is one decoder layer of
the draft family (the target's, or `layer_family`) with causal self-attention over the (packed) rows at positions
t. Emb and LMHead are the target's, frozen and shared; `shared_head.norm` is per module and trainable,
as in DeepSeek's NextN weights.

Submodule names map 1:1 onto DeepSeek's NextN layout: module k is the family decoder layer itself
(`mtp_layers.{k-1}.self_attn.*`, `.mlp.*`, `.input_layernorm`, `.post_attention_layernorm`) carrying
`enorm`, `hnorm`, `eh_proj` and `shared_head.norm`, i.e. `model.layers.{L+k-1}.<same names>` in a
DeepSeek checkpoint (shared_head.head / embed_tokens are the target's and not stored).

Inference (`propose`): each module keeps its own KV cache of committed rows (rows whose inputs are
all accepted tokens: module k row t needs x[t+k], so rows t <= n-k once x[n] is the newest token).
A round drafts D tokens: module k at the newest row n-1 predicts x[n+k], using module k-1's hidden
at that row and the drafted token x[n+k-1]; rows after the committed ones are computed speculatively
and cropped. `num_draft > D` re-applies the last module to its own hidden (Eagle-style recursion; the
modules were not trained for it, so expect lower acceptance). Default proposals = D.

Shape legend: B = batch, T = tokens, N = new rows, K = draft tokens, H = hidden, V = vocab, L = keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import DraftSampler
from deepspec.drafters.base import DrafterModel, draft_layer_config
from deepspec.drafters.chain.batching import packed_causal_mask, shift_within_sequence
from deepspec.drafters.chain.layer import causal_rows_mask, run_family_layer
from deepspec.drafters.mtp.config import MTPConfig


class _SharedHead(nn.Module):
    """DeepSeek's `shared_head`: holds the per-module final norm (the head weight is the target's)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


@dataclass
class MTPDecodeState:
    caches: list[DraftKVCache] = field(default_factory=list)
    num_committed: list[int] = field(default_factory=list)  # committed rows per module
    # Hidden outputs of module k for committed rows not yet consumed by module k+1 (rows num_committed[k+1]..).
    pending_hidden: list[torch.Tensor | None] = field(default_factory=list)
    num_rows: int = 0  # target rows seen (h^0 available for rows < num_rows)
    tokens_BT: torch.Tensor | None = None  # accepted tokens x[1..num_rows] (token after each row)


class MTPDrafter(DrafterModel):
    config_class = MTPConfig

    def __init__(self, config: MTPConfig):
        super().__init__(config)
        family = config.family
        num_modules = config.num_mtp_modules
        layer_config = draft_layer_config(config, num_modules)
        hidden = config.hidden_size
        eps = getattr(layer_config, "rms_norm_eps", 1e-6)
        modules = []
        for index in range(num_modules):
            block = family.decoder_layer_cls(layer_config, index)
            block.enorm = family.make_norm(hidden, eps)
            block.hnorm = family.make_norm(hidden, eps)
            block.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            block.shared_head = _SharedHead(family.make_norm(hidden, eps))
            modules.append(block)
        self.mtp_layers = nn.ModuleList(modules)
        self.rotary_emb = family.rotary_cls(config=layer_config)
        self.post_init()

    @torch.no_grad()
    def init_from_target_model(self, target_model) -> None:
        """Post-hoc warm start (`init_from_target=True`): every block copies the target's LAST decoder layer
        and every `shared_head.norm` the target's final norm, so module logits start on the target's scale."""
        from deepspec.targets.features import decoder_layers

        last_layer_state = decoder_layers(target_model)[-1].state_dict()
        decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.model
        final_norm = decoder.norm
        for block in self.mtp_layers:
            missing, unexpected = block.load_state_dict(last_layer_state, strict=False)
            own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
            if unexpected or set(missing) - own:
                raise ValueError(f"cannot copy the target's last layer into an MTP block: missing "
                                 f"{sorted(set(missing) - own)}, unexpected {sorted(unexpected)}")
            block.shared_head.norm.load_state_dict(final_norm.state_dict())

    @property
    def num_modules(self) -> int:
        return len(self.mtp_layers)

    def module_forward(self, index: int, embeds_BQH: torch.Tensor, previous_hidden_BQH: torch.Tensor,
                       position_ids_BQ: torch.Tensor, mask_B1QL: torch.Tensor, cache: DraftKVCache) -> torch.Tensor:
        """Module `index` (0-based): pre-norm hidden h^{index+1} from Emb(next tokens) and h^{index}."""
        block = self.mtp_layers[index]
        dtype = block.eh_proj.weight.dtype
        fused_BQH = block.eh_proj(torch.cat([block.enorm(embeds_BQH.to(dtype)),
                                             block.hnorm(previous_hidden_BQH.to(dtype))], dim=-1))
        position_embeddings = self.config.family.rotary(self.rotary_emb, fused_BQH, position_ids_BQ, "full_attention")
        return run_family_layer(block, fused_BQH, position_embeddings, mask_B1QL, cache)

    def module_logits(self, index: int, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits of module `index` (shared_head.norm then the frozen shared LM head)."""
        normed = self.mtp_layers[index].shared_head.norm(hidden_NH)
        return normed @ self.target_parts.lm_head_weight.T.to(normed.dtype)

    def head_norm(self, index: int, hidden_NH: torch.Tensor) -> torch.Tensor:
        return self.mtp_layers[index].shared_head.norm(hidden_NH)

    # -- training ----------------------------------------------------------------------------
    def chain_forward(self, input_ids_BT: torch.Tensor, final_hidden_BTH: torch.Tensor, sequence_ids_BT: torch.Tensor,
                      position_ids_BT: torch.Tensor) -> list[torch.Tensor]:
        """All D modules over all rows; entry k-1 is h^k [B, T, H] (pre-norm), predicting x[t+k+1]."""
        mask_B1TT = packed_causal_mask(sequence_ids_BT)
        hidden_BTH = final_hidden_BTH
        outputs = []
        for index in range(self.num_modules):
            tokens_BT, _ = shift_within_sequence(input_ids_BT, sequence_ids_BT, index + 1,
                                                 self.config.pad_token_id_for_shift)
            hidden_BTH = self.module_forward(index, self.target_parts.embed(tokens_BT), hidden_BTH, position_ids_BT,
                                             mask_B1TT, DraftKVCache())
            outputs.append(hidden_BTH)
        return outputs

    # -- inference ---------------------------------------------------------------------------
    def _run_rows(self, index: int, state: MTPDecodeState, tokens_BQ: torch.Tensor, previous_BQH: torch.Tensor,
                  first_row: int) -> torch.Tensor:
        """Rows first_row.. of module `index` against its cache (causal); keys are appended."""
        cache = state.caches[index]
        batch, num_query = tokens_BQ.shape
        device = tokens_BQ.device
        rows_Q = torch.arange(first_row, first_row + num_query, device=device)
        mask_B1QL = causal_rows_mask(first_row, num_query, batch, cache.get_seq_length() + num_query, device)
        return self.module_forward(index, self.target_parts.embed(tokens_BQ), previous_BQH,
                                   rows_Q.expand(batch, num_query), mask_B1QL, cache)

    def new_decode_state(self) -> MTPDecodeState:
        return MTPDecodeState(caches=[DraftKVCache() for _ in range(self.num_modules)],
                              num_committed=[0] * self.num_modules, pending_hidden=[None] * self.num_modules)

    @torch.no_grad()
    def propose(self, state: MTPDecodeState, final_hidden_BNH: torch.Tensor, next_token_ids_BN: torch.Tensor,
                sampler: DraftSampler, num_draft: int | None = None) -> DraftProposal:
        """Draft `num_draft` (default D) tokens after N new target rows.

        `final_hidden_BNH`: the target's post-norm final hidden of the N new positions (rows
        r..r+N-1, r = rows seen so far); `next_token_ids_BN`: the accepted token after each of them
        (the last is the target's newest token x[n], n = r+N).
        """
        num_draft = self.num_modules if num_draft is None else int(num_draft)
        if num_draft < 1:
            raise ValueError(f"num_draft={num_draft} must be >= 1")
        if final_hidden_BNH.shape[:2] != next_token_ids_BN.shape or next_token_ids_BN.shape[1] < 1:
            raise ValueError(f"final_hidden_BNH {tuple(final_hidden_BNH.shape)} and next_token_ids_BN "
                             f"{tuple(next_token_ids_BN.shape)} must share [B, N] with N >= 1")
        start_rows = state.num_rows
        if state.num_committed[0] != start_rows:
            raise RuntimeError("MTP decode state is inconsistent: module 1 must have committed every row seen")
        accepted_BT = (next_token_ids_BN if state.tokens_BT is None
                       else torch.cat([state.tokens_BT, next_token_ids_BN], 1))
        state.tokens_BT = accepted_BT  # accepted_BT[:, j] = x[j+1]
        num_rows = accepted_BT.shape[1]  # n: rows 0..n-1, x[n] is the newest token
        state.num_rows = num_rows
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        previous_BQH = final_hidden_BNH  # h^0 for rows start_rows..n-1
        previous_first = start_rows  # first row of previous_BQH
        for index in range(self.num_modules):
            first = state.num_committed[index]
            if index > 0 and first < previous_first:
                # Rows the previous module committed in earlier rounds that this module has not yet.
                previous_BQH = torch.cat([state.pending_hidden[index - 1], previous_BQH], dim=1)
            assert previous_BQH.shape[1] == num_rows - first, "MTP decode state out of sync"
            # Row t of module index needs x[t+index+1]: accepted while <= x[n], then this round's drafts.
            known_and_drafted_BT = torch.cat([accepted_BT] + [d[:, None] for d in drafts], dim=1)
            tokens_BQ = known_and_drafted_BT[:, first + index: num_rows + index]
            hidden_BQH = self._run_rows(index, state, tokens_BQ, previous_BQH, first)
            # Rows t <= n-index-1 have only accepted inputs: they stay in the cache (cropped at the end).
            committed = max(num_rows - index, first)
            if index > 0:
                # h^{index} rows the previous module committed but this module has not: kept for next round.
                previous_committed = state.num_committed[index - 1]
                state.pending_hidden[index - 1] = previous_BQH[:, committed - first: previous_committed - first]
            state.num_committed[index] = committed
            # Every module drafts (later modules need the earlier drafts); extra ones are dropped below.
            token_B, probs_BV = sampler(self.module_logits(index, hidden_BQH[:, -1]), len(drafts))
            drafts.append(token_B)
            probs.append(probs_BV)
            previous_first = first
            previous_BQH = hidden_BQH
        # Recursive extension (num_draft > D): the last module on its own hidden, one position further each
        # step, attending to its rows of this round (committed + speculative) and its earlier extension keys.
        last = self.num_modules - 1
        hidden_B1H = previous_BQH[:, -1:]
        cache = state.caches[last]
        batch, device = hidden_B1H.shape[0], hidden_B1H.device
        for step in range(num_draft - len(drafts)):
            length = cache.get_seq_length()
            mask_B11L = torch.ones(batch, 1, 1, length + 1, dtype=torch.bool, device=device)
            position_B1 = torch.full((batch, 1), num_rows + step, dtype=torch.long, device=device)
            hidden_B1H = self.module_forward(last, self.target_parts.embed(drafts[-1][:, None]), hidden_B1H,
                                             position_B1, mask_B11L, cache)
            token_B, probs_BV = sampler(self.module_logits(last, hidden_B1H[:, 0]), len(drafts))
            drafts.append(token_B)
            probs.append(probs_BV)
        for index in range(self.num_modules):
            state.caches[index].crop(state.num_committed[index])
        drafts, probs = drafts[:num_draft], probs[:num_draft]
        probs_BKV = None if any(p is None for p in probs) else torch.stack(probs, dim=1)
        return DraftProposal(torch.stack(drafts, dim=1), probs_BKV)
