"""The draft side's KV cache: one class for every drafter (block context K/V, Eagle3 / MTP chain K/V).

Per draft layer it holds keys/values `[B, K, C, D]` (C cached entries). Two ways in:
  * `append(keys, values, positions_BC, valid_BC)` - all layers at once, with each entry's absolute
    position and whether it is real (block drafters: context K/V of accepted tokens; rows of a batch
    advance by different counts, so padding entries are marked invalid);
  * `update(key_states, value_states, layer_idx)` - one layer at a time, the protocol transformers'
    attention modules call on a `cache=` object (chain drafters run the family's own attention over it).
Edits (no caller touches the tensors directly): `crop` (drop speculative/rejected entries), `select_rows`
(finished requests leave a batch), `merge` (a new request joins: entries right-padded, padding invalid),
`compact` (gather each row's valid entries to the front). `visible_BC(anchor_pos_B)` says which entries a
block anchored at `anchor_pos_B` may attend to (valid and strictly before the anchor).

Shape legend: B = rows, K = key/value heads, C = cached entries, D = head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_entries(tensor: torch.Tensor, length: int, dim: int, value=0) -> torch.Tensor:
    """Right-pad `tensor` along `dim` to `length` with `value` (unchanged when already that long)."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


class DraftKVCache:
    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [B, K, C, D]
        self.values: dict[int, torch.Tensor] = {}
        self.positions_BC: torch.Tensor | None = None  # tracked by `append` users only
        self.valid_BC: torch.Tensor | None = None

    # -- sizes ------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Entries stored for `layer_idx` (default: any layer; all layers of one cache advance together)."""
        if layer_idx is None:
            layer_idx = next(iter(self.keys), None)
        return int(self.keys[layer_idx].shape[-2]) if layer_idx in self.keys else 0

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def layer_kv(self, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer 0..num_layers-1 its (keys, values), or None while the cache is empty."""
        return [(self.keys[i], self.values[i]) if i in self.keys else None for i in range(num_layers)]

    # -- writing ----------------------------------------------------------------------------------
    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions_BC: torch.Tensor,
               valid_BC: torch.Tensor) -> None:
        """Append entries to every layer (layer i gets keys[i]), with their positions and validity."""
        if self.positions_BC is None:
            self.keys, self.values = dict(enumerate(keys)), dict(enumerate(values))
            self.positions_BC, self.valid_BC = positions_BC.clone(), valid_BC.clone()
            return
        if positions_BC.shape[0] != self.positions_BC.shape[0]:
            raise ValueError(f"batch size {positions_BC.shape[0]} differs from the cache's "
                             f"{self.positions_BC.shape[0]}")
        for i, (k, v) in enumerate(zip(keys, values)):
            self.keys[i] = torch.cat([self.keys[i], k], dim=2)
            self.values[i] = torch.cat([self.values[i], v], dim=2)
        self.positions_BC = torch.cat([self.positions_BC, positions_BC], dim=1)
        self.valid_BC = torch.cat([self.valid_BC, valid_BC], dim=1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' cache protocol: append this layer's new K/V and return everything stored for it."""
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return self.keys[layer_idx], self.values[layer_idx]

    # -- editing ----------------------------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every layer."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} must lie in [0, {self.length}]")
        for i in list(self.keys):
            self.keys[i] = self.keys[i][..., :length, :]
            self.values[i] = self.values[i][..., :length, :]
        if self.positions_BC is not None:
            self.positions_BC = self.positions_BC[:, :length]
            self.valid_BC = self.valid_BC[:, :length]

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep the listed rows, in that order (an empty list empties the cache)."""
        if not rows:
            self.__init__()
            return
        device = next(iter(self.keys.values())).device if self.keys else None
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        self.keys = {i: k[index] for i, k in self.keys.items()}
        self.values = {i: v[index] for i, v in self.values.items()}
        if self.positions_BC is not None:
            self.positions_BC = self.positions_BC[index]
            self.valid_BC = self.valid_BC[index]

    def merge(self, other: DraftKVCache) -> None:
        """Append `other`'s rows after this cache's rows; both are right-padded to a common entry count
        (padding entries are invalid, hence never attended)."""
        if not other.length:
            return
        if not self.length:
            self.keys, self.values = dict(other.keys), dict(other.values)
            self.positions_BC, self.valid_BC = other.positions_BC, other.valid_BC
            return
        width = max(self.length, other.length)
        self.keys = {i: torch.cat([pad_entries(self.keys[i], width, 2), pad_entries(other.keys[i], width, 2)])
                     for i in self.keys}
        self.values = {i: torch.cat([pad_entries(self.values[i], width, 2), pad_entries(other.values[i], width, 2)])
                       for i in self.values}
        self.positions_BC = torch.cat([pad_entries(self.positions_BC, width, 1),
                                       pad_entries(other.positions_BC, width, 1)])
        self.valid_BC = torch.cat([pad_entries(self.valid_BC, width, 1, False),
                                   pad_entries(other.valid_BC, width, 1, False)])

    @property
    def num_holes(self) -> int:
        """Invalid entries over all rows (0 when validity is not tracked)."""
        return 0 if self.valid_BC is None else int((~self.valid_BC).sum())

    def compact(self) -> None:
        """Gather each row's valid entries to the front, in order; drop entries no row uses."""
        counts_B = self.valid_BC.sum(dim=1)
        width = int(counts_B.max())
        # Stable sort puts each row's valid entries first, in their original order.
        order_BC = torch.sort((~self.valid_BC).to(torch.int8), dim=1, stable=True).indices[:, :width]
        gather = order_BC[:, None, :, None]
        self.keys = {i: k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[3])) for i, k in self.keys.items()}
        self.values = {i: v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[3])) for i, v in self.values.items()}
        self.positions_BC = self.positions_BC.gather(1, order_BC)
        self.valid_BC = torch.arange(width, device=counts_B.device)[None, :] < counts_B[:, None]

    # -- reading ----------------------------------------------------------------------------------
    def visible_BC(self, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """Which cached entries a block anchored at `anchor_pos_B` may attend to."""
        if self.positions_BC is None:
            return torch.zeros(anchor_pos_B.shape[0], 0, dtype=torch.bool, device=anchor_pos_B.device)
        return self.valid_BC & (self.positions_BC < anchor_pos_B[:, None])
