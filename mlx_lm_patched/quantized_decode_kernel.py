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
not copied), dequantizes them in registers and attends flash-decoding
style: the keys are cut into ``decode_splits`` ranges, a block a range and
KV head keeps a running max, sum and output for the query heads of that KV
head (each key read once for all of them), and a second kernel merges the
ranges. Bits 4 and 8, group sizes 32/64/128, head dims up to 128 (80 as
the cache pads it, to 96), boolean or additive mask arrays (a ring's sinks
and wrap, a batch's padding) or "causal". ``decode_attention_reference`` is
its arithmetic in ``mx`` ops, which tests check on CPU; ``python -m
mlx_lm_patched.bench qdecode`` checks the kernel on a GPU. On an H100
(Llama-8B shape, 4k / 16k / 32k tokens, 256 greedy steps) 8-bit decode
went from 0.65 / 0.54 / 0.41x the bfloat16 cache's tokens per second to
0.91 / 0.92 / 0.91x, 4 bits from 0.81 / 0.61 / 0.49x to 0.77 / 0.93 /
0.99x, with the same greedy tokens at 16k and 32k (other runs on other
H100s: 0.53-0.82x at 4k). The kernel's attention alone still takes
1.3-1.6x the fused bfloat16 kernel's (0.12 against 0.077 ms a layer at
32k), its host side 10x (0.025 against 0.003 ms), and the quantized
cache's update costs about 2 ms a step more than ``KVCache``'s. ``MLX_LM_PATCHED_DECODE_KERNEL=0`` keeps the old road.
Prefill chunks keep the road above. Metal and CPU are untouched.
"""

import math
import os

import mlx.core as mx

from ._registry import Patch, pasted_into, targets

# The decode kernel, CUDA only (``use_decode_kernel``): see
# ``quantized_decode_attention``.

# Query rows (query heads of a KV head times queries) a block keeps at once.
DECODE_ROWS = 4
# Longest query block the kernel takes; longer ones go through fused
# attention over dequantized keys. On an H100 (32 query heads over 8, head
# dim 128, 32 layers each taking the last one's output) 8 queries over 4k /
# 32k 8-bit keys took 0.14 / 0.59 ms a layer, 0.16 / 0.89 that way (4 bits:
# 0.15 / 0.59 against 0.17 / 0.80); past 8 untried.
DECODE_MAX_QUERIES = 8
# Blocks to aim for in the first kernel (the fastest of 128 to 1024 on an
# H100, 4 to 8 query heads over 8 KV heads: fewer did not fill it).
DECODE_BLOCKS = 256
DECODE_MIN_KEYS = 64
# Keys a group of lanes loads before using them (loads in flight), and
# whether it loads the next ones before using these.
DECODE_KEYS_PER_ITER = 4
DECODE_PREFETCH = True

_cuda_kernels = mx.cuda.is_available()

_DECODE_HEADER = """
#define LOWEST (-3.402823466e+38f)
#define NEG_INF (__int_as_float(0xff800000))

// 8 quantized values of a lane as floats: each one's bits under float
// 2^23's mantissa, less 2^23 (full-rate ops; an integer conversion is not).
template <int BITS>
__device__ __forceinline__ void unpack8(const uint32_t* w, float* out) {
  if constexpr (BITS == 8) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        out[4 * j + i] =
            __uint_as_float(__byte_perm(w[j], 0x4B000000u, 0x7440 + i)) - 8388608.f;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      out[i] = __uint_as_float(((w[0] >> (4 * i)) & 0xfu) | 0x4B000000u) - 8388608.f;
    }
  }
}
"""

# One block: 128 threads, groups of TPK lanes a key, 8 dims a lane; the
# block's keys are [split * per, (split + 1) * per), its rows those of
# blockIdx.z's chunk of DECODE_ROWS.
_DECODE_PARTIAL = """
  constexpr int R = NREP * NQ;
  constexpr int WPT = BITS / 4;
  constexpr int NG = 128 / TPK;
  constexpr int NRC = (R + RC - 1) / RC;
  const int split = blockIdx.x, n_splits = gridDim.x;
  const int kvh = blockIdx.y, b = blockIdx.z / NRC, rc = blockIdx.z % NRC;
  const int group = threadIdx.x / TPK, lane = threadIdx.x % TPK;
  const int kL = kw_shape[2], D = q_shape[3];
  const int d0 = lane * 8;
  const bool active = d0 < W;
  const float sc = scale[0];
  const int per = (kL + n_splits - 1) / n_splits;
  const int k_begin = split * per, k_end = min(kL, k_begin + per);

  float qr[RC][8], qsum[RC], m[RC], l[RC], acc[RC][8], accb[RC];
#pragma unroll
  for (int r = 0; r < RC; r++) {
    const int row = rc * RC + r;
    const int h = kvh * NREP + row / NQ, t = row % NQ;
    qsum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int d = d0 + i;
      float x = 0.f;
      if (row < R && d < D) {
        x = float(q[b * q_strides[0] + h * q_strides[1] + t * q_strides[2] +
                    d * q_strides[3]]) * sc;
      }
      qr[r][i] = x;
      qsum[r] += x;
      acc[r][i] = 0.f;
    }
    m[r] = LOWEST;
    l[r] = 0.f;
    accb[r] = 0.f;
  }

  const int g = d0 / GS;
  const uint32_t* kw_p = kw + b * kw_strides[0] + kvh * kw_strides[1] + lane * WPT * kw_strides[3];
  const uint32_t* vw_p = vw + b * vw_strides[0] + kvh * vw_strides[1] + lane * WPT * vw_strides[3];
  const auto* ks_p = ks + b * ks_strides[0] + kvh * ks_strides[1] + g * ks_strides[3];
  const auto* kb_p = kb + b * kb_strides[0] + kvh * kb_strides[1] + g * kb_strides[3];
  const auto* vs_p = vs + b * vs_strides[0] + kvh * vs_strides[1] + g * vs_strides[3];
  const auto* vb_p = vb + b * vb_strides[0] + kvh * vb_strides[1] + g * vb_strides[3];

  // A tile: KT keys and values of this group's lanes, loaded (with PF) an
  // iteration ahead of their use.
  struct Tile {
    uint32_t kw[KT][WPT], vw[KT][WPT];
    float ks[KT], kb[KT], vs[KT], vb[KT];
  };
  auto load = [&](Tile& t, int base) {
#pragma unroll
    for (int u = 0; u < KT; u++) {
      const int k = base + group * KT + u;
      const bool ok = active && k < k_end;
#pragma unroll
      for (int j = 0; j < WPT; j++) {
        t.kw[u][j] = ok ? kw_p[k * kw_strides[2] + j * kw_strides[3]] : 0u;
        t.vw[u][j] = ok ? vw_p[k * vw_strides[2] + j * vw_strides[3]] : 0u;
      }
      t.ks[u] = ok ? float(ks_p[k * ks_strides[2]]) : 0.f;
      t.kb[u] = ok ? float(kb_p[k * kb_strides[2]]) : 0.f;
      t.vs[u] = ok ? float(vs_p[k * vs_strides[2]]) : 0.f;
      t.vb[u] = ok ? float(vb_p[k * vb_strides[2]]) : 0.f;
    }
  };
  Tile cur, nxt;
  if constexpr (PF) load(cur, k_begin);
  for (int base = k_begin; base < k_end; base += NG * KT) {
    if constexpr (PF) {
      if (base + NG * KT < k_end) load(nxt, base + NG * KT);
    } else {
      load(cur, base);
    }
    const auto& kwv = cur.kw;
    const auto& vwv = cur.vw;
    const auto& ksv = cur.ks;
    const auto& kbv = cur.kb;
    const auto& vsv = cur.vs;
    const auto& vbv = cur.vb;
    float s[KT][RC];
#pragma unroll
    for (int u = 0; u < KT; u++) {
      float w[8];
      unpack8<BITS>(kwv[u], w);
      const int k = base + group * KT + u;
#pragma unroll
      for (int r = 0; r < RC; r++) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) dot += qr[r][i] * w[i];
        float x = ksv[u] * dot + kbv[u] * qsum[r];
#pragma unroll
        for (int off = TPK / 2; off > 0; off /= 2) {
          x += __shfl_xor_sync(0xffffffffu, x, off);
        }
        const int row = rc * RC + r;
        const int h = kvh * NREP + row / NQ, t = row % NQ;
        if (k >= k_end || row >= R) {
          x = NEG_INF;
        } else {
          if constexpr (CAUSAL) {
            if (k > kL - NQ + t) x = NEG_INF;
          }
          if constexpr (MASK != 0) {
            const auto mv = mask[b * mask_strides[0] + h * mask_strides[1] +
                                 t * mask_strides[2] + k * mask_strides[3]];
            if constexpr (MASK == 1) {
              if (!mv) x = NEG_INF;
            } else {
              x += float(mv);
            }
          }
        }
        s[u][r] = x;
      }
    }
#pragma unroll
    for (int r = 0; r < RC; r++) {
      float mt = m[r];
#pragma unroll
      for (int u = 0; u < KT; u++) mt = fmaxf(mt, s[u][r]);
      const float c = __expf(m[r] - mt);
      m[r] = mt;
      l[r] *= c;
      accb[r] *= c;
#pragma unroll
      for (int i = 0; i < 8; i++) acc[r][i] *= c;
    }
#pragma unroll
    for (int u = 0; u < KT; u++) {
      float w[8];
      unpack8<BITS>(vwv[u], w);
#pragma unroll
      for (int r = 0; r < RC; r++) {
        const float p = __expf(s[u][r] - m[r]);
        l[r] += p;
        const float ps = p * vsv[u];
        accb[r] += p * vbv[u];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r][i] += ps * w[i];
      }
    }
    if constexpr (PF) cur = nxt;
  }

  // Merge the block's groups: max, then the rescaled sums and outputs.
  __shared__ float sm[NG][RC], sl[NG][RC], so[RC][NG][TPK * 8];
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RC; r++) {
      sm[group][r] = m[r];
      sl[group][r] = l[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < RC; r++) {
    float M = LOWEST;
    for (int j = 0; j < NG; j++) M = fmaxf(M, sm[j][r]);
    const float f = __expf(m[r] - M);
#pragma unroll
    for (int i = 0; i < 8; i++) so[r][group][d0 + i] = (acc[r][i] + accb[r]) * f;
  }
  __syncthreads();
  const size_t part = ((size_t)(b * gridDim.y + kvh) * n_splits + split) * R;
  for (int e = threadIdx.x; e < RC * W; e += 128) {
    const int r = e / W, d = e % W, row = rc * RC + r;
    if (row >= R) continue;
    float M = LOWEST, S = 0.f, O = 0.f;
    for (int j = 0; j < NG; j++) M = fmaxf(M, sm[j][r]);
    for (int j = 0; j < NG; j++) {
      S += sl[j][r] * __expf(sm[j][r] - M);
      O += so[r][j][d];
    }
    o_part[(part + row) * W + d] = O;
    if (d == 0) {
      m_part[part + row] = M;
      l_part[part + row] = S;
    }
  }
"""

# One block a (batch, KV head, row); one thread a dim.
_DECODE_REDUCE = """
  constexpr int R = NREP * NQ;
  const int d = threadIdx.x;
  const int kvh = blockIdx.y / R, row = blockIdx.y % R, b = blockIdx.z;
  const int n_splits = m_part_shape[2];
  const size_t part = (size_t)(b * (gridDim.y / R) + kvh) * n_splits * R + row;
  float M = LOWEST;
#pragma unroll 8
  for (int s = 0; s < n_splits; s++) M = fmaxf(M, m_part[part + s * R]);
  float S = 0.f, O = 0.f;
#pragma unroll 8
  for (int s = 0; s < n_splits; s++) {
    const float f = __expf(m_part[part + s * R] - M);
    S += l_part[part + s * R] * f;
    O += o_part[(part + s * R) * W + d] * f;
  }
  if (d < D) {
    const int h = kvh * NREP + row / NQ, t = row % NQ;
    out[((b * (gridDim.y / R) * NREP + h) * NQ + t) * D + d] = T(S > 0.f ? O / S : 0.f);
  }
"""

_decode_kernels = {}
_decode_constants = {}


def _decode_kernel(name):
    if not _decode_kernels:
        _decode_kernels["partial"] = mx.fast.cuda_kernel(
            name="qkv_decode_partial",
            input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "mask", "scale"],
            output_names=["o_part", "m_part", "l_part"],
            source=_DECODE_PARTIAL,
            header=_DECODE_HEADER,
            ensure_row_contiguous=False,
        )
        _decode_kernels["reduce"] = mx.fast.cuda_kernel(
            name="qkv_decode_reduce",
            input_names=["o_part", "m_part", "l_part"],
            output_names=["out"],
            source=_DECODE_REDUCE,
            header=_DECODE_HEADER,
        )
    return _decode_kernels[name]


def _decode_constant(value, dtype):
    """A one-element array, made once (a decode step makes no new ones)."""
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
    ``MLX_LM_PATCHED_DECODE_KERNEL=0`` keeps every call on fused attention
    over dequantized keys."""
    return (
        _cuda_kernels
        and os.environ.get("MLX_LM_PATCHED_DECODE_KERNEL", "1") != "0"
        and queries.shape[2] <= DECODE_MAX_QUERIES
        and queries.shape[3] <= 128
        and bits in (4, 8)
        and queries.dtype in (mx.bfloat16, mx.float16)
    )


def quantized_decode_attention(
    queries, q_keys, q_values, scale, mask, group_size, bits, splits=None
):
    """Attention of a few queries over a quantized cache, with the kernel."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads, kL = q_keys[0].shape[-3], q_keys[0].shape[-2]
    n_repeats = n_q_heads // n_kv_heads
    width = q_keys[0].shape[-1] * 32 // bits
    rows = n_repeats * L
    rc = min(DECODE_ROWS, rows)
    row_chunks = -(-rows // rc)
    splits = splits or decode_splits(B, n_kv_heads, kL, row_chunks)
    causal = isinstance(mask, str)
    if mask is None or causal:
        kind, mask = 0, _decode_constant(False, mx.bool_)
    else:
        kind = 1 if mask.dtype == mx.bool_ else 2
        while mask.ndim < 4:
            mask = mask[None]
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, kL))  # strides 0
    template = [
        ("BITS", bits),
        ("GS", group_size),
        ("W", width),
        ("NREP", n_repeats),
        ("NQ", L),
        ("RC", rc),
        ("MASK", kind),
        ("CAUSAL", causal),
        ("TPK", 1 << (width // 8 - 1).bit_length()),
        ("KT", DECODE_KEYS_PER_ITER),
        ("PF", DECODE_PREFETCH),
    ]
    o_part, m_part, l_part = _decode_kernel("partial")(
        inputs=[queries, *q_keys, *q_values, mask, _decode_constant(scale, mx.float32)],
        template=template,
        grid=(splits * 128, n_kv_heads, B * row_chunks),
        threadgroup=(128, 1, 1),
        output_shapes=[
            (B, n_kv_heads, splits, rows, width),
            (B, n_kv_heads, splits, rows),
            (B, n_kv_heads, splits, rows),
        ],
        output_dtypes=[mx.float32] * 3,
    )
    return _decode_kernel("reduce")(
        inputs=[o_part, m_part, l_part],
        template=[("NREP", n_repeats), ("NQ", L), ("W", width), ("D", D)]
        + [("T", queries.dtype)],
        grid=(width, n_kv_heads * rows, B),
        threadgroup=(width, 1, 1),
        output_shapes=[(B, n_q_heads, L, D)],
        output_dtypes=[queries.dtype],
    )[0]


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


# Written as they read in mlx_lm/models/base.py, and run from there.
_decode_kernel = pasted_into("mlx_lm.models.base", _decode_kernel)
_decode_constant = pasted_into("mlx_lm.models.base", _decode_constant)
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
        os,
        _decode_kernel,
        _decode_constant,
        decode_splits,
        use_decode_kernel,
        quantized_decode_attention,
        DECODE_ROWS=DECODE_ROWS,
        DECODE_MAX_QUERIES=DECODE_MAX_QUERIES,
        DECODE_BLOCKS=DECODE_BLOCKS,
        DECODE_MIN_KEYS=DECODE_MIN_KEYS,
        DECODE_KEYS_PER_ITER=DECODE_KEYS_PER_ITER,
        DECODE_PREFETCH=DECODE_PREFETCH,
        _cuda_kernels=_cuda_kernels,
        _DECODE_HEADER=_DECODE_HEADER,
        _DECODE_PARTIAL=_DECODE_PARTIAL,
        _DECODE_REDUCE=_DECODE_REDUCE,
        _decode_kernels=_decode_kernels,
        _decode_constants=_decode_constants,
    ),
)
