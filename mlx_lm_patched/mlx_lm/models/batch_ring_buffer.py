"""The preallocated ``BatchRotatingKVCache``'s helpers: window checkpoints
and state checks."""

import copy

import mlx.core as mx


def _batch_checkpoints(cache, sinks, columns, S):
    """Keep ``cache`` at each multiple of ``checkpoint_every`` columns this
    update of ``S`` reached; ``columns`` end at the newest. With right
    padding, a row past its tokens there gets none (offset 0), the others
    theirs before their rolls."""
    every, window = cache.checkpoint_every, cache.max_size - cache.keep
    end, pre, count = cache._offset, cache._offset - S, columns[0].shape[2]
    start, lengths, roll = end, None, 0
    if cache._lengths is not None:  # the rows' tokens this call, given
        lengths, _, given = cache._padded
        start, end = end - given, min(end, end - given + max(lengths))
        roll = mx.array([max(0, given - n) for n in lengths])
    taken = [c for c in cache.checkpoints if c._offset <= pre]
    new = []
    positions = range((pre // every + 1) * every, end + 1, every)
    for t in positions[-cache.max_checkpoints :]:
        live, j = min(t, window), t - cache._offset + count
        snap = copy.copy(cache)
        snap.keys, snap.values = (
            mx.concatenate([s, x[..., j - live : j, :]], axis=2)
            for s, x in zip(sinks, columns)
        )
        snap._offset, snap._idx, snap.rotated = t, cache.keep + live, False
        snap.offset = cache.offset + roll - (cache._offset - t)
        if lengths is not None:
            real = mx.array([t - start <= n for n in lengths])
            snap.offset = mx.where(real, snap.offset, 0)
        lp = cache.left_padding - roll + (cache._offset - window)
        snap.left_padding = lp - (t - live)
        snap._undo_keys = snap._undo_values = snap._lengths = None
        snap._lo, snap._hi, snap.checkpoints = 0, 0, ()
        new += [snap.keys, snap.values]
        taken.append(snap)
    cache.checkpoints = taken[-cache.max_checkpoints :]
    if new:  # evaluated with the ring
        cache.keys, cache.values = mx.depends([cache.keys, cache.values], new)
