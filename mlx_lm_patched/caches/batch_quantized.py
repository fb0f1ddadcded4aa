"""Batched quantized caches: ``BatchQuantizedKVCache``, ``BatchQuantizedRotatingKVCache``
(the new module ``mlx_lm/models/batch_quantized_cache.py``).

Upstream cannot batch a quantized cache: ``QuantizedKVCache`` has no
``merge`` (``batch_generate`` with quantized prompt caches raises "does not
yet support batching with history"), and ``BatchKVCache.merge`` of quantized
caches returns an empty cache (ml-explore/mlx-lm#118, #126; PRs #941, #1322,
#1343, #1526 closed unmerged).

Here ``BatchQuantizedKVCache`` is a ``BatchKVCache`` holding ``mx.quantize``
tuples (merge, extract, filter, extend, finalize, save/load; its ``prepare``,
``trim`` and ``make_mask`` are ``BatchKVCache``'s), and
``BatchQuantizedRotatingKVCache`` a ``BatchRotatingKVCache`` of packed
quantized tokens. ``QuantizedKVCache.merge``, ``BatchKVCache.merge`` and
``RotatingKVCache.merge`` of any mix of quantized and unquantized caches,
in any order, lead to them; ``to_quantized`` converts a running batch.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

from .._newmods import hooks, new_module
from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.batch_quantized_cache import (
        BatchQuantizedKVCache,
        BatchQuantizedRotatingKVCache,
    )
    from mlx_lm.models.cache import BatchRotatingKVCache
    from mlx_lm.models.quantized_rotating_cache import _quantize_update


class _RotatingKVCache:
    @classmethod
    def merge(_, caches):
        if any(hasattr(c, "bits") for c in caches):
            return BatchQuantizedRotatingKVCache.merge(caches)
        return BatchRotatingKVCache.merge(caches)


class _BatchRotatingKVCache:
    def to_quantized(self, group_size: int = 64, bits: int = 4):
        B = self.offset.shape[0]
        cache = BatchQuantizedRotatingKVCache(
            self.max_size, [0] * B, self.keep, group_size, bits
        )
        cache.checkpoint_every = self.checkpoint_every
        cache.max_checkpoints = self.max_checkpoints
        cache.real_rows = self.real_rows  # a checkpoint's
        # New arrays: ``-=`` on a shared one would move both caches.
        cache.left_padding = mx.array(self.left_padding)
        cache.offset = mx.array(self.offset)
        cache._offset, cache._idx, cache.rotated = self._offset, self._idx, self.rotated
        cache._fewest = self._fewest
        if self._lengths is not None:
            cache._lengths = mx.array(self._lengths)
            cache._padded = self._padded
        # The ring and its undo ring (``slack``), each packed.
        cache.slack, cache._lo, cache._hi = self.slack, self._lo, self._hi
        for k, v in (("keys", "values"), ("_undo_keys", "_undo_values")):
            if getattr(self, k) is not None:
                parts = _quantize_update(cache, getattr(self, k), getattr(self, v))
                setattr(cache, k, cache._pack(parts[0]))
                setattr(cache, v, cache._pack(parts[1]))
        self._convert_checkpoints(cache, lambda c: c.to_quantized(group_size, bits))
        return cache


class _QuantizedKVCache:
    @classmethod
    def merge(_, caches):
        return BatchQuantizedKVCache.merge(caches)


class _BatchKVCache:
    def to_quantized(self, group_size: int = 64, bits: int = 4):
        B = self.left_padding.shape[0]
        cache = BatchQuantizedKVCache([0] * B, group_size=group_size, bits=bits)
        cache.left_padding = mx.array(self.left_padding)  # on the device: no sync
        cache.offset, cache._idx = mx.array(self.offset), self._idx
        if self._right_padding is not None:
            cache._right_padding = mx.array(self._right_padding)
        if self.keys is not None:
            # The whole buffer: the quantized one has the same capacity.
            cache.keys, cache.values = _quantize_update(cache, self.keys, self.values)
        return cache


# BatchKVCache.merge: quantized caches merge as BatchQuantizedKVCache.
_BATCH_KV_CACHE_MERGE = """\
@@ -2,2 +2,4 @@
 def merge(cls, caches):
+    if any(hasattr(c, "bits") for c in caches):
+        return BatchQuantizedKVCache.merge(caches)
     lengths = [c.size() for c in caches]
"""


PATCH = Patch(
    "batch_quantized",
    "BatchQuantizedKVCache, BatchQuantizedRotatingKVCache: quantized caches "
    "merge, batch, extract, save and load",
    new_module("mlx_lm.models.batch_quantized_cache")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.batch_quantized_cache",
        "BatchQuantizedKVCache",
        "BatchQuantizedRotatingKVCache",
    )
    + targets("mlx_lm.models.cache:QuantizedKVCache", _QuantizedKVCache)
    + targets("mlx_lm.models.cache:BatchKVCache", _BatchKVCache)
    + edits("mlx_lm.models.cache:BatchKVCache", merge=_BATCH_KV_CACHE_MERGE)
    + targets("mlx_lm.models.cache:RotatingKVCache", _RotatingKVCache)
    + targets("mlx_lm.models.cache:BatchRotatingKVCache", _BatchRotatingKVCache),
    requires=(
        "mlx_lm.models.cache:BatchRotatingKVCache.state",
        "mlx_lm.models.cache:BatchRotatingKVCache.extend",
        "mlx_lm.models.cache:BatchRotatingKVCache.extract",
        "mlx_lm.models.cache:BatchRotatingKVCache.merge",
        "mlx_lm.models.cache:QuantizedKVCache.state",
    ),
)
