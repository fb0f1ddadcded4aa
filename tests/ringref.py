"""What attention must see through a rotating cache, and upstream twins to compare.

The reference keeps every token and admits, for a query at absolute position
``q``, the first ``keep`` tokens and the ``window - keep`` newest up to ``q``:
what a ring of ``window`` slots fed token by token holds.
"""

import mlx.core as mx

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


def random_kv(*shape):
    return mx.random.normal(shape), mx.random.normal(shape)
