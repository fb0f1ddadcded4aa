"""Attention over a quantized cache: in chained query blocks, any head dim,
and on CUDA through fused attention.

Upstream's ``quantized_scaled_dot_product_attention`` materialises the
scores of every query at once, so a long prefill chunk's scores outgrow the
quantized cache itself (ml-explore/mlx-lm#1587: prefill peaks 40-50% above
the unquantized cache's). Here queries go through in blocks of about
``block_bytes`` of scores, with the same result bit for bit: on CPU each
block depends on the previous one's output (``mx.depends``) and nothing is
evaluated; on a GPU each block is evaluated (a chain bounds nothing there;
see ``bounded_attention``). On CPU the query heads that share a KV head
are rows of one matrix multiplied by that head's keys: upstream broadcasts
the keys over them instead, and MLX's CPU ``mx.quantized_matmul`` copies
broadcast keys and values, ``n_repeats`` copies of the layer's, in every
call (Metal's reads them in place). One attention call of a 232-token
chunk over 999 8-bit keys (8 heads over 2, bfloat16, CPU) peaked at 4.25
MiB this way against 5.03 (bfloat16 through fused attention: 4.22); a
small llama's 8-bit ``KVCache`` prefill peak fell from 1.005x to 0.905x
the bfloat16 one's. Head dims that no group size divides are zero-padded
by ``QuantizedKVCache`` (keys and values alike); the queries are padded to
match and the padding dropped from the output.

On MLX's CUDA backend ``mx.quantized_matmul`` has no kernel for a cache's
keys and values (slices of a larger buffer: ``[quantized_matmul] No
implementation for problem shape: 1663x15999x128x32, transpose: true``),
so ``--kv-bits`` failed in the first prefill chunk. There the layer's keys
and values are dequantized into the query dtype (one layer's worth, a
fraction of an unquantized cache) and go through fused attention
(``scaled_dot_product_attention``, no scores materialised): on an H100, one
2048-query x 6143-key call (32 heads, head dim 128) over 8-bit keys took
1.8 ms and 80 MiB, against 7.5 ms and 800 MiB for upstream's road where its
kernel exists (contiguous keys). Each layer's attention there is scheduled
and waits for the previous layer's (``_schedule``): unsynced, a GPU runs far
behind the host, and a decode step's 32 layers were all in flight, each
with its dequantized keys (Llama-8B shape, 16,000 8-bit tokens: a step
peaked at 5.07 GiB above the weights, 1.56 chained, against 2.94 for the
bfloat16 cache). Evaluating each prefill chunk's attention instead, as this
function did before, held less but cost time: 16,000 4-bit tokens
prefilled in 0.74 s, against 0.53 chained. Decode steps have no kernel
either (``1x16000x128x32``): there, dequantizing a layer's cache for one
query made ``--kv-bits 8`` decode at 0.40x the bfloat16 cache's tokens per
second and 4 bits at 0.56x (H200, Llama-8B shape, 16k tokens).

So decode steps on CUDA (up to ``DECODE_MAX_QUERIES`` queries, bits 4 and
8) go through ``quantized_decode_attention``, a kernel over the packed
cache (``quantized_decode_kernel``). Prefill chunks keep the road above.
Metal and CPU are untouched.
"""

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
from mlx.utils import tree_map

from .._newmods import hooks
from .._registry import Patch, pasted_into, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.kernels.quantized_decode import (
        quantized_decode_attention,
        use_decode_kernel,
    )
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.bounded_attention import sdpa_backend
    from mlx_lm.models.quantized_layout import _quantize_tail
    from mlx_lm.models.ring_buffer import _schedule

# The marker of the last layer's attention scheduled on CUDA (``_schedule``).
_previous_attention = []


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    q_keys: tuple[mx.array, mx.array, mx.array],
    q_values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Optional[mx.array],
    group_size: int = 64,
    bits: int = 8,
    block_bytes: int = 1 << 26,
) -> mx.array:
    """Attention over a quantized cache, about ``block_bytes`` of scores at a
    time: a long prefill chunk's scores outgrow the cache otherwise (#1587)."""
    if use_decode_kernel(queries, bits) and sdpa_backend() == "cuda":
        # No layer's keys dequantized; a QuantizedKVCache's tail read as it is.
        return quantized_decode_attention(
            queries, q_keys, q_values, scale, mask, group_size, bits
        )
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads

    # A QuantizedKVCache zero-pads head dims no group size divides (keys and
    # values alike): pad the queries to match, drop the padding from the output.
    width = q_keys[0].shape[-1] * 32 // bits

    if len(q_keys) == 5:
        q_keys, q_values = _quantize_tail(q_keys, q_values, group_size, bits)
    if sdpa_backend() == "cuda":
        keys, values = (
            mx.dequantize(*x, group_size=group_size, bits=bits, dtype=queries.dtype)
            for x in (q_keys, q_values)
        )
        if width > D:
            keys, values = keys[..., :D], values[..., :D]
        out = scaled_dot_product_attention(queries, keys, values, None, scale, mask)
        # Each layer's attention waits for the previous layer's: unchained,
        # a GPU runs far behind the host and every layer it has not finished
        # holds its dequantized keys. On an H100 (32 layers, 8 KV heads of
        # 128, a decode step's attention alone) unchained steps held 0.98 /
        # 2.6 / 5.1 GiB at 6,000 / 16,000 / 32,000 4-bit keys, chained 0.09 /
        # 0.24 / 0.48, in less time (2.6 against 3.3 ms at 6,000).
        _schedule((out,), _previous_attention)
        return out

    queries *= scale
    if width > D:
        queries = mx.pad(queries, [(0, 0), (0, 0), (0, 0), (0, width - D)])
    queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, width))
    # On CPU the query heads sharing a KV head are rows of one matrix, (B,
    # n_kv_heads, n_repeats * L, width): broadcast over them, the keys and
    # values are copied by ``quantized_matmul`` (it wants them row
    # contiguous). Metal's reads them broadcast, and picks its kernel by the
    # rows (``qvm`` for a decode step's values): there they stay as upstream's.
    on_cpu = sdpa_backend() == "cpu"
    if not on_cpu:
        q_keys, q_values = (
            tree_map(lambda x: mx.expand_dims(x, axis=-3), t)
            for t in (q_keys, q_values)
        )

    kL = q_keys[0].shape[-2]
    if isinstance(mask, str):
        q_indices = mx.arange(kL - L, kL)
        k_indices = mx.arange(kL)
        mask = q_indices[:, None] >= k_indices[None]
    if mask is not None and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)

    # Chained blocks of an eighth of the budget on CPU, evaluated blocks on a
    # GPU (see bounded_attention).
    per_query = B * n_q_heads * kL * queries.dtype.size
    rows = max(1, block_bytes // ((8 if on_cpu else 1) * per_query))
    if not on_cpu:
        rows = 1 << (rows.bit_length() - 1)
    rows = L if L * per_query <= block_bytes else rows
    out = []
    for i in range(0, L, rows):
        q = queries[..., i : i + rows, :]
        n = q.shape[-2]
        if out and on_cpu:  # one block after the other
            q = mx.depends(q, out[-1])
        shape = (B, n_kv_heads, n_repeats, n, -1)
        if on_cpu:
            shape = (B, n_kv_heads, n_repeats * n, -1)
        scores = mx.quantized_matmul(
            mx.reshape(q, shape),
            *q_keys,
            transpose=True,
            group_size=group_size,
            bits=bits,
        )
        scores = mx.reshape(scores, (B, n_kv_heads, n_repeats, n, kL))
        if mask is not None:
            rowwise = mask.ndim > 1 and mask.shape[-2] > 1
            m = mask[..., i : i + rows, :] if rowwise else mask
            if m.dtype == mx.bool_:
                scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
            else:
                scores += m
        scores = mx.softmax(scores, axis=-1, precise=True)
        o = mx.quantized_matmul(
            mx.reshape(scores, shape),
            *q_values,
            transpose=False,
            group_size=group_size,
            bits=bits,
        )
        out.append(mx.reshape(o, (B, n_kv_heads, n_repeats, n, width)))
        if rows < L and not on_cpu:
            mx.eval(out[-1])
    out = out[0] if len(out) == 1 else mx.concatenate(out, axis=-2)
    out = mx.reshape(out, (B, n_q_heads, L, width))
    if width > D:
        out = out[..., :D]

    return out


# Written as it reads in mlx_lm/models/base.py, and run from there.
quantized_scaled_dot_product_attention = pasted_into(
    "mlx_lm.models.base", quantized_scaled_dot_product_attention
)

PATCH = Patch(
    "quantized_attention",
    "quantized_scaled_dot_product_attention: chained query blocks of bounded "
    "scores, zero-padded head dims, fused attention over dequantized keys on CUDA "
    "and the decode kernel for CUDA decode steps",
    targets("mlx_lm.models.base", quantized_scaled_dot_product_attention)
    + targets("mlx_lm.models.base", _previous_attention=_previous_attention)
    + hooks("mlx_lm.models.base", "mlx_lm.models.bounded_attention", "sdpa_backend")
    + hooks("mlx_lm.models.base", "mlx_lm.models.quantized_layout", "_quantize_tail")
    + hooks("mlx_lm.models.base", "mlx_lm.models.ring_buffer", "_schedule"),
    requires=(
        "mlx_lm.models.base:scaled_dot_product_attention",
        "mlx_lm.models:bounded_attention",
        "mlx_lm.models:quantized_layout",
        "mlx_lm.models:ring_buffer",
    ),
)
