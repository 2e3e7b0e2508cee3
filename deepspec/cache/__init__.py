"""Sharded, indexed, memory-mapped cache of target features (on-disk contract in FORMAT.md), and the feature
sources training reads (source.py: a finished cache, or the target computing the features online / hybrid)."""

from deepspec.cache.build import BuildJob, CacheStats, build_cache
from deepspec.cache.format import (
                                   FORMAT_VERSION,
                                   CacheMeta,
                                   bytes_per_token,
                                   check_cache_compatible,
                                   dequantize_fp8,
                                   quantize_fp8,
                                   read_meta,
)
from deepspec.cache.merge import merge_cache
from deepspec.cache.plan import estimate_cache_size, format_estimate, render_samples
from deepspec.cache.reader import CachedSample, CacheReader, verify_cache
from deepspec.cache.source import FeatureSource, FeatureSourceConfig

__all__ = [
    "FORMAT_VERSION", "BuildJob", "CacheMeta", "CacheReader", "CacheStats", "CachedSample", "FeatureSource",
    "FeatureSourceConfig", "build_cache", "bytes_per_token", "check_cache_compatible", "dequantize_fp8",
    "estimate_cache_size", "format_estimate", "merge_cache", "quantize_fp8", "read_meta", "render_samples",
    "verify_cache",
]
