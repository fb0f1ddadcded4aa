"""Prompt cache entries: copies of their live state, and the positions an
entry can go back to (a trim, or its rings' checkpoints)."""

import copy
import json
import os

import mlx.core as mx
from mlx.utils import tree_map

from .cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)


def _live_state(cache):
    """``cache.state`` with only the live tokens (a wrapped ring in temporal order)."""
    state = cache.state
    if isinstance(cache, RotatingKVCache) and cache.offset > cache.max_size:
        keys, values = tree_map(cache._temporal_order, state[:2])
        return (keys, values, *state[2:5], cache.max_size, *state[6:])
    if isinstance(cache, (KVCache, ChunkedKVCache)) and cache.keys is not None:
        n = cache.offset - getattr(cache, "start_position", 0)
        return (cache.keys[..., :n, :], cache.values[..., :n, :], *state[2:])
    return state


def _copy_cache(cache, copy_array):
    """A cache like ``cache`` whose arrays are ``copy_array`` of its live
    state's (``mx.array`` copies them, lazily: the caller schedules a whole
    entry at once; ``copy.copy`` shares their buffers). Nothing waits: a
    fetch or an insert never syncs the stream."""
    if not isinstance(cache, _BaseCache):  # not a cache of this module
        return copy.deepcopy(cache)
    new = copy.copy(cache)
    if isinstance(cache, CacheList):
        new.caches = tuple(_copy_cache(c, copy_array) for c in cache.caches)
    else:
        new.state = tree_map(
            lambda x: copy_array(x) if isinstance(x, mx.array) else x,
            _live_state(cache),
        )
    return new


def _restore_points(cache, length):
    """Positions every layer of ``cache``, a cache of ``length`` tokens, can
    go back to: a ring by a checkpoint, or a trim."""
    found = {c.offset for x in cache for c in getattr(x, "checkpoints", ())}
    return sorted(
        p
        for p in found
        if all(
            any(c.offset == p for c in getattr(layer, "checkpoints", ()))
            or can_trim_prompt_cache([layer], length - p)
            for layer in cache
        )
    )


def _back_to(cache, length, at, working=lambda c: c):
    """``cache``, a cache of ``length`` tokens to change, at ``at`` tokens:
    trimmed, or each ring that cannot be replaced by ``working(its
    checkpoint at at)``, which keeps that checkpoint and the older ones (an
    entry made from it branches back there again); ``None`` where it cannot."""
    if can_trim_prompt_cache(cache, length - at):
        trim_prompt_cache(cache, length - at)
        return cache
    if at not in _restore_points(cache, length):
        return None
    for i, layer in enumerate(cache):
        held = {c.offset: c for c in getattr(layer, "checkpoints", ())}
        if at in held:  # a ring of its own: never in its own checkpoints
            cache[i] = copy.copy(working(held[at]))
            cache[i].checkpoints = [c for p, c in held.items() if p <= at]
        else:
            trim_prompt_cache([layer], length - at)
    return cache


def _disk_restore_point(disk, model, tokens, prefix):
    """How many tokens of ``disk``'s entry of ``tokens`` (a
    ``DiskPromptCache``'s) a prompt sharing ``prefix`` of them can reuse:
    ``prefix`` where it trims back there, else the newest position at or
    before it where each of its rings has a checkpoint, as its header says
    (its other layers are taken to trim; a load checks both), or 0. The
    positions are kept (``disk._points``) while the file is the one indexed:
    an agent loop asks of the same entry every turn."""
    name = disk._name(model, tokens)
    _, _, trimmable, size = disk._files[name]  # size: 0 while queued
    if trimmable >= len(tokens) - prefix:
        return prefix
    if disk._points.get(name, (None,))[0] != size:
        try:
            state = disk._pending.get(name)
            if state is None:
                path = os.path.join(disk.directory, name)
                meta = disk._read_header(path, full=True)[1]["__metadata__"]
            else:
                meta = state.metadata
            points = _ring_points(meta)
        except Exception:  # unreadable: none (a load would say why)
            return 0
        disk._points[name] = (size, points)
    return max((p for p in disk._points[name][1] if p <= prefix), default=0)


def _ring_points(metadata) -> frozenset:
    """The positions where every ring of an entry (its file's ``metadata``)
    has a checkpoint."""
    found = {}
    for i, p in json.loads(metadata.get("0.ring_checkpoints", "[]")):
        found.setdefault(i, set()).add(p)
    return frozenset(set.intersection(*found.values()) if found else ())
