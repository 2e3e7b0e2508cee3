"""Per-kind `deepspec train` overrides for short CPU runs on a small target (the learning benchmark's preset).

Block drafters (DSpark, DFlash): `num_draft_layers` layers copied from the target (its last layers and final
norm, so the shared LM head sees hidden states on the target's scale). Eagle3: the reduced draft vocabulary
(its standard option; the most frequent assistant tokens), so its step stays near the others'. DSpark's
recipe for fast learning (issue 15, measured in recipes/README.md) comes from its config defaults
(`drafter.markov_init`, `optim.lr`), not from here, so `deepspec train` alone gets it too.
"""

from __future__ import annotations

from deepspec.drafters.spec import get_drafter_spec

CPU_DRAFT_LAYERS = 2
CPU_DRAFT_VOCAB = 8192


def kind_preset_overrides(kind: str, draft_layers: int = CPU_DRAFT_LAYERS, draft_vocab: int = CPU_DRAFT_VOCAB) -> list[str]:
    """The kind's CPU preset as `deepspec train` overrides (module docstring)."""
    spec = get_drafter_spec(kind)
    capabilities = spec.capabilities(spec.config_class())  # what the kind's default config can do
    overrides = []
    if capabilities.block_convention is not None:
        overrides += [f"drafter.num_draft_layers={draft_layers}", "drafter.init_from_target=true"]
    if capabilities.draft_vocab:
        overrides.append(f"drafter.draft_vocab_size={draft_vocab}")
    return overrides
