// What the engine kernels' files share (attention_kernels.cpp, linear_kernels.cpp, moe_kernels.cpp): OpenMP ranges,
// the vector path the tests may cap (fxp_set_vector_path), bf16 bit conversions and roundings, the engine's exp
// polynomial and lane reductions, the AMX tile helpers. Plain C++, no torch headers; built into one library by
// contract/kernels.py with -ffp-contract=off (every multiply and add rounds as written, fused only where asked).
#pragma once

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
}  // namespace

inline int g_vector_path = 0;  // one for the library (a C++17 inline variable: every kernel file reads this one)

namespace {

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
