// Small-M 4-bit matrix products: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = 1..16, for draft models.
//
// Weights: asymmetric 4-bit in groups of 32 along K (w = d * q + m, q in 0..15, d and m in fp16 per group:
// the Q4_1 scheme, 5 bits per weight), packed once at load time in tiles of NR rows:
//   packed[N/NR][K/64][NR/2][64] bytes: byte k of pair p holds q[row 2p][k] (low nibble) and
//   q[row 2p + 1][k] (high nibble), so one 64-byte load and two masks give two rows of 64 weights;
//   d, m: fp16 [N/NR][K/64][NR][2] (each row's two groups of the chunk).
// Activations: each row quantized to int8 with one scale per call, as in linear_int8.cpp. Per group,
//   sum_k w_k x_k = sx * (d * sum_k q_k qx_k + m * sum_k qx_k),
// the first sum by AVX512-VNNI or AVX2 (unsigned q times signed qx), the second from per-group sums of qx.
// Every output element is accumulated in the same order whatever M is: a row's result does not depend on
// the other rows in the call.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

namespace verispec {
namespace {

constexpr int64_t NR = 4;   // weight rows per tile
constexpr int64_t KC = 64;  // k per chunk: two groups of 32
constexpr int64_t GS = 32;  // group size
constexpr int64_t MT = 2;   // activation rows per register tile
constexpr int64_t PF = 64;  // software prefetch distance, in chunks (8 KB), into L2: faster than 16 into L1
                            // (measured: docs/BENCHMARKS.md, "Kernel design choices")

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static void rows_vnni(const int8_t* x, int64_t Kp, const float* xs /* [MR][K/32] */, const uint8_t* q,
                      const uint16_t* d, const uint16_t* mn, int64_t chunks, float* out /* [MR][NR] */) {
  __m512 acc[MR][NR];
  __m256 mac[MR];
  for (int i = 0; i < MR; ++i) {
    mac[i] = _mm256_setzero_ps();
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* qc = q + c * NR * GS;
    _mm_prefetch(reinterpret_cast<const char*>(qc + PF * NR * GS), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(qc + PF * NR * GS + 64), _MM_HINT_T1);
    __m512i w[NR];  // q[row j][k], k = 0..63 of this chunk
    for (int p = 0; p < NR / 2; ++p) {
      const __m512i v = _mm512_loadu_si512(qc + p * KC);
      w[2 * p] = _mm512_and_si512(v, lo4);
      w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    }
    // d for (row j, group g) at lane 2j + g of d8; lanes 0-7 of a product use group 0, 8-15 group 1
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + c * NR * 2)));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + c * NR * 2)));
    const __m512 d16 = _mm512_castps256_ps512(d8);
    __m512 dv[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                           2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
      dv[j] = _mm512_permutexvar_ps(idx, d16);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_loadu_si512(x + i * Kp + c * KC);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w[j], a)), dv[j], acc[i][j]);
      // min terms: lane 2j + g += m[j][g] * xsum[g]
      const __m256 xs2 = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xs + i * (Kp / GS) + 2 * c)));
      mac[i] = _mm256_fmadd_ps(m8, xs2, mac[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float mm[8];
    _mm256_store_ps(mm, mac[i]);
    for (int j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]) + (mm[2 * j] + mm[2 * j + 1]);
  }
}

// rows_vnni with AVX2 (no VNNI): group g of a chunk is bytes 32 g .. 32 g + 31, so each group's dot product is
// one maddubs (nibble x int8, pairs in int16: at most 2 x 15 x 127) and one madd, as eight int32 lanes; the
// lanes are scaled by the group's d and accumulated in fp32 (another order than the AVX512 path's: the two
// agree to fp32 rounding, and a row's result still does not depend on the other rows in the call).
template <int MR>
__attribute__((target("avx2,fma,f16c")))
static void rows_avx2(const int8_t* x, int64_t Kp, const float* xs /* [MR][K/32] */, const uint8_t* q,
                      const uint16_t* d, const uint16_t* mn, int64_t chunks, float* out /* [MR][NR] */) {
  __m256 acc[MR][NR], mac[MR];
  for (int i = 0; i < MR; ++i) {
    mac[i] = _mm256_setzero_ps();
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const __m256i lo4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  alignas(32) float df[8];
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* qc = q + c * NR * GS;
    _mm_prefetch(reinterpret_cast<const char*>(qc + PF * NR * GS), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(qc + PF * NR * GS + 64), _MM_HINT_T1);
    _mm256_store_ps(df, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + c * NR * 2))));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + c * NR * 2)));
    for (int g = 0; g < 2; ++g) {
      __m256i w[NR];  // q[row j][k], k = 32 g .. 32 g + 31 of this chunk
      for (int p = 0; p < NR / 2; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc + p * KC + 32 * g));
        w[2 * p] = _mm256_and_si256(v, lo4);
        w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      }
      for (int i = 0; i < MR; ++i) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * Kp + c * KC + 32 * g));
        for (int j = 0; j < NR; ++j) {
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], a), ones);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(df + 2 * j + g), acc[i][j]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {  // min terms: lane 2j + g += m[j][g] * xsum[g]
      const __m256 xs2 = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xs + i * (Kp / GS) + 2 * c)));
      mac[i] = _mm256_fmadd_ps(m8, xs2, mac[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float mm[8], a8[8];
    _mm256_store_ps(mm, mac[i]);
    for (int j = 0; j < NR; ++j) {
      _mm256_store_ps(a8, acc[i][j]);
      out[i * NR + j] = (((a8[0] + a8[4]) + (a8[2] + a8[6])) + ((a8[1] + a8[5]) + (a8[3] + a8[7]))) + (mm[2 * j] + mm[2 * j + 1]);
    }
  }
}

static void rows_portable(const int8_t* x, int64_t Kp, const float* xs, const uint8_t* q, const uint16_t* d,
                          const uint16_t* mn, int64_t chunks, int64_t M, float* out) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < NR; ++j) {
      float s = 0.0f, ms = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* qr = q + (c * NR + (j & ~1)) * GS;  // this row's pair
        const int shift = (j & 1) * 4;
        const int8_t* xc = x + i * Kp + c * KC;
        int32_t g0 = 0, g1 = 0;
        for (int64_t k = 0; k < GS; ++k) {
          g0 += static_cast<int32_t>((qr[k] >> shift) & 0x0f) * xc[k];
          g1 += static_cast<int32_t>((qr[GS + k] >> shift) & 0x0f) * xc[GS + k];
        }
        const uint16_t* dc = d + (c * NR + j) * 2;
        const uint16_t* mc = mn + (c * NR + j) * 2;
        s += static_cast<float>(g0) * half_to_float(dc[0]) + static_cast<float>(g1) * half_to_float(dc[1]);
        ms += half_to_float(mc[0]) * xs[i * (Kp / GS) + 2 * c] + half_to_float(mc[1]) * xs[i * (Kp / GS) + 2 * c + 1];
      }
      out[i * NR + j] = s + ms;
    }
}

}  // namespace

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& d,
                        const torch::Tensor& mn, const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == NR / 2 &&
                  packed.size(3) == KC && packed.is_contiguous(),
              "linear_q4: packed weight must be uint8 [N/", NR, ", K/", KC, ", ", NR / 2, ", ", KC, "]");
  const int64_t tiles = packed.size(0), chunks = packed.size(1), Kp = chunks * KC;
  TORCH_CHECK(d.scalar_type() == at::kHalf && mn.scalar_type() == at::kHalf && d.numel() == tiles * chunks * NR * 2 &&
                  mn.numel() == d.numel() && d.is_contiguous() && mn.is_contiguous(),
              "linear_q4: d and m must be fp16 [N/", NR, ", K/", KC, ", ", NR, ", 2]");
  TORCH_CHECK(N <= tiles * NR, "linear_q4: N larger than the packed weight");
  const QuantizedRows xq = quantize_rows(x, Kp, "linear_q4");
  const int64_t M = xq.M, groups = Kp / GS;
  std::vector<float> xs(M * groups);  // per-group sums of the quantized activations, for the min terms
  for (int64_t g = 0; g < M * groups; ++g) {
    int32_t s = 0;
    for (int64_t k = 0; k < GS; ++k) s += xq.q[g * GS + k];
    xs[g] = static_cast<float>(s);
  }
  const int8_t* qx = xq.q.data();
  const float* sx = xq.scale.data();
  const torch::Tensor b = fp32_bias(bias);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* qp = packed.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>());
  const Output out(x, M, N);
  const bool vec = has_vnni(), avx2 = has_avx2();
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    float dots[kMaxRows * NR];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* qt = qp + t * chunks * NR * GS;
      const uint16_t* dt = dp + t * chunks * NR * 2;
      const uint16_t* mt = mp + t * chunks * NR * 2;
      if (vec) {
        int64_t m = 0;
        for (; m + MT <= M; m += MT)
          rows_vnni<MT>(qx + m * Kp, Kp, xs.data() + m * (Kp / GS), qt, dt, mt, chunks, dots + m * NR);
        if (m < M) rows_vnni<1>(qx + m * Kp, Kp, xs.data() + m * (Kp / GS), qt, dt, mt, chunks, dots + m * NR);
      } else if (avx2) {
        int64_t m = 0;
        for (; m + MT <= M; m += MT)
          rows_avx2<MT>(qx + m * Kp, Kp, xs.data() + m * (Kp / GS), qt, dt, mt, chunks, dots + m * NR);
        if (m < M) rows_avx2<1>(qx + m * Kp, Kp, xs.data() + m * (Kp / GS), qt, dt, mt, chunks, dots + m * NR);
      } else {
        rows_portable(qx, Kp, xs.data(), qt, dt, mt, chunks, M, dots);
      }
      if ((t + 1) * NR <= N)
        for (int64_t m = 0; m < M; ++m) out.set4(m, t * NR, _mm_mul_ps(_mm_loadu_ps(dots + m * NR), _mm_set1_ps(sx[m])), bp);
      else
        for (int64_t j = 0; j < NR && t * NR + j < N; ++j)
          for (int64_t m = 0; m < M; ++m)
            out.set(m, t * NR + j, dots[m * NR + j] * sx[m] + (bp ? bp[t * NR + j] : 0.0f));
    }
  });
  return out.finish(x);
}

}  // namespace verispec
