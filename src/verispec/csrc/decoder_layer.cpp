// One Llama/Qwen decoder layer for a few new tokens (T <= kMaxRows) of one sequence, quantized matrices
// (int8 or 4-bit: linear_int8.cpp / linear_q4.cpp, told apart by the packed weight's dtype).
//
// The draft model's decode step is ~24 layers x ~35 small PyTorch ops; running each layer as one call
// makes a step cheaper (measured: docs/BENCHMARKS.md, "Draft step cost", per-op against fused). The layer
// keeps the order of bf16 roundings of models/llama.py (RMSNorm in fp32 then scaled in bf16, RoPE and
// residual adds in bf16, SiLU in fp32) and its kernels for the matrices; attention is fp32 with another
// summation order than the batched matmul there (~1e-6 relative).
#include "kernels.h"

// No fused multiply-adds where the source says multiply, then add: g++ contracts them by default in C++ wherever
// the instruction set has FMA, which would give the AVX512 clone and attend_avx512 other bits than the AVX2 and
// baseline clones (and the two attention paths other bits from each other).
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace verispec {
namespace {

using bf16 = at::BFloat16;

// bf16 <-> float in plain integer arithmetic (the compiler vectorizes these; c10's conversions stay scalar):
// f is exact, b rounds to nearest even with NaN -> 0x7FC0, bit for bit c10::BFloat16(float).
inline float bits(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
inline float f(bf16 v) { return bits(v.x); }
inline bf16 b(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return bf16(static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r), bf16::from_bits());
}

constexpr int64_t L = 16;  // partial sums per reduction: vectorizable without -ffast-math's reassociation

// sum of term(0) .. term(n - 1) in L interleaved partial sums, then a fixed tree: the order does not depend
// on the ISA clone, and the inner loop vectorizes (term is inlined)
template <typename Term>
__attribute__((always_inline)) inline float lane_reduce(int64_t n, Term term) {
  float p[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t l = 0; l < L; ++l) p[l] += term(i + l);
  for (; i < n; ++i) p[0] += term(i);
  // the tree p[l] += p[l + w] for w = 8, 4, 2, 1, written out so that it stays in registers: as a loop over w
  // it went through the stack, a chain of dependent loads and stores per score (measured: docs/BENCHMARKS.md,
  // "Kernel design choices")
  static_assert(L == 16, "the tree below sums 16 partial sums");
  float p8[8], p4[4];
  for (int64_t l = 0; l < 8; ++l) p8[l] = p[l] + p[l + 8];
  for (int64_t l = 0; l < 4; ++l) p4[l] = p8[l] + p8[l + 4];
  return (p4[0] + p4[2]) + (p4[1] + p4[3]);
}

// exp in plain arithmetic the compiler vectorizes (std::exp is one scalar call per value): 2^n * p(r),
// n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p the degree-7 Taylor polynomial (remainder
// < 3e-9 on |r| <= ln 2 / 2): a few float ulps from expf, on x clamped to [-87, 88].
__attribute__((always_inline)) inline float vexp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 trick
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// The loops below are cloned for x86-64-v4 (AVX512 F/BW/DQ/VL), AVX2 and the baseline and picked at load; the
// source fixes the order of every operation, so each clone gives the same bits. (A clone for AVX512F alone
// packed bf16 without BW's word operations, slower: docs/BENCHMARKS.md, "What did not help".)
// h[t] = w * bf16(x[t] * rsqrt(mean(x[t]^2) + eps))   (rows of n values, in place allowed)
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void rms_norm(const bf16* x, const bf16* w, bf16* h, int64_t rows, int64_t n, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const bf16* xr = x + t * n;
    const float ss = lane_reduce(n, [&](int64_t i) { return f(xr[i]) * f(xr[i]); });
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    bf16* hr = h + t * n;
    for (int64_t i = 0; i < n; ++i) hr[i] = b(f(w[i]) * f(b(f(xr[i]) * r)));
  }
}

// y[i] = bf16(y[i] + a[i])   (residual adds, rounded as in llama.py)
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void add_into(bf16* y, const bf16* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = b(f(y[i]) + f(a[i]));
}

// act = bf16(bf16(silu(gate)) * up) for one row of n, SiLU in fp32 (as F.silu on bf16). The denominators
// 1 + exp(-g) go through a buffer: in one loop g++ (with the build's -fno-trapping-math) split the division by
// vexp's clamp cases, four masked vdivps per 16 values where one does (same bits; measured: docs/BENCHMARKS.md,
// "Kernel design choices").
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void silu_mul(const bf16* __restrict gate, const bf16* __restrict up, bf16* __restrict act, int64_t n) {
  constexpr int64_t C = 256;
  float den[C];
  for (int64_t i0 = 0; i0 < n; i0 += C) {
    const int64_t m = std::min(C, n - i0);
    for (int64_t i = 0; i < m; ++i) den[i] = 1.0f + vexp(-f(gate[i0 + i]));
    for (int64_t i = 0; i < m; ++i) act[i0 + i] = b(f(b(f(gate[i0 + i]) / den[i])) * f(up[i0 + i]));
  }
}

// x[0:hd] <- x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 (as in llama.py)
void rope(bf16* x, const bf16* c, const bf16* s, int64_t hd) {
  const int64_t h2 = hd / 2;
  for (int64_t i = 0; i < h2; ++i) {
    const float x1 = f(x[i]), x2 = f(x[i + h2]);
    x[i] = b(f(b(x1 * f(c[i]))) + f(b(-x2 * f(s[i]))));
    x[i + h2] = b(f(b(x2 * f(c[i + h2]))) + f(b(x1 * f(s[i + h2]))));
  }
}

// each of the G rows of p [G, S] (scores) -> its softmax (weights)
__attribute__((always_inline)) inline void softmax_rows(float* p, int64_t G, int64_t S) {
  for (int64_t h = 0; h < G; ++h) {
    float* ph = p + h * S;
    float mx = ph[0];
    for (int64_t j = 1; j < S; ++j) mx = std::max(mx, ph[j]);
    for (int64_t j = 0; j < S; ++j) ph[j] = vexp(ph[j] - mx);
    const float inv = 1.0f / lane_reduce(S, [&](int64_t j) { return ph[j]; });
    for (int64_t j = 0; j < S; ++j) ph[j] *= inv;
  }
}

// scores of keys [j0, S) (of lo + j0 ..) one at a time, lane_reduce's order: p[h * S + j] for G scaled queries qf
__attribute__((always_inline)) inline void scores_from(int64_t j0, const float* qf, const uint16_t* k, float* p,
                                                       int64_t G, int64_t hd, int64_t lo, int64_t S) {
  for (int64_t j = j0; j < S; ++j) {
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * hd;
      const uint16_t* kr = k + (lo + j) * hd;
      p[h * S + j] = lane_reduce(hd, [&](int64_t dd) { return qh[dd] * bits(kr[dd]); });
    }
  }
}

// out[i] = bf16 bits of acc[i]
__attribute__((always_inline)) inline void store_bf16(const float* acc, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const bf16 r = static_cast<bf16>(acc[i]);
    std::memcpy(out + i, &r, 2);
  }
}

// G query heads q [G, hd] against keys/values [lo, hi) of one KV head (rows of hd) -> out [G, hd] (bf16
// bits). Plain loops the compiler vectorizes.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t G, int64_t hd,
            int64_t lo, int64_t hi, float scale, float* scratch) {
  const int64_t S = hi - lo;
  float* p = scratch;               // [G, S] scores, then weights
  float* qf = p + G * S;            // [G, hd]
  float* acc = qf + G * hd;         // [G, hd]
  float* row = acc + G * hd;        // [hd]
  for (int64_t i = 0; i < G * hd; ++i) qf[i] = bits(q[i]) * scale;
  for (int64_t j = 0; j < S; ++j) {
    for (int64_t d = 0; d < hd; ++d) row[d] = bits(k[(lo + j) * hd + d]);
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * hd;
      p[h * S + j] = lane_reduce(hd, [&](int64_t d) { return qh[d] * row[d]; });
    }
  }
  softmax_rows(p, G, S);
  for (int64_t i = 0; i < G * hd; ++i) acc[i] = 0.0f;
  for (int64_t j = 0; j < S; ++j) {
    for (int64_t d = 0; d < hd; ++d) row[d] = bits(v[(lo + j) * hd + d]);
    for (int64_t h = 0; h < G; ++h) {
      const float pj = p[h * S + j];
      for (int64_t d = 0; d < hd; ++d) acc[h * hd + d] += pj * row[d];
    }
  }
  store_bf16(acc, out, G * hd);
}

// 16 bf16 -> float, as bits()
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const uint16_t* s) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), 16));
}

// attend() with AVX512 intrinsics where hd is a multiple of 16: the same operations on every value in the same
// order, so bitwise the same result. The scores of 16 keys come out of one reduction done side by side (each
// key's 16 lanes summed in lane_reduce's tree), and the weighted sum of the values keeps up to 8 heads' partial
// sums of 16 dimensions in registers over all keys instead of in memory.
__attribute__((target("avx512f")))
void attend_avx512(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t G, int64_t hd,
                   int64_t lo, int64_t hi, float scale, float* scratch) {
  const int64_t S = hi - lo, C = hd / 16;
  float* p = scratch;       // [G, S] scores, then weights
  float* qf = p + G * S;    // [G, hd]
  float* acc = qf + G * hd; // [G, hd]
  float* kf = acc + G * hd; // [16, hd]: 16 keys as floats
  for (int64_t i = 0; i < G * hd; ++i) qf[i] = bits(q[i]) * scale;
  int64_t j = 0;
  for (; j + 16 <= S; j += 16) {
    for (int64_t jj = 0; jj < 16; ++jj)
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(kf + jj * hd + 16 * c, load16(k + (lo + j + jj) * hd + 16 * c));
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * hd;
      __m512 a[16];
      for (int jj = 0; jj < 16; ++jj) a[jj] = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m512 qc = _mm512_loadu_ps(qh + 16 * c);
        for (int jj = 0; jj < 16; ++jj) a[jj] = _mm512_add_ps(a[jj], _mm512_mul_ps(qc, _mm512_loadu_ps(kf + jj * hd + 16 * c)));
      }
      // lane_reduce's tree for the 16 keys at once: p8[l] = p[l] + p[l + 8]: keys (2m, 2m + 1) in b[m]
      __m512 b[8];
      for (int m = 0; m < 8; ++m)
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44), _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xee));
      // p4[l] = p8[l] + p8[l + 4]: 128-bit lane r of d[n] holds key (4n + r)'s p4 (b[2n]: keys 4n, 4n + 1; b[2n + 1]: 4n + 2, 4n + 3)
      __m512 d[4];
      for (int n = 0; n < 4; ++n)
        d[n] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * n], b[2 * n + 1], 0x88), _mm512_shuffle_f32x4(b[2 * n], b[2 * n + 1], 0xdd));
      // (p4[0] + p4[2]) + (p4[1] + p4[3]): f = [x0 + x2 of d0, of d1, x1 + x3 of d0, of d1] per 128-bit lane
      const __m512 f0 = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
      const __m512 f1 = _mm512_add_ps(_mm512_unpacklo_ps(d[2], d[3]), _mm512_unpackhi_ps(d[2], d[3]));
      // element 4r + n: key 4n + r
      const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(f0, f1, 0x44), _mm512_shuffle_ps(f0, f1, 0xee));
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      _mm512_storeu_ps(p + h * S + j, _mm512_permutexvar_ps(order, r));
    }
  }
  scores_from(j, qf, k, p, G, hd, lo, S);  // the last keys one at a time, as attend() does
  softmax_rows(p, G, S);
  for (int64_t h0 = 0; h0 < G; h0 += 8) {
    const int64_t gn = std::min<int64_t>(8, G - h0);
    for (int64_t c = 0; c < C; ++c) {
      __m512 o[8];
      for (int hh = 0; hh < 8; ++hh) o[hh] = _mm512_setzero_ps();
      for (int64_t jj = 0; jj < S; ++jj) {
        const __m512 vr = load16(v + (lo + jj) * hd + 16 * c);
        for (int hh = 0; hh < 8; ++hh)
          if (hh < gn) o[hh] = _mm512_add_ps(o[hh], _mm512_mul_ps(_mm512_set1_ps(p[(h0 + hh) * S + jj]), vr));
      }
      for (int hh = 0; hh < gn; ++hh) _mm512_storeu_ps(acc + (h0 + hh) * hd + 16 * c, o[hh]);
    }
  }
  store_bf16(acc, out, G * hd);
}

// 8 bf16 -> float, as bits()
__attribute__((target("avx2"), always_inline)) inline __m256 load8(const uint16_t* s) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 16));
}

// lane_reduce's tree on its 16 partial sums, lanes 0-7 in lo and 8-15 in hi
__attribute__((target("avx2"), always_inline)) inline float tree16(__m256 lo, __m256 hi) {
  const __m256 p8 = _mm256_add_ps(lo, hi);                                                // p8[l] = p[l] + p[l + 8]
  const __m128 p4 = _mm_add_ps(_mm256_castps256_ps128(p8), _mm256_extractf128_ps(p8, 1));  // p8[l] + p8[l + 4]
  const __m128 t = _mm_add_ps(p4, _mm_movehl_ps(p4, p4));  // [p4[0] + p4[2], p4[1] + p4[3], ...]
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// attend() with AVX2 intrinsics where hd is a multiple of 16 (no FMA: a multiply, then an add, as attend() does):
// the same operations on every value in the same order, so bitwise the same result, faster than the compiler's
// vectorization of attend() (which prefill, with hundreds of keys a row, spends most of its attention time in;
// measured: docs/BENCHMARKS.md, "Kernel design choices"). The scores of 4 keys at a time, their 16 partial sums
// in two registers each, the keys made floats once for all G heads; the weighted sum of the values keeps up to 8
// heads' sums of 8 dimensions in registers over all keys.
__attribute__((target("avx2")))
void attend_avx2(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t G, int64_t hd,
                 int64_t lo, int64_t hi, float scale, float* scratch) {
  constexpr int64_t J = 4;  // keys a block
  const int64_t S = hi - lo, C = hd / 16;
  float* p = scratch;       // [G, S] scores, then weights
  float* qf = p + G * S;    // [G, hd]
  float* acc = qf + G * hd; // [G, hd]
  float* kf = acc + G * hd; // [J, hd]: a block of keys as floats
  for (int64_t i = 0; i < G * hd; ++i) qf[i] = bits(q[i]) * scale;
  int64_t j = 0;
  for (; j + J <= S; j += J) {
    for (int64_t jj = 0; jj < J; ++jj)
      for (int64_t c = 0; c < 2 * C; ++c) _mm256_storeu_ps(kf + jj * hd + 8 * c, load8(k + (lo + j + jj) * hd + 8 * c));
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = qf + h * hd;
      __m256 a[J][2];
      for (int64_t jj = 0; jj < J; ++jj) a[jj][0] = a[jj][1] = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m256 q0 = _mm256_loadu_ps(qh + 16 * c), q1 = _mm256_loadu_ps(qh + 16 * c + 8);
        for (int64_t jj = 0; jj < J; ++jj) {
          a[jj][0] = _mm256_add_ps(a[jj][0], _mm256_mul_ps(q0, _mm256_loadu_ps(kf + jj * hd + 16 * c)));
          a[jj][1] = _mm256_add_ps(a[jj][1], _mm256_mul_ps(q1, _mm256_loadu_ps(kf + jj * hd + 16 * c + 8)));
        }
      }
      for (int64_t jj = 0; jj < J; ++jj) p[h * S + j + jj] = tree16(a[jj][0], a[jj][1]);
    }
  }
  scores_from(j, qf, k, p, G, hd, lo, S);  // the last keys one at a time, as attend() does
  softmax_rows(p, G, S);
  for (int64_t h0 = 0; h0 < G; h0 += 8) {
    const int64_t gn = std::min<int64_t>(8, G - h0);
    for (int64_t c = 0; c < 2 * C; ++c) {
      __m256 o[8];
      for (int hh = 0; hh < 8; ++hh) o[hh] = _mm256_setzero_ps();
      for (int64_t jj = 0; jj < S; ++jj) {
        const __m256 vr = load8(v + (lo + jj) * hd + 8 * c);
        for (int hh = 0; hh < 8; ++hh)
          if (hh < gn) o[hh] = _mm256_add_ps(o[hh], _mm256_mul_ps(_mm256_broadcast_ss(p + (h0 + hh) * S + jj), vr));
      }
      for (int hh = 0; hh < gn; ++hh) _mm256_storeu_ps(acc + (h0 + hh) * hd + 8 * c, o[hh]);
    }
  }
  store_bf16(acc, out, G * hd);
}

using AttendFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                          int64_t, float, float*);

// the fastest attention path for this ISA setting: all give the same bits
AttendFn attend_for(int64_t hd) {
  if (hd % 16) return attend;
  return has_vnni() ? attend_avx512 : (has_avx2() ? attend_avx2 : attend);
}

torch::Tensor linear(const torch::Tensor& x, const std::vector<c10::optional<torch::Tensor>>& w, size_t at,
                     int64_t n) {
  if (w[at + 2]->scalar_type() == at::kLong) return linear_gguf(x, *w[at], *w[at + 1], *w[at + 2], w[at + 3]);
  if (w[at]->scalar_type() == at::kByte) return linear_q4(x, *w[at], *w[at + 1], *w[at + 2], w[at + 3], n);
  return linear_int8(x, *w[at], *w[at + 1], *w[at + 2], w[at + 3], n);
}


using Weights = std::vector<c10::optional<torch::Tensor>>;

// 1. The attention input norm and the fused q/k/v projection of rows x [N, D] -> [N, (H + 2 Hkv) hd].
torch::Tensor qkv_rows(const torch::Tensor& x, const Weights& w, int64_t rows_out, float eps) {
  auto h = torch::empty_like(x);
  rms_norm(x.data_ptr<bf16>(), w[0]->data_ptr<bf16>(), h.data_ptr<bf16>(), x.size(0), x.size(1), eps);
  return linear(h, w, 1, rows_out).contiguous();
}

// 2. One row's q/k norms (Qwen3) and RoPE, in place: r = [q (H hd), k (Hkv hd), v (Hkv hd)].
void norm_rope_row(bf16* r, const Weights& w, const bf16* c, const bf16* s, int64_t H, int64_t Hkv, int64_t hd,
                   float eps) {
  if (w[5].has_value()) rms_norm(r, w[5]->data_ptr<bf16>(), r, H, hd, eps);
  if (w[6].has_value()) rms_norm(r + H * hd, w[6]->data_ptr<bf16>(), r + H * hd, Hkv, hd, eps);
  for (int64_t hh = 0; hh < H + Hkv; ++hh) rope(r + hh * hd, c, s, hd);
}

// 4-5. Output projection of the attention o [N, H hd] and residual, then the MLP (norm, gate/up, SiLU(gate) * up,
// down) and residual -> the layer's output [N, D].
torch::Tensor finish_layer(const torch::Tensor& x, const torch::Tensor& o, const Weights& w, int64_t I, float eps) {
  const int64_t T = x.size(0), D = x.size(1);
  auto attn = linear(o, w, 7, D).contiguous();
  auto y = torch::empty_like(x);
  bf16* yp = y.data_ptr<bf16>();
  std::memcpy(yp, x.data_ptr<bf16>(), T * D * sizeof(bf16));
  add_into(yp, attn.data_ptr<bf16>(), T * D);
  auto h = torch::empty_like(x);
  rms_norm(yp, w[11]->data_ptr<bf16>(), h.data_ptr<bf16>(), T, D, eps);
  auto gu = linear(h, w, 12, 2 * I).contiguous();  // [T, 2I]
  auto act = torch::empty({T, I}, x.options());
  const bf16* gp = gu.data_ptr<bf16>();
  bf16* actp = act.data_ptr<bf16>();
  at::parallel_for(0, T * I, 4096, [&](int64_t i0, int64_t i1) {  // elementwise: any split gives the same values
    for (int64_t i = i0; i < i1;) {
      const int64_t t = i / I, c = i % I, n = std::min(i1 - i, I - c);
      silu_mul(gp + t * 2 * I + c, gp + t * 2 * I + I + c, actp + i, n);
      i += n;
    }
  });
  auto down = linear(act, w, 16, D).contiguous();
  add_into(yp, down.data_ptr<bf16>(), T * D);
  return y;
}

}  // namespace

// Test hook: one attend() (fast: attend_avx512, or attend_avx2 under set_isa('avx2')) of q [G, hd] against rows [lo, hi) of k, v [n, hd], all bf16
// -> {weights [G, S], the fp32 sums [G, hd] before their rounding, out [G, hd] bf16}: the two paths compared
// bit for bit before the bf16 rounding of the output can hide a difference.
std::vector<torch::Tensor> attend_parts(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t lo, int64_t hi, bool fast) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  q.dim() == 2 && k.dim() == 2 && k.sizes() == v.sizes() && k.size(1) == q.size(1) &&
                  q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "attend_parts: q [G, hd], k and v [n, hd], contiguous bf16");
  TORCH_CHECK(0 <= lo && lo < hi && hi <= k.size(0), "attend_parts: need 0 <= lo < hi <= n");
  const int64_t G = q.size(0), hd = q.size(1), S = hi - lo;
  TORCH_CHECK(!fast || ((has_vnni() || has_avx2()) && hd % 16 == 0),
              "attend_parts: the fast path (AVX512, or AVX2 where set_isa('avx2')) needs hd % 16 == 0");
  auto scratch = torch::zeros({G * (S + 2 * hd) + 16 * hd}, q.options().dtype(at::kFloat));
  auto out = torch::empty_like(q);
  auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<bf16>());
  auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<bf16>());
  auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<bf16>());
  (fast ? attend_for(hd) : attend)(qp, kp, vp, reinterpret_cast<uint16_t*>(out.data_ptr<bf16>()), G, hd, lo, hi,
                                  1.0f / std::sqrt(static_cast<float>(hd)), scratch.data_ptr<float>());
  return {scratch.narrow(0, 0, G * S).view({G, S}).clone(), scratch.narrow(0, G * S + G * hd, G * hd).view({G, hd}).clone(),
          out};
}

// x: [T, D] bf16; cos, sin: [T, hd] bf16; k_cache, v_cache: [Hkv, capacity, hd] bf16 (this layer, batch
// row 0), new keys/values written at [start, start + T); window: sliding window (0: none).
// w: ln1, qkv (3 packed-weight tensors, bias), q_norm, k_norm, o (4), ln2, gate_up (4), down (4); absent
// entries are None. dims: H, Hkv, hd, intermediate. Returns the layer's output [T, D] bf16.
torch::Tensor decoder_layer_quantized(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t window,
                                 const std::vector<c10::optional<torch::Tensor>>& w,
                                 const std::vector<int64_t>& dims, double eps) {
  TORCH_CHECK(w.size() == 20 && dims.size() == 4, "decoder_layer_quantized: 20 weights and 4 dims expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "decoder_layer_quantized: x [T, D] bf16");
  const int64_t T = x.size(0), H = dims[0], Hkv = dims[1], hd = dims[2], I = dims[3];
  const int64_t G = H / Hkv, S = start + T;
  TORCH_CHECK(T <= kMaxRows && S <= k_cache.size(1) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decoder_layer_quantized: bad chunk or cache");
  const float feps = static_cast<float>(eps);
  const int64_t cap = k_cache.size(1);

  // the first key the query at position last sees (sliding window)
  auto first_key = [&](int64_t last) -> int64_t { return window > 0 && last - window + 1 > 0 ? last - window + 1 : 0; };

  // 0. this layer's cached keys/values [lo, start) on their way into the L2 of the thread that will attend with
  //    them (step 3 splits its items the same way), while the q/k/v projection streams its weights: a cheaper
  //    draft attention (measured: docs/BENCHMARKS.md, "Kernel design choices")
  if (start > 0)
    at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
      uint64_t seen = 0;  // KV heads this thread has prefetched (heads past 63: not prefetched)
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = i % Hkv, last = start + i / Hkv;
        if (g >= 64 || (seen >> g & 1)) continue;
        seen |= uint64_t{1} << g;
        const int64_t lo = first_key(last);
        const char* kb = reinterpret_cast<const char*>(k_cache.data_ptr<bf16>() + (g * cap + lo) * hd);
        const char* vb = reinterpret_cast<const char*>(v_cache.data_ptr<bf16>() + (g * cap + lo) * hd);
        for (int64_t o = 0; o < (start - lo) * hd * 2; o += 64) {
          _mm_prefetch(kb + o, _MM_HINT_T1);
          _mm_prefetch(vb + o, _MM_HINT_T1);
        }
      }
    });

  // 1. attention input norm and the fused q/k/v projection
  auto qkv = qkv_rows(x, w, (H + 2 * Hkv) * hd, feps);  // [T, (H + 2 Hkv) hd]
  bf16* qkvp = qkv.data_ptr<bf16>();
  const int64_t row = (H + 2 * Hkv) * hd;

  // 2. q/k norms (Qwen3), RoPE on q and k, new keys/values into the cache
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  for (int64_t t = 0; t < T; ++t) {
    bf16* r = qkvp + t * row;
    norm_rope_row(r, w, cos.data_ptr<bf16>() + t * hd, sin.data_ptr<bf16>() + t * hd, H, Hkv, hd, feps);
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t i = 0; i < hd; ++i) {
        kc[(g * cap + start + t) * hd + i] = r[(H + g) * hd + i];
        vc[(g * cap + start + t) * hd + i] = r[(H + Hkv + g) * hd + i];
      }
  }

  // 3. causal attention in fp32: row t sees keys [lo, start + t]; the G query heads of a KV head together
  auto o = torch::empty({T, H * hd}, x.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const AttendFn attend_fast = attend_for(hd);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(G * (S + 2 * hd) + 16 * hd);  // attend()'s p, qf, acc, row (attend_avx512's kf)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, g = i % Hkv, last = start + t;
      const int64_t lo = first_key(last);
      attend_fast(reinterpret_cast<const uint16_t*>(qkvp + t * row + g * G * hd),
             reinterpret_cast<const uint16_t*>(kc + g * cap * hd), reinterpret_cast<const uint16_t*>(vc + g * cap * hd),
             reinterpret_cast<uint16_t*>(o.data_ptr<bf16>() + t * H * hd + g * G * hd), G, hd, lo, last + 1, scale,
             scratch.data());
    }
  });

  // 4-5. output projection, residual, MLP
  return finish_layer(x, o, w, I, feps);
}

// The same layer for the new tokens of several sequences in one call (the batched engine step), on a paged KV
// cache. x [N, D] bf16, rows grouped by sequence; cos, sin [N, hd]; k_pool, v_pool [num_blocks, Hkv, block_size, hd]
// bf16 (this layer's blocks); seqs [S, 3] int64: each sequence's first row, row count and the position of its first
// row; tables [S, max_blocks] int32: each sequence's block table (position p in block tables[s][p / block_size], slot
// p % block_size). Row t of a sequence, at position start + t, writes its keys/values to its slot and attends to
// its sequence's keys [lo, start + t] (lo: sliding window) with attend() on a gathered copy of them: the same
// operations in the same order as decoder_layer_quantized, and the matrices' kernels treat each row alike whatever
// the row count, so a row's result does not depend on what else the call carries.
torch::Tensor decoder_layer_paged(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                  torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& seqs,
                                  const torch::Tensor& tables, int64_t window, const Weights& w,
                                  const std::vector<int64_t>& dims, double eps) {
  TORCH_CHECK(w.size() == 20 && dims.size() == 4, "decoder_layer_paged: 20 weights and 4 dims expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "decoder_layer_paged: x [N, D] bf16");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == at::kBFloat16, "decoder_layer_paged: pools [blocks, Hkv, block_size, hd] bf16");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 3 && seqs.is_contiguous() &&
                  tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.size(0) == seqs.size(0) &&
                  tables.is_contiguous(), "decoder_layer_paged: seqs [S, 3] int64, tables [S, max_blocks] int32");
  const int64_t N = x.size(0), H = dims[0], Hkv = dims[1], hd = dims[2], I = dims[3], G = H / Hkv;
  const int64_t num_blocks = k_pool.size(0), bs = k_pool.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(k_pool.size(1) == Hkv && k_pool.size(3) == hd && cos.size(0) == N && sin.size(0) == N,
              "decoder_layer_paged: shapes do not match");
  const int64_t* sq = seqs.data_ptr<int64_t>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int64_t S = seqs.size(0);
  for (int64_t s = 0, rows = 0; s < S; ++s) {
    const int64_t first = sq[3 * s], n = sq[3 * s + 1], start = sq[3 * s + 2];
    TORCH_CHECK(first == rows && n > 0 && start >= 0 && start + n <= max_blocks * bs,
                "decoder_layer_paged: sequence ", s, " rows or positions out of range");
    for (int64_t b = 0; b < (start + n + bs - 1) / bs; ++b)
      TORCH_CHECK(tb[s * max_blocks + b] >= 0 && tb[s * max_blocks + b] < num_blocks, "decoder_layer_paged: bad block id");
    rows += n;
    TORCH_CHECK(s + 1 < S || rows == N, "decoder_layer_paged: the sequences' rows do not add up to x's");
  }
  const float feps = static_cast<float>(eps);
  auto first_key = [&](int64_t last) -> int64_t { return window > 0 && last - window + 1 > 0 ? last - window + 1 : 0; };
  auto slot = [&](int64_t s, int64_t pos, int64_t g) -> int64_t {  // element offset of (position, KV head g) in a pool
    return ((static_cast<int64_t>(tb[s * max_blocks + pos / bs]) * Hkv + g) * bs + pos % bs) * hd;
  };

  // 1-2. norm, q/k/v for every row at once; per row q/k norms, RoPE, keys/values into their slots
  const int64_t row = (H + 2 * Hkv) * hd;
  auto qkv = qkv_rows(x, w, row, feps);  // [N, (H + 2 Hkv) hd]
  bf16* qkvp = qkv.data_ptr<bf16>();
  bf16* kp = k_pool.data_ptr<bf16>();
  bf16* vp = v_pool.data_ptr<bf16>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = 0; t < sq[3 * s + 1]; ++t) {
      const int64_t n = sq[3 * s] + t, pos = sq[3 * s + 2] + t;
      bf16* r = qkvp + n * row;
      norm_rope_row(r, w, cos.data_ptr<bf16>() + n * hd, sin.data_ptr<bf16>() + n * hd, H, Hkv, hd, feps);
      for (int64_t g = 0; g < Hkv; ++g) {
        std::memcpy(kp + slot(s, pos, g), r + (H + g) * hd, hd * sizeof(bf16));
        std::memcpy(vp + slot(s, pos, g), r + (H + Hkv + g) * hd, hd * sizeof(bf16));
      }
    }

  // 3. attention: per (sequence, KV head), its keys/values [lo, last] gathered into one run, then each row
  auto o = torch::empty({N, H * hd}, x.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const AttendFn attend_fast = attend_for(hd);
  at::parallel_for(0, S * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> kbuf, vbuf;
    std::vector<float> scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / Hkv, g = i % Hkv, first = sq[3 * s], n = sq[3 * s + 1], start = sq[3 * s + 2];
      const int64_t lo = first_key(start), hi = start + n, len = hi - lo;
      kbuf.resize(len * hd);
      vbuf.resize(len * hd);
      scratch.resize(G * (len + 2 * hd) + 16 * hd);
      for (int64_t p = lo; p < hi;) {  // a run of slots within one block at a time
        const int64_t run = std::min(hi - p, bs - p % bs);
        std::memcpy(kbuf.data() + (p - lo) * hd, kp + slot(s, p, g), run * hd * sizeof(bf16));
        std::memcpy(vbuf.data() + (p - lo) * hd, vp + slot(s, p, g), run * hd * sizeof(bf16));
        p += run;
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t last = start + t;
        attend_fast(reinterpret_cast<const uint16_t*>(qkvp + (first + t) * row + g * G * hd),
               kbuf.data(), vbuf.data(), reinterpret_cast<uint16_t*>(o.data_ptr<bf16>() + (first + t) * H * hd + g * G * hd),
               G, hd, first_key(last) - lo, last + 1 - lo, scale, scratch.data());
      }
    }
  });

  // 4-5. output projection, residual, MLP
  return finish_layer(x, o, w, I, feps);
}

}  // namespace verispec
