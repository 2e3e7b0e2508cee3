"""Shared by the chain drafters (Eagle3, MTP): packed sequence batches, the family-layer runner, per-step
objective terms and the batch-1 proposer that commits target rows with their next tokens."""
