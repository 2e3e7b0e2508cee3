"""Acceptance parity: a *trained* block drafter, exported, accepts as many tokens per step when a
consumer's own code drafts from the folder as in DeepSpec's loop (greedy, same prompts, same target).

This is the check a slot shift cannot pass: a drafter read one position off by its engine would still load and
match numerically, but its consumer would accept about one token per step while DeepSpec's loop accepts many.

- Target: the tiny random Qwen3 of `deepspec.targets.tiny` (hidden 64, 4 layers, 4/2 heads), but with an untied
  LM head and its final norm scaled up (`sharp_qwen3_target`). The tied tiny target's greedy continuations repeat
  the last prompt token forever, where x[a + j] = x[a + j + 1] and a slot shift is invisible.
- Data: the target's own greedy continuations of random prompts (its "regenerated answers"); the drafter trains on
  them with the real objective until it accepts well above chance, and is evaluated on the same prompts (this
  measures the loops against each other, not generalisation).
- Loops, all greedy:
  - DeepSpec: `deepspec.decoding.loop.speculative_generate` (KV-cached verifier, `make_proposer`), on the drafter
    DeepSpec re-reads from the exported folder (`load_exported`);
  - dflash 0.1.0's own `dflash_generate` (dflash/model.py:179-324) on the SGLang folder (`DFlashDraftModel.
    from_pretrained`) and on the vLLM folder (dflash cannot open it, `AttributeError: num_target_layers`: its
    model is rebuilt from what vLLM 0.33.0 derives, `transformers_utils/configs/speculators/algos.py:90-126`, and
    the folder's tensors load strictly); `return_stats` calls `torch.cuda.synchronize` (`_cuda_time`,
    model.py:174-176), patched to `time.perf_counter` on CPU;
  - for DSpark (anchor-predicts, whose engines SGLang/vLLM need a GPU), a plain greedy verify loop around
    speculators 0.9.0's own DSpark block forward (`_backbone_forward` + its Markov head, reading the slots its
    `sample_from_anchor` names) on the vLLM folder.
- Accepted tokens per step = tokens emitted per verification round (accepted drafts + the bonus), what
  `RoundRecord.tau` and dflash's `acceptance_lengths` both count.

Shape legend: B = 1 request, T = tokens, C = context tokens, F = fused features, G = block size, K = drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

LAYER_IDS = [0, 1, 2]
PROMPT_LEN = 8


@dataclass
class LoopResult:
    loop: str
    lengths: list[list[int]] = field(default_factory=list)  # tokens emitted per round, per prompt
    tokens: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    seconds: float = 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        flat = [n for per_prompt in self.lengths for n in per_prompt]
        return sum(flat) / max(len(flat), 1)

    def summary(self, reference_tokens: list[list[int]]) -> dict:
        return {"loop": self.loop, "mean_accepted_per_step": self.mean_accepted_per_step,
                "rounds": sum(len(x) for x in self.lengths), "tokens": sum(len(t) for t in self.tokens),
                "equals_target_greedy": self.tokens == reference_tokens, "seconds": round(self.seconds, 2)}


# -- target and data ----------------------------------------------------------------------------------
def sharp_qwen3_target(vocab_size: int = 2048, norm_scale: float = 150.0, seed: int = 1, num_heads: int | None = None,
                       num_kv_heads: int | None = None, head_dim: int | None = None):
    """The tiny Qwen3 shape with an untied head and sharp distributions (module docstring), as a `LoadedTarget`;
    `num_heads` / `num_kv_heads` / `head_dim` reshape its attention (vLLM's CPU attention needs head_dim >= 32)."""
    import transformers

    from deepspec.targets.load import LoadedTarget, load_tokenizer
    from deepspec.targets.tiny import tiny_config

    config = tiny_config("qwen3", vocab_size=vocab_size)
    config.tie_word_embeddings = False
    for name, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if value is not None:
            setattr(config, name, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        model.model.norm.weight.mul_(norm_scale)
    return LoadedTarget(model=model, tokenizer=load_tokenizer("smollm2-135m"), name="tiny-sharp-qwen3",
                        path="<memory>", revision=f"seed{seed}")


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Plain argmax continuations, full forward per token (no generation processors: `generate`'s
    `min_new_tokens` would mask the EOS id, which is an ordinary token for this random target)."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(num_new):
            ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


def random_prompts(num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(20, vocab_size, (PROMPT_LEN,), generator=generator).tolist() for _ in range(num)]


# -- training ------------------------------------------------------------------------------------------
def train_drafter(kind: str, target, sequences: list[list[int]], steps: int, lr: float = 1e-2,
                  anchors_per_seq: int = 8, seed: int = 0, **overrides):
    """The real objective of any drafter kind on the target's own continuations (prompt tokens unsupervised), Adam
    with a linear decay; anchors (block drafters) resampled every step; the kind's own batcher (its spec); kinds
    that read target layers read LAYER_IDS. Returns (drafter in eval mode, last-step draft/target argmax
    agreement)."""
    from deepspec.cache.memory import capture_samples
    from deepspec.drafters.build import build_drafter
    from deepspec.drafters.spec import BatchSettings, get_drafter_spec
    from deepspec.training.objective import compute_training_loss

    masks = [[i >= PROMPT_LEN for i in range(len(s))] for s in sequences]
    samples = capture_samples(target, sequences, LAYER_IDS, masks)
    torch.manual_seed(seed)
    spec = get_drafter_spec(kind)
    if spec.default_feature_layers(target.num_layers):
        overrides = {"target_layer_ids": LAYER_IDS, **overrides}
    drafter = build_drafter(kind, target, **overrides).train()
    settings = BatchSettings(cache_layer_ids=LAYER_IDS, feature_layer_ids=drafter.config.target_layer_ids,
                             max_anchors_per_seq=anchors_per_seq, seed=seed)
    batcher = spec.make_batcher(drafter.config, settings)
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    for step in range(steps):
        result = compute_training_loss(drafter, batcher.collate(samples, epoch=step))
        optimizer.zero_grad()
        result.loss.total.backward()
        optimizer.step()
        schedule.step()
    valid = result.terms.valid_N
    agreement = float((result.terms.draft_argmax_N == result.terms.target_argmax_N)[valid].float().mean())
    return drafter.eval(), agreement


# -- loops ----------------------------------------------------------------------------------------------
def deepspec_loop(drafter, target, prompts, num_new: int) -> LoopResult:
    from deepspec.decoding.loop import speculative_generate
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.drafters.proposers import make_proposer

    result, t0 = LoopResult("deepspec speculative_generate"), time.perf_counter()
    for prompt in prompts:
        out = speculative_generate(TargetVerifier(target.model, drafter.config.target_layer_ids),
                                   make_proposer(drafter, target.model), prompt, num_new,
                                   SamplingParams(temperature=0.0))
        result.lengths.append([r.tau for r in out.rounds])
        result.tokens.append(out.token_ids)
    result.seconds = time.perf_counter() - t0
    return result


def dflash_loop(model, target, prompts, num_new: int, label: str) -> LoopResult:
    """dflash 0.1.0's own generate loop (greedy) on `model` (a dflash `DFlashDraftModel`)."""
    import dflash.model as dflash_model

    dflash_model._cuda_time = time.perf_counter  # CPU: return_stats would call torch.cuda.synchronize
    result, t0 = LoopResult(label), time.perf_counter()
    for prompt in prompts:
        stats = dflash_model.dflash_generate(model, target.model, torch.tensor([prompt]), num_new, None,
                                             temperature=0.0, return_stats=True)
        result.lengths.append([int(n) for n in stats.acceptance_lengths])
        result.tokens.append(stats.output_ids[0, len(prompt):].tolist())
    result.seconds = time.perf_counter() - t0
    return result


def dflash_model_from_sglang(folder: Path):
    from dflash.model import DFlashDraftModel

    model, info = DFlashDraftModel.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise ValueError(f"{folder}: dflash loading info {info}")
    return model.eval()


def dflash_model_from_vllm(folder: Path):
    """dflash's model built from what vLLM 0.33.0 derives from a speculators DFlash folder (`update_dflash`,
    algos.py:90-126: the draft layer config is `transformer_layer_config`, `target_layer_ids = aux - 1`,
    `mask_token_id`, `block_size`; `num_target_layers` from the verifier) and the folder's tensors but the
    verifier's embedding/head (vLLM shares the target's), loaded strictly."""
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    engine = json.loads((folder / "config.json").read_text())
    layer = dict(engine["transformer_layer_config"])
    layer.pop("model_type", None)
    verifier = json.loads((Path(engine["speculators_config"]["verifier"]["name_or_path"]) / "config.json").read_text())
    config = Qwen3Config(**layer)
    config.num_target_layers = verifier["num_hidden_layers"]
    config.dflash_config = {"target_layer_ids": [i - 1 for i in engine["aux_hidden_state_layer_ids"]],
                            "mask_token_id": engine["mask_token_id"], "block_size": engine["block_size"]}
    model = DFlashDraftModel(config).to(torch.float32)
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
               if not k.startswith(("embed_tokens.", "lm_head."))}
    model.load_state_dict(tensors, strict=True)
    return model.eval()


@torch.no_grad()
def context_features(target, ids: list[int]) -> torch.Tensor:
    """features_1CF of `ids` (the target's hidden states after each layer in LAYER_IDS, concatenated)."""
    out = target.model(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)


@torch.no_grad()
def speculators_dspark_drafts(model, features_1CF: torch.Tensor, anchor: int) -> list[int]:
    """speculators' DSpark block forward with the anchor after the context (its `_backbone_forward`, one anchor),
    then its Markov head greedily left to right over the slots `sample_from_anchor` names."""
    g = model.block_size
    context = features_1CF.shape[1]
    total = context + g + 1  # select_anchors excludes the last G positions
    feats = torch.zeros(1, total, features_1CF.shape[-1])
    feats[:, :context] = features_1CF
    ids = torch.zeros(1, total, dtype=torch.long)
    ids[0, context] = anchor
    loss_mask = torch.zeros(1, total, dtype=torch.long)
    loss_mask[0, context] = 1
    hidden, logits, _, _, _ = model._backbone_forward(feats, ids, loss_mask, torch.zeros(1, total, model.hidden_size),
                                                     torch.zeros(1, total, dtype=torch.long), max_anchors=1)
    hidden_1GH, logits_1GV = hidden[:1], logits[:1]
    first = 0 if model.config.sample_from_anchor else 1
    prev_1G = torch.full((1, g), anchor, dtype=torch.long)
    drafts = []
    for k in range(first, g):
        bias = model.markov_head.block_bias(prev_token_ids=prev_1G, hidden_states=hidden_1GH)
        token = int((logits_1GV[0, k] + bias[0, k]).argmax())
        drafts.append(token)
        if k + 1 < g:
            prev_1G[0, k + 1] = token
    return drafts


@torch.no_grad()
def block_forward_loop(draft_fn, target, prompts, num_new: int, label: str) -> LoopResult:
    """A plain greedy speculative loop around a consumer's block forward (no KV cache: the tiny target is re-run
    on the whole sequence each round). Budget rule as DeepSpec's: never verify past what may still be emitted."""
    result, t0 = LoopResult(label), time.perf_counter()
    for prompt in prompts:
        seq = list(prompt) + [int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())]
        lengths = []
        while len(seq) - len(prompt) < num_new:
            anchor_pos = len(seq) - 1
            drafts = draft_fn(context_features(target, seq[:anchor_pos]), seq[anchor_pos])
            drafts = drafts[: max(num_new - (len(seq) - len(prompt)) - 1, 0)]
            posterior = target.model(torch.tensor([seq + drafts])).logits[0, anchor_pos:].argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
                accepted += 1
            seq += drafts[:accepted] + [posterior[accepted]]
            lengths.append(accepted + 1)
        result.lengths.append(lengths)
        result.tokens.append(seq[len(prompt):][:num_new])
    result.seconds = time.perf_counter() - t0
    return result


def speculators_model(folder: Path):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention fails on CPU
    return SpeculatorModel.from_pretrained(str(folder), config=config).eval()


# -- the check ------------------------------------------------------------------------------------------
@dataclass
class Settings:
    num_prompts: int = 16
    num_new: int = 48  # training continuation length; the loops generate `num_new - 8` tokens
    steps: int = 300
    lr: float = 1e-2
    anchors_per_seq: int = 8
    block_size: int = 7
    num_draft_layers: int = 2
    kinds: tuple[str, ...] = ("dflash", "dspark")


def rounds_before_the_budget(lengths: list[int], num_new: int, block_size: int) -> list[int]:
    """The rounds that started with at least a full block of budget left (1 prefill token + earlier rounds): loops
    clip their last drafts differently near `num_new` (dflash verifies one more slot, then truncates), not before."""
    kept, emitted = [], 1
    for n in lengths:
        if emitted + block_size > num_new:
            break
        kept.append(n)
        emitted += n
    return kept


def compare(ours: LoopResult, theirs: LoopResult, num_new: int, block_size: int) -> dict:
    """Accepted tokens per step of both loops, over all rounds and over the rounds before the budget (the last
    round or two of a request is clipped differently: dflash drafts a full block and truncates, DeepSpec drafts
    only what may still be emitted, so the round counts of the tail can differ by one with identical drafts)."""
    a, b = ours.mean_accepted_per_step, theirs.mean_accepted_per_step
    kept_ours = [rounds_before_the_budget(x, num_new, block_size) for x in ours.lengths]
    kept_theirs = [rounds_before_the_budget(y, num_new, block_size) for y in theirs.lengths]
    a_kept, b_kept = (LoopResult("", kept).mean_accepted_per_step for kept in (kept_ours, kept_theirs))
    return {"consumer": theirs.loop, "relative_difference": abs(b - a) / a,
            "ours_before_the_budget": a_kept, "theirs_before_the_budget": b_kept,
            "relative_difference_before_the_budget": abs(b_kept - a_kept) / a_kept,
            "same_rounds_before_the_budget": kept_ours == kept_theirs, "same_tokens": ours.tokens == theirs.tokens}


def run(settings: Settings, workdir: Path) -> dict:
    """Train, export, run every loop; the JSON report (`deepspec bench interop` prints it)."""
    from importlib.metadata import version

    from deepspec.export import export_drafter, load_exported

    target = sharp_qwen3_target()
    vocab = target.model.config.vocab_size
    prompts = random_prompts(settings.num_prompts, vocab)
    sequences = [p + c for p, c in zip(prompts, greedy_continuations(target, prompts, settings.num_new))]
    eval_new = settings.num_new - 8
    reference = [s[PROMPT_LEN: PROMPT_LEN + eval_new] for s in sequences]
    verifier = workdir / "verifier"
    target.model.save_pretrained(verifier)
    report = {"consumers": {name: version(name) for name in ("dflash", "speculators")},
              "target": "tiny random Qwen3 (hidden 64, 4 layers), untied head, final norm x150, vocab 2048",
              "settings": vars(settings) | {"kinds": list(settings.kinds), "eval_new_tokens": eval_new},
              "drafters": {}}
    for kind in settings.kinds:
        t0 = time.perf_counter()
        extra = {"markov_rank": 32} if kind == "dspark" else {}
        drafter, agreement = train_drafter(kind, target, sequences, settings.steps, settings.lr,
                                           settings.anchors_per_seq, block_size=settings.block_size,
                                           num_draft_layers=settings.num_draft_layers, init_from_target=True, **extra)
        entry = {"block_convention": drafter.config.block_convention, "num_drafts": drafter.config.num_drafts,
                 "train_seconds": round(time.perf_counter() - t0, 1), "train_agreement": agreement, "loops": []}
        vllm = export_drafter(drafter, workdir / f"{kind}-vllm", "vllm", target=target, verifier=str(verifier))
        loops = []
        if kind == "dflash":
            sglang = export_drafter(drafter, workdir / f"{kind}-sglang", "sglang", target=target)
            ours = deepspec_loop(load_exported(sglang, target), target, prompts, eval_new)
            loops.append(dflash_loop(dflash_model_from_sglang(sglang), target, prompts, eval_new,
                                     "dflash dflash_generate on the SGLang folder"))
            loops.append(dflash_loop(dflash_model_from_vllm(vllm), target, prompts, eval_new,
                                     "dflash dflash_generate on the vLLM folder (vLLM's derived config)"))
        else:
            ours = deepspec_loop(load_exported(vllm, target), target, prompts, eval_new)
            model = speculators_model(vllm)
            loops.append(block_forward_loop(lambda f, a, model=model: speculators_dspark_drafts(model, f, a), target,
                                            prompts, eval_new, "speculators DSpark block forward on the vLLM folder"))
        entry["loops"] = [ours.summary(reference)] + [loop.summary(reference) for loop in loops]
        entry["parity"] = [compare(ours, loop, eval_new, settings.block_size) for loop in loops]
        report["drafters"][kind] = entry
    return report


def main(argv=None) -> int:
    """`deepspec bench interop`: the consumer libraries (scripts/bootstrap.sh installs them) must be importable."""
    parser = argparse.ArgumentParser(prog="deepspec bench interop", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_interop_acceptance.json"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48, help="training continuation length (loops: 8 fewer)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kinds", nargs="+", default=["dflash", "dspark"], choices=["dflash", "dspark"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; a hub lookup must fail fast, not hang
    torch.set_num_threads(args.threads)
    from deepspec.utils.io import emit_report

    settings = Settings(num_prompts=args.prompts, num_new=args.new_tokens, steps=args.steps, kinds=tuple(args.kinds))
    with tempfile.TemporaryDirectory(prefix="deepspec-acceptance-") as workdir:
        report = run(settings, Path(workdir))
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
