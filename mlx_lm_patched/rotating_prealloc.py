"""Preallocated, in-place ``RotatingKVCache``.

Upstream grows the ring in 256-token steps by trim-then-concatenate, so each
growth step briefly holds several copies of every layer's cache, and a
chunked prefill keeps up to ``max_size + S - 1`` tokens per layer. Here the
first update allocates the ``max_size`` ring once; decode and chunks within
the ring write into it in place. A multi-token update that runs past the ring
gives attention a transient of the last ``max_size - 1`` tokens plus the
chunk (the same keys, in the same order, as upstream) and keeps a ring of
the newest tokens, copied from it. Writing into the old ring instead would
need a sync inside the model (its readers done first, or MLX copies it
anyway): on an H100 (Llama-8B shape, ring 4096, 2048-token chunks) the
per-layer ``mx.eval`` doing that took 16-25% of the prefill time. It bounded
a chunk past the ring to one layer at a time (1.6 GiB); without it the
chunk's graph is in flight at once (6.4 GiB), as ``KVCache``'s chunks are
(5.6-11 GiB).

Also fixed: ``keep`` tokens stay visible to every query (upstream hides them
from the later queries of a chunk, and rolls the single-token mask as if
``keep=0``), negative trims and trims of a wrapped ring raise instead of
corrupting ``_idx`` (ml-explore/mlx-lm#1776, #1868), updates whose shape does
not match the ring raise before anything changes.
"""

from typing import Optional

import mlx.core as mx

from ._registry import Patch, Target, class_patch, pasted_into


def _check_update(cache, keys, values):
    """Raise, changing nothing, if ``keys``/``values`` do not fit ``cache``."""
    new = (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
    held = new
    if cache.keys is not None:
        k, v = cache.keys, cache.values
        held = (*k.shape[:2], k.shape[3], v.shape[3], k.dtype)
    if held != new or keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise ValueError(
            f"{type(cache).__name__} holds (batch, heads, key dim, value dim, "
            f"dtype) {held}; got keys {keys.shape} {keys.dtype} and values "
            f"{values.shape} {values.dtype}"
        )


def _stored(keys, values):
    """The tokens state arrays ``keys`` and ``values`` hold; ``ValueError``
    unless both are None or (B, H, L, D) arrays agreeing in B, H, L and dtype."""
    if keys is None and values is None:
        return 0
    if not all(isinstance(x, mx.array) and x.ndim == 4 for x in (keys, values)):
        raise ValueError("keys and values are not both (batch, heads, tokens, dim)")
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise ValueError(
            f"keys {keys.shape} {keys.dtype} and values {values.shape} "
            f"{values.dtype} differ in batch, heads, tokens or dtype"
        )
    return keys.shape[2]


def _put(buffer, update, start, axes=(2,)):
    """``buffer[..., start:start + n, :] = update`` into ``buffer``'s memory."""
    if update.shape == buffer.shape:
        # ``__setitem__`` over a whole array would return ``update`` itself.
        return mx.slice_update(buffer, update, mx.array(start), axes)
    index = [slice(None)] * buffer.ndim
    for axis, s in zip(axes, start):
        index[axis] = slice(s, s + update.shape[axis])
    buffer[tuple(index)] = update
    return buffer


# The class body is written as it reads in mlx_lm/models/cache.py and runs
# there (``class_patch`` pastes it).
class RotatingKVCache:
    # Layout of the ``max_size`` ring, ``n = min(offset, max_size)`` tokens live:
    # - ``offset <= max_size``: slot ``s`` holds position ``s``, ``_idx == offset``;
    # - ``offset > max_size``: slots ``[0, keep)`` hold the first ``keep``
    #   positions, slots ``[keep, max_size)`` the last ``max_size - keep`` in
    #   rotated order, the oldest at ``_idx`` (at ``keep`` when ``_idx == max_size``).
    # This is upstream's layout after its trims, so decode sees the same arrays.

    def __init__(self, max_size, keep=0):
        if max_size < 1:
            raise ValueError(f"RotatingKVCache: max_size must be >= 1, got {max_size}")
        # The newest token needs a slot of its own: a ring no larger than
        # ``keep`` keeps ``max_size - 1`` first tokens.
        self.keep = min(keep, max_size - 1)
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    def _allocate(self, keys, values):
        """Allocate the ring, moving in any state saved in another layout."""
        B, H, _, Dk = keys.shape
        k = mx.zeros((B, H, self.max_size, Dk), keys.dtype)
        v = mx.zeros((B, H, self.max_size, values.shape[3]), values.dtype)
        if self.keys is not None:
            n = min(self.offset, self.max_size)
            keep = min(self.keep, n)
            total = self._temporal_order(self.keys).shape[2]
            live = mx.array(
                list(range(keep)) + list(range(total - n + keep, total)), mx.int32
            )
            k = _put(k, self._temporal_order(self.keys)[..., live, :], [0])
            v = _put(v, self._temporal_order(self.values)[..., live, :], [0])
            self._idx = n
        self.keys, self.values = k, v

    def _update_past_ring(self, keys, values):
        """A multi-token update past the ring: attention sees the last
        ``max_size - 1`` tokens and the new ones; the ring keeps the newest."""
        n = min(self.offset, self.max_size)
        m = min(n, self.max_size - 1)
        keep = min(self.keep, n)
        # Slots in temporal order: the ``keep`` first tokens, then the ring
        # from its oldest slot ``_idx``; a full ring's oldest drops out.
        runs = [[0, keep], [self._idx, n], [keep, self._idx]]
        if m < n:
            runs[1 if self._idx < n else 2][0] += 1
        seen = [
            mx.concatenate([c[..., a:b, :] for a, b in runs if a < b] + [x], axis=2)
            for c, x in ((self.keys, keys), (self.values, values))
        ]
        # The ring becomes a copy of the newest tokens: writing into the old
        # one in place would wait for its readers (a sync inside the model).
        end = seen[0].shape[2]
        slots = list(range(self.keep)) + list(
            range(end - self.max_size + self.keep, end)
        )
        slots = mx.array(slots, mx.int32)
        self.keys, self.values = seen[0][..., slots, :], seen[1][..., slots, :]
        self.offset += keys.shape[2]
        self._idx = self.max_size
        return tuple(seen)

    def update_and_fetch(self, keys, values):
        _check_update(self, keys, values)
        if self.keys is None or self.keys.shape[2] != self.max_size:
            self._allocate(keys, values)
        S = keys.shape[2]
        if self.offset + S <= self.max_size:
            prev = self.offset
            self.keys = _put(self.keys, keys, [prev])
            self.values = _put(self.values, values, [prev])
            self.offset += S
            self._idx = self.offset
            return self.keys_and_values()
        if S > 1:
            return self._update_past_ring(keys, values)
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self.offset += 1
        self._idx += 1
        return self.keys, self.values

    @property
    def state(self):
        if self.keys is not None and self.offset < self.keys.shape[2]:
            k, v = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        else:
            k, v = self.keys, self.values
        return k, v, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @staticmethod
    def _check_state(v):
        if len(v) != 6:
            raise ValueError(f"{len(v)} state items, a RotatingKVCache has 6")
        keys, values, offset, keep, max_size, _idx = v
        n = _stored(keys, values)
        if max_size < 1 or not 0 <= keep < max_size:
            raise ValueError(
                f"keep {keep} and max_size {max_size}: need 0 <= keep < max_size"
            )
        if offset < 0:
            raise ValueError(f"offset {offset} is negative")
        if n < min(offset, max_size):
            raise ValueError(f"{n} tokens stored for offset {offset}")
        # Upstream's ring holds more than max_size tokens right after a
        # multi-token update, in temporal order with _idx at the end.
        if n > max_size and not _idx == n <= offset:
            raise ValueError(f"{n} tokens stored, more than max_size {max_size}")
        # Slot ``_idx`` is next: the oldest once wrapped, else at ``offset``.
        if not (keep <= _idx <= n if offset > max_size else _idx == offset):
            raise ValueError(
                f"_idx {_idx} does not fit offset {offset} and keep {keep}"
            )

    def trim(self, n):
        name = type(self).__name__
        if n < 0:
            raise ValueError(f"{name}.trim: n must be >= 0, got {n}")
        if n and self.offset > self.max_size:
            raise ValueError(
                f"{name}.trim: the ring has wrapped (offset {self.offset} > "
                f"max_size {self.max_size}), its oldest tokens are gone; "
                "check is_trimmable() first"
            )
        n = min(self.offset, n)
        self.offset -= n
        self._idx = self.offset
        return n

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        # A key is visible if it is one of the ``keep`` first tokens or among
        # the ``window - keep`` newest. ``window`` is the model's
        # ``window_size`` capped at the ring (a sliding layer shrunk by
        # ``max_kv_size``), so chunks and decode agree.
        window = min(window_size or self.max_size, self.max_size)
        if N > 1:
            offset = min(self.max_size - 1, self.offset)
            if offset + N <= window and not return_array:
                return "causal"
            rinds = mx.arange(offset + N)
            linds = mx.arange(offset, offset + N)[:, None]
            recent = linds < rinds + window - self.keep
            return (linds >= rinds) & (recent | (rinds < self.keep))
        if window == self.max_size or self.offset < window:
            return None
        slots = mx.arange(min(self.offset + 1, self.max_size))
        if self.offset < self.max_size:
            distance = self.offset - slots
        else:
            idx = self.keep if self._idx == self.max_size else self._idx
            ring = self.max_size - self.keep
            distance = (idx - slots) % ring
        return (slots < self.keep) | (distance < window - self.keep)


PATCH = Patch(
    "rotating_prealloc",
    "RotatingKVCache: allocate the ring once, write in place, keep tokens visible",
    [
        Target("mlx_lm.models.cache", name, pasted_into("mlx_lm.models.cache", f), None)
        for name, f in (
            ("_check_update", _check_update),
            ("_stored", _stored),
            ("_put", _put),
        )
    ]
    + class_patch(
        "mlx_lm.models.cache:RotatingKVCache",
        RotatingKVCache,
        {
            "__init__": "e0dcbbd9ab98",
            "_allocate": None,
            "_update_past_ring": None,
            "update_and_fetch": "a49febe14a68",
            "state": "58270b869508",
            "_check_state": None,
            "trim": "798fee465b19",
            "make_mask": "aae2a6dcb644",
        },
        removes={
            "_trim": "b810aeeb118b",
            "_update_concat": "74947aeaf783",
            "_update_in_place": "72480bc8fe40",
        },
    ),
    uses={
        "mlx_lm.models.cache": (
            "Optional",
            "mx",
        )
    },
)
