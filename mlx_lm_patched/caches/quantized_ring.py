"""A quantized sliding window: ``RotatingKVCache.to_quantized`` (the new
module ``mlx_lm/models/quantized_rotating_cache.py``).

Upstream raises ``NotImplementedError: RotatingKVCache Quantization NYI``, so
``generate --kv-bits`` fails on every model with a sliding layer (gemma3,
llama with ``sliding_window``) and with ``--max-kv-size``
(ml-explore/mlx-lm#1573, #1583; PRs #968, #1074, #1584 closed unmerged).
Here ``to_quantized`` returns a ``QuantizedRotatingKVCache``: the same
preallocated ring as the patched ``RotatingKVCache`` (a subclass: same slots,
same masks, same trims), holding ``mx.quantize`` tuples that attention reads
through ``bits``, written in place.
``to_kv_cache()`` dequantizes it back into a ``RotatingKVCache``, and it
saves and loads through ``save_prompt_cache``/``load_prompt_cache``.

It steps back as the bf16 ring does (``slack``, see ``rotating_prealloc``):
each quantized part is a ring of its own with its own undo ring, so a
server with ``--kv-bits`` on a sliding-window model trims a stored entry
back to a common prefix after a wrap, and ``to_quantized``,
``to_kv_cache`` and the state keep the slack and what the undo ring holds
(five more state items, as the bf16 ring's).
"""

from typing import TYPE_CHECKING

from .._newmods import hooks, new_module
from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.quantized_rotating_cache import (
        QuantizedRotatingKVCache,
        _quantize_update,
    )


class _RotatingKVCache:
    def to_quantized(
        self, group_size: int = 64, bits: int = 4
    ) -> "QuantizedRotatingKVCache":
        cache = QuantizedRotatingKVCache(
            self.max_size,
            self.keep,
            group_size,
            bits,
            self.slack,
            self.checkpoint_every,
            self.max_checkpoints,
        )
        if self.keys is not None and self.offset > 0:
            # Upstream's layout past the ring becomes the ring's; a shorter
            # state (a stored entry's live tokens) stays as short.
            if self.keys.shape[2] > self.max_size:
                self._allocate(self.keys, self.values)
            cache.keys, cache.values = _quantize_update(cache, self.keys, self.values)
            cache.offset, cache._idx = self.offset, self._idx
            if self._undo_keys is not None:
                undo = _quantize_update(cache, self._undo_keys, self._undo_values)
                cache._undo_keys, cache._undo_values = undo
                cache._lo, cache._hi = self._lo, self._hi
        cache.checkpoints = [c.to_quantized(group_size, bits) for c in self.checkpoints]
        return cache


PATCH = Patch(
    "quantized_ring",
    "RotatingKVCache.to_quantized: a preallocated quantized sliding window",
    new_module("mlx_lm.models.quantized_rotating_cache")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.quantized_rotating_cache",
        "QuantizedRotatingKVCache",
        "_quantize_update",
    )
    + targets("mlx_lm.models.cache:RotatingKVCache", _RotatingKVCache),
    requires=(
        "mlx_lm.models.cache:RotatingKVCache.state",
        "mlx_lm.models.cache:QuantizedKVCache.state",
    ),
)
