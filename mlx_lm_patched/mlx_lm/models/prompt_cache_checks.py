"""Prompt cache files checked before anything is built from them, and the
layout a cache must share with the model it serves."""

import json
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_unflatten

from . import cache as cache_module  # the cache classes a file names
from .cache import CacheList, RotatingKVCache, _BaseCache


def _prompt_cache_from_arrays(
    arrays: Dict[str, Any],
    cache_metadata: Dict[str, str],
    source: str,
    finite: bool = False,
) -> tuple:
    """``(cache, metadata)`` from what ``save_prompt_cache`` wrote; every way
    the file can be malformed is a ``ValueError`` naming ``source``. With
    ``finite``, the caller has checked that no float array holds NaN or
    infinities (the disk tier does as it reads)."""
    try:
        cache_metadata = tree_unflatten(list(cache_metadata.items()))
    except Exception as e:
        raise ValueError(f"{source} has malformed metadata ({e!r})") from None
    if not (isinstance(cache_metadata, list) and len(cache_metadata) == 3):
        raise ValueError(f"{source} is not a prompt cache: it names no cache classes")
    metadata, classes, scalars = cache_metadata
    if not isinstance(metadata, dict) or not isinstance(classes, list):
        raise ValueError(f"{source} has malformed metadata or cache classes")
    for c in classes:
        cls = vars(cache_module).get(c) if isinstance(c, str) else None
        if not (isinstance(cls, type) and issubclass(cls, _BaseCache)):
            raise ValueError(f"{source} names an unknown cache class {c!r}")
    if not (
        isinstance(scalars, list)
        and scalars[:1] == [""]
        and all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x)
            for x in scalars[1:]
        )
    ):
        raise ValueError(f"{source} has a malformed list of scalar entries")
    states = {}
    for key in arrays:
        parts = key.split(".")
        if not (len(parts) >= 2 and all(p.isascii() and p.isdigit() for p in parts)):
            raise ValueError(f"{source} has an array {key!r} that is no state entry")
        states.setdefault(int(parts[0]), set()).add(int(parts[1]))
    for layer, indices in sorted(states.items()):
        if indices != set(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - indices)
            missing = ", ".join(f"{layer}.{i}" for i in missing)
            raise ValueError(f"{source} lacks state arrays {missing}")
    if sorted(states) != list(range(len(classes))):
        raise ValueError(
            f"{source} has states for {len(states)} caches but names {len(classes)}"
        )
    arrays = dict(arrays)
    for pos, kind in scalars[1:]:
        array = arrays.get(pos)
        if array is None:
            raise ValueError(f"{source} names a scalar {pos} it does not hold")
        if kind == "scalar":
            if array.size != 1 or not (
                mx.issubdtype(array.dtype, mx.integer) or array.dtype == mx.bool_
            ):
                raise ValueError(f"{source}: scalar {pos} is not one integer")
            arrays[pos] = array.item()
        elif kind == "string":
            if array.ndim != 1 or not mx.issubdtype(array.dtype, mx.integer):
                raise ValueError(f"{source}: string {pos} is not a list of characters")
            try:
                arrays[pos] = "".join(chr(i) for i in array.tolist())
            except ValueError as e:
                raise ValueError(f"{source}: string {pos}: {e}") from None
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"{source}: unknown scalar type {kind!r}")
    for key, array in arrays.items():
        if not isinstance(array, mx.array):
            continue
        # Keys and values, a quantized cache's scales and biases: floats
        # attention can use; its packed data: uint32.
        floating = mx.issubdtype(array.dtype, mx.floating)
        if array.ndim == 4 and not (floating or array.dtype == mx.uint32):
            raise ValueError(f"{source}: array {key} has dtype {array.dtype}")
        if floating and not finite and not mx.all(mx.isfinite(array)).item():
            raise ValueError(f"{source}: array {key} holds NaN or infinite values")
    arrays = tree_unflatten(list(arrays.items()))
    # ``_check_state(state)``, where a class has one, raises ``ValueError``
    # saying how the state contradicts itself.
    for i, (c, s) in enumerate(zip(classes, arrays)):
        try:
            getattr(vars(cache_module)[c], "_check_state", lambda s: None)(s)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: layer {i} ({c}): {e}") from None
    cache = []
    for i, (c, s) in enumerate(zip(classes, arrays)):
        try:
            cache.append(vars(cache_module)[c].from_state(s))
        except Exception as e:
            raise ValueError(f"{source}: layer {i} ({c}): {e!r}") from None
    held = metadata.pop("ring_checkpoints", None)
    if held is not None:
        cache = _with_checkpoints(cache, held, source)
    return cache, metadata


def _with_checkpoints(cache: List[Any], held: str, source: str) -> List[Any]:
    """The layers of ``cache`` with the ring checkpoints stored after them
    (``prompt_cache_state``; ``held``: JSON ``[layer, position]`` of each).
    One that is not its ring's (another class, size, layout or dtype, a
    position not in ``(keep, offset]`` or taken twice) is a ``ValueError``
    naming ``source``."""
    try:
        held = json.loads(held)
    except ValueError:
        held = None
    n = len(cache) - len(held) if isinstance(held, list) else 0
    if n < 1 or not all(
        isinstance(x, list) and len(x) == 2 and all(type(y) is int for y in x)
        for x in held
    ):
        raise ValueError(f"{source} has a malformed list of ring checkpoints")

    def kind(c):  # what a checkpoint shares with its ring
        k = c.keys[0] if isinstance(c.keys, (tuple, list)) else c.keys
        quantized = (getattr(c, a, None) for a in ("bits", "group_size", "dtype"))
        layout = prompt_cache_layout([c])
        return (type(c), c.max_size, c.keep, k.shape[0], k.dtype, *quantized, *layout)

    layers, taken = cache[:n], {}
    for (i, at), c in zip(held, cache[n:]):
        ring = layers[i] if 0 <= i < n else None
        if not (
            isinstance(ring, RotatingKVCache)
            and c.offset == at
            and ring.keep < at <= ring.offset
            and at not in taken.setdefault(i, {})
            and kind(c) == kind(ring)
        ):
            raise ValueError(
                f"{source}: checkpoint {at} of layer {i} is not its ring's"
            )
        taken[i][at] = c
    for i, found in taken.items():
        layers[i].checkpoints = [found[p] for p in sorted(found)]
    return layers


def prompt_cache_layout(cache: List[Any]) -> List[Any]:
    """Per layer, what the model shapes in its cache: ``(kv heads, key dim,
    value dim)``, a list for a ``CacheList``, ``None`` while empty, the class
    name of a cache that holds no keys (``ArraysCache``)."""
    layout = []
    for c in cache:
        if isinstance(c, CacheList):
            layout.append(prompt_cache_layout(c.caches))
        elif not hasattr(c, "keys"):
            layout.append(type(c).__name__)
        elif c.keys is None:
            layout.append(None)
        elif isinstance(c.keys, (tuple, list)):  # quantized: dims before packing
            dims = getattr(c, "head_dims", None) or tuple(
                x[0].shape[-1] * 32 // c.bits for x in (c.keys, c.values)
            )
            layout.append((c.keys[0].shape[1], *dims))
        else:
            layout.append((c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1]))
    return layout


def prompt_cache_mismatch(expected: List[Any], cache: List[Any]) -> Optional[str]:
    """Why ``cache`` cannot serve a model whose caches have the layout
    ``expected`` (``prompt_cache_layout``), or ``None`` if it can."""
    got = prompt_cache_layout(cache)
    if len(got) != len(expected):
        return f"it has {len(got)} layers, the model {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        if g is None or e is None:
            continue
        if isinstance(g, list) and isinstance(e, list):
            why = prompt_cache_mismatch(e, cache[i].caches)
            if why is not None:
                return f"layer {i}: {why}"
        elif g != e:
            both = isinstance(g, tuple) and isinstance(e, tuple)
            what = " (kv heads, key dim, value dim)" if both else ""
            return f"layer {i} holds {g}, the model {e}{what}"
    return None
