"""The arithmetic of one block-drafter training micro-batch: matmul and attention FLOPs (2 per multiply-add).

Forward: the fusion (2 T mH H), each draft layer's context keys/values (4 T H Kh D), its q/k/v/o projections over
the slots (2 S H (2 Qh D + 2 Kh D)), its MLP (6 S H I), its attention (4 Qh D x the query-key pairs the kernel
computes: every pair of each segment for "segmented", the [S, T + S] square for "dense", the pairs a block may see
for "flex", which skips empty tiles), the heads (2 N (H + R) for the confidence head), anchor fusion (4 S H H), the
output adapter (2 S H H), and the loss: draft logits 2 N H V, the Markov bias 2 N R V, the frozen target's logits
2 N H V; with online features the target's own forward over the tokens (2 T x its decoder and head parameters).
Backward: twice the forward of every trainable matmul (the input's and the weight's gradients; once for the
fusion, whose input, the cached features, needs none), 2.5 times that of
attention (flash attention recomputes the scores: 5 products against 2); the loss's draft logits only the hidden
states' gradient (the head is frozen), the Markov bias both factors'; a checkpointed loss computes its forward a
second time. This is what torch's FLOP counter counts for the same ops (`--measure` reports both).

Shape legend: T = context tokens, S = slots, N = rows, H = hidden, I = MLP width, Qh / Kh heads, D = head dim,
V = draft vocabulary, R = rank, m = feature layers.
"""

from __future__ import annotations

from deepspec.losses.distribution import checkpoint_decision
from deepspec.planning.shapes import MicroBatch, Numerics, Widths


def attention_pairs(mb: MicroBatch, attention: str) -> int:
    """Query-key pairs one draft layer's attention computes for the micro-batch."""
    s, t, g = mb.slots, mb.context_tokens, mb.block_size
    if attention == "segmented":
        return sum(rows * (keys + rows) for rows, keys in mb.segments)
    if attention == "dense":
        return s * (t + s)
    return mb.sequences * sum(g * (anchor + g) for anchor in mb.anchor_positions())


def plan_flops(mb: MicroBatch, w: Widths, num: Numerics, loss_cfg, target_forward_params: int = 0) -> dict:
    """Forward, backward and recompute FLOPs of one micro-batch, by part. `target_forward_params`: the target
    parameters a token's online feature forward multiplies by (its decoder layers and the head that gives the
    log-normaliser; 0 with offline features)."""
    t, s, n, h = mb.context_tokens, mb.slots, mb.rows, w.hidden
    qd, kd = w.heads * w.head_dim, w.kv_heads * w.head_dim
    layer_matmuls = 2 * s * h * (2 * qd + 2 * kd) + 6 * s * h * w.intermediate
    forward = {
        "fusion": 2 * t * w.feature_layers * h * h,
        "context_keys_values": w.draft_layers * 4 * t * h * kd,
        "draft_layers": (w.draft_layers * layer_matmuls + (4 * s * h * h if w.anchor_fusion else 0)
                         + (2 * s * h * h if w.output_adapter else 0)),
        "attention": w.draft_layers * 4 * qd * attention_pairs(mb, num.attention),
        "heads": 2 * n * (h + w.rank) if w.confidence_head else 0,
        "loss_draft_logits": 2 * n * h * w.vocab,
        "loss_markov_bias": 2 * n * w.rank * w.vocab if w.sequential_head != "none" else 0,
        "loss_target_logits": 2 * n * h * w.vocab,
        "online_target_forward": 2 * t * target_forward_params,
    }
    trainable = sum(forward[k] for k in ("context_keys_values", "draft_layers", "heads"))
    backward = (2 * trainable + forward["fusion"] + 5 * forward["attention"] // 2 + forward["loss_draft_logits"]
                + 2 * forward["loss_markov_bias"])
    vocab = w.vocab + (1 if w.reduced_vocab else 0)
    checkpointed = checkpoint_decision(loss_cfg.checkpoint, n, vocab, loss_cfg.checkpoint_budget_mb).checkpoint
    loss_forward = forward["loss_draft_logits"] + forward["loss_markov_bias"] + forward["loss_target_logits"]
    recompute = loss_forward if checkpointed else 0
    total = sum(forward.values()) + backward + recompute
    return {"forward": forward, "forward_total": sum(forward.values()), "backward": backward,
            "loss_recompute": recompute, "total": total}
