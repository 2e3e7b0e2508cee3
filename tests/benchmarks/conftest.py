"""Benchmark fixtures: the training helpers (`tt`, tests/training/conftest.py) for the benchmarks that train."""

from ..training.conftest import tt  # noqa: F401
