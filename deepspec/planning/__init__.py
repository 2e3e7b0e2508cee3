"""`deepspec plan`: what a training configuration costs per rank before it runs, and (`--measure`) what it costs here.

For the configuration `deepspec train` would run (the same Hydra overrides, a world size and a device) the plan
gives the memory of one rank by component (target weights, the frozen embedding / LM head, drafter parameters,
gradients and optimizer states under the ZeRO stage and world size, the draft layers' activations, the context
keys/values, block attention, the chunked loss, the batch), the tokens and supervised positions of a step, the
steps of an epoch and the cache's bytes for a data size, the FLOPs of a step, and the largest micro-batch that fits
a device. It reads configurations only: the target's published widths (`target.shape`) or its config.json, never
weights (`plan.py`, `memory.py`, `flops.py`). `measure.py` runs a few steps of the same configuration on this
machine with a random-weight stand-in of the target and a synthetic cache of the planned shapes, and
`tracking.py` measures them.
"""
