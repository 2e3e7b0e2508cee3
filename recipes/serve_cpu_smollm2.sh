#!/usr/bin/env bash
# CPU only: EAGLE-3 and DFlash drafters for the embedded SmolLM2-135M, trained on the target's own answers to a few
# thousand ShareGPT conversations regenerated through vLLM's CPU build, then served by it (`deepspec bench serve`).
#   bash recipes/serve_cpu_smollm2.sh [BENCHMARK.jsonl ...]
# Benchmark files ({"turns": [...]} JSONL, e.g. mt-bench and gsm8k) are kept out of the training prompts and served
# at the end; the bundled humaneval always is. Every stage resumes where it stopped: rerun the same command.
# Needs .venv-vllm (scripts/bootstrap.sh makes it). docs/results.md has the stages' measured times: on 2 cores,
# stage 1 takes under a minute and stage 2 about 2.5 hours (1.32M assistant tokens).
set -euo pipefail
OUT=${OUT:-runs/served-smollm2}
CONVERSATIONS=${CONVERSATIONS:-4000}
STEPS=${STEPS:-6000}
DRAFTERS=${DRAFTERS:-"eagle3 dflash"}
deepspec() { "${DEEPSPEC_PYTHON:-.venv/bin/python}" -m deepspec.cli "$@"; }
benchmarks=(humaneval "$@")
mkdir -p "$OUT"

# 1. ShareGPT conversations that share no 13-word run with any benchmark prompt.
[ -f "$OUT/prompts.jsonl" ] || deepspec decontaminate --prompts sharegpt --benchmarks "${benchmarks[@]}" \
  --limit "$CONVERSATIONS" --out "$OUT/prompts.jsonl"
# 2. The target's greedy answers, two turns each, from vLLM's server (started and stopped here).
deepspec regenerate --prompts "$OUT/prompts.jsonl" --out "$OUT/data.jsonl" --backend vllm --threads 2 \
  --kv-cache-gib 6 --max-model-len 2048 --concurrency 128 --batch-size 512 --greedy --max-new-tokens 256 \
  --max-turns 2 --max-prompt-tokens 1024
# 3. The target's features for every token.
deepspec cache target.name=smollm2-135m "data.prompts=$OUT/data.jsonl" data.val_fraction=0.02 \
  data.test_fraction=0.0 "cache.out_dir=$OUT/cache" cache.max_length=1280
# 4. Drafters in the layouts vLLM serves (experiment=cpu-servable), each resuming its own run folder.
for kind in $DRAFTERS; do
  deepspec train experiment=cpu-servable "drafter=$kind" "data.cache_dir=$OUT/cache" "trainer.max_steps=$STEPS" \
    "trainer.save_every=500" "trainer.val_every=1000" "trainer.out_dir=$OUT/train/$kind" \
    "hydra.run.dir=$OUT/train/$kind"
done
# 5. Served by vLLM beside vLLM alone and vLLM's ngram, one thread, batch 1, T = 0.
drafters=()
for kind in $DRAFTERS; do
  drafters+=("$kind=$("${DEEPSPEC_PYTHON:-.venv/bin/python}" -m deepspec.training.latest "$OUT/train/$kind")")
done
for bench in "${benchmarks[@]}"; do
  name=$(basename "$bench" .jsonl)
  [ -f "$OUT/serve-$name.json" ] || deepspec bench serve --drafter "${drafters[@]}" --benchmark "$bench" \
    --num-prompts 16 --max-new-tokens 128 --threads 1 --out "$OUT/serve-$name.json"
done
