"""Target layer ids: one explicit convention, the default spread, and validation.

Convention (written into cache metadata and drafter configs as LAYER_ID_CONVENTION):
layer id `l` is the *output of decoder layer l*, i.e. transformers' `hidden_states[l + 1]`
(`hidden_states[0]` is the embedding output). SGLang's Eagle3 aux ids use the same sense;
vLLM's speculators count the *input* of layer l, which is our id + 1 (see `to_input_of_layer`).
Valid ids are 0..L-2: `hidden_states[-1]` is taken after the final norm, so the last layer's raw
output is not what `hidden_states` exposes and we do not offer it.
"""

from __future__ import annotations

LAYER_ID_CONVENTION = "output_of_layer"
# Feature layers a cache stores and a drafter fuses by default: the paper gives every drafter the same target
# layers (DeepSpec's reference: 5), so the block drafters and Eagle3 read the same cached layers.
DEFAULT_NUM_FEATURE_LAYERS = 5


def spread_layer_ids(num_layers: int, num_points: int) -> list[int]:
    """`num_points` ids evenly spread from layer 1 to layer L-3 (the paper's choice); each drafter kind's spec says how
    many it reads by default (`DrafterSpec.default_feature_layers`).

    36 layers -> [1, 9, 17, 25, 33]; 40 -> [1, 10, 19, 28, 37]; 30 -> [1, 8, 14, 21, 27].
    """
    if num_points <= 0:
        return []
    if num_layers - 3 < num_points:
        # Too shallow for distinct ids in 1..L-3 (tiny test targets): spread over 0..L-2 instead.
        last = max(num_layers - 2, 0)
        ids = [round(i * last / max(num_points - 1, 1)) for i in range(num_points)]
        return sorted(set(ids))
    first, last = 1, num_layers - 3
    if num_points == 1:
        return [last]
    step = (last - first) / (num_points - 1)
    ids = [int(first + i * step + 0.5) for i in range(num_points)]
    return sorted(set(ids))


def validate_layer_ids(layer_ids: list[int], num_layers: int, field: str = "target_layer_ids") -> list[int]:
    """Check ids against the target depth before any compute; return them as a plain list."""
    ids = [int(i) for i in layer_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{field}={ids} contains duplicates")
    for pos, layer in enumerate(ids):
        if not 0 <= layer <= num_layers - 2:
            raise ValueError(
                f"{field}[{pos}]={layer} is out of range: the target has {num_layers} layers and ids "
                f"follow the '{LAYER_ID_CONVENTION}' convention (valid 0..{num_layers - 2})"
            )
    return ids


def to_input_of_layer(layer_ids: list[int]) -> list[int]:
    """Convert our 'output of layer l' ids to the 'input of layer l' convention (vLLM speculators)."""
    return [i + 1 for i in layer_ids]


def from_input_of_layer(layer_ids: list[int]) -> list[int]:
    return [i - 1 for i in layer_ids]
