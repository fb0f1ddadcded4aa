"""The CUDA source of ``quantized_decode``'s float-lane kernel and of the
kernel merging its key ranges."""

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
