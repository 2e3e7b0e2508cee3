"""In-memory cached samples straight from the target (smoke tests, small experiments): no files written.

`capture_samples(target, token_ids, layer_ids, loss_masks)` gives the `CachedSample`s a cache reader would
return for the same tokens and layers (float32, every token supervised unless `loss_masks` says otherwise),
the target's log-normaliser included.

Shape legend: T = tokens of one sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepspec.cache.reader import CachedSample
from deepspec.targets.features import capture_features, target_log_normalizer


def capture_samples(target, token_ids: Sequence[Sequence[int]], layer_ids: list[int],
                    loss_masks: Sequence[Sequence[bool]] | None = None) -> list[CachedSample]:
    """In-memory `CachedSample`s from `capture_features`; without `loss_masks` every token is supervised."""
    samples = []
    for index, ids in enumerate(token_ids):
        ids_1T = torch.as_tensor(list(ids), dtype=torch.long, device=target.model.device)[None]
        feats = capture_features(target.model, ids_1T, None, layer_ids)
        mask_T = torch.ones(ids_1T.shape[1], dtype=torch.bool)
        if loss_masks is not None:
            mask_T = torch.as_tensor(list(loss_masks[index]), dtype=torch.bool)
            if mask_T.shape != mask_T.new_empty(ids_1T.shape[1]).shape:
                raise ValueError(f"loss_masks[{index}] has {mask_T.numel()} entries for {ids_1T.shape[1]} tokens")
        samples.append(CachedSample(sample_id=str(index), input_ids=ids_1T[0].cpu(), loss_mask=mask_T,
                                    features=feats.features_BTF[0].cpu(), final_hidden=feats.final_hidden_BTH[0].cpu(),
                                    target_lse=target_log_normalizer(target.model, feats.final_hidden_BTH[0]).cpu()))
    return samples
