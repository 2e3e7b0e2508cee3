"""Named `deepspec train` presets for short CPU runs on a small target (the main job's, the learning benchmark's).

A preset is a list of overrides per drafter kind; `kind_preset_overrides(kind, preset=...)` applies the ones the
kind has (block drafters: DSpark, DFlash; every kind with a draft vocabulary: Eagle3, DSpark, DFlash):
- `cpu` (the default): 2 draft layers, random init, the anchor fused with the latest context
  (`drafter.anchor_fusion=latest_context`, block/config.py), the reduced 8k draft vocabulary, and bf16 autocast
  where the CPU multiplies bf16 natively (`trainer.autocast=auto`). Issue 19 (recipes/README.md) measured the old
  preset's backbone ignoring its anchor and its latest context position: this one uses both.
- `cpu-v1`: the preset before issue 19: 2 layers copied from the target's last layers (and its final norm), 8k
  draft vocabulary.
- `paper`: the paper's configuration at the same depth: random layers, full vocabulary, the paper's random Markov
  start, no anchor fusion, fp32.
The 8k draft vocabulary cuts a CPU training step and a drafted block to about a quarter
(eval/bench_drafters.py --compare-vocab). DSpark's bigram start of the Markov head (issue 15) comes from its config
defaults (`drafter.markov_init`), so `deepspec train` alone gets it too; `paper` turns it off. `cpu` also starts
DSpark's backbone at zero (`drafter.final_norm_init=0`, block/config.py), so its first drafts are the bigram
start's: without it the random layers' logits swamp the Markov head and step 0 scores chance.
"""

from __future__ import annotations

from deepspec.drafters.spec import get_drafter_spec

CPU_DRAFT_LAYERS = 2
CPU_DRAFT_VOCAB = 8192
PRESETS = ("cpu", "cpu-v1", "paper")
DEFAULT_PRESET = "cpu"


def kind_preset_overrides(kind: str, draft_layers: int = CPU_DRAFT_LAYERS,
                          draft_vocab: int | None = CPU_DRAFT_VOCAB, preset: str = DEFAULT_PRESET) -> list[str]:
    """The kind's overrides of `preset` (module docstring); `draft_vocab=None` keeps the full vocabulary."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    spec = get_drafter_spec(kind)
    capabilities = spec.capabilities(spec.config_class())  # what the kind's default config can do
    block = capabilities.block_convention is not None
    if preset == "paper":
        draft_vocab = None
    overrides = []
    if block:
        overrides.append(f"drafter.num_draft_layers={draft_layers}")
        overrides.append(f"drafter.init_from_target={'true' if preset == 'cpu-v1' else 'false'}")
        if preset == "cpu":
            overrides.append("drafter.anchor_fusion=latest_context")
    if capabilities.draft_vocab and draft_vocab is not None:
        overrides.append(f"drafter.draft_vocab_size={draft_vocab}")
    if preset == "paper" and kind == "dspark":
        overrides.append("drafter.markov_init=random")
    if preset == "cpu" and kind == "dspark":
        overrides.append("drafter.final_norm_init=0")  # the backbone starts at zero: step 0 is the bigram floor
    if preset == "cpu":
        overrides.append("trainer.autocast=auto")
    return overrides


def preset_drafter_params(kind: str, preset: str = DEFAULT_PRESET) -> dict:
    """The `drafter.*` fields of a preset as build keywords (tests build the preset's drafter without Hydra)."""
    params = {}
    for override in kind_preset_overrides(kind, preset=preset):
        key, value = override.split("=", 1)
        if key.startswith("drafter."):
            params[key.removeprefix("drafter.")] = {"true": True, "false": False}.get(value, value)
    for key in ("num_draft_layers", "draft_vocab_size"):
        if key in params:
            params[key] = int(params[key])
    return params
