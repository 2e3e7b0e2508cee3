"""The memory of one rank of a block-drafter training run (DSpark, DFlash), by component.

Static (the whole run): the target's weights as the trainer loads them (every features mode loads the whole
target: its embedding and LM head feed the drafter, its decoder layers run online features, decoded validation and
calibration; with `data.target_sharding=zero3` a rank holds 1/N of every target weight plus whole copies of the
embedding and LM head, which the drafter reads in its own forward and backward: deepspec/targets/sharding.py), the
drafter's parameters, its optimizer states and gradients under the ZeRO stage and world size
(ZeRO, Rajbhandari et al. 2020: bf16 parameters 2 bytes each, fp32 master copy and AdamW moments 12 bytes each
split over the ranks from stage 1, bf16 gradients split from stage 2, parameters from stage 3 - where this
trainer keeps every drafter parameter gathered for the whole step, `TrainingModule.register_for_zero3`; without
ZeRO, one fp32 process: AdamW's two moments in the parameters' dtype), and with `trainer.ema_decay` the fp32
average of the drafter's weights (4 bytes per parameter on every rank).

Per micro-batch (`MicroBatch`, the worst case): the batch on the device, and what autograd keeps for backward,
counted tensor by tensor from the code that runs (a = activation bytes, 4 = fp32 internals of RMSNorm):
- context (per sequence token T): the features cast for the fusion when the batch has another dtype, the fusion's
  RMSNorm (T H (4 + a) + 4 T) and its output H_ctx (T H a), the context RoPE tables (2 T D a), and per draft layer
  the context keys' k-norm (T Kh D (4 + a) + 4 T Kh);
- draft layers (per slot S, per layer): the input RMSNorm (S H a, + S H 4 + 4 S when its input needs a gradient:
  every layer after the first, or with anchor fusion), the q/k/v input (S H a), q-norm (S Qh D (4 + a) + 4 S Qh),
  k-norm (S Kh D (4 + a) + 4 S Kh), the o-projection input (S Qh D a), the post-attention RMSNorm (S H (4 + a) + 4 S)
  and MLP input (S H a), the MLP's gate, up, activation and product (4 S I a); the final norm once (S H (4 + a) + 4 S),
  the output adapter's input when there is one (S H a), and the block RoPE tables (2 S D a);
- block attention (per layer): "segmented" (CPU) saves, per call, the gathered keys and values (2 Kh M D a, M =
  context keys + rows), the mask (rows M a), the queries and outputs (2 Qh rows D a) and the log-sum-exps;
  "flex" (CUDA) the [context; block] keys and values (2 Kh (T + S) D a), queries, outputs and log-sum-exps;
  "dense" also the [S, T + S] mask;
- heads: the confidence head's input (N (H + R) a) and the Markov factors (N R a);
- loss: the chunked full-vocabulary terms (deepspec/losses/distribution.py) keep 12 bytes per logit of every row
  when not checkpointed, and need 20 (not checkpointed) or 28 (checkpointed: recomputed in backward) bytes per
  logit of one chunk of `loss.chunk_rows` rows while it runs (`deepspec plan --measure` checks them against the
  live tensors: docs/results.md, section 5).
The step's peak is the static part + the gradients it holds (all of them while micro-batches accumulate) + the batch
+ everything saved + the loss chunk in flight; the optimizer step's peak (gradients, fp32 gradient partition,
AdamW's temporaries) and, with online or hybrid features, the target's feature forward (over the micro-batch, or
one sample with `data.online_batch=sample`; under ZeRO-3 with one decoder layer's weights gathered) are compared,
and the largest is the plan's total.

Shape legend: T = context tokens, S = block slots, N = draft rows, H = hidden, I = MLP width, Qh / Kh = query /
key-value heads, D = head dim, V = draft vocabulary, R = rank, m = feature layers, P = drafter parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepspec.losses.distribution import checkpoint_decision
from deepspec.planning.shapes import MicroBatch, Numerics, Widths

FP32 = 4
INDEX = 8  # int64 index tensors of the batch
LOSS_SAVED_PER_LOGIT = 12  # kept for backward by a chunk that is not checkpointed (every row)
LOSS_CHUNK_PER_LOGIT = {False: 20, True: 28}  # in flight for one chunk (checkpointed: its recompute and backward)


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    what: str
    phase: str  # static | step | optimizer (the optimizer step only)


@dataclass(frozen=True)
class ParameterCounts:
    """Exact parameter counts (meta-device models): the target's parts and the drafter."""

    target_embedding_head: int  # embedding + untied LM head + final norm
    target_decoder_layers: int
    target_layers: int  # decoder layers (ZeRO-3 gathers one at a time)
    target_bytes: int  # bytes per target parameter
    drafter: int  # trainable drafter parameters
    drafter_tensors: int  # trainable parameter tensors (AdamW keeps a step counter for each)
    drafter_buffer_bytes: int
    drafter_linear_in_layers: int  # weights of the draft layers' matmuls (autocast copies them)


def zero_static(params: ParameterCounts, num: Numerics, bucket_elements: int) -> list[Component]:
    """Drafter parameters, optimizer states and held gradients of one rank (module docstring). `bucket_elements`:
    DeepSpeed's contiguous-gradient reduce bucket(s) (deepspeed.reduce_bucket_size, twice with overlap_comm, 0 without
    contiguous_gradients), allocated whole in every backward (on CPU as well)."""
    p, n, stage = params.drafter, num.world_size, num.zero_stage
    pb = num.param_bytes
    if stage == 0:
        return [Component("drafter_parameters", p * pb + params.drafter_buffer_bytes,
                          f"P={p:,} x {pb} B (+ buffers)", "static"),
                Component("optimizer_states", 2 * p * pb + FP32 * params.drafter_tensors,
                          f"AdamW moments: 2 x P x {pb} B (no ZeRO) + a step counter per tensor", "static"),
                Component("gradients", p * pb if num.grad_accum > 1 else 0,
                          "P x B, held across accumulated micro-batches" if num.grad_accum > 1
                          else "freed by each step (no accumulation)", "static")]
    shard = -(-p // n)
    param_bytes = shard * pb + p * pb if stage == 3 else p * pb
    param_what = (f"P/N x {pb} B partition + P x {pb} B gathered for the step" if stage == 3 else f"P={p:,} x {pb} B")
    bucket = bucket_elements * pb
    grad_bytes = (p * pb if stage == 1 else shard * pb) + bucket
    grad_what = (f"P x {pb} B (stage 1 keeps them whole)" if stage == 1 else f"P/N x {pb} B partition") + (
        f" + {bucket_elements:,}-element reduce bucket" if bucket else "")
    return [Component("drafter_parameters", param_bytes + params.drafter_buffer_bytes, param_what, "static"),
            Component("optimizer_states", 12 * shard, "P/N x (4 B fp32 master + 8 B AdamW moments)", "static"),
            Component("gradients", grad_bytes, grad_what, "static")]


def target_components(params: ParameterCounts, widths: Widths, num: Numerics, materialised: bool,
                      sharded: bool = False) -> list[Component]:
    tb, n = params.target_bytes, num.world_size
    layers, outer = params.target_decoder_layers, params.target_embedding_head
    not_there = "" if materialised else " (not materialised)"
    if sharded:  # ZeRO-3: 1/N of every weight, and whole copies of the embedding and LM head
        parts = [Component("target_decoder_layers", -(-layers // n) * tb if materialised else 0,
                           f"{layers:,} x {tb} B / N (ZeRO-3 partition){not_there}", "static"),
                 Component("frozen_embedding_head", outer * tb + -(-outer // n) * tb,
                           f"{outer:,} x {tb} B: whole embedding and LM head + their 1/N partition", "static")]
    else:
        parts = [Component("target_decoder_layers", layers * tb if materialised else 0,
                           f"{layers:,} x {tb} B{not_there}", "static"),
                 Component("frozen_embedding_head", outer * tb,
                           f"{outer:,} x {tb} B (embedding, LM head, final norm)", "static")]
    if widths.reduced_vocab:  # the draft head's rows, gathered once and kept (BlockDrafter.draft_head_weight)
        parts.append(Component("draft_head_rows", widths.vocab * widths.hidden * num.param_bytes
                               + widths.target_vocab * INDEX, "Vd x H rows of the head + V draft-row ids", "static"))
    return parts


def batch_bytes(mb: MicroBatch, w: Widths, num: Numerics) -> int:
    floats = (mb.context_tokens * w.feature_layers * w.hidden + mb.rows * w.hidden) * num.batch_bytes
    return floats + mb.rows * FP32 + INDEX * (2 * mb.context_tokens + 2 * mb.slots + 2 * mb.blocks + 4 * mb.rows)


def rmsnorm_saved(rows: int, width: int, a: int, input_needs_grad: bool = True) -> int:
    """What a family RMSNorm keeps: its fp32 input (when that needs a gradient), the normalised input in the
    output dtype (for the weight's gradient) and the fp32 reciprocal norms."""
    return rows * width * a + ((rows * width * FP32 + rows * FP32) if input_needs_grad else 0)


def context_saved(mb: MicroBatch, w: Widths, num: Numerics) -> int:
    t, h, a = mb.context_tokens, w.hidden, num.activation_bytes
    cast = t * w.feature_layers * h * a if num.batch_bytes != a else 0
    fused = rmsnorm_saved(t, h, a) + t * h * a + 2 * t * w.head_dim * a
    keys = w.draft_layers * (t * w.kv_heads * w.head_dim * (FP32 + a) + FP32 * t * w.kv_heads)
    return cast + fused + keys


def layers_saved(mb: MicroBatch, w: Widths, num: Numerics) -> int:
    s, h, a = mb.slots, w.hidden, num.activation_bytes
    qd, kd = w.heads * w.head_dim, w.kv_heads * w.head_dim
    per_layer = (s * h * a  # q/k/v input
                 + s * qd * (FP32 + a) + FP32 * s * w.heads + s * kd * (FP32 + a) + FP32 * s * w.kv_heads  # q/k norms
                 + s * qd * a  # o-projection input
                 + rmsnorm_saved(s, h, a) + s * h * a  # post-attention norm, MLP input
                 + 4 * s * w.intermediate * a)  # gate, up, activation, product
    first_input_needs_grad = w.anchor_fusion
    inputs = (rmsnorm_saved(s, h, a, first_input_needs_grad)
              + (w.draft_layers - 1) * rmsnorm_saved(s, h, a))
    shared = rmsnorm_saved(s, h, a) + 2 * s * w.head_dim * a  # final norm, RoPE tables of the block positions
    shared += s * h * a if w.output_adapter else 0  # the output adapter's input
    fusion = (s * 2 * h * a + rmsnorm_saved(s, h, a, False)) if w.anchor_fusion else 0
    return w.draft_layers * per_layer + inputs + shared + fusion


def attention_saved(mb: MicroBatch, w: Widths, num: Numerics) -> int:
    a, d = num.activation_bytes, w.head_dim
    s, t = mb.slots, mb.context_tokens
    queries_outputs = 2 * s * w.heads * d * a + 2 * FP32 * s * w.heads
    if num.attention == "segmented":
        calls = sum(2 * w.kv_heads * (keys + rows) * d * a + rows * (keys + rows) * a for rows, keys in mb.segments)
    else:
        calls = 2 * w.kv_heads * (t + s) * d * a + (s * (t + s) * a if num.attention == "dense" else 0)
    return w.draft_layers * (calls + queries_outputs)


def heads_saved(mb: MicroBatch, w: Widths, num: Numerics) -> int:
    n, a = mb.rows, num.activation_bytes
    confidence = n * (w.hidden + w.rank) * a if w.confidence_head else 0
    markov = n * w.rank * a if w.sequential_head != "none" else 0
    return confidence + markov


def loss_components(mb: MicroBatch, w: Widths, num: Numerics, loss_cfg) -> list[Component]:
    vocab = w.vocab + (1 if w.reduced_vocab else 0)  # the outside column of a reduced vocabulary
    decision = checkpoint_decision(loss_cfg.checkpoint, mb.rows, vocab, loss_cfg.checkpoint_budget_mb)
    chunk = min(loss_cfg.chunk_rows, mb.rows)
    cast = mb.rows * w.hidden * num.activation_bytes if num.batch_bytes != num.activation_bytes else 0
    saved = 0 if decision.checkpoint else LOSS_SAVED_PER_LOGIT * mb.rows * vocab
    in_flight = LOSS_CHUNK_PER_LOGIT[decision.checkpoint] * chunk * vocab
    how = "checkpointed" if decision.checkpoint else "not checkpointed"
    return [Component("loss_saved", saved + cast + 6 * FP32 * mb.rows,
                      f"{how}: {0 if decision.checkpoint else LOSS_SAVED_PER_LOGIT} B x N={mb.rows:,} x V={vocab:,}"
                      " + per-row terms", "step"),
            Component("loss_chunk", in_flight,
                      f"{LOSS_CHUNK_PER_LOGIT[decision.checkpoint]} B x {chunk} rows x V={vocab:,} ({how})", "step")]


def optimizer_step_extra(params: ParameterCounts, num: Numerics) -> Component:
    """What only the optimizer step adds: the fp32 gradient partition (ZeRO) and AdamW's temporaries."""
    p, n = params.drafter, num.world_size
    if num.zero_stage == 0:
        temporaries = 2 * p * num.param_bytes if num.device == "cuda" else 0  # foreach lists on CUDA only
        return Component("optimizer_step", temporaries, "AdamW temporaries", "optimizer")
    shard = -(-p // n)
    return Component("optimizer_step", 3 * FP32 * shard, "fp32 gradient partition + AdamW temporaries (P/N x 12 B)",
                     "optimizer")


def online_forward(tokens: int, w: Widths, params: ParameterCounts, sharded: bool = False) -> int:
    """The target's inference forward that computes features (data.features=online|hybrid) over `tokens` (the
    micro-batch's, or one sample's with data.online_batch=sample): one decoder layer's working set (the residual,
    the attention and MLP intermediates) while the captured layers accumulate (those are the batch's features,
    counted there); under ZeRO-3 also the weights of the decoder layer it runs, gathered whole."""
    gathered = -(-params.target_decoder_layers // params.target_layers) * params.target_bytes if sharded else 0
    return tokens * (4 * w.hidden + 3 * w.intermediate) * params.target_bytes + gathered


def plan_memory(params: ParameterCounts, widths: Widths, num: Numerics, mb: MicroBatch, loss_cfg, *,
                bucket_elements: int, target_layers_materialised: bool = True, features: str = "offline",
                online_batch: str = "micro_batch", target_sharding: str = "none") -> dict:
    """Every component (bytes), the phases' peaks and the total (module docstring). `features`,
    `online_batch`, `target_sharding`: the run's data.features, data.online_batch, data.target_sharding."""
    sharded = target_sharding == "zero3"
    static = (target_components(params, widths, num, target_layers_materialised, sharded)
              + zero_static(params, num, bucket_elements))
    if num.weight_average:  # deepspec.training.averaging
        static.append(Component("weight_average", FP32 * params.drafter,
                                f"P x {FP32} B fp32 average (trainer.ema_decay)", "static"))
    step = [Component("batch", batch_bytes(mb, widths, num), "features, final hidden states, ids of the micro-batch",
                      "step"),
            Component("context_activations", context_saved(mb, widths, num),
                      "fusion, H_ctx and the context keys of every draft layer", "step"),
            Component("draft_layer_activations", layers_saved(mb, widths, num),
                      f"{widths.draft_layers} layers over S={mb.slots:,} slots (norms, projections, MLP)", "step"),
            Component("block_attention", attention_saved(mb, widths, num),
                      f"{num.attention}: keys/values, masks, queries and outputs kept by every attention call",
                      "step"),
            Component("heads_activations", heads_saved(mb, widths, num), "confidence and Markov head inputs", "step"),
            *loss_components(mb, widths, num, loss_cfg)]
    if num.autocast and num.param_bytes != 2:
        step.append(Component("autocast_weight_copies", params.drafter_linear_in_layers * 2,
                              "bf16 copies of the draft layers' weights", "step"))
    optimizer = optimizer_step_extra(params, num)
    components = [*static, *step, optimizer]
    if features != "offline":
        tokens = mb.tokens_per_sequence if online_batch == "sample" else mb.context_tokens
        components.append(Component("online_feature_forward", online_forward(tokens, widths, params, sharded),
                                    f"the target's forward over {tokens:,} tokens (one layer's working set"
                                    + (", its weights gathered)" if sharded else ")"), "features"))
    by_name = {c.name: c.bytes for c in components}
    static_bytes = sum(c.bytes for c in static)
    peaks = {"step": static_bytes + sum(c.bytes for c in step)}
    full_grads = params.drafter * num.param_bytes if num.zero_stage in (0, 1) else by_name["gradients"]
    peaks["optimizer"] = static_bytes - by_name["gradients"] + full_grads + optimizer.bytes
    if features != "offline":
        peaks["features"] = static_bytes + by_name["batch"] + by_name["online_feature_forward"]
    phase = max(peaks, key=peaks.get)
    return {"components": components, "static_bytes": static_bytes, "step_peak_bytes": peaks["step"],
            "optimizer_peak_bytes": peaks["optimizer"], "phase_peaks": peaks, "total_bytes": peaks[phase],
            "peak_phase": phase}
