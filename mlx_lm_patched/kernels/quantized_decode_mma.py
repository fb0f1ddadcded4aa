"""The CUDA source of ``quantized_decode_kernel``'s tensor-core kernel
(``mma.sync``), for query blocks of up to 8 rows a KV head over head dims
64 and 128; its helpers are in ``quantized_decode_source``'s header. Not a
patch: the kernel module installs it in ``mlx_lm.models.base``."""

# One block: NW warps, each taking 16 keys at a time of the block's range
# [split * per, (split + 1) * per), a KV head's query rows (up to 8) the n8
# columns of f16 tensor-core products (mma.sync m16n8k16), transposed:
# scores (keys x rows) with A the keys' quantized integers (exact in f16,
# made from their bits with no conversion: key_pairs) and B the queries
# (in key_pairs' order), a group's dims a k16 chunk at a time, so each group's
# sums take its keys' scale and bias after the product; outputs (dims x
# rows) with A the values times their scales (rounded to f16) and B the
# probabilities (f16), the biases' share added from float sums. Lane (g, c)
# loads GS / 4 dims of each group of keys g and g + 8 and W / 8 dims of keys
# 2c, 2c + 1, 2c + 8, 2c + 9: contiguous words, 16-byte loads; with PF a
# warp's next keys load while it uses these, and its next two tiles' values
# are copied to shared memory (cp.async) meanwhile; its outputs are rescaled
# only when a row's maximum grew. The scales and biases of keys
# and values are staged in shared memory by the whole block, up to CK keys'
# at a time, before the warps use them. Queries beyond f16's range are
# clamped to it.
_DECODE_MMA = """
  constexpr int R = NREP * NQ;
  constexpr int NGR = W / GS;
  constexpr int CH = GS / 16;
  constexpr int WPG = GS * BITS / 128;
  constexpr int VD = W / 8;
  constexpr int VW = VD * BITS / 32;
  constexpr int MT = W / 16;
  constexpr int VWR = W * BITS / 32;  // a value row's words
  constexpr int VRS = VWR + 4;  // its stride in shared memory: reads free of bank conflicts
  const int split = blockIdx.x, parts = gridDim.x, n_splits = parts - (TAIL > 1);
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, c = threadIdx.x % 4;
  const size_t n = (size_t)gridDim.z * gridDim.y * parts * R;  // see _DECODE_REDUCE
  float *const o_part = partials, *const m_part = o_part + n * W, *const l_part = m_part + n;
  // With MERGE, the last block of a KV head's ranges merges them
  // (merge_ranges), counted by the cache's counters (cnt).
  const size_t part0 = (size_t)(b * gridDim.y + kvh) * parts * R;
  auto merge = [&]() {
    if constexpr (MERGE) {
      merge_ranges<W, D, R>(
          (unsigned int*)cnt + b * gridDim.y + kvh, parts, o_part, m_part, l_part, part0, out,
          (size_t)(b * gridDim.y + kvh) * R * D);
    }
  };
  if (split == n_splits) {  // the last block, with a tail
    tail_range<W, D, NREP, NQ, R, TAIL, CAUSAL, MASK, WT>(
        q, q_strides, tk, tk_strides, tv, tv_strides, nk, nk_strides, nv, nv_strides,
        WT ? nk_shape[2] : 0, tko, tvo, mask, mask_strides, b, kvh, 0,
        lens_shape[1] - 1, lens_shape[0] - 1, SC, o_part, m_part, l_part,
        part0 + split * R);
    merge();
    return;
  }
  int kL, k_begin, k_end;
  key_range(lens_shape[0], lens_shape[1], kw_shape[2], split, n_splits, kL, k_begin, k_end);
  const float sc = SC;

  // B of the scores: query row g (column g), a group's dims a k16 chunk at
  // a time, lane c holding GS / 4 of each group's dims.
  uint32_t qb[NGR][CH][2];
  float qsum[2][NGR];
  {
    const int h = kvh * NREP + g / NQ, t = g % NQ;
    const auto* qp = q + b * q_strides[0] + h * q_strides[1] + t * q_strides[2];
#pragma unroll
    for (int gi = 0; gi < NGR; gi++) {
      float s = 0.f;
#pragma unroll
      for (int jj = 0; jj < CH; jj++) {
        float x[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int d = gi * GS + c * (GS / 4) + qdim<BITS>(jj, i);
          x[i] = (g < R && d < D) ? fminf(fmaxf(float(qp[d * q_strides[3]]), -65504.f), 65504.f) : 0.f;
          s += x[i];
        }
        qb[gi][jj][0] = pack_h2(x[0], x[1]);
        qb[gi][jj][1] = pack_h2(x[2], x[3]);
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      // This lane's scores are rows 2c and 2c + 1: their sums from lanes 8c, 8c + 4.
      qsum[0][gi] = __shfl_sync(0xffffffffu, s, 8 * c);
      qsum[1][gi] = __shfl_sync(0xffffffffu, s, 8 * c + 4);
    }
  }

  const auto kw_p = kw + b * kw_strides[0] + kvh * kw_strides[1];
  const auto vw_p = vw + b * vw_strides[0] + kvh * vw_strides[1];
  const auto ks_p = ks + b * ks_strides[0] + kvh * ks_strides[1];
  const auto kb_p = kb + b * kb_strides[0] + kvh * kb_strides[1];
  const auto vs_p = vs + b * vs_strides[0] + kvh * vs_strides[1];
  const auto vb_p = vb + b * vb_strides[0] + kvh * vb_strides[1];
  const long long kr = kw_strides[2], kc = kw_strides[3];
  const long long vr = vw_strides[2], vc = vw_strides[3];
  const bool kvec = kc == 1 && kr % 4 == 0 && (size_t)kw_p % 16 == 0;
  const bool vvec = vc == 1 && vr % 4 == 0 && (size_t)vw_p % 16 == 0;
  const int gv = g * VD / GS;  // the group of this lane's value dims
  __shared__ float ps[NW][16][9];

  float m[2] = {LOWEST, LOWEST}, l[2] = {0.f, 0.f};
  float o[MT][4], ob[2][NGR];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
#pragma unroll
  for (int gi = 0; gi < NGR; gi++) ob[0][gi] = ob[1][gi] = 0.f;

  // A warp's values, 16 keys at a time, copied to shared memory (cp.async)
  // up to two tiles ahead of their use: no registers hold them in flight. H200,
  // ncu, means of 8 launches, 4k / 16k / 32k keys: 8 bits 29.4 / 44.6 / 59.2
  // us loaded as used, 32.6 / 39.5 / 53.4 copied a tile ahead; 4 bits 30.3
  // / 43.6 / 60.1, 28.3 / 43.9 / 61.1 (190 registers, 180 before).
  // A warp's buffers: this tile's and the next two's, or the next one's
  // where the tail's block needs more (up to 8 rows: its own arrays, which
  // the block's static shared memory, under 48 KB, also holds).
  constexpr int VS = R <= 4 ? 3 : 2;
  __shared__ __align__(16) uint32_t sv[NW][VS][16 * VRS];

  // The scales and biases of up to CK keys, staged in shared memory by the
  // block at once, their loads all in flight together (loaded by each warp
  // with its keys, their first uses were the kernel's longest stalls). H200,
  // ncu, means of 8 launches, 4k / 16k / 32k keys: 8 bits 26.9 / 42.2 / 59.7
  // us before, 28.8 / 39.1 / 56.1 staged; 4 bits 27.7 / 40.2 / 58.8, 27.5 /
  // 39.6 / 57.6.
  using ST = cuda::std::remove_cv_t<cuda::std::remove_reference_t<decltype(ks[0])>>;
  // Up to 15 KB of scales and biases (whole tiles of the warps' keys): the
  // block's static shared memory stays under 48 KB. After the loop the
  // warps' outputs (so, below) take sv's bytes where they fit, else these.
  constexpr int CK = 3840 / sizeof(ST) / NGR / (16 * NW) * (16 * NW);
  constexpr int SB = 4 * CK * NGR * sizeof(ST), OB = NW * 8 * W * sizeof(float);
  constexpr bool SO_SV = OB <= sizeof(sv);
  __shared__ __align__(16) unsigned char s_raw[SO_SV || SB > OB ? SB : OB];
  ST* const s_ks = reinterpret_cast<ST*>(s_raw);
  ST *const s_kb = s_ks + CK * NGR, *const s_vs = s_kb + CK * NGR, *const s_vb = s_vs + CK * NGR;

  auto copy_values = [&](uint32_t* dst, int base) {
    if (vvec) {
      copy_rows<true, VWR, VRS>(dst, vw_p, vr, 1, base, k_end);
    } else {
      copy_rows<false, VWR, VRS>(dst, vw_p, vr, vc, base, k_end);
    }
    cp_async_commit();
  };

  // Keys g and g + 8 (A of the scores: rows of the m16 tile); with PF
  // loaded an iteration ahead of their use.
  struct Keys {
    uint32_t kw[2][NGR * WPG];
  };
  auto load_keys = [&](Keys& t, int base) {
    const uint32_t* const p = kw_p + (base + g) * kr + c * WPG * kc;
#pragma unroll
    for (int u = 0; u < 2; u++) {
#pragma unroll
      for (int gi = 0; gi < NGR; gi++) {
        load_words<WPG>(
            &t.kw[u][gi * WPG], p + 8 * u * kr + gi * WPG * 4 * kc, kc, kvec, base + 8 * u + g < k_end);
      }
    }
  };
  Keys cur, nxt;
  if constexpr (PF) load_keys(cur, k_begin + 16 * warp);
  int it = 0;
#pragma unroll
  for (int i = 0; i < VS - 1; i++) copy_values(sv[warp][i], k_begin + 16 * (warp + i * NW));
  for (int c0 = k_begin; c0 < k_end; c0 += CK) {
    const int nk = min(CK, k_end - c0) * NGR;
    __syncthreads();
#pragma unroll 8
    for (int e = threadIdx.x; e < nk; e += 32 * NW) {
      const int k = c0 + e / NGR, gi = e % NGR;
      s_ks[e] = ks_p[k * ks_strides[2] + gi * ks_strides[3]];
      s_kb[e] = kb_p[k * kb_strides[2] + gi * kb_strides[3]];
      s_vs[e] = vs_p[k * vs_strides[2] + gi * vs_strides[3]];
      s_vb[e] = vb_p[k * vb_strides[2] + gi * vb_strides[3]];
    }
    __syncthreads();
    // Unrolled by two: 8-12% less time on an H200 (ncu, 4k-32k keys, 8 and
    // 4 bits), where a buffer swap (two calls of one step) gained nothing.
#pragma unroll 2
    for (int base = c0 + 16 * warp; base < c0 + CK && base < k_end; base += 16 * NW) {
      __syncwarp();  // the lanes are done with the buffer refilled here
      copy_values(sv[warp][(it + VS - 1) % VS], base + 16 * (VS - 1) * NW);
      // Scales of keys 2c, 2c + 1, 2c + 8, 2c + 9 (A of the outputs: its k16 columns).
      float vss[4], vsb[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int k = base + 2 * c + (u & 1) + 8 * (u >> 1);
        vss[u] = k < k_end ? float(s_vs[(k - c0) * NGR + gv]) : 0.f;
        vsb[u] = -8388608.f * vss[u];  // unpack8's RAW offset, scaled (exact)
      }
      if constexpr (PF) {
        load_keys(nxt, base + 16 * NW);
      } else {
        load_keys(cur, base);
      }
      float kss[2][NGR], kbs[2][NGR], vbs[2][NGR];
#pragma unroll
      for (int u = 0; u < 2; u++) {
        const int k = base + 8 * u + g, e = (k - c0) * NGR;
#pragma unroll
        for (int gi = 0; gi < NGR; gi++) {
          kss[u][gi] = k < k_end ? float(s_ks[e + gi]) : 0.f;
          kbs[u][gi] = k < k_end ? float(s_kb[e + gi]) : 0.f;
          vbs[u][gi] = k < k_end ? float(s_vb[e + gi]) : 0.f;
        }
      }
      const auto& kwr = cur.kw;

      // Scores, transposed (keys x rows): a group's sums take its keys'
      // scale and bias. s[e]: key g + 8 * (e >> 1), row 2c + (e & 1).
      float acc[NGR][4];
#pragma unroll
      for (int gi = 0; gi < NGR; gi++) {
        acc[gi][0] = acc[gi][1] = acc[gi][2] = acc[gi][3] = 0.f;
#pragma unroll
        for (int jj = 0; jj < CH; jj++) {
          uint32_t a[4];
#pragma unroll
          for (int u = 0; u < 2; u++) {
            key_pairs<BITS>(kwr[u][gi * WPG + jj * BITS / 8], jj, a[u], a[2 + u]);
          }
          mma_h16816(acc[gi], a, qb[gi][jj][0], qb[gi][jj][1]);
        }
      }
      float s[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int u = e >> 1, row = 2 * c + (e & 1), k = base + 8 * u + g;
        float x = 0.f;
#pragma unroll
        for (int gi = 0; gi < NGR; gi++) {
          x += kss[u][gi] * acc[gi][e] + kbs[u][gi] * qsum[e & 1][gi];
        }
        x *= sc;
        if (k >= k_end) {
          x = NEG_INF;
        } else if (row < R) {
          x = mask_score<CAUSAL, MASK>(
              x, mask, mask_strides, b, kvh * NREP + row / NQ, row % NQ, k, kL, NQ);
        }
        s[e] = x;
      }

      // Online softmax of rows 2c and 2c + 1 (the lanes of one c hold a row's 16 keys).
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float mt = fmaxf(s[r], s[2 + r]);
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
        mt = fmaxf(m[r], mt);
        const float corr = __expf(m[r] - mt);
        const bool grew = mt > m[r];
        m[r] = mt;
        s[r] = __expf(s[r] - mt);
        s[2 + r] = __expf(s[2 + r] - mt);
        l[r] = l[r] * corr + s[r] + s[2 + r];
        if (__any_sync(0xffffffffu, grew)) {  // else every corr is 1
#pragma unroll
          for (int i = 0; i < MT; i++) {
            o[i][r] *= corr;
            o[i][2 + r] *= corr;
          }
        }
#pragma unroll
        for (int gi = 0; gi < NGR; gi++) {
          ob[r][gi] = ob[r][gi] * corr + s[r] * vbs[0][gi] + s[2 + r] * vbs[1][gi];
        }
      }

      // B of the outputs (keys x rows) from the scores' layout, through shared memory.
      ps[warp][g][2 * c] = s[0];
      ps[warp][g][2 * c + 1] = s[1];
      ps[warp][g + 8][2 * c] = s[2];
      ps[warp][g + 8][2 * c + 1] = s[3];
      __syncwarp();
      const uint32_t pb0 = pack_h2(ps[warp][2 * c][g], ps[warp][2 * c + 1][g]);
      const uint32_t pb1 = pack_h2(ps[warp][2 * c + 8][g], ps[warp][2 * c + 9][g]);
      __syncwarp();

      // Outputs, transposed (dims x rows): A the values times their scales;
      // m-tile i's rows g and g + 8 are dims g * VD + 2i and g * VD + 2i + 1.
      cp_async_wait<VS - 1>();  // this tile's values, not the next ones'
      __syncwarp();
      uint32_t vwr[4][VW];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int r = 2 * c + (u & 1) + 8 * (u >> 1);
        load_words<VW>(vwr[u], &sv[warp][it % VS][r * VRS + g * VW], 1, true, true);
      }
#pragma unroll
      for (int c8 = 0; c8 < VD / 8; c8++) {
        float vv[4][8];
#pragma unroll
        for (int u = 0; u < 4; u++) {
          unpack8<BITS, true>(&vwr[u][c8 * BITS / 4], vv[u]);
#pragma unroll
          for (int i = 0; i < 8; i++) vv[u][i] = fmaf(vv[u][i], vss[u], vsb[u]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const uint32_t a[4] = {
              pack_h2(vv[0][2 * i], vv[1][2 * i]), pack_h2(vv[0][2 * i + 1], vv[1][2 * i + 1]),
              pack_h2(vv[2][2 * i], vv[3][2 * i]), pack_h2(vv[2][2 * i + 1], vv[3][2 * i + 1])};
          mma_h16816(o[4 * c8 + i], a, pb0, pb1);
        }
      }
      if constexpr (PF) cur = nxt;
      it++;
    }
  }

  cp_async_wait<0>();  // the copy issued past the range, before shared memory is reused
  // Each row's sum and bias terms over its lanes, then the block's warps merged.
#pragma unroll
  for (int r = 0; r < 2; r++) {
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
#pragma unroll
      for (int gi = 0; gi < NGR; gi++) {
        ob[r][gi] += __shfl_xor_sync(0xffffffffu, ob[r][gi], off);
      }
    }
  }
  __shared__ float sm[NW][8], sl[NW][8];
  __syncthreads();  // every warp done with the staged scales and its values
  float(*const so)[8][W] = reinterpret_cast<float(*)[8][W]>(SO_SV ? (void*)sv : (void*)s_raw);
  if (g == 0) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      sm[warp][2 * c + r] = m[r];
      sl[warp][2 * c + r] = l[r];
    }
  }
#pragma unroll
  for (int i = 0; i < MT; i++) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int d = g * VD + 2 * i + (e >> 1);
      so[warp][2 * c + (e & 1)][d] = o[i][e] + ob[e & 1][d / GS];
    }
  }
  __syncthreads();
  const size_t part = part0 + split * R;
  for (int e = threadIdx.x; e < R * W; e += blockDim.x) {
    const int row = e / W, d = e % W;
    float M = LOWEST, S = 0.f, O = 0.f;
#pragma unroll
    for (int j = 0; j < NW; j++) M = fmaxf(M, sm[j][row]);
#pragma unroll
    for (int j = 0; j < NW; j++) {
      const float f = __expf(sm[j][row] - M);
      S += sl[j][row] * f;
      O += so[j][row][d] * f;
    }
    o_part[(part + row) * W + d] = O;
    if (d == 0) {
      m_part[part + row] = M;
      l_part[part + row] = S;
    }
  }
  merge();
"""
