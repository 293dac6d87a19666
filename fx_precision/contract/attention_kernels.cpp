// fxp_engine::attention's kernel (contract/ops/attention.py holds the op and its fp32 reference): the engine's CPU
// attention in its arithmetic and order. Plain C++ (no torch or Python headers: it builds in a second or two), built at
// first use with the other kernel files and loaded by contract/kernels.py, which checks every argument; tensors arrive
// as raw pointers.
//
// What vLLM's CPU attention computes for one query row against its keys (one KV tile), per variant:
//
//   scores    amx: s_j = (sum_d q[d] * k_j[d]) * scale   bf16 operands, exact products, fp32 adds in d order
//             vec: s_j = sum_d (q[d] * scale) * k_j[d]   q pre-scaled in fp32; mul then add (or fused)
//   softmax   m = max_j s_j;  e_j = exp(s_j - m)          exp: glibc expf, or the AVX-512 polynomial
//             l: e_j summed into 16 lanes (key j in lane j % 16), the lanes reduced as the build does
//             (avx512: halves, then halves again; avx2: lanes 0-7 and 8-15 each from 0, then added)
//   P.V       o[d] = sum_j p_j * v_j[d], keys in order     amx: p_j rounded to bf16 (RNE), exact products
//                                                         vec: p_j in fp32; mul then add (or fused)
//   output    o[d] * (float)(1.0 / (double)l), stored to bf16 by rounding to nearest even, or truncating
//
// KV tiles: the engine takes a row's keys in tiles (contract/attention_tiles.py says which), and the softmax
// runs online across them: m starts at the lowest float; per tile, m_t = max(m, its scores); where m - m_t < -8
// the tile rescales (f = expf(m - m_t), l = fma(f, l, l_t), acc *= f before its P.V, m = m_t), else it keeps m
// and l = l_t + l; l_t is the tile's own 16-lane sum, reduced. One tile is the one-pass softmax above.
// Split-KV: where the engine split a row's keys across threads, each part runs its own online softmax over its
// keys, and the parts merge in key order: the larger max M keeps its (L, O); the other's scale by f = expf(smaller
// - larger), fused (L = fma(l, f, L), O = fma(o, f, O)); M = max. The output is O / L as above.
// Where the engine's build compiles these two without FMA (merge_fma 0: vLLM's AVX2 build), the tile
// rescale and the merge multiply, round, then add (l_t + f * l; O + o * f).
//
// The amx variant runs the engine's own instruction, TDPBF16PS, on the same 32-element chunks in the
// same order (scores: head dims 0-31, 32-63, ...; P.V: keys 0-31, 32-63, ...): how that instruction
// sums a chunk is the hardware's, and only the hardware reproduces it bit for bit. It needs AMX (the
// engine only picks it where AMX is) and the process's AMX permission (torch._C._cpu._init_amx()).
// The vec variant's sums are sequences per key (scores) and per head dim (P.V), so on AVX-512F it runs them 16
// keys or 16 dims to a vector (AVX2: its dots 8 lanes wide), each lane the scalar loop's sequence (FXP_VEC_DOTS). Every
// vector path equals the scalar one bit for bit.
// Compiled with -ffp-contract=off: every multiply and add rounds as written, fused only where asked.

#include "engine_kernels.h"


struct Problem {
  const uint16_t* q;  // [B, T, H, D]
  const uint16_t* k;  // [B, S, KVH, D]
  const uint16_t* v;
  uint16_t* out;      // [B, T, H, D]
  const int64_t* key_lens;
  const bool* mask;   // [B, mask_heads, T, S] or null
  int64_t B, T, H, D, S, KVH, group, mask_heads;
  float scale;
  bool causal;
  int64_t window, q_offset;
  int exp_kind, reduce_kind, store_kind;
  bool amx, flush, p_bf16, fma;
  bool merge_fma;  // the tile rescale and the split-KV merge fused (the AVX-512 builds), or multiply then add (AVX2)
  int64_t threads;
  const int32_t* kv_tiles;  // [B, T, kv_splits, 4]: each row's split-KV parts (first key, end key, tile origin, keys per
  int64_t kv_splits;        // tile; keys 0: one tile; end <= first: no part), or null: one part of one tile
};

// The keys query t of (b, h) sees: first..last, less what the mask blocks inside (mrow).
struct RowRange {
  int64_t first, last;
  const bool* mrow;
  bool allowed(int64_t j) const { return j >= first && j <= last && (mrow == nullptr || mrow[j]); }
  bool empty() const { return last < first; }
};

inline RowRange row_range(const Problem& P, int64_t b, int64_t h, int64_t t) {
  const int64_t valid = std::min<int64_t>(P.key_lens[b], P.S);
  const int64_t pos = P.q_offset + t;
  RowRange r{(P.window >= 0) ? std::max<int64_t>(0, pos - P.window) : 0, P.causal ? std::min<int64_t>(pos, valid - 1) : valid - 1,
             P.mask != nullptr ? P.mask + ((b * P.mask_heads + (P.mask_heads == 1 ? 0 : h)) * P.T + t) * P.S : nullptr};
  if (r.mrow != nullptr) {
    while (r.first <= r.last && !r.mrow[r.first]) ++r.first;
    while (r.last >= r.first && !r.mrow[r.last]) --r.last;
  }
  return r;
}

inline void store_row(const Problem& P, uint16_t* orow, const float* acc, float l) {
  const float inv = static_cast<float>(1.0 / static_cast<double>(l));
  for (int64_t d = 0; d < P.D; ++d) {
    float o = inv * acc[d];
    orow[d] = P.store_kind == STORE_TRUNC ? bf16_trunc(o) : bf16_rne(o);
  }
}

// The KV tile that holds key j of a row whose tiles start at `origin` and hold `tile` keys each (tile 0: one tile).
inline int64_t tile_end(int64_t j, int64_t origin, int64_t tile, int64_t last) {
  if (tile <= 0) return last;
  const int64_t rel = j - origin;
  const int64_t index = rel >= 0 ? rel / tile : -((-rel + tile - 1) / tile);
  return std::min<int64_t>(last, origin + (index + 1) * tile - 1);
}

// The engine's split-KV parts of query t of batch b: kv_splits entries of (first key, end key, tile origin, keys per
// tile), in key order (an entry with end <= first: none); without kv_tiles, one part of one tile.
struct KvSplit {
  int64_t start, end, origin, tile;
};

inline KvSplit row_split(const Problem& P, int64_t b, int64_t t, int64_t i) {
  if (P.kv_tiles == nullptr) return KvSplit{0, std::numeric_limits<int64_t>::max(), 0, 0};
  const int32_t* e = P.kv_tiles + ((b * P.T + t) * P.kv_splits + i) * 4;
  return KvSplit{e[0], e[1], e[2], e[3]};
}

// The engine's AVX-512 exp polynomial on 16 lanes: fast_exp512, op for op.
__attribute__((target("avx512f"))) inline __m512 fast_exp512_x16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(bits_to_float(0xc2aeac50u));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  __m512 src = _mm512_min_ps(x, _mm512_set1_ps(bits_to_float(0x42b17218u)));
  src = _mm512_max_ps(src, lo);
  __m512 fx = _mm512_fmadd_ps(src, _mm512_set1_ps(bits_to_float(0x3fb8aa3bu)), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(bits_to_float(0x3f317218u)), src);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_cvt_roundps_epi32(_mm512_sub_ps(fx, _mm512_set1_ps(1.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 two_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  two_n = _mm512_mask_blend_ps(underflow, two_n, _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(p, two_n), _mm512_set1_ps(2.0f));
}

// bf16_rne on 16 lanes (finite inputs: probabilities), denormals kept as the scalar rounding keeps them.
__attribute__((target("avx512f"))) inline __m256i bf16_rne_x16(__m512 f) {
  const __m512i b = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_cvtepi32_epi16(rounded);
}

// The lanes of keys j0..j0+15 the row sees: first..last as a run of lanes, less what its mask blocks
// (a masked load: bytes past the run are never read).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __mmask16 row_keys16(const RowRange& r, int64_t j0) {
  const int64_t from = std::max<int64_t>(r.first - j0, 0), to = std::min<int64_t>(r.last - j0, 15);
  if (to < from) return 0;
  const __mmask16 run = static_cast<__mmask16>(((1u << (to + 1)) - 1u) & ~((1u << from) - 1u));
  if (r.mrow == nullptr) return run;
  const __m128i bytes = _mm_maskz_loadu_epi8(run, r.mrow + j0);
  return _mm_test_epi8_mask(bytes, bytes);
}


// exp(x) of the keys `in` holds (0 in the other lanes): the AVX-512 polynomial on 16 lanes, else the scalar exp lane by lane.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 engine_exp16(const Problem& P, __m512 x, __mmask16 in) {
  if (P.exp_kind == EXP_FAST512) return _mm512_maskz_mov_ps(in, fast_exp512_x16(x));
  alignas(64) float e[16];
  _mm512_store_ps(e, x);
  for (int n = 0; n < 16; ++n) e[n] = (in >> n) & 1 ? engine_exp(e[n], P.exp_kind) : 0.0f;
  return _mm512_load_ps(e);
}

// ---- the vec variant on AVX-512F: the scalar loops of attention_rowwise, 16 lanes at a time, each lane's arithmetic
// the scalar loop's op for op (same operands, same order, the same fused or separate multiply-add), so every score,
// exponential and output is the same bits (tests hold the paths equal, fxp_set_vector_path(3) the scalar one).

constexpr int64_t kScoreGroups = 4;  // 16-key groups whose dot chains run side by side

// K of one (batch, kv head) as fp32 columns: kt[d * ld + j] = k_j[d], zero past S (ld: S rounded up to 16, and a run of
// kScoreGroups groups more).
void transpose_keys(const Problem& P, int64_t b, int64_t g, int64_t ld, float* kt) {
  for (int64_t d = 0; d < P.D; ++d) std::fill(kt + d * ld + P.S, kt + (d + 1) * ld, 0.0f);
  for (int64_t j = 0; j < P.S; ++j) {
    const uint16_t* krow = P.k + ((b * P.S + j) * P.KVH + g) * P.D;
    for (int64_t d = 0; d < P.D; ++d) kt[d * ld + j] = bf16_value(krow[d]);
  }
}

// The largest score of the row's keys in lo..hi, from `m` (max is exact: any order gives the same float).
__attribute__((target("avx512f,avx512bw,avx512vl"))) float vec_tile_max(const RowRange& r, const float* s, int64_t lo, int64_t hi, float m,
                                                                        bool* any) {
  const RowRange tile{std::max(r.first, lo), std::min(r.last, hi), r.mrow};
  __m512 vmax = _mm512_set1_ps(m);
  bool seen = false;
  for (int64_t j0 = tile.first - tile.first % 16; j0 <= tile.last; j0 += 16) {
    const __mmask16 in = row_keys16(tile, j0);
    seen = seen || in != 0;
    vmax = _mm512_mask_max_ps(vmax, in, vmax, _mm512_loadu_ps(s + j0));
  }
  *any = seen;
  return _mm512_reduce_max_ps(vmax);
}

// e_j = exp(s_j - mu) and p_j for the row's keys in lo..hi (0 elsewhere in their groups), e summed into `lane` (key j
// in lane j % 16, keys in order): the scalar loop's exp, sum and P.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void vec_tile_exp(const Problem& P, const RowRange& r, const float* s, int64_t lo,
                                                                       int64_t hi, float mu, float* lane, float* p) {
  const RowRange tile{std::max(r.first, lo), std::min(r.last, hi), r.mrow};
  __m512 sum = _mm512_loadu_ps(lane);
  alignas(64) float e[16];
  for (int64_t j0 = tile.first - tile.first % 16; j0 <= tile.last; j0 += 16) {
    const __mmask16 in = row_keys16(tile, j0);
    const __m512 ev = engine_exp16(P, _mm512_sub_ps(_mm512_loadu_ps(s + j0), _mm512_set1_ps(mu)), in);
    sum = _mm512_mask_add_ps(sum, in, sum, ev);
    if (P.p_bf16) {
      _mm512_store_ps(e, ev);
      for (int n = 0; n < 16; ++n) p[j0 + n] = bf16_value(bf16_rne(e[n]));
    } else {
      _mm512_storeu_ps(p + j0, ev);
    }
  }
  _mm512_storeu_ps(lane, sum);
}

// The vec variant's two dot sequences, W lanes to a vector (VEC), each lane the scalar loop's sequence op for op:
//   SCORES  s_j = sum_d qs[d] * k_j[d] from 0 in d order, keys j_lo.. up to last (j_lo a multiple of 16), the same
//           run of 16 * kScoreGroups keys side by side whatever W
//   PV      acc[d] += p_j * v_j[d] over the tile's keys in key order, NV vectors of head dims side by side
// LOADU, STOREU, SET1, ZERO, FMA(a, b, c) = a * b + c rounded once, MUL, ADD, and BF16(p) (W bf16 values widened) are
// the ISA's operations; the per-key softmax steps are the callers'.
#define FXP_VEC_DOTS(SCORES, PV, TARGET, VEC, W, LOADU, STOREU, SET1, ZERO, FMA, MUL, ADD, BF16)                                    \
  __attribute__((target(TARGET))) void SCORES(const float* qs, const float* kt, int64_t ld, int64_t D, int64_t j_lo, int64_t last,   \
                                              bool fma, float* s) {                                                                 \
    constexpr int64_t V = 16 * kScoreGroups / (W);                                                                                 \
    for (int64_t j0 = j_lo; j0 <= last; j0 += 16 * kScoreGroups) {                                                                 \
      VEC acc[V];                                                                                                                  \
      for (int64_t i = 0; i < V; ++i) acc[i] = ZERO();                                                                             \
      for (int64_t d = 0; d < D; ++d) {                                                                                            \
        const VEC q = SET1(qs[d]);                                                                                                 \
        const float* col = kt + d * ld + j0;                                                                                       \
        for (int64_t i = 0; i < V; ++i) {                                                                                          \
          const VEC k = LOADU(col + (W) * i);                                                                                      \
          acc[i] = fma ? FMA(q, k, acc[i]) : ADD(acc[i], MUL(q, k));                                                               \
        }                                                                                                                          \
      }                                                                                                                            \
      for (int64_t i = 0; i < V; ++i) STOREU(s + j0 + (W) * i, acc[i]);                                                            \
    }                                                                                                                              \
  }                                                                                                                                \
  template <int NV>                                                                                                                \
  __attribute__((target(TARGET))) void PV(const Problem& P, const RowRange& tile, const float* p, const uint16_t* v0, int64_t v_stride, \
                                          float* acc) {                                                                             \
    VEC a[NV];                                                                                                                     \
    for (int i = 0; i < NV; ++i) a[i] = LOADU(acc + (W) * i);                                                                      \
    for (int64_t j = tile.first; j <= tile.last; ++j) {                                                                            \
      if (!tile.allowed(j)) continue;                                                                                              \
      const VEC pj = SET1(p[j]);                                                                                                   \
      const uint16_t* vrow = v0 + j * v_stride;                                                                                    \
      for (int i = 0; i < NV; ++i) {                                                                                               \
        const VEC vv = BF16(vrow + (W) * i);                                                                                       \
        a[i] = P.fma ? FMA(pj, vv, a[i]) : ADD(a[i], MUL(pj, vv));                                                                 \
      }                                                                                                                            \
    }                                                                                                                              \
    for (int i = 0; i < NV; ++i) STOREU(acc + (W) * i, a[i]);                                                                      \
  }

#define VEC512_BF16(p) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))
FXP_VEC_DOTS(dot_scores_avx512, dot_pv_avx512, "avx512f", __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps,
             _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, VEC512_BF16)
#define VEC256_BF16(p) \
  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))
FXP_VEC_DOTS(dot_scores_avx2, dot_pv_avx2, "avx2,fma", __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
             _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, VEC256_BF16)

using PvFn = void (*)(const Problem&, const RowRange&, const float*, const uint16_t*, int64_t, float*);
constexpr int64_t kPvVectors[3] = {8, 4, 1};  // the runs' vectors, widest first
constexpr PvFn kPvAvx512[3] = {dot_pv_avx512<8>, dot_pv_avx512<4>, dot_pv_avx512<1>};
constexpr PvFn kPvAvx2[3] = {dot_pv_avx2<8>, dot_pv_avx2<4>, dot_pv_avx2<1>};

// acc[d] += p_j * v_j[d] over the row's keys in lo..hi in key order: the head dims in runs of 8, 4 or 1 vectors of
// 16 (AVX-512F) or 8 (AVX2) lanes.
void vec_pv(const Problem& P, const RowRange& r, int64_t b, int64_t g, int64_t lo, int64_t hi, const float* p, float* acc, bool avx512) {
  const RowRange tile{std::max(r.first, lo), std::min(r.last, hi), r.mrow};
  const int64_t v_stride = P.KVH * P.D, lanes = avx512 ? 16 : 8;
  const uint16_t* v0 = P.v + (b * P.S * P.KVH + g) * P.D;
  for (int64_t d0 = 0; d0 < P.D;) {
    int run = 0;
    while (kPvVectors[run] > (P.D - d0) / lanes) ++run;
    (avx512 ? kPvAvx512 : kPvAvx2)[run](P, tile, p, v0 + d0, v_stride, acc + d0);
    d0 += kPvVectors[run] * lanes;
  }
}

// One query row at a time: the reference, and the path of every variant but hardware AMX (and of hardware AMX
// where a row spans two KV tiles). The row's keys go through the softmax one KV tile at a time, as the engine's
// online softmax takes them (module comment, "KV tiles").
void attention_rowwise(const Problem& P, bool hardware_amx) {
  const int64_t D = P.D, S = P.S;
  const bool vec = !P.amx && !hardware_amx && D % 16 == 0;  // the vec variant: its dot sequences vectorise
  const bool vec512 = vec && g_vector_path <= 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool dots = vec512 || (vec && g_vector_path <= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  const int64_t ld = (S + 15) / 16 * 16 + 16 * kScoreGroups;  // a run of groups from any key stays inside
  parallel_ranges(P.B * P.H, P.threads, [&](int64_t begin, int64_t end) {
    std::vector<float> s(ld), e(S), p(ld), qs(D), acc(D), total(D), kt(dots ? D * ld : 0);
    std::vector<uint16_t> pchunk(32), bvnni(32 * 16);
    alignas(64) float cbuf[16];
    int64_t kt_of = -1;  // the (batch, kv head) kt holds
    if (hardware_amx) amx_configure();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.H, h = bh % P.H, g = h / P.group;
      if (dots && kt_of != b * P.KVH + g) {
        transpose_keys(P, b, g, ld, kt.data());
        kt_of = b * P.KVH + g;
      }
      for (int64_t t = 0; t < P.T; ++t) {
        const RowRange range = row_range(P, b, h, t);
        const int64_t first = range.first, last = range.last;
        auto allowed = [&](int64_t j) { return range.allowed(j); };
        const uint16_t* qrow = P.q + ((b * P.T + t) * P.H + h) * D;
        uint16_t* orow = P.out + ((b * P.T + t) * P.H + h) * D;
        if (range.empty()) {
          for (int64_t d = 0; d < D; ++d) orow[d] = 0;
          continue;
        }
        for (int64_t d = 0; d < D; ++d) qs[d] = P.amx ? bf16_value(qrow[d]) : bf16_value(qrow[d]) * P.scale;
        if (hardware_amx) {  // scores: for each 16 keys, the head dims in chunks of 32, in order
          for (int64_t j0 = first - first % 16; j0 <= last; j0 += 16) {
            for (int n = 0; n < 16; ++n) cbuf[n] = 0.0f;
            for (int64_t c = 0; c < D; c += 32) {
              for (int r = 0; r < 16; ++r)
                for (int n = 0; n < 16; ++n) {
                  const int64_t j = j0 + n;
                  const bool in = allowed(j);
                  const uint16_t* krow = P.k + ((b * S + (in ? j : first)) * P.KVH + g) * D;
                  bvnni[(r * 16 + n) * 2] = in ? krow[c + 2 * r] : 0;
                  bvnni[(r * 16 + n) * 2 + 1] = in ? krow[c + 2 * r + 1] : 0;
                }
              amx_chunk(qrow + c, bvnni.data(), cbuf);
            }
            for (int n = 0; n < 16; ++n) {
              const int64_t j = j0 + n;
              if (allowed(j)) s[j] = cbuf[n] * P.scale;
            }
          }
        }
        if (dots) (vec512 ? dot_scores_avx512 : dot_scores_avx2)(qs.data(), kt.data(), ld, D, first - first % 16, last, P.fma, s.data());
        for (int64_t j = first; j <= last && !hardware_amx && !dots; ++j) {
          if (!allowed(j)) continue;
          const uint16_t* krow = P.k + ((b * S + j) * P.KVH + g) * D;
          float a = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            float kv = bf16_value(krow[d]);
            if (P.amx) {
              float prod = P.flush ? ftz(ftz(qs[d]) * ftz(kv)) : qs[d] * kv;
              a = P.flush ? ftz(a + prod) : a + prod;
            } else {
              a = P.fma ? std::fmaf(qs[d], kv, a) : a + qs[d] * kv;
            }
          }
          s[j] = P.amx ? a * P.scale : a;
        }
        // The online softmax over the row's KV tiles, per split-KV part, the parts merged in key order. m starts at
        // the lowest float (the engine's seed), so the first tile always takes its own max and l its own sum; a later
        // tile whose max passes m by more than 8 rescales (l = f l + l_tile fused, acc *= f before its P.V, f = expf(m -
        // m_tile)), else it keeps m (e up to e^8) and adds its sum. One tile of one part is the one-pass softmax.
        float merged_m = 0.0f, l = 0.0f;
        bool merged_any = false;
        for (int64_t d = 0; d < D; ++d) total[d] = 0.0f;
        for (int64_t part = 0; part < (P.kv_tiles != nullptr ? P.kv_splits : 1); ++part) {
          const KvSplit split = row_split(P, b, t, part);
          const int64_t part_first = std::max<int64_t>(first, split.start);
          const int64_t part_last = std::min<int64_t>(last, split.end - 1);
          if (split.end <= split.start || part_last < part_first) continue;
          for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
          float m = std::numeric_limits<float>::lowest(), part_l = 0.0f;
          bool first_tile = true, any_key = false;
          for (int64_t lo = part_first; lo <= part_last;) {
            const int64_t hi = tile_end(lo, split.origin, split.tile, part_last);
            float tile_max = m;
            bool any = false;
            if (vec512) tile_max = vec_tile_max(range, s.data(), lo, hi, m, &any);
            for (int64_t j = lo; j <= hi && !vec512; ++j) {
              if (!allowed(j)) continue;
              tile_max = std::fmax(tile_max, s[j]);
              any = true;
            }
            if (!any) {  // no key of this row in the tile: the engine's step there leaves m, l and acc as they are
              lo = hi + 1;
              continue;
            }
            any_key = true;
            const float shift = m - tile_max;
            const bool rescale = shift < -8.0f;
            const float mu = rescale ? tile_max : m;
            float lane[16] = {0};
            if (vec512) vec_tile_exp(P, range, s.data(), lo, hi, mu, lane, p.data());
            for (int64_t j = lo; j <= hi && !vec512; ++j) {
              if (!allowed(j)) {
                e[j] = 0.0f;
                p[j] = 0.0f;
                continue;
              }
              e[j] = engine_exp(s[j] - mu, P.exp_kind);
              lane[j % 16] += e[j];
              p[j] = P.p_bf16 ? bf16_value(bf16_rne(e[j])) : e[j];
            }
            const float tile_sum = reduce_lanes(lane, P.reduce_kind);
            if (rescale) {
              const float f = std::exp(shift);
              part_l = P.merge_fma ? std::fmaf(f, part_l, tile_sum) : tile_sum + f * part_l;
              if (!first_tile)
                for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * f;
              m = tile_max;
            } else {
              part_l = tile_sum + part_l;
            }
            if (hardware_amx) {  // P.V: for each 16 dims, the tile's keys in chunks of 32 from a multiple of 32, in order
              const int64_t start = lo - lo % 32;
              for (int64_t d0 = 0; d0 < D; d0 += 16) {
                for (int n = 0; n < 16; ++n) cbuf[n] = acc[d0 + n];
                for (int64_t j0 = start; j0 <= hi; j0 += 32) {
                  for (int i = 0; i < 32; ++i) {
                    const int64_t j = j0 + i;
                    pchunk[i] = j >= lo && j <= hi && allowed(j) ? bf16_rne(e[j]) : 0;
                  }
                  for (int r = 0; r < 16; ++r)
                    for (int n = 0; n < 16; ++n)
                      for (int w = 0; w < 2; ++w) {
                        const int64_t j = j0 + 2 * r + w;
                        const bool in = j >= lo && j <= hi && allowed(j);
                        bvnni[(r * 16 + n) * 2 + w] = in ? P.v[((b * S + j) * P.KVH + g) * D + d0 + n] : 0;
                      }
                  amx_chunk(pchunk.data(), bvnni.data(), cbuf);
                }
                for (int n = 0; n < 16; ++n) acc[d0 + n] = cbuf[n];
              }
            }
            if (dots) vec_pv(P, range, b, g, lo, hi, p.data(), acc.data(), vec512);
            for (int64_t j = lo; j <= hi && !hardware_amx && !dots; ++j) {
              if (!allowed(j)) continue;
              const uint16_t* vrow = P.v + ((b * S + j) * P.KVH + g) * D;
              const float pj = P.flush ? ftz(p[j]) : p[j];
              for (int64_t d = 0; d < D; ++d) {
                float vv = bf16_value(vrow[d]);
                if (P.amx) {
                  float prod = P.flush ? ftz(pj * ftz(vv)) : pj * vv;
                  acc[d] = P.flush ? ftz(acc[d] + prod) : acc[d] + prod;
                } else {
                  acc[d] = P.fma ? std::fmaf(pj, vv, acc[d]) : acc[d] + pj * vv;
                }
              }
            }
            first_tile = false;
            lo = hi + 1;
          }
          if (!any_key) continue;
          if (!merged_any) {  // the first part: the running (M, L, O)
            merged_m = m;
            l = part_l;
            for (int64_t d = 0; d < D; ++d) total[d] = acc[d];
            merged_any = true;
            continue;
          }
          // reduce_splits: the larger max keeps its terms, the other's are scaled by expf(smaller - larger), fused
          if (merged_m > m) {
            const float f = std::exp(m - merged_m);
            l = P.merge_fma ? std::fmaf(part_l, f, l) : l + part_l * f;
            for (int64_t d = 0; d < D; ++d) total[d] = P.merge_fma ? std::fmaf(acc[d], f, total[d]) : total[d] + acc[d] * f;
          } else {
            const float f = std::exp(merged_m - m);
            l = P.merge_fma ? std::fmaf(l, f, part_l) : part_l + l * f;
            for (int64_t d = 0; d < D; ++d) total[d] = P.merge_fma ? std::fmaf(total[d], f, acc[d]) : acc[d] + total[d] * f;
          }
          merged_m = std::fmax(merged_m, m);
        }
        store_row(P, orow, total.data(), l);
      }
    }
    if (hardware_amx) amx_release();
  });
}

// Whether some row of the problem sees keys in two KV tiles or split-KV parts (the tiled AMX path computes one tile).
bool any_row_spans_tiles(const Problem& P) {
  if (P.kv_tiles == nullptr) return false;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t h = 0; h < P.H; h += (P.mask_heads == 1 ? P.H : 1))
      for (int64_t t = 0; t < P.T; ++t) {
        const RowRange r = row_range(P, b, h, t);
        if (r.empty()) continue;
        const KvSplit split = row_split(P, b, t, 0);
        if (split.start > r.first || split.end <= r.last || tile_end(r.first, split.origin, split.tile, r.last) < r.last) return true;
      }
  return false;
}

// One query row's softmax over its keys, 16 keys at a time (key j in lane j % 16, as the engine's lane
// sum has them): the scores scaled in place, m their max, e = exp(s - m) summed per lane in key order,
// P = e rounded to bf16 (0 off the row's keys). Returns l, the lanes reduced as the build does.
__attribute__((target("avx512f,avx512bw,avx512vl"))) float softmax_row16(const Problem& P, const RowRange& r, float* srow, uint16_t* prow) {
  const int64_t j_lo = r.first - r.first % 16;
  auto keys = [&](int64_t j0) { return row_keys16(r, j0); };
  const __m512 scale = _mm512_set1_ps(P.scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = j_lo; j0 <= r.last; j0 += 16) {
    const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(srow + j0), scale);
    _mm512_storeu_ps(srow + j0, sc);
    vmax = _mm512_mask_max_ps(vmax, keys(j0), vmax, sc);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 lane = _mm512_setzero_ps();
  for (int64_t j0 = j_lo; j0 <= r.last; j0 += 16) {
    const __mmask16 in = keys(j0);
    const __m512 ev = engine_exp16(P, _mm512_sub_ps(_mm512_loadu_ps(srow + j0), m), in);
    lane = _mm512_mask_add_ps(lane, in, lane, ev);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j0), bf16_rne_x16(ev));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, lane);
  return reduce_lanes(lanes, P.reduce_kind);
}

// Hardware AMX, 16 query rows per tile: the same instruction on the same chunks in the same order as
// attention_rowwise, so every row's result is the same bits (a test holds the two equal).
//   K of (b, g) packed once: per 16 keys, per 32 head dims, the VNNI B tile;  V: per 32 keys, per 16 dims
//   scores  C[16 rows, 16 keys] over the head-dim chunks in order; each row keeps its allowed keys
//   P.V     C[16 rows, 16 dims] over the key chunks in order, P = 0 off a row's keys; a row's C is
//           taken after its own last chunk (the later chunks, zeros for it, could turn a -0 into +0);
//           the chunks before its first add zeros to C = +0, which leaves +0
// Keys a row does not see enter the tiles with p = 0 (P.V) or are dropped (scores): each element of C
// is its own row of A against its own column of B, so other keys and rows never touch it.
void attention_amx_tiled(const Problem& P) {
  const int64_t D = P.D, S = P.S, T = P.T;
  const int64_t blocks16 = (S + 15) / 16, chunks = D / 32, S32 = (S + 31) / 32 * 32, dims16 = D / 16;
  parallel_ranges(P.B * P.H, P.threads, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kpack(blocks16 * chunks * 512), vpack((S32 / 32) * dims16 * 512);
    std::vector<uint16_t> qbuf(16 * D), pbuf(16 * S32);
    std::vector<float> sbuf(16 * blocks16 * 16), acc(16 * D);
    alignas(64) float cbuf[16 * 16];
    std::vector<RowRange> ranges(16);
    amx_configure_rows16();
    int64_t packed = -1;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.H, h = bh % P.H, g = h / P.group;
      const int64_t valid = std::min<int64_t>(P.key_lens[b], S);
      if (packed != b * P.KVH + g) {
        packed = b * P.KVH + g;
        for (int64_t blk = 0; blk < blocks16; ++blk)
          for (int64_t c = 0; c < chunks; ++c)
            for (int r = 0; r < 16; ++r)
              for (int n = 0; n < 16; ++n) {
                const int64_t j = blk * 16 + n;
                const uint16_t* krow = P.k + ((b * S + j) * P.KVH + g) * D + c * 32 + 2 * r;
                uint16_t* dst = kpack.data() + ((blk * chunks + c) * 16 + r) * 32 + n * 2;
                dst[0] = j < valid ? krow[0] : 0;
                dst[1] = j < valid ? krow[1] : 0;
              }
        for (int64_t jc = 0; jc < S32 / 32; ++jc)
          for (int64_t db = 0; db < dims16; ++db)
            for (int r = 0; r < 16; ++r)
              for (int n = 0; n < 16; ++n)
                for (int w = 0; w < 2; ++w) {
                  const int64_t j = jc * 32 + 2 * r + w;
                  vpack[((jc * dims16 + db) * 16 + r) * 32 + n * 2 + w] = j < valid ? P.v[((b * S + j) * P.KVH + g) * D + db * 16 + n] : 0;
                }
      }
      for (int64_t t0 = 0; t0 < T; t0 += 16) {
        const int64_t rows = std::min<int64_t>(16, T - t0);
        int64_t lo = S, hi = -1;
        for (int64_t i = 0; i < 16; ++i) {
          ranges[i] = i < rows ? row_range(P, b, h, t0 + i) : RowRange{0, -1, nullptr};
          if (!ranges[i].empty()) {
            lo = std::min(lo, ranges[i].first);
            hi = std::max(hi, ranges[i].last);
          }
          for (int64_t d = 0; d < D; ++d) qbuf[i * D + d] = i < rows ? P.q[((b * T + t0 + i) * P.H + h) * D + d] : 0;
        }
        if (hi < lo) {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t d = 0; d < D; ++d) P.out[((b * T + t0 + i) * P.H + h) * D + d] = 0;
          continue;
        }
        for (int64_t blk = lo / 16; blk <= hi / 16; ++blk)
          amx_rows16(qbuf.data(), D * 2, 32, kpack.data() + blk * chunks * 512, chunks, sbuf.data() + blk * 16, blocks16 * 16 * 4);
        float l[16];
        for (int64_t i = 0; i < 16; ++i) {
          uint16_t* prow = pbuf.data() + i * S32;
          std::fill(prow, prow + S32, 0);
          if (!ranges[i].empty()) l[i] = softmax_row16(P, ranges[i], sbuf.data() + i * blocks16 * 16, prow);
        }
        for (int64_t db = 0; db < dims16; ++db) {
          amx_zero_c();
          for (int64_t jc = lo / 32; jc <= hi / 32; ++jc) {
            amx_step(pbuf.data() + jc * 32, S32 * 2, vpack.data() + (jc * dims16 + db) * 512);
            bool taken = false;
            for (int64_t i = 0; i < 16; ++i) {
              if (ranges[i].empty() || ranges[i].last / 32 != jc) continue;
              if (!taken) amx_store_c(cbuf);
              taken = true;
              for (int n = 0; n < 16; ++n) acc[i * D + db * 16 + n] = cbuf[i * 16 + n];
            }
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          uint16_t* orow = P.out + ((b * T + t0 + i) * P.H + h) * D;
          if (ranges[i].empty()) {
            for (int64_t d = 0; d < D; ++d) orow[d] = 0;
            continue;
          }
          store_row(P, orow, acc.data() + i * D, l[i]);
        }
      }
    }
    amx_release();
  });
}

extern "C" {

// q: [B, T, H, D], k, v: [B, S, KVH, D] (bf16 bits, contiguous); key_lens: [B], valid keys per row;
// mask: [B, mask_heads, T, S] bytes (1: attend) or null. Query t of row b sits at position q_offset + t;
// it sees keys j <= q_offset + t (causal), j >= q_offset + t - w (window w >= 0), and where the mask
// allows. Masked keys inside the range contribute nothing, as in the engine (p = 0). Writes out
// [B, T, H, D]. rowwise: one query row at a time (the reference the tiled path is held to).
// The caller (contract/kernels.py) checks dtypes, shapes and contiguity.
// One arithmetic of the engine's attention kernel (mirrored by contract/kernels.py AttentionVariantStruct).
struct FxpAttentionVariant {
  int32_t scores;     // Qk: QK_AMX | QK_VEC
  int32_t exp;        // Exp: EXP_LIBM | EXP_FAST512
  int32_t lane_sum;   // Reduce: REDUCE_AVX512 | REDUCE_AVX2
  int32_t p_bf16;     // probabilities rounded to bf16 before P.V
  int32_t fma;        // fused multiply-adds in the fp32 dot products (vec)
  int32_t store;      // Store: STORE_RNE | STORE_TRUNC
  int32_t flush;      // denormals flushed as AMX flushes them
  int32_t merge_fma;  // the tile rescale and the split-KV merge: fused multiply-adds, or multiply then add
};

void fxp_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, const int64_t* key_lens, const uint8_t* mask,
                   int64_t B, int64_t T, int64_t H, int64_t D, int64_t S, int64_t KVH, int64_t mask_heads, double scale, int causal,
                   int64_t window, int64_t q_offset, const FxpAttentionVariant* variant, int rowwise, int64_t threads,
                   const int32_t* kv_tiles, int64_t kv_splits) {
  const FxpAttentionVariant& a = *variant;
  Problem P{q, k, v, out, key_lens, reinterpret_cast<const bool*>(mask),
            B, T, H, D, S, KVH, H / KVH, mask != nullptr ? mask_heads : 1,
            static_cast<float>(scale), causal != 0, window, q_offset,
            a.exp, a.lane_sum, a.store,
            a.scores == QK_AMX, a.scores == QK_AMX && a.flush != 0, a.p_bf16 != 0, a.fma != 0, a.merge_fma != 0, threads, kv_tiles, kv_splits};
  const bool hardware_amx = P.amx && D % 32 == 0;
  if (hardware_amx && !rowwise && !any_row_spans_tiles(P)) {
    attention_amx_tiled(P);
  } else {
    attention_rowwise(P, hardware_amx);
  }
}

int fxp_cpu_has_amx() { return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16"); }

int fxp_cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

void fxp_set_vector_path(int level) { g_vector_path = level; }

}  // extern "C"
