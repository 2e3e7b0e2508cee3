"""The target's forward over a batch of planned samples, and the one conversion of what it computes to the tensors
a shard stores: what the cache build and online training both run, so both hold the same bytes.

Shape legend: B = batch, T = tokens, H = hidden size, M = feature layers, F = M * H, K = top-k entries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepspec.cache import format as fmt
from deepspec.cache.plan import PlannedSample
from deepspec.targets.features import capture_features, lm_head_weight, target_log_normalizer, top_k_logprobs
from deepspec.targets.sharding import gathered


def pad_batch(batch: Sequence[PlannedSample], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding to the longest sample: with causal attention the real tokens never see the pad tokens."""
    max_len = max(sample.length for sample in batch)
    input_ids_BT = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(batch), max_len), dtype=torch.long)
    for b, sample in enumerate(batch):
        input_ids_BT[b, :sample.length] = sample.input_ids
        attention_mask_BT[b, :sample.length] = 1
    return input_ids_BT.to(device), attention_mask_BT.to(device)


@dataclass
class CapturedSample:
    """What the target produced for one sample of a batch, padding stripped (the inputs of `ShardWriter.add`)."""

    features_TF: torch.Tensor
    final_hidden_TH: torch.Tensor
    target_lse_T: torch.Tensor | None = None
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None


def capture_batch(model, batch: Sequence[PlannedSample], layer_ids: Sequence[int], *, storage_dtype: str,
                  content: str, top_k: int | None, pad_token_id: int, partitioned: bool = False,
                  target_lse: bool = True) -> list[CapturedSample]:
    """One forward of the target over the batch, right-padded, longest first (`pad_batch`) -> per-sample captures
    on the CPU, in the order of `batch`. The build's computation; online training calls it with its micro-batches
    (or with one sample: the computation of `cache.batch_size=1`). `partitioned`: a ZeRO-3 target
    (deepspec.targets.sharding), whose LM head is gathered for the log-normaliser; every rank must call this
    together then. `target_lse=False` leaves the log-normaliser out (online training whose drafter does not
    read it: a quarter of a small target's arithmetic)."""
    order = sorted(range(len(batch)), key=lambda b: (-batch[b].length, batch[b].position))
    padded = [batch[b] for b in order]
    device = next(model.parameters()).device
    input_ids_BT, attention_mask_BT = pad_batch(padded, pad_token_id, device)
    captured = capture_features(model, input_ids_BT, attention_mask_BT, list(layer_ids))
    features_BTF = captured.features_BTF.cpu()
    out: list[CapturedSample | None] = [None] * len(batch)
    with gathered([lm_head_weight(model)], partitioned and (target_lse or content == fmt.CONTENT_TOP_K)):
        for row, b in enumerate(order):  # strip the padding: only real tokens are stored
            length = batch[b].length
            out[b] = finish_capture(model, features_BTF[row, :length],
                                    captured.final_hidden_BTH[row, :length],
                                    storage_dtype=storage_dtype, content=content, top_k=top_k,
                                    target_lse=target_lse)
    return out


def finish_capture(model, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor, *,
                   storage_dtype: str, content: str, top_k: int | None,
                   target_lse: bool = True) -> CapturedSample:
    """One sample's capture from its layer features and its exact final hidden state (after the
    final norm): what the target's head adds (the log-normaliser, or the top-k), whoever computed
    the hidden states (the target's forward here, a serving engine in
    deepspec.cache.engine_source)."""
    # The log-normaliser of the logits the losses will recompute: from the final hidden as stored
    # (rounded).
    stored_hidden_TH = final_hidden_TH.to(fmt.final_hidden_torch_dtype(storage_dtype))
    item = CapturedSample(features_TF, stored_hidden_TH.cpu())
    if content == fmt.CONTENT_TOP_K:  # the next-token law, from the exact (un-rounded) final hidden
        ids_TK, logprobs_TK = top_k_logprobs(model, final_hidden_TH, top_k)
        item.top_k = (ids_TK.cpu(), logprobs_TK.cpu())
    elif target_lse:
        item.target_lse_T = target_log_normalizer(model, stored_hidden_TH).cpu()
    return item


def stored_sample_tensors(sample: PlannedSample, features_TF: torch.Tensor | None, final_hidden_TH: torch.Tensor | None,
                          target_lse_T: torch.Tensor | None, top_k: tuple[torch.Tensor, torch.Tensor] | None, *,
                          content: str, storage_dtype: str, num_feature_layers: int) -> dict[str, torch.Tensor]:
    """One sample's tensors exactly as a shard stores them (names and dtypes of FORMAT.md), in shard order.
    The one conversion from captured features to stored bytes: the writer and online training both use it."""
    stored = {fmt.TENSOR_INPUT_IDS: sample.input_ids, fmt.TENSOR_LOSS_MASK: sample.loss_mask}
    if content == fmt.CONTENT_TOP_K:
        ids_TK, logprobs_TK = top_k
        stored[fmt.TENSOR_TOP_K_IDS] = ids_TK.to(torch.int32)
        stored[fmt.TENSOR_TOP_K_LOGPROBS] = logprobs_TK.to(fmt.top_k_logprobs_torch_dtype(storage_dtype))
    else:
        stored[fmt.TENSOR_FINAL_HIDDEN] = final_hidden_TH.to(fmt.final_hidden_torch_dtype(storage_dtype))
        if target_lse_T is not None:  # None only in online training that does not read it (never in a cache)
            stored[fmt.TENSOR_TARGET_LSE] = target_lse_T.float()
    if content == fmt.CONTENT_HIDDEN and num_feature_layers:  # none in top-k / final-hidden-only caches
        if storage_dtype != "fp8":
            stored[fmt.TENSOR_FEATURES] = features_TF.to(fmt.feature_torch_dtype(storage_dtype))
        else:
            stored[fmt.TENSOR_FEATURES], stored[fmt.TENSOR_FEATURES_SCALE] = fmt.quantize_fp8(features_TF,
                                                                                              num_feature_layers)
    return stored


def fp8_error_sums(features_TF: torch.Tensor | None, stored: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(squared error, squared reference) of fp8-stored features against the captured ones; (0, 0) otherwise."""
    if fmt.TENSOR_FEATURES_SCALE not in stored:
        return 0.0, 0.0
    reference_TF = features_TF.double()
    error_TF = fmt.dequantize_fp8(stored[fmt.TENSOR_FEATURES], stored[fmt.TENSOR_FEATURES_SCALE],
                                  torch.float64) - reference_TF
    return float(error_TF.square().sum()), float(reference_TF.square().sum())
