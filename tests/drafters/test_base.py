"""DrafterModel base: a drafter loaded from disk owns its tensors and computes exactly what the saved one did.

transformers memory-maps the safetensors file; tensors left as views of that mapping sit at arbitrary
byte offsets (MKL then takes other vector paths: last-bit differences in the confidence head, seen on
AMD EPYC with every ATen kernel set) and change when the file is rewritten.
`DrafterModel.from_pretrained` copies them out.

Shape legend: B = batch, C = context tokens, F = features, G = block size.
"""

from __future__ import annotations

import pytest
import torch

from deepspec.drafters.build import build_drafter, load_drafter
from deepspec.export import load_checkpoint

# c10's CPU allocator aligns every allocation to 64 bytes (c10::gAlignment; 16 only in mobile builds).
ALLOCATOR_ALIGNMENT = 64

KINDS = {
    "dspark-markov": ("dspark", {"num_draft_layers": 2, "markov_rank": 8}),
    "dspark-rnn": ("dspark", {"num_draft_layers": 1, "markov_rank": 4, "sequential_head": "rnn"}),
    "eagle3": ("eagle3", {"draft_vocab_size": 100, "target_layer_ids": [0, 1, 2]}),
    "mtp": ("mtp", {"num_mtp_modules": 2}),
    "standalone": ("standalone", {"num_draft_layers": 2}),
    "standalone-own": ("standalone", {"num_draft_layers": 1, "share_target_embeddings": False}),
}


def _random_drafter(kind, target, **overrides):
    """Every weight randomised (norms around 1), so each tensor matters to the outputs."""
    torch.manual_seed(0)
    model = build_drafter(kind, target, **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def _not_owned(model) -> list[str]:
    """Names of parameters/buffers whose storage torch's allocator did not make (a file mapping, a foreign
    buffer: not resizable) or that start off the allocator's alignment."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, tensor in tensors
            if not tensor.untyped_storage().resizable() or tensor.data_ptr() % ALLOCATOR_ALIGNMENT]


@pytest.mark.parametrize("case", sorted(KINDS))
def test_loaded_drafter_owns_aligned_storage_independent_of_its_file(case, tiny_qwen3, tmp_path):
    kind, overrides = KINDS[case]
    model = _random_drafter(kind, tiny_qwen3, **overrides)
    model.save_pretrained(tmp_path)
    loaded = {"load_drafter": load_drafter(tmp_path, tiny_qwen3), "load_checkpoint": load_checkpoint(tmp_path)}
    for how, reloaded in loaded.items():
        assert _not_owned(reloaded) == [], how
    # Rewriting the file in place (a re-export, a checkpoint overwritten) leaves loaded drafters unchanged.
    weights = tmp_path / "model.safetensors"
    header_end = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with weights.open("r+b") as handle:
        handle.seek(header_end)
        handle.write(bytes(weights.stat().st_size - header_end))
    saved = model.state_dict()
    for how, reloaded in loaded.items():
        changed = [name for name, value in reloaded.state_dict().items() if not torch.equal(value, saved[name])]
        assert changed == [], f"{how}: {changed[:3]} changed with the file"


@pytest.mark.float_exact
@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_gemma3"])
def test_reloaded_dspark_confidence_is_bit_identical(family, request, tmp_path):
    """Same weights, same inputs, same computation: the confidence (a 1-output Linear) too, on any CPU."""
    target = request.getfixturevalue(family)
    model = _random_drafter("dspark", target, **KINDS["dspark-markov"][1])
    model.save_pretrained(tmp_path)
    reloaded = load_drafter(tmp_path, target).eval()
    generator = torch.Generator().manual_seed(1)
    num_features = len(model.config.target_layer_ids) * model.config.hidden_size
    features_BCF = torch.randn(2, 5, num_features, generator=generator)
    positions_BC = torch.arange(5).expand(2, 5)
    anchors_B = torch.randint(0, model.config.target_vocab_size, (2,), generator=generator)
    anchor_pos_B = torch.full((2,), 5)

    def greedy(logits_BV, slot):
        return logits_BV.argmax(-1), None

    with torch.no_grad():
        proposals = [m.propose(m.extend_context(m.new_decode_state(), features_BCF, positions_BC), anchors_B,
                               anchor_pos_B, greedy) for m in (model, reloaded)]
    assert torch.equal(proposals[0].token_ids_BK, proposals[1].token_ids_BK)
    assert torch.equal(proposals[0].confidence_BK, proposals[1].confidence_BK), "confidence differs after reload"
