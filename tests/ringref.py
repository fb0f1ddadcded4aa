"""Shared test helpers: what attention must see through a rotating cache,
upstream twins to compare, bit-exact comparison, random keys and values.

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
        if t.fingerprint is not None
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


def random_kv(*shape, dtype=mx.float32):
    return mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)


def same(a, b):
    """Bit-exact equality of arrays (dtype and shape too), of tuples and lists
    of them, and of plain values."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    return type(a) is type(b) and a == b


# Token prompts of different lengths, for batches.
PROMPTS = [list(range(1, 30)), list(range(5, 17)), list(range(40, 90))]


def single_stream(model, prompt, steps, cache=None, max_kv_size=None, **kwargs):
    """Greedy tokens of one ``generate_step`` stream, and its cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size) if cache is None else cache
    gen = generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=cache, **kwargs
    )
    return [t for t, _ in gen], cache


def active():
    """Bytes MLX holds once garbage is collected."""
    import gc

    gc.collect()
    return mx.get_active_memory()


def same_mask(fp, q):
    """Equal masks, an fp ring's single-query vector as the quantized ring's row."""
    if isinstance(fp, mx.array) and fp.ndim == 1:
        fp = fp[None]
    return same(fp, q)


def free_port():
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
