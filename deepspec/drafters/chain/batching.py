"""Sequence-level batches for the autoregressive drafters (Eagle3, MTP) from cached samples.

Samples are *packed* into rows of `max_tokens_per_row` tokens (first-fit decreasing): every token
carries its sequence id (-1 for padding) and its position inside its own sequence, and attention is
block-diagonal causal (a token sees earlier tokens of its own sequence only). Packing keeps the
padded fraction low; `pack=False` gives one sample per row (padding to the longest). A sample longer
than a row is truncated to the row length (reported in `num_truncated_tokens`).

Shifts never cross a sequence boundary: `shift_within_sequence(x, seq, k)[t] = x[t + k]` only if
`t + k` belongs to the same sequence (else `fill`). Labels are supervised only where the label token
is an assistant token (loss_mask) — `labels_at_shift`.

Cached feature columns: the cache may hold more layers than a drafter reads (e.g. 5 cached, Eagle3
reads 3); `feature_columns(cache_layer_ids, feature_layer_ids, H)` maps the chosen ids to column
slices of the cached `[T, m*H]` features, in the drafter's order.

Target distributions: from the cached final hidden state (`final_hidden_BTH`), or, from a top-k cache
(deepspec/cache/FORMAT.md), the target's top-k next-token ids and log-probs (`top_k_*_BTK`; no hidden states:
only a kind that declares that content in its spec trains on it).

Shape legend: B = rows, T = tokens per row, H = hidden, F = feature width (chosen layers * H), K = top-k entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepspec.drafters.spec import BatchCounts, BatchSettings
from deepspec.losses.distribution import IGNORE_INDEX

PADDING_SEQUENCE_ID = -1


@dataclass
class AutoregressiveBatch:
    input_ids_BT: torch.Tensor  # long, pad_token_id at padding
    loss_mask_BT: torch.Tensor  # bool, True at assistant tokens
    features_BTF: torch.Tensor  # chosen target layers, concatenated in the drafter's order
    final_hidden_BTH: torch.Tensor | None  # target hidden after its final norm (post-norm); None from a top-k cache
    sequence_ids_BT: torch.Tensor  # long, index into sample_ids; -1 at padding
    position_ids_BT: torch.Tensor  # long, position inside its own sequence (0 at padding)
    sample_ids: list
    padded_fraction: float
    num_truncated_tokens: int = 0
    top_k_ids_BTK: torch.Tensor | None = None  # long, top-k cache: the target's most likely next tokens (0 at padding)
    top_k_logprobs_BTK: torch.Tensor | None = None  # their log-probs over the whole vocabulary (0 at padding)

    @property
    def valid_BT(self) -> torch.Tensor:
        return self.sequence_ids_BT >= 0

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> AutoregressiveBatch:
        float_dtype = dtype or self.features_BTF.dtype

        def move(tensor, float_dtype=None):
            return None if tensor is None else tensor.to(device, float_dtype)

        # Log-probs stay float32: they are exponentiated into the target law (never rounded to bf16).
        return AutoregressiveBatch(
            input_ids_BT=self.input_ids_BT.to(device), loss_mask_BT=self.loss_mask_BT.to(device),
            features_BTF=self.features_BTF.to(device, float_dtype),
            final_hidden_BTH=move(self.final_hidden_BTH, float_dtype),
            sequence_ids_BT=self.sequence_ids_BT.to(device), position_ids_BT=self.position_ids_BT.to(device),
            sample_ids=self.sample_ids, padded_fraction=self.padded_fraction,
            num_truncated_tokens=self.num_truncated_tokens, top_k_ids_BTK=move(self.top_k_ids_BTK),
            top_k_logprobs_BTK=move(self.top_k_logprobs_BTK, torch.float32))


def feature_columns(cache_layer_ids: Sequence[int], feature_layer_ids: Sequence[int], hidden_size: int) -> torch.Tensor:
    """Column indices (LongTensor [len(feature_layer_ids) * H]) of the chosen layers in the cached features."""
    cache_ids = [int(i) for i in cache_layer_ids]
    columns = []
    for pos, layer in enumerate(feature_layer_ids):
        if int(layer) not in cache_ids:
            raise ValueError(f"feature_layer_ids[{pos}]={layer} is not in the cache's layer ids {cache_ids}")
        start = cache_ids.index(int(layer)) * hidden_size
        columns.append(torch.arange(start, start + hidden_size))
    if not columns:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(columns)


def _pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, no row above `capacity` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = min(lengths[index], capacity)
        for row, space in enumerate(free):
            if length <= space:
                rows[row].append(index)
                free[row] -= length
                break
        else:
            rows.append([index])
            free.append(capacity - length)
    return rows


def collate_autoregressive(samples: Sequence, *, cache_layer_ids: Sequence[int], feature_layer_ids: Sequence[int],
                           max_tokens_per_row: int, pack: bool = True, pad_token_id: int = 0) -> AutoregressiveBatch:
    """Pack (or pad) cached samples into an `AutoregressiveBatch` (see module docstring).

    Each sample has `input_ids [T]`, `loss_mask [T]`, `features [T, m*H]` (m = len(cache_layer_ids)),
    `final_hidden [T, H]` (or None, with `top_k_ids [T, K]` and `top_k_logprobs [T, K]` instead) and `sample_id`.
    """
    if not samples:
        raise ValueError("collate_autoregressive: no samples")
    if int(max_tokens_per_row) != max_tokens_per_row or max_tokens_per_row < 2:
        raise ValueError(f"max_tokens_per_row={max_tokens_per_row!r} must be an integer >= 2")
    has_hidden = samples[0].final_hidden is not None
    top_k = None if has_hidden else samples[0].top_k_ids.shape[-1]
    hidden_size = samples[0].final_hidden.shape[-1] if has_hidden else 0
    columns_F = feature_columns(cache_layer_ids, feature_layer_ids, hidden_size)
    cached_width = len(list(cache_layer_ids)) * hidden_size
    for index, sample in enumerate(samples):
        length = sample.input_ids.shape[0]
        target_ok = (sample.final_hidden is not None and sample.final_hidden.shape == (length, hidden_size)) \
            if has_hidden else (sample.final_hidden is None and getattr(sample, "top_k_ids", None) is not None
                                and sample.top_k_ids.shape == sample.top_k_logprobs.shape == (length, top_k))
        if sample.features.shape != (length, cached_width) or not target_ok or sample.loss_mask.shape[0] != length:
            target = (f"final_hidden {tuple(sample.final_hidden.shape)}" if sample.final_hidden is not None else
                      f"top_k_ids {tuple(getattr(sample.top_k_ids, 'shape', ()))}")
            raise ValueError(f"sample {index} ({getattr(sample, 'sample_id', '?')}): inconsistent shapes input_ids "
                             f"{tuple(sample.input_ids.shape)}, loss_mask {tuple(sample.loss_mask.shape)}, features "
                             f"{tuple(sample.features.shape)} (expected [T, {cached_width}]), {target}")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    if pack:
        rows = _pack_rows(lengths, int(max_tokens_per_row))
        row_len = int(max_tokens_per_row) if len(rows) > 1 else min(int(max_tokens_per_row), sum(lengths))
    else:
        rows = [[i] for i in range(len(samples))]
        row_len = min(int(max_tokens_per_row), max(lengths))
    num_rows = len(rows)
    feat_dtype = samples[0].features.dtype if samples[0].features.dtype.is_floating_point else torch.float32
    input_ids_BT = torch.full((num_rows, row_len), pad_token_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(num_rows, row_len, dtype=torch.bool)
    features_BTF = torch.zeros(num_rows, row_len, columns_F.shape[0], dtype=feat_dtype)
    final_hidden_BTH = torch.zeros(num_rows, row_len, hidden_size, dtype=samples[0].final_hidden.dtype) \
        if has_hidden else None
    top_k_ids_BTK = None if has_hidden else torch.zeros(num_rows, row_len, top_k, dtype=torch.long)
    top_k_logprobs_BTK = None if has_hidden else torch.zeros(num_rows, row_len, top_k, dtype=torch.float32)
    sequence_ids_BT = torch.full((num_rows, row_len), PADDING_SEQUENCE_ID, dtype=torch.long)
    position_ids_BT = torch.zeros(num_rows, row_len, dtype=torch.long)
    truncated = 0
    for row, members in enumerate(rows):
        cursor = 0
        for index in members:
            sample = samples[index]
            length = min(lengths[index], row_len - cursor)
            truncated += lengths[index] - length
            span = slice(cursor, cursor + length)
            input_ids_BT[row, span] = torch.as_tensor(sample.input_ids[:length]).long()
            loss_mask_BT[row, span] = torch.as_tensor(sample.loss_mask[:length]).bool()
            features_BTF[row, span] = sample.features[:length].index_select(1, columns_F).to(feat_dtype)
            if has_hidden:
                final_hidden_BTH[row, span] = sample.final_hidden[:length]
            else:
                top_k_ids_BTK[row, span] = sample.top_k_ids[:length]
                top_k_logprobs_BTK[row, span] = sample.top_k_logprobs[:length].float()
            sequence_ids_BT[row, span] = index
            position_ids_BT[row, span] = torch.arange(length)
            cursor += length
    num_real = int((sequence_ids_BT >= 0).sum())
    return AutoregressiveBatch(
        input_ids_BT=input_ids_BT, loss_mask_BT=loss_mask_BT, features_BTF=features_BTF,
        final_hidden_BTH=final_hidden_BTH, sequence_ids_BT=sequence_ids_BT, position_ids_BT=position_ids_BT,
        sample_ids=[getattr(s, "sample_id", i) for i, s in enumerate(samples)],
        padded_fraction=1.0 - num_real / float(num_rows * row_len), num_truncated_tokens=truncated,
        top_k_ids_BTK=top_k_ids_BTK, top_k_logprobs_BTK=top_k_logprobs_BTK)


def shift_within_sequence(values_BT: torch.Tensor, sequence_ids_BT: torch.Tensor, shift: int,
                          fill) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values[t + shift], same_sequence)` per token; `fill` where t + shift leaves the token's sequence.

    Works for [B, T] and [B, T, ...] values; returns the shifted values and a bool [B, T] validity mask.
    """
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    num_tokens = sequence_ids_BT.shape[1]
    if shift == 0:
        return values_BT, sequence_ids_BT >= 0
    if isinstance(fill, torch.Tensor):
        shifted = fill.expand_as(values_BT).clone()
    else:
        shifted = torch.full_like(values_BT, fill)
    same_BT = torch.zeros_like(sequence_ids_BT, dtype=torch.bool)
    if shift < num_tokens:
        shifted[:, : num_tokens - shift] = values_BT[:, shift:]
        same_BT[:, : num_tokens - shift] = (sequence_ids_BT[:, shift:] == sequence_ids_BT[:, :-shift]) & \
            (sequence_ids_BT[:, :-shift] >= 0)
    fill_value = fill if isinstance(fill, torch.Tensor) else torch.tensor(fill, dtype=values_BT.dtype)
    mask = same_BT.reshape(*same_BT.shape, *([1] * (values_BT.dim() - 2)))
    shifted = torch.where(mask, shifted, fill_value.to(values_BT.device, values_BT.dtype))
    return shifted, same_BT


def labels_at_shift(input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor, sequence_ids_BT: torch.Tensor,
                    shift: int) -> torch.Tensor:
    """Label `x[t + shift]` at each token, IGNORE_INDEX unless it is an assistant token of the same sequence."""
    ids_BT, same_BT = shift_within_sequence(input_ids_BT, sequence_ids_BT, shift, IGNORE_INDEX)
    mask_BT, _ = shift_within_sequence(loss_mask_BT, sequence_ids_BT, shift, False)
    return torch.where(same_BT & mask_BT, ids_BT, torch.full_like(ids_BT, IGNORE_INDEX))


def packed_causal_mask(sequence_ids_BT: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [B, 1, T, T] (True = may attend): same sequence and key <= query.

    Padding tokens (sequence id -1) share one "sequence" so each attends at least to itself (no NaN rows).
    """
    num_tokens = sequence_ids_BT.shape[1]
    causal_TT = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=sequence_ids_BT.device).tril()
    same_BTT = sequence_ids_BT[:, :, None] == sequence_ids_BT[:, None, :]
    return (same_BTT & causal_TT)[:, None]


class ChainBatcher:
    """The spec's batcher for chain drafters: cached samples packed into rows of `max_tokens_per_row`."""

    def __init__(self, config, settings: BatchSettings):
        self.settings = settings

    def collate(self, samples: Sequence, epoch: int = 0) -> AutoregressiveBatch:
        s = self.settings
        return collate_autoregressive(samples, cache_layer_ids=s.cache_layer_ids, feature_layer_ids=s.feature_layer_ids,
                                      max_tokens_per_row=s.max_tokens_per_row, pad_token_id=s.pad_token_id)

    @staticmethod
    def counts(batch: AutoregressiveBatch) -> BatchCounts:
        return BatchCounts(int(batch.valid_BT.sum()), int(batch.loss_mask_BT.sum()))
