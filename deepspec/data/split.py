"""Train / validation / test split by a seeded hash of each conversation id.

Hashing ids (instead of shuffling the list) makes the split deterministic for a seed *and* stable when
conversations are added or reordered: a conversation never moves to another split because the data
set grew. Conversations sharing an id (exact duplicates in ShareGPT) land in the same split, so
duplicates never leak between train and evaluation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from deepspec.data.sources import Conversation

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "validation", "test")


def split_unit_interval(conversation_id: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, id)."""
    digest = hashlib.sha256(f"{seed}\x00{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_conversations(convs: Sequence[Conversation], seed: int, val_fraction: float,
                        test_fraction: float) -> dict[str, list[Conversation]]:
    """Assign each conversation to train/validation/test; input order is kept inside each split."""
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1)")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(f"val_fraction + test_fraction = {val_fraction + test_fraction} leaves no training data")
    splits: dict[str, list[Conversation]] = {name: [] for name in SPLIT_NAMES}
    for conv in convs:
        u = split_unit_interval(conv.id, seed)
        name = "test" if u < test_fraction else "validation" if u < test_fraction + val_fraction else "train"
        splits[name].append(conv)
    log.info("split (seed %d): %s", seed, ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return splits
