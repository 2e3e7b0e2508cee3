"""vLLM's own DSpark draft module on given target features, executed by the Python of vLLM's environment.

    <vllm-python> -I tests/export/vllm_dspark_worker.py JOB.json

vLLM pins its own torch, so this file imports only vLLM, torch, safetensors and the standard library and talks to
the test through files. JOB (JSON) names the target folder, the exported DSpark folder (`deepspec export --format
vllm`), an input safetensors file and the output safetensors file. The inputs are, per request r, the target's
feature-layer outputs `features_<r>` [C, F] (the concatenated aux hidden states vLLM's runner hands the drafter)
and `anchor_<r>` [1], the token after the context (vLLM's bonus token). The outputs are, per request, `tokens_<r>`
[K] (greedy drafts), `base_logits_<r>` [K, V] (the parallel stage) and `logits_<r>` [K, V] (with the Markov bias of
the previous token: the anchor, then the drafts), `confidence_<r>` [K] when the head has a confidence head.

The module is vLLM's: `load_dspark_model` (vllm/v1/worker/gpu/spec_decode/dspark/utils.py) builds and loads
`Qwen3DSparkForCausalLM` next to the target vLLM builds, the context K/V come from the module's own
`precompute_and_store_context_kv` (its fused projection, K norm and RoPE; captured where it would write the paged
cache), the query block is laid out as `_prepare_dflash_inputs_kernel` does (anchor + mask tokens at the positions
after the context; `sample_from_anchor` picks the slots sampled), and the drafts come from `DSparkSpeculator.
_sample_sequential` itself. Only the attention core is replaced: exact softmax attention of the block's queries
over the context K/V plus the block's own K/V (non-causal, as the DSpark layers are), so no paged KV cache,
attention backend or GPU runner is needed. One process, a one-rank gloo group, vLLM's CPU platform, float32.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exact_attention(layer_attn, q, k, v, context):
    """softmax(q K^T * scale) V over [context K/V ; block K/V], all keys visible (DSpark's non-causal layers)."""
    import torch

    num_heads, num_kv, head_dim = layer_attn.num_heads, layer_attn.num_kv_heads, layer_attn.head_size
    n = q.shape[0]
    ctx_k, ctx_v = context
    keys = torch.cat([ctx_k, k.view(n, num_kv, head_dim)], dim=0)  # [C + n, nkv, hd]
    values = torch.cat([ctx_v, v.view(n, num_kv, head_dim)], dim=0)
    group = num_heads // num_kv
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [nh, C + n, hd]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    queries = q.view(n, num_heads, head_dim).transpose(0, 1)  # [nh, n, hd]
    weights = torch.softmax(queries @ keys.transpose(1, 2) * layer_attn.impl.scale, dim=-1)
    return (weights @ values).transpose(0, 1).reshape(n, num_heads * head_dim)


def run(job: dict) -> None:
    """Every run of the job in one process and one gloo group.

    JOB: {"target", "inputs", "runs": [{"drafter", "outputs", "error"}]}; a run that raises writes its error file.
    """
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    # The one refusal on this path: the CPU platform picks the V1 runner (no Triton CPU backend, vllm.py:724-727),
    # whose feature check rejects DSpark (vllm.py:3198-3203). No runner runs here, so the check is skipped.
    VllmConfig._validate_v1_model_runner = lambda self: None
    _set_torch_accelerator_to_noop()  # what vLLM's CPU runner does before it loads models
    torch.set_num_threads(1)
    for one in job["runs"]:
        try:
            run_one(job["target"], one["drafter"], job["inputs"], one["outputs"])
        except Exception as error:  # a refusal is a result too: its type and message go to the run's error file
            with open(one["error"], "w") as out:
                json.dump({"type": type(error).__name__, "message": str(error)}, out)


def run_one(target_dir: str, drafter_dir: str, inputs_path: str, outputs_path: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    draft_config = json.loads(open(os.path.join(drafter_dir, "config.json")).read())
    sample_from_anchor = draft_config["sample_from_anchor"]
    num_drafts = draft_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    engine_args = EngineArgs(
        model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
        speculative_config={"method": "dspark", "model": drafter_dir, "num_speculative_tokens": num_drafts})
    vllm_config = engine_args.create_engine_config()
    torch.manual_seed(0)
    inputs = load_file(inputs_path)
    outputs: dict[str, torch.Tensor] = {}
    with set_current_vllm_config(vllm_config), torch.no_grad():
        if not model_parallel_is_initialized():  # once per process: the first run's config sets up the group
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1, backend="gloo")
        target = get_model(vllm_config=vllm_config)
        model = load_dspark_model(target, vllm_config).eval()
        inner = model.model
        attn_layers = [layer.self_attn.attn for layer in inner.layers]
        captured: dict[int, tuple] = {}

        def capture(index):
            def do_kv_cache_update(_layer, key, value, _kv_cache, _slot_mapping):
                captured[index] = (key.clone(), value.clone())
            return do_kv_cache_update

        for index, attn in enumerate(attn_layers):
            attn.impl.do_kv_cache_update = capture(index)
            attn.forward = (lambda a, i: lambda q, k, v, *rest, **kw: exact_attention(a, q, k, v, captured[i]))(
                attn, index)

        mask_id = inner.mask_token_id
        requests = sorted(int(name.split("_")[1]) for name in inputs if name.startswith("features_"))
        for r in requests:
            features = inputs[f"features_{r}"].to(torch.float32)
            anchor = inputs[f"anchor_{r}"].to(torch.long)
            num_ctx = features.shape[0]
            context_states = model.combine_hidden_states(features)
            captured.clear()
            model.precompute_and_store_context_kv(context_states, torch.arange(num_ctx),
                                                  torch.arange(num_ctx, dtype=torch.long))
            assert len(captured) == len(attn_layers)
            num_query = num_drafts if sample_from_anchor else 1 + num_drafts
            input_ids = torch.full((num_query,), mask_id, dtype=torch.long)
            input_ids[0] = anchor[0]
            positions = num_ctx + torch.arange(num_query)
            head_hidden = model(input_ids, positions)
            first = 0 if sample_from_anchor else 1
            spec = types.SimpleNamespace(
                _draft_topk=None, num_speculative_steps=num_drafts, model=model,
                sample_indices=torch.arange(first, first + num_drafts),
                sample_idx_mapping=torch.zeros(num_drafts, dtype=torch.long),
                sample_pos=positions[first:first + num_drafts] + (1 if sample_from_anchor else 0),
                use_confidence_head=inner.confidence_head is not None,
                input_buffers=types.SimpleNamespace(input_ids=input_ids), _anchor_idx=torch.zeros(1, dtype=torch.long),
                draft_logits=None, draft_tokens=torch.zeros(1, num_drafts, dtype=torch.long),
                draft_token_confidence_probs=torch.zeros(1, num_drafts), _maybe_predict_acceptance=lambda *a: None,
                _step_cols=torch.arange(num_drafts))
            spec._sample_logits = types.MethodType(DSparkSpeculator._sample_logits, spec)
            DSparkSpeculator._sample_sequential(spec, 1, head_hidden)
            tokens = spec.draft_tokens[0].clone()
            sample_hidden = head_hidden[first:first + num_drafts]
            base = model.compute_draft_logits(sample_hidden)
            prev = torch.cat([anchor[:1], tokens[:-1]])
            outputs[f"tokens_{r}"] = tokens
            outputs[f"base_logits_{r}"] = base.float().contiguous()
            outputs[f"logits_{r}"] = (base + model.markov_bias(model.markov_embed(prev))).float().contiguous()
            if spec.use_confidence_head:
                outputs[f"confidence_{r}"] = spec.draft_token_confidence_probs[0].clone()
    save_file(outputs, outputs_path)


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    run(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
