"""How ``QuantizedKVCache`` holds keys and values: a group size that divides
the head dims or zero-padded head dims, the checks a quantized state must
pass, and the tail a decode step hands attention with the packed tokens."""

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


_decode_lengths_made = {}
_tail_starts = {}


def _tail_start(t):
    """``mx.array([t])``, made once: where a decode step's tokens go in the
    tail."""
    if t not in _tail_starts:
        _tail_starts[t] = mx.array([t])
    return _tail_starts[t]


def _decode_lengths(quantized, tail):
    """An array of shape ``(quantized + 1, tail + 1)`` (a broadcast scalar:
    the decode kernel reads the lengths off its shape), made once a step (a
    step's layers share it), a view of one zero made once: no kernel a step
    (a new zero was one, writing MLX's managed memory)."""
    key = (quantized, tail)
    if key not in _decode_lengths_made:
        zero = _decode_lengths_made.get(None)
        if zero is None:
            zero = mx.zeros((1, 1), mx.int32)
        _decode_lengths_made.clear()
        _decode_lengths_made[None] = zero
        _decode_lengths_made[key] = mx.broadcast_to(zero, (quantized + 1, tail + 1))
    return _decode_lengths_made[key]


class _TailFetch(tuple):
    """A ``QuantizedKVCache`` decode step's ``(packed, scales, biases, tail,
    lengths)``, the step's tokens not in the tail: ``before`` (the tail
    item) is the tail without them, ``new`` the tokens, to go at ``start``.
    The decode kernel reads both and hands ``cache`` the tail it writes
    (``_wrote_tail``); ``written()`` writes it for any other reader. H200,
    Llama-8B shape, 8 bits: the two writes a layer took 0.8 ms of a decode
    step's 3.0 of MLX launches; made and never run, 1.6 us of its host
    time each."""

    def __new__(cls, items, new, start, cache):
        self = super().__new__(cls, items)
        self.before, self.new, self.start, self.cache = items[3], new, start, cache
        return self

    def __getnewargs__(self):  # copy.deepcopy (upstream's prompt cache LRU)
        return tuple(self), self.new, self.start, self.cache

    def written(self):
        """The tail with the step's tokens."""
        return mx.slice_update(self.before, self.new, _tail_start(self.start), (2,))


def _quantize_tail(q_keys, q_values, group_size, bits):
    """``(packed, scales, biases)`` of the keys and of the values a
    ``QuantizedKVCache`` decode step hands out with its tail (the whole
    buffers, the tail, the lengths): the tail quantized after the packed
    tokens, the bits the cache will hold."""
    quantized, tail = (n - 1 for n in q_keys[4].shape)  # see _decode_lengths
    out = []
    for fetched in (q_keys, q_values):
        *parts, rest, _ = fetched
        if hasattr(fetched, "written"):  # the step's tokens, not in the tail
            rest = fetched.written()
        width = parts[0].shape[-1] * 32 // bits
        rest = rest[:, :, :tail]
        if width > rest.shape[-1]:
            rest = mx.pad(rest, [(0, 0)] * 3 + [(0, width - rest.shape[-1])])
        rest = mx.quantize(rest, group_size=group_size, bits=bits)
        out.append(
            tuple(
                mx.concatenate([x[:, :, :quantized], y], axis=2)
                for x, y in zip(parts, rest)
            )
        )
    return out


def _start_tail(cache):
    """Give a decode step a tail if it can have one: on CUDA, after the
    prompt, 4 or 8 bits, a half-precision cache of one head dim up to
    128 (what the decode kernel reads)."""
    if (
        not cache.decode_tail
        or cache._keys is None
        or cache.bits not in (4, 8)
        or cache.dtype not in ("bfloat16", "float16")
        or cache.head_dims[0] != cache.head_dims[1]
        or cache.head_dims[0] > 128
    ):
        return False
    shape = (*cache._keys[0].shape[:2], cache.decode_tail, cache.head_dims[0])
    dtype = getattr(mx, cache.dtype)
    cache._tail = (mx.zeros(shape, dtype), mx.zeros(shape, dtype))
    # The decode kernel's, one a batch row and KV head (merge_ranges);
    # 16 bytes or more: MLX keeps arrays of up to 8 in managed memory.
    cache._counters = mx.zeros((max(4, shape[0] * shape[1]),), mx.uint32)
    return True


def _tail_update(cache, keys, values):
    """Write a decode step's tokens into the tail (quantizing it first if
    they do not fit); the buffers for ``quantized_decode_attention``:
    ``(packed, scales, biases, tail, lengths)`` of keys and of values,
    the tokens ``[0, quantized)`` packed and the next ``tail`` in the
    tail (``_decode_lengths``). The tail is written lazily
    (``_TailFetch``): the kernel writes it with the step's tokens as it
    reads them, and nothing evaluates the write here."""
    n = keys.shape[2]
    if cache._tail_len + n > cache._tail[0].shape[2]:
        cache._flush()
    tk, tv = cache._written_tail()
    t = cache._tail_len
    cache.offset += n
    cache._tail_len = t + n
    lengths = _decode_lengths(cache.offset - t - n, t + n)
    cache._step = (
        _TailFetch((*cache._keys, tk, lengths), keys, t, cache),
        _TailFetch((*cache._values, tv, lengths), values, t, cache),
    )
    return cache._step


def _check_quantized_state(v):
    """Raise ``ValueError`` saying how the ``QuantizedKVCache`` state ``v``
    contradicts itself."""
    if len(v) not in (5, 7):
        raise ValueError(f"{len(v)} state items, a QuantizedKVCache has 5 or 7")
    keys, values, offset, group_size, bits = v[:5]
    n = _check_quantized(keys, values, group_size, bits, *v[5:])
    if not 0 <= offset <= n:
        raise ValueError(f"offset {offset} is not within the {n} tokens stored")
