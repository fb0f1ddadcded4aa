"""``BatchRotatingKVCache`` rows move between batches whole.

Upstream's ``merge``, ``extend`` and ``extract`` know no ``keep`` or
``slack``: ``merge`` of ``RotatingKVCache(keep=...)`` rows builds a
``keep=0`` batch (so batched rows of ``generate --max-kv-size`` diverge from
their single streams), and ``extend`` and ``extract`` take a batch's sinks
for window columns. ``extract`` also fails on an empty cache
(``TypeError``), and ``extend`` takes a batch of another ``max_size``
silently.

Here rows move by slices, not gathers: ``merge`` keeps each row's sinks and
newest ``max_size - keep`` tokens as columns of a whole ring (no
reallocation at the next update), ``extend`` copies both batches' sinks and
live columns into one, and ``extract`` returns a ``RotatingKVCache`` with the
row's ``keep`` that owns its memory (an empty one from an empty batch).
``merge`` and ``extend`` refuse caches of another ``max_size`` or ``keep``
(``merge`` also other heads, head dim or dtype) with a ``ValueError`` naming
them; ``filter`` and ``extract`` refuse rows out of range (``IndexError``).

Rows keep their ``slack`` (``RotatingKVCache(slack=n)``): ``merge`` gives
the batch the largest of its rows', whose undo ring fills while it decodes,
and ``extract`` hands each row its evicted tokens, so a row taken out after
a wrap can be trimmed back (a server's prompt cache reuses it). ``extend``
resets the undo ring; it fills again over the next decode steps. Rows keep
their window checkpoints (``batch_rotating_prealloc``): those a row brings
to ``merge`` and those its batch took, which ``extend`` cuts out per row,
come back out with it from ``extract``; ``to_quantized`` converts them all.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.cache import RotatingKVCache
    from mlx_lm.models.ring_buffer import _copy_runs, _put, _spread

# The class body is written as it reads in mlx_lm/models/cache.py and runs
# there (``targets`` pastes it): ``RotatingKVCache``, ``_copy_runs``, ``_put``
# and ``_spread`` are that module's; ``_runs``, ``_columns`` and ``_reset_undo``
# the ring's own (``batch_rotating_prealloc``).


class BatchRotatingKVCache:
    def filter(self, batch_indices):
        """
        In-place filter to keep just the given indices in the cache.
        """
        B, rows = self.offset.shape[0], batch_indices
        if isinstance(rows, mx.array):
            rows = rows.tolist()
        if not all(-B <= i < B for i in rows):  # on the host: no sync
            raise IndexError(
                f"BatchRotatingKVCache.filter: rows {rows} out of range for {B} rows"
            )
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        if self._undo_keys is not None:
            self._undo_keys = self._undo_keys[batch_indices]
            self._undo_values = self._undo_values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        for c in self.checkpoints:
            c.filter(batch_indices)
        if self.real_rows:  # a checkpoint's
            self.real_rows = tuple(self.real_rows[i] for i in rows)
        if self.row_checkpoints:
            self.row_checkpoints = [self.row_checkpoints[i] for i in rows]

    def extend(self, other):
        """
        In-place extend this cache with the other cache.
        """
        if (other.max_size, other.keep) != (self.max_size, self.keep):
            raise ValueError(
                "BatchRotatingKVCache can only extend with a cache of the same "
                f"max_size and keep, got {(self.max_size, self.keep)} and "
                f"{(other.max_size, other.keep)}"
            )
        self._fewest = min(self._fewest, other._fewest)
        # Each row's checkpoints go along (the batch's, cut out per row)
        rows = self._checkpoints_by_row() + other._checkpoints_by_row()
        self.row_checkpoints, self.checkpoints = (rows if any(rows) else ()), ()
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        full = self if self.keys is not None else other
        _, H, _, Dk = full.keys.shape
        Dv = full.values.shape[3]
        caches = (self, other)
        live = [min(c._offset, c.max_size - c.keep) for c in caches]
        n = max(live)
        B = sum(c.offset.shape[0] for c in caches)
        keys = mx.zeros((B, H, self.max_size, Dk), full.keys.dtype)
        values = mx.zeros((B, H, self.max_size, Dv), full.values.dtype)
        row = 0
        for c, l in zip(caches, live):
            if c.keys is not None:  # slices, not a gather (see _rolled_ring)
                keys = _put(keys, c.keys[..., : c.keep, :], [row, 0], (0, 2))
                values = _put(values, c.values[..., : c.keep, :], [row, 0], (0, 2))
                at = self.keep + n - l
                for a, b in c._runs():
                    keys = _put(keys, c.keys[..., a:b, :], [row, at], (0, 2))
                    values = _put(values, c.values[..., a:b, :], [row, at], (0, 2))
                    at += b - a
            row += c.offset.shape[0]
        self.left_padding = mx.concatenate(
            [c.left_padding + n - l for c, l in zip(caches, live)]
        )
        self.offset = mx.concatenate([c.offset for c in caches])
        self.keys, self.values = keys, values
        self._offset = max(c._offset for c in caches)
        self._idx = self.keep + n
        self.rotated = False
        self._reset_undo(max(c.slack for c in caches))

    def extract(self, idx):
        B = self.offset.shape[0]
        if not -B <= idx < B:
            raise IndexError(
                f"BatchRotatingKVCache.extract: row {idx} out of range for {B} rows"
            )
        cache = RotatingKVCache(
            self.max_size,
            self.keep,
            self.slack,
            self.checkpoint_every,
            self.max_checkpoints,
        )
        # One sync for the row and the checkpoints it takes out of the batch
        mx.eval([(c.left_padding, c.offset) for c in (self, *self.checkpoints)])
        cache.offset = self.offset.tolist()[idx]
        if self.keys is None:
            cache.offset = 0
            return cache
        sinks = min(self.keep, cache.offset)
        padding = max(0, self.left_padding.tolist()[idx] + self.keep)
        n = min(self._offset, self.max_size - self.keep)
        runs = [(0, sinks), *self._columns(self._runs(), padding, n)]
        # A concatenation copies: the row does not pin the batch's buffers.
        cache.keys, cache.values = (
            mx.concatenate([c[idx : idx + 1, :, a:b] for a, b in runs], axis=2)
            for c in (self.keys, self.values)
        )
        cache._idx = sum(b - a for a, b in runs)
        if self._undo_keys is not None:
            # Row position ``p`` is column ``p + first``.
            first = self._offset - cache.offset
            lo, hi = (
                max(self._lo - self.keep - first, self.keep),
                self._hi - self.keep - first,
            )
            U = 2 * self.slack
            pairs = [(p % U, (p + first + self.keep) % U) for p in range(lo, hi)]
            for name in ("_undo_keys", "_undo_values") if lo < hi else ():
                undo = getattr(self, name)[idx : idx + 1]
                setattr(cache, name, _copy_runs(mx.zeros_like(undo), undo, pairs))
            cache._lo, cache._hi = (lo, hi) if lo < hi else (0, 0)
        cache.checkpoints = self._row_checkpoints(idx, cache.offset)
        return cache

    def _row_checkpoints(self, idx, offset):
        """Row ``idx``'s checkpoints (it holds ``offset`` tokens): those it
        brought and the batch's cut out for it, past its sinks, spread over
        its own positions (``_spread``), scheduled (pinning none of the
        batch's buffers; no wait, on the serving path)."""
        taken = list(self.row_checkpoints[idx]) if self.row_checkpoints else []
        taken += [c.extract(idx) for c in self.checkpoints]
        if not taken:
            return []
        held = {c.offset: c for c in taken if self.keep < c.offset <= offset}
        every, most = self.checkpoint_every, self.max_checkpoints
        taken = [held[p] for p in _spread(sorted(held), every, most)]
        mx.async_eval([c.state for c in taken])
        return taken

    def _convert_checkpoints(self, cache, convert):
        """``cache``, this batch in another form (``to_quantized``), gets its
        checkpoints, the batch's and its rows', each ``convert(checkpoint)``."""
        cache.checkpoints = [convert(c) for c in self.checkpoints]
        cache.row_checkpoints = [[convert(c) for c in r] for r in self.row_checkpoints]

    def _checkpoints_by_row(self):
        """``_row_checkpoints`` of every row."""
        B = self.offset.shape[0]
        if not (self.checkpoints or self.row_checkpoints):
            return [[] for _ in range(B)]
        offsets = self.offset.tolist()
        return [self._row_checkpoints(b, offsets[b]) for b in range(B)]

    @classmethod
    def merge(cls, caches):
        max_size, keep = caches[0].max_size, caches[0].keep
        if not all((c.max_size, c.keep) == (max_size, keep) for c in caches):
            raise ValueError(
                "BatchRotatingKVCache can only merge caches with the same maximum "
                f"size and keep, got {[(c.max_size, c.keep) for c in caches]}"
            )
        full = [c for c in caches if c.keys is not None]
        if len({(c.keys.shape[1], c.keys.shape[3], c.keys.dtype) for c in full}) > 1:
            raise ValueError(
                "BatchRotatingKVCache can only merge caches with the same heads, "
                f"head dim and dtype, got {[(c.keys.shape, c.keys.dtype) for c in full]}"
            )
        # Each row keeps its sinks and its newest ``R`` tokens as columns.
        columns = [min(c.offset, max_size - keep) for c in caches]
        n = max(columns)
        cache = cls(max_size, [0] * len(caches), keep)
        cache._reset_undo(max(c.slack for c in caches))
        cache.checkpoint_every = max(c.checkpoint_every for c in caches)
        cache.max_checkpoints = max(c.max_checkpoints for c in caches)
        if n == 0:
            return cache
        _, H, _, Dk = full[0].keys.shape
        Dv = full[0].values.shape[3]
        shape = (len(caches), H, max_size)
        keys = mx.zeros((*shape, Dk), full[0].keys.dtype)
        values = mx.zeros((*shape, Dv), full[0].values.dtype)
        for i, (l, c) in enumerate(zip(columns, caches)):
            if l:
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
                s = min(keep, c.offset)
                keys = _put(keys, k[..., :s, :], [i, 0], (0, 2))
                values = _put(values, v[..., :s, :], [i, 0], (0, 2))
                keys = _put(keys, k[..., -l:, :], [i, keep + n - l], (0, 2))
                values = _put(values, v[..., -l:, :], [i, keep + n - l], (0, 2))
        cache.left_padding = mx.array([n - c.offset for c in caches])
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset for c in caches])
        cache._fewest = min(c.offset for c in caches)
        cache._offset = n
        cache._idx = keep + n
        if any(c.checkpoints for c in caches):  # each row brings its own
            cache.row_checkpoints = [list(c.checkpoints) for c in caches]
        return cache


PATCH = Patch(
    "batch_rotating_rows",
    "BatchRotatingKVCache: rows merge, extend, filter and extract with their "
    "keep, slack and memory",
    targets("mlx_lm.models.cache:BatchRotatingKVCache", BatchRotatingKVCache),
    requires=(
        "mlx_lm.models.cache:BatchRotatingKVCache.__init__",  # keep
        "mlx_lm.models.cache:BatchRotatingKVCache._runs",
        "mlx_lm.models.cache:BatchRotatingKVCache._columns",
        "mlx_lm.models.cache:BatchRotatingKVCache._reset_undo",
        "mlx_lm.models.cache:RotatingKVCache.state",  # keep, slack
    ),
)
