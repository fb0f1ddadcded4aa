"""Batched quantized caches: ``BatchKVCache`` and ``BatchRotatingKVCache``
holding quantized tokens, so quantized prompt caches merge into a batch."""

from typing import List

import mlx.core as mx

from .cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    _check_quantized,
    _kv_quant_layout,
    _pipeline,
    _put,
    _quantize_update,
    dynamic_roll,
)


def _quantized_like(caches):
    """``caches`` with the unquantized ones quantized like the first quantized
    one, and that one's group size and bits."""
    quantized = [c for c in caches if hasattr(c, "bits")]
    group_size, bits = quantized[0].group_size, quantized[0].bits
    caches = [
        c if hasattr(c, "bits") else c.to_quantized(group_size, bits) for c in caches
    ]
    return caches, group_size, bits


def _check_layouts(caches, what):
    """Raise unless ``caches`` share group size, bits and head dims; ``what``
    (``"BatchQuantizedKVCache can only merge caches"``) begins the message."""
    layouts = {(c.group_size, c.bits, tuple(c.head_dims)) for c in caches}
    if len(layouts) > 1:
        raise ValueError(
            f"{what} of the same group size, bits and head dims, got {sorted(layouts)}"
        )


# Written as it would read in mlx_lm/models/cache.py, and run there.
class BatchQuantizedKVCache(BatchKVCache):
    # ``BatchKVCache``'s layout (its ``prepare``, ``trim``, ``make_mask`` and
    # ``size`` are inherited): column ``t < _idx`` of the shared
    # timeline, row ``b`` real from column ``left_padding[b]``,
    # ``offset[b]`` its real tokens. ``keys``/``values`` are ``mx.quantize``
    # tuples, each part (B, H, capacity, ...), columns ``[_idx, capacity)``
    # free; group size, bits, dtype and head dims as in ``QuantizedKVCache``.
    step = 256

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        BatchKVCache.__init__(self, left_padding)
        self.group_size = group_size
        self.bits = bits
        self.dtype = None
        self.head_dims = None

    def _resize(self, like, capacity):
        """Move columns ``[0, _idx)`` into buffers of ``capacity`` columns,
        shaped like the quantized update ``like``."""
        old = self.keys + self.values if self.keys is not None else (None,) * 6
        new = []
        for x, o in zip(like[0] + like[1], old):
            n = mx.zeros((*x.shape[:2], capacity, x.shape[3]), x.dtype)
            new.append(n if o is None else _put(n, o[..., : self._idx, :], [0]))
        self.keys, self.values = tuple(new[:3]), tuple(new[3:])

    def update_and_fetch(self, keys, values):
        keys, values = _quantize_update(self, keys, values)
        prev, S = self._idx, keys[0].shape[2]
        capacity = 0 if self.keys is None else self.keys[0].shape[2]
        if prev + S > capacity:
            capacity = max(prev + S, capacity + capacity // 2)
            self._resize(
                (keys, values), (capacity + self.step - 1) // self.step * self.step
            )
        self.offset = self.offset + S
        self._idx += S
        for c, x in zip(self.keys + self.values, keys + values):
            c[..., prev : self._idx, :] = x
        _pipeline(self.keys + self.values, S)
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(
            tuple(x[..., : self._idx, :] for x in parts)
            for parts in (self.keys, self.values)
        )

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding[:, None]
            self.keys, self.values = (
                tuple(dynamic_roll(x, padding, axis=2) for x in parts)
                for parts in (self.keys, self.values)
            )
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    @property
    def state(self):
        keys, values = (None, None) if self.keys is None else self.keys_and_values()
        return (
            keys,
            values,
            self.offset,
            self.left_padding,
            self._idx,
            self.group_size,
            self.bits,
            self.dtype,
            self.head_dims,
        )

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.left_padding, self._idx = v[:5]
        self.group_size, self.bits, self.dtype, head_dims = v[5:]
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)
        self.head_dims = None if head_dims is None else tuple(head_dims)
        self._right_padding = None

    @staticmethod
    def _check_state(v):
        if len(v) != 9:
            raise ValueError(f"{len(v)} state items, a BatchQuantizedKVCache has 9")
        keys, values = v[:2]
        _check_quantized(keys, values, *v[5:])
        packed = [None if x is None else x[0] for x in (keys, values)]
        BatchKVCache._check_state((*packed, *v[2:5]))

    def filter(self, batch_indices):
        """
        In-place filter to keep just the given indices in the cache.
        """
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        # Shift left to reduce padding
        shift = min(self.left_padding.tolist()) if self.left_padding.size else 0
        if self.keys is not None:
            self.keys, self.values = (
                tuple(mx.contiguous(x[batch_indices, :, shift:]) for x in parts)
                for parts in (self.keys, self.values)
            )
        self._idx -= shift
        self.left_padding -= shift

    def extend(self, other):
        """
        In-place extend this cache with the other cache.
        """
        if not hasattr(other, "bits"):
            other = other.to_quantized(self.group_size, self.bits)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        full = self if self.keys is not None else other
        _check_layouts(
            [c for c in (self, other) if c.keys is not None],
            "BatchQuantizedKVCache can only extend with a cache",
        )
        max_idx = max(self._idx, other._idx)

        # Right-justify both at ``max_idx`` columns.
        def aligned(c):
            if c.keys is None:
                B = c.offset.shape[0]
                return [
                    mx.zeros((B, x.shape[1], max_idx, x.shape[3]), x.dtype)
                    for x in full.keys + full.values
                ]
            pad = [(0, 0), (0, 0), (max_idx - c._idx, 0), (0, 0)]
            return [mx.pad(x[..., : c._idx, :], pad) for x in c.keys + c.values]

        parts = [mx.concatenate(p) for p in zip(aligned(self), aligned(other))]
        self.keys, self.values = tuple(parts[:3]), tuple(parts[3:])
        self.left_padding = mx.concatenate(
            [c.left_padding + max_idx - c._idx for c in (self, other)]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = max_idx
        self.group_size, self.bits = full.group_size, full.bits
        self.dtype, self.head_dims = full.dtype, full.head_dims

    def extract(self, idx):
        cache = QuantizedKVCache(self.group_size, self.bits)
        if self.keys is None:
            return cache
        mx.eval(self.left_padding)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = (
            tuple(
                mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in parts
            )
            for parts in (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        cache.dtype, cache.head_dims = self.dtype, self.head_dims
        return cache

    @classmethod
    def merge(cls, caches):
        caches, group_size, bits = _quantized_like(caches)
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), group_size, bits)
        full = [c for c in caches if c.size() > 0]
        _check_layouts(full, "BatchQuantizedKVCache can only merge caches")

        padding = [max_length - l for l in lengths]
        cache = cls(padding, full[0].group_size, full[0].bits)
        cache.dtype, cache.head_dims = full[0].dtype, full[0].head_dims
        parts = []
        for j, x in enumerate(full[0].keys + full[0].values):
            shape = (len(caches), x.shape[1], max_length, x.shape[3])
            parts.append(mx.zeros(shape, x.dtype))
            for i, (p, c) in enumerate(zip(padding, caches)):
                if c.size() > 0:
                    live = (c.keys + c.values)[j][..., : c.offset, :]
                    parts[j] = _put(parts[j], live, [i, p], (0, 2))
        cache.keys, cache.values = tuple(parts[:3]), tuple(parts[3:])
        cache.offset += max_length
        cache._idx = max_length
        return cache

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)


class BatchQuantizedRotatingKVCache(BatchRotatingKVCache):
    # ``BatchRotatingKVCache`` itself (ring, sinks, padding, masks, filter,
    # extend, trim: all its code), with keys and values each one uint32
    # array: per token its packed quantized head dim, then its scales and
    # biases bit for bit. Every slot operation thus moves whole tokens;
    # attention gets them back as (packed, scales, biases) views.

    def __init__(
        self,
        max_size,
        left_padding: List[int],
        keep: int = 0,
        group_size: int = 64,
        bits: int = 8,
    ):
        BatchRotatingKVCache.__init__(self, max_size, left_padding, keep)
        self.group_size = group_size
        self.bits = bits
        self.dtype = None
        self.head_dims = None

    def _pack(self, parts):
        """One uint32 array from ``(packed, scales, biases)``."""
        packed, scales, biases = parts
        extra = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
        return mx.concatenate([packed, extra], axis=-1)

    def _unpack(self, x, head_dim):
        """``(packed, scales, biases)`` views of ``x``'s tokens."""
        _, k_width, v_width = _kv_quant_layout(
            *self.head_dims, self.group_size, self.bits
        )
        width = k_width if head_dim == self.head_dims[0] else v_width
        n = width * self.bits // 32
        extra = x[..., n:].view(getattr(mx, self.dtype))
        groups = extra.shape[-1] // 2
        return x[..., :n], extra[..., :groups], extra[..., groups:]

    def update_and_fetch(self, keys, values):
        dims = (keys.shape[3], values.shape[3])
        keys, values = (self._pack(q) for q in _quantize_update(self, keys, values))
        keys, values = BatchRotatingKVCache.update_and_fetch(self, keys, values)
        return self._unpack(keys, dims[0]), self._unpack(values, dims[1])

    @property
    def state(self):
        state = BatchRotatingKVCache.state.fget(self)[:8] + (self.keep,)
        return state + (self.group_size, self.bits, self.dtype, self.head_dims)

    @state.setter
    def state(self, v):
        BatchRotatingKVCache.state.fset(self, v[:9])
        self.group_size, self.bits, self.dtype, head_dims = v[9:]
        self.head_dims = None if head_dims is None else tuple(head_dims)

    @staticmethod
    def _check_state(v):
        if len(v) != 13:
            raise ValueError(
                f"{len(v)} state items, a BatchQuantizedRotatingKVCache has 13"
            )
        BatchRotatingKVCache._check_state(v[:9])
        keys, values, group_size, bits, dtype, head_dims = *v[:2], *v[9:]
        if keys is not None and head_dims is not None:
            # Each token: its packed head dim, then its scales and biases.
            _, *widths = _kv_quant_layout(*head_dims, group_size, bits)
            if dtype not in ("float16", "bfloat16", "float32"):
                raise ValueError(f"dtype {dtype!r} is not a float dtype")
            size = getattr(mx, dtype).size
            for x, w in zip((keys, values), widths):
                if x.dtype != mx.uint32 or x.shape[3] != w * bits // 32 + (
                    2 * w // group_size * size // 4
                ):
                    raise ValueError(
                        f"{x.shape[3]} words a token do not fit head dims "
                        f"{tuple(head_dims)}, bits={bits}, group_size={group_size}"
                    )

    def extend(self, other):
        if not hasattr(other, "bits"):
            other = other.to_quantized(self.group_size, self.bits)
        _check_layouts(
            [c for c in (self, other) if c.keys is not None],
            "BatchQuantizedRotatingKVCache can only extend with a cache",
        )
        BatchRotatingKVCache.extend(self, other)
        if self.head_dims is None:
            self.group_size, self.bits = other.group_size, other.bits
            self.dtype, self.head_dims = other.dtype, other.head_dims

    def extract(self, idx):
        row = BatchRotatingKVCache.extract(self, idx)
        knobs = row.slack, row.checkpoint_every, row.max_checkpoints
        cache = QuantizedRotatingKVCache(
            self.max_size, self.keep, self.group_size, self.bits, *knobs
        )
        cache.offset, cache._lo, cache._hi = row.offset, row._lo, row._hi
        cache.checkpoints = row.checkpoints
        if row.keys is not None:
            # The row and its undo ring (its slack's evicted tokens), unpacked.
            for name in ("keys", "values", "_undo_keys", "_undo_values"):
                x, dim = getattr(row, name), self.head_dims[name.endswith("values")]
                if x is not None:
                    parts = map(mx.contiguous, self._unpack(x, dim))
                    setattr(cache, name, tuple(parts))
            cache._idx = row._idx
            cache.dtype, cache.head_dims = self.dtype, self.head_dims
        return cache

    @classmethod
    def merge(cls, caches):
        caches, group_size, bits = _quantized_like(caches)
        full = [c for c in caches if c.keys is not None]
        _check_layouts(full, "BatchQuantizedRotatingKVCache can only merge caches")
        # Each row as a RotatingKVCache of packed tokens, merged as those are.
        rows = []
        for c in caches:
            row = RotatingKVCache(
                c.max_size, c.keep, c.slack, c.checkpoint_every, c.max_checkpoints
            )
            if c.keys is not None:
                row.keys, row.values = cls._pack(c, c.keys), cls._pack(c, c.values)
            row.offset, row._idx, row.checkpoints = c.offset, c._idx, c.checkpoints
            rows.append(row)
        cache = BatchRotatingKVCache.merge.__func__(cls, rows)
        cache.group_size, cache.bits = group_size, bits
        if full:
            # The group size in use, which an empty cache has not chosen yet.
            cache.group_size = full[0].group_size
            cache.dtype, cache.head_dims = full[0].dtype, tuple(full[0].head_dims)
        return cache
