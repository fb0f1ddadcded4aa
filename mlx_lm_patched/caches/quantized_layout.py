"""How ``QuantizedKVCache`` quantizes keys and values: a group size that
divides the head dim (96 with 64 quantizes with 32) or a zero-padded head
dim (80), and the checks a quantized state must pass. ``quantized_cache``
installs them in mlx_lm/models/cache.py, where they run.
"""

import mlx.core as mx


def _kv_quant_layout(k_head_dim, v_head_dim, group_size, bits):
    """``(group_size, k_width, v_width)`` to quantize these head dims with.

    The requested group size if it divides both dims, else the largest
    supported smaller one that does, else both dims (if equal) zero-padded
    to a multiple of 32.
    """
    if group_size not in (32, 64, 128) or bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(
            f"QuantizedKVCache: unsupported group_size={group_size}, bits={bits} "
            "(group_size must be 32, 64 or 128; bits 2, 3, 4, 5, 6 or 8)"
        )
    for g in (group_size, 64, 32):
        if g <= group_size and k_head_dim % g == 0 and v_head_dim % g == 0:
            return g, k_head_dim, v_head_dim
    if k_head_dim != v_head_dim:
        raise ValueError(
            f"QuantizedKVCache: key and value head dims {k_head_dim} and "
            f"{v_head_dim} are not multiples of 32 and differ, so cannot be padded"
        )
    width = (k_head_dim + 31) // 32 * 32
    return 32, width, width


def _kv_quantize(keys, values, group_size, bits):
    """``(group_size, keys, values)``: the group size in use and the
    ``mx.quantize`` parts of ``keys`` and ``values``, their head dims
    zero-padded as ``_kv_quant_layout`` says."""
    group_size, k_width, v_width = _kv_quant_layout(
        keys.shape[3], values.shape[3], group_size, bits
    )
    out = []
    for x, width in ((keys, k_width), (values, v_width)):
        if width > x.shape[3]:
            x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, width - x.shape[3])])
        out.append(mx.quantize(x, group_size=group_size, bits=bits))
    return group_size, *out


def _check_quantized(keys, values, group_size, bits, dtype=None, head_dims=None):
    """The tokens quantized state arrays ``keys`` and ``values`` hold;
    ``ValueError`` unless each is a (packed, scales, biases) triple that
    ``group_size`` and ``bits`` (and ``dtype``, ``head_dims`` if given) describe."""
    if keys is None and values is None:
        return 0
    _kv_quant_layout(128, 128, group_size, bits)  # raises if either is unsupported
    parts = list(keys or ()) + list(values or ())
    if len(parts) != 6 or not all(
        isinstance(x, mx.array) and x.ndim == 4 for x in parts
    ):
        raise ValueError("keys and values are not (packed, scales, biases) triples")
    if len({x.shape[:3] for x in parts}) > 1:
        raise ValueError("keys and values parts differ in batch, heads or tokens")
    for (packed, scales, biases), dim in zip((keys, values), head_dims or (0, 0)):
        width = packed.shape[-1] * 32 // bits
        if (
            packed.dtype != mx.uint32
            or packed.shape[-1] * 32 % bits
            or scales.shape != biases.shape
            or scales.shape[-1] * group_size != width
        ):
            raise ValueError(
                f"packed width {packed.shape[-1]} and {scales.shape[-1]} groups do not "
                f"fit bits={bits}, group_size={group_size}"
            )
        if dim and not dim <= width < dim + 32:
            raise ValueError(f"head dims {tuple(head_dims)} do not fit width {width}")
        if dtype is not None and dtype != str(scales.dtype).rpartition(".")[2]:
            raise ValueError(f"dtype {dtype!r} but {scales.dtype} scales")
    return keys[0].shape[2]
