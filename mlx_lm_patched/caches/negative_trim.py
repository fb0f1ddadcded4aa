"""Every cache rejects a negative or non-integer trim.

Upstream's ``trim(n)`` takes ``min(offset, n)`` tokens off, so ``trim(-1)``
grows the offset by one (``KVCache`` 10 -> 11), past the tokens the cache
holds; ``can_trim_prompt_cache``/``trim_prompt_cache`` pass a negative count
straight through (ml-explore/mlx-lm#1868). ``trim(2.5)`` leaves a float
offset (the next model call fails: ``[rope] offset must be an integer``);
``trim(nan)`` and ``trim(inf)`` take everything off. Here ``KVCache``,
``ConcatenateKVCache``, ``ChunkedKVCache`` and ``BatchKVCache`` raise
``ValueError("<Class>.trim: n must be >= 0, got -1")`` or ``... n must be an
integer, got 2.5`` and change nothing, as the rings and the quantized caches
do in their own patches.
"""

from .._registry import Patch, targets


# Written as they read in mlx_lm/models/cache.py, and run there.
class KVCache:
    def trim(self, n):
        if not isinstance(n, int):
            raise ValueError(
                f"{type(self).__name__}.trim: n must be an integer, got {n!r}"
            )
        if n < 0:
            raise ValueError(f"{type(self).__name__}.trim: n must be >= 0, got {n}")
        n = min(self.offset, n)
        self.offset -= n
        return n


class ChunkedKVCache:
    def trim(self, n):
        if not isinstance(n, int):
            raise ValueError(f"ChunkedKVCache.trim: n must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"ChunkedKVCache.trim: n must be >= 0, got {n}")
        n = min(self.offset - self.start_position, n)
        self.offset -= n
        return n


class BatchKVCache:
    def trim(self, n):
        if not isinstance(n, int):
            raise ValueError(
                f"{type(self).__name__}.trim: n must be an integer, got {n!r}"
            )
        if n < 0:
            raise ValueError(f"{type(self).__name__}.trim: n must be >= 0, got {n}")
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n


PATCH = Patch(
    "negative_trim",
    "KVCache, ConcatenateKVCache, ChunkedKVCache, BatchKVCache: trim(n) raises "
    "unless n is an integer >= 0",
    targets("mlx_lm.models.cache:KVCache", KVCache)
    + targets("mlx_lm.models.cache:ConcatenateKVCache", KVCache)
    + targets("mlx_lm.models.cache:ChunkedKVCache", ChunkedKVCache)
    + targets("mlx_lm.models.cache:BatchKVCache", BatchKVCache),
)
