"""MTP: DeepSeek-V3-style chained multi-token-prediction modules trained post hoc on a frozen target. `spec.SPEC`."""
