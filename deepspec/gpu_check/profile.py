"""Sizes and time budgets of one GPU check run: the real sizes on CUDA, tiny ones for the CPU dry run.

The dry run takes the same code paths at sizes a small CPU finishes in minutes (Triton kernels through
TRITON_INTERPRET=1). Figures that only a GPU can give (kernel timings, CUDA peak memory) are null there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # "cuda" | "cpu"
    time_limit_s: float  # the whole run (all checks); the shell step before it is not counted
    # Seconds each check may take if every earlier one used its own; time an earlier check leaves
    # unused goes to the later ones (runner.check_timeout).
    budgets_s: dict[str, float] = field(default_factory=dict)
    # 1. acceptance kernel vs torch reference
    accept_vocab_sizes: tuple[int, ...] = (152064, 262144)
    accept_batch_sizes: tuple[int, ...] = (1, 3, 8, 32, 64)
    accept_num_draft: int = 7
    accept_bf16_case: tuple[int, int] = (32, 152064)  # (batch, vocab) re-run with bf16 logits
    timing_batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    timing_vocab_sizes: tuple[int, ...] = (152064, 262144)
    timing_iters: int = 20
    goal_case: tuple[int, int, int] = (32, 152064, 7)  # (batch, vocab, drafts): Triton >= 3x the reference
    # 2. fused TV-loss kernel vs the chunked torch path
    tv_rows: int = 4096
    tv_hidden: int = 1024
    tv_vocab: int = 152064
    tv_chunk_rows: int = 512
    tv_repeats: int = 3
    # targets: a random-weight model of a real shape, written once and loaded by every entry point
    target_shape: str = "qwen3-0.6b"
    second_shape: str = "llama-3.2-1b"  # greedy identity only (built in memory)
    # 3. training
    num_conversations: int = 320
    max_length: int = 512
    train_steps: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 4
    max_tokens_per_row: int = 1024  # eagle3/mtp packed rows
    train_extra: tuple[str, ...] = ()  # further Hydra overrides (the dry run shrinks the drafters)
    # 4. decoding
    greedy_prompts: int = 2
    greedy_tokens: int = 32
    bench_prompts: int = 2
    bench_tokens: int = 32
    bench_temperatures: tuple[float, ...] = (0.0, 1.0)
    concurrency: tuple[int, ...] = (1, 8, 32)
    batched_tokens: int = 32
    batched_requests_per_slot: int = 2
    batched_context_len: int = 256
    batched_profile_repeats: int = 5

    @property
    def dry_run(self) -> bool:
        return self.device == "cpu"


# The default time limits are the checks' budgets with some slack; `--time-limit` scales them (with_time_limit).
GPU = Profile(
    name="gpu", device="cuda", time_limit_s=440.0,
    budgets_s={"acceptance": 50, "tv_loss": 40, "target": 30, "training": 180, "decoding": 140},
)

DRY_RUN = Profile(
    name="dry-run", device="cpu", time_limit_s=300.0,
    budgets_s={"acceptance": 40, "tv_loss": 30, "target": 20, "training": 150, "decoding": 60},
    accept_vocab_sizes=(1000, 2600), accept_batch_sizes=(1, 3), accept_num_draft=4, accept_bf16_case=(3, 1000),
    timing_batch_sizes=(2,), timing_vocab_sizes=(1000,), timing_iters=2, goal_case=(2, 1000, 4),
    tv_rows=48, tv_hidden=32, tv_vocab=1500, tv_chunk_rows=16, tv_repeats=1,
    target_shape="tiny-qwen3", second_shape="tiny-llama",
    num_conversations=24, max_length=96, train_steps=3, global_batch_size=2, micro_batch_size=2,
    max_tokens_per_row=128,
    train_extra=("drafter.num_draft_layers=1", "data.max_anchors_per_seq=16", "optim.lr=3e-3",
                 "optim.warmup_fraction=0.0"),
    greedy_prompts=1, greedy_tokens=12, bench_prompts=1, bench_tokens=6, bench_temperatures=(0.0,),
    concurrency=(1, 2), batched_tokens=6, batched_requests_per_slot=1, batched_context_len=16,
    batched_profile_repeats=1,
)

PROFILES = {"cuda": GPU, "cpu": DRY_RUN}


def with_time_limit(profile: Profile, seconds: float) -> Profile:
    """`profile` under a time limit of `seconds`, every check's budget scaled by the same factor, so the budgets keep
    their proportions and still fit inside the limit."""
    if seconds <= 0:
        raise ValueError(f"the time limit must be positive, got {seconds}")
    scale = seconds / profile.time_limit_s
    return replace(profile, time_limit_s=float(seconds),
                   budgets_s={name: budget * scale for name, budget in profile.budgets_s.items()})
