"""Eagle3: fused target features + one family decoder layer over [embedding; hidden], trained with TTT. `spec.SPEC`."""
