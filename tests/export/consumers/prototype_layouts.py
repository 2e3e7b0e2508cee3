"""Phase-2 candidate layouts, checked against the real consumers before the exporters change (issue 14).

Each experiment takes today's export of a tiny random drafter, rewrites its folder into a candidate layout
(what phase 2 would write) and loads it with the consumer's own code, comparing with DeepSpec's numbers:
- eagle3 full vocabulary as an explicit identity draft vocabulary (lm_head = target head, d2t = 0, t2d = all)
  -> SpecForge `AutoDraftModel` (and what SGLang's `LlamaForCausalLMEagle3.load_weights` reads the same way);
- DSpark head settings under `dflash_config` (+ top level) -> SpecForge `DSparkDraftModel`;
- DSpark in the speculators layout (`speculators_model_type: "dspark"`, `sample_from_anchor: true`)
  -> speculators `DSparkDraftModel`;
- MTP in speculators' layout (`mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,..}`)
  -> speculators `MTPDraftModel`.
Run: PYTHONPATH=$PWD .venv/bin/python tests/export/consumers/prototype_layouts.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


sys.path.insert(0, str(Path(__file__).parent))  # scripts beside the harness import it directly
import harness as H  # noqa: E402


def rewrite(folder: Path, out: Path, config_edit, tensor_edit=None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config_edit(config)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(str(folder / "model.safetensors"))
    if tensor_edit is not None:
        tensors = tensor_edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def prepare(case: H.Case, workdir: Path, targets: dict):
    from deepspec.export import load_exported

    target = targets.setdefault(case.family, H.make_target(case.family))
    model = H.make_drafter(case, target)
    inputs = H.inputs_for(model)
    folder = H.export_case(case, model, target, workdir / f"{case.name}-{case.layout}")
    return target, inputs, folder, H.ours(load_exported(folder, target), inputs)


def eagle3_identity_vocab(workdir: Path, targets: dict) -> H.Row:
    case = H.Case("eagle3-full", "eagle3", "sglang", "llama", {"target_layer_ids": [0, 1, 2]})
    target, inputs, folder, ref = prepare(case, workdir, targets)
    vocab = target.model.config.vocab_size
    head = target.model.get_output_embeddings().weight.detach().clone()

    def config_edit(config):
        config["draft_vocab_size"] = vocab

    def tensor_edit(tensors):
        return {**tensors, "lm_head.weight": head, "d2t": torch.zeros(vocab, dtype=torch.long),
                "t2d": torch.ones(vocab, dtype=torch.bool)}

    candidate = rewrite(folder, workdir / "eagle3-identity", config_edit, tensor_edit)
    row = H.Row("eagle3-full [identity draft vocab]", "eagle3", "sglang", "specforge")
    H.run_specforge(case, candidate, target, inputs, ref, row)
    return row


def dspark_in_dflash_config(workdir: Path, targets: dict, name: str, overrides: dict) -> H.Row:
    case = H.Case(name, "dspark", "sglang", "qwen3", overrides)
    target, inputs, folder, ref = prepare(case, workdir, targets)

    def config_edit(config):
        fields = config["dspark_config"]
        moved = {"markov_rank": fields["markov_rank"], "markov_head_type": fields["markov_head_type"],
                 "enable_confidence_head": fields["enable_confidence_head"],
                 "confidence_head_with_markov": fields["confidence_head_with_markov"]}
        config["dflash_config"].update(moved)
        config.update(moved)  # SGLang 0.5.23 build_markov_head/build_confidence_head read the top level

    candidate = rewrite(folder, workdir / f"{name}-dflash-config", config_edit)
    row = H.Row(f"{name} [heads in dflash_config]", "dspark", "sglang", "specforge")
    H.run_specforge(case, candidate, target, inputs, ref, row)
    # Confidence: SpecForge's head reads [h; W1[prev]] like DeepSpec's; compare slot-aligned logits.
    from specforge.modeling.auto import AutoDraftModel

    model = AutoDraftModel.from_pretrained(str(candidate), dtype=torch.float32).eval()
    if model.confidence_head is not None and "confidence_BG" in ref:
        with torch.no_grad():
            ids_BG, hidden_BGH = H.block_consumer_hidden(model, target, inputs)
            prev_BG = torch.cat([ids_BG[:, :1], ref["tokens_BG"][:, :-1]], dim=1)
            features = torch.cat([hidden_BGH, model.markov_head.get_prev_embeddings(prev_BG)], dim=-1)
            confidence = torch.sigmoid(model.confidence_head(features))
        row.max_diff = max(row.max_diff, H.max_abs(confidence, ref["confidence_BG"]))
        row.note += "; confidence compared too"
    return row


def dspark_speculators(workdir: Path, targets: dict) -> H.Row:
    case = H.Case("dspark-markov", "dspark", "sglang", "qwen3", {"num_draft_layers": 2, "markov_rank": 8})
    target, inputs, folder, ref = prepare(case, workdir, targets)
    vllm_case = H.Case("dflash", "dflash", "vllm", "qwen3", {"num_draft_layers": 2})
    vllm_model = H.make_drafter(vllm_case, target)
    vllm_folder = H.export_case(vllm_case, vllm_model, target, workdir / "dflash-vllm-template")
    template = json.loads((vllm_folder / "config.json").read_text())
    sglang = json.loads((folder / "config.json").read_text())

    def config_edit(config):
        config.clear()
        config.update(template)
        fields = sglang["dspark_config"]
        config.update(architectures=["DSparkSpeculator"], speculators_model_type="dspark", sample_from_anchor=True,
                      markov_rank=fields["markov_rank"], markov_head_type=fields["markov_head_type"],
                      enable_confidence_head=fields["enable_confidence_head"],
                      confidence_head_with_markov=fields["confidence_head_with_markov"])
        config["speculators_config"]["algorithm"] = "dspark"
        config["speculators_config"]["verifier"]["name_or_path"] = str(H.save_target_folder(target, workdir))

    candidate = rewrite(folder, workdir / "dspark-speculators", config_edit)
    row = H.Row("dspark-markov [speculators dspark]", "dspark", "vllm", "speculators")
    H.run_speculators(case, candidate, target, inputs, ref, row, workdir)
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(candidate))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(str(candidate), config=config).eval()
    with torch.no_grad():  # Markov bias + confidence with speculators' own prev-token rule (sample_from_anchor)
        anchors = inputs["anchors_B"]
        prev_BG = torch.cat([anchors[:, None], ref["tokens_BG"][:, :-1]], dim=1)
        base = model.lm_head(ref["hidden_BGH"])
        bias = model.markov_head.block_bias(prev_token_ids=prev_BG, hidden_states=ref["hidden_BGH"])
        probs = torch.softmax(base + bias, dim=-1)
        features = torch.cat([ref["hidden_BGH"], model.markov_head.prev_embeddings(prev_BG)], dim=-1)
        confidence = torch.sigmoid(model.confidence_head(features))
    row.max_diff = max(row.max_diff, H.max_abs(probs, ref["probs_BGV"]), H.max_abs(confidence, ref["confidence_BG"]))
    row.note += "; Markov probs + confidence compared"
    return row


def mtp_speculators(workdir: Path, targets: dict) -> H.Row:
    case = H.Case("mtp-1", "mtp", "nextn", "qwen3", {"num_mtp_modules": 1}, {"standalone": True})
    target, inputs, folder, ref = prepare(case, workdir, targets)
    names = {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.", "eh_proj.": "input_proj.",
             "shared_head.norm.": "final_layernorm."}

    def tensor_edit(tensors):
        out = {}
        for key, value in tensors.items():
            local = key.removeprefix("model.layers.0.")
            if local.startswith(("embed_tokens.", "shared_head.head.")):
                continue  # the verifier's, loaded by speculators itself
            for old, new in names.items():
                if local.startswith(old):
                    local = new + local[len(old):]
            out["mtp_layers.0." + local] = value
        return out

    nextn = json.loads((folder / "config.json").read_text())

    def config_edit(config):
        layer = dict(nextn)
        layer.pop("num_nextn_predict_layers", None)
        layer["num_hidden_layers"] = target.model.config.num_hidden_layers
        config.clear()
        config.update({
            "architectures": ["MTPDraftModel"], "speculators_model_type": "mtp", "num_nextn_predict_layers": 1,
            "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 1,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": str(H.save_target_folder(target, workdir)),
                                                "architectures": ["Qwen3ForCausalLM"]}},
        })

    candidate = rewrite(folder, workdir / "mtp-speculators", config_edit, tensor_edit)
    row = H.Row("mtp-1 [speculators mtp]", "mtp", "vllm", "speculators")
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(candidate)).eval()
    row.loads = row.loads_as_exported = True
    row.missing, row.unexpected = H.key_diff(model, candidate, ("embed_tokens.", "lm_head.", "verifier_"))
    n = H.CONTEXT
    positions = torch.arange(n)[None].expand(H.BATCH, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(H.BATCH, 1, n, n)
    with torch.no_grad():
        layer = model.mtp_layers[0]
        out = layer(hidden_states=inputs["features_BCF"], token_embeddings=model.embed_tokens(inputs["tokens_BC"]),
                    attention_mask=causal, position_ids=positions,
                    position_embeddings=model.rotary_emb(inputs["features_BCF"], positions))
        logits = model.lm_head(out)
        row.max_diff = H.max_abs(logits, ref["step0_logits_BNV"])
        first = logits[:, -1].argmax(-1)
    row.ours_tokens, row.consumer_tokens = ref["tokens_BK"][:, :1].tolist(), first[:, None].tolist()
    row.tokens_equal = bool(torch.equal(first, ref["tokens_BK"][:, 0]))
    row.note = ("first draft only: speculators re-applies its one layer to the post-final_layernorm output "
                "(core.py:274), DeepSpec chains pre-norm hidden")
    return row


def main() -> None:
    torch.set_num_threads(1)
    workdir, targets = Path(tempfile.mkdtemp(prefix="deepspec-proto-")), {}
    rows = []
    experiments = [
        lambda: eagle3_identity_vocab(workdir, targets),
        lambda: dspark_in_dflash_config(workdir, targets, "dspark-markov", {"num_draft_layers": 2, "markov_rank": 8}),
        lambda: dspark_in_dflash_config(workdir, targets, "dspark-rnn",
                                        {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn"}),
        lambda: dspark_speculators(workdir, targets),
        lambda: mtp_speculators(workdir, targets),
    ]
    for experiment in experiments:
        with H.hub_offline():
            try:
                rows.append(experiment())
            except Exception as error:  # noqa: BLE001
                rows.append(H.Row("?", "?", "?", "?", note=f"{type(error).__name__}: {str(error)[:300]}"))
    print(H.markdown(rows))


if __name__ == "__main__":
    main()
