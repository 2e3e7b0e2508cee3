"""Two torchrun ranks, killed after one shard each by the fault-injection hook, resume to the same cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspec.cache import CacheReader, verify_cache

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, n: int = 12) -> None:
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "question " * (i + 1)},
                                                  {"from": "gpt", "value": "answer words " * (2 * i + 1)}]}
               for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def torchrun_cache(prompts: Path, out_dir: Path, fail_after: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    faults = [] if fail_after is None else [f"faults.stop_after={fail_after}"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "data_tools" / "cache_hiddens.py"), "target=tiny-random-llama",
               f"data.prompts={prompts}", "data.val_fraction=0.25", f"cache.out_dir={out_dir}",
               "cache.layer_ids=[0,1,2]", "cache.shard_size_mb=0.02", "cache.batch_size=2", "cache.progress=false",
               *faults]
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_equal_uninterrupted_run(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    done = torchrun_cache(prompts, reference)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = torchrun_cache(prompts, resumed, fail_after=1)
    assert killed.returncode != 0 and "injected failure" in killed.stdout + killed.stderr
    assert not (resumed / "meta.json").exists()
    kept = [json.loads(p.read_text()) for p in sorted(resumed.glob("index-r*.json"))]
    assert kept and all(not k["complete"] for k in kept) and sum(len(k["shards"]) for k in kept) >= 1

    again = torchrun_cache(prompts, resumed)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_counts = [int(n) for n in re.findall(r"\((\d+) samples resumed\)", again.stdout)]
    kept_samples = sum(len(sh["samples"]) for k in kept for sh in k["shards"])
    assert len(resumed_counts) == 2 and sum(resumed_counts) == kept_samples > 0
    assert (resumed / "index.json").read_text() == (reference / "index.json").read_text()
    index = json.loads((reference / "index.json").read_text())
    assert {s["shard"][:9] for s in index["samples"]} == {"shard-r00", "shard-r01"}
    assert [s["position"] for s in index["samples"]] == sorted(s["position"] for s in index["samples"])
    assert verify_cache(resumed) == []
    a, b = CacheReader(reference, dtype=None), CacheReader(resumed, dtype=None)
    assert len(a) == len(b) == 12
    for i in range(len(a)):
        assert torch.equal(a[i].features, b[i].features) and torch.equal(a[i].final_hidden, b[i].final_hidden)
        assert torch.equal(a[i].input_ids, b[i].input_ids) and torch.equal(a[i].loss_mask, b[i].loss_mask)
