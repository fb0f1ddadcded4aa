"""The CUDA decode kernel's arithmetic (``quantized_decode_kernel``) in
plain ``mx`` ops, for tests on CPU and the GPU check of ``python -m
mlx_lm_patched.bench qdecode``. Not a patch: nothing runs it in a model."""

import math

import mlx.core as mx


def decode_attention_reference(
    queries, q_keys, q_values, scale, mask, group_size, bits, splits
):
    """What the kernel computes, in ``mx`` ops: keys and values dequantized
    in float32, the queries (scaled, zero-padded to the cache's width) as
    rows of their KV head, the keys cut into ``splits`` ranges of ``ceil(kL
    / splits)``, a ``QuantizedKVCache``'s tail (``q_keys`` and ``q_values``
    of five) one more range; each range's max (never below float32's
    lowest), sum of exponentials and weighted values, merged by their
    maxima."""
    B, n_q_heads, L, D = queries.shape
    tail = 0
    if len(q_keys) == 5:
        kL, tail = (n - 1 for n in q_keys[4].shape)
        rest = [
            (x.written() if hasattr(x, "written") else x[3])[:, :, :tail]
            for x in (q_keys, q_values)
        ]
        rest = [x.astype(mx.float32) for x in rest]
        q_keys, q_values = ([p[:, :, :kL] for p in x[:3]] for x in (q_keys, q_values))
    n_kv_heads, kL = q_keys[0].shape[-3], q_keys[0].shape[-2]
    n_repeats = n_q_heads // n_kv_heads
    keys, values = (
        mx.dequantize(*x, group_size=group_size, bits=bits, dtype=mx.float32)
        for x in (q_keys, q_values)
    )
    width = keys.shape[-1]
    if tail:
        rest = [mx.pad(x, [(0, 0)] * 3 + [(0, width - D)]) for x in rest]
        keys, values = (
            mx.concatenate([x, y], axis=2) for x, y in zip((keys, values), rest)
        )
    q = queries.astype(mx.float32) * scale
    q = mx.pad(q, [(0, 0)] * 3 + [(0, width - D)])
    q = mx.reshape(q, (B, n_kv_heads, n_repeats * L, width))
    scores = q @ mx.swapaxes(keys, -1, -2)
    n = kL + tail
    if isinstance(mask, str):
        mask = mx.arange(n - L, n)[:, None] >= mx.arange(n)[None]
    if mask is not None:
        while mask.ndim < 4:
            mask = mask[None]
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, n))
        mask = mx.reshape(mask, (B, n_kv_heads, n_repeats * L, n))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -math.inf)
        else:
            scores = scores + mask.astype(mx.float32)
    # The ranges, each padded to the longest (the tail's may be longer).
    per = -(-kL // splits)
    size = max(per, tail)
    ranges = [(i * per, min(kL, (i + 1) * per)) for i in range(splits)]
    ranges += [(kL, n)] if tail else []

    def cut(x, fill):
        parts = [
            mx.pad(
                x[..., a:b, :],
                [(0, 0)] * (x.ndim - 2) + [(0, size - max(b - a, 0)), (0, 0)],
                constant_values=fill,
            )
            for a, b in ranges
        ]
        return mx.stack(parts, axis=-3)

    scores = cut(scores[..., None], -math.inf)[..., 0]
    values = cut(values, 0)[:, :, None]
    m = mx.maximum(mx.max(scores, axis=-1), mx.finfo(mx.float32).min)
    p = mx.exp(scores - m[..., None])
    s = mx.sum(p, axis=-1)
    o = (p[..., None, :] @ values)[..., 0, :]
    M = mx.max(m, axis=-1, keepdims=True)
    f = mx.exp(m - M)
    S = mx.sum(s * f, axis=-1)
    O = mx.sum(o * f[..., None], axis=-2)
    out = mx.where(S[..., None] > 0, O / mx.where(S > 0, S, 1)[..., None], 0)
    out = mx.reshape(out, (B, n_q_heads, L, width))[..., :D]
    return out.astype(queries.dtype)
