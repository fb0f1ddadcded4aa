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
and wrap, a batch's padding) or "causal". ``quantized_decode_reference``
has its arithmetic in ``mx`` ops, which tests check on CPU; ``python -m
mlx_lm_patched.bench qdecode`` checks the kernel on a GPU. On H100s
(Llama-8B shape, 4k / 16k / 32k tokens) 8-bit decode runs at 0.72-0.96x
the bfloat16 cache's tokens per second, 4 bits 0.70-1.02x (the old road
0.36-0.68x), with the old road's greedy tokens at 16k and 32k: a step is
bound by the host (its Python and MLX's launches), which the quantized
cache has more of. ``MLX_LM_PATCHED_DECODE_KERNEL=0`` keeps the old road.
Prefill chunks keep the road above. Metal and CPU are untouched.
"""

import os

import mlx.core as mx

from ._registry import Patch, pasted_into, targets

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
DECODE_PREFETCH = True
DECODE_DIMS_PER_LANE = 16

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

# One block: 128 threads, groups of TPK lanes a key, DPL dims a lane; the
# block's keys are [split * per, (split + 1) * per), its rows those of
# blockIdx.z's chunk of DECODE_ROWS.
_DECODE_PARTIAL = """
  constexpr int R = NREP * NQ;
  constexpr int WPT = BITS / 4;
  constexpr int WPL = WPT * DPL / 8;
  constexpr int NG = 128 / TPK;
  constexpr int NRC = (R + RC - 1) / RC;
  const int split = blockIdx.x, n_splits = gridDim.x;
  const int kvh = blockIdx.y, b = blockIdx.z / NRC, rc = blockIdx.z % NRC;
  const int group = threadIdx.x / TPK, lane = threadIdx.x % TPK;
  const int kL = kw_shape[2], D = q_shape[3];
  const int d0 = lane * DPL;
  const bool active = d0 < W;
  const float sc = scale[0];
  const int per = (kL + n_splits - 1) / n_splits;
  const int k_begin = split * per, k_end = min(kL, k_begin + per);

  float qr[RC][DPL], qsum[RC], m[RC], l[RC], acc[RC][DPL], accb[RC];
#pragma unroll
  for (int r = 0; r < RC; r++) {
    const int row = rc * RC + r;
    const int h = kvh * NREP + row / NQ, t = row % NQ;
    qsum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
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
  const uint32_t* kw_p = kw + b * kw_strides[0] + kvh * kw_strides[1] + lane * WPL * kw_strides[3];
  const uint32_t* vw_p = vw + b * vw_strides[0] + kvh * vw_strides[1] + lane * WPL * vw_strides[3];
  const auto* ks_p = ks + b * ks_strides[0] + kvh * ks_strides[1] + g * ks_strides[3];
  const auto* kb_p = kb + b * kb_strides[0] + kvh * kb_strides[1] + g * kb_strides[3];
  const auto* vs_p = vs + b * vs_strides[0] + kvh * vs_strides[1] + g * vs_strides[3];
  const auto* vb_p = vb + b * vb_strides[0] + kvh * vb_strides[1] + g * vb_strides[3];

  // A tile: KT keys and values of this group's lanes, loaded (with PF) an
  // iteration ahead of their use.
  struct Tile {
    uint32_t kw[KT][WPL], vw[KT][WPL];
    float ks[KT], kb[KT], vs[KT], vb[KT];
  };
  auto load = [&](Tile& t, int base) {
#pragma unroll
    for (int u = 0; u < KT; u++) {
      const int k = base + group * KT + u;
      const bool ok = active && k < k_end;
#pragma unroll
      for (int j = 0; j < WPL; j++) {
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
      float w[DPL];
#pragma unroll
      for (int c = 0; c < DPL / 8; c++) unpack8<BITS>(&kwv[u][c * WPT], &w[c * 8]);
      const int k = base + group * KT + u;
#pragma unroll
      for (int r = 0; r < RC; r++) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; i++) dot += qr[r][i] * w[i];
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
      for (int i = 0; i < DPL; i++) acc[r][i] *= c;
    }
#pragma unroll
    for (int u = 0; u < KT; u++) {
      float w[DPL];
#pragma unroll
      for (int c = 0; c < DPL / 8; c++) unpack8<BITS>(&vwv[u][c * WPT], &w[c * 8]);
#pragma unroll
      for (int r = 0; r < RC; r++) {
        const float p = __expf(s[u][r] - m[r]);
        l[r] += p;
        const float ps = p * vsv[u];
        accb[r] += p * vbv[u];
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[r][i] += ps * w[i];
      }
    }
    if constexpr (PF) cur = nxt;
  }

  // Merge the block's groups: max, then the rescaled sums and outputs.
  __shared__ float sm[NG][RC], sl[NG][RC], so[RC][NG][TPK * DPL];
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
    for (int i = 0; i < DPL; i++) so[r][group][d0 + i] = (acc[r][i] + accb[r]) * f;
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

# One block a (batch, KV head, row); one thread a dim. The ranges' maxima
# and weights are read at once (a thread a range), then the outputs, so
# the loads wait for memory twice, not once a range.
_DECODE_REDUCE = """
  constexpr int R = NREP * NQ;
  const int d = threadIdx.x, nt = blockDim.x;
  const int kvh = blockIdx.y / R, row = blockIdx.y % R, b = blockIdx.z;
  const int n_splits = m_part_shape[2];
  const size_t part = (size_t)(b * (gridDim.y / R) + kvh) * n_splits * R + row;
  __shared__ float f[MAX_SPLITS], red[32];
  float M = LOWEST;
  for (int s = d; s < n_splits; s += nt) M = fmaxf(M, m_part[part + s * R]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  if (d % 32 == 0) red[d / 32] = M;
  __syncthreads();
  M = red[0];
  for (int w = 1; w < (nt + 31) / 32; w++) M = fmaxf(M, red[w]);
  float S = 0.f;
  for (int s = d; s < n_splits; s += nt) {
    f[s] = __expf(m_part[part + s * R] - M);
    S += l_part[part + s * R] * f[s];
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) S += __shfl_xor_sync(0xffffffffu, S, off);
  __syncthreads();
  if (d % 32 == 0) red[d / 32] = S;
  __syncthreads();
  S = 0.f;
  for (int w = 0; w < (nt + 31) / 32; w++) S += red[w];
  float O = 0.f;
#pragma unroll 16
  for (int s = 0; s < n_splits; s++) O += o_part[(part + s * R) * W + d] * f[s];
  if (d < D) {
    const int h = kvh * NREP + row / NQ, t = row % NQ;
    out[((b * (gridDim.y / R) * NREP + h) * NQ + t) * D + d] = T(S > 0.f ? O / S : 0.f);
  }
"""


_decode_kernels = {}
_decode_constants = {}
_decode_launches = {}


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


def _decode_launch(
    B, n_q_heads, L, D, n_kv_heads, width, bits, group_size, kind, causal, splits, dtype
):
    """The two kernels' launch arguments for one shape, made once (a decode
    step's Python is most of its time on a fast GPU)."""
    key = (B, n_q_heads, L, D, n_kv_heads, width, bits, group_size, kind, causal)
    key += (splits, dtype, DECODE_KEYS_PER_ITER, DECODE_PREFETCH, DECODE_DIMS_PER_LANE)
    if key in _decode_launches:
        return _decode_launches[key]
    n_repeats = n_q_heads // n_kv_heads
    rows = n_repeats * L
    rc = min(DECODE_ROWS, rows)
    dpl = DECODE_DIMS_PER_LANE
    partial = dict(
        template=[
            ("BITS", bits),
            ("GS", group_size),
            ("W", width),
            ("NREP", n_repeats),
            ("NQ", L),
            ("RC", rc),
            ("MASK", kind),
            ("CAUSAL", causal),
            ("DPL", dpl),
            ("TPK", 1 << (-(-width // dpl) - 1).bit_length()),
            ("KT", DECODE_KEYS_PER_ITER),
            ("PF", DECODE_PREFETCH),
        ],
        grid=(splits * 128, n_kv_heads, B * -(-rows // rc)),
        threadgroup=(128, 1, 1),
        output_shapes=[
            (B, n_kv_heads, splits, rows, width),
            (B, n_kv_heads, splits, rows),
            (B, n_kv_heads, splits, rows),
        ],
        output_dtypes=[mx.float32] * 3,
    )
    reduce = dict(
        template=[("NREP", n_repeats), ("NQ", L), ("W", width), ("D", D), ("T", dtype)]
        + [("MAX_SPLITS", max(splits, DECODE_BLOCKS))],
        grid=(width, n_kv_heads * rows, B),
        threadgroup=(width, 1, 1),
        output_shapes=[(B, n_q_heads, L, D)],
        output_dtypes=[dtype],
    )
    _decode_launches[key] = partial, reduce
    return partial, reduce


def quantized_decode_attention(
    queries, q_keys, q_values, scale, mask, group_size, bits, splits=None
):
    """Attention of a few queries over a quantized cache, with the kernel."""
    B, n_q_heads, L, D = queries.shape
    _, n_kv_heads, kL, packed = q_keys[0].shape
    rows = n_q_heads // n_kv_heads * L
    splits = splits or decode_splits(
        B, n_kv_heads, kL, -(-rows // min(DECODE_ROWS, rows))
    )
    causal = isinstance(mask, str)
    if mask is None or causal:
        kind, mask = 0, _decode_constant(False, mx.bool_)
    else:
        kind = 1 if mask.dtype == mx.bool_ else 2
        while mask.ndim < 4:
            mask = mask[None]
        mask = mx.broadcast_to(mask, (B, n_q_heads, L, kL))  # strides 0
    partial, reduce = _decode_launch(
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
    )
    scale = _decode_constant(scale, mx.float32)
    parts = _decode_kernel("partial")(
        inputs=[queries, *q_keys, *q_values, mask, scale], **partial
    )
    return _decode_kernel("reduce")(inputs=parts, **reduce)[0]


# Written as they read in mlx_lm/models/base.py, and run from there.
_decode_kernel = pasted_into("mlx_lm.models.base", _decode_kernel)
_decode_constant = pasted_into("mlx_lm.models.base", _decode_constant)
_decode_launch = pasted_into("mlx_lm.models.base", _decode_launch)
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
        _decode_launch,
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
        _cuda_kernels=_cuda_kernels,
        _DECODE_HEADER=_DECODE_HEADER,
        _DECODE_PARTIAL=_DECODE_PARTIAL,
        _DECODE_REDUCE=_DECODE_REDUCE,
        _decode_kernels=_decode_kernels,
        _decode_constants=_decode_constants,
        _decode_launches=_decode_launches,
    ),
)
