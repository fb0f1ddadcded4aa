"""``QuantizedKVCache`` done right (issue 4).

Upstream's quantized cache reports ``size() == 0``, raises on ``nbytes`` when
empty, lets ``trim(-1)`` grow ``offset`` (as do ``KVCache``,
``ChunkedKVCache`` and ``ConcatenateKVCache``), saves its padding, grows by
concatenating 256-token steps, cannot give its tokens back in full precision,
and fails on head dims such as 96 or 80 that group size 64 does not divide;
``KVCache.to_quantized`` quantizes the padding too; ``generate`` accepts
``--kv-bits 16`` until the cache reaches ``--quantized-kv-start`` tokens.
Here the cache:

- reports live tokens (``size``), rejects negative trims (so do the
  unquantized caches), and ``compact()`` frees what trimming left behind;
  ``nbytes`` is what the buffers hold;
- allocates once when told the final length (``reserve``), else grows by half
  its capacity, writing the old tokens into the new buffers (no concatenate);
- saves upstream's five-item ``state``, which plain mlx-lm reads, and reads
  the quantized dtype and head dims back off the arrays, so
  ``save_prompt_cache``/``load_prompt_cache`` round trips are bit-exact and
  ``to_kv_cache()`` dequantizes to the original dtype; only zero-padded head
  dims, which upstream cannot attend over, add them as two more items;
- picks a group size that divides the head dim (96 with 64 quantizes with
  32), or zero-pads it (80), padding the queries to match in
  ``quantized_scaled_dot_product_attention``, which also attends in query
  blocks of bounded scores (ml-explore/mlx-lm#1587), bit-identical; such a
  file, saved with the group size in use, passes ``generate``'s
  ``--kv-group-size`` check for the group size that was asked for
  (``quantizes_with``);
- unsupported ``kv_bits`` or ``kv_group_size`` raise at the first model call
  (``maybe_quantize_kv_cache``), before any token;
- ``prompt_cache_to_host`` copies any prompt cache to numpy on the calling
  thread (bfloat16 as uint16 bits); ``HostPromptCache.save`` then writes a
  file ``load_prompt_cache`` reads from any thread without touching MLX.
"""

import importlib
import linecache
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_reduce
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ._registry import Patch, Target, class_patch, get_original, pasted_into, source_of


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


class _QuantizedKVCache:
    def __init__(self, group_size: int = 64, bits: int = 8):
        # keys, values: (packed, scales, biases), each (B, H, capacity, ...);
        # tokens [0, offset) are live, [offset, capacity) are padding.
        self.keys = None
        self.values = None
        self.offset = 0
        # As asked until the first update, then the one in use (see
        # _kv_quant_layout); head dims wider than head_dims are zero padding.
        self.group_size = group_size
        self.bits = bits
        self.dtype = None  # name of the quantized keys' dtype, e.g. "bfloat16"
        self.head_dims = None  # (k_head_dim, v_head_dim) before padding
        self.reserved = 0  # tokens expected in all; the next allocation holds them

    def update_and_fetch(self, keys, values):
        B, n_kv_heads, num_steps, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        dtype = str(keys.dtype).rpartition(".")[2]
        if (
            keys.shape[:3] != values.shape[:3]
            or keys.dtype != values.dtype
            or self.keys is not None
            and (
                (B, n_kv_heads) != self.keys[0].shape[:2]
                or (k_head_dim, v_head_dim) != tuple(self.head_dims)
                or self.dtype not in (None, dtype)
            )
        ):
            held = None
            if self.keys is not None:
                held = (*self.keys[0].shape[:2], *self.head_dims, self.dtype)
            raise ValueError(
                f"QuantizedKVCache holds (batch, heads, k_dim, v_dim, dtype) {held}; "
                f"got keys {keys.shape} {dtype} and values {values.shape} "
                f"{values.dtype}"
            )
        group_size, keys, values = _kv_quantize(
            keys, values, self.group_size, self.bits
        )
        prev = self.offset
        end = prev + num_steps

        if self.keys is None:
            self.group_size = group_size
            self.dtype = str(keys[1].dtype).rpartition(".")[2]
            self.head_dims = (k_head_dim, v_head_dim)
        capacity = 0 if self.keys is None else self.keys[0].shape[-2]
        if end > capacity or self.keys is None:
            if end <= self.reserved:
                capacity = self.reserved
            else:
                capacity = max(end, capacity + capacity // 2)
                capacity = (capacity + self.step - 1) // self.step * self.step
            if self.keys is not None:
                self._resize(capacity)
            elif capacity == num_steps:
                self.keys, self.values, self.offset = keys, values, end
                return self.keys_and_values()
            else:
                self.keys, self.values = tree_map(
                    lambda x: mx.zeros((B, n_kv_heads, capacity, x.shape[-1]), x.dtype),
                    (keys, values),
                )

        self.offset = end
        for i in range(len(self.keys)):
            self.keys[i][..., prev : self.offset, :] = keys[i]
            self.values[i][..., prev : self.offset, :] = values[i]

        return self.keys_and_values()

    def size(self):
        return self.offset

    @property
    def state(self):
        keys, values = self.keys, self.values
        if keys is not None and self.offset < keys[0].shape[-2]:
            keys, values = self.keys_and_values()
        state = (keys, values, self.offset, self.group_size, self.bits)
        # Upstream's 5 items, which it reads (the setter reads dtype and head
        # dims off the arrays), unless the head dims are zero-padded.
        if keys is not None and self.head_dims is not None:
            widths = tuple(x[0].shape[-1] * 32 // self.bits for x in (keys, values))
            if tuple(self.head_dims) != widths:
                return state + (self.dtype, self.head_dims)
        return state

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.group_size, self.bits, *meta = v
        # Upstream's state has no dtype or head dims: read them off the arrays.
        if keys is not None and not meta:
            meta = [str(keys[1].dtype).rpartition(".")[2], None]
        self.dtype, head_dims = meta or (None, None)
        if keys is not None and head_dims is None:
            head_dims = (
                keys[0].shape[-1] * 32 // self.bits,
                values[0].shape[-1] * 32 // self.bits,
            )
        self.head_dims = None if head_dims is None else tuple(head_dims)
        self.keys = None if keys is None else tuple(keys)
        self.values = None if values is None else tuple(values)
        self.reserved = 0

    @staticmethod
    def _check_state(v):
        if len(v) not in (5, 7):
            raise ValueError(f"{len(v)} state items, a QuantizedKVCache has 5 or 7")
        keys, values, offset, group_size, bits = v[:5]
        n = _check_quantized(keys, values, group_size, bits, *v[5:])
        if not 0 <= offset <= n:
            raise ValueError(f"offset {offset} is not within the {n} tokens stored")

    def trim(self, n):
        if n < 0:
            raise ValueError(f"QuantizedKVCache.trim: n must be >= 0, got {n}")
        n = min(self.offset, n)
        self.offset -= n
        return n

    def reserve(self, n):
        """Expect ``n`` tokens in all: allocate room for them at once."""
        if n < 0:
            raise ValueError(f"QuantizedKVCache.reserve: negative token count ({n})")
        self.reserved = n
        if self.keys is not None and n > self.keys[0].shape[-2]:
            self._resize(n)

    def compact(self):
        """Copy the live tokens into exactly sized buffers, freeing the old ones."""
        if self.keys is None:
            return
        if self.offset == 0:
            self.keys = self.values = None
            return
        if self.offset < self.keys[0].shape[-2]:
            self._resize(self.offset)
        mx.eval(self.keys, self.values)

    def _resize(self, capacity):
        """Move the live tokens into new buffers of ``capacity`` tokens."""

        def resize(x):
            new = mx.zeros((*x.shape[:-2], capacity, x.shape[-1]), dtype=x.dtype)
            live = x[..., : self.offset, :]
            return mx.slice_update(new, live, mx.array([0]), [2])

        self.keys = tuple(resize(x) for x in self.keys)
        self.values = tuple(resize(x) for x in self.values)

    def to_kv_cache(self) -> "KVCache":
        """The live tokens dequantized into a ``KVCache`` of the original dtype."""
        kv_cache = KVCache()
        if self.keys is None or self.offset == 0:
            return kv_cache
        keys, values = self.keys_and_values()
        dtype = getattr(mx, self.dtype)
        k_head_dim, v_head_dim = self.head_dims
        keys = mx.dequantize(*keys, group_size=self.group_size, bits=self.bits)
        values = mx.dequantize(*values, group_size=self.group_size, bits=self.bits)
        kv_cache.keys = keys[..., :k_head_dim].astype(dtype)
        kv_cache.values = values[..., :v_head_dim].astype(dtype)
        kv_cache.offset = self.offset
        return kv_cache

    def quantizes_with(self, group_size):
        """Whether asking for ``group_size`` gives the group size this cache
        holds, which may have been lowered to divide its head dims."""
        if self.head_dims is None:
            return group_size == self.group_size
        layout = _kv_quant_layout(*self.head_dims, group_size, self.bits)
        return layout[0] == self.group_size

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)


class _ChunkedKVCache:
    def trim(self, n):
        if n < 0:
            raise ValueError(f"ChunkedKVCache.trim: n must be >= 0, got {n}")
        n = min(self.offset - self.start_position, n)
        self.offset -= n
        return n


def _check_kv_quantization(kv_bits, kv_group_size):
    """Refuse what ``mx.quantize`` cannot do at the first model call, not
    when the cache reaches ``quantized_kv_start`` tokens."""
    if kv_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(
            f"kv_bits (--kv-bits) must be 2, 3, 4, 5, 6 or 8, got {kv_bits}"
        )
    if kv_group_size not in (32, 64, 128):
        raise ValueError(
            f"kv_group_size (--kv-group-size) must be 32, 64 or 128, got {kv_group_size}"
        )


def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    if kv_bits is None:
        return
    _check_kv_quantization(kv_bits, kv_group_size)
    for e, c in enumerate(prompt_cache):
        if hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
            prompt_cache[e] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def _generate_main():
    """Upstream's ``generate.main`` (its fingerprint pins the source), its
    ``--kv-group-size`` check asking the loaded cache (``quantizes_with``):
    a file whose group size was lowered to fit its head dims is accepted."""
    module = importlib.import_module("mlx_lm.generate")
    old = "if args.kv_group_size != prompt_cache[0].group_size:"
    new = "if not prompt_cache[0].quantizes_with(args.kv_group_size):"
    source = source_of(get_original("mlx_lm.generate", "main")).replace(old, new)
    # Registered with linecache so that inspect finds the source, as for a file.
    name = "<mlx_lm_patched.quantized_cache: generate.main>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {}
    exec(compile(source, name, "exec"), vars(module), namespace)
    return namespace["main"]


class _KVCache:
    def trim(self, n):
        if n < 0:
            raise ValueError(f"{type(self).__name__}.trim: n must be >= 0, got {n}")
        n = min(self.offset, n)
        self.offset -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        quant_cache = QuantizedKVCache(group_size=group_size, bits=bits)
        if self.keys is not None and self.offset > 0:
            quant_cache.reserve(self.offset)
            quant_cache.update_and_fetch(
                self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
            )
        return quant_cache


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
    """Attention over a quantized cache, at most ``block_bytes`` of scores at a
    time: a long prefill chunk's scores outgrow the cache otherwise (#1587)."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads

    queries *= scale

    # A QuantizedKVCache zero-pads head dims no group size divides (keys and
    # values alike): pad the queries to match, drop the padding from the output.
    width = q_keys[0].shape[-1] * 32 // bits
    if width > D:
        queries = mx.pad(queries, [(0, 0), (0, 0), (0, 0), (0, width - D)])

    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, width))
        q_keys = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_keys)
        q_values = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_values)

    kL = q_keys[0].shape[-2]
    if isinstance(mask, str):
        q_indices = mx.arange(kL - L, kL)
        k_indices = mx.arange(kL)
        mask = q_indices[:, None] >= k_indices[None]
    if mask is not None and n_repeats > 1 and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)

    rows = max(1, block_bytes // (B * n_q_heads * kL * queries.dtype.size))
    out = []
    for i in range(0, L, rows):
        scores = mx.quantized_matmul(
            queries[..., i : i + rows, :],
            *q_keys,
            transpose=True,
            group_size=group_size,
            bits=bits,
        )
        if mask is not None:
            rowwise = mask.ndim > 1 and mask.shape[-2] > 1
            m = mask[..., i : i + rows, :] if rowwise else mask
            if m.dtype == mx.bool_:
                scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
            else:
                scores += m
        scores = mx.softmax(scores, axis=-1, precise=True)
        out.append(
            mx.quantized_matmul(
                scores, *q_values, transpose=False, group_size=group_size, bits=bits
            )
        )
        if rows < L:
            mx.eval(out[-1])  # lazily, every block's scores would be alive at once
    out = out[0] if len(out) == 1 else mx.concatenate(out, axis=-2)

    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, -1))
    if width > D:
        out = out[..., :D]

    return out


@dataclass
class HostPromptCache:
    """A prompt cache copied to host memory, for serializing on any thread.

    ``arrays`` are numpy copies of the state arrays, bfloat16 as its uint16
    bits; ``dtypes`` names each array's MLX dtype; ``metadata`` is what
    ``save_prompt_cache`` writes. ``save`` uses no MLX.
    """

    arrays: Dict[str, Any]
    dtypes: Dict[str, str]
    metadata: Dict[str, str]

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.arrays.values())

    def save(self, file_name: str):
        """Write a ``.safetensors`` file that ``load_prompt_cache`` reads."""
        import json

        codes = {
            "bool": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32",
            "uint64": "U64", "int8": "I8", "int16": "I16", "int32": "I32",
            "int64": "I64", "float16": "F16", "bfloat16": "BF16",
            "float32": "F32", "float64": "F64",
        }  # fmt: skip
        header = {"__metadata__": self.metadata}
        start = 0
        for k, a in self.arrays.items():
            dtype = codes[self.dtypes[k]]
            header[k] = {"dtype": dtype, "shape": list(a.shape)}
            header[k]["data_offsets"] = [start, start + a.nbytes]
            start += a.nbytes
        header = json.dumps(header).encode()
        header += b" " * (-len(header) % 8)
        with open(file_name, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for a in self.arrays.values():
                f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def prompt_cache_to_host(
    cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> HostPromptCache:
    """Evaluate ``cache`` and copy its state to numpy, on the calling thread."""
    import numpy as np

    scalars = [""]  # as in save_prompt_cache
    arrays, dtypes = {}, {}
    for k, data in tree_flatten([c.state for c in cache]):
        if isinstance(data, (int, float, bool)):
            scalars.append((k, "scalar"))
            data = mx.array(data)
        elif isinstance(data, str):
            scalars.append((k, "string"))
            data = mx.array([ord(char) for char in data])
        elif data is None:
            scalars.append((k, "none"))
            data = mx.array([])
        elif not isinstance(data, mx.array):
            raise ValueError(f"Model state is not serializable: {data}")
        dtypes[k] = str(data.dtype).rpartition(".")[2]
        if data.dtype == mx.bfloat16:
            data = data.view(mx.uint16)
        arrays[k] = data
    mx.eval(list(arrays.values()))
    arrays = {k: np.array(a) for k, a in arrays.items()}
    classes = [type(c).__name__ for c in cache]
    cache_metadata = dict(tree_flatten([metadata or {}, classes, scalars]))
    return HostPromptCache(arrays, dtypes, cache_metadata)


def prompt_cache_from_host(host: HostPromptCache, return_metadata=False):
    """The prompt cache ``prompt_cache_to_host`` copied, bit for bit."""
    arrays = {
        k: mx.array(a).view(getattr(mx, host.dtypes[k])) for k, a in host.arrays.items()
    }
    cache, metadata = _prompt_cache_from_arrays(arrays, host.metadata, "host snapshot")
    if return_metadata:
        return cache, metadata
    return cache


_kv_quant_layout = pasted_into("mlx_lm.models.cache", _kv_quant_layout)
_kv_quantize = pasted_into("mlx_lm.models.cache", _kv_quantize)
_check_quantized = pasted_into("mlx_lm.models.cache", _check_quantized)
prompt_cache_to_host = pasted_into("mlx_lm.models.cache", prompt_cache_to_host)
prompt_cache_from_host = pasted_into("mlx_lm.models.cache", prompt_cache_from_host)
quantized_scaled_dot_product_attention = pasted_into(
    "mlx_lm.models.base", quantized_scaled_dot_product_attention
)


PATCH = Patch(
    "quantized_cache",
    "QuantizedKVCache: live size, compaction, geometric growth, dequantized and "
    "host export, bit-exact save/load, any head dim",
    [
        Target("mlx_lm.models.cache", "_kv_quant_layout", _kv_quant_layout, None),
        Target("mlx_lm.models.cache", "_kv_quantize", _kv_quantize, None),
        Target("mlx_lm.models.cache", "_check_quantized", _check_quantized, None),
        Target("mlx_lm.models.cache", "HostPromptCache", HostPromptCache, None),
        Target(
            "mlx_lm.models.cache", "prompt_cache_to_host", prompt_cache_to_host, None
        ),
        Target(
            "mlx_lm.models.cache",
            "prompt_cache_from_host",
            prompt_cache_from_host,
            None,
        ),
        Target(
            "mlx_lm.models.base",
            "quantized_scaled_dot_product_attention",
            quantized_scaled_dot_product_attention,
            "f42bc5d03992",
        ),
    ]
    + class_patch(
        "mlx_lm.models.cache:QuantizedKVCache",
        _QuantizedKVCache,
        {
            "__init__": "c8217697b4c0",
            "update_and_fetch": "5096c112dfde",
            "size": "6b9dbb3b7aa4",
            "state": "069c07781538",
            "_check_state": None,
            "trim": "6ebc79648024",
            "reserve": None,
            "compact": None,
            "_resize": None,
            "to_kv_cache": None,
            "quantizes_with": None,
            "nbytes": "82f80ece693d",
        },
    )
    + class_patch(
        "mlx_lm.models.cache:KVCache",
        _KVCache,
        {"to_quantized": "c6f6b9bc51f5", "trim": "6ebc79648024"},
    )
    # Every cache rejects a negative trim (upstream's grow the offset).
    + [
        Target(
            "mlx_lm.models.cache:ConcatenateKVCache",
            "trim",
            pasted_into("mlx_lm.models.cache", _KVCache.trim),
            "6ebc79648024",
        )
    ]
    + class_patch(
        "mlx_lm.models.cache:ChunkedKVCache", _ChunkedKVCache, {"trim": "559a164e9c37"}
    )
    # Unsupported --kv-bits or --kv-group-size fail at the first model call.
    + [
        Target(
            "mlx_lm.generate",
            "_check_kv_quantization",
            pasted_into("mlx_lm.generate", _check_kv_quantization),
            None,
        ),
        Target(
            "mlx_lm.generate",
            "maybe_quantize_kv_cache",
            pasted_into("mlx_lm.generate", maybe_quantize_kv_cache),
            "ecf45153d6a6",
        ),
        Target("mlx_lm.generate", "main", _generate_main(), "1830d4c1a9b7"),
    ],
    requires=("prompt_cache_files",),
)
