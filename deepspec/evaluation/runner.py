"""Run drafters over benchmarks with the reference decoding loop and summarise acceptance (paper §4.1-4.3).

Per prompt: `speculative_generate` (batch 1) on the chat-rendered first turn (`deepspec.data.chat.prompt_ids`,
the same rendering as training data), stopping at the template's end-of-turn tokens or `max_new_tokens`; in the
text format (a base model, deepspec.data.rendering) on the first turn's text as a prefix, stopping at the
end-of-sequence token. A prompt that cannot be rendered is skipped (the first of each reason named); a benchmark
whose every prompt is, is refused before anything runs.
Each prompt gets its own generator seeded with `seed + prompt index`, so results do not depend on the
order drafters or benchmarks are run in.

Statistics per benchmark (rounds pooled over prompts):
  * tau: mean tokens emitted per decoding round (accepted drafts + the bonus/corrected token);
  * prefix_survival[k-1]: P(drafts 1..k all accepted | position k was verified);
  * conditional_acceptance[k-1]: P(draft k accepted | drafts 1..k-1 accepted and k was verified)
    (paper fig. 2: position k is not penalised by earlier rejections).
Threshold sweep (paper fig. 5), for drafters with a confidence head: exact offline simulation, not a
re-run. Each round of the fixed-length run records its confidence vector c_1..c_K and its accepted count
n; a static threshold would have verified l = `static_threshold_lengths(c, t)` drafts and accepted
min(n, l) of them, because the drafts, their confidences and the acceptance test of position j (which
reads only positions <= j and the round's noise) do not depend on how many later positions are verified.
The simulation is exact per round; it does not follow the different trajectory a live threshold run
would take in later rounds (the same counterfactual the paper's offline sweep reports). A live run with
`threshold=` uses `threshold_policy` in the loop instead (and then no sweep is computed).

Shape legend: K = draft positions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepspec.data.rendering import COMMAND_LINE_OPTIONS, Rendering, Skipped, SkipReport
from deepspec.decoding.acceptance import Acceptance
from deepspec.decoding.loop import speculative_generate
from deepspec.decoding.policies import fixed_policy, threshold_policy
from deepspec.decoding.proposal import DraftProposal, RoundRecord
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.scheduler import static_threshold_lengths
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.proposers import make_proposer
from deepspec.drafters.spec import capabilities_of
from deepspec.evaluation.prompt_sets import Benchmark

log = logging.getLogger(__name__)

DEFAULT_SWEEP_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))
# The settings a drafter's recorded rendering is checked against, as the command line names them.
RENDERING_FIELDS = {"format": "--format", "chat_template": "--chat-template (or target.chat_template)",
                    "chat_template_kwargs": "target.chat_template_kwargs (--chat-template-kwargs)"}


@dataclass
class EvalSettings:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    seed: int = 0
    num_draft_tokens: int | None = None  # drafts per round (None: the drafter's default)
    verify_length: int | None = None  # cap on verified drafts per round (fixed policy)
    threshold: float | None = None  # live static confidence threshold (drafters with a confidence head)
    sweep_thresholds: Sequence[float] = DEFAULT_SWEEP_THRESHOLDS
    system_prompt: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)  # the target config's (e.g. Qwen3 non-thinking)
    data_format: str = "chat"  # text: prompts are text prefixes (a base model, deepspec.data.rendering)
    chat_template: str | None = None  # a template given for the target (None: the tokenizer's own)
    with_prompt_lookup: bool = False  # each round prompt lookup's drafts or the drafter's (decoding/combined.py)

    @property
    def rendering(self) -> Rendering:
        return Rendering(format=self.data_format, chat_template=self.chat_template,
                         chat_template_kwargs=self.chat_template_kwargs, system_prompt=self.system_prompt)

    def __post_init__(self) -> None:
        _ = self.rendering  # a format, template settings and system prompt that go together
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must lie in [0, 1]")
        if any(not 0.0 <= t <= 1.0 for t in self.sweep_thresholds):
            raise ValueError(f"sweep_thresholds={list(self.sweep_thresholds)} must lie in [0, 1]")

    def to_json(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k, "top_p": self.sampling.top_p, "seed": self.seed,
                "num_draft_tokens": self.num_draft_tokens, "verify_length": self.verify_length,
                "threshold": self.threshold, "sweep_thresholds": list(self.sweep_thresholds),
                "system_prompt": self.system_prompt, "chat_template_kwargs": dict(self.chat_template_kwargs),
                "data_format": self.data_format, "chat_template": self.chat_template,
                "with_prompt_lookup": self.with_prompt_lookup}


class RecordingProposer:
    """Wraps a proposer and keeps the full-length confidence vector of every proposal (one per round)."""

    def __init__(self, proposer):
        self.inner = proposer
        self.max_tokens = proposer.max_tokens
        self.confidences: list[list[float] | None] = []

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.confidences = []
        self.inner.reset(prompt_ids_T, features_TF, final_hidden_TH)

    def propose(self, anchor_id, anchor_pos, sampling, generator) -> DraftProposal:
        proposal = self.inner.propose(anchor_id, anchor_pos, sampling, generator)
        conf = proposal.confidence_BK
        self.confidences.append(None if conf is None else conf[0].detach().float().cpu().tolist())
        return proposal

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        self.inner.on_accept(token_ids_N, features_NF, final_hidden_NH)


def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def position_statistics(rounds: Iterable[RoundRecord]) -> dict:
    """Per draft position k = 1..K_max: prefix survival and conditional acceptance (module docstring)."""
    rounds = list(rounds)
    max_k = max((r.proposed for r in rounds), default=0)
    verified, reached, accepted = [0] * max_k, [0] * max_k, [0] * max_k
    for r in rounds:
        for k in range(1, r.proposed + 1):
            verified[k - 1] += 1
            reached[k - 1] += r.accepted >= k - 1
            accepted[k - 1] += r.accepted >= k
    return {
        "prefix_survival": [_ratio(a, v) for a, v in zip(accepted, verified)],
        "conditional_acceptance": [_ratio(a, n) for a, n in zip(accepted, reached)],
        "verified_counts": verified,
        "reached_counts": reached,
        "accepted_counts": accepted,
    }


def simulate_threshold_sweep(rounds: Sequence[RoundRecord], confidences: Sequence[Sequence[float]],
                             thresholds: Sequence[float], cumulative: bool = False) -> list[dict]:
    """Offline static-threshold sweep over fixed-length rounds (exactness: module docstring)."""
    if len(rounds) != len(confidences):
        raise ValueError(f"{len(rounds)} rounds but {len(confidences)} confidence vectors")
    sweep = []
    for threshold in thresholds:
        accepted = verified = 0
        for r, conf in zip(rounds, confidences):
            if len(conf) < r.proposed:
                raise ValueError(f"a round verified {r.proposed} drafts but has only {len(conf)} confidences")
            if r.proposed == 0:
                continue
            length = static_threshold_lengths([list(conf[: r.proposed])], threshold, cumulative)[0]
            accepted += min(r.accepted, length)
            verified += length
        num = max(len(rounds), 1)
        sweep.append({"threshold": float(threshold), "tokens_per_step": (accepted + len(rounds)) / num,
                      "accepted_per_step": accepted / num, "rejected_per_step": (verified - accepted) / num,
                      "verified_per_step": verified / num, "acceptance_rate": _ratio(accepted, verified)})
    return sweep


def summarize(rounds: Sequence[RoundRecord], confidences: Sequence[Sequence[float] | None] | None,
              decode_s: float, thresholds: Sequence[float] | None) -> dict:
    """Benchmark-level numbers from pooled rounds (see module docstring)."""
    num_rounds = len(rounds)
    emitted = sum(r.tau for r in rounds)
    summary = {
        "tau": _ratio(emitted, num_rounds),
        "num_rounds": num_rounds,
        "num_round_tokens": emitted,
        "mean_drafted": _ratio(sum(r.drafted for r in rounds), num_rounds),
        "mean_verified": _ratio(sum(r.proposed for r in rounds), num_rounds),
        "acceptance_rate": _ratio(sum(r.accepted for r in rounds), sum(r.proposed for r in rounds)),
        "decode_s": decode_s,
        "round_tokens_per_s": _ratio(emitted, decode_s),
        "draft_ms_per_round": _ratio(1000 * sum(r.draft_s for r in rounds), num_rounds),
        "verify_ms_per_round": _ratio(1000 * sum(r.verify_s for r in rounds), num_rounds),
    }
    summary.update(position_statistics(rounds))
    summary["threshold_sweep"] = None
    if thresholds is not None and confidences is not None and all(c is not None for c in confidences):
        summary["threshold_sweep"] = simulate_threshold_sweep(rounds, confidences, thresholds)
    return summary


def has_confidence_head(drafter) -> bool:
    return capabilities_of(drafter).confidence_head


def benchmark_prompts(benchmarks: Sequence[Benchmark], tokenizer, rendering: Rendering
                      ) -> dict[str, list[tuple[int, list[int]]]]:
    """{benchmark name: [(prompt index, prompt ids)]}: each prompt rendered (module docstring); one that cannot be
    is skipped and counted, the first of each reason named; a benchmark whose every prompt is skipped is refused."""
    out = {}
    for bench in benchmarks:
        skips, rendered = SkipReport(), []
        for index, messages in enumerate(bench.prompts):
            try:
                rendered.append((index, rendering.prompt_ids(tokenizer, messages)))
            except Skipped as err:
                where = bench.where[index] if index < len(bench.where) else f"{bench.name}[{index}]"
                skips.skip(err.reason, where, str(err))
        skips.warn(log, "prompts", f"benchmark {bench.name}: ")
        skips.require_kept(len(rendered), f"benchmark {bench.name!r} ({bench.source})", COMMAND_LINE_OPTIONS)
        out[bench.name] = rendered
    return out


def evaluate_drafter(target, drafter, benchmarks: Sequence[Benchmark], settings: EvalSettings,
                     progress: bool = True, prompts: dict | None = None) -> dict:
    """Run one drafter over every benchmark; returns {benchmark name: summary dict}. `prompts`: the rendered
    prompts (`benchmark_prompts`; rendered here when not given)."""
    from tqdm.auto import tqdm

    model, tokenizer = target.model, target.tokenizer
    device = next(model.parameters()).device
    rendering = settings.rendering
    prompts = prompts if prompts is not None else benchmark_prompts(benchmarks, tokenizer, rendering)
    eos_ids = rendering.stop_token_ids(tokenizer)
    confident = has_confidence_head(drafter)
    live_threshold = settings.threshold is not None and confident
    policy = (threshold_policy(settings.threshold, verify_length=settings.verify_length) if live_threshold
              else fixed_policy(settings.verify_length))
    verifier = TargetVerifier(model, drafter.config.target_layer_ids)
    acceptance = Acceptance()  # one backend choice (and one notice) for the whole evaluation
    results = {}
    for bench in benchmarks:
        proposer = RecordingProposer(make_proposer(drafter, model, num_draft_tokens=settings.num_draft_tokens,
                                                   with_prompt_lookup=settings.with_prompt_lookup))
        rounds: list[RoundRecord] = []
        confidences: list = []
        decode_s = 0.0
        num_tokens = 0
        for index, ids in tqdm(prompts[bench.name], desc=f"{bench.name}", disable=not progress, leave=False):
            generator = torch.Generator(device=device).manual_seed(settings.seed + index)
            result = speculative_generate(verifier, proposer, ids, settings.max_new_tokens, settings.sampling,
                                          eos_token_ids=eos_ids, generator=generator, length_policy=policy,
                                          acceptance_backend=acceptance)
            rounds.extend(result.rounds)
            confidences.extend(proposer.confidences)
            decode_s += result.decode_s
            num_tokens += len(result.token_ids)
        summary = summarize(rounds, confidences if confident else None, decode_s,
                            None if live_threshold else settings.sweep_thresholds)
        summary.update({"domain": bench.domain, "source": bench.source, "num_prompts": len(prompts[bench.name]),
                        "num_skipped_prompts": len(bench.prompts) - len(prompts[bench.name]),
                        "num_generated_tokens": num_tokens,
                        "policy": "threshold" if live_threshold else "fixed"})
        if settings.with_prompt_lookup:  # the share of rounds that proposed prompt lookup's drafts
            summary["lookup_round_share"] = _ratio(proposer.inner.lookup_rounds, proposer.inner.rounds)
        results[bench.name] = summary
    return results


def evaluate(target, drafters: dict[str, tuple[object, str]], benchmarks: Sequence[Benchmark],
             settings: EvalSettings, progress: bool = True) -> dict:
    """All drafters ({name: (drafter, path)}) over all benchmarks -> the results dict tables.py renders."""
    if not drafters:
        raise ValueError("evaluate: no drafters given")
    if not benchmarks:
        raise ValueError("evaluate: no benchmarks given")
    names = [b.name for b in benchmarks]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names} (use label=spec to rename)")
    check_drafter_templates({name: drafter for name, (drafter, _) in drafters.items()}, settings.rendering,
                            {name: path for name, (_, path) in drafters.items()})
    prompts = benchmark_prompts(benchmarks, target.tokenizer, settings.rendering)
    out = {"settings": {"target": target.name, "target_revision": target.revision,
                        "benchmarks": [{"name": b.name, "domain": b.domain, "source": b.source,
                                        "num_prompts": len(prompts[b.name])} for b in benchmarks],
                        **settings.to_json()},
           "drafters": {}}
    for name, (drafter, path) in drafters.items():
        cfg = drafter.config
        out["drafters"][name] = {
            "kind": cfg.drafter_kind, "path": str(path), "confidence_head": has_confidence_head(drafter),
            "calibrated": bool(has_confidence_head(drafter) and cfg.calibration_temperatures),
            "benchmarks": evaluate_drafter(target, drafter, benchmarks, settings, progress=progress, prompts=prompts),
        }
    return out


def check_drafter_templates(drafters: dict, rendering: Rendering, sources: dict | None = None) -> None:
    """Prompts are rendered as each drafter's training data were (format, chat template, template options:
    recorded in its config from the cache); another setting is refused before anything runs. Drafters whose
    source (`sources`: name -> `drafter_specs` value) is a wrapped pretrained `KIND:MODEL` read no cache: skipped."""
    for name, drafter in drafters.items():
        if sources is not None and wrapped_model_spec(str(sources[name])) is not None:
            continue
        rendering.check_recorded(drafter.config, f"drafter {name!r}'s training data (its config.json)",
                                 RENDERING_FIELDS)


def wrapped_model_spec(source: str) -> tuple[str, str] | None:
    """`KIND:MODEL` -> (kind, model) when KIND is a registered drafter kind (one that wraps a pretrained model, e.g.
    `standalone:HuggingFaceTB/SmolLM2-135M-Instruct`, `standalone:path/to/causal_lm_export`); else None."""
    from deepspec.drafters.spec import drafter_kinds

    kind, sep, model = str(source).partition(":")
    return (kind, model) if sep and model and kind in drafter_kinds() and not Path(source).exists() else None


def drafter_specs(items: Sequence[str]) -> dict[str, Path | str]:
    """CLI `[NAME=]PATH` / `[NAME=]KIND:MODEL` items -> {name: saved drafter folder or `KIND:MODEL`}; unnamed ones
    are named after their folder (or model)."""
    specs: dict[str, Path | str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or Path(item).exists():
            path, name = item, Path(item.rstrip("/")).name
        if not name:
            raise ValueError(f"--drafter {item!r}: empty name")
        if name in specs:
            raise ValueError(f"--drafter: two drafters named {name!r}; use NAME=PATH to rename one")
        if wrapped_model_spec(path) is not None:
            specs[name] = path
            continue
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--drafter {item!r}: {path} is not a saved drafter directory (nor KIND:MODEL, "
                                    f"e.g. standalone:<causal LM sharing the target's tokenizer>)")
        specs[name] = Path(path)
    return specs


def open_drafter(source: Path | str, target, strict_target: bool = True):
    """A drafter from a `drafter_specs` value: a saved drafter folder (`load_drafter`), or `KIND:MODEL`, built
    for `target` around that pretrained model (`build_drafter(KIND, target, base_model=MODEL)`)."""
    from deepspec.drafters.build import build_drafter, load_drafter

    wrapped = wrapped_model_spec(str(source))
    if wrapped is not None:
        return build_drafter(wrapped[0], target, base_model=wrapped[1])
    return load_drafter(source, target, strict_target=strict_target)


def finite_or_none(value):
    """JSON has no NaN: map non-finite floats to None (used before writing results)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value
