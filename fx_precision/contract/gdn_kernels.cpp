// GatedDeltaNet in the engine's CPU arithmetic: vLLM 0.32's kernels for Qwen3-Next / Qwen3.5 linear attention as its
// portable kernel build computes them (the `_C_AVX2` build: ATen's generic `Vectorized`, lane by lane, glibc's
// expf / logf / log1pf / sqrtf, every multiply and add rounded apart, no FMA; its matrix products through libtorch's
// reduced-precision dot: four partial sums by index mod 4, then ((p0 + p1) + p2) + p3). Read off the shipped binary
// and held to it bit for bit (tests/engine/test_gdn.py); docs/engine-contract.md, "GatedDeltaNet", draws it.
//
//   fxp_gdn_gating(a, b, A_log, dt_bias, T, Hv, decode, g, beta)
//       prefill (fused_gdn_gating_cpu): heads in blocks of 16 ("vector": softplus with logf(expf(x) + 1), beta
//       rounded once), the last Hv % 16 heads scalar (log1pf; beta in bf16 arithmetic: three roundings);
//       decode (inside fused_sigmoid_gating_delta_rule_update_cpu): every head as the scalar tail
//   fxp_gdn_chunk(q, k, v, g, beta, state, state_bf16, out, L, H, Hv, D, eps)
//       chunk_gated_delta_rule_cpu on one request's prefilled tokens: q / k l2-normalised (q scaled) to bf16, chunks
//       of 64 from the request's first token, the WY form in bf16 matrices with fp32 sums, the state carried in
//       fp32 (its bf16 rounding used in products) and, for a bf16 state cache, rounded after every chunk
//   fxp_gdn_decode(q, k, v, g, beta, state, state_bf16, fused, out, B, H, Hv, D, eps)
//       fused_sigmoid_gating_delta_rule_update_cpu's recurrence for one decoded token per row (q / k normalised in
//       fp32, never rounded), the state rounded per element for a bf16 state cache; `fused`: as the `_C_AVX512` build
//       computes it, the same generic lanes compiled for AVX-512, where GCC fused three multiply-adds of the
//       recurrence (kv_mem += (S g) k; S' = (S g) + k dt; o += (S' q) scale) into one rounding each. Its other
//       contractions (the l2 sums' u * u, the triangular solve's products) multiply two bf16 values, exact in fp32,
//       and change no bit, so the chunk rule, the gating and the conv are the portable build's
//   fxp_gdn_conv_decode(x, conv_state, weight, C, K, out)
//       causal_conv1d_update_cpu_vec: one token's depthwise conv from the K - 1 stored inputs, silu in fp32, one bf16
//       store; the state shifted by one and the token appended
//
// Tensors cross as raw pointers, contiguous, bf16 as uint16_t; the caller (contract/gdn.py) checks every shape.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

namespace {

inline float bf2f(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, as c10::BFloat16(float)
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (std::isnan(f)) return 0x7FC0;
    uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
    return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float rbf(float f) { return bf2f(f2bf(f)); }

// a * b + c: rounded twice (the portable build), or once where the compiler fused the two (kFused: vLLM's _C_AVX512
// build, its generic lanes compiled for AVX-512 with GCC's default -ffp-contract=fast)
template <bool kFused>
inline float madd(float a, float b, float c) {
    if constexpr (kFused) return std::fma(a, b, c);
    float prod = a * b;
    return c + prod;
}

// libtorch's reduced-precision dot: four partial sums, element l into sum l mod 4 (sequential, each from +0), then
// ((p0 + p1) + p2) + p3. The kernel's products run over D (a multiple of 32) or a chunk's rows zero-padded to a
// multiple of 32: the padding adds +0 to sums that are never -0, so n elements grouped by l mod 4 give its bits.
// The four sums are the four lanes of one SSE register (each lane its own multiply, then its own add: the same
// roundings in the same order), the tail element by element into its lane.
inline float dot4(const float* x, const float* y, int64_t n) {
    __m128 acc = _mm_setzero_ps();
    int64_t l = 0;
    for (; l + 4 <= n; l += 4) acc = _mm_add_ps(acc, _mm_mul_ps(_mm_loadu_ps(x + l), _mm_loadu_ps(y + l)));
    float p[4];
    _mm_storeu_ps(p, acc);
    for (; l < n; ++l) {
        float prod = x[l] * y[l];
        p[l & 3] = p[l & 3] + prod;
    }
    float s = p[0] + p[1];
    s = s + p[2];
    return s + p[3];
}

inline float softplus_vector(float x) {  // ATen's vectorised softplus at threshold 20 (generic lanes: logf(expf(x) + 1))
    if (x > 20.0f) return x;
    float e = expf(x);
    if (x < -20.0f) return e;
    return logf(e + 1.0f);
}

inline float softplus_scalar(float x) {  // the scalar softplus: log1pf
    if (x > 20.0f) return x;
    float e = expf(x);
    if (x < -20.0f) return e;
    return log1pf(e);
}

inline float beta_bf16_chain(float b) {  // 1 / (1 + exp(-b)) in c10::BFloat16 arithmetic: each step rounded to bf16
    float t = rbf(expf(-b));
    float den = rbf(1.0f + t);
    return rbf(1.0f / den);
}

constexpr int64_t kChunk = 64;

// q / k l2-normalised as the chunk kernel does (two 8-lane accumulators over 16-element blocks, their lanes added,
// summed lane by lane), multiplied by `post` (q: 1/sqrt(D); k: none) and rounded to bf16
void l2norm_chunk(const uint16_t* x, int64_t rows, int64_t D, float eps, bool scaled, std::vector<float>& out) {
    out.assign(rows * D, 0.0f);
    const float scale = 1.0f / sqrtf(static_cast<float>(D));
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * D;
        float a0[8] = {0}, a1[8] = {0};
        for (int64_t blk = 0; blk < D / 16; ++blk) {
            for (int l = 0; l < 8; ++l) {
                float u = bf2f(row[16 * blk + l]);
                float w = bf2f(row[16 * blk + 8 + l]);
                float uu = u * u, ww = w * w;
                a0[l] = a0[l] + uu;
                a1[l] = a1[l] + ww;
            }
        }
        float s = a0[0] + a1[0];
        for (int l = 1; l < 8; ++l) s = s + (a0[l] + a1[l]);
        float rs = 1.0f / sqrtf(s + eps);
        for (int64_t d = 0; d < D; ++d) {
            float y = bf2f(row[d]) * rs;
            if (scaled) y = y * scale;
            out[r * D + d] = rbf(y);
        }
    }
}

// the decode kernel's l2 factor: one 8-lane accumulator over the row, its lanes summed in order, from 0
float l2factor_decode(const uint16_t* row, int64_t D, float eps) {
    float acc[8] = {0};
    for (int64_t m = 0; m < D / 8; ++m) {
        for (int l = 0; l < 8; ++l) {
            float u = bf2f(row[8 * m + l]);
            float uu = u * u;
            acc[l] = acc[l] + uu;
        }
    }
    float s = acc[0];
    for (int l = 1; l < 8; ++l) s = s + acc[l];
    s = 0.0f + s;
    return 1.0f / sqrtf(s + eps);
}

// one v-head of one request's prefilled tokens (fxp_gdn_chunk): chunks of 64 from its first token
void chunk_head(const float* qn, const float* kn, const uint16_t* v, const float* g, const uint16_t* beta, float* S, int state_bf16,
                uint16_t* out, int64_t L, int64_t H, int64_t Hv, int64_t D, int64_t hv) {
    const int64_t group = Hv / H;
    const int64_t C = kChunk;
    std::vector<float> gc(C), dec(C * C), A2(C * C), A3(C * C), x(C), vs(C);
    std::vector<float> kc(C * D), qc(C * D), vc(C * D), bc(C), eg(C);
    std::vector<float> kb(C * D), vb(C * D), w(C * D), u(C * D), sp(D * D), spT(D * D), v2(C * D), v2T(D * C), qg(C * D), ku(C * D);
    std::vector<float> colA(C), colB(C);
    {
        const int64_t h = hv / group;
        for (int64_t c0 = 0; c0 < L; c0 += C) {
            const int64_t mb = (L - c0 < C) ? (L - c0) : C;
            float run = 0.0f;
            for (int64_t i = 0; i < C; ++i) {
                if (i < mb) run = run + g[(c0 + i) * Hv + hv];
                gc[i] = run;
            }
            for (int64_t r = 0; r < mb; ++r)
                for (int64_t c = 0; c < C; ++c) dec[r * C + c] = (c <= r) ? expf(gc[r] - gc[c]) : 0.0f;
            for (int64_t t = 0; t < mb; ++t) {
                for (int64_t d = 0; d < D; ++d) {
                    kc[t * D + d] = kn[((c0 + t) * H + h) * D + d];
                    qc[t * D + d] = qn[((c0 + t) * H + h) * D + d];
                    vc[t * D + d] = bf2f(v[((c0 + t) * Hv + hv) * D + d]);
                }
                bc[t] = bf2f(beta[(c0 + t) * Hv + hv]);
            }
            // A = beta k k^T * decay (strictly lower), then its triangular inverse T = (I - A)^-1, stored bf16
            std::fill(A2.begin(), A2.end(), 0.0f);
            for (int64_t r = 0; r < mb; ++r)
                for (int64_t c = 0; c < r; ++c) {
                    float kk = dot4(&kc[r * D], &kc[c * D], D);
                    float y = kk * (-bc[r]);
                    y = y * dec[r * C + c];
                    A2[r * C + c] = rbf(y);
                }
            for (int64_t i = 1; i < mb; ++i) {
                for (int64_t jj = 0; jj < i; ++jj) x[jj] = vs[jj] = A2[i * C + jj];
                for (int64_t kk = 0; kk < i; ++kk)
                    for (int64_t jj = 0; jj < kk; ++jj) {
                        float prod = x[kk] * A2[kk * C + jj];
                        vs[jj] = vs[jj] + prod;
                    }
                for (int64_t jj = 0; jj < i; ++jj) A2[i * C + jj] = rbf(vs[jj]);
            }
            for (int64_t i = 0; i < mb; ++i) A2[i * C + i] = rbf(A2[i * C + i] + 1.0f);
            for (int64_t t = 0; t < mb; ++t) {
                eg[t] = expf(gc[t]);
                float mk = (1.0f * bc[t]) * eg[t];
                float mv = 1.0f * bc[t];
                for (int64_t d = 0; d < D; ++d) {
                    kb[t * D + d] = rbf(kc[t * D + d] * mk);
                    vb[t * D + d] = rbf(vc[t * D + d] * mv);
                }
            }
            // w = T kb, u = T vb (K: the chunk's rows; padding rows are zero and add nothing)
            for (int64_t d = 0; d < D; ++d) {
                for (int64_t l = 0; l < mb; ++l) {
                    colA[l] = kb[l * D + d];
                    colB[l] = vb[l * D + d];
                }
                for (int64_t j = 0; j < mb; ++j) {
                    w[j * D + d] = rbf(dot4(&A2[j * C], colA.data(), mb));
                    u[j * D + d] = rbf(dot4(&A2[j * C], colB.data(), mb));
                }
            }
            // P = (q k^T) * decay (lower with the diagonal), bf16
            std::fill(A3.begin(), A3.end(), 0.0f);
            for (int64_t r = 0; r < mb; ++r)
                for (int64_t c = 0; c <= r; ++c) {
                    float qk = dot4(&qc[r * D], &kc[c * D], D);
                    float y = qk * 1.0f;
                    y = y * dec[r * C + c];
                    A3[r * C + c] = rbf(y);
                }
            const float glast = gc[mb - 1];
            const float elast = expf(glast);
            for (int64_t i = 0; i < D * D; ++i) sp[i] = rbf(S[i]);  // the state in products: bf16
            for (int64_t kd = 0; kd < D; ++kd)
                for (int64_t vd = 0; vd < D; ++vd) spT[vd * D + kd] = sp[kd * D + vd];
            for (int64_t i = 0; i < D * D; ++i) S[i] = S[i] * elast;
            for (int64_t j = 0; j < mb; ++j) {
                for (int64_t vd = 0; vd < D; ++vd) {
                    float vp = dot4(&w[j * D], &spT[vd * D], D);
                    v2[j * D + vd] = rbf(u[j * D + vd] - vp);
                }
                float mq = 1.0f * eg[j];
                for (int64_t d = 0; d < D; ++d) qg[j * D + d] = rbf(qc[j * D + d] * mq);
            }
            for (int64_t vd = 0; vd < D; ++vd) {
                for (int64_t l = 0; l < mb; ++l) colA[l] = v2[l * D + vd];
                for (int64_t j = 0; j < mb; ++j) {
                    float o = dot4(&qg[j * D], &spT[vd * D], D);
                    o = o + dot4(&A3[j * C], colA.data(), mb);
                    out[((c0 + j) * Hv + hv) * D + vd] = f2bf(o);
                }
            }
            for (int64_t t = 0; t < mb; ++t) {
                float e = expf(glast - gc[t]);
                for (int64_t d = 0; d < D; ++d) ku[t * D + d] = rbf(kc[t * D + d] * e);
            }
            for (int64_t vd = 0; vd < D; ++vd)  // v2's columns, each once
                for (int64_t l = 0; l < mb; ++l) v2T[vd * C + l] = v2[l * D + vd];
            for (int64_t kd = 0; kd < D; ++kd) {
                for (int64_t l = 0; l < mb; ++l) colB[l] = ku[l * D + kd];
                for (int64_t vd = 0; vd < D; ++vd) S[kd * D + vd] = S[kd * D + vd] + dot4(colB.data(), &v2T[vd * C], mb);
            }
            if (state_bf16)
                for (int64_t i = 0; i < D * D; ++i) S[i] = rbf(S[i]);
        }
    
    }
}

template <bool kFused>
void decode_rows(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* g, const uint16_t* beta, float* state,
                    int state_bf16, uint16_t* out, int64_t B, int64_t H, int64_t Hv, int64_t D, float eps) {
    const int64_t group = Hv / H;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    // Heads apart (each thread whole heads); within a head every output vd folds di in order, the outputs advancing
    // together over the state's rows: the kernel's arithmetic per output, whatever the threads.
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bi = 0; bi < B; ++bi) {
        for (int64_t n = 0; n < Hv; ++n) {
            std::vector<float> qv(D), kv(D), acc(D, 0.0f), dt(D), o(D, 0.0f);
            const int64_t h = n / group;
            const uint16_t* qrow = q + (bi * H + h) * D;
            const uint16_t* krow = k + (bi * H + h) * D;
            const float rq = l2factor_decode(qrow, D, eps);
            const float rk = l2factor_decode(krow, D, eps);
            for (int64_t d = 0; d < D; ++d) {
                qv[d] = bf2f(qrow[d]) * rq;
                kv[d] = bf2f(krow[d]) * rk;
            }
            const float ge = expf(g[bi * Hv + n]);
            const float bt = bf2f(beta[bi * Hv + n]);
            float* S = state + (bi * Hv + n) * D * D;
            for (int64_t di = 0; di < D; ++di) {
                const float* row = S + di * D;
                const float kd = kv[di];
                for (int64_t vd = 0; vd < D; ++vd) {
                    float decayed = row[vd] * ge;
                    acc[vd] = madd<kFused>(decayed, kd, acc[vd]);
                }
            }
            for (int64_t vd = 0; vd < D; ++vd) {
                float diff = bf2f(v[(bi * Hv + n) * D + vd]) - acc[vd];
                dt[vd] = diff * bt;
            }
            for (int64_t di = 0; di < D; ++di) {
                float* row = S + di * D;
                const float kd = kv[di], qd = qv[di];
                for (int64_t vd = 0; vd < D; ++vd) {
                    float decayed = row[vd] * ge;
                    float sn = madd<kFused>(kd, dt[vd], decayed);
                    float t = sn * qd;
                    o[vd] = madd<kFused>(t, scale, o[vd]);
                    row[vd] = state_bf16 ? rbf(sn) : sn;
                }
            }
            for (int64_t vd = 0; vd < D; ++vd) out[(bi * Hv + n) * D + vd] = f2bf(o[vd]);
        }
    }
}

}  // namespace

extern "C" {

void fxp_gdn_gating(const uint16_t* a, const uint16_t* b, const float* A_log, const float* dt_bias, int64_t T, int64_t Hv,
                    int decode, float* g, uint16_t* beta) {
    const int64_t vector_heads = decode ? 0 : Hv - Hv % 16;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < Hv; ++j) {
            const float x = bf2f(a[t * Hv + j]) + dt_bias[j];
            const float bj = bf2f(b[t * Hv + j]);
            if (j < vector_heads) {
                float decay = -1.0f * expf(A_log[j]);
                g[t * Hv + j] = decay * softplus_vector(x);
                beta[t * Hv + j] = f2bf(1.0f / (1.0f + expf(-bj)));
            } else {
                float decay = -expf(A_log[j]);
                g[t * Hv + j] = decay * softplus_scalar(x);
                beta[t * Hv + j] = f2bf(beta_bf16_chain(bj));
            }
        }
    }
}

void fxp_gdn_chunk(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* g, const uint16_t* beta, float* state,
                   int state_bf16, uint16_t* out, int64_t L, int64_t H, int64_t Hv, int64_t D, float eps) {
    std::vector<float> qn, kn;
    l2norm_chunk(q, L * H, D, eps, true, qn);
    l2norm_chunk(k, L * H, D, eps, false, kn);
#pragma omp parallel for schedule(static)
    for (int64_t hv = 0; hv < Hv; ++hv)  // heads apart: each thread one head's whole arithmetic, as the engine's
        chunk_head(qn.data(), kn.data(), v, g, beta, state + hv * D * D, state_bf16, out, L, H, Hv, D, hv);
}

void fxp_gdn_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* g, const uint16_t* beta, float* state,
                    int state_bf16, int fused, uint16_t* out, int64_t B, int64_t H, int64_t Hv, int64_t D, float eps) {
    if (fused)
        decode_rows<true>(q, k, v, g, beta, state, state_bf16, out, B, H, Hv, D, eps);
    else
        decode_rows<false>(q, k, v, g, beta, state, state_bf16, out, B, H, Hv, D, eps);
}

void fxp_gdn_conv_decode(const uint16_t* x, uint16_t* conv_state, const uint16_t* weight, int64_t C, int64_t K, uint16_t* out) {
    // conv_state: [C, K - 1] (oldest first); weight: [C, K]
    for (int64_t c = 0; c < C; ++c) {
        uint16_t* s = conv_state + c * (K - 1);
        const uint16_t* wc = weight + c * K;
        float acc = 0.0f;
        for (int64_t i = 0; i < K - 1; ++i) {
            float prod = bf2f(wc[i]) * bf2f(s[i]);
            acc = acc + prod;
        }
        float last = bf2f(wc[K - 1]) * bf2f(x[c]);
        acc = acc + last;
        float sig = acc >= 0.0f ? 1.0f / (1.0f + expf(-acc)) : expf(acc) / (1.0f + expf(acc));
        out[c] = f2bf(acc * sig);
        for (int64_t i = 0; i + 1 < K - 1; ++i) s[i] = s[i + 1];
        s[K - 2] = x[c];
    }
}

// One request's decoded tokens in turn (n of them, each its own engine step): per token the conv's update, the
// gating of the decode kernel, q / k / v split from the conv output, the recurrence; conv_state [C, K - 1] and state
// [Hv, D, D] carried from token to token. x: [n, C] bf16 (the conv's inputs), a / b: [n, Hv], out: [n, Hv, D].
void fxp_gdn_decode_run(const uint16_t* x, uint16_t* conv_state, const uint16_t* weight, const uint16_t* a, const uint16_t* b,
                        const float* A_log, const float* dt_bias, float* state, int state_bf16, int fused, uint16_t* out, int64_t n, int64_t C,
                        int64_t K, int64_t H, int64_t Hv, int64_t D, float eps) {
    std::vector<uint16_t> mixed(C);
    std::vector<float> g(Hv);
    std::vector<uint16_t> beta(Hv);
    for (int64_t t = 0; t < n; ++t) {
        fxp_gdn_conv_decode(x + t * C, conv_state, weight, C, K, mixed.data());
        fxp_gdn_gating(a + t * Hv, b + t * Hv, A_log, dt_bias, 1, Hv, 1, g.data(), beta.data());
        const uint16_t* q = mixed.data();
        const uint16_t* k = mixed.data() + H * D;
        const uint16_t* v = mixed.data() + 2 * H * D;
        // fxp_gdn_decode takes B rows of [H, D] / [Hv, D] and a state per row: one row, this request's state
        fxp_gdn_decode(q, k, v, g.data(), beta.data(), state, state_bf16, fused, out + t * Hv * D, 1, H, Hv, D, eps);
    }
}

}  // extern "C"
