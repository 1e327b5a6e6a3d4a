// Small-M int8 matrix products: y[M, N] = x[M, K] @ (w_scale[N] * q[N, K])^T (+ bias), M = 1..16.
//
// Weights: symmetric int8 per output row, packed once at load time into tiles of NR rows so that one
// tile is a single sequential stream: packed[N/NR][K/64][NR][64] (N and K zero-padded).
// Activations: each row quantized on the fly to int8 with its own scale (round to nearest, max |x| ->
// 127), stored as uint8 = q + 128 for AVX512-VNNI's unsigned x signed dot product; the +128 is removed
// exactly with the weight row sums. Integer accumulation is exact, so the result for a row does not
// depend on M, on the tiling, or on the instruction set: the AVX512 and portable paths agree bitwise.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>


namespace verispec {
namespace {

constexpr int64_t NR = 4;     // weight rows per tile
constexpr int64_t KC = 64;    // k elements per chunk (one zmm of int8)
constexpr int64_t MT = 4;     // activation rows per register tile
constexpr int64_t KB = 1024;  // k elements per cache block: NR * KB = 4 KiB of weights in L1
constexpr int64_t kPfTiles = 16;  // scale / row-sum prefetch distance in tiles (4 cache lines ahead)
constexpr int64_t PF = 32 * NR * KC;  // software prefetch distance in bytes (32 chunks = 8 KiB ahead: the best of 0-128 measured here)

// U independent accumulator sets per (row, output) hide the dot-product latency when MR is small;
// integer sums are exact, so splitting them changes nothing in the result.
template <int MR, int U = (MR <= 2 ? 2 : 1)>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline void block_vnni(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t c0, int64_t c1,
                              __m512i* acc /* [MR][NR] */) {
  __m512i c[U][MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      c[0][i][j] = acc[i * NR + j];
      for (int u = 1; u < U; ++u) c[u][i][j] = _mm512_setzero_si512();
    }
  int64_t ch = c0;
  for (; ch + U <= c1; ch += U) {
    for (int u = 0; u < U; ++u) {
      const int8_t* wc = w + (ch + u) * NR * KC;
      for (int l = 0; l < NR; ++l) _mm_prefetch(reinterpret_cast<const char*>(wc + PF + l * KC), _MM_HINT_T0);
      __m512i b[NR];
      for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(wc + j * KC);
      for (int i = 0; i < MR; ++i) {
        __m512i a = _mm512_loadu_si512(x + i * ldx + (ch + u) * KC);
        for (int j = 0; j < NR; ++j) c[u][i][j] = _mm512_dpbusd_epi32(c[u][i][j], a, b[j]);
      }
    }
  }
  for (; ch < c1; ++ch) {
    const int8_t* wc = w + ch * NR * KC;
    for (int i = 0; i < MR; ++i) {
      __m512i a = _mm512_loadu_si512(x + i * ldx + ch * KC);
      for (int j = 0; j < NR; ++j) c[0][i][j] = _mm512_dpbusd_epi32(c[0][i][j], a, _mm512_loadu_si512(wc + j * KC));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      __m512i s = c[0][i][j];
      for (int u = 1; u < U; ++u) s = _mm512_add_epi32(s, c[u][i][j]);
      acc[i * NR + j] = s;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void tile_vnni(const uint8_t* x, int64_t M, int64_t Kp, const int8_t* wt, int32_t* out /* [M][NR] */) {
  __m512i acc[kMaxRows * NR];
  for (int64_t i = 0; i < M * NR; ++i) acc[i] = _mm512_setzero_si512();
  const int64_t chunks = Kp / KC, cb = KB / KC;
  for (int64_t c0 = 0; c0 < chunks; c0 += cb) {
    const int64_t c1 = c0 + cb < chunks ? c0 + cb : chunks;
    int64_t m = 0;
    for (; m + MT <= M; m += MT) block_vnni<MT>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR);
    switch (M - m) {
      case 3: block_vnni<3>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR); break;
      case 2: block_vnni<2>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR); break;
      case 1: block_vnni<1>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR); break;
      default: break;
    }
  }
  for (int64_t i = 0; i < M * NR; ++i) out[i] = _mm512_reduce_add_epi32(acc[i]);
}

// plain C++, the reference path (any x86-64): the sums the vector paths must match
static void tile_portable(const uint8_t* x, int64_t M, int64_t Kp, const int8_t* wt, int32_t* out) {
  const int64_t chunks = Kp / KC;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < NR; ++j) {
      int32_t s = 0;
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int8_t* wc = wt + (ch * NR + j) * KC;
        const uint8_t* xc = x + m * Kp + ch * KC;
        for (int64_t k = 0; k < KC; ++k) s += static_cast<int32_t>(xc[k]) * static_cast<int32_t>(wc[k]);
      }
      out[m * NR + j] = s;
    }
}

// AVX2 (no VNNI): vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pair sums, so it is fed
// |w| and sign(w) * x with x back to signed (q = x - 128, |q| <= 127): a pair is at most 2 * 127 * 127 = 32,258,
// never saturated, and vpmaddwd widens the pairs into int32. Its sums are sum(q * w) itself, so the epilogue
// subtracts no 128 * rowsum for them: exact integers, the same result as the other paths.
template <int MR>
__attribute__((target("avx2"))) static inline void block_avx2(const uint8_t* x, int64_t ldx, const int8_t* w,
                                                              int64_t c0, int64_t c1, __m256i* acc /* [MR][NR] */) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i c[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i][j] = acc[i * NR + j];
  for (int64_t ch = c0; ch < c1; ++ch) {
    const int8_t* wc = w + ch * NR * KC;
    for (int l = 0; l < NR; ++l) _mm_prefetch(reinterpret_cast<const char*>(wc + PF + l * KC), _MM_HINT_T0);
    for (int h = 0; h < KC; h += 32) {
      __m256i a[MR];
      for (int i = 0; i < MR; ++i)
        a[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + ch * KC + h)), flip);
      for (int j = 0; j < NR; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + j * KC + h));
        const __m256i babs = _mm256_sign_epi8(b, b);  // |w| (w >= -127)
        for (int i = 0; i < MR; ++i)
          c[i][j] = _mm256_add_epi32(c[i][j],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(babs, _mm256_sign_epi8(a[i], b)), ones));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i * NR + j] = c[i][j];
}

__attribute__((target("avx2"))) static inline int32_t hsum_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2"))) static void tile_avx2(const uint8_t* x, int64_t M, int64_t Kp, const int8_t* wt,
                                                      int32_t* out /* [M][NR] */) {
  __m256i acc[kMaxRows * NR];
  for (int64_t i = 0; i < M * NR; ++i) acc[i] = _mm256_setzero_si256();
  const int64_t chunks = Kp / KC, cb = KB / KC;
  for (int64_t c0 = 0; c0 < chunks; c0 += cb) {  // a block of weights stays in L1 while every row reads it
    const int64_t c1 = c0 + cb < chunks ? c0 + cb : chunks;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) block_avx2<2>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR);
    if (m < M) block_avx2<1>(x + m * Kp, Kp, wt, c0, c1, acc + m * NR);
  }
  for (int64_t i = 0; i < M * NR; ++i) out[i] = hsum_avx2(acc[i]);
}

}  // namespace

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& rowsum, const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == NR &&
                  packed.size(3) == KC && packed.is_contiguous(),
              "linear_int8: packed weight must be int8 [N/", NR, ", K/", KC, ", ", NR, ", ", KC, "]");
  const int64_t tiles = packed.size(0), Kp = packed.size(1) * KC;
  TORCH_CHECK(N <= tiles * NR && scale.numel() == tiles * NR && rowsum.numel() == tiles * NR,
              "linear_int8: scales/row sums do not match the packed weight");
  QuantizedRows xq = quantize_rows(x, Kp, "linear_int8");
  const int64_t M = xq.M;
  for (auto& v : xq.q) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);  // as uint8: q + 128
  const uint8_t* qx = reinterpret_cast<const uint8_t*>(xq.q.data());
  const float* sx = xq.scale.data();
  const torch::Tensor b = fp32_bias(bias);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* sw = scale.data_ptr<float>();
  const int32_t* rs = rowsum.data_ptr<int32_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const Output out(x, M, N);
  const bool vec = has_vnni(), avx2 = has_avx2();
  const int32_t offset = avx2 ? 0 : 128;  // the uint8 paths' dots carry 128 * rowsum (the AVX2 path's do not)
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    int32_t dots[kMaxRows * NR];
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* wt = wp + t * (Kp / KC) * NR * KC;
      if (t + kPfTiles < tiles) {  // the per-row scales and sums are streams too: fetch them ahead (unfetched they
                                   // took a share of a draft step: docs/BENCHMARKS.md, "Kernel design choices")
        __builtin_prefetch(sw + (t + kPfTiles) * NR);
        __builtin_prefetch(rs + (t + kPfTiles) * NR);
        if (bp) __builtin_prefetch(bp + (t + kPfTiles) * NR);
      }
      if (vec)
        tile_vnni(qx, M, Kp, wt, dots);
      else if (avx2)
        tile_avx2(qx, M, Kp, wt, dots);
      else
        tile_portable(qx, M, Kp, wt, dots);
      for (int64_t j = 0; j < NR && t * NR + j < N; ++j) {
        const int64_t n = t * NR + j;
        for (int64_t m = 0; m < M; ++m) {
          const int32_t d = dots[m * NR + j] - offset * rs[n];
          out.set(m, n, static_cast<float>(d) * sx[m] * sw[n] + (bp ? bp[n] : 0.0f));
        }
      }
    }
  });
  return out.finish(x);
}

}  // namespace verispec
