"""The CUDA source of ``quantized_decode_kernel``'s kernels, compiled by
``mx.fast.cuda_kernel`` at first use. Not a patch: the kernel module
installs these strings in ``mlx_lm.models.base`` with its functions."""

_DECODE_DEFINES = """
#define LOWEST (-3.402823466e+38f)
#define NEG_INF (__int_as_float(0xff800000))
"""

_DECODE_HEADER = _DECODE_DEFINES + """
#include <cuda/std/limits>
#include <cuda/std/type_traits>
// The keys [k_begin, k_end) of a block's range, of the packed ones: the
// lengths array's shape is one more than the packed and tail counts, or
// (1, 1): the packed views' own length (``viewed``), no tail. kL counts the
// tail's keys too. (Read off shapes, kernel parameters: a loaded count
// took registers the kernel's loop lacks.)
__device__ __forceinline__ void key_range(
    int q1, int t1, int viewed, int split, int n_splits, int& kL, int& k_begin, int& k_end) {
  const int kQ = t1 > 1 ? q1 - 1 : viewed;
  kL = kQ + t1 - 1;
  const int per = (kQ + n_splits - 1) / n_splits;
  k_begin = split * per;
  k_end = min(kQ, k_begin + per);
}

// 8 quantized values of a lane as floats: each one's bits under float
// 2^23's mantissa, less 2^23 (full-rate ops; an integer conversion is not);
// RAW: not less 2^23, for an fmaf that takes it off as it scales.
template <int BITS, bool RAW = false>
__device__ __forceinline__ void unpack8(const uint32_t* w, float* out) {
  constexpr float OFF = RAW ? 0.f : 8388608.f;
  if constexpr (BITS == 8) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        out[4 * j + i] = __uint_as_float(__byte_perm(w[j], 0x4B000000u, 0x7440 + i)) - OFF;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      out[i] = __uint_as_float(((w[0] >> (4 * i)) & 0xfu) | 0x4B000000u) - OFF;
    }
  }
}

// A key's quantized values as two f16x2 words of the scores' A, from its
// word jj * BITS / 8: each value's bits under f16 1024's mantissa, less
// 1024 (exact). 8 bits: dims 4jj + {0, 1} and {2, 3}; 4 bits: dims {2l,
// 2l + 4} and {2l + 1, 2l + 5} of the word (l = jj % 2), the queries'
// B taking the same order (qdim).
template <int BITS>
__device__ __forceinline__ void key_pairs(uint32_t w, int jj, uint32_t& lo, uint32_t& hi) {
  uint32_t x, y;
  if constexpr (BITS == 8) {
    x = __byte_perm(w, 0x64646464u, 0x4140);
    y = __byte_perm(w, 0x64646464u, 0x4342);
  } else {
    const int s = 8 * (jj & 1);
    x = ((w >> s) & 0x000f000fu) | 0x64006400u;
    y = ((w >> (s + 4)) & 0x000f000fu) | 0x64006400u;
  }
  const __half2 magic = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
  __half2 a = __hsub2(*reinterpret_cast<__half2*>(&x), magic);
  __half2 b = __hsub2(*reinterpret_cast<__half2*>(&y), magic);
  lo = *reinterpret_cast<uint32_t*>(&a);
  hi = *reinterpret_cast<uint32_t*>(&b);
}

// The dim of chunk jj's i-th query value (slots 2c, 2c + 1, 2c + 8, 2c + 9
// of the k16 chunk), as key_pairs orders a key's.
template <int BITS>
__device__ __forceinline__ int qdim(int jj, int i) {
  if constexpr (BITS == 8) return 4 * jj + i;
  return 8 * (jj / 2) + 2 * (jj % 2) + (i >> 1) + 4 * (i & 1);
}

// Score x of query row t of head h for key k: -inf past the causal bound or
// where a boolean mask (MASK 1) is off; an additive mask (MASK 2) added.
template <bool CAUSAL, int MASK, typename M, typename S>
__device__ __forceinline__ float mask_score(
    float x, const M* mask, const S& ms, int b, int h, int t, int k, int kL, int NQ) {
  if constexpr (CAUSAL) {
    if (k > kL - NQ + t) return NEG_INF;
  }
  if constexpr (MASK != 0) {
    const auto mv = mask[b * ms[0] + h * ms[1] + t * ms[2] + k * ms[3]];
    if constexpr (MASK == 1) {
      if (!mv) return NEG_INF;
    } else {
      return x + float(mv);
    }
  }
  return x;
}

// Two floats as an f16x2 word, the first in the low half.
__device__ __forceinline__ uint32_t pack_h2(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// d += a * b, one m16n8k16 tensor-core product of f16, float accumulators.
__device__ __forceinline__ void mma_h16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N words from p: 16- or 8-byte loads where the words are contiguous and
// aligned (vec), else one at a time N strides apart; zeros unless ok.
template <int N>
__device__ __forceinline__ void load_words(
    uint32_t* dst, const uint32_t* p, long long stride, bool vec, bool ok) {
  if (!ok) {
#pragma unroll
    for (int j = 0; j < N; j++) dst[j] = 0u;
  } else if (vec && N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N / 4; j++) {
      const uint4 x = reinterpret_cast<const uint4*>(p)[j];
      dst[4 * j] = x.x, dst[4 * j + 1] = x.y, dst[4 * j + 2] = x.z, dst[4 * j + 3] = x.w;
    }
  } else if (vec && N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N / 2; j++) {
      const uint2 x = reinterpret_cast<const uint2*>(p)[j];
      dst[2 * j] = x.x, dst[2 * j + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; j++) dst[j] = p[j * stride];
  }
}
// BYTES bytes from global src to shared dst, in flight until cp_async_wait
// (cp.async); zeros unless ok.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(BYTES), "r"(ok ? BYTES : 0));
  }
}
// A warp's copy of rows [base, base + 16) of WR words each, from p (rows
// rs apart, words cs apart) to dst (rows DS apart), zeros from row k_end on:
// 16-byte cp.async (VEC: cs 1 and 16-byte aligned rows), a lane's pieces
// 32 / (WR / 4) rows apart; else word by word, with 4-byte cp.async where
// cs is 1.
template <bool VEC, int WR, int DS>
__device__ __forceinline__ void copy_rows(
    uint32_t* dst, const uint32_t* p, long long rs, long long cs, int base, int k_end) {
  const int lane = threadIdx.x % 32;
  if constexpr (VEC) {
    constexpr int PR = WR / 4, RS = 32 / PR;
    static_assert(WR % 4 == 0 && 32 % PR == 0 && 16 % RS == 0, "rows a lane's pieces tile");
    const int r0 = lane / PR, j = 4 * (lane % PR);
    const uint32_t* const src = p + (base + r0) * rs + j;
#pragma unroll
    for (int t = 0; t < 16 / RS; t++) {
      const int r = r0 + t * RS;
      const bool ok = base + r < k_end;
      cp_async<16>(dst + r * DS + j, ok ? src + t * RS * rs : p, ok);
    }
  } else {
#pragma unroll 1
    for (int e = lane; e < 16 * WR; e += 32) {
      const int r = e / WR, j = e % WR, k = base + r;
      if (cs == 1) {
        cp_async<4>(dst + r * DS + j, k < k_end ? p + k * rs + j : p, k < k_end);
      } else {
        dst[r * DS + j] = k < k_end ? p[k * rs + j * cs] : 0u;
      }
    }
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;");
}
// Wait until at most N of this thread's copy groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
// Flash-decoding's merge inside the first kernel: a block done with its
// range counts itself in (counter: one a batch row and KV head, which
// atomicInc takes back to zero after the last); the last block of the
// parts merges their outputs, maxima and sums into out (rows of D dims from
// out0), a warp a row, a lane W / 32 dims, each range's weight computed by
// one lane and shuffled to the others.
template <int W, int D, int R, typename OT>
__device__ void merge_ranges(
    unsigned int* counter, int parts, const float* o_part, const float* m_part,
    const float* l_part, size_t part0, OT* out, size_t out0) {
  constexpr int DL = W / 32;
  __shared__ bool last;
  __threadfence();  // this block's range written before it counts itself in
  __syncthreads();
  if (threadIdx.x == 0) last = atomicInc(counter, parts - 1) == parts - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int lane = threadIdx.x % 32;
  for (int row = threadIdx.x / 32; row < R; row += blockDim.x / 32) {
    float M = LOWEST;
    for (int s = lane; s < parts; s += 32) M = fmaxf(M, __ldcg(m_part + part0 + s * R + row));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float S = 0.f, O[DL];
#pragma unroll
    for (int i = 0; i < DL; i++) O[i] = 0.f;
    for (int s0 = 0; s0 < parts; s0 += 32) {
      const int s = s0 + lane, n = min(32, parts - s0);
      const float f = s < parts ? __expf(__ldcg(m_part + part0 + s * R + row) - M) : 0.f;
      S += s < parts ? __ldcg(l_part + part0 + s * R + row) * f : 0.f;
#pragma unroll 8
      for (int j = 0; j < n; j++) {
        const float fj = __shfl_sync(0xffffffffu, f, j);
        const float* op = o_part + (part0 + (size_t)(s0 + j) * R + row) * W + lane * DL;
#pragma unroll
        for (int i = 0; i < DL; i++) O[i] += fj * __ldcg(op + i);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) S += __shfl_xor_sync(0xffffffffu, S, off);
#pragma unroll
    for (int i = 0; i < DL; i++) {
      const int d = lane * DL + i;
      if (d < D) out[out0 + row * D + d] = OT(S > 0.f ? O[i] / S : 0.f);
    }
  }
}
// Rows [0, n_tail) of KV head kvh's tail, rows [0, t0) from t and the rest
// from n, to out (B, KV heads, TAIL, D): 16-byte words, four a thread in
// flight, where rows are whole words; else element by element.
template <int D, int TAIL, typename KT, typename S>
__device__ void write_tail(
    const KT* t, const S& ts, const KT* n, const S& ns, int t0, int n_tail, KT* out, int b,
    int kvh) {
  constexpr int E = 16 / sizeof(KT), WR = D / E;  // a word's elements, a row's words
  KT* const o = out + ((size_t)b * gridDim.y + kvh) * TAIL * D;
  const KT *const tp = t + b * ts[0] + kvh * ts[1], *const np = n + b * ns[0] + kvh * ns[1];
  const int nt = blockDim.x;
  if (D % E == 0 && ts[3] == 1 && ns[3] == 1 && ts[2] % E == 0 && ns[2] % E == 0 &&
      (size_t)tp % 16 == 0 && (size_t)np % 16 == 0) {
    const int total = n_tail * WR;
    for (int e0 = threadIdx.x; e0 < total; e0 += 4 * nt) {
      uint4 w[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int e = e0 + u * nt, j = e / WR, c = e % WR;
        const KT* src = j < t0 ? tp + j * ts[2] : np + (j - t0) * ns[2];
        if (e < total) w[u] = reinterpret_cast<const uint4*>(src)[c];
      }
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int e = e0 + u * nt;
        if (e < total) reinterpret_cast<uint4*>(o)[e] = w[u];
      }
    }
  } else {
    for (int e = threadIdx.x; e < n_tail * D; e += nt) {
      const int j = e / D, d = e % D;
      o[e] = j < t0 ? tp[j * ts[2] + d * ts[3]] : np[(j - t0) * ns[2] + d * ns[3]];
    }
  }
}
// The tail's keys and values (after the packed ones, in the cache dtype:
// see key_range) as one more range, in float32, by a block of its own:
// rows [r0, r0 + RR) of KV head kvh; its output, maximum and sum go to
// part + row as a range's do. WT: the tail's last nn keys and values are
// the step's (nk, nv), not yet in tk and tv; the block of rows 0 writes
// the tail with them to tko and tvo (write_tail).
template <int W, int D, int NREP, int NQ, int RR, int TAIL, bool CAUSAL, int MASK, bool WT,
          typename QT, typename KT, typename M, typename S, typename SM>
__device__ void tail_range(
    const QT* q, const S& qs, const KT* tk, const S& tks, const KT* tv, const S& tvs,
    const KT* nk, const S& nks, const KT* nv, const S& nvs, int nn, KT* tko, KT* tvo,
    const M* mask, const SM& ms, int b, int kvh, int r0, int n_tail, int kQ, float sc,
    float* o_part, float* m_part, float* l_part, size_t part) {
  constexpr int R = NREP * NQ, DH = (D + 1) / 2;
  __shared__ float qsh[RR][2 * DH], p[RR][TAIL], pm[RR], pl[RR];
  const int tid = threadIdx.x, nt = blockDim.x, kL = kQ + n_tail, t0 = n_tail - nn;
  if (WT && r0 == 0) {  // the tail written first: no stores among the loads below
    write_tail<D, TAIL>(tk, tks, nk, nks, t0, n_tail, tko, b, kvh);
    write_tail<D, TAIL>(tv, tvs, nv, nvs, t0, n_tail, tvo, b, kvh);
  }
  for (int e = tid; e < RR * 2 * DH; e += nt) {
    const int r = e / (2 * DH), d = e % (2 * DH), row = r0 + r;
    const int h = kvh * NREP + row / NQ, t = row % NQ;
    qsh[r][d] = row < R && d < D ? float(q[b * qs[0] + h * qs[1] + t * qs[2] + d * qs[3]]) : 0.f;
  }
  __syncthreads();
  // Two threads a key, each half its dims (loaded at once): its scores.
  for (int j0 = 0; j0 < n_tail; j0 += nt / 2) {
    const int j = j0 + tid / 2, half = tid % 2;
    const bool fresh = WT && j >= t0;
    const auto* kp = fresh ? nk + b * nks[0] + kvh * nks[1] + (j - t0) * nks[2]
                           : tk + b * tks[0] + kvh * tks[1] + j * tks[2];
    const auto kcs = fresh ? nks[3] : tks[3];
    // The rows' sums taken 8 dims at a time (all DH held at once took 20-30
    // more registers, which the tensor-core kernel's blocks share).
    float acc[RR];
#pragma unroll
    for (int r = 0; r < RR; r++) acc[r] = 0.f;
#pragma unroll 2
    for (int i = 0; i < DH; i += 8) {
      float x[8];
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int d = half * DH + i + u;
        x[u] = j < n_tail && d < D && i + u < DH ? float(kp[d * kcs]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < 8; u++) {
#pragma unroll
        for (int r = 0; r < RR; r++) acc[r] += i + u < DH ? qsh[r][half * DH + i + u] * x[u] : 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < RR; r++) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
      const int row = r0 + r;
      if (half == 0 && j < n_tail) {
        p[r][j] = row < R ? mask_score<CAUSAL, MASK>(
            acc[r] * sc, mask, ms, b, kvh * NREP + row / NQ, row % NQ, kQ + j, kL, NQ) : NEG_INF;
      }
    }
  }
  __syncthreads();
  // A warp a row: its maximum, probabilities and sum.
  for (int r = tid / 32; r < RR; r += nt / 32) {
    float m = LOWEST, l = 0.f;
    for (int j = tid % 32; j < n_tail; j += 32) m = fmaxf(m, p[r][j]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    for (int j = tid % 32; j < n_tail; j += 32) {
      p[r][j] = __expf(p[r][j] - m);
      l += p[r][j];
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
    pm[r] = m, pl[r] = l;
  }
  __syncthreads();
  // A thread a dim: the rows' outputs.
  for (int d = tid; d < W; d += nt) {
    float o[RR];
#pragma unroll
    for (int r = 0; r < RR; r++) o[r] = 0.f;
    const auto* vp = tv + b * tvs[0] + kvh * tvs[1] + d * tvs[3];
    const auto* np = nv + b * nvs[0] + kvh * nvs[1] + d * nvs[3];
    for (int j0 = 0; j0 < n_tail; j0 += 16) {  // 16 values loaded at once
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const int j = j0 + i;
        const auto* src = WT && j >= t0 ? np + (j - t0) * nvs[2] : vp + j * tvs[2];
        v[i] = d < D && j < n_tail ? float(*src) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < 16; i++) {
#pragma unroll
        for (int r = 0; r < RR; r++) o[r] += j0 + i < n_tail ? p[r][j0 + i] * v[i] : 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < RR; r++) {
      if (r0 + r < R) {
        o_part[(part + r0 + r) * W + d] = o[r];
        if (d == 0) m_part[part + r0 + r] = pm[r], l_part[part + r0 + r] = pl[r];
      }
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
  const int split = blockIdx.x, parts = gridDim.x, n_splits = parts - (TAIL > 1);
  const int kvh = blockIdx.y, b = blockIdx.z / NRC, rc = blockIdx.z % NRC;
  const int group = threadIdx.x / TPK, lane = threadIdx.x % TPK;
  const size_t n = (size_t)gridDim.z / NRC * gridDim.y * parts * R;  // see _DECODE_REDUCE
  float *const o_part = partials, *const m_part = o_part + n * W, *const l_part = m_part + n;
  if (split == n_splits) {  // the last block, with a tail
    tail_range<W, D, NREP, NQ, RC, TAIL, CAUSAL, MASK, WT>(
        q, q_strides, tk, tk_strides, tv, tv_strides, nk, nk_strides, nv, nv_strides,
        WT ? nk_shape[2] : 0, tko, tvo, mask, mask_strides, b, kvh, rc * RC,
        lens_shape[1] - 1, lens_shape[0] - 1, SC, o_part, m_part, l_part,
        ((size_t)(b * gridDim.y + kvh) * parts + split) * R);
    return;
  }
  int kL, k_begin, k_end;
  key_range(lens_shape[0], lens_shape[1], kw_shape[2], split, n_splits, kL, k_begin, k_end);
  const int d0 = lane * DPL;
  const bool active = d0 < W;
  const float sc = SC;

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
        if (k >= k_end || row >= R) {
          x = NEG_INF;
        } else {
          x = mask_score<CAUSAL, MASK>(
              x, mask, mask_strides, b, kvh * NREP + row / NQ, row % NQ, k, kL, NQ);
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
  const size_t part = ((size_t)(b * gridDim.y + kvh) * parts + split) * R;
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
# the loads wait for memory twice, not once a range. The first kernel's
# partial results come as one array (two outputs and two inputs less to
# make and launch: on an H200 about 2 us of host time an output, 0.3 an
# input), its n rows' (B x KV heads x ranges x query rows) outputs, then
# maxima, then sums.
_DECODE_REDUCE = """
  constexpr int R = NREP * NQ;
  const int d = threadIdx.x, nt = blockDim.x;
  const int kvh = blockIdx.y / R, row = blockIdx.y % R, b = blockIdx.z;
  const int n_splits = partials_shape[2];
  const size_t n = (size_t)gridDim.z * (gridDim.y / R) * n_splits * R;
  const float *const o_part = partials, *const m_part = o_part + n * W, *const l_part = m_part + n;
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
