"""Compile DeepSpeed's CPU shared-memory collective op now (cached): `scripts/bootstrap.sh` calls this once, so that
the first `deepspeed.initialize` of a training run loads it instead of compiling it. Skips quietly on a machine
whose accelerator is not the CPU (GPU builds bring their own ops) or where the op is not compatible."""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
except ImportError as err:  # deepspeed not installed: nothing to build
    print(f"prebuild_deepspeed_ops: skipped ({err})")
    sys.exit(0)

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    print("prebuild_deepspeed_ops: no compatible CPU shared-memory op here, nothing to build")
    sys.exit(0)
try:
    builder.load(verbose=False)
except Exception as err:  # a set-up step: say why and let training compile (or fail) as before
    print(f"prebuild_deepspeed_ops: could not build {builder.NAME} ({type(err).__name__}: {err}); the first "
          "training run will try again", file=sys.stderr)
    sys.exit(0)
print(f"prebuild_deepspeed_ops: {builder.NAME} ready")
