"""Attention over an array mask: fused where the backend fuses it, in
chained query blocks of bounded scores where it materialises them."""

import mlx.core as mx


def sdpa_backend() -> str:
    """The MLX backend of the default device: "cpu", "cuda" or "metal"."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


# CUDA: the calls cuDNN would take that attend unfused, their scores small: at
# most this many queries over at most this many keys (a sliding window's
# layers), or a few queries over any number (a prompt sent again), and at most
# UNFUSED_SCORES scores in all (a batch's rows and heads). MLX records cuDNN's
# calls as CUDA graph nodes it cannot update, so each commit holding one is
# instantiated anew, and cuDNN builds a graph for every new shape.
UNFUSED_QUERIES, UNFUSED_KEYS, FEW_QUERIES = 1024, 4096, 16
UNFUSED_SCORES = 1 << 27


def attention_path(queries, keys, values, mask) -> str:
    """How ``mx.fast.scaled_dot_product_attention`` runs with this mask:
    "fused" (the mask as it is), "additive" (fused once a boolean mask is made
    additive in the query dtype), "unfused" (MLX's own composition, on CUDA
    where the scores are small) or "scores" (materialised, in query blocks
    past ``max_scores``)."""
    if not isinstance(mask, mx.array):
        return "fused"
    backend = sdpa_backend()
    L, D, D_v = queries.shape[2], queries.shape[-1], values.shape[-1]
    if backend == "metal":
        if L > 8:
            fused = D == D_v and D in (64, 72, 80, 96, 128)
        else:
            gqa = queries.shape[1] // keys.shape[1]
            fused = D == D_v and D in (64, 96, 128, 256) and L * gqa <= 32
        return "fused" if fused else "scores"
    if backend == "cuda":
        fused = (
            queries.dtype in (mx.float16, mx.bfloat16)
            and L > 1
            and D % 8 == 0
            and D_v % 8 == 0
            and max(D, D_v) <= 128
        )
        if not fused:
            return "scores"
        B, H, K = queries.shape[0], queries.shape[1], keys.shape[2]
        few = L <= FEW_QUERIES or (L <= UNFUSED_QUERIES and K <= UNFUSED_KEYS)
        return "unfused" if few and B * H * L * K <= UNFUSED_SCORES else "additive"
    return "scores"


_additive_masks = {}


def additive_mask(mask, dtype):
    """``mask`` as an additive mask in ``dtype``: 0 where visible, the dtype's
    minimum elsewhere, a view of rows padded to 16 bytes. cuDNN reads a bias
    whose rows are not aligned slowly: one 2048 x 6143-key call took 1.25 ms,
    the same mask with rows of 6144 0.77 ms, bit for bit (H100, 32 heads;
    ``mask="causal"``: 0.44). A model gives every layer the same mask: the
    last one converted is kept with its conversion, so a model call converts
    once."""
    key = (id(mask), dtype)
    if key not in _additive_masks:
        _additive_masks.clear()
        K = mask.shape[-1]
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, -K % (16 // dtype.size))]
        additive = mx.where(
            mx.pad(mask, pad), mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype)
        )
        _additive_masks[key] = mask, additive[..., :K]
    return _additive_masks[key][1]


def bucket(n: int) -> int:
    """``n`` rounded up to the next of two sizes per doubling (…, 512, 768,
    1024, 1536, 2048, …; 64 at least)."""
    if n <= 64:
        return 64
    step = 1 << (n.bit_length() - 2)
    return -(-n // step) * step


def _in_bucket(queries, keys, values, scale, mask):
    """The fused call on queries and keys padded to their ``bucket``s, the
    padding masked out (it adds exact zeros) and cut off: cuDNN builds a
    graph for every new shape (45-75 ms on an H200, once), and a server
    meets a new one at every request of a growing conversation."""
    L, K = queries.shape[2], keys.shape[2]
    Lb, Kb = bucket(L), bucket(K)
    if (Lb, Kb) == (L, K) or tuple(mask.shape[-2:]) != (L, K):
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask
        )
    pad = lambda x, n: mx.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, n), (0, 0)])
    queries, keys, values = pad(queries, Lb - L), pad(keys, Kb - K), pad(values, Kb - K)
    out = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=bucket_mask(mask, Lb, Kb)
    )
    return out[..., :L, :]


_bucket_masks = {}


def bucket_mask(mask, rows: int, columns: int):
    """An additive ``mask`` padded to ``rows`` x ``columns``: the new columns
    masked, the new rows seeing their first column only (no row all
    masked). Made once for a model call's layers, as ``additive_mask``."""
    key = (id(mask), rows, columns)
    if key not in _bucket_masks:
        _bucket_masks.clear()
        L, K = mask.shape[-2:]
        low = mx.finfo(mask.dtype).min
        lead = [(0, 0)] * (mask.ndim - 2)
        padded = mx.pad(mask, lead + [(0, 0), (0, columns - K)], constant_values=low)
        padded = mx.pad(padded, lead + [(0, rows - L), (0, 0)], constant_values=low)
        first = (mx.arange(rows)[:, None] >= L) & (mx.arange(columns)[None] == 0)
        _bucket_masks[key] = mask, mx.where(first, mx.array(0, mask.dtype), padded)
    return _bucket_masks[key][1]


def unfused(queries, keys, values, scale, mask):
    """Attention as MLX composes it where no fused kernel takes a call
    (``mlx/fast.cpp``), bit for bit: the scores materialised."""
    B, H, L, D = queries.shape
    n_kv = keys.shape[1]
    queries = mx.array(scale, queries.dtype) * queries
    if H > n_kv:  # each key head's queries together
        queries = queries.reshape(B, n_kv, H // n_kv, L, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        if mask.ndim >= 3:
            mask = (
                mx.expand_dims(mask, -3)
                if mask.shape[-3] == 1
                else mask.reshape(*mask.shape[:-3], n_kv, H // n_kv, *mask.shape[-2:])
            )
    scores = queries @ keys.swapaxes(-1, -2)
    if mask.dtype == mx.bool_:
        low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        scores = mx.where(mask, scores, low)
    else:
        scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.reshape(B, H, L, -1) if H > n_kv else out


def _query_blocks(queries, keys, values, scale, mask, sinks, rows):
    """Attention a block of queries at a time, the scores of ``rows`` queries
    at most (an eighth of that on CPU, where a chain runs about six blocks
    ahead). On CPU a chain of blocks keeps the bound; a GPU encodes every
    block before the first one runs, so there only evaluating each block
    does, and blocks of a power of two queries give upstream's output bit for
    bit."""
    on_cpu = sdpa_backend() == "cpu"
    block = max(1, rows // 8 if on_cpu else rows)
    if not on_cpu:
        block = 1 << (block.bit_length() - 1)
    out = []
    for start in range(0, queries.shape[2], block):
        part = slice(start, start + block)
        q = queries[..., part, :]
        if out and on_cpu:  # one block after the other
            q = mx.depends(q, out[-1])
        out.append(
            mx.fast.scaled_dot_product_attention(
                q,
                keys,
                values,
                scale=scale,
                mask=mask[..., part, :] if mask.shape[-2] > 1 else mask,
                sinks=sinks,
            )
        )
        if not on_cpu:
            mx.eval(out[-1])
    return mx.concatenate(out, axis=2)


def bounded_attention(
    queries, keys, values, scale: float, mask, sinks=None, max_scores: int = 1 << 28
):
    """``mx.fast.scaled_dot_product_attention`` by the road ``attention_path``
    names: a boolean mask made additive where only that is fused, the
    materialised scores in query blocks of ``max_scores`` bytes at most."""
    path = attention_path(queries, keys, values, mask)
    if path == "unfused":
        if sinks is None:
            return unfused(queries, keys, values, scale, mask)
        path = "additive"
    if path == "additive" and mask.dtype == mx.bool_:
        mask = additive_mask(mask, queries.dtype)
    if path == "additive" and sinks is None:
        return _in_bucket(queries, keys, values, scale, mask)
    if path == "scores":
        B, H, N, _ = queries.shape
        per_query = 4 * B * H * keys.shape[2]  # float32 scores
        if N * per_query > max_scores:
            rows = max_scores // per_query
            return _query_blocks(queries, keys, values, scale, mask, sinks, rows)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )
