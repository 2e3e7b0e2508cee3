"""The target side of batched speculative decoding: one KV cache, a row per request, holes allowed.

`BatchedTargetCache` is one transformers `DynamicCache` with one row per active request. Every round
appends `L = 1 + max_r l_r` slots to all rows (shorter rows padded); explicit per-row `position_ids`
continue each request's own positions, and each slot records whether it is real (padding and
rejected drafts are not) and its token position. Rejected drafts are not cropped (other rows may
keep theirs); they are masked from then on and `compact` gathers the valid slots per row. Finished
requests free their row (`keep_rows`); new requests are prefilled together (`prefill_requests`) and
merged in by right-padding the caches to a common slot count (`add_rows`, padding masked).

The attention masks are built here, per layer type of the target (`AttentionLayout`): a query sees
the valid slots of its row at positions <= its own and, in a sliding-window layer (Gemma 3,
Mistral-style windows, Qwen3's `use_sliding_window`), only those less than `sliding_window`
positions back. The window counts token positions, not cache slots: holes and padding never push a
real token out of it, which is why every cache layer is a plain one (transformers' sliding layers
evict by slot count). The sliding layers have a slot axis of their own, so `compact` drops the slots
no later query of their row can see: they keep about one window per row.

The same class serves any causal LM that keeps one KV row per request, e.g. a standalone drafter's
own model: rows may also join empty (`add_empty_rows`, their tokens fed by later forwards), a
forward may take embeddings instead of ids, and `rollback` drops each row's newest slots (the drafts
the target rejected), cropping the cache wherever every row dropped them.

Shape legend: R = active requests (rows), n = requests prefilled together, S = slots of one axis,
L = slots appended this round, K = key slots a query is masked over, T = prompt tokens,
V = vocabulary, F = feature width, H = hidden.
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

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")  # attention implementations that read a 4-D mask


def attention_layer_types(config) -> list[str]:
    """Per decoder layer, `full_attention` or `sliding_attention` (or another type it names)."""
    config = text_config(config)
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    # Mistral-style configs name no layer types: one window for every layer when one is set.
    kind = SLIDING_ATTENTION if getattr(config, "sliding_window", None) else FULL_ATTENTION
    return [kind] * int(config.num_hidden_layers)


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer runs, and the masks handed to the model for it."""

    layers: dict[str, list[int]]  # layer type -> decoder layer indices
    window: int | None  # sliding layers: a query sees its own position and window - 1 before it
    implementation: str  # the model's attention: "sdpa" (boolean masks) or "eager" (additive)
    dtype: torch.dtype  # of the additive masks

    @classmethod
    def of(cls, model: PreTrainedModel) -> AttentionLayout:
        """`model`'s layout; a layer type or an attention these masks cannot serve is refused."""
        stack = decoder_stack(model)
        layer_types = attention_layer_types(model.config)
        other = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if other:
            raise ValueError(f"batched decoding masks full-attention and sliding-window layers "
                             f"per cache slot; this target also has layer_types {other}, whose "
                             "state is not a per-token KV cache")
        implementation = stack.config._attn_implementation
        if implementation not in MASKED_IMPLEMENTATIONS:
            raise ValueError(f"batched decoding passes explicit attention masks, which "
                             f"attn_implementation {implementation!r} does not read; load the "
                             f"target with one of {MASKED_IMPLEMENTATIONS}")
        layers: dict[str, list[int]] = {}
        for index, layer_type in enumerate(layer_types):
            layers.setdefault(layer_type, []).append(index)
        window = (getattr(text_config(model.config), "sliding_window", None)
                  if SLIDING_ATTENTION in layers else None)
        dtype = next(stack.parameters()).dtype
        return cls(layers, None if window is None else int(window), implementation, dtype)

    def window_of(self, layer_type: str) -> int | None:
        return self.window if layer_type == SLIDING_ATTENTION else None

    def mask(self, layer_type: str, key_valid_RK: torch.Tensor, key_pos_RK: torch.Tensor,
             query_pos_RL: torch.Tensor) -> torch.Tensor:
        """The 4-D mask of L new queries per row over K key slots, the last L being the queries'
        own: valid keys at positions <= the query's, in a sliding layer less than `window` back."""
        delta_RLK = query_pos_RL[:, :, None] - key_pos_RK[:, None, :]
        allowed_RLK = key_valid_RK[:, None, :] & (delta_RLK >= 0)
        window = self.window_of(layer_type)
        if window is not None:
            allowed_RLK &= delta_RLK < window
        # Every query sees its own slot: a padding query with no valid key in reach would get an
        # all-masked row, whose NaN (sdpa) would reach real rows through its masked K/V at the next
        # layer (0 x NaN).
        length, num_keys = query_pos_RL.shape[1], key_pos_RK.shape[1]
        own_L = torch.arange(length, device=query_pos_RL.device)
        allowed_RLK[:, own_L, num_keys - length + own_L] = True
        if self.implementation == "eager":
            zeros_RLK = allowed_RLK.new_zeros(allowed_RLK.shape, dtype=self.dtype)
            return zeros_RLK.masked_fill(~allowed_RLK, torch.finfo(self.dtype).min)[:, None]
        return allowed_RLK[:, None]

    @staticmethod
    def pack(masks: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """What the model's forward takes: one 4-D mask for one layer type (Llama, Mistral), one per
        layer type for a hybrid (Gemma 3, Qwen3 with windows: a dict keyed by layer type)."""
        return next(iter(masks.values())) if len(masks) == 1 else masks


@dataclass
class _SlotAxis:
    """The slots of the cache layers of one attention type: per row and slot, valid or not, and its
    token position."""

    layer_type: str
    layers: list[int]
    window: int | None
    valid_RS: torch.Tensor  # bool
    pos_RS: torch.Tensor  # long; meaningful where valid

    @property
    def num_slots(self) -> int:
        return int(self.valid_RS.shape[1])

    def still_read_RS(self, next_pos_R: torch.Tensor) -> torch.Tensor:
        """Valid slots a query at a position >= next_pos_R[r] may see (a window drops older)."""
        if self.window is None:
            return self.valid_RS
        return self.valid_RS & (self.pos_RS > next_pos_R[:, None] - self.window)


class BatchedTargetCache:
    """A `DynamicCache` with one row per request; per attention type, the slots' validity and
    positions."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.layout = AttentionLayout.of(model)
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.next_pos_R: list[int] = []
        self._reset_axes()

    def _reset_axes(self) -> None:
        empty = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.axes = [_SlotAxis(kind, layers, self.layout.window_of(kind), empty, empty.long())
                     for kind, layers in self.layout.layers.items()]

    @property
    def num_rows(self) -> int:
        return len(self.next_pos_R)

    @property
    def num_slots(self) -> int:
        """Slots of the widest axis (the full-attention layers' when the target has any)."""
        return max(axis.num_slots for axis in self.axes)

    def _layer_kv(self) -> list[list[torch.Tensor]]:
        return [[layer.keys, layer.values] for layer in self.cache.layers]

    def _set_kv(self, kv: list[list[torch.Tensor]]) -> None:
        self.cache = DynamicCache(ddp_cache_data=[tuple(pair) for pair in kv])

    def add_rows(self, prefill: Prefill, rows: list[int]) -> None:
        """Merge the listed rows of a prefill as new last rows (each axis right-padded to a common
        width)."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=prefill.valid_nT.device)
        new_kv = [[layer.keys[index], layer.values[index]] for layer in prefill.cache.layers]
        new_valid = prefill.valid_nT[index]
        new_width = new_valid.shape[1]
        new_pos = torch.arange(new_width, device=new_valid.device)[None].expand(len(rows), -1)
        kv = new_kv if self.cache is None else self._layer_kv()
        for axis in self.axes:
            width = max(axis.num_slots, new_width)
            if self.cache is not None:
                for i in axis.layers:
                    kv[i] = [torch.cat([pad_entries(old, width, 2), pad_entries(new, width, 2)])
                             for old, new in zip(kv[i], new_kv[i])]
            axis.valid_RS = torch.cat([pad_entries(axis.valid_RS, width, 1, False),
                                       pad_entries(new_valid, width, 1, False)])
            axis.pos_RS = torch.cat([pad_entries(axis.pos_RS, width, 1),
                                     pad_entries(new_pos, width, 1)])
        self._set_kv(kv)
        self.next_pos_R.extend(prefill.lengths[r] for r in rows)

    def add_empty_rows(self, count: int) -> None:
        """`count` new last rows holding no slots yet (their tokens come with later forwards)."""
        if count < 1:
            return
        if self.cache is not None:
            pad = lambda t: torch.cat([t, t.new_zeros(count, *t.shape[1:])])  # noqa: E731
            self._set_kv([[pad(k), pad(v)] for k, v in self._layer_kv()])
        for axis in self.axes:
            new_valid = axis.valid_RS.new_zeros(count, axis.num_slots)
            axis.valid_RS = torch.cat([axis.valid_RS, new_valid])
            axis.pos_RS = torch.cat([axis.pos_RS, axis.pos_RS.new_zeros(count, axis.num_slots)])
        self.next_pos_R.extend([0] * count)

    def keep_rows(self, rows: list[int]) -> None:
        self.next_pos_R = [self.next_pos_R[r] for r in rows]
        if not rows:
            self.cache = None
            self._reset_axes()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.cache is not None:
            self._set_kv([[k[index], v[index]] for k, v in self._layer_kv()])
        for axis in self.axes:
            axis.valid_RS, axis.pos_RS = axis.valid_RS[index], axis.pos_RS[index]

    def hole_fraction(self) -> float:
        """The share of the cached K/V (slots x layers) no later query reads: masked slots, and
        slots a sliding window has left behind."""
        next_pos_R = torch.tensor(self.next_pos_R, dtype=torch.long, device=self.device)
        total = sum(axis.valid_RS.numel() * len(axis.layers) for axis in self.axes)
        read = sum(int(axis.still_read_RS(next_pos_R).sum()) * len(axis.layers)
                   for axis in self.axes)
        return 0.0 if total == 0 else 1.0 - read / total

    def compact(self) -> None:
        """Gather each row's slots still read to the front of each axis; drop what no row reads."""
        next_pos_R = torch.tensor(self.next_pos_R, dtype=torch.long, device=self.device)
        kv = self._layer_kv()
        for axis in self.axes:
            keep_RS = axis.still_read_RS(next_pos_R)
            counts_R = keep_RS.sum(dim=1)
            width = int(counts_R.max())
            # A stable sort puts each row's kept slots first, in their original order.
            order_RS = torch.sort((~keep_RS).to(torch.int8), dim=1, stable=True).indices[:, :width]
            gather = order_RS[:, None, :, None]
            for i in axis.layers:
                kv[i] = [t.gather(2, gather.expand(-1, t.shape[1], -1, t.shape[3])) for t in kv[i]]
            axis.pos_RS = axis.pos_RS.gather(1, order_RS)
            axis.valid_RS = torch.arange(width, device=self.device)[None, :] < counts_R[:, None]
        self._set_kv(kv)

    def forward(self, input_ids_RL: torch.Tensor, real_RL: torch.Tensor,
                layer_ids: Sequence[int] = (), inputs_embeds_RLH: torch.Tensor | None = None):
        """Append L slots per row and return (hidden_RLH, features_RLF); padding slots are masked.
        With `inputs_embeds_RLH` the model reads those instead of embedding `input_ids_RL`."""
        length = input_ids_RL.shape[1]
        device = input_ids_RL.device
        positions_RL = (torch.tensor(self.next_pos_R, device=device)[:, None]
                        + torch.arange(length, device=device)[None])
        masks = {axis.layer_type: self.layout.mask(axis.layer_type,
                                                   torch.cat([axis.valid_RS, real_RL], dim=1),
                                                   torch.cat([axis.pos_RS, positions_RL], dim=1),
                                                   positions_RL)
                 for axis in self.axes}
        if self.cache is None:  # rows that joined empty: the first forward creates the cache
            self.cache = DynamicCache()
        stack = decoder_stack(self.model)
        inputs = ({"input_ids": input_ids_RL} if inputs_embeds_RLH is None
                  else {"inputs_embeds": inputs_embeds_RLH})
        with LayerOutputHooks(self.model, list(layer_ids)) as hooks:
            out = stack(**inputs, attention_mask=self.layout.pack(masks), position_ids=positions_RL,
                        **cache_kwargs(stack, self.cache), use_cache=True)
            hidden_RLH = out.last_hidden_state
            features_RLF = hooks.features(hidden_RLH)
        # Until acceptance decides, only the real tokens count; `commit` narrows to the kept ones.
        for axis in self.axes:
            axis.valid_RS = torch.cat([axis.valid_RS, real_RL], dim=1)
            axis.pos_RS = torch.cat([axis.pos_RS, positions_RL], dim=1)
        return hidden_RLH, features_RLF

    def commit(self, length: int, num_kept_R: list[int]) -> None:
        """After a forward of `length` slots, keep the first num_kept_R[r] of them in row r."""
        keep_RL = (torch.arange(length, device=self.device)[None]
                   < torch.tensor(num_kept_R, device=self.device)[:, None])
        for axis in self.axes:
            axis.valid_RS[:, -length:] = keep_RL
        self.next_pos_R = [p + n for p, n in zip(self.next_pos_R, num_kept_R)]

    def rollback(self, num_drop_R: list[int]) -> None:
        """Drop the newest `num_drop_R[r]` slots of row r (committed by single-slot forwards since
        the last `compact`, all real): they are masked, and the slots no row keeps any more are
        cropped off the cache."""
        for axis in self.axes:
            for row, drop in enumerate(num_drop_R):
                if drop:
                    axis.valid_RS[row, axis.num_slots - drop:] = False
            slot_S = torch.arange(1, axis.num_slots + 1, device=self.device)
            kept_width = int((axis.valid_RS * slot_S).max()) if axis.valid_RS.numel() else 0
            self._crop(axis, axis.num_slots - kept_width)
        self.next_pos_R = [p - drop for p, drop in zip(self.next_pos_R, num_drop_R)]

    def drop_last(self, length: int) -> None:
        """Remove the last `length` slots of every row: a forward whose tokens are not kept."""
        for axis in self.axes:
            self._crop(axis, length)

    def _crop(self, axis: _SlotAxis, num_removed: int) -> None:
        if num_removed > 0:
            for i in axis.layers:
                self.cache.layers[i].crop(-num_removed)  # transformers crops a negative count
            axis.valid_RS = axis.valid_RS[:, : axis.num_slots - num_removed]
            axis.pos_RS = axis.pos_RS[:, : axis.valid_RS.shape[1]]


@dataclass
class Prefill:
    cache: DynamicCache  # n rows, right-padded to the longest prompt
    valid_nT: torch.Tensor  # bool, real prompt tokens
    lengths: list[int]
    last_logits_nV: torch.Tensor  # next-token logits after each prompt's last token
    features_nTF: torch.Tensor
    final_hidden_nTH: torch.Tensor


@torch.no_grad()
def prefill_requests(model: PreTrainedModel, prompts: Sequence[torch.Tensor],
                     layer_ids: Sequence[int]) -> Prefill:
    """Prefill several prompts in one right-padded forward (padding masked, positions from 0)."""
    device = prompts[0].device
    lengths = [int(p.shape[0]) for p in prompts]
    width = max(lengths)
    ids_nT = torch.stack([pad_entries(p.long(), width, 0) for p in prompts])
    slot_T = torch.arange(width, device=device)
    valid_nT = slot_T[None] < torch.tensor(lengths, device=device)[:, None]
    pos_nT = slot_T[None].expand(len(prompts), -1)
    layout = AttentionLayout.of(model)
    masks = {kind: layout.mask(kind, valid_nT, pos_nT, pos_nT) for kind in layout.layers}
    # Plain layers: a sliding layer of `DynamicCache(config=...)` would keep the padded batch's last
    # slots, not each prompt's last tokens; `BatchedTargetCache.compact` drops what a window left.
    cache = DynamicCache()
    stack = decoder_stack(model)
    with LayerOutputHooks(model, list(layer_ids)) as hooks:
        out = stack(input_ids=ids_nT, attention_mask=layout.pack(masks), position_ids=pos_nT,
                    **cache_kwargs(stack, cache), use_cache=True)
        hidden_nTH = out.last_hidden_state
        features_nTF = hooks.features(hidden_nTH)
    last_nH = hidden_nTH[torch.arange(len(prompts), device=device),
                         torch.tensor(lengths, device=device) - 1]
    return Prefill(cache, valid_nT, lengths, target_logits(model, last_nH), features_nTF,
                   hidden_nTH)
