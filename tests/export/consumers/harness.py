"""Interop harness: load DeepSpec exports with the consumers' own code and compare with `load_exported`.

For every (drafter kind, layout) DeepSpec exports, this module
1. builds a tiny drafter with random weights on a tiny random target (float32),
2. exports it with `deepspec.export.export_drafter` (vLLM layouts name the target saved to a local folder as
   their verifier, as a user of an unpublished target would with `--verifier`),
3. loads the folder with each consumer library's own entry point (speculators `SpeculatorModel.from_pretrained`,
   dflash `DFlashDraftModel.from_pretrained`, specforge `AutoDraftModel.from_pretrained`),
4. runs the consumer's forward on the same inputs DeepSpec's re-read drafter (`load_exported`) gets and reports
   missing/unexpected keys, the max abs difference of the slot-aligned outputs (block hidden states, Markov-corrected
   probabilities and confidences; Eagle3/MTP step-0 logits), and whether the tokens the consumer drafts for one
   block *with its own slot indexing* equal DeepSpec's (as many as the layout declares: `speculative_tokens`).
Cases an export must refuse (a block convention or a head no engine reads, NextN for non-DeepSeek targets) are
rows too: the export must raise naming the reason and leave no folder. The consumer libraries are imported lazily,
so this module imports without them (rows then say "not installed").

Known consumer bugs worked around here, never in the exported files:
- specforge 0.2.0 Eagle3: RoPE buffers are uninitialised after `from_pretrained` -> `midlayer.self_attn._init_rope()`.
- speculators 0.9.0: default `simple_flex_attention` fails on CPU once parameters require grad ("FlexAttention
  does not support backward on CPU") and takes BlockMasks only -> `transformer_layer_config._attn_implementation
  = "sdpa"` before building the model, so the harness's dense boolean masks apply.

Shape legend: B = batch, C = context tokens, F = fused feature width, G = block size, K = drafts, H = hidden,
N = rows, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONTEXT = 5  # context tokens before the anchor / rows of an autoregressive drafter
BATCH = 2
CHAIN = 3  # chained drafts compared for Eagle3


# -- cases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    layout: str
    family: str
    overrides: dict = field(default_factory=dict)
    reduced_vocab: int | None = None
    refused: str | None = None  # the export must refuse, with a message matching this regex


MASK, ANCHOR = {"block_convention": "mask-predicts"}, {"block_convention": "anchor-predicts"}
MARKOV = {"num_draft_layers": 2, "markov_rank": 8}
RNN = {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn"}
QWEN3_LAYERS, LLAMA_LAYERS = {"layer_family": "qwen3"}, {"layer_family": "llama"}
CASES = [
    Case("eagle3-full", "eagle3", "sglang", "llama", {"target_layer_ids": [0, 1, 2]}),
    Case("eagle3-reduced", "eagle3", "sglang", "llama", {"target_layer_ids": [0, 1, 2]}, reduced_vocab=64),
    Case("eagle3-full", "eagle3", "vllm", "llama", {"target_layer_ids": [0, 1, 2]}),
    Case("eagle3-reduced", "eagle3", "vllm", "llama", {"target_layer_ids": [0, 1, 2]}, reduced_vocab=64),
    Case("eagle3-qwen3-full", "eagle3", "vllm", "qwen3", {"target_layer_ids": [0, 1, 2]}),
    Case("dflash", "dflash", "sglang", "qwen3", {"num_draft_layers": 2}),  # mask-predicts, its default
    Case("dflash", "dflash", "vllm", "qwen3", {"num_draft_layers": 2}),
    Case("dflash-anchor", "dflash", "sglang", "qwen3", {"num_draft_layers": 1, **ANCHOR}, refused="mask-predicts"),
    Case("dflash-anchor", "dflash", "vllm", "qwen3", {"num_draft_layers": 1, **ANCHOR}, refused="mask-predicts"),
    Case("dspark-markov", "dspark", "sglang", "qwen3", MARKOV),  # anchor-predicts, its default
    Case("dspark-markov-mask", "dspark", "sglang", "qwen3", {**MARKOV, **MASK}),
    Case("dspark-rnn", "dspark", "sglang", "qwen3", RNN),
    Case("dspark-rnn-mask", "dspark", "sglang", "qwen3", {**RNN, **MASK}),
    Case("dspark-conf-only", "dspark", "sglang", "qwen3", {"num_draft_layers": 1, "markov_rank": 4,
                                                           "sequential_head": "none"}, refused="sequential head"),
    Case("dspark-markov", "dspark", "vllm", "qwen3", MARKOV),
    # Trained from a zero final norm (drafter.final_norm_init, the bigram floor start): a start, not an architecture,
    # so both engine layouts read it as any DSpark (the harness randomises every weight after building).
    Case("dspark-zero-start", "dspark", "sglang", "qwen3", {**MARKOV, "final_norm_init": 0.0}),
    Case("dspark-zero-start", "dspark", "vllm", "qwen3", {**MARKOV, "final_norm_init": 0.0}),
    Case("dspark-markov-mask", "dspark", "vllm", "qwen3", {**MARKOV, **MASK}),
    Case("dspark-rnn", "dspark", "vllm", "qwen3", RNN),
    Case("dspark-rnn-mask", "dspark", "vllm", "qwen3", {**RNN, **MASK}, refused="RNN head over the anchor slot"),
    Case("mtp-1", "mtp", "vllm", "qwen3", {"num_mtp_modules": 1}),
    Case("mtp-2", "mtp", "vllm", "qwen3", {"num_mtp_modules": 2}, refused="exactly one module"),
    Case("mtp-1-llama", "mtp", "vllm", "llama", {"num_mtp_modules": 1}, refused="Qwen3 family only"),
    Case("mtp-1", "mtp", "nextn", "qwen3", {"num_mtp_modules": 1}, refused="DeepSeek-V3 targets"),
    # Draft layers of the family the engine builds on a target of another (drafter.layer_family): Qwen3-layer
    # DFlash/DSpark/MTP on the Llama target, Llama-layer EAGLE-3 (SpecForge's and SGLang's) on the Qwen3 target.
    Case("dflash-qwen3-layers", "dflash", "sglang", "llama", {"num_draft_layers": 2, **QWEN3_LAYERS}),
    Case("dflash-qwen3-layers", "dflash", "vllm", "llama", {"num_draft_layers": 2, **QWEN3_LAYERS}),
    Case("dspark-qwen3-layers", "dspark", "sglang", "llama", {**MARKOV, **MASK, **QWEN3_LAYERS}),
    Case("dspark-qwen3-layers", "dspark", "vllm", "llama", {**MARKOV, **QWEN3_LAYERS}),
    Case("eagle3-llama-layers", "eagle3", "sglang", "qwen3", {"target_layer_ids": [0, 1, 2], **LLAMA_LAYERS}),
    Case("eagle3-llama-layers-reduced", "eagle3", "sglang", "qwen3", {"target_layer_ids": [0, 1, 2], **LLAMA_LAYERS},
         reduced_vocab=64),
    Case("eagle3-llama-layers", "eagle3", "vllm", "qwen3", {"target_layer_ids": [0, 1, 2], **LLAMA_LAYERS}),
    Case("mtp-1-qwen3-layers", "mtp", "vllm", "llama", {"num_mtp_modules": 1, **QWEN3_LAYERS}),
    # ... and without it the engine's layer class cannot hold the drafter: refused naming the option.
    Case("dflash-llama-layers", "dflash", "sglang", "llama", {"num_draft_layers": 1},
         refused=r"builds qwen3 draft layers.*drafter\.layer_family=qwen3"),
    Case("dspark-llama-layers", "dspark", "vllm", "llama", MARKOV, refused=r"drafter\.layer_family=qwen3"),
    Case("eagle3-qwen3-layers", "eagle3", "sglang", "qwen3", {"target_layer_ids": [0, 1, 2]},
         refused=r"builds llama or mistral draft layers.*drafter\.layer_family=llama"),
]

# layout -> consumers that read it
CONSUMERS = {
    ("eagle3", "sglang"): ["specforge"],
    ("eagle3", "vllm"): ["speculators"],
    ("dflash", "sglang"): ["dflash", "specforge", "speculators"],
    ("dflash", "vllm"): ["speculators"],
    ("dspark", "sglang"): ["specforge"],
    ("dspark", "vllm"): ["speculators"],
    ("mtp", "vllm"): ["speculators"],
}
PACKAGES = {"speculators": "speculators", "dflash": "dflash", "specforge": "specforge"}
REFUSED = "(refused)"  # the consumer column of a refusal row


def consumers_of(case: Case) -> list[str]:
    return [REFUSED] if case.refused else CONSUMERS[(case.kind, case.layout)]


@dataclass
class Row:
    case: str
    kind: str
    layout: str
    consumer: str
    loads: bool = False  # loads the folder exactly as DeepSpec wrote it
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    max_diff: float | None = None
    tokens_equal: bool | None = None
    ours_tokens: list | None = None
    consumer_tokens: list | None = None
    # SpecForge DSpark only: whether its own spec_generate slot reading (slots 1..G-1 always) drafts our tokens
    own_loop_tokens_equal: bool | None = None
    layer_model_type: str | None = None  # the model_type of the draft-layer config the folder holds
    refusal: str | None = None  # the export's message when it refused (refusal rows)
    folder_left: bool | None = None  # refusal rows: whether anything was written
    note: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def consumer_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# -- DeepSpec side ---------------------------------------------------------------------------------
def make_target(family: str):
    from deepspec.targets.load import make_tiny_target

    return make_tiny_target(family)


def make_drafter(case: Case, target, seed: int = 0):
    """A drafter with every weight randomised (norms around 1) so any swapped tensor shows up."""
    from deepspec.drafters.build import build_drafter
    from deepspec.drafters.draft_vocab import build_draft_vocab

    torch.manual_seed(seed)
    overrides = dict(case.overrides)
    if case.reduced_vocab:
        overrides["draft_vocab_size"] = case.reduced_vocab
    model = build_drafter(case.kind, target, **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    if case.reduced_vocab:
        counts = torch.arange(target.model.config.vocab_size).flip(0) % 1013
        d2t, t2d = build_draft_vocab(counts, case.reduced_vocab, always_keep=[2])
        model.set_draft_vocab(d2t, t2d)
        with torch.no_grad():
            model.lm_head.weight.add_(0.1)
    return model.eval()


def inputs_for(model, seed: int = 1) -> dict[str, torch.Tensor]:
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    vocab, hidden = config.target_vocab_size, config.hidden_size
    kind = type(config).drafter_kind
    width = len(config.target_layer_ids) * hidden if kind in ("dflash", "dspark", "eagle3") else hidden
    return {
        "features_BCF": torch.randn(BATCH, CONTEXT, width, generator=generator),
        "tokens_BC": torch.randint(0, vocab, (BATCH, CONTEXT), generator=generator),  # Eagle3/MTP: x[t+1]
        "anchors_B": torch.randint(0, vocab, (BATCH,), generator=generator),
    }


def greedy_with_probs(logits_BV, slot):
    return logits_BV.argmax(dim=-1), torch.softmax(logits_BV.float(), dim=-1)


@torch.no_grad()
def ours(model, inputs) -> dict[str, torch.Tensor]:
    """DeepSpec's numbers on `inputs` (the re-read drafter's, i.e. `load_exported`)."""
    from deepspec.decoding.kv_cache import DraftKVCache

    kind = type(model.config).drafter_kind
    features, tokens = inputs["features_BCF"], inputs["tokens_BC"]
    if kind in ("dflash", "dspark"):
        positions = torch.arange(CONTEXT).expand(BATCH, CONTEXT)
        cache = model.extend_context(model.new_decode_state(), features, positions)
        anchor_pos = torch.full((BATCH,), CONTEXT)
        hidden_BGH = model.draft_hidden(cache, inputs["anchors_B"], anchor_pos)
        proposal = model.propose(cache, inputs["anchors_B"], anchor_pos, greedy_with_probs)
        out = {"hidden_BGH": hidden_BGH, "probs_BKV": proposal.probs_BKV, "tokens_BK": proposal.token_ids_BK,
               "first_draft_slot": model.config.first_draft_slot}
        if proposal.confidence_BK is not None:
            out["confidence_BK"] = proposal.confidence_BK
        return out
    positions_BN = torch.arange(CONTEXT).expand(BATCH, CONTEXT)
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril().expand(BATCH, 1, CONTEXT, CONTEXT)
    embeds = model.target_parts.embed(tokens)
    if kind == "eagle3":
        hidden = model.layer_forward(embeds, model.fuse_features(features), positions_BN, causal, DraftKVCache())
        step0 = model.draft_logits(hidden)  # draft-vocabulary logits (V with the full vocabulary)
        draft = model.propose(model.new_decode_state(), features, tokens, greedy_with_probs, num_draft=CHAIN)
    else:  # mtp: the proposal of its D modules (what the layout declares as speculative_tokens)
        hidden = model.module_forward(0, embeds, features, positions_BN, causal, DraftKVCache())
        step0 = model.module_logits(0, hidden)
        draft = model.propose(model.new_decode_state(), features, tokens, greedy_with_probs)
    return {"step0_logits_BNV": step0, "tokens_BK": draft.token_ids_BK}


def save_target_folder(target, root: Path) -> Path:
    """A local verifier folder (config + safetensors) that speculators can resolve."""
    folder = root / f"verifier-{target.model.config.model_type}"
    if not folder.exists():
        target.model.save_pretrained(folder)
    return folder


def export_case(case: Case, model, target, out_dir: Path) -> Path:
    from deepspec.export import export_drafter

    opts = {"verifier": str(save_target_folder(target, out_dir.parent))} if case.layout == "vllm" else {}
    return export_drafter(model, out_dir, case.layout, target=target, **opts)


# -- helpers for every consumer ----------------------------------------------------------------------
def file_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def key_diff(model, folder: Path, consumer_owned: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(missing, unexpected): model keys absent from the file (minus keys the consumer fills from the target) and
    file keys the model has no place for (a consumer silently drops those)."""
    have = set(model.state_dict())
    stored = file_keys(folder)
    missing = sorted(k for k in have - stored if not k.startswith(consumer_owned))
    unexpected = sorted(stored - have)
    return missing, unexpected


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def compare_tokens(row: Row, ours_BK: torch.Tensor, consumer_BK: torch.Tensor) -> None:
    """The consumer's drafts vs DeepSpec's for the same target positions (a + 1, a + 2, ...): equal count and ids."""
    row.ours_tokens, row.consumer_tokens = ours_BK.tolist(), consumer_BK.tolist()
    row.tokens_equal = ours_BK.shape == consumer_BK.shape and bool(torch.equal(ours_BK, consumer_BK))


def teacher_forced_prev(ref, anchors_B: torch.Tensor, block_size: int) -> torch.Tensor:
    """prev_BG: the token before each slot's prediction with DeepSpec's drafts as the block so far. Draft k (at
    slot first + k) follows x[a] (k = 0) or draft k - 1; slots before the first draft follow the anchor."""
    first = ref["first_draft_slot"]
    prev_BG = anchors_B[:, None].repeat(1, block_size)
    prev_BG[:, first + 1:] = ref["tokens_BK"][:, :-1]
    return prev_BG


def declared_drafts(folder: Path) -> int | None:
    engine = json.loads((folder / "config.json").read_text())
    methods = (engine.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


# -- dflash 0.1.0 ----------------------------------------------------------------------------------
def block_consumer_hidden(model, target, inputs):
    """The consumer's block forward (dflash/SpecForge signature): [anchor, mask*(G-1)] after the C context features,
    as `dflash_generate` calls it (dflash/model.py:238-249), with the target's raw embedding rows."""
    g = model.block_size
    anchors = inputs["anchors_B"]
    ids_BG = torch.full((anchors.shape[0], g), int(model.mask_token_id), dtype=torch.long)
    ids_BG[:, 0] = anchors
    noise = target.model.get_input_embeddings()(ids_BG)
    positions = torch.arange(CONTEXT + g)[None].expand(anchors.shape[0], -1)
    return ids_BG, model(target_hidden=inputs["features_BCF"], noise_embedding=noise,
                         position_ids=positions, past_key_values=None, use_cache=False)


def run_dflash(case, folder, target, inputs, ref, row: Row) -> None:
    from dflash.model import DFlashDraftModel

    model, info = DFlashDraftModel.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32)
    model.eval()
    row.loads = True
    row.missing, row.unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    with torch.no_grad():
        _, hidden_BGH = block_consumer_hidden(model, target, inputs)
        row.max_diff = max_abs(hidden_BGH, ref["hidden_BGH"])
        # dflash_generate: draft_hidden[:, 1 - block_size:] -> tokens for slots 1..G-1 (model.py:243-268)
        logits = model.compute_logits(hidden_BGH[:, 1 - model.block_size:, :], target.model.lm_head)
        row.max_diff = max(row.max_diff, max_abs(torch.softmax(logits, -1), ref["probs_BKV"]))
    compare_tokens(row, ref["tokens_BK"], logits.argmax(dim=-1))
    row.note = (f"target_layer_ids={model.target_layer_ids} block_size={model.block_size} "
                f"mask_token_id={model.mask_token_id}; consumer slots 1..G-1")


# -- specforge 0.2.0 -------------------------------------------------------------------------------
def run_specforge(case, folder, target, inputs, ref, row: Row) -> None:
    from specforge.modeling.auto import AutoDraftModel

    model, info = AutoDraftModel.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32)
    model.eval()
    row.loads = True
    row.missing, row.unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if case.kind == "eagle3":
        # SGLang's Eagle3 and SpecForge (load_embedding) take the embedding from the target: not stored.
        row.missing = [k for k in row.missing if not k.startswith("embed_tokens.")]
        return specforge_eagle3(model, target, inputs, ref, row)
    engine = json.loads((folder / "config.json").read_text())
    with torch.no_grad():
        ids_BG, hidden_BGH = block_consumer_hidden(model, target, inputs)
        row.max_diff = max_abs(hidden_BGH, ref["hidden_BGH"])
        # spec_generate: block_output_ids[:, 1:] = _sample_draft_tokens(...) (slots 1..G-1, whatever the flags)
        own_tokens = model._sample_draft_tokens(target.model, hidden_BGH, ids_BG)
        notes = [f"{type(model).__name__} block_size={model.block_size} mask_token_id={model.mask_token_id}"]
        if case.kind == "dflash":
            compare_tokens(row, ref["tokens_BK"], own_tokens)
            row.note = "; ".join(notes) + "; consumer slots 1..G-1 (spec_generate)"
            return
        # DSpark: SGLang (>= 0.5.19) reads the top-level sample_from_anchor (dspark_draft.py:88-106, 656-670);
        # SpecForge's heads applied to SGLang's slot choice, and SpecForge's own loop (slots 1..G-1) on the side.
        first = 0 if engine["sample_from_anchor"] else 1
        draft_hidden_BKH = hidden_BGH[:, first:]
        base_BKV = target.model.lm_head(draft_hidden_BKH)
        consumer, _ = model.markov_head.sample_block_tokens(base_BKV, first_prev_token_ids=inputs["anchors_B"],
                                                            hidden_states=draft_hidden_BKH)
        prev_BK = teacher_forced_prev(ref, inputs["anchors_B"], model.block_size)[:, first:]
        corrected = model.markov_head.apply_block_logits(base_BKV, token_ids=prev_BK, hidden_states=draft_hidden_BKH)
        row.max_diff = max(row.max_diff, max_abs(torch.softmax(corrected, -1), ref["probs_BKV"]))
        if model.confidence_head is not None:
            features = torch.cat([draft_hidden_BKH, model.markov_head.get_prev_embeddings(prev_BK)], dim=-1)
            row.max_diff = max(row.max_diff, max_abs(torch.sigmoid(model.confidence_head(features)),
                                                     ref["confidence_BK"]))
    compare_tokens(row, ref["tokens_BK"], consumer)
    row.own_loop_tokens_equal = (own_tokens.shape == ref["tokens_BK"].shape
                                 and bool(torch.equal(own_tokens, ref["tokens_BK"])))
    notes.append(f"markov_head={type(model.markov_head).__name__} confidence_head="
                 f"{'yes' if model.confidence_head is not None else 'no'}; slots {first}..G-1 as SGLang 0.5.23 reads "
                 f"sample_from_anchor={engine['sample_from_anchor']}; SpecForge's own spec_generate (slots 1..G-1) "
                 f"tokens equal: {row.own_loop_tokens_equal}")
    row.note = "; ".join(notes)


def specforge_eagle3(model, target, inputs, ref, row: Row) -> None:
    # SGLang/SpecForge take the embedding from the target (SpecForge: load_embedding); not stored in the export.
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    model.midlayer.self_attn._init_rope()  # specforge 0.2.0 bug: RoPE buffers uninitialised after from_pretrained
    features, tokens = inputs["features_BCF"], inputs["tokens_BC"]
    n = CONTEXT
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None].expand(BATCH, 1, n, n)
    positions = torch.arange(n)[None].expand(BATCH, n)
    d2t = model.d2t
    with torch.no_grad():
        hidden = model.project_hidden_states(features)
        cache_hidden = [[], []]
        embeds = model.embed_input_ids(tokens)
        chain = []
        for step in range(CHAIN):
            hidden = model.backbone(input_embeds=embeds, hidden_states=hidden, cache_hidden=cache_hidden,
                                    attention_mask=causal, position_ids=positions)
            logits = model.compute_logits(hidden)
            if step == 0:
                row.max_diff = max_abs(logits, ref["step0_logits_BNV"])
            draft_ids = logits.argmax(-1)
            target_ids = draft_ids + d2t[draft_ids]  # SGLang hot_token_id = d2t + arange
            chain.append(target_ids[:, -1])
            embeds = model.embed_input_ids(target_ids)  # each row continues with its own draft (TTT == inference)
    compare_tokens(row, ref["tokens_BK"], torch.stack(chain, dim=1))
    row.note = (f"draft_vocab_size={model.config.draft_vocab_size}; embed_tokens copied from the target (SGLang "
                "set_embed); RoPE re-init workaround")


# -- speculators 0.9.0 -----------------------------------------------------------------------------
def speculators_load(folder: Path, target, workdir: Path, row: Row):
    """`SpeculatorModel.from_pretrained` on the folder as written -> (model, folder it read, note).

    A folder without `speculators_model_type` goes through speculators' own external-checkpoint conversion
    (what `from_pretrained(path, verifier=...)` runs), given the local verifier a user would pass.
    """
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.convert.entrypoints import maybe_convert_external_checkpoint

    def attempt(path: Path):
        config = SpeculatorModelConfig.from_pretrained(str(path))
        config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention fails on CPU
        return SpeculatorModel.from_pretrained(str(path), config=config)

    engine = json.loads((folder / "config.json").read_text())
    if "speculators_model_type" not in engine:
        verifier = save_target_folder(target, workdir)
        converted = Path(maybe_convert_external_checkpoint(str(folder), verifier=str(verifier),
                                                           output_path=str(workdir / (folder.name + "-converted"))))
        return (attempt(converted), converted,
                "auto-converted by speculators (external checkpoint, verifier=local target)")
    return attempt(folder), folder, ""


def run_speculators(case, folder, target, inputs, ref, row: Row, workdir: Path) -> None:
    model, read, why = speculators_load(folder, target, workdir, row)
    model.eval()
    row.loads = True
    owned = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")
    if case.kind == "mtp" or not getattr(model, "use_draft_vocab", True):
        owned += ("lm_head.",)
    row.missing, row.unexpected = key_diff(model, read, owned)
    row.note = "; ".join(n for n in (why, type(model).__name__) if n)
    declared = declared_drafts(read)
    if case.kind == "eagle3":
        speculators_eagle3(model, inputs, ref, row)
    elif case.kind in ("dflash", "dspark"):
        speculators_block(model, inputs, ref, row, declared)
    else:
        speculators_mtp(model, inputs, ref, row, declared)


def speculators_eagle3(model, inputs, ref, row: Row) -> None:
    from transformers import DynamicCache

    features, tokens = inputs["features_BCF"], inputs["tokens_BC"]
    n = CONTEXT
    positions = torch.arange(n)[None].expand(BATCH, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(BATCH, 1, n, n)
    with torch.no_grad():
        cache = DynamicCache()
        hidden = model.fc(features)
        chain, query_mask = [], causal
        embeds, pos = model.embed_tokens(tokens), positions
        for step in range(CHAIN):
            x = torch.cat([embeds, hidden], dim=-1)
            rope = model.rotary_emb(x, pos)
            for layer in model.layers:
                hidden = layer(x, attention_mask=query_mask, position_ids=pos, past_key_values=cache,
                               position_embeddings=rope)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            logits = model.lm_head(model.norm(hidden))
            if model.config.norm_output:
                hidden = model.norm(hidden)
            if step == 0:
                row.max_diff = max_abs(logits, ref["step0_logits_BNV"])
                hidden = hidden[:, -1:]
                pos = positions[:, -1:]
            ids = logits[:, -1].argmax(-1)
            if model.use_draft_vocab:
                ids = ids + model.d2t[ids]
            chain.append(ids)
            embeds = model.embed_tokens(ids[:, None])
            pos = pos + 1
            length = cache.get_seq_length()
            query_mask = torch.ones(BATCH, 1, 1, length + 1, dtype=torch.bool)
    compare_tokens(row, ref["tokens_BK"], torch.stack(chain, dim=1))


def speculators_block(model, inputs, ref, row: Row, declared: int | None) -> None:
    """speculators' own anchored-block forward (`_backbone_forward`) with one anchor at position C, then its slot
    reading (`sample_from_anchor`: slots 0..G-1, else 1..G-1) and, for DSpark, its Markov/confidence heads."""
    g = model.block_size
    total = CONTEXT + g + 1  # select_anchors excludes the last G positions
    hidden_rows, logits_rows = [], []
    for b in range(BATCH):
        feats = torch.zeros(1, total, inputs["features_BCF"].shape[-1])
        feats[:, :CONTEXT] = inputs["features_BCF"][b : b + 1]
        ids = torch.zeros(1, total, dtype=torch.long)
        ids[0, CONTEXT] = inputs["anchors_B"][b]
        loss_mask = torch.zeros(1, total, dtype=torch.long)
        loss_mask[0, CONTEXT] = 1
        with torch.no_grad():
            hidden, logits, _, _, _ = model._backbone_forward(
                feats, ids, loss_mask, torch.zeros(1, total, model.hidden_size),
                torch.zeros(1, total, dtype=torch.long), max_anchors=1)
        hidden_rows.append(hidden[0])
        logits_rows.append(logits[0])
    hidden_BGH, logits_BGV = torch.stack(hidden_rows), torch.stack(logits_rows)
    row.max_diff = max_abs(hidden_BGH, ref["hidden_BGH"])
    first = 0 if model.config.sample_from_anchor else 1
    markov = getattr(model, "markov_head", None)
    with torch.no_grad():
        if markov is None:
            consumer = logits_BGV[:, first:].argmax(-1)
            row.max_diff = max(row.max_diff, max_abs(torch.softmax(logits_BGV[:, first:], -1), ref["probs_BKV"]))
        else:
            # Teacher-forced with DeepSpec's drafts: the corrected distributions and confidences, slot-aligned.
            prev_BG = teacher_forced_prev(ref, inputs["anchors_B"], g)
            bias = markov.block_bias(prev_token_ids=prev_BG, hidden_states=hidden_BGH)
            probs = torch.softmax(logits_BGV[:, first:] + bias[:, first:], -1)
            row.max_diff = max(row.max_diff, max_abs(probs, ref["probs_BKV"]))
            if model.confidence_head is not None:
                conf_in = torch.cat([hidden_BGH, markov.prev_embeddings(prev_BG)], dim=-1)[:, first:]
                row.max_diff = max(row.max_diff, max_abs(torch.sigmoid(model.confidence_head(conf_in)),
                                                         ref["confidence_BK"]))
            # Greedy left to right, slot k biased by the token drafted before it (dspark/core.py prev_token_ids).
            prev_BG = inputs["anchors_B"][:, None].repeat(1, g)
            for k in range(first, g):
                bias_BV = markov.block_bias(prev_token_ids=prev_BG, hidden_states=hidden_BGH)[:, k]
                token = (logits_BGV[:, k] + bias_BV).argmax(-1)
                if k + 1 < g:
                    prev_BG[:, k + 1] = token
            consumer = torch.cat([prev_BG[:, first + 1:], token[:, None]], dim=1)
    compare_tokens(row, ref["tokens_BK"], consumer[:, :declared])
    row.note += (f"; sample_from_anchor={model.config.sample_from_anchor} aux_ids={model.target_layer_ids} "
                 f"speculative_tokens={declared}")


def speculators_mtp(model, inputs, ref, row: Row, declared: int | None) -> None:
    """speculators' MTP layer on the verifier's final hidden + next-token embeddings (models/mtp/core.py)."""
    n = CONTEXT
    positions = torch.arange(n)[None].expand(BATCH, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(BATCH, 1, n, n)
    with torch.no_grad():
        layer = model.mtp_layers[0]
        out = layer(hidden_states=inputs["features_BCF"], token_embeddings=model.embed_tokens(inputs["tokens_BC"]),
                    attention_mask=causal, position_ids=positions,
                    position_embeddings=model.rotary_emb(inputs["features_BCF"], positions))
        logits = model.lm_head(out)
    row.max_diff = max_abs(logits, ref["step0_logits_BNV"])
    compare_tokens(row, ref["tokens_BK"], logits[:, -1:].argmax(-1)[:, :declared])
    row.note += f"; speculative_tokens={declared} (one module: the first draft)"


@contextlib.contextmanager
def hub_offline():
    """Consumers that resolve a hub name must fail at once (no network here), not after retries."""
    import huggingface_hub.constants as hub

    saved, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved


# -- driver --------------------------------------------------------------------------------------------
def run_consumer(row: Row, case: Case, folder: Path, target, inputs, reference, workdir: Path) -> None:
    if row.consumer == "speculators":
        run_speculators(case, folder, target, inputs, reference, row, workdir)
    elif row.consumer == "specforge":
        run_specforge(case, folder, target, inputs, reference, row)
    else:
        run_dflash(case, folder, target, inputs, reference, row)


def run_refusal(case: Case, model, target, folder: Path) -> list[Row]:
    row = Row(case.name, case.kind, case.layout, REFUSED)
    try:
        export_case(case, model, target, folder)
        row.note = "exported: expected a refusal"
    except ValueError as error:
        row.refusal = str(error)
        row.note = f"refused: {str(error)[:240]}"
    row.folder_left = folder.exists()
    return [row]


def run_case(case: Case, workdir: Path, targets: dict) -> list[Row]:
    from deepspec.export import load_exported

    target = targets.setdefault(case.family, make_target(case.family))
    model = make_drafter(case, target)
    folder = workdir / f"{case.name}-{case.layout}"
    if case.refused:
        return run_refusal(case, model, target, folder)
    inputs = inputs_for(model)
    rows = [Row(case.name, case.kind, case.layout, consumer) for consumer in consumers_of(case)]
    try:
        export_case(case, model, target, folder)
    except Exception as error:
        for row in rows:
            row.note = f"DeepSpec export refused: {type(error).__name__}: {str(error)[:200]}"
        return rows
    reference = ours(load_exported(folder, target), inputs)
    engine = json.loads((folder / "config.json").read_text())
    for row in rows:
        row.layer_model_type = engine.get("transformer_layer_config", engine).get("model_type")
        if consumer_version(PACKAGES[row.consumer]) is None:
            row.note = f"{row.consumer} not installed"
            continue
        try:
            with hub_offline():
                run_consumer(row, case, folder, target, inputs, reference, workdir)
        except Exception as error:  # a refusal is a finding, recorded in the row
            last = traceback.extract_tb(error.__traceback__)[-1]
            where = f"{Path(last.filename).name}:{last.lineno}"
            message = str(error).splitlines()[0][:220] if str(error) else ""
            row.note = (row.note + " | " if row.note else "") + f"{type(error).__name__} at {where}: {message}"
    return rows


def refusal_matches(case: Case, row: Row) -> bool:
    return row.refusal is not None and re.search(case.refused, row.refusal) is not None


def run_all(cases=CASES, workdir: Path | None = None) -> list[Row]:
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="deepspec-interop-")) if own else Path(workdir)
    targets: dict = {}
    try:
        rows = []
        for case in cases:
            rows.extend(run_case(case, workdir, targets))
        return rows
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def markdown(rows: list[Row]) -> str:
    lines = ["| case | layout | consumer | loads | missing | unexpected | max diff | drafted tokens equal | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r.max_diff is None else f"{r.max_diff:.1e}"
        eq = "" if r.tokens_equal is None else ("yes" if r.tokens_equal else "**no**")
        loads = "-" if r.consumer == REFUSED else ("yes" if r.loads else "**no**")
        lines.append(f"| {r.case} | {r.layout} | {r.consumer} | {loads} | {', '.join(r.missing) or '-'} | "
                     f"{', '.join(r.unexpected) or '-'} | {diff} | {eq} | {r.note.replace('|', '/')} |")
    return "\n".join(lines)


__all__ = ["CASES", "CONSUMERS", "Case", "Row", "consumer_version", "consumers_of", "markdown", "refusal_matches",
           "run_all", "run_case"]
