"""Preallocated, in-place ``BatchRotatingKVCache``.

The batch twin of ``rotating_prealloc``: the ``max_size`` ring is allocated once
per batch composition (``merge``, ``extend`` and ``filter`` change the number of
rows, so they build a new ring); decode and chunks within the ring write into it
in place. A chunk past the ring, and ``finalize`` after right padding, leave a
ring of the same size copied from slices (each row's right-padding roll is known
on the host): nothing is gathered. Chunks of ``PIPELINE_MIN`` (1,024) tokens or
more are pipelined a layer at a time (``_pipeline``), nothing else is evaluated.

Rows keep their first ``keep`` tokens like ``RotatingKVCache(keep=...)`` does
(upstream's batch cache has no ``keep``). With ``keep=0`` the saved state is
upstream's eight items, which plain mlx-lm loads; ``keep`` is a ninth item only
when it is not 0. Once every row holds ``keep`` tokens (counted on the host, no
sync) updates skip the sinks (docs/benchmarks.md: their small ops doubled a
decode step), and writing them never reads the ring, which would make MLX copy it.

Also fixed: a multi-token update after decode has wrapped gets a mask that
accounts for the column it drops (upstream's hid a left-padded row's oldest
token), a loaded cache can be updated (upstream: ``AttributeError: _lengths``),
and ``trim`` rejects negative counts and never makes a row's offset negative.

A batch with a ``slack`` keeps an undo ring over its columns while it decodes
(``_hold``), reset by right padding and ``trim``; rows bring their slack and
take their evicted tokens back out (``batch_rotating_rows``). A batch takes
window checkpoints as rings do (``rotating_prealloc``; helpers: the new
module ``mlx_lm/models/batch_ring_buffer.py``), keeping one where any row's
own spread keeps it: a row of a right-padded call spreads its checkpoints
back from its own last token, not the batch's (``real_rows``, on the host).
"""

from typing import TYPE_CHECKING, List, Optional

import mlx.core as mx

from .._newmods import defined, hooks, new_module
from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.batch_ring_buffer import _batch_checkpoints, _rolled_ring
    from mlx_lm.models.ring_buffer import (
        _check_update,
        _hold,
        _pipeline,
        _put,
        _sinks_and_newest,
    )

# The state check, a function of the new module that the class binds.
_check_batch_ring_state = defined(
    "mlx_lm.models.batch_ring_buffer", "_check_batch_ring_state"
)


# Written as it reads in mlx_lm/models/cache.py, and run there.
class BatchRotatingKVCache:
    # Ring of ``max_size`` slots. Slots ``[0, keep)`` hold each row's first
    # ``keep`` real tokens (its sinks); slots ``[keep, max_size)`` a window of
    # ``R = max_size - keep`` columns of the shared timeline, one token per row,
    # ``n = min(_offset, R)`` of them live:
    # - ``_offset <= R``: column ``t`` at slot ``keep + t``, ``_idx == keep + _offset``;
    # - ``_offset > R``: the oldest live column at slot ``_idx`` (``keep`` when
    #   ``_idx == max_size``).
    # ``left_padding[b]``: index among the live columns, oldest first, of row
    # ``b``'s first real token (negative once evicted); ``offset[b]``: real
    # tokens row ``b`` has seen. A row's first ``keep`` tokens also sit in the
    # window, masked: attention reads them from the sinks. ``_fewest``: at
    # most the fewest real tokens of any row, known without a sync; once it
    # reaches ``keep`` every row's sinks are full and updates skip them.
    # As RotatingKVCache's (``__init__`` sets them; ``merge`` takes its rows').
    checkpoint_every = 0
    max_checkpoints = 8
    checkpoints = ()
    # A checkpoint's rows with tokens at it, on the host (right padding gives
    # a row none past its own): () for every row.
    real_rows = ()
    _check_state = staticmethod(_check_batch_ring_state)
    # Per row, the checkpoints it brought (``merge``, ``extend``): windows at
    # its own positions; the batch's own, taken since, are ``checkpoints``.
    row_checkpoints = ()

    def __init__(
        self,
        max_size,
        left_padding: List[int],
        keep: int = 0,
        checkpoint_every: int = 0,
        max_checkpoints: int = 8,
    ):
        if max_size < 1:
            raise ValueError(
                f"BatchRotatingKVCache: max_size must be >= 1, got {max_size}"
            )
        self.keys = None
        self.values = None

        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-l for l in left_padding])
        self._fewest = -max(left_padding, default=0)

        self.max_size = max_size
        self.keep = min(keep, max_size - 1)  # as in RotatingKVCache
        self._idx = keep
        self._offset = 0
        self.rotated = False

        # Lengths for right_padded inputs to make sure that padding tokens do
        # not evict valid tokens.
        self._lengths = None
        self._reset_undo(0)
        self.checkpoint_every, self.max_checkpoints = checkpoint_every, max_checkpoints

    @property
    def left_padding(self):
        # Columns dropped by decode steps past the ring are counted on the host
        # and taken off when it is read (the mask reads layer 0's once a step):
        # no subtraction a layer and step, none left lazy where nobody reads.
        if self._dropped:
            self._left_padding = self._left_padding - self._dropped
            self._dropped = 0
        return self._left_padding

    @left_padding.setter
    def left_padding(self, v):
        self._left_padding, self._dropped = v, 0

    def _reset_undo(self, slack):
        """Column ``t`` is position ``keep + t`` of ``RotatingKVCache``'s undo
        ring (``_hold``): rows extracted with their evicted tokens can trim
        back ``slack`` after a wrap. Whatever changes the columns resets it."""
        self.slack = slack
        self._undo_keys = self._undo_values = None
        self._lo = self._hi = 0

    def _runs(self):
        """Slot ranges of the live columns, oldest first."""
        window = self.max_size - self.keep
        if self._offset <= window:
            return [(self.keep, self.keep + self._offset)]
        idx = self._idx if self._idx < self.max_size else self.keep
        return [(idx, self.max_size), (self.keep, idx)]

    def _allocate(self, keys, values, slots=None):
        """Allocate the ring (or its first ``slots``), moving in any state
        saved in another layout."""
        B, H, _, Dk = keys.shape
        slots = self.max_size if slots is None else slots
        k = mx.zeros((B, H, slots, Dk), keys.dtype)
        v = mx.zeros((B, H, slots, values.shape[3]), values.dtype)
        if self.keys is not None and self.keep:  # our own, saved linear
            k, v = _put(k, self.keys, [0]), _put(v, self.values, [0])
        elif self.keys is not None:  # upstream's layout, rolled or longer
            self._temporal_order()
            n = min(self._idx, self.max_size)
            k = _put(k, self.keys[..., self._idx - n : self._idx, :], [0])
            v = _put(v, self.values[..., self._idx - n : self._idx, :], [0])
            self.left_padding -= self._idx - n
            self._idx = n
        self.keys, self.values = k, v
        self.rotated = False

    def _update_sinks(self, keys, values):
        """Copy the new tokens that are among a row's first ``keep`` to its sinks."""
        S, n = keys.shape[2], min(self._offset, self.max_size - self.keep)
        real = self.offset + S
        if self._lengths is not None:
            real = mx.minimum(real, self._lengths)
        sink = mx.arange(self.keep)[None]
        column = sink + self.left_padding[:, None] - n
        take = ((column >= 0) & (column < S) & (sink < real[:, None]))[:, None, :, None]
        column = mx.clip(column, 0, S - 1)[:, None, :, None]
        # Unless the update runs past the ring, a row's sinks that take no
        # token are written to the slot the update writes next: reading no
        # slot, the ring is written in place (MLX copies a buffer that a
        # pending op still reads).
        within = S == 1 or self._offset + S <= self.max_size - self.keep
        slot = self.keep if self._idx == self.max_size else self._idx
        for name, new in (("keys", keys), ("values", values)):
            old, new = getattr(self, name), mx.take_along_axis(new, column, axis=2)
            if within:
                slots = mx.where(take, sink[..., None], slot)
                setattr(self, name, mx.put_along_axis(old, slots, new, axis=2))
            else:
                sinks = mx.where(take, new, old[..., : self.keep, :])
                setattr(self, name, _put(old, sinks, [0]))

    @staticmethod
    def _columns(runs, lo, hi):
        """Source ranges of columns ``[lo, hi)`` of ``runs`` laid end to end."""
        t = 0
        for a, b in runs:
            x, y = max(lo, t), min(hi, t + b - a)
            if x < y:
                yield a + x - t, a + y - t
            t += b - a

    def _rolls(self):
        """Each row's roll of the right padding given since the last roll
        (``_padded``: lengths, tokens rolled, tokens given)."""
        lengths, rolled, consumed = self._padded
        return [max(0, consumed - l) - max(0, rolled - l) for l in lengths]

    def _update_past_ring(self, keys, values):
        """A multi-token update past the window: attention sees the sinks, the
        last ``R - 1`` columns and the new ones; the ring becomes a copy of the
        sinks and the newest ``R`` columns."""
        window = self.max_size - self.keep
        n = min(self._offset, window)
        m = min(n, window - 1)
        S = keys.shape[2]
        # Live slots, oldest first; a full window's oldest (``n - m``, at most
        # one) drops out of attention. With right padding it goes first in the
        # copy, unseen: padding rolls over it too, and it may be a short row's
        # first token.
        live = self._runs()
        drop = n - m if self._lengths is not None else 0
        lead = self.keep  # the sinks' columns before the live ones in ``seen``
        if n == 0:
            # Nothing live: attention reads the update as it is, each row's
            # sinks in place (``make_mask``), no copy of it with the sinks
            # ahead (a ring's worth a layer in flight, a BatchGenerator's
            # first chunk).
            seen, lead = [keys, values], 0
            sinks = [c[..., : self.keep, :] for c in (self.keys, self.values)]
        else:
            runs = [
                *self._columns(live, n - m - drop, n - m),
                (0, self.keep),
                *self._columns(live, n - m, n),
            ]
            seen = [
                mx.concatenate([c[..., a:b, :] for a, b in runs if a < b] + [x], 2)
                for c, x in ((self.keys, keys), (self.values, values))
            ]
            sinks = [c[..., drop : drop + self.keep, :] for c in seen]
        self._offset += S
        self.offset = self.offset + S
        if self._lengths is None:
            self.keys, self.values = (
                _sinks_and_newest(k, c, self.max_size) for k, c in zip(sinks, seen)
            )
        else:  # dropped, live and new columns, the sinks after the dropped
            runs = [(0, drop), (drop + lead, seen[0].shape[2])]
            self.keys, self.values = _rolled_ring(self, seen, sinks, runs, window)
        self._idx = self.max_size
        self.rotated = False
        self.left_padding -= n + S - window
        if self.checkpoint_every:
            _batch_checkpoints(self, sinks, [c[..., drop + lead :, :] for c in seen], S)
        # Measured necessary: a BatchGenerator prefill (Llama-8B shape, H100, 4
        # prompts of 1500-3000 tokens, ring 2048) peaked at 11.1 GiB unpipelined
        # (the unbounded batch: 10.3), pipelined at 3.0 in the unbounded batch's
        # time (0.373 s against 0.372); evaluated every layer 2.1 GiB, 9% later.
        _pipeline((*seen, self.keys, self.values), S)
        if self._lengths is not None:
            self._reset_undo(self.slack)
            return _hold(
                self, tuple(c[..., drop:, :] for c in seen), self._offset + self.keep
            )
        first = self._offset - S - m + self.keep
        source = (*seen, first, lambda p: p - first + lead)
        return _hold(self, tuple(seen), self._offset + self.keep, source)

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if S == 1 and self._lengths is not None:
            raise RuntimeError(
                "finalize() should be called before decoding with BatchRotatingKVCache"
            )
        _check_update(self, keys, values)
        if self.keys is None and S > self.max_size - self.keep:
            # Past an empty ring: only its sinks are read, then it is copied
            # anew (a whole ring a layer less in flight).
            self._allocate(keys, values, self.keep)
        elif self.keys is None or self.keys.shape[2] != self.max_size:
            self._allocate(keys, values)
        if self.keep and self._fewest < self.keep:
            self._update_sinks(keys, values)
        if self._lengths is None:  # else right padding: finalize() counts
            self._fewest += S
        else:
            lengths, rolled, consumed = self._padded
            self._padded = (lengths, rolled, consumed + S)
        if self._offset + S <= self.max_size - self.keep:
            prev = self._idx
            self.keys = _put(self.keys, keys, [prev])
            self.values = _put(self.values, values, [prev])
            _pipeline((self.keys, self.values), S)
            self._offset += S
            self.offset = self.offset + S
            self._idx += S
            return _hold(self, self.keys_and_values(), self._offset + self.keep)
        if S > 1:
            return self._update_past_ring(keys, values)
        if self._idx == self.max_size:
            self._idx = self.keep
        self.rotated = True
        self._dropped += 1  # taken off ``left_padding`` when it is read
        # Indexed without an ellipsis: less host time a layer and step.
        self.keys[:, :, self._idx : self._idx + 1] = keys
        self.values[:, :, self._idx : self._idx + 1] = values
        self._offset += 1
        self.offset = self.offset + 1
        self._idx += 1
        return _hold(self, (self.keys, self.values), self._offset + self.keep)

    def keys_and_values(self):
        if self._offset < self.max_size - self.keep:
            end = self.keep + self._offset
            return self.keys[..., :end, :], self.values[..., :end, :]
        return self.keys, self.values

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(
                    "Left padding can only be added to an empty BatchRotatingKVCache"
                )
            self._fewest -= max(left_padding, default=0)
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding

        if right_padding is not None and max(right_padding) > 0:
            self._lengths = mx.array(lengths) + self.offset
            self._padded = (list(lengths), 0, 0)  # and the tokens since, on the host

    def finalize(self):
        if self._lengths is not None:
            # A chunk past the ring has rolled the padding given so far: with
            # nothing left to roll, the ring is in order as it stands.
            if self.keys is not None and any(self._rolls()):
                n = min(self._offset, self.max_size - self.keep)
                held = (self.keys, self.values)
                sinks = [c[..., : self.keep, :] for c in held]
                self.keys, self.values = _rolled_ring(
                    self, held, sinks, self._runs(), n
                )
                self._idx = self.keep + n
                self.rotated = False
                self._reset_undo(self.slack)
            # Sinks are written until now: the rows' new tokens count from here.
            self._fewest += min(self._padded[0])
            self._lengths = None

    @property
    def state(self):
        k, v = self.keys, self.values
        if k is not None and self.keep + self._offset < k.shape[2]:
            end = self.keep + self._offset
            k, v = k[..., :end, :], v[..., :end, :]
        state = (k, v, self.offset, self.left_padding, self.max_size, self._offset)
        state += (self._idx, self.rotated)
        # With keep=0 the layout is upstream's: save its 8 items, which it reads.
        return state + (self.keep,) if self.keep else state

    @state.setter
    def state(self, v):
        # Upstream's state has no ``keep``.
        *s, self.keep = (*v, 0) if len(v) == 8 else v
        self.keys, self.values, self.offset, self.left_padding = s[:4]
        self.max_size, self._offset, self._idx, self.rotated = s[4:]
        self._lengths = None
        self._fewest = min(self.offset.tolist(), default=0)
        self._reset_undo(0)
        if self.keys is not None and self.keys.shape[2] > self.max_size:
            # Upstream's ring right after a multi-token update, in temporal
            # order: keep its newest max_size columns before any mask is made.
            drop = self.keys.shape[2] - self.max_size
            self.keys = self.keys[..., drop:, :]
            self.values = self.values[..., drop:, :]
            self.left_padding = self.left_padding - drop
            self._idx = self.max_size

    @property
    def nbytes(self):
        # The undo ring and checkpoints too: a server's prompt cache budgets by it.
        held = self.keys, self.values, self._undo_keys, self._undo_values
        held += (*self.checkpoints, *(c for r in self.row_checkpoints for c in r))
        return sum(x.nbytes for x in held if x is not None)

    def is_trimmable(self):
        return self._offset < self.max_size - self.keep

    def trim(self, n):
        name = type(self).__name__
        if not isinstance(n, int):
            raise ValueError(f"{name}.trim: n must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"{name}.trim: n must be >= 0, got {n}")
        if n and self._offset > self.max_size - self.keep:
            raise ValueError(
                f"{name}.trim: the ring has wrapped (offset "
                f"{self._offset} > {self.max_size - self.keep} columns), its "
                "oldest tokens are gone; check is_trimmable() first"
            )
        n = min(self._offset, n)
        self._offset -= n
        self._idx = self.keep + self._offset
        self._reset_undo(self.slack)
        self.offset = mx.maximum(self.offset - n, 0)
        self._fewest = max(self._fewest - n, 0)
        self.left_padding = mx.minimum(self.left_padding, self._offset)
        return n

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        # A row sees its sinks up to its own position, and the real columns
        # past its sinks among the ``window - keep`` newest; ``window`` is the
        # model's ``window_size`` capped at the ring, as in RotatingKVCache.
        window = min(window_size or self.max_size, self.max_size) - self.keep
        columns = self.max_size - self.keep
        n = min(self._offset, columns)
        if n == 0 and N > columns:
            # The update alone, its first ``keep`` real columns the sinks
            # (``_update_past_ring``).
            left_padding = mx.expand_dims(self.left_padding, (1, 2, 3))
            column = mx.arange(N)
            linds = column[:, None]
            mask = (column <= linds) & (column >= left_padding)
            sinks = column < left_padding + self.keep
            return mask & ((linds < column + window) | sinks)
        wraps = N == 1 and self._offset >= columns
        if wraps:
            # One token written over the oldest column of the full window.
            offset, dropped = columns - 1, 1
        elif self._offset + N > columns:
            # Attention sees the last ``R - 1`` columns, then the new ones.
            offset = min(n, columns - 1)
            dropped = n - offset
        else:
            offset, dropped = self._offset, 0
        left_padding = mx.expand_dims(self.left_padding - dropped, (1, 2, 3))
        slot = mx.arange(self.keep + offset + N)
        if wraps:
            idx = self._idx if self._idx < self.max_size else self.keep
            rinds = (slot - idx - 1) % columns
        else:
            rinds = slot - self.keep
        linds = mx.arange(offset, offset + N)[:, None]
        mask = (linds >= rinds) & (linds < rinds + window)
        mask = mask & (rinds >= left_padding + self.keep)
        if self.keep:
            sinks = (slot < self.keep) & (slot <= linds - left_padding)
            mask = sinks | (mask & (slot >= self.keep))
        return mask


PATCH = Patch(
    "batch_rotating_prealloc",
    "BatchRotatingKVCache: allocate the ring once, write in place, fix its masks",
    new_module("mlx_lm.models.batch_ring_buffer")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.batch_ring_buffer",
        "_batch_checkpoints",
        "_check_batch_ring_state",
        "_rolled_ring",
    )
    + targets(
        "mlx_lm.models.cache:BatchRotatingKVCache",
        BatchRotatingKVCache,
        removes=("_trim", "_update_concat", "_update_in_place"),
    ),
)
