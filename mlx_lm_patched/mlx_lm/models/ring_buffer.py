"""The preallocated ``RotatingKVCache``'s helpers: ring slots, in-place
writes, the undo ring, window checkpoints and their spread, state checks,
and layers' updates pipelined."""

import copy

import mlx.core as mx


def _check_update(cache, keys, values):
    """Raise, changing nothing, if ``keys``/``values`` do not fit ``cache``."""
    ks, vs, held = keys.shape, values.shape, cache.keys
    fits = ks[:3] == vs[:3] and keys.dtype == values.dtype
    if fits and held is not None:  # a decode step's check: a few comparisons
        hk, hv = held.shape, cache.values.shape
        fits = hk[:2] == ks[:2] and (hk[3], hv[3]) == (ks[3], vs[3])
        fits = fits and held.dtype == keys.dtype
    if not fits:
        k, v = (keys, values) if held is None else (held, cache.values)
        raise ValueError(
            f"{type(cache).__name__} holds (batch, heads, key dim, value dim, "
            f"dtype) {(*k.shape[:2], k.shape[3], v.shape[3], k.dtype)}; got keys "
            f"{ks} {keys.dtype} and values {vs} {values.dtype}"
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


def _copy_runs(dst, src, pairs):
    """Set ``dst``'s column ``d`` to ``src``'s column ``s`` (the token axis)
    for each ``(d, s)`` of ``pairs``, in place, a slice a run of consecutive
    columns: an index array a copy made a dozen graph nodes a layer, evaluated
    by a prompt-cache hit's first step (2,328 nodes against 536 without an
    undo ring, 32 layers)."""
    i = 0
    while i < len(pairs):
        (d, s), n = pairs[i], 1
        while i + n < len(pairs) and pairs[i + n] == (d + n, s + n):
            n += 1
        dst[..., d : d + n, :] = src[..., s : s + n, :]
        i += n
    return dst


def _ring_slot(cache, p, offset):
    """The ring slot of position ``p``, ``offset`` tokens in: ``[keep,
    max_size)``, the oldest in the window at ``_idx``."""
    ring = cache.max_size - cache.keep
    return cache.keep + (cache._idx - cache.keep + p - offset) % ring


def _sinks_and_newest(sinks, columns, max_size):
    """A ring of ``max_size`` slots: ``sinks``, then the newest columns of
    ``columns`` (temporal order). Copied from two slices, not gathered: on an
    H100 a gather of the slots took 13% of a 16,000-token prefill (0.708
    against 0.616 s, ring 4096)."""
    start = columns.shape[2] - max_size + sinks.shape[2]
    return mx.concatenate([sinks, columns[..., start:, :]], axis=2)


def _schedule(arrays, chain: list):
    """Schedule ``arrays`` (``mx.async_eval``, with a one-element marker) and
    wait for the marker ``chain`` holds, the arrays scheduled on it before:
    the host stays one step ahead of the device, whose work is not all in
    flight at once. Under ``mx.compile`` it does nothing."""
    marker = arrays[-1][:1, :1, :1, :1] * 1  # owns its one element
    try:
        mx.async_eval(*arrays, marker)
    except ValueError:  # a graph transformation: nothing can be evaluated
        return
    waiting, chain[:] = chain[:], [marker]
    if waiting:
        mx.eval(*waiting)


# The marker of the last layer ``_pipeline`` scheduled.
_previous_layer = []

# The shortest chunk ``_pipeline`` schedules. A shorter one (a chat or agent
# turn) runs lazily, as upstream's: its waits cost more than they save.
PIPELINE_MIN = 1024


def _pipeline(arrays, chunk, chain=_previous_layer):
    """Schedule a layer's update of a ``chunk`` of ``PIPELINE_MIN`` tokens or
    more (its ``arrays``) and wait for the previous layer's: lazily, MLX runs
    every layer's ring copy last and holds every layer's transients until
    then. On an H100 (Llama-8B shape, ring 4096, 2048-token chunks, 16,000
    tokens) a chunk past the ring peaked at 1.1 GiB instead of 6.4, the
    prefill in 0.51 s against 0.53 (an ``mx.eval`` a layer: 20% slower); a
    512-token chunk took 13-20 ms longer pipelined, at the same peak
    (``docs/serving.md``)."""
    if chunk >= PIPELINE_MIN:
        _schedule(arrays, chain)


def _hold(cache, fetched, offset, source=None):
    """Return ``fetched``; if the next update evicts (``offset`` tokens in),
    first copy into ``cache``'s undo ring the next ``slack`` tokens to leave
    the window and the evicted ones not held yet, from ``source``: ``(keys,
    values, first, index)``, positions from ``first`` at ``index(p)``; by
    default the ring. ``fetched`` depends on the copy, so attention does it
    before the next update writes the ring in place."""
    oldest = offset - cache.max_size + cache.keep
    if cache.slack == 0 or oldest < cache.keep or cache._hi > oldest:
        return fetched

    def slot(p):
        return _ring_slot(cache, p, offset)

    keys, values, first, index = source or (cache.keys, cache.values, oldest, slot)
    U = 2 * cache.slack
    if cache._undo_keys is None or cache._undo_keys.shape[:3] != (*keys.shape[:2], U):
        B, H, _, Dk = keys.shape
        cache._undo_keys = mx.zeros((B, H, U, Dk), keys.dtype)
        cache._undo_values = mx.zeros((B, H, U, values.shape[3]), values.dtype)
        cache._lo = cache._hi = 0
    start = max(cache._hi, first, oldest - cache.slack)
    if start > cache._hi:
        cache._lo = start
    cache._hi = min(oldest + cache.slack, offset)
    cache._lo = max(cache._lo, cache._hi - U)
    pairs = [(p % U, index(p)) for p in range(start, cache._hi)]
    _copy_runs(cache._undo_keys, keys, pairs)
    _copy_runs(cache._undo_values, values, pairs)
    return tuple(mx.depends(list(fetched), [cache._undo_keys, cache._undo_values]))


def _spread(positions, every, most):
    """Which of the checkpoints at ``positions`` (ascending) to keep: all
    that ``most`` hold; past that the newest and each one without which a
    branch behind it would go back (to the one kept before it, or the start)
    more than half its distance from the newest plus a slack, ``every`` more
    each pass until ``most`` hold them. New ones stay dense, old ones thin
    geometrically: 8 keep 24,576 tokens at ``every=512``, a branch ``d``
    tokens back within ``d / 2 + 3 * every`` of one. Distances only grow, so
    one dropped is never needed again; the rule reads differences only, so
    a batch row's positions, shifted by its padding, thin alike."""
    kept, slack = list(positions), 0
    while len(kept) > most:
        slack += max(every, 1)
        newest, thinned = kept[-1], [0]
        for p, after in zip(kept, kept[1:]):
            if after - thinned[-1] > (newest - after) / 2 + slack:
                thinned.append(p)
        kept = thinned[1:] + [newest]
    return kept


def _ring_checkpoints(cache, seen, first):
    """Keep ``cache``'s window at each multiple of ``checkpoint_every`` this
    update reaches that ``_spread`` keeps; ``seen`` holds the sinks, then
    positions from ``first``. A checkpoint is a copy cut from what attention
    reads, evaluated with the ring: a reference would make MLX copy the ring
    at its next write."""
    every, keep = cache.checkpoint_every, cache.keep
    end = first + seen[0].shape[2] - keep
    taken = [c for c in cache.checkpoints if c.offset <= cache.offset]
    reached = range((max(cache.offset, keep) // every + 1) * every, end + 1, every)
    kept = _spread(
        [c.offset for c in taken] + list(reached), every, cache.max_checkpoints
    )
    taken = [c for c in taken if c.offset in kept]
    new = []
    for p in (p for p in reached if p in kept):
        j = p - first + keep
        lo = max(keep, j - cache.max_size + keep)
        snap = copy.copy(cache)
        snap.keys, snap.values = (
            mx.concatenate([x[..., :keep, :], x[..., lo:j, :]], axis=2) for x in seen
        )
        snap.offset, snap._idx, snap.checkpoints = p, min(p, cache.max_size), ()
        snap._undo_keys = snap._undo_values = None
        snap._lo = snap._hi = 0
        new += [snap.keys, snap.values]
        taken.append(snap)
    cache.checkpoints = taken
    if new:
        cache.keys, cache.values = mx.depends([cache.keys, cache.values], new)


def _check_ring_state(v):
    """Raise ``ValueError`` saying how the ``RotatingKVCache`` state ``v``
    contradicts itself."""
    if len(v) not in (6, 11):
        raise ValueError(f"{len(v)} state items, a RotatingKVCache has 6 or 11")
    keys, values, offset, keep, max_size, _idx = v[:6]
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
        raise ValueError(f"_idx {_idx} does not fit offset {offset} and keep {keep}")
    if len(v) == 11:
        undo_keys, undo_values, slack, lo, hi = v[6:]
        held = _stored(undo_keys, undo_values)
        if not 0 < slack <= max_size - keep or held not in (0, 2 * slack):
            raise ValueError(
                f"slack {slack} with {held} undo slots: need 0 < slack <= "
                f"max_size - keep and 0 or 2 * slack slots"
            )
        if not (held and keep <= lo <= hi <= lo + held) and lo | hi:
            raise ValueError(f"undo positions [{lo}, {hi}) do not fit its slots")
