"""Helpers shared by the drafter tests."""

from __future__ import annotations

import torch

from deepspec.cache.reader import CachedSample
from deepspec.targets.features import capture_features, top_k_logprobs


def make_chain_samples(target, lengths, layer_ids=(), seed=0, prompt_len=3, top_k=None) -> list[CachedSample]:
    """Cached samples of random ids with the target's features at `layer_ids` (none by default) and its final hidden
    state, or (with `top_k`) its top-k next-token ids and log-probs instead of the final hidden state; the first
    `prompt_len` positions are prompt (loss mask off)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for index, length in enumerate(lengths):
        ids_1T = torch.randint(20, 1000, (1, length), generator=g)
        feats = capture_features(target.model, ids_1T, None, list(layer_ids))
        mask = torch.ones(length, dtype=torch.bool)
        mask[:prompt_len] = False
        if top_k is None:
            samples.append(CachedSample(f"s{index}", ids_1T[0], mask, feats.features_BTF[0], feats.final_hidden_BTH[0]))
        else:
            ids_TK, logprobs_TK = top_k_logprobs(target.model, feats.final_hidden_BTH[0], top_k)
            samples.append(CachedSample(f"s{index}", ids_1T[0], mask, feats.features_BTF[0], None,
                                        top_k_ids=ids_TK, top_k_logprobs=logprobs_TK))
    return samples
