"""Window checkpoints of rings, taken as a multi-token update passes them.

A wrapped ring (a sliding layer of gemma3-like models, a ``--max-kv-size``
ring) has forgotten its oldest tokens, so a stored prompt cache cannot be
trimmed back past its slack: a request that shares the first 1,200 tokens of
a cached 1,500-token prompt on gemma3_text (window 256) prefilled all 1,240
of its tokens again (issue #28; llama.cpp keeps ``--ctx-checkpoints`` for
the same reason).

A ring made with ``checkpoint_every=n`` (0 takes none) keeps, at each
multiple of ``n`` a multi-token update reaches, a copy of its window in
``checkpoints``, the newest ``max_checkpoints``. A checkpoint is cut from
what attention reads anyway (the sinks, the last window and the chunk), so
nothing is evaluated on its own: the copy is a dependency of the new ring.
It must be a copy: the ring is written in place, and a reference would make
MLX copy the whole ring at the next write. A trim drops the checkpoints past
the new end and ``nbytes`` counts them. Batched rings take them at multiples
of ``n`` columns of the batch's timeline; right padding gives a row none
past its own tokens; rows keep theirs through ``merge``, ``extend``,
``filter`` and ``extract`` (``batch_rotating_rows``). ``LRUPromptCache``
restores the nearest one (``prompt_cache_store``).

The ring patches' classes take these methods (``rotating_prealloc``,
``batch_rotating_prealloc``, ``quantized_ring``); they run in
mlx_lm/models/cache.py.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import copy


class RotatingKVCache:
    def _checkpoint(self, seen, first):
        """Keep the window at each multiple of ``checkpoint_every`` this
        update reaches; ``seen`` holds the sinks, then positions from ``first``."""
        every, keep = self.checkpoint_every, self.keep
        end = first + seen[0].shape[2] - keep
        taken = [c for c in self.checkpoints if c.offset <= self.offset]
        new = []
        positions = range((max(self.offset, keep) // every + 1) * every, end + 1, every)
        for p in positions[-self.max_checkpoints :]:
            j = p - first + keep
            lo = max(keep, j - self.max_size + keep)
            snap = copy.copy(self)
            snap.keys, snap.values = (
                mx.concatenate([x[..., :keep, :], x[..., lo:j, :]], axis=2)
                for x in seen
            )
            snap.offset, snap._idx, snap.checkpoints = p, min(p, self.max_size), ()
            snap._undo_keys = snap._undo_values = None
            snap._lo = snap._hi = 0
            new += [snap.keys, snap.values]
            taken.append(snap)
        self.checkpoints = taken[-self.max_checkpoints :]
        if new:  # evaluated with the ring
            self.keys, self.values = mx.depends([self.keys, self.values], new)


class BatchRotatingKVCache:
    def _checkpoint(self, sinks, columns, S):
        """Keep the batch at each multiple of ``checkpoint_every`` columns
        this update of ``S`` reached; ``columns`` end at the newest. With
        right padding, a row past its tokens there gets none (offset 0), the
        others theirs before their rolls."""
        every, window = self.checkpoint_every, self.max_size - self.keep
        end, pre, count = self._offset, self._offset - S, columns[0].shape[2]
        start, lengths, roll = end, None, 0
        if self._lengths is not None:  # the rows' tokens this call, given
            lengths, _, given = self._padded
            start, end = end - given, min(end, end - given + max(lengths))
            roll = mx.array([max(0, given - n) for n in lengths])
        taken = [c for c in self.checkpoints if c._offset <= pre]
        new = []
        positions = range((pre // every + 1) * every, end + 1, every)
        for t in positions[-self.max_checkpoints :]:
            live, j = min(t, window), t - self._offset + count
            snap = copy.copy(self)
            snap.keys, snap.values = (
                mx.concatenate([s, x[..., j - live : j, :]], axis=2)
                for s, x in zip(sinks, columns)
            )
            snap._offset, snap._idx, snap.rotated = t, self.keep + live, False
            snap.offset = self.offset + roll - (self._offset - t)
            if lengths is not None:
                real = mx.array([t - start <= n for n in lengths])
                snap.offset = mx.where(real, snap.offset, 0)
            lp = self.left_padding - roll + (self._offset - window)
            snap.left_padding = lp - (t - live)
            snap._undo_keys = snap._undo_values = snap._lengths = None
            snap._lo, snap._hi, snap.checkpoints = 0, 0, ()
            new += [snap.keys, snap.values]
            taken.append(snap)
        self.checkpoints = taken[-self.max_checkpoints :]
        if new:  # evaluated with the ring
            self.keys, self.values = mx.depends([self.keys, self.values], new)
