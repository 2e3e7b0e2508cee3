"""A training step's loss reads no value back from the device, for every drafter kind, with the full and with a
reduced draft vocabulary: the objectives check shapes and dtypes only, and the values only behind `loss.check_values`
(the debug switch). A read is any tensor-to-host conversion (`item`, `tolist`, `bool`, `int`, `float`, `.cpu()`,
`.numpy()`) made by the loss code itself (deepspec/losses, the kinds' objectives, the draft-vocabulary maps); on a
GPU each one would wait for the device. The drafters' own forwards are not the loss and are not counted here."""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import deepspec
from deepspec.cache.memory import capture_samples
from deepspec.drafters.spec import BatchSettings, drafter_kinds, spec_of
from deepspec.training.objective import compute_training_loss

torch.set_num_threads(1)

PACKAGE = Path(deepspec.__file__).parent
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
IDS = [[1, 5, 77, 912, 33, 4001, 17, 300, 42, 9, 8, 7, 6, 5, 4, 3, 2000, 1500],
       [7, 8, 9, 10, 11, 12, 13, 14, 15, 99, 3, 4, 1000, 20, 30, 40]]


def _loss_code(filename: str) -> bool:
    path = Path(filename)
    if not path.is_relative_to(PACKAGE):
        return False
    parts = path.relative_to(PACKAGE).parts
    return (parts[0] == "losses" or path.name == "objective.py"
            or parts[:2] == ("drafters", "draft_vocab.py"))


class HostReads:
    """Counts the tensor-to-host reads whose caller is loss code, by caller (file:line)."""

    def __init__(self, monkeypatch):
        self.calls: Counter = Counter()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._spy(getattr(torch.Tensor, name), name))

    def _spy(self, real, name):
        calls = self.calls

        def read(tensor, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            if _loss_code(caller.filename):
                calls[f"{name} at {Path(caller.filename).relative_to(PACKAGE)}:{caller.lineno}"] += 1
            return real(tensor, *args, **kwargs)

        return read


def _batch(drafter, target):
    layer_ids = list(drafter.config.target_layer_ids)
    samples = capture_samples(target, IDS, layer_ids)
    settings = BatchSettings(cache_layer_ids=layer_ids, feature_layer_ids=layer_ids, max_anchors_per_seq=6,
                             max_tokens_per_row=40)
    prepare = spec_of(drafter).prepare_for_training
    if prepare is not None:  # the draft vocabulary, bigram-started heads: as training runs it
        from types import SimpleNamespace

        prepare(drafter, (SimpleNamespace(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in samples),
                target.tokenizer)
    return spec_of(drafter).make_batcher(drafter.config, settings).collate(samples, 0)


@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.parametrize("kind", drafter_kinds())
def test_training_loss_reads_nothing_from_the_device(kind, vocab, tiny_llama, tiny_drafter, monkeypatch):
    drafter = tiny_drafter(kind, tiny_llama, **({"draft_vocab_size": 64} if vocab == "reduced" else {}))
    batch = _batch(drafter, tiny_llama)
    loss_cfg = spec_of(drafter).loss_class()
    assert loss_cfg.check_values is False  # the default a training run gets

    reads = HostReads(monkeypatch)
    result = compute_training_loss(drafter, batch, loss_cfg)
    result.loss.total.backward()
    assert not reads.calls, f"{kind} ({vocab} vocabulary): the loss read the device: {dict(reads.calls)}"
    parts = result.loss.parts  # what logging reads: one copy, when it reads
    assert sum(reads.calls.values()) == 1, dict(reads.calls)
    assert parts and all(isinstance(v, (int, float)) for v in parts.values()), parts

    reads.calls.clear()  # the debug switch keeps the value checks, which do read the device
    compute_training_loss(drafter, batch, replace(loss_cfg, check_values=True))
    assert reads.calls, f"{kind}: loss.check_values=true checked no value"
