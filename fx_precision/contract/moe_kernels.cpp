// fxp_engine's fused experts kernel (contract/moe.py holds the op and its reference): vLLM's CPU fused experts per
// kernel build, each (token, slot) in the engine's chains.

#include "engine_kernels.h"

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


// acc[n * 16 + m] = sum_k xt[k * 16 + m] * w[n * K + k], one FMA chain per (n, m) in k order, from 0. Four outputs n
// advance together (four independent chains in flight, as a GEMM's register block holds them): each chain's own
// order is unchanged.
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void moe_chains(const float* xt, const uint16_t* w, int64_t N, int64_t K, float* acc) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    float a0[kMoeLanes] = {}, a1[kMoeLanes] = {}, a2[kMoeLanes] = {}, a3[kMoeLanes] = {};
    const uint16_t *r0 = w + n * K, *r1 = r0 + K, *r2 = r1 + K, *r3 = r2 + K;
    for (int64_t k = 0; k < K; ++k) {
      const float w0 = bf16_value(r0[k]), w1 = bf16_value(r1[k]), w2 = bf16_value(r2[k]), w3 = bf16_value(r3[k]);
      const float* xk = xt + k * kMoeLanes;
      for (int m = 0; m < kMoeLanes; ++m) {
        a0[m] = std::fmaf(xk[m], w0, a0[m]);
        a1[m] = std::fmaf(xk[m], w1, a1[m]);
        a2[m] = std::fmaf(xk[m], w2, a2[m]);
        a3[m] = std::fmaf(xk[m], w3, a3[m]);
      }
    }
    std::memcpy(acc + n * kMoeLanes, a0, sizeof(a0));
    std::memcpy(acc + (n + 1) * kMoeLanes, a1, sizeof(a1));
    std::memcpy(acc + (n + 2) * kMoeLanes, a2, sizeof(a2));
    std::memcpy(acc + (n + 3) * kMoeLanes, a3, sizeof(a3));
  }
  for (; n < N; ++n) {
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
