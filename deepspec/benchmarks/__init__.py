"""Benchmarks and studies: `deepspec bench NAME` (NAME -> module: `BENCHMARKS` below).

Each benchmark prints one JSON object and writes it to a file (`deepspec.utils.io.emit_report`); speed is
compared side by side in one run (our path against its baseline) and reported as ratios and CPU-seconds. The
stage packages hold library code only; everything that measures them lives here, with the study harnesses the
benchmarks share (the drafter-free floors, the input ablations, the equal-budget learning runs).
"""

# `deepspec bench NAME` -> the module whose `main(argv)` runs it
BENCHMARKS = {
    "cache": "deepspec.benchmarks.cache",
    "cache-engine": "deepspec.benchmarks.cache_engine",
    "calibration": "deepspec.benchmarks.calibration",
    "drafters": "deepspec.benchmarks.drafters",
    "interop": "deepspec.benchmarks.interop_acceptance",
    "kernels": "deepspec.benchmarks.kernels",
    "learning": "deepspec.benchmarks.learning",
    "loss-memory": "deepspec.benchmarks.loss_memory",
    "regenerate": "deepspec.benchmarks.regenerate",
    "scaling": "deepspec.benchmarks.scaling",
    "scheduler": "deepspec.benchmarks.scheduler",
    "serve": "deepspec.benchmarks.serve",
    "speed": "deepspec.benchmarks.speed",
    "standalone": "deepspec.benchmarks.standalone",
    "train": "deepspec.benchmarks.train",
}
