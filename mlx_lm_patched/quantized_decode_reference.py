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
    / splits)``; each range's max (never below float32's lowest), sum of
    exponentials and weighted values, merged by their maxima."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads, kL = q_keys[0].shape[-3], q_keys[0].shape[-2]
    n_repeats = n_q_heads // n_kv_heads
    keys, values = (
        mx.dequantize(*x, group_size=group_size, bits=bits, dtype=mx.float32)
        for x in (q_keys, q_values)
    )
    width = keys.shape[-1]
    q = queries.astype(mx.float32) * scale
    q = mx.pad(q, [(0, 0)] * 3 + [(0, width - D)])
    q = mx.reshape(q, (B, n_kv_heads, n_repeats * L, width))
    scores = q @ mx.swapaxes(keys, -1, -2)
    if isinstance(mask, str):
        mask = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
    if mask is not None:
        while mask.ndim < 4:
            mask = mask[None]
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, kL))
        mask = mx.reshape(mask, (B, n_kv_heads, n_repeats * L, kL))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -math.inf)
        else:
            scores = scores + mask.astype(mx.float32)
    per = -(-kL // splits)
    pad = [(0, 0)] * 3 + [(0, per * splits - kL)]
    scores = mx.pad(scores, pad, constant_values=-math.inf)
    scores = mx.reshape(scores, (*scores.shape[:3], splits, per))
    values = mx.pad(values, [(0, 0), (0, 0), (0, per * splits - kL), (0, 0)])
    values = mx.reshape(values, (B, n_kv_heads, 1, splits, per, width))
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
