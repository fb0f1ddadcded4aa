"""A quantized sliding window: ``RotatingKVCache``'s preallocated ring
holding ``mx.quantize`` tuples (``RotatingKVCache.to_quantized``)."""

import copy
from typing import Optional

import mlx.core as mx

from .cache import RotatingKVCache, _check_quantized, _hold, _kv_quantize, _put


def _quantize_update(cache, keys, values):
    """``keys`` and ``values`` quantized (and padded) as the quantized ``cache``
    holds them; the first update fixes its group size, head dims and dtype."""
    dims = (keys.shape[3], values.shape[3])
    if cache.head_dims is not None and dims != tuple(cache.head_dims):
        raise ValueError(
            f"{type(cache).__name__} holds head dims {tuple(cache.head_dims)}, "
            f"got {dims}"
        )
    dtype = str(keys.dtype).rpartition(".")[2]
    group_size, keys, values = _kv_quantize(keys, values, cache.group_size, cache.bits)
    if cache.head_dims is None:
        cache.group_size, cache.head_dims, cache.dtype = group_size, dims, dtype
    return [tuple(keys), tuple(values)]


class QuantizedRotatingKVCache(RotatingKVCache):
    # The ring of the patched ``RotatingKVCache``: ``max_size`` slots,
    # ``offset``, ``_idx`` and ``keep`` with the same meaning, so its
    # ``trim``, ``is_trimmable`` and ``size`` are inherited. ``keys``/``values``
    # are ``mx.quantize`` tuples (packed, scales, biases), each part
    # (B, H, max_size, ...) once allocated; a token's groups lie along its
    # own head dim, so moving a slot moves its token exactly.

    # With ``slack``, ``_undo_keys``/``_undo_values`` are quantized tuples too
    # (each part ``(B, H, 2 * slack, ...)``), ``_lo``/``_hi`` as the ring's.

    def __init__(
        self,
        max_size,
        keep=0,
        group_size: int = 64,
        bits: int = 8,
        slack=0,
        checkpoint_every=0,
        max_checkpoints=8,
    ):
        RotatingKVCache.__init__(
            self, max_size, keep, slack, checkpoint_every, max_checkpoints
        )
        # As in QuantizedKVCache (see its __init__).
        self.group_size = group_size
        self.bits = bits
        self.dtype = None
        self.head_dims = None

    def _join_checkpoints(self, per_part):
        """The checkpoints each quantized part's ring kept (of ours, which it
        was given, and those it took), joined into ours."""
        taken = []
        for parts in zip(*per_part):
            if any(parts[0] is c for c in self.checkpoints):
                taken.append(parts[0])
                continue
            snap = copy.copy(self)
            snap.keys = tuple(p.keys for p in parts)
            snap.values = tuple(p.values for p in parts)
            snap.offset, snap._idx, snap.checkpoints = (
                parts[0].offset,
                parts[0]._idx,
                (),
            )
            taken.append(snap)
        self.checkpoints = taken

    def _allocate(self, keys, values):
        """Allocate the ring, moving in the live slots of a loaded state."""

        def ring(new, old):
            x = mx.zeros((*new.shape[:2], self.max_size, new.shape[3]), new.dtype)
            return x if old is None else _put(x, old, [0])

        old_k = self.keys or (None,) * len(keys)
        old_v = self.values or (None,) * len(values)
        self.keys = tuple(ring(n, o) for n, o in zip(keys, old_k))
        self.values = tuple(ring(n, o) for n, o in zip(values, old_v))

    def _per_part(self, method, *args):
        """``method(ring, *args)`` on each quantized part as a
        ``RotatingKVCache`` of its own (its slots, positions and undo ring
        this ring's); tuple arguments are taken part by part. Returns what
        each call returned; this ring takes their state (none if one raised)."""
        rings, out = [], []
        undo = [self._undo_keys or (None,) * 3, self._undo_values or (None,) * 3]
        for i, parts in enumerate(zip(self.keys, self.values, *undo)):
            ring = RotatingKVCache(
                self.max_size,
                self.keep,
                self.slack,
                self.checkpoint_every,
                self.max_checkpoints,
            )
            ring.keys, ring.values, ring._undo_keys, ring._undo_values = parts
            ring.offset, ring._idx = self.offset, self._idx
            ring.checkpoints = self.checkpoints  # their spread (_ring_checkpoints)
            ring._lo, ring._hi = self._lo, self._hi
            out.append(method(ring, *(a[i] if type(a) is tuple else a for a in args)))
            rings.append(ring)
        self.keys, self.values, undo_keys, undo_values = (
            tuple(getattr(r, name) for r in rings)
            for name in ("keys", "values", "_undo_keys", "_undo_values")
        )
        if undo_keys[0] is not None:
            self._undo_keys, self._undo_values = undo_keys, undo_values
        for name in ("offset", "_idx", "_lo", "_hi"):
            setattr(self, name, getattr(rings[0], name))
        return out

    def _hold_parts(self, fetched):
        """``_hold`` on each part: with slack, the next tokens to leave the
        window are copied to the undo ring before they are overwritten."""
        offset, oldest = self.offset, self.offset - self.max_size + self.keep
        if not self.slack or oldest < self.keep or self._hi > oldest:
            return fetched  # ``_hold`` copies nothing (most decode steps)
        held = self._per_part(lambda r, k, v: _hold(r, (k, v), offset), *fetched)
        return tuple(tuple(p) for p in zip(*held))

    def _update_past_ring(self, keys, values):
        """``RotatingKVCache._update_past_ring`` on each quantized part, which
        is a ring of that layout itself: attention sees the last
        ``max_size - 1`` tokens and the new ones; the ring keeps the newest."""
        seen = self._per_part(
            lambda ring, k, v: (ring._update_past_ring(k, v), ring.checkpoints),
            keys,
            values,
        )
        seen, taken = zip(*seen)
        if self.checkpoint_every:
            self._join_checkpoints(taken)
        return tuple(tuple(p) for p in zip(*seen))

    def update_and_fetch(self, keys, values):
        B, H, S, _ = keys.shape
        if self.keys is not None and (B, H) != self.keys[0].shape[:2]:
            raise ValueError(
                "QuantizedRotatingKVCache holds (batch, heads)="
                f"{self.keys[0].shape[:2]}, got {(B, H)}"
            )
        keys, values = _quantize_update(self, keys, values)
        if self.keys is None or self.keys[0].shape[2] != self.max_size:
            self._allocate(keys, values)
        if self.offset + S <= self.max_size:
            prev = self.offset
            self.keys = tuple(_put(c, x, [prev]) for c, x in zip(self.keys, keys))
            self.values = tuple(_put(c, x, [prev]) for c, x in zip(self.values, values))
            self.offset += S
            self._idx = self.offset
            return self._hold_parts(self.keys_and_values())
        if S > 1:
            return self._update_past_ring(keys, values)
        if self._idx == self.max_size:
            self._idx = self.keep
        for c, x in zip(self.keys + self.values, keys + values):
            c[:, :, self._idx : self._idx + 1] = x
        self.offset += 1
        self._idx += 1
        return self._hold_parts((self.keys, self.values))

    def keys_and_values(self):
        if self.offset < self.keys[0].shape[2]:
            return tuple(
                tuple(x[..., : self.offset, :] for x in parts)
                for parts in (self.keys, self.values)
            )
        return self.keys, self.values

    @property
    def state(self):
        keys, values = self.keys, self.values
        if keys is not None and self.offset < keys[0].shape[2]:
            keys, values = self.keys_and_values()
        state = (
            keys,
            values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            self.group_size,
            self.bits,
            self.dtype,
            self.head_dims,
        )
        if self.slack:
            undo = self._undo_keys, self._undo_values
            state += (*undo, self.slack, self._lo, self._hi)
        return state

    @state.setter
    def state(self, v):
        RotatingKVCache.state.fset(self, (*v[:6], *v[10:]))
        self.group_size, self.bits, self.dtype, head_dims = v[6:10]
        for name in ("keys", "values", "_undo_keys", "_undo_values"):
            x = getattr(self, name)
            setattr(self, name, None if x is None else tuple(x))
        self.head_dims = None if head_dims is None else tuple(head_dims)

    @staticmethod
    def _check_state(v):
        if len(v) not in (10, 15):
            raise ValueError(
                f"{len(v)} state items, a QuantizedRotatingKVCache has 10 or 15"
            )
        _check_quantized(*v[:2], *v[6:10])
        if len(v) == 15:
            _check_quantized(*v[10:12], *v[6:10])
        # The ring's rules, on the packed parts (one slot per token, as the ring).
        packed = [None if x is None else x[0] for x in (*v[:2], *v[10:12])]
        RotatingKVCache._check_state((*packed[:2], *v[2:6], *packed[2:], *v[12:]))

    def trim(self, n):
        """``RotatingKVCache.trim`` on each quantized part; raises, changing
        nothing, where it cannot trim ``n`` exactly."""
        if self.keys is None:
            return RotatingKVCache.trim(self, n)
        try:
            n = self._per_part(RotatingKVCache.trim, n)[0]
        except ValueError as e:  # a part's refusal, said in this class's name
            raise ValueError(str(e).replace("RotatingKVCache", type(self).__name__, 1))
        self.checkpoints = [c for c in self.checkpoints if c.offset <= self.offset]
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Already quantized: ``generate_step`` asks again after every step."""
        if bits != self.bits:
            raise ValueError(
                f"QuantizedRotatingKVCache holds {self.bits}-bit tokens, "
                f"asked for {bits} bits"
            )
        return self

    def to_kv_cache(self):
        """The ring dequantized into a ``RotatingKVCache`` of the original dtype."""
        cache = RotatingKVCache(
            self.max_size,
            self.keep,
            self.slack,
            self.checkpoint_every,
            self.max_checkpoints,
        )
        if self.keys is None or self.offset == 0:
            return cache
        dtype = getattr(mx, self.dtype)
        held = self.keys_and_values()
        if self._undo_keys is not None:
            held += (self._undo_keys, self._undo_values)
        out = []
        for parts, dim in zip(held, self.head_dims * 2):
            x = mx.dequantize(*parts, group_size=self.group_size, bits=self.bits)
            out.append(x[..., :dim].astype(dtype))
        cache.keys, cache.values, *undo = out
        if undo:
            cache._undo_keys, cache._undo_values = undo
        cache.offset, cache._idx = self.offset, self._idx
        cache._lo, cache._hi = self._lo, self._hi
        cache.checkpoints = self.checkpoints  # quantized: dequantized if restored
        return cache

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        mask = RotatingKVCache.make_mask(self, N, window_size, return_array)
        # One decode query: (1, slots), as quantized attention takes query rows.
        return mask[None] if isinstance(mask, mx.array) and mask.ndim == 1 else mask

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        held = (
            self.keys
            + self.values
            + (self._undo_keys or ())
            + (self._undo_values or ())
        )
        return sum(x.nbytes for x in held + (*self.checkpoints,))
