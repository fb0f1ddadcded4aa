"""Attention over an array mask in query blocks of bounded size.

MLX's fused attention stays fused only with ``mask="causal"`` or no mask. An
array mask (a rotating cache's window once a chunk runs past the ring, a
batch's left padding) makes it materialise float32 scores for every query
and key: 1,552 MiB for one 2048-query x 6143-key call with 32 heads on MLX's
CUDA backend, several layers' worth alive at once, so bounding the cache
made a long prefill cost more memory than not bounding it. Past
``max_scores`` bytes of scores, queries now go through in blocks, each
evaluated before the next; smaller calls are unchanged.
"""

from typing import Optional

import mlx.core as mx

from ._registry import Patch, Target, pasted_into


def scaled_dot_product_attention(
    queries,
    keys,
    values,
    cache,
    scale: float,
    mask: Optional[mx.array],
    sinks: Optional[mx.array] = None,
    max_scores: int = 1 << 28,
) -> mx.array:
    if hasattr(cache, "bits"):
        if sinks is not None:
            raise ValueError("Quantized SDPA does not support attention sinks.")
        return quantized_scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            group_size=cache.group_size,
            bits=cache.bits,
        )
    B, H, N, _ = queries.shape
    block = max(1, max_scores // (4 * B * H * keys.shape[2]))
    if not isinstance(mask, mx.array) or N <= block:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    out = []
    for start in range(0, N, block):
        rows = slice(start, start + block)
        out.append(
            mx.fast.scaled_dot_product_attention(
                queries[..., rows, :],
                keys,
                values,
                scale=scale,
                mask=mask[..., rows, :],
                sinks=sinks,
            )
        )
        mx.eval(out[-1])
    return mx.concatenate(out, axis=2)


# Written as it reads in mlx_lm/models/base.py, and run from there.
scaled_dot_product_attention = pasted_into(
    "mlx_lm.models.base", scaled_dot_product_attention
)

PATCH = Patch(
    "bounded_attention",
    "scaled_dot_product_attention: array-masked queries in blocks of bounded scores",
    [
        Target(
            "mlx_lm.models.base",
            "scaled_dot_product_attention",
            scaled_dot_product_attention,
            "8deba4a8a8fb",
        )
    ],
    uses={
        "mlx_lm.models.base": (
            "Optional",
            "mx",
            "quantized_scaled_dot_product_attention",
        )
    },
)
