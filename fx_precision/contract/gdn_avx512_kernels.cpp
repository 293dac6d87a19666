// GatedDeltaNet as vLLM's AVX-512 kernel build (_C: AVX-512 + AVX512-BF16, with or without AMX) computes it: the C++
// kernels of csrc/cpu/sgl-kernels (conv.cpp, fla.cpp) as its binary runs them, read off the binary's code and held to it
// bit for bit (engines/vllm/gdn_probe.py runs both on random inputs at the model's sizes; tests/engine/test_gdn.py).
//
//   fxp_gdn512_conv      causal_conv1d_fwd_cpu / _update_cpu with packed weights (width 4): per channel and token
//                        VDPBF16PS on the tap pairs (odd tap first, each step rounded), fast_silu (exp_u20, then
//                        VRCP14PS of 1 + e), one NE rounding
//   fxp_gdn512_gating    fused_gdn_gating_cpu: heads in vector blocks of 32 (exp_u20, SLEEF's 16-lane log, VRCP14PS
//                        sigmoid), the rest scalar (glibc, as the portable build)
//   fxp_gdn512_decode    fused_sigmoid_gating_delta_rule_update_cpu: q / k l2 factors in 16 fused lanes and GCC's
//                        reduce tree, the scalar gating, the recurrence with its four fused multiply-adds
//   fxp_gdn512_chunk     chunk_gated_delta_rule_cpu: chunks of 64; l2 by VDPBF16PS pairs; decay fexp_u20; every
//                        GEMM libtorch's at::native::cpublas::brgemm, the engine's own call (oneDNN's avx512_core_bf16
//                        brgemm here: pairs from 0, odd element first, C added once at the end; AMX tiles on an AMX
//                        CPU); solve_tril with fused multiply-adds; VCVTNEPS2BF16 roundings
//
// The approximations are the engine's own: VRCP14PS is the instruction itself (its table is the CPU's: the training side
// runs on the engine's CPU family, as the contract's AMX kernels do), SLEEF's log is torch's own function (set by
// fxp_gdn512_set_log), exp_u20 / fexp_u20 are ATen's polynomials, written out. Subnormal inputs to the bf16 dot
// products (which the hardware treats as zero) are not modelled: random and model data do not reach them.

#include "engine_kernels.h"

namespace {

inline float b2f(uint16_t h) { return bf16_value(h); }
inline uint32_t fbits(float f) { return float_to_bits(f); }
// ATen's convert_from_float (software round to nearest even; NaN -> 0xffff)
inline uint16_t to_bf16_sw(float f) {
  uint32_t u = fbits(f);
  if (std::isnan(f)) return 0xffff;
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
// c10::BFloat16(float) (NaN -> 0x7fc0)
inline uint16_t to_bf16_c10(float f) {
  uint32_t u = fbits(f);
  if (std::isnan(f)) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
// VCVTNEPS2BF16: nearest even, a subnormal input gives a signed zero, NaN quieted
inline uint16_t to_bf16_ne(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7f800000) == 0 && (u & 0x7fffff)) return static_cast<uint16_t>((u >> 16) & 0x8000);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
inline float round_ne(float f) { return b2f(to_bf16_ne(f)); }
inline float round_c10(float f) { return b2f(to_bf16_c10(f)); }

// ATen's Vectorized<float>::exp_u20 (vec512): the shared header's fast_exp512, the attention's exp
inline float exp_u20(float x) { return fast_exp512(x); }

// ATen's Vectorized<float>::fexp_u20 (vec512), lane by lane
float fexp_u20(float x) {
  const bool below = x < bits_to_float(0xc2aeac50), above = x > bits_to_float(0x42b17218);
  float s = x * bits_to_float(0x3fb8aa3b);
  const float f = s - std::floor(s);
  float t = std::fma(f, bits_to_float(0xbda235d5), bits_to_float(0xbe65b8f5));
  t = std::fma(f, t, bits_to_float(0x3e9b69f0));
  t = std::fma(f, t, bits_to_float(0x38e077a1));
  s = s - t;
  const float v = std::fma(8388608.0f, s, 1065353216.0f);
  int32_t i = (v >= 2147483648.0f || v != v) ? INT32_MIN : static_cast<int32_t>(v);  // cvttps2dq
  if (below) i = 0;
  if (above) i = 0x7f800000;
  return bits_to_float(static_cast<uint32_t>(i));
}

// VRCP14PS itself: the engine's sigmoid and silu divide by it
__attribute__((target("avx512f"))) float rcp14(float x) { return _mm512_cvtss_f32(_mm512_rcp14_ps(_mm512_set1_ps(x))); }

typedef __m512 (*Log16)(__m512);
Log16 g_log16 = nullptr;  // torch's Sleef_logf16_u10 (fxp_gdn512_set_log)

__attribute__((target("avx512f"))) float sleef_log16(float x) { return _mm512_cvtss_f32(g_log16(_mm512_set1_ps(x))); }

// GCC's _mm512_reduce_add_ps: the shared header's 16-lane tree
inline float reduce16(const float* a) { return reduce_lanes(a, REDUCE_AVX512); }

// one VDPBF16PS lane: the odd (high) product first, each addition rounded
inline float dot_pair(float acc, float a0, float a1, float b0, float b1) {
  acc = acc + a1 * b1;
  return acc + a0 * b0;
}

// oneDNN's avx512_core_bf16 brgemm on bf16 values held as floats, written out (where torch exports no brgemm; the test
// of the chunk rule holds torch's to it): C[m][n] = (add ? C + acc : acc), acc from 0 over the K pairs in order (odd
// element first). B is [K][N] row-major.
// Each output's pairs are folded in order; the outputs of a row advance together (a vector of them, as the kernel's
// own registers hold them), which is the same arithmetic per output.
__attribute__((target("avx512f"))) void brgemm_emulated(int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                                                         float* C, int ldc, bool add) {
  std::vector<float> acc(N);
  const int whole = N - N % 16;
  for (int m = 0; m < M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int p = 0; p < K / 2; ++p) {
      const float a0 = A[m * lda + 2 * p], a1 = A[m * lda + 2 * p + 1];
      const float* b0 = B + (2 * p) * ldb;
      const float* b1 = B + (2 * p + 1) * ldb;
      const __m512 va0 = _mm512_set1_ps(a0), va1 = _mm512_set1_ps(a1);
      for (int n = 0; n < whole; n += 16) {  // dot_pair, 16 outputs at once: the odd product added first, each sum rounded
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(&acc[n]), _mm512_mul_ps(va1, _mm512_loadu_ps(b1 + n)));
        _mm512_storeu_ps(&acc[n], _mm512_add_ps(v, _mm512_mul_ps(va0, _mm512_loadu_ps(b0 + n))));
      }
      for (int n = whole; n < N; ++n) acc[n] = dot_pair(acc[n], a0, a1, b0[n], b1[n]);
    }
    for (int n = 0; n < N; ++n) C[m * ldc + n] = add ? acc[n] + C[m * ldc + n] : acc[n];
  }
}

// The engine's GEMMs call libtorch's at::native::cpublas::brgemm (oneDNN's ukernel: VDPBF16PS on an AVX-512 BF16 CPU,
// AMX tiles on an AMX CPU), set by fxp_gdn512_set_brgemm: the contract calls the same function with the same M, N, K,
// add_C and operands (A bf16 rows, B packed to VNNI pairs [K/2][N][2]), so its sums are the engine's on either CPU.
typedef void (*TorchBrgemm)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const uint16_t*, const uint16_t*, float*, bool);
typedef void (*TorchBrgemmRelease)(bool);
TorchBrgemm g_torch_brgemm = nullptr;
TorchBrgemmRelease g_torch_brgemm_release = nullptr;

void brgemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc, bool add) {
  if (g_torch_brgemm == nullptr) {
    brgemm_emulated(M, N, K, A, lda, B, ldb, C, ldc, add);
    return;
  }
  const int Kp = (K + 1) / 2 * 2;
  thread_local std::vector<uint16_t> a16, b16;
  a16.assign(static_cast<size_t>(M) * Kp, 0);
  b16.assign(static_cast<size_t>(Kp) * N, 0);
  for (int m = 0; m < M; ++m)  // the operands are bf16 values: their top 16 bits
    for (int k = 0; k < K; ++k) a16[static_cast<size_t>(m) * Kp + k] = static_cast<uint16_t>(fbits(A[m * lda + k]) >> 16);
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) b16[(static_cast<size_t>(k / 2) * N + n) * 2 + (k & 1)] = static_cast<uint16_t>(fbits(B[k * ldb + n]) >> 16);
  g_torch_brgemm(M, N, Kp, Kp, N, ldc, add, a16.data(), b16.data(), C, true);
}

float softplus_scalar(float x) { return x > 20.0f ? x : (x < -20.0f ? std::exp(x) : std::log1p(std::exp(x))); }

// the decode kernel's beta (and the prefill gating's scalar heads'): c10 bf16 arithmetic, three roundings
float beta_scalar(float b) {
  const float e = round_c10(std::exp(-b));
  const float d = round_c10(1.0f + e);
  return round_c10(1.0f / d);
}

// the chunk kernel's l2 normalisation of one [D] bf16 row: VDPBF16PS pairs over 16 lanes, the reduce tree
void l2_normalised(const uint16_t* x, int64_t D, float eps, bool scaled, float* out) {
  float acc[16] = {0};
  for (int64_t c = 0; c < D / 32; ++c) {
    for (int i = 0; i < 16; ++i) {
      const float e = b2f(x[32 * c + 2 * i]), o = b2f(x[32 * c + 2 * i + 1]);
      acc[i] = dot_pair(acc[i], e, o, e, o);
    }
  }
  const float rs = 1.0f / std::sqrt(reduce16(acc) + eps);
  const float scale = static_cast<float>(1.0f / std::sqrt(static_cast<double>(D)));
  for (int64_t d = 0; d < D; ++d) {
    float y = b2f(x[d]) * rs;
    if (scaled) y = y * scale;
    out[d] = round_ne(y);
  }
}

// One head's decode step on its state St [D (k), D (v)]: kv, delta and o [D] per output vd, each folding d in order
// (16 outputs a vector: the same fma, mul and sub per output as one at a time). D is whole vectors (64, 128).
__attribute__((target("avx512f"))) void decode_head(float* St, const uint16_t* kr, const uint16_t* qr, const uint16_t* vr, float ge, float bt,
                                                    float qs, float ks, float scale, int64_t D, float* kv, float* delta, float* o) {
  const __m512 vge = _mm512_set1_ps(ge), vscale = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kd = _mm512_set1_ps(b2f(kr[d]) * ks);
    const float* Srow = St + d * D;
    for (int64_t vd = 0; vd < D; vd += 16)
      _mm512_storeu_ps(kv + vd, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(Srow + vd), vge), kd, _mm512_loadu_ps(kv + vd)));
  }
  for (int64_t vd = 0; vd < D; ++vd) delta[vd] = (b2f(vr[vd]) - kv[vd]) * bt;
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kd = _mm512_set1_ps(b2f(kr[d]) * ks);
    const __m512 qd = _mm512_set1_ps(b2f(qr[d]) * qs);
    float* Srow = St + d * D;
    for (int64_t vd = 0; vd < D; vd += 16) {
      const __m512 updated = _mm512_fmadd_ps(kd, _mm512_loadu_ps(delta + vd), _mm512_mul_ps(_mm512_loadu_ps(Srow + vd), vge));
      _mm512_storeu_ps(o + vd, _mm512_fmadd_ps(_mm512_mul_ps(updated, qd), vscale, _mm512_loadu_ps(o + vd)));
      _mm512_storeu_ps(Srow + vd, updated);
    }
  }
}

}  // namespace

extern "C" {

void fxp_gdn512_set_log(void* fn) { g_log16 = reinterpret_cast<Log16>(fn); }
void fxp_gdn512_set_brgemm(void* fn, void* release) {
  g_torch_brgemm = reinterpret_cast<TorchBrgemm>(fn);
  g_torch_brgemm_release = reinterpret_cast<TorchBrgemmRelease>(release);
}

// One piece's conv: x [L, C] bf16 rows after history [3, C] (the request's stored inputs, oldest first; zeros for a new
// request), w [C, 4] bf16; out [L, C] bf16.
void fxp_gdn512_conv(const uint16_t* x, const uint16_t* history, const uint16_t* w, int64_t L, int64_t C, uint16_t* out) {
#pragma omp parallel for collapse(2) schedule(static)  // every output its own arithmetic: split over threads as they come
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t c = 0; c < C; ++c) {
      float xs[4];
      for (int k = 0; k < 4; ++k) {
        const int64_t at = t - 3 + k;
        xs[k] = b2f(at >= 0 ? x[at * C + c] : history[(3 + at) * C + c]);
      }
      float acc = dot_pair(0.0f, xs[0], xs[1], b2f(w[c * 4 + 0]), b2f(w[c * 4 + 1]));
      acc = dot_pair(acc, xs[2], xs[3], b2f(w[c * 4 + 2]), b2f(w[c * 4 + 3]));
      const float y = acc * rcp14(exp_u20(-acc) + 1.0f);
      out[t * C + c] = to_bf16_ne(y);
    }
  }
}

// The prefill gating of T tokens: a, b [T, Hv] bf16, A_log [Hv] fp32, dt_bias [Hv] bf16 -> g [T, Hv] fp32, beta bf16.
void fxp_gdn512_gating(const uint16_t* a, const uint16_t* b, const float* A_log, const uint16_t* dt, int64_t T, int64_t Hv, float* g,
                       uint16_t* beta) {
  const int64_t vector_heads = Hv - Hv % 32;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < Hv; ++j) {
      const float x = b2f(a[t * Hv + j]) + b2f(dt[j]);
      const float bj = b2f(b[t * Hv + j]);
      if (j < vector_heads) {
        const float e = exp_u20(x);
        float sp = sleef_log16(e + 1.0f);
        if (x < -20.0f) sp = e;
        if (x > 20.0f) sp = x;
        g[t * Hv + j] = (-1.0f * exp_u20(A_log[j])) * sp;
        beta[t * Hv + j] = to_bf16_sw(rcp14(exp_u20(-bj) + 1.0f));
      } else {
        g[t * Hv + j] = -std::exp(A_log[j]) * softplus_scalar(x);
        beta[t * Hv + j] = to_bf16_c10(beta_scalar(bj));
      }
    }
  }
}

// B decoded tokens, one per request: q, k [B, H, D], v [B, Hv, D], a, b [B, Hv] bf16; A_log [Hv] fp32, dt [Hv] bf16;
// S [B, Hv, D (k), D (v)] fp32, updated in place; out [B, Hv, D] bf16.
void fxp_gdn512_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* a, const uint16_t* b, const float* A_log,
                       const uint16_t* dt, float* S, int64_t B, int64_t H, int64_t Hv, int64_t D, uint16_t* out) {
  const int64_t group = Hv / H;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float eps = 1e-5f;  // the decode kernel's own constant
  std::vector<float> factors(2 * B * H);
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      for (int which = 0; which < 2; ++which) {
        const uint16_t* x = (which == 0 ? q : k) + (i * H + h) * D;
        float acc[16] = {0};
        for (int64_t block = 0; block < D / 32; ++block) {
          for (int l = 0; l < 16; ++l) acc[l] = std::fma(b2f(x[32 * block + l]), b2f(x[32 * block + l]), acc[l]);
          for (int l = 0; l < 16; ++l) acc[l] = std::fma(b2f(x[32 * block + 16 + l]), b2f(x[32 * block + 16 + l]), acc[l]);
        }
        factors[which * B * H + i * H + h] = 1.0f / std::sqrt((0.0f + reduce16(acc)) + eps);
      }
    }
  }
  // Heads apart (each thread whole heads); within a head every output vd folds d in order, the outputs advancing
  // together: the kernel's arithmetic per output, whatever the threads.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t n = 0; n < Hv; ++n) {
      std::vector<float> kv(D, 0.0f), delta(D), o(D, 0.0f);
      const int64_t h = n / group;
      const float x = b2f(a[i * Hv + n]) + b2f(dt[n]);
      const float ge = std::exp(-std::exp(A_log[n]) * softplus_scalar(x));
      const float bt = beta_scalar(b2f(b[i * Hv + n]));
      const float qs = factors[i * H + h], ks = factors[B * H + i * H + h];
      float* St = S + (i * Hv + n) * D * D;
      const uint16_t* qr = q + (i * H + h) * D;
      const uint16_t* kr = k + (i * H + h) * D;
      decode_head(St, kr, qr, v + (i * Hv + n) * D, ge, bt, qs, ks, scale, D, kv.data(), delta.data(), o.data());
      for (int64_t vd = 0; vd < D; ++vd) out[(i * Hv + n) * D + vd] = to_bf16_sw(o[vd]);
    }
  }
}

// One request piece of L prefilled tokens: q, k [L, H, D], v [L, Hv, D] bf16, g [L, Hv] fp32, beta [L, Hv] bf16;
// S [Hv, D, D] fp32 in / out (the request's state, zeros for a new one); out [L, Hv, D] bf16.
void fxp_gdn512_chunk(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* g, const uint16_t* beta, float* S, int64_t L,
                      int64_t H, int64_t Hv, int64_t D, float eps, uint16_t* out) {
  const int C = 64;
  const int64_t group = Hv / H;
  std::vector<float> qn(L * H * D), kn(L * H * D);
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      l2_normalised(q + (t * H + h) * D, D, eps, true, &qn[(t * H + h) * D]);
      l2_normalised(k + (t * H + h) * D, D, eps, false, &kn[(t * H + h) * D]);
    }
  }
  // Heads apart: each thread whole heads, each head its own scratch (the engine's arithmetic per head, whatever the threads)
#pragma omp parallel for schedule(static)
  for (int64_t hv = 0; hv < Hv; ++hv) {
    std::vector<float> gc(C), decay(C * C), attn(C * C), A(C * C), kb(C * D), vb(C * D), w(C * D), u(C * D), Sb(D * D), wS(C * D),
        v2(C * D), qg(C * D), o(C * D), ku(D * C), kc(C * D), qc(C * D), row(C), kT(D * C), P(C * C);
    const int64_t h = hv / group;
    float* St = S + hv * D * D;
    for (int64_t c0 = 0; c0 < L; c0 += C) {
      const int mb = static_cast<int>(std::min<int64_t>(C, L - c0));
      const int pad = (mb + 31) / 32 * 32;
      float run = 0.0f;
      for (int i = 0; i < C; ++i) {
        if (i < mb) run = run + g[(c0 + i) * Hv + hv];
        gc[i] = run;
      }
      for (int r = 0; r < C; ++r)
        for (int c = 0; c < C; ++c) decay[r * C + c] = c <= r ? fexp_u20(gc[r] - gc[c]) : 0.0f;
      std::fill(kc.begin(), kc.end(), 0.0f);
      std::fill(qc.begin(), qc.end(), 0.0f);
      std::fill(kT.begin(), kT.end(), 0.0f);
      for (int t = 0; t < mb; ++t) {
        for (int64_t d = 0; d < D; ++d) {
          kc[t * D + d] = kn[((c0 + t) * H + h) * D + d];
          qc[t * D + d] = qn[((c0 + t) * H + h) * D + d];
          kT[d * C + t] = kc[t * D + d];
        }
      }
      // intra: A = (I + strictly lower (k k^T * -beta * decay))^-1, solved row by row
      brgemm(mb, mb, static_cast<int>(D), kc.data(), static_cast<int>(D), kT.data(), C, attn.data(), C, false);
      std::fill(A.begin(), A.end(), 0.0f);
      for (int r = 0; r < mb; ++r) {
        const float nb = -b2f(beta[(c0 + r) * Hv + hv]);
        for (int c = 0; c < r; ++c) A[r * C + c] = round_ne((attn[r * C + c] * nb) * decay[r * C + c]);
      }
      for (int i = 1; i < mb; ++i) {
        for (int j = 0; j < i; ++j) row[j] = A[i * C + j];
        for (int kk = 0; kk < i; ++kk) {
          const float aik = A[i * C + kk];
          for (int j = 0; j < kk; ++j) row[j] = std::fma(aik, A[kk * C + j], row[j]);
        }
        for (int j = 0; j < i; ++j) A[i * C + j] = round_ne(row[j]);
      }
      for (int i = 0; i < mb; ++i) A[i * C + i] = round_c10(A[i * C + i] + 1.0f);
      std::fill(kb.begin(), kb.end(), 0.0f);
      std::fill(vb.begin(), vb.end(), 0.0f);
      for (int t = 0; t < mb; ++t) {
        const float bt = b2f(beta[(c0 + t) * Hv + hv]);
        const float eg = fexp_u20(gc[t]);
        for (int64_t d = 0; d < D; ++d) {
          kb[t * D + d] = round_ne((kc[t * D + d] * bt) * eg);
          vb[t * D + d] = round_ne(b2f(v[((c0 + t) * Hv + hv) * D + d]) * bt);
        }
      }
      brgemm(mb, static_cast<int>(D), pad, A.data(), C, kb.data(), static_cast<int>(D), w.data(), static_cast<int>(D), false);
      brgemm(mb, static_cast<int>(D), pad, A.data(), C, vb.data(), static_cast<int>(D), u.data(), static_cast<int>(D), false);
      for (int i = 0; i < mb * D; ++i) {
        w[i] = round_ne(w[i]);
        u[i] = round_ne(u[i]);
      }
      // inter: the chunk's output from the state it starts with, then the state it leaves
      brgemm(mb, mb, static_cast<int>(D), qc.data(), static_cast<int>(D), kT.data(), C, attn.data(), C, false);
      std::fill(P.begin(), P.end(), 0.0f);
      for (int r = 0; r < mb; ++r)
        for (int c = 0; c <= r; ++c) P[r * C + c] = round_ne(attn[r * C + c] * decay[r * C + c]);
      const float g_last = gc[mb - 1];
      const float e_last = std::exp(g_last);
      for (int64_t i = 0; i < D * D; ++i) {
        Sb[i] = round_ne(St[i]);
        St[i] = St[i] * e_last;
      }
      brgemm(mb, static_cast<int>(D), static_cast<int>(D), w.data(), static_cast<int>(D), Sb.data(), static_cast<int>(D), wS.data(),
             static_cast<int>(D), false);
      std::fill(v2.begin(), v2.end(), 0.0f);
      for (int t = 0; t < mb; ++t)
        for (int64_t d = 0; d < D; ++d) v2[t * D + d] = round_ne(u[t * D + d] - wS[t * D + d]);
      for (int t = 0; t < mb; ++t) {
        const float eg = fexp_u20(gc[t]);
        for (int64_t d = 0; d < D; ++d) qg[t * D + d] = round_ne(qc[t * D + d] * eg);
      }
      brgemm(mb, static_cast<int>(D), static_cast<int>(D), qg.data(), static_cast<int>(D), Sb.data(), static_cast<int>(D), o.data(),
             static_cast<int>(D), false);
      brgemm(mb, static_cast<int>(D), pad, P.data(), C, v2.data(), static_cast<int>(D), o.data(), static_cast<int>(D), true);
      for (int t = 0; t < mb; ++t)
        for (int64_t d = 0; d < D; ++d) out[((c0 + t) * Hv + hv) * D + d] = to_bf16_ne(o[t * D + d]);
      std::fill(ku.begin(), ku.end(), 0.0f);
      for (int t = 0; t < mb; ++t) {
        const float e = fexp_u20(g_last - gc[t]);
        for (int64_t d = 0; d < D; ++d) ku[d * C + t] = round_ne(kc[t * D + d] * e);
      }
      brgemm(static_cast<int>(D), static_cast<int>(D), pad, ku.data(), C, v2.data(), static_cast<int>(D), St, static_cast<int>(D), true);
    }
    if (g_torch_brgemm_release != nullptr) g_torch_brgemm_release(true);  // as the engine's threads end their heads
  }
}

}  // extern "C"
