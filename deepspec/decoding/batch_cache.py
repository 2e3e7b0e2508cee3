"""The target side of batched speculative decoding: one KV cache with a row per request, holes allowed.

`BatchedTargetCache` is one transformers `DynamicCache` with one row per active request. Every round appends
`L = 1 + max_r l_r` slots to all rows (shorter rows padded); an explicit 2-D attention mask over all slots marks
real tokens 1 and padding / rejected drafts 0, and explicit per-row `position_ids` continue each request's own
positions. Rejected drafts are not cropped (other rows may keep theirs); they are masked from then on and
`compact` gathers the valid slots per row. Finished requests free their row (`keep_rows`); new requests are
prefilled together (`prefill_requests`) and merged in by right-padding the caches to a common slot count
(`add_rows`, padding masked). Full-attention targets only: sliding-window layers would evict real slots
counted in cache-slot space, not token space.

The same class serves any causal LM that keeps one KV row per request, e.g. a standalone drafter's own
model: rows may also join empty (`add_empty_rows`, their tokens fed by later forwards), a forward may take
embeddings instead of ids, and `rollback` drops each row's newest slots (the drafts the target rejected),
cropping the cache wherever every row dropped them.

Shape legend: R = active requests (rows), n = requests prefilled together, S = target cache slots, L = slots
appended this round, T = prompt tokens, V = vocabulary, F = feature width, H = hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from deepspec.decoding.kv_cache import pad_entries
from deepspec.decoding.verifier import target_logits
from deepspec.targets.family import cache_kwargs, text_config
from deepspec.targets.features import LayerOutputHooks, decoder_stack


def check_full_attention(model: PreTrainedModel) -> None:
    layer_types = getattr(text_config(model.config), "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"batched decoding supports full-attention targets only; this target has layer_types "
                         f"{sorted(set(layer_types))} (use the batch-1 loop, deepspec.decoding.loop)")


class BatchedTargetCache:
    """A `DynamicCache` with one row per request plus `valid_RS` (real slots) and per-row positions."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache: DynamicCache | None = None
        self.valid_RS: torch.Tensor | None = None
        self.next_pos_R: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.next_pos_R)

    @property
    def num_slots(self) -> int:
        return 0 if self.valid_RS is None else int(self.valid_RS.shape[1])

    def _layers(self) -> list:
        return list(self.cache.layers)

    def _set_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))

    def add_rows(self, prefill: Prefill, rows: list[int]) -> None:
        """Merge the listed rows of a prefill as new last rows (caches right-padded to a common width)."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=prefill.valid_nT.device)
        new_keys = [layer.keys[index] for layer in prefill.cache.layers]
        new_values = [layer.values[index] for layer in prefill.cache.layers]
        new_valid = prefill.valid_nT[index]
        if self.num_rows == 0:
            self._set_kv(new_keys, new_values)
            self.valid_RS = new_valid
        else:
            width = max(self.num_slots, new_valid.shape[1])
            keys = [torch.cat([pad_entries(layer.keys, width, 2), pad_entries(k, width, 2)])
                    for layer, k in zip(self._layers(), new_keys)]
            values = [torch.cat([pad_entries(layer.values, width, 2), pad_entries(v, width, 2)])
                      for layer, v in zip(self._layers(), new_values)]
            self._set_kv(keys, values)
            self.valid_RS = torch.cat([pad_entries(self.valid_RS, width, 1, False),
                                       pad_entries(new_valid, width, 1, False)])
        self.next_pos_R.extend(prefill.lengths[r] for r in rows)

    def add_empty_rows(self, count: int, device: torch.device | str) -> None:
        """`count` new last rows holding no slots yet (their tokens come with later forwards)."""
        if count < 1:
            return
        if self.num_rows == 0:
            self.cache, self.valid_RS = None, torch.zeros(count, 0, dtype=torch.bool, device=device)
        else:
            if self.cache is not None:
                pad = lambda t: torch.cat([t, t.new_zeros(count, *t.shape[1:])])  # noqa: E731
                self._set_kv([pad(layer.keys) for layer in self._layers()],
                             [pad(layer.values) for layer in self._layers()])
            self.valid_RS = torch.cat([self.valid_RS, self.valid_RS.new_zeros(count, self.num_slots)])
        self.next_pos_R.extend([0] * count)

    def keep_rows(self, rows: list[int]) -> None:
        self.next_pos_R = [self.next_pos_R[r] for r in rows]
        if not rows:
            self.cache, self.valid_RS = None, None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.valid_RS.device)
        if self.cache is not None:
            self._set_kv([layer.keys[index] for layer in self._layers()],
                         [layer.values[index] for layer in self._layers()])
        self.valid_RS = self.valid_RS[index]

    def hole_fraction(self) -> float:
        return 0.0 if self.valid_RS is None or self.valid_RS.numel() == 0 else float((~self.valid_RS).float().mean())

    def compact(self) -> None:
        """Gather each row's valid slots to the front; drop slots no row uses."""
        counts_R = self.valid_RS.sum(dim=1)
        width = int(counts_R.max())
        order_RS = torch.sort((~self.valid_RS).to(torch.int8), dim=1, stable=True).indices[:, :width]
        gather = order_RS[:, None, :, None]
        keys = [layer.keys.gather(2, gather.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
                for layer in self._layers()]
        values = [layer.values.gather(2, gather.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
                  for layer in self._layers()]
        self._set_kv(keys, values)
        self.valid_RS = torch.arange(width, device=counts_R.device)[None, :] < counts_R[:, None]

    def forward(self, input_ids_RL: torch.Tensor, real_RL: torch.Tensor, layer_ids: Sequence[int] = (),
                inputs_embeds_RLH: torch.Tensor | None = None):
        """Append L slots per row and return (hidden_RLH, features_RLF); padding slots are masked. With
        `inputs_embeds_RLH` the model reads those embeddings instead of embedding `input_ids_RL` itself."""
        length = input_ids_RL.shape[1]
        device = input_ids_RL.device
        positions_RL = torch.tensor(self.next_pos_R, device=device)[:, None] + torch.arange(length, device=device)[None]
        attention_mask = torch.cat([self.valid_RS, real_RL], dim=1).long()
        if self.cache is None:  # rows that joined empty: the first forward creates the cache
            self.cache = DynamicCache()
        stack = decoder_stack(self.model)
        inputs = {"input_ids": input_ids_RL} if inputs_embeds_RLH is None else {"inputs_embeds": inputs_embeds_RLH}
        with LayerOutputHooks(self.model, list(layer_ids)) as hooks:
            out = stack(**inputs, attention_mask=attention_mask, position_ids=positions_RL,
                        **cache_kwargs(stack, self.cache), use_cache=True)
            hidden_RLH = out.last_hidden_state
            features_RLF = hooks.features(hidden_RLH)
        # Until acceptance decides, only the real tokens count; `commit` narrows to the kept ones.
        self.valid_RS = torch.cat([self.valid_RS, real_RL], dim=1)
        return hidden_RLH, features_RLF

    def commit(self, length: int, num_kept_R: list[int]) -> None:
        """After a forward of `length` slots, keep the first num_kept_R[r] of them in row r."""
        device = self.valid_RS.device
        keep_RL = torch.arange(length, device=device)[None] < torch.tensor(num_kept_R, device=device)[:, None]
        self.valid_RS[:, -length:] = keep_RL
        self.next_pos_R = [p + n for p, n in zip(self.next_pos_R, num_kept_R)]

    def rollback(self, num_drop_R: list[int]) -> None:
        """Drop the newest `num_drop_R[r]` slots of row r (slots committed by single-slot forwards, all real):
        they are masked, and the slots no row keeps any more are cropped off the cache."""
        for row, drop in enumerate(num_drop_R):
            if drop:
                self.valid_RS[row, self.num_slots - drop:] = False
                self.next_pos_R[row] -= drop
        slot_S = torch.arange(1, self.num_slots + 1, device=self.valid_RS.device)
        kept_width = int((self.valid_RS * slot_S).max()) if self.valid_RS.numel() else 0
        if kept_width < self.num_slots:
            self.cache.crop(kept_width - self.num_slots)  # transformers crops by a negative count of slots
            self.valid_RS = self.valid_RS[:, :kept_width]


@dataclass
class Prefill:
    cache: DynamicCache  # n rows, right-padded to the longest prompt
    valid_nT: torch.Tensor  # bool, real prompt tokens
    lengths: list[int]
    last_logits_nV: torch.Tensor  # next-token logits after each prompt's last token
    features_nTF: torch.Tensor
    final_hidden_nTH: torch.Tensor


@torch.no_grad()
def prefill_requests(model: PreTrainedModel, prompts: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> Prefill:
    """Prefill several prompts in one right-padded forward (padding masked, positions from 0 per row)."""
    device = prompts[0].device
    lengths = [int(p.shape[0]) for p in prompts]
    width = max(lengths)
    ids_nT = torch.stack([pad_entries(p.long(), width, 0) for p in prompts])
    slot_T = torch.arange(width, device=device)
    valid_nT = slot_T[None] < torch.tensor(lengths, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    stack = decoder_stack(model)
    with LayerOutputHooks(model, list(layer_ids)) as hooks:
        out = stack(input_ids=ids_nT, attention_mask=valid_nT.long(),
                    position_ids=slot_T[None].expand(len(prompts), -1), **cache_kwargs(stack, cache), use_cache=True)
        hidden_nTH = out.last_hidden_state
        features_nTF = hooks.features(hidden_nTH)
    last_nH = hidden_nTH[torch.arange(len(prompts), device=device), torch.tensor(lengths, device=device) - 1]
    return Prefill(cache, valid_nT, lengths, target_logits(model, last_nH), features_nTF, hidden_nTH)
