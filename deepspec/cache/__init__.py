"""Sharded, indexed, memory-mapped cache of target features (on-disk contract in FORMAT.md)."""

from deepspec.cache.format import (
                                   FORMAT_VERSION,
                                   CacheMeta,
                                   bytes_per_token,
                                   check_cache_compatible,
                                   dequantize_fp8,
                                   quantize_fp8,
                                   read_meta,
)
from deepspec.cache.reader import CachedSample, CacheReader, verify_cache
from deepspec.cache.writer import (
                                   CacheStats,
                                   build_cache,
                                   estimate_cache_size,
                                   format_estimate,
                                   merge_cache,
                                   render_samples,
)

__all__ = [
    "FORMAT_VERSION", "CacheMeta", "CacheReader", "CacheStats", "CachedSample", "build_cache", "bytes_per_token",
    "check_cache_compatible", "dequantize_fp8", "estimate_cache_size", "format_estimate", "merge_cache",
    "quantize_fp8", "read_meta", "render_samples", "verify_cache",
]
