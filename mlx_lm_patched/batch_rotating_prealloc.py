"""Preallocated, in-place ``BatchRotatingKVCache``.

The batch twin of ``rotating_prealloc``: the ``max_size`` ring is allocated
once per batch composition (``merge``, ``extend`` and ``filter`` change the
number of rows, so they build a new ring); decode and chunked prefill write
into it in place, and right padding is rolled into left padding in place.

Also fixed: a multi-token update after decode has wrapped gets a mask that
accounts for the column it drops (upstream's hid a left-padded row's oldest
token), a loaded cache can be updated (upstream: ``AttributeError:
_lengths``), ``extract`` returns a row that owns its memory and works on an
empty cache, and ``trim`` rejects negative counts and never makes a row's
offset negative.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from ._registry import Patch, class_patch
from .rotating_prealloc import _put


class BatchRotatingKVCache:
    # Ring of ``max_size`` columns; column ``t`` of the shared timeline holds
    # one token per row, ``n = min(_offset, max_size)`` columns are live:
    # - ``_offset <= max_size``: slot ``t`` holds column ``t``, ``_idx == _offset``;
    # - ``_offset > max_size``: the oldest live column is at ``_idx % max_size``.
    # ``left_padding[b]``: index, in temporal order of the live columns, of
    # row ``b``'s first real token (negative once it was evicted);
    # ``offset[b]``: real tokens row ``b`` has seen.

    def _order(self):
        """Slots of the live columns, oldest first."""
        n = min(self._offset, self.max_size)
        idx = self._idx % self.max_size if self._offset > self.max_size else 0
        return list(range(idx, n)) + list(range(idx))

    def _allocate(self, keys, values):
        """Allocate the ring, moving in any state saved in another layout."""
        B, H, _, Dk = keys.shape
        k = mx.zeros((B, H, self.max_size, Dk), keys.dtype)
        v = mx.zeros((B, H, self.max_size, values.shape[3]), values.dtype)
        if self.keys is not None:
            self._temporal_order()
            n = min(self._idx, self.max_size)
            k = _put(k, self.keys[..., self._idx - n : self._idx, :], [0])
            v = _put(v, self.values[..., self._idx - n : self._idx, :], [0])
            self.left_padding -= self._idx - n
            self._idx = n
        self.keys, self.values = k, v
        self.rotated = False

    def _check(self, keys, values):
        ring = (self.keys.shape[:2], self.keys.shape[3], self.values.shape[3])
        new = (keys.shape[:2], keys.shape[3], values.shape[3])
        if ring != new or keys.dtype != self.keys.dtype:
            raise ValueError(
                f"BatchRotatingKVCache holds (batch, heads)={ring[0]}, head dims "
                f"{ring[1:]} of {self.keys.dtype}; got {new[0]}, {new[1:]} "
                f"of {keys.dtype}"
            )

    def _rewrite(self, columns):
        """Write ``columns`` (temporal order, evaluated) as the live ring."""
        self.keys = _put(self.keys, columns[0], [0])
        self.values = _put(self.values, columns[1], [0])
        self._idx = columns[0].shape[2]
        self.rotated = False

    def _roll_right_padding(self, columns):
        """Roll the right padding each row has consumed to its left;
        ``columns`` are keys and values in temporal order."""
        roll = mx.maximum(0, self.offset - self._lengths)
        n = columns[0].shape[2]
        src = ((mx.arange(n)[None] - roll[:, None]) % n)[:, None, :, None]
        self.left_padding += roll
        self.offset = self.offset - roll
        return [mx.take_along_axis(c, src, axis=2) for c in columns]

    def _update_past_ring(self, keys, values):
        """A multi-token update past the ring: attention sees the last
        ``max_size - 1`` columns and the new ones; the ring keeps the newest."""
        n = min(self._offset, self.max_size)
        m = min(n, self.max_size - 1)
        order = mx.array(self._order()[n - m :], mx.int32)
        seen = []
        for cache, new in ((self.keys, keys), (self.values, values)):
            B, H, S, D = new.shape
            seen.append(mx.zeros((B, H, m + S, D), new.dtype))
            seen[-1][..., :m, :] = cache[..., order, :]
            seen[-1][..., m:, :] = new
        # Done reading the ring: evaluate now so the writes below reuse its buffer.
        mx.eval(seen)
        self._offset += S
        self.offset = self.offset + S
        # Padding must not take the place of real tokens in the ring.
        kept = seen if self._lengths is None else self._roll_right_padding(seen)
        self._rewrite([c[..., m + S - self.max_size :, :] for c in kept])
        self.left_padding -= n + S - self.max_size
        return tuple(seen)

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if S == 1 and self._lengths is not None:
            raise RuntimeError(
                "finalize() should be called before decoding with BatchRotatingKVCache"
            )
        if self.keys is None or self.keys.shape[2] != self.max_size:
            self._allocate(keys, values)
        self._check(keys, values)
        if self._offset + S <= self.max_size:
            prev = self._offset
            self.keys = _put(self.keys, keys, [prev])
            self.values = _put(self.values, values, [prev])
            self._offset += S
            self.offset = self.offset + S
            self._idx = self._offset
            return self.keys_and_values()
        if S > 1:
            return self._update_past_ring(keys, values)
        self._idx %= self.max_size
        self.rotated = True
        self.left_padding -= 1
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self._offset += 1
        self.offset = self.offset + 1
        self._idx += 1
        return self.keys, self.values

    def finalize(self):
        if self._lengths is not None:
            if self.keys is not None:
                order = mx.array(self._order(), mx.int32)
                live = [c[..., order, :] for c in (self.keys, self.values)]
                live = self._roll_right_padding(live)
                mx.eval(live)
                self._rewrite(live)
            self._lengths = None

    @property
    def state(self):
        k, v = self.keys, self.values
        if k is not None and self._offset < k.shape[2]:
            k, v = k[..., : self._offset, :], v[..., : self._offset, :]
        return (
            k,
            v,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        )

    @state.setter
    def state(self, v):
        (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        ) = v
        self._lengths = None

    def trim(self, n):
        if n < 0:
            raise ValueError(f"BatchRotatingKVCache.trim: n must be >= 0, got {n}")
        if n and self._offset > self.max_size:
            raise ValueError(
                f"BatchRotatingKVCache.trim: the ring has wrapped (offset "
                f"{self._offset} > max_size {self.max_size}), its oldest tokens "
                "are gone; check is_trimmable() first"
            )
        n = min(self._offset, n)
        self._offset -= n
        self._idx = self._offset
        self.offset = mx.maximum(self.offset - n, 0)
        self.left_padding = mx.minimum(self.left_padding, self._offset)
        return n

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        window_size = window_size or self.max_size
        n = min(self._offset, self.max_size)
        wraps = N == 1 and self._offset >= self.max_size
        if wraps:
            # One token written over the oldest column of the full ring.
            offset, dropped = self.max_size - 1, 1
        elif self._offset + N > self.max_size:
            # Attention sees the last ``max_size - 1`` columns, then the new ones.
            offset = min(n, self.max_size - 1)
            dropped = n - offset
        else:
            offset, dropped = self._offset, 0
        left_padding = self.left_padding - dropped
        rinds = mx.arange(offset + N)
        linds = mx.arange(offset, offset + N)[:, None]
        mask = (linds >= rinds) & (linds < rinds + window_size)
        mask = mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))
        if wraps:
            mask = mx.roll(mask, shift=self._idx % self.max_size + 1, axis=-1)
        return mask

    def extend(self, other):
        """
        In-place extend this cache with the other cache.
        """
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        full = self if self.keys is not None else other
        _, H, _, Dk = full.keys.shape
        Dv = full.values.shape[3]
        caches = (self, other)
        n = max(min(c._offset, c.max_size) for c in caches)
        B = sum(c.offset.shape[0] for c in caches)
        keys = mx.zeros((B, H, self.max_size, Dk), full.keys.dtype)
        values = mx.zeros((B, H, self.max_size, Dv), full.values.dtype)
        row = 0
        for c in caches:
            rows = c.offset.shape[0]
            if c.keys is not None:
                order = mx.array(c._order(), mx.int32)
                start, axes = [row, n - order.size], (0, 2)
                keys = _put(keys, c.keys[..., order, :], start, axes)
                values = _put(values, c.values[..., order, :], start, axes)
            row += rows
        self.left_padding = mx.concatenate(
            [c.left_padding + n - min(c._offset, c.max_size) for c in caches]
        )
        self.offset = mx.concatenate([c.offset for c in caches])
        self.keys, self.values = keys, values
        self._offset = max(c._offset for c in caches)
        self._idx = n
        self.rotated = False

    def extract(self, idx):
        cache = RotatingKVCache(self.max_size)
        mx.eval(self.left_padding, self.offset)
        cache.offset = self.offset.tolist()[idx]
        if self.keys is None:
            cache.offset = 0
            return cache
        padding = max(0, self.left_padding.tolist()[idx])
        live = mx.array(self._order()[padding:], mx.int32)
        # A gather copies: the row does not pin the batch's buffers.
        cache.keys = self.keys[idx : idx + 1, :, live]
        cache.values = self.values[idx : idx + 1, :, live]
        cache._idx = live.size
        return cache

    @classmethod
    def merge(cls, caches):
        if not all(c.max_size == caches[0].max_size for c in caches):
            raise ValueError(
                "BatchRotatingKVCache can only merge caches with the same maximum size"
            )
        full = [c for c in caches if c.keys is not None]
        if len({(c.keys.shape[1], c.keys.shape[3], c.keys.dtype) for c in full}) > 1:
            raise ValueError(
                "BatchRotatingKVCache can only merge caches with the same heads, "
                f"head dim and dtype, got {[(c.keys.shape, c.keys.dtype) for c in full]}"
            )
        lengths = [c.size() for c in caches]
        n = max(lengths)
        if n == 0:
            return cls(caches[0].max_size, [0] * len(caches))
        padding = [n - l for l in lengths]
        _, H, _, Dk = full[0].keys.shape
        Dv = full[0].values.shape[3]
        shape = (len(caches), H, caches[0].max_size)
        keys = mx.zeros((*shape, Dk), full[0].keys.dtype)
        values = mx.zeros((*shape, Dv), full[0].values.dtype)
        for i, (p, l, c) in enumerate(zip(padding, lengths, caches)):
            if l:
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
                keys = _put(keys, k[..., -l:, :], [i, p], (0, 2))
                values = _put(values, v[..., -l:, :], [i, p], (0, 2))
        cache = cls(caches[0].max_size, padding)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset for c in caches])
        cache._idx = cache._offset = n
        return cache


PATCH = Patch(
    "batch_rotating_prealloc",
    "BatchRotatingKVCache: allocate the ring once, write in place, fix its masks",
    class_patch(
        "mlx_lm.models.cache:BatchRotatingKVCache",
        BatchRotatingKVCache,
        {
            "_order": None,
            "_allocate": None,
            "_check": None,
            "_rewrite": None,
            "_roll_right_padding": None,
            "_update_past_ring": None,
            "update_and_fetch": "a49febe14a68",
            "finalize": "3b873fc3d89c",
            "state": "6b269fad0f9b",
            "trim": "6016a533a41f",
            "make_mask": "0ead5fbf5d65",
            "extend": "2710c7080f16",
            "extract": "514b9880b66d",
            "merge": "228e19f9fda9",
        },
        removes={
            "_trim": "e89fdacec3a7",
            "_update_concat": "5a66b0c9a1d2",
            "_update_in_place": "9fa8087f4909",
        },
    ),
    requires=("rotating_prealloc",),
)
