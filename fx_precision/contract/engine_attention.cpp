// Attention with an inference engine's CPU arithmetic, scalar and in the engine's order.
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
// The amx variant runs the engine's own instruction, TDPBF16PS, on the same 32-element chunks in the
// same order (scores: head dims 0-31, 32-63, ...; P.V: keys 0-31, 32-63, ...): how that instruction
// sums a chunk is the hardware's, and only the hardware reproduces it bit for bit. It needs AMX (the
// engine only picks it where AMX is) and the process's AMX permission (torch._C._cpu._init_amx()).
// Compiled with -ffp-contract=off: every multiply and add rounds as written, fused only where asked.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// The AVX-512 exp polynomial of the engine's CPU attention (range-reduced to 2^n * p(r), p of degree 5).
inline float fast_exp512(float x) {
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
  return p * two_n * 2.0f;
}

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

}  // namespace

// q: [B, T, H, D], k, v: [B, S, KVH, D] (bf16, contiguous); key_lens: [B] (int64), valid keys per row;
// mask: [B, 1 or H, T, S] bool (true: attend) or an empty tensor. Query t of row b sits at position
// q_offset + t; it sees keys j <= q_offset + t (causal), j >= q_offset + t - w (window w >= 0), and
// where the mask allows. Masked keys inside the range contribute nothing, as in the engine (p = 0).
// Returns [B, T, H, D] bf16.
torch::Tensor engine_attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_lens, torch::Tensor mask,
                                       double scale_d, bool causal, int64_t window, int64_t q_offset, int64_t qk_kind, int64_t exp_kind,
                                       int64_t reduce_kind, int64_t p_bf16, int64_t fma, int64_t store_kind, int64_t ftz_amx) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "engine attention takes bf16 q, k, v");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k.size(1), KVH = k.size(2);
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of key/value heads");
  auto out = torch::empty({B, T, H, D}, q.options());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  auto lens = key_lens.to(torch::kInt64).contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const bool masked = mask.defined() && mask.numel() > 0;
  torch::Tensor mask_c = masked ? mask.to(torch::kBool).contiguous() : mask;
  const bool* mp = masked ? mask_c.data_ptr<bool>() : nullptr;
  const int64_t mask_heads = masked ? mask_c.size(1) : 1;
  if (masked) {
    TORCH_CHECK(mask_c.dim() == 4 && mask_c.size(0) == B && mask_c.size(2) == T && mask_c.size(3) == S && (mask_heads == 1 || mask_heads == H),
                "engine attention: the mask must be [B, 1 or H, T, S]");
  }
  const float scale = static_cast<float>(scale_d);
  const int64_t group = H / KVH;
  const bool amx = qk_kind == QK_AMX;
  const bool flush = amx && ftz_amx;

  const bool hardware_amx = amx && D % 32 == 0;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(S), e(S), p(S), qs(D), acc(D);
    std::vector<uint16_t> pchunk(32), bvnni(32 * 16);
    alignas(64) float cbuf[16];
    if (hardware_amx) amx_configure();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / group;
      const int64_t valid = std::min<int64_t>(lp[b], S);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t pos = q_offset + t;
        int64_t last = causal ? std::min<int64_t>(pos, valid - 1) : valid - 1;
        int64_t first = (window >= 0) ? std::max<int64_t>(0, pos - window) : 0;
        const bool* mrow = masked ? mp + ((b * mask_heads + (mask_heads == 1 ? 0 : h)) * T + t) * S : nullptr;
        if (mrow != nullptr) {
          while (first <= last && !mrow[first]) ++first;
          while (last >= first && !mrow[last]) --last;
        }
        auto allowed = [&](int64_t j) { return j >= first && j <= last && (mrow == nullptr || mrow[j]); };
        const uint16_t* qrow = qp + ((b * T + t) * H + h) * D;
        uint16_t* orow = op + ((b * T + t) * H + h) * D;
        if (last < first) {
          for (int64_t d = 0; d < D; ++d) orow[d] = 0;
          continue;
        }
        for (int64_t d = 0; d < D; ++d) qs[d] = amx ? bf16_value(qrow[d]) : bf16_value(qrow[d]) * scale;
        float m = -std::numeric_limits<float>::infinity();
        if (hardware_amx) {  // scores: for each 16 keys, the head dims in chunks of 32, in order
          for (int64_t j0 = first - first % 16; j0 <= last; j0 += 16) {
            for (int n = 0; n < 16; ++n) cbuf[n] = 0.0f;
            for (int64_t c = 0; c < D; c += 32) {
              for (int r = 0; r < 16; ++r)
                for (int n = 0; n < 16; ++n) {
                  const int64_t j = j0 + n;
                  const bool in = allowed(j);
                  const uint16_t* krow = kp + ((b * S + (in ? j : first)) * KVH + g) * D;
                  bvnni[(r * 16 + n) * 2] = in ? krow[c + 2 * r] : 0;
                  bvnni[(r * 16 + n) * 2 + 1] = in ? krow[c + 2 * r + 1] : 0;
                }
              amx_chunk(qrow + c, bvnni.data(), cbuf);
            }
            for (int n = 0; n < 16; ++n) {
              const int64_t j = j0 + n;
              if (!allowed(j)) continue;
              s[j] = cbuf[n] * scale;
              m = std::fmax(m, s[j]);
            }
          }
        }
        for (int64_t j = first; j <= last && !hardware_amx; ++j) {
          if (!allowed(j)) continue;
          const uint16_t* krow = kp + ((b * S + j) * KVH + g) * D;
          float a = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            float kv = bf16_value(krow[d]);
            if (amx) {
              float prod = flush ? ftz(ftz(qs[d]) * ftz(kv)) : qs[d] * kv;
              a = flush ? ftz(a + prod) : a + prod;
            } else {
              a = fma ? std::fmaf(qs[d], kv, a) : a + qs[d] * kv;
            }
          }
          s[j] = amx ? a * scale : a;
          m = std::fmax(m, s[j]);
        }
        float lane[16] = {0};
        for (int64_t j = first; j <= last; ++j) {
          if (!allowed(j)) {
            e[j] = 0.0f;
            p[j] = 0.0f;
            continue;
          }
          e[j] = engine_exp(s[j] - m, static_cast<int>(exp_kind));
          lane[j % 16] += e[j];
          p[j] = p_bf16 ? bf16_value(bf16_rne(e[j])) : e[j];
        }
        const float l = reduce_lanes(lane, static_cast<int>(reduce_kind));
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
        if (hardware_amx) {  // P.V: for each 16 dims, the keys in chunks of 32 from a multiple of 32, in order
          const int64_t start = first - first % 32;
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            for (int n = 0; n < 16; ++n) cbuf[n] = 0.0f;
            for (int64_t j0 = start; j0 <= last; j0 += 32) {
              for (int i = 0; i < 32; ++i) {
                const int64_t j = j0 + i;
                pchunk[i] = allowed(j) ? bf16_rne(e[j]) : 0;
              }
              for (int r = 0; r < 16; ++r)
                for (int n = 0; n < 16; ++n)
                  for (int w = 0; w < 2; ++w) {
                    const int64_t j = j0 + 2 * r + w;
                    const bool in = allowed(j);
                    bvnni[(r * 16 + n) * 2 + w] = in ? vp[((b * S + j) * KVH + g) * D + d0 + n] : 0;
                  }
              amx_chunk(pchunk.data(), bvnni.data(), cbuf);
            }
            for (int n = 0; n < 16; ++n) acc[d0 + n] = cbuf[n];
          }
        }
        for (int64_t j = first; j <= last && !hardware_amx; ++j) {
          if (!allowed(j)) continue;
          const uint16_t* vrow = vp + ((b * S + j) * KVH + g) * D;
          const float pj = flush ? ftz(p[j]) : p[j];
          for (int64_t d = 0; d < D; ++d) {
            float vv = bf16_value(vrow[d]);
            if (amx) {
              float prod = flush ? ftz(pj * ftz(vv)) : pj * vv;
              acc[d] = flush ? ftz(acc[d] + prod) : acc[d] + prod;
            } else {
              acc[d] = fma ? std::fmaf(pj, vv, acc[d]) : acc[d] + pj * vv;
            }
          }
        }
        const float inv = static_cast<float>(1.0 / static_cast<double>(l));
        for (int64_t d = 0; d < D; ++d) {
          float o = inv * acc[d];
          orow[d] = store_kind == STORE_TRUNC ? bf16_trunc(o) : bf16_rne(o);
        }
      }
    }
    if (hardware_amx) amx_release();
  });
  return out;
}

bool cpu_has_amx() { return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16"); }

bool cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// The engine's small-batch linear (its "tinygemm": batches of at most 4 rows on AVX-512 BF16): for each
// row and each 16 outputs, start from the bias (fp32) or 0 and accumulate the K inputs pair by pair
// with VDPBF16PS, in order; one bf16 store (round to nearest even). x: [M, K], w: [N, K] bf16;
// bias: [N] fp32 or empty.
__attribute__((target("avx512f,avx512bf16"))) torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "small_batch_linear takes bf16");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 2 == 0 && N % 16 == 0, "small_batch_linear: K even and N a multiple of 16");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  torch::Tensor b32 = has_bias ? bias.to(torch::kFloat32).contiguous() : bias;
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = has_bias ? b32.data_ptr<float>() : nullptr;
  std::vector<uint32_t> packed(16);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      __m512 acc = has_bias ? _mm512_loadu_ps(bp + n0) : _mm512_set1_ps(0.0f);
      for (int64_t k = 0; k < K / 2; ++k) {
        uint32_t a_pair;
        std::memcpy(&a_pair, xp + m * K + 2 * k, 4);
        for (int n = 0; n < 16; ++n) std::memcpy(&packed[n], wp + (n0 + n) * K + 2 * k, 4);
        __m512i va = _mm512_set1_epi32(static_cast<int>(a_pair));
        __m512i vb = _mm512_loadu_si512(packed.data());
        acc = _mm512_dpbf16_ps(acc, (__m512bh)va, (__m512bh)vb);
      }
      __m256i stored = (__m256i)_mm512_cvtneps_pbh(acc);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + m * N + n0), stored);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &engine_attention_forward, "engine attention forward");
  m.def("cpu_has_amx", &cpu_has_amx, "whether this CPU runs AMX bf16 tiles");
  m.def("cpu_has_avx512_bf16", &cpu_has_avx512_bf16, "whether this CPU runs AVX-512 BF16 dot products");
  m.def("small_batch_linear", &small_batch_linear, "the engine's small-batch linear");
}
