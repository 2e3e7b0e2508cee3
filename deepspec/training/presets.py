"""Per-kind `deepspec train` overrides for short CPU runs on a small target (the learning benchmark's preset).

Block drafters (DSpark, DFlash): `num_draft_layers` layers copied from the target (its last layers and final
norm, so the shared LM head sees hidden states on the target's scale). Every kind with a draft vocabulary
(Eagle3, DSpark, DFlash): the reduced one (the most frequent assistant tokens), which cuts a CPU training step
and a drafted block to about a quarter (eval/bench_drafters.py --compare-vocab). DSpark's
recipe for fast learning (issue 15, measured in recipes/README.md) comes from its config defaults
(`drafter.markov_init`, `optim.lr`), not from here, so `deepspec train` alone gets it too.
"""

from __future__ import annotations

from deepspec.drafters.spec import get_drafter_spec

CPU_DRAFT_LAYERS = 2
CPU_DRAFT_VOCAB = 8192


def kind_preset_overrides(kind: str, draft_layers: int = CPU_DRAFT_LAYERS,
                          draft_vocab: int | None = CPU_DRAFT_VOCAB) -> list[str]:
    """The kind's CPU preset as `deepspec train` overrides (module docstring); `draft_vocab=None` keeps the full
    vocabulary."""
    spec = get_drafter_spec(kind)
    capabilities = spec.capabilities(spec.config_class())  # what the kind's default config can do
    overrides = []
    if capabilities.block_convention is not None:
        overrides += [f"drafter.num_draft_layers={draft_layers}", "drafter.init_from_target=true"]
    if capabilities.draft_vocab and draft_vocab is not None:
        overrides.append(f"drafter.draft_vocab_size={draft_vocab}")
    return overrides
