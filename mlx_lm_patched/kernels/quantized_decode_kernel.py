"""A decode kernel over the packed quantized cache, CUDA only.

Upstream's ``quantized_scaled_dot_product_attention`` fails on MLX's CUDA
backend (``quantized_matmul`` has no kernel for a cache's keys), and
dequantizing a layer's whole cache for one query (``quantized_attention``'s
road) made ``--kv-bits 8`` decode at 0.40x the bfloat16 cache's tokens per
second and 4 bits at 0.56x (H200, Llama-8B shape, 16k tokens).

Up to ``DECODE_MAX_QUERIES`` queries (a decode step) on CUDA go through
``quantized_decode_attention``: an ``mx.fast.cuda_kernel`` (compiled at
first use) that reads the packed keys and values in place (uint32 words,
scales and biases in the cache dtype, any strides: the cache's slices are
views, which ``ensure_row_contiguous=False`` passes without a copy),
dequantizes them in registers and attends flash-decoding style: the keys
are cut into ``decode_splits`` ranges, a block a range and KV head keeps a
running max, sum and output for the query heads of that KV head (each key
read once for all of them), and a second kernel merges the ranges (over a
cache's decode step the tensor-core kernel's last block of a KV head's
ranges merges them: ``DECODE_MERGE``). Up to 8
query rows a KV head over head dims 64 and 128 (a decode step of GQA up to
8) take tensor-core products (``quantized_decode_mma``: the keys' integers
are exact in f16, so only the values times their scales and the
probabilities are rounded, to f16); other shapes a kernel of float lanes
(``quantized_decode_source``). Bits 4 and 8, group sizes 32/64/128, head
dims up to 128 (80 as the cache pads it, to 96), boolean or additive mask
arrays (a ring's sinks and wrap, a batch's padding) or "causal".
``quantized_decode_reference`` has its arithmetic in ``mx`` ops, which
tests check on CPU; ``python -m mlx_lm_patched.bench qdecode`` checks the
kernels on a GPU. On an H100 (ncu, 32 query heads over 8, head dim 128)
the tensor-core kernel takes 40 / 60 us a layer at 16k / 32k 8-bit keys,
the float one 51 / 76, fused attention over the bfloat16 cache 36 / 60;
decode ran at 0.64-0.92x the bfloat16 cache's tokens per second (4k-32k),
bound by the cache's update (a quantize and six writes a layer against two
writes) and the host. A ``QuantizedKVCache`` decode step now hands the
kernels its whole buffers, its tail of unquantized tokens and their
lengths as an array's shape (``QuantizedKVCache._tail_update``): 0.88-1.05x.
The tail is one more range, read by a block of its own in float32
(``tail_range``), so the merge kernel only merges: it took 11-22 us a layer
with the tail in it (H200, by the tail's length), 5.4-6.1 without.
Over a cache's decode step (a ``_TailFetch``) the tail's block also reads
the step's tokens where they are and writes the tail with them (two more
outputs, ``write_tail``), which the cache keeps: the two slice writes a
layer it replaces took 0.8 ms of a step's 3.0 ms of MLX launches (H200,
8 bits, 4k), and add 0-3 us a layer to the kernel (ncu, 4k-32k).
``MLX_LM_PATCHED_DECODE_KERNEL=0`` keeps the old road (and no tail).
Prefill chunks keep the road above. Metal and CPU are untouched.
"""

import hashlib
import math
import os
import tempfile

import mlx.core as mx

from .._registry import Patch, pasted_into, targets
from .quantized_decode_mma import _DECODE_MMA
from .quantized_decode_source import (
    _DECODE_DEFINES,
    _DECODE_HEADER,
    _DECODE_PARTIAL,
    _DECODE_REDUCE,
)

# Query rows (query heads of a KV head times queries) a block keeps at once.
DECODE_ROWS = 4
# Longest query block the kernel takes; longer ones go through fused
# attention over dequantized keys. On an H100 (32 query heads over 8, head
# dim 128, 32 layers each taking the last one's output) 8 queries over 4k /
# 32k 8-bit keys took 0.14 / 0.59 ms a layer, 0.16 / 0.89 that way (4 bits:
# 0.15 / 0.59 against 0.17 / 0.80); past 8 untried.
DECODE_MAX_QUERIES = 8
# Blocks to aim for in the first kernel (H100: fewer did not fill it).
DECODE_BLOCKS = 256
DECODE_MIN_KEYS = 64
# Keys a group of lanes loads before using them (loads in flight), whether
# it loads the next ones before using these, and dims a lane dequantizes (8
# or 16: 16 halves a key's lanes, so its shuffles and exponentials). H100,
# ncu, 32 query heads over 8, 32k keys, q8 / q4: 8 dims and 4 keys 87 / 84
# us, 16 and 4 78 / 74, 16 and 2 74 / 73 (4k keys: 29, 32, 31); 512 or
# 1024 blocks were slower.
DECODE_KEYS_PER_ITER = 2
# Set, the tensor-core kernel's warps also load their next 16 keys (not
# their values) before using these. H100, ncu, 3 runs each, 33 tail tokens,
# 4k / 16k / 32k keys: q8 29.0 / 47.4 / 72.0 us a layer unset, 27.9 / 41.5 /
# 61.6 set (q4: 29.5 / 57.2 / 68.8 against 29.1 / 54.1 / 65.3).
DECODE_PREFETCH = True
DECODE_DIMS_PER_LANE = 16
# Whether query blocks of up to 8 rows over head dims 64 or 128 take the
# tensor-core kernel (``_DECODE_MMA``) rather than the one above. H100,
# ncu, 32 query heads over 8, 4k / 16k / 32k keys, q8: 28.9 / 40.5 / 60.1
# us against 31.9 / 51.3 / 76.2 (q4: 27.8 / 42.4 / 65.2); at 512 blocks
# instead of 256 it was slower (46-68 us at 16k-32k).
DECODE_MMA = True
# Warps a block of the tensor-core kernel. H200, 32 layers chained, 32
# query heads over 8, 4k / 16k / 32k 8-bit keys: 4 warps 114 / 125 / 146 us
# a layer, 8 warps 113 / 133 / 166 (4 bits: 118 / 132 / 149 against 119 /
# 137 / 154).
DECODE_MMA_WARPS = 4
# Whether the tensor-core kernel merges a cache's decode step's ranges
# itself (the last block of a KV head's ranges, counted by the cache's
# counters, which the kernel leaves at zero: merge_ranges) rather than a
# second kernel doing it: a call's host time (H200, one process taking
# turns: decode 1.02-1.09x faster, q8 and q4, 4k-32k; ncu: the same GPU time).
# Only the call on a cache's step whose tail the cache keeps counts on the
# cache's counters: those kernels run one after another (each reads the
# tail the last wrote). Two attention calls over one fetch, evaluated
# together, might run at once (H200: they did, and merged wrongly), so
# the second keeps the merge kernel.
DECODE_MERGE = True

_cuda_kernels = mx.cuda.is_available()
# MLX_LM_PATCHED_DECODE_KERNEL=0 keeps the old road; read at import, as
# QuantizedKVCache.decode_tail reads it (a lookup a call took 0.5 us).
_decode_kernel_env = os.environ.get("MLX_LM_PATCHED_DECODE_KERNEL", "1") != "0"

_decode_kernels = {}
_decode_constants = {}
_CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
_decode_launches = {}


def _decode_kernel(name, template):
    """The kernel ``name`` ("partial", "mma" or "reduce") with ``template``'s
    constants compiled in, made once: a launch then converts no template
    arguments, and its source (which MLX hashes at every launch) has no
    comments or indentation."""
    key = (name, tuple(template))
    if key not in _decode_kernels:
        inputs = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "nk", "nv"]
        inputs += ["lens", "mask", "cnt"]
        write, merge = dict(template).get("WT"), dict(template).get("MERGE")
        outputs = ["partials", "tko", "tvo"] if write else ["partials"]
        outputs += ["out"] if merge else []
        header = _DECODE_HEADER
        if name == "reduce":
            inputs, outputs, header = ["partials"], ["out"], _DECODE_DEFINES
        source = {"partial": _DECODE_PARTIAL, "mma": _DECODE_MMA}
        source = source.get(name, _DECODE_REDUCE)
        constants = [
            (
                f"using {k} = {_CUDA_TYPES[v]};"
                if isinstance(v, mx.Dtype)
                else f"constexpr {type(v).__name__} {k} = {_c_value(v)};"
            )
            for k, v in template
        ]
        if name == "mma" and not merge:  # merge_ranges', unused
            constants.append("float* const out = nullptr;")
        if name != "reduce" and not write:  # tail_range's, unused
            constants.append(
                "cuda::std::remove_const_t<cuda::std::remove_pointer_t<decltype(tk)>>"
                "* const tko = nullptr, * const tvo = nullptr;"
            )
        header, source = _minified(header), _minified(source)
        # MLX passes an input's shape, strides or ndim where the source
        # names them; an #include of the rest names none.
        named = [f"{n}_{x}" for n in inputs for x in ("shape", "strides", "ndim")]
        text = header + source
        named = [f"(void){x};" for x in named if x in text]
        _decode_kernels[key] = mx.fast.cuda_kernel(
            name=f"qkv_decode_{name}_{len(_decode_kernels)}",
            input_names=inputs,
            output_names=outputs,
            source="\n".join(constants + named) + "\n" + _source_file(source),
            header=_source_file(header),
            ensure_row_contiguous=False,
        )
    return _decode_kernels[key]


def _source_file(source):
    """An ``#include`` of ``source`` from a file named by its hash, written
    once to ``MLX_LM_PATCHED_CUDA_DIR`` (by default
    ``~/.cache/mlx_lm_patched/cuda``), or ``source`` itself where no such
    file can be written or the directory is not this user's alone: MLX
    copies a custom kernel's source at each call and hashes it at each
    launch (H200: 4 us a launch more with 17 KB than with none)."""
    folder = os.environ.get("MLX_LM_PATCHED_CUDA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "mlx_lm_patched", "cuda"
    )
    folder = os.path.abspath(folder)
    name = hashlib.sha256(source.encode()).hexdigest()[:32] + ".cuh"
    path = os.path.join(folder, name)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
        if st.st_uid != os.getuid() or st.st_mode & 0o022 or '"' in path:
            return source
        with open(path, "a+") as f:  # made here if missing
            f.seek(0)
            kept = f.read() == source
        if not kept:
            fd, temporary = tempfile.mkstemp(dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(temporary, path)
    except OSError:
        return source
    return f'#include "{path}"\n'


def _minified(source):
    """``source`` without blank lines, comment lines or indentation."""
    lines = (x.strip() for x in source.splitlines())
    return "\n".join(x for x in lines if x and not x.startswith("//")) + "\n"


def _c_value(v):
    """``v`` (an int, bool or float) as a C++ constant expression; a float as
    the double it is (a hexadecimal literal: exact), which a ``float``
    constant rounds as ``mx.array(v, mx.float32)`` does."""
    if not isinstance(v, float):
        return str(v).lower()
    if math.isfinite(v):
        return v.hex()
    limit = "quiet_NaN" if math.isnan(v) else "infinity"
    return f"{'-' * (v < 0)}cuda::std::numeric_limits<float>::{limit}()"


def _decode_constant(value, dtype):
    """A one-element array, made once (a decode step makes no new ones):
    inputs the kernels do not read. MLX keeps it in managed memory, where a
    kernel's read cost 9-14 us a layer (see ``_decode_launch``'s scale)."""
    key = (value, dtype)
    if key not in _decode_constants:
        _decode_constants[key] = mx.array([[[[value]]]], dtype)
    return _decode_constants[key]


def decode_splits(B, n_kv_heads, kL, row_chunks=1):
    """Key ranges a decode step's keys are cut into: about ``DECODE_BLOCKS``
    blocks in all, each of ``DECODE_MIN_KEYS`` keys or more."""
    blocks = max(1, B * n_kv_heads * row_chunks)
    splits = max(1, DECODE_BLOCKS // blocks)
    return max(1, min(splits, kL // DECODE_MIN_KEYS))


def use_decode_kernel(queries, bits) -> bool:
    """Whether a call goes through the kernel: MLX's CUDA backend (never
    Metal or CPU), a short query block, head dims up to 128, 4 or 8 bits,
    half-precision queries. Setting
    ``MLX_LM_PATCHED_DECODE_KERNEL=0`` before import keeps every call on
    fused attention over dequantized keys."""
    _, _, L, D = queries.shape
    return (
        _cuda_kernels
        and _decode_kernel_env
        and L <= DECODE_MAX_QUERIES
        and D <= 128
        and bits in (4, 8)
        and queries.dtype in (mx.bfloat16, mx.float16)
    )


def _decode_launch(
    B,
    n_q_heads,
    L,
    D,
    n_kv_heads,
    width,
    bits,
    group_size,
    kind,
    causal,
    splits,
    dtype,
    scale,
    tail=1,
    tail_dtype=None,
    merge=False,
):
    """Which first kernel, and the two kernels (``template``, ``kernel``, the
    ``call``'s arguments) for one shape, made once (a decode step's Python is
    most of its time on a fast GPU); ``scale``, compiled in: read from a
    one-element array, which MLX keeps in managed memory, it cost every
    layer 9-14 us of GPU time (H200, 32 layers of 8-bit keys, one CUDA
    graph: 33.6 / 62.8 us a layer at 4k / 32k keys, 25.1 / 49.2 with the
    array in device memory); ``tail``: the tokens a cache's tail
    holds (1 without one); ``tail_dtype``: its dtype where the first kernel
    writes it with the step's tokens (a ``_TailFetch``), else None;
    ``merge``: whether the tensor-core kernel merges its ranges itself
    (counted by the cache's counters; no second kernel then)."""
    key = (
        *(B, n_q_heads, L, D, n_kv_heads, width, bits, group_size, kind, causal),
        *(splits, dtype, scale, tail, tail_dtype, merge, DECODE_KEYS_PER_ITER),
        *(DECODE_PREFETCH, DECODE_DIMS_PER_LANE, DECODE_ROWS, DECODE_MMA),
        DECODE_MMA_WARPS,
    )
    launch = _decode_launches.get(key)
    if launch is not None:
        return launch
    n_repeats = n_q_heads // n_kv_heads
    rows = n_repeats * L
    mma = _decode_mma(rows, width)
    rc = rows if mma else min(DECODE_ROWS, rows)
    dpl = DECODE_DIMS_PER_LANE
    template = [("BITS", bits), ("GS", group_size), ("W", width), ("D", D)]
    template += [("NREP", n_repeats), ("NQ", L), ("MASK", kind), ("CAUSAL", causal)]
    template += [("SC", float(scale)), ("TAIL", tail), ("WT", tail_dtype is not None)]
    template.append(("PF", DECODE_PREFETCH))
    merge = mma and merge
    if mma:
        template += [("NW", DECODE_MMA_WARPS), ("MERGE", merge)]
    else:
        template += [("RC", rc), ("DPL", dpl)]
        template.append(("TPK", 1 << (-(-width // dpl) - 1).bit_length()))
        template.append(("KT", DECODE_KEYS_PER_ITER))
    first = "mma" if mma else "partial"
    threads = 32 * DECODE_MMA_WARPS if mma else 128
    parts = splits + (tail > 1)  # a tail's block after the ranges'
    partial = dict(
        template=template,
        kernel=_decode_kernel(first, template) if _cuda_kernels else None,
        call=dict(
            grid=(parts * threads, n_kv_heads, B * -(-rows // rc)),
            threadgroup=(threads, 1, 1),
            output_shapes=[(B, n_kv_heads, parts, rows * (width + 2))],
            output_dtypes=[mx.float32],
        ),
    )
    if tail_dtype is not None:  # the tail, written
        partial["call"]["output_shapes"] += [(B, n_kv_heads, tail, D)] * 2
        partial["call"]["output_dtypes"] += [tail_dtype] * 2
    if merge:  # the output: no second kernel
        partial["call"]["output_shapes"].append((B, n_q_heads, L, D))
        partial["call"]["output_dtypes"].append(dtype)
        _decode_launches[key] = first, partial, None
        return _decode_launches[key]
    template = [("NREP", n_repeats), ("NQ", L), ("W", width), ("D", D), ("T", dtype)]
    template.append(("MAX_SPLITS", max(parts, DECODE_BLOCKS)))
    reduce = dict(
        template=template,
        kernel=_decode_kernel("reduce", template) if _cuda_kernels else None,
        call=dict(
            grid=(width, n_kv_heads * rows, B),
            threadgroup=(width, 1, 1),
            output_shapes=[(B, n_q_heads, L, D)],
            output_dtypes=[dtype],
        ),
    )
    _decode_launches[key] = first, partial, reduce
    return _decode_launches[key]


def _decode_mma(rows, width) -> bool:
    """Whether the tensor-core kernel takes these query rows (of a KV head)
    and cache width."""
    return DECODE_MMA and rows <= 8 and width in (64, 128)


def quantized_decode_attention(
    queries, q_keys, q_values, scale, mask, group_size, bits, splits=None
):
    """Attention of a few queries over a quantized cache, with the kernel.
    ``q_keys``, ``q_values``: ``(packed, scales, biases)``, or with a
    ``QuantizedKVCache``'s tail and lengths after them (the whole buffers:
    ``QuantizedKVCache._tail_update``); where the tail is written lazily (a
    ``_TailFetch``), the first kernel reads the step's tokens where they are
    and writes the tail, which the cache takes (``_wrote_tail``)."""
    B, n_q_heads, L, D = queries.shape
    fetched, tail_dtype, merge = q_keys, None, False
    if hasattr(fetched, "before"):
        tk, nk, tv, nv = q_keys.before, q_keys.new, q_values.before, q_values.new
        tail_dtype = tk.dtype
        # The call whose tail the cache keeps (the first on this fetch): the
        # cache's next step reads that tail, so the kernels counting on its
        # counters run one after another.
        merge = DECODE_MERGE and fetched.cache._keeps(fetched)
        q_keys, q_values = q_keys[:3], q_values[:3]
        lengths, tail = fetched[4], tk.shape[2]
    elif len(q_keys) == 5:
        *q_keys, tk, lengths = q_keys
        *q_values, tv, _ = q_values
        tail, nk, nv = tk.shape[2], tk, tv
    else:  # lengths of shape (1, ...): the kernels take the views' own
        tk = tv = nk = nv = _decode_constant(0, queries.dtype)
        lengths, tail = _decode_constant(0, mx.int32), 1
    _, n_kv_heads, kL, packed = q_keys[0].shape
    rows = n_q_heads // n_kv_heads * L
    chunks = 1 if _decode_mma(rows, packed * 32 // bits) else -(-rows // DECODE_ROWS)
    splits = splits or decode_splits(B, n_kv_heads, kL, chunks)
    causal = isinstance(mask, str)
    if mask is None or causal:
        kind, mask = 0, _decode_constant(False, mx.bool_)
    else:
        kind = 1 if mask.dtype == mx.bool_ else 2
        while mask.ndim < 4:
            mask = mask[None]
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, mask.shape[-1]))  # strides 0
    first, partial, reduce = _decode_launch(
        B,
        n_q_heads,
        L,
        D,
        n_kv_heads,
        packed * 32 // bits,
        bits,
        group_size,
        kind,
        causal,
        splits,
        queries.dtype,
        scale,
        tail,
        tail_dtype,
        merge,
    )
    # Merged in the first kernel (no reduce), counted on the cache's counters.
    counters = _decode_constant(0, mx.uint32) if reduce else fetched.cache._counters
    inputs = [queries, *q_keys, *q_values, tk, tv, nk, nv, lengths, mask, counters]
    parts = partial["kernel"](inputs=inputs, **partial["call"])
    if tail_dtype is not None:
        fetched.cache._wrote_tail(fetched, *parts[1:3])
    if reduce is None:
        return parts[3]
    return reduce["kernel"](inputs=parts[:1], **reduce["call"])[0]


# Written as they read in mlx_lm/models/base.py, and run from there.
_decode_kernel = pasted_into("mlx_lm.models.base", _decode_kernel)
_source_file = pasted_into("mlx_lm.models.base", _source_file)
_minified = pasted_into("mlx_lm.models.base", _minified)
_c_value = pasted_into("mlx_lm.models.base", _c_value)
_decode_constant = pasted_into("mlx_lm.models.base", _decode_constant)
_decode_launch = pasted_into("mlx_lm.models.base", _decode_launch)
_decode_mma = pasted_into("mlx_lm.models.base", _decode_mma)
decode_splits = pasted_into("mlx_lm.models.base", decode_splits)
use_decode_kernel = pasted_into("mlx_lm.models.base", use_decode_kernel)
quantized_decode_attention = pasted_into(
    "mlx_lm.models.base", quantized_decode_attention
)

PATCH = Patch(
    "quantized_decode_kernel",
    "quantized_decode_attention: a flash-decoding kernel over the packed "
    "quantized cache for CUDA decode steps",
    targets(
        "mlx_lm.models.base",
        hashlib,
        math,
        os,
        tempfile,
        _decode_kernel,
        _source_file,
        _minified,
        _c_value,
        _decode_constant,
        _decode_launch,
        _decode_mma,
        decode_splits,
        use_decode_kernel,
        quantized_decode_attention,
        DECODE_ROWS=DECODE_ROWS,
        DECODE_MAX_QUERIES=DECODE_MAX_QUERIES,
        DECODE_BLOCKS=DECODE_BLOCKS,
        DECODE_MIN_KEYS=DECODE_MIN_KEYS,
        DECODE_KEYS_PER_ITER=DECODE_KEYS_PER_ITER,
        DECODE_PREFETCH=DECODE_PREFETCH,
        DECODE_DIMS_PER_LANE=DECODE_DIMS_PER_LANE,
        DECODE_MMA=DECODE_MMA,
        DECODE_MMA_WARPS=DECODE_MMA_WARPS,
        DECODE_MERGE=DECODE_MERGE,
        _cuda_kernels=_cuda_kernels,
        _decode_kernel_env=_decode_kernel_env,
        _CUDA_TYPES=_CUDA_TYPES,
        _DECODE_DEFINES=_DECODE_DEFINES,
        _DECODE_HEADER=_DECODE_HEADER,
        _DECODE_PARTIAL=_DECODE_PARTIAL,
        _DECODE_REDUCE=_DECODE_REDUCE,
        _DECODE_MMA=_DECODE_MMA,
        _decode_kernels=_decode_kernels,
        _decode_constants=_decode_constants,
        _decode_launches=_decode_launches,
    ),
)
