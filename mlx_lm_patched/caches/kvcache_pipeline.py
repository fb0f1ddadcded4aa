"""``KVCache`` and ``BatchKVCache``: a long chunk is pipelined a layer at a time.

Upstream's unbounded caches write a prefill chunk lazily, so MLX evaluates
the chunk's whole graph at once, every layer's transients in flight
together: on an H100 (Llama-8B shape, 2048-token chunks) 5.6-11 GiB above
the cache itself, and a ``BatchGenerator`` chunk of 4 x 2,048 tokens
10.3 GiB. Here their ``update_and_fetch`` ends with the rings' ``_pipeline``
(``rotating_prealloc``): an update of ``PIPELINE_MIN`` (1,024) tokens or more
is scheduled and waits for the previous layer's, so about two layers are in
flight. Decode steps and shorter chunks are untouched; under ``mx.compile``
it does nothing.
"""

from typing import TYPE_CHECKING

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import mlx.core as mx
    from mlx_lm.models.ring_buffer import _pipeline


# Written as they would read in mlx_lm/models/cache.py, and run there.
def _grow(cache, keys, values, prev):
    """Give ``cache.keys``/``values`` room for ``keys``/``values`` from
    column ``prev``, in ``cache.step``-column steps (upstream's growth)."""
    if cache.keys is not None and prev + keys.shape[2] <= cache.keys.shape[2]:
        return
    n = (cache.step + keys.shape[2] - 1) // cache.step * cache.step
    new = [mx.zeros((*x.shape[:2], n, x.shape[3]), x.dtype) for x in (keys, values)]
    if cache.keys is None:
        cache.keys, cache.values = new
        return
    held = [
        x[..., :prev, :] if prev % cache.step else x for x in (cache.keys, cache.values)
    ]
    cache.keys, cache.values = (
        mx.concatenate([h, z], axis=2) for h, z in zip(held, new)
    )


class KVCache:
    def update_and_fetch(self, keys, values):
        prev = self.offset
        _grow(self, keys, values, prev)
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        _pipeline((self.keys, self.values), keys.shape[2])
        return self.keys_and_values()


class BatchKVCache:
    def update_and_fetch(self, keys, values):
        prev = self._idx
        _grow(self, keys, values, prev)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        _pipeline((self.keys, self.values), keys.shape[2])
        return self.keys_and_values()


PATCH = Patch(
    "kvcache_pipeline",
    "KVCache, BatchKVCache: a chunk of 1024 tokens or more is pipelined a "
    "layer at a time",
    targets("mlx_lm.models.cache", _grow)
    + targets("mlx_lm.models.cache:KVCache", KVCache)
    + targets("mlx_lm.models.cache:BatchKVCache", BatchKVCache),
)
