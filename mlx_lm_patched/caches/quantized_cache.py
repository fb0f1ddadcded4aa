"""``QuantizedKVCache`` done right (its layout and decode tail: the new module
``mlx_lm/models/quantized_layout.py``).

Upstream's quantized cache reports ``size() == 0``, raises on ``nbytes`` when
empty, lets ``trim(-1)`` grow ``offset`` (as do ``KVCache``,
``ChunkedKVCache`` and ``ConcatenateKVCache``), saves its padding, grows by
concatenating 256-token steps, cannot give its tokens back in full precision,
and fails on head dims such as 96 or 80 that group size 64 does not divide;
``KVCache.to_quantized`` quantizes the padding too; ``generate`` accepts
``--kv-bits 16`` until the cache reaches ``--quantized-kv-start`` tokens.
Here the cache:

- reports live tokens (``size``), rejects negative trims (so do the
  unquantized caches), and ``compact()`` frees what trimming left behind;
  ``nbytes`` is what the buffers hold;
- allocates once when told the final length (``reserve``), else grows by half
  its capacity, writing the old tokens into the new buffers (no concatenate);
  a chunk of 1,024 tokens or more is pipelined a layer at a time, as
  ``KVCache``'s (``kvcache_pipeline``);
- saves upstream's five-item ``state``, which plain mlx-lm reads, and reads
  the quantized dtype and head dims back off the arrays, so
  ``save_prompt_cache``/``load_prompt_cache`` round trips are bit-exact and
  ``to_kv_cache()`` dequantizes to the original dtype; only zero-padded head
  dims, which upstream cannot attend over, add them as two more items;
- picks a group size that divides the head dim (96 with 64 quantizes with
  32), or zero-pads it (80; attention pads the queries to match, see
  ``quantized_attention``; the layout: ``quantized_layout``); a file saved
  with the group size in use passes ``generate``'s ``--kv-group-size`` check
  for the size that was asked for (``quantizes_with``).

On MLX's CUDA backend a decode step (up to 8 tokens) is not quantized at
once: its tokens wait in a small buffer of the cache dtype, the tail, and
are quantized ``decode_tail`` (64) at a time, into the same bits as one by
one. ``update_and_fetch`` hands attention the whole buffers, the tail and
an array whose shape carries the two lengths (``_decode_lengths``) instead
of six slices, and the step's tokens are not written into the tail
(``_TailFetch``): ``quantized_decode_attention`` reads the tail as it was
and the step's tokens where they are, writes the new tail as it goes and
hands it to the cache (any other reader writes it, ``_written_tail``), so
no write of the cache's is made in a decode step but every 64th (two
quantizes and six writes, against ``KVCache``'s two writes every step). A
decode step's cache work and its host time were what kept ``--kv-bits``
below the bfloat16 cache's speed there.
Everything else (``keys``, ``state``, ``trim``, ``nbytes``, ...) sees the
tail quantized first.
"""

import os
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .._newmods import defined, hooks, new_module
from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.quantized_layout import (
        _kv_quant_layout,
        _kv_quantize,
        _start_tail,
        _tail_update,
    )
    from mlx_lm.models.ring_buffer import _pipeline

# The state check, a function of the new module that the class binds.
_check_quantized_state = defined(
    "mlx_lm.models.quantized_layout", "_check_quantized_state"
)


class _QuantizedKVCache:
    # Tokens a decode step may leave unquantized (CUDA, where the decode
    # kernel reads them; 0: each update quantized at once).
    decode_tail = (
        64
        if mx.cuda.is_available()
        and os.environ.get("MLX_LM_PATCHED_DECODE_KERNEL", "1") != "0"
        else 0
    )
    _tail_len = 0

    def __init__(self, group_size: int = 64, bits: int = 8):
        # keys, values: (packed, scales, biases), each (B, H, capacity, ...);
        # tokens [0, offset) are live, [offset, capacity) are padding. The
        # last _tail_len of them may wait in _tail (keys and values of
        # decode_tail tokens in the cache dtype) until keys is read; _step:
        # a decode step's fetches (_tail_update) while its tokens are not in
        # _tail (the decode kernel writes them).
        self.keys = None
        self.values = None
        self._tail = self._step = None
        self.offset = 0
        # As asked until the first update, then the one in use (see
        # _kv_quant_layout); head dims wider than head_dims are zero padding.
        self.group_size = group_size
        self.bits = bits
        self.dtype = None  # name of the quantized keys' dtype, e.g. "bfloat16"
        self.head_dims = None  # (k_head_dim, v_head_dim) before padding
        self.reserved = 0  # tokens expected in all; the next allocation holds them

    @property
    def keys(self):
        if self._tail_len:
            self._flush()
        return self._keys

    @keys.setter
    def keys(self, v):
        self._keys, self._tail_len = v, 0

    @property
    def values(self):
        if self._tail_len:
            self._flush()
        return self._values

    @values.setter
    def values(self, v):
        self._values, self._tail_len = v, 0

    def update_and_fetch(self, keys, values):
        B, n_kv_heads, num_steps, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        if num_steps <= 8 and (self._tail is not None or _start_tail(self)):
            tk, tv = self._tail
            if (
                (B, n_kv_heads, k_head_dim, v_head_dim)
                == (*tk.shape[:2], tk.shape[3], tv.shape[3])
                and values.shape[:3] == (B, n_kv_heads, num_steps)
                and keys.dtype == values.dtype == tk.dtype
            ):
                return _tail_update(self, keys, values)
        dtype = str(keys.dtype).rpartition(".")[2]
        if (
            keys.shape[:3] != values.shape[:3]
            or keys.dtype != values.dtype
            or self.keys is not None
            and (
                (B, n_kv_heads) != self.keys[0].shape[:2]
                or (k_head_dim, v_head_dim) != tuple(self.head_dims)
                or self.dtype not in (None, dtype)
            )
        ):
            held = None
            if self.keys is not None:
                held = (*self.keys[0].shape[:2], *self.head_dims, self.dtype)
            raise ValueError(
                f"QuantizedKVCache holds (batch, heads, k_dim, v_dim, dtype) {held}; "
                f"got keys {keys.shape} {dtype} and values {values.shape} "
                f"{values.dtype}"
            )
        group_size, keys, values = _kv_quantize(
            keys, values, self.group_size, self.bits
        )
        prev = self.offset
        end = prev + num_steps

        if self.keys is None:
            self.group_size = group_size
            self.dtype = str(keys[1].dtype).rpartition(".")[2]
            self.head_dims = (k_head_dim, v_head_dim)
        capacity = 0 if self.keys is None else self.keys[0].shape[-2]
        if end > capacity or self.keys is None:
            capacity = self._grown(capacity, end)
            if self.keys is not None:
                self._resize(capacity)
            elif capacity == num_steps:  # the update is the buffer
                self.keys, self.values = keys, values
            else:
                self.keys, self.values = tree_map(
                    lambda x: mx.zeros((B, n_kv_heads, capacity, x.shape[-1]), x.dtype),
                    (keys, values),
                )

        self.offset = end
        if self.keys is not keys:
            # [:, :, a:b], not [..., a:b, :]: MLX parses an Ellipsis in 2-3 us.
            for i in range(len(self.keys)):
                self.keys[i][:, :, prev:end] = keys[i]
                self.values[i][:, :, prev:end] = values[i]
        _pipeline((*self.keys, *self.values), num_steps)
        return self.keys_and_values()

    def _grown(self, capacity, end):
        """The capacity to grow to from ``capacity`` for ``end`` tokens."""
        if end <= self.reserved:
            return self.reserved
        capacity = max(end, capacity + capacity // 2)
        return (capacity + self.step - 1) // self.step * self.step

    def _written_tail(self):
        """The tail with the last decode step's tokens in it (written here if
        no kernel wrote it)."""
        if self._step is not None:
            self._tail = tuple(f.written() for f in self._step)
            self._step = None
        return self._tail

    def _keeps(self, fetched):
        """Whether ``fetched`` (``_tail_update``) is the step whose tokens
        the tail waits for: a kernel writing them hands the cache its tail."""
        return self._step is not None and self._step[0] is fetched

    def _wrote_tail(self, fetched, tk, tv):
        """Take the decode kernel's tail, written with the step's tokens, for
        ``fetched`` (``_tail_update``) if the tail still waits for them."""
        if self._keeps(fetched):
            self._tail, self._step = (tk, tv), None

    def _flush(self):
        """Quantize the tail's tokens into ``keys`` and ``values``."""
        t, self._tail_len = self._tail_len, 0
        end = self.offset
        tk, tv = self._written_tail()
        _, keys, values = _kv_quantize(
            tk[:, :, :t], tv[:, :, :t], self.group_size, self.bits
        )
        if end > self._keys[0].shape[2]:
            self._resize(self._grown(self._keys[0].shape[2], end))
        for i in range(3):
            self._keys[i][:, :, end - t : end] = keys[i]
            self._values[i][:, :, end - t : end] = values[i]

    def keys_and_values(self):
        # Six plain slices: upstream's tree_map and Ellipsis took a third of a
        # CUDA decode step's Python (Llama-8B shape, 32 layers).
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        end = self.offset
        return tuple(x[:, :, :end] for x in self.keys), tuple(
            x[:, :, :end] for x in self.values
        )

    def size(self):
        return self.offset

    @property
    def state(self):
        keys, values = self.keys, self.values
        if keys is not None and self.offset < keys[0].shape[-2]:
            keys, values = self.keys_and_values()
        state = (keys, values, self.offset, self.group_size, self.bits)
        # Upstream's 5 items, which it reads (the setter reads dtype and head
        # dims off the arrays), unless the head dims are zero-padded.
        if keys is not None and self.head_dims is not None:
            widths = tuple(x[0].shape[-1] * 32 // self.bits for x in (keys, values))
            if tuple(self.head_dims) != widths:
                return state + (self.dtype, self.head_dims)
        return state

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.group_size, self.bits, *meta = v
        # Upstream's state has no dtype or head dims: read them off the arrays.
        if keys is not None and not meta:
            meta = [str(keys[1].dtype).rpartition(".")[2], None]
        self.dtype, head_dims = meta or (None, None)
        if keys is not None and head_dims is None:
            head_dims = (
                keys[0].shape[-1] * 32 // self.bits,
                values[0].shape[-1] * 32 // self.bits,
            )
        self.head_dims = None if head_dims is None else tuple(head_dims)
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)
        self.reserved = 0
        self._tail = self._step = None

    _check_state = staticmethod(_check_quantized_state)

    def trim(self, n):
        if not isinstance(n, int):
            raise ValueError(f"QuantizedKVCache.trim: n must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"QuantizedKVCache.trim: n must be >= 0, got {n}")
        n = min(self.offset, n)
        self.offset -= n
        self._tail_len = max(0, self._tail_len - n)
        return n

    def reserve(self, n):
        """Expect ``n`` tokens in all: allocate room for them at once."""
        if n < 0:
            raise ValueError(f"QuantizedKVCache.reserve: negative token count ({n})")
        self.reserved = n
        if self.keys is not None and n > self.keys[0].shape[-2]:
            self._resize(n)

    def compact(self):
        """Copy the live tokens into exactly sized buffers, freeing the old ones."""
        if self.keys is None:
            return
        self._tail = self._step = None
        if self.offset == 0:
            self.keys = self.values = None
            return
        if self.offset < self.keys[0].shape[-2]:
            self._resize(self.offset)
        mx.eval(self.keys, self.values)

    def _resize(self, capacity):
        """Move the live tokens into new buffers of ``capacity`` tokens."""

        def resize(x):
            new = mx.zeros((*x.shape[:-2], capacity, x.shape[-1]), dtype=x.dtype)
            live = x[..., : self.offset, :]
            return mx.slice_update(new, live, mx.array([0]), [2])

        self.keys = tuple(resize(x) for x in self.keys)
        self.values = tuple(resize(x) for x in self.values)

    def to_kv_cache(self) -> "KVCache":
        """The live tokens dequantized into a ``KVCache`` of the original dtype."""
        kv_cache = KVCache()
        if self.keys is None or self.offset == 0:
            return kv_cache
        keys, values = self.keys_and_values()
        dtype = getattr(mx, self.dtype)
        k_head_dim, v_head_dim = self.head_dims
        keys = mx.dequantize(*keys, group_size=self.group_size, bits=self.bits)
        values = mx.dequantize(*values, group_size=self.group_size, bits=self.bits)
        kv_cache.keys = keys[..., :k_head_dim].astype(dtype)
        kv_cache.values = values[..., :v_head_dim].astype(dtype)
        kv_cache.offset = self.offset
        return kv_cache

    def quantizes_with(self, group_size):
        """Whether asking for ``group_size`` gives the group size this cache
        holds, which may have been lowered to divide its head dims."""
        if self.head_dims is None:
            return group_size == self.group_size
        layout = _kv_quant_layout(*self.head_dims, group_size, self.bits)
        return layout[0] == self.group_size

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        arrays = (self.keys, self.values, self._tail or ())
        return tree_reduce(lambda a, x: a + x.nbytes, arrays, 0)


class _KVCache:
    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        # The state set, not an update: an update of 1,024 tokens or more waits
        # for the last layer's (_pipeline), 32 round trips to the GPU in all
        # (H200, Llama-8B shape, 2048 tokens: 5-6 ms of a 4k prefill's 0.12 s).
        quant_cache = QuantizedKVCache(group_size=group_size, bits=bits)
        if self.keys is not None and self.offset > 0:
            keys = self.keys[..., : self.offset, :]
            values = self.values[..., : self.offset, :]
            group_size, *parts = _kv_quantize(keys, values, group_size, bits)
            dtype = str(keys.dtype).rpartition(".")[2]
            dims = (keys.shape[3], values.shape[3])
            quant_cache.state = (*parts, self.offset, group_size, bits, dtype, dims)
        return quant_cache


PATCH = Patch(
    "quantized_cache",
    "QuantizedKVCache: live size, compaction, geometric growth, dequantized "
    "export, bit-exact save/load, any head dim",
    new_module("mlx_lm.models.quantized_layout")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.quantized_layout",
        "_check_quantized",
        "_check_quantized_state",
        "_kv_quant_layout",
        "_kv_quantize",
        "_start_tail",
        "_tail_update",
    )
    + targets("mlx_lm.models.cache", os)
    + targets("mlx_lm.models.cache:QuantizedKVCache", _QuantizedKVCache)
    + targets("mlx_lm.models.cache:KVCache", _KVCache),
)
