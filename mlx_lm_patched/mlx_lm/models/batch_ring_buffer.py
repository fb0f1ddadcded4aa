"""The preallocated ``BatchRotatingKVCache``'s helpers: rings rolled from
slices, window checkpoints and state checks."""

import copy

import mlx.core as mx

from .ring_buffer import _put, _spread, _stored


def _batch_checkpoints(cache, sinks, columns, S):
    """Keep ``cache`` at each multiple of ``checkpoint_every`` columns this
    update of ``S`` reached that a row keeps (``_spread`` of the columns
    where it has tokens); ``columns`` end at the newest. With right padding,
    a row past its tokens there has none (offset 0; ``real_rows`` says so
    on the host), the others theirs before their rolls."""
    every, window = cache.checkpoint_every, cache.max_size - cache.keep
    end, pre, count = cache._offset, cache._offset - S, columns[0].shape[2]
    start, lengths, roll = end, None, 0
    if cache._lengths is not None:  # the rows' tokens this call, given
        lengths, _, given = cache._padded
        start, end = end - given, min(end, end - given + max(lengths))
        roll = mx.array([max(0, given - n) for n in lengths])
    taken = [c for c in cache.checkpoints if c._offset <= pre]
    reached = {
        t: () if lengths is None else tuple(t - start <= n for n in lengths)
        for t in range((pre // every + 1) * every, end + 1, every)
    }
    held = [(c._offset, c.real_rows) for c in taken] + list(reached.items())
    kept = set()
    for b in range(cache.offset.shape[0]):  # each row's own spread
        mine = [t for t, real in held if not real or real[b]]
        kept.update(_spread(mine, every, cache.max_checkpoints))
    taken = [c for c in taken if c._offset in kept]
    new = []
    for t in (t for t in reached if t in kept):
        live, j = min(t, window), t - cache._offset + count
        snap = copy.copy(cache)
        snap.keys, snap.values = (
            mx.concatenate([s, x[..., j - live : j, :]], axis=2)
            for s, x in zip(sinks, columns)
        )
        snap._offset, snap._idx, snap.rotated = t, cache.keep + live, False
        snap.offset = cache.offset + roll - (cache._offset - t)
        if lengths is not None:
            snap.offset = mx.where(mx.array(reached[t]), snap.offset, 0)
        snap.real_rows = reached[t]
        lp = cache.left_padding - roll + (cache._offset - window)
        snap.left_padding = lp - (t - live)
        snap._undo_keys = snap._undo_values = snap._lengths = None
        snap._lo, snap._hi, snap.checkpoints, snap.row_checkpoints = 0, 0, (), ()
        new += [snap.keys, snap.values, snap.offset, snap.left_padding]
        taken.append(snap)
    cache.checkpoints = taken
    # Evaluated with the ring, its offsets too: ``extract`` reads them on
    # the host (left lazy, each layer's extract computed them on the device)
    if new:
        cache.keys, cache.values = mx.depends([cache.keys, cache.values], new)


def _rolled_ring(cache, sources, sinks, runs, count):
    """A new ring from ``sources`` (keys, values): their ``sinks`` (keys,
    values), then the last ``count`` of the columns in
    ``runs`` (source ranges, oldest first) once each row rolls the right
    padding it has consumed to its left. The rolls are known on the host
    (``_padded``): slices, one per run of neighbouring rows rolled alike,
    no gather (MLX's CUDA gather copies a ring at a fraction of a copy's
    speed) and no sync."""
    rolls = cache._rolls()
    lengths, _, consumed = cache._padded
    cache._padded = (lengths, consumed, consumed)
    roll = mx.array(rolls)
    cache.left_padding += roll
    cache.offset = cache.offset - roll
    groups = []  # [first row, end row, roll]: neighbours rolled alike
    for row, r in enumerate(rolls):
        if groups and groups[-1][2] == r:
            groups[-1][1] = row + 1
        else:
            groups.append([row, row + 1, r])
    K = sum(b - a for a, b in runs)
    copies = []  # (rows, source range, ring slot), for keys and values alike
    for lo, hi, r in groups:
        start, at = (K - count - r) % max(K, 1), cache.keep
        wrapped = cache._columns(runs, 0, start + count - K)
        for a, b in [*cache._columns(runs, start, start + count), *wrapped]:
            copies.append((lo, hi, a, b, at))
            at += b - a
    out = []
    for src, sink in zip(sources, sinks):
        B, H, _, D = src.shape
        ring = mx.zeros((B, H, cache.max_size, D), src.dtype)
        ring = _put(ring, sink, [0])
        for lo, hi, a, b, at in copies:
            ring = _put(ring, src[lo:hi, :, a:b], [lo, at], (0, 2))
        out.append(ring)
    return tuple(out)


def _check_batch_ring_state(v):
    """Raise ``ValueError`` saying how the ``BatchRotatingKVCache`` state
    ``v`` contradicts itself."""
    if len(v) not in (8, 9):
        raise ValueError(f"{len(v)} state items, a BatchRotatingKVCache has 8 or 9")
    keys, values, offset, left_padding, max_size, _offset, _idx = v[:7]
    keep = v[8] if len(v) == 9 else 0
    n = _stored(keys, values)
    if max_size < 1 or not 0 <= keep < max_size:
        raise ValueError(
            f"keep {keep} and max_size {max_size}: need 0 <= keep < max_size"
        )
    if not all(isinstance(x, mx.array) and x.ndim == 1 for x in v[2:4]) or (
        offset.size != left_padding.size
    ):
        raise ValueError("offset and left_padding are not one entry per row")
    if _offset < 0:
        raise ValueError(f"_offset {_offset} is negative")
    # The sinks and the live columns once allocated (an empty cache has
    # none); upstream's ring (keep=0) is longer right after a multi-token
    # update, with _idx at the end.
    need = keep + min(_offset, max_size - keep) if n or _offset else 0
    longer = n > max_size and not (keep == 0 and _idx == n)
    if n < need or longer:
        raise ValueError(
            f"{n} slots stored for _offset {_offset}, keep {keep}, max_size {max_size}"
        )
    wrapped = _offset > max_size - keep
    if not (keep <= _idx <= n if wrapped else _idx == keep + _offset):
        raise ValueError(f"_idx {_idx} does not fit _offset {_offset} and keep {keep}")
