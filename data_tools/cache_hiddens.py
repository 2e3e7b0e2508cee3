"""Cache target features for drafter training: prompts/answers -> sharded safetensors cache (deepspec.cache).

  python data_tools/cache_hiddens.py data.prompts=answers.jsonl cache.out_dir=cache/smollm2   # build
  python data_tools/cache_hiddens.py mode=estimate ...   # print the size estimate and exit
  python data_tools/cache_hiddens.py mode=verify cache.out_dir=...   # checksums; exit 1 on problems
  torchrun --nproc_per_node 2 data_tools/cache_hiddens.py ...   # each rank writes its own shards
The same as `deepspec cache ...` (deepspec.cache.cli).
"""

from deepspec.cache.cli import main

if __name__ == "__main__":
    main()
