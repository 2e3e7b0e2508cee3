"""DSpark (paper §3): the block backbone + a sequential head (Markov / RNN) + a confidence head. `spec.SPEC`."""
