"""What attention must see through a rotating cache, and upstream twins to compare.

The reference keeps every token and admits, for a query at absolute position
``q``, the first ``keep`` tokens and the ``window - keep`` newest up to ``q``:
what a ring of ``window`` slots fed token by token holds.
"""

import os
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlx_lm_patched import _registry


def upstream_twin(patch, cls):
    """A subclass of ``cls`` running the upstream methods ``patch`` replaces."""
    originals = {
        t.attr: _registry.get_original(t.owner, t.attr)
        for t in patch.targets
        if t.fingerprint is not None and t.owner.endswith(f":{cls.__name__}")
    }
    return type(f"Upstream{cls.__name__}", (cls,), originals)


def attend(q, k, v, mask):
    """Plain softmax attention; ``mask`` as a cache's ``make_mask`` returns it."""
    scores = q @ k.swapaxes(-1, -2)
    if mask == "causal":
        N, L = q.shape[2], k.shape[2]
        mask = mx.tril(mx.ones((N, L), mx.bool_), k=L - N)
    if isinstance(mask, mx.array):
        scores = mx.where(mask, scores, -1e9)
    return mx.softmax(scores, axis=-1) @ v


def reference_mask(offset, N, window, keep=0):
    """Keys ``[0, offset + N)`` each of the ``N`` queries from ``offset`` sees."""
    q = mx.arange(offset, offset + N)[:, None]
    k = mx.arange(offset + N)[None]
    return (k <= q) & ((k < keep) | (k > q - (window - keep)))


def save_load(cache):
    """``cache`` through ``save_prompt_cache`` and ``load_prompt_cache``."""
    with tempfile.TemporaryDirectory() as d:
        save_prompt_cache(os.path.join(d, "c.safetensors"), [cache])
        (cache,) = load_prompt_cache(os.path.join(d, "c.safetensors"))
    return cache


def random_kv(*shape):
    return mx.random.normal(shape), mx.random.normal(shape)


def data_pointer(a):
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def buffers_through(cache, batch, sizes, monkeypatch):
    """Update ``cache`` with float16 chunks of ``sizes``; return the distinct
    (shape, keys pointer, values pointer) seen and the concatenate calls."""
    calls, concatenate = [], mx.concatenate
    monkeypatch.setattr(
        mx, "concatenate", lambda *a, **k: calls.append(1) or concatenate(*a, **k)
    )
    seen = set()
    for S in sizes:
        k, v = random_kv(batch, 2, S, 8)
        out = cache.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
        mx.eval(out, cache.keys, cache.values)
        seen.add(
            (cache.keys.shape, data_pointer(cache.keys), data_pointer(cache.values))
        )
    return seen, len(calls)
