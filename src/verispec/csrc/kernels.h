// verispec's CPU kernels: shared declarations.
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace verispec {

constexpr int64_t kGgufLayout = 3;  // how linear_gguf.cpp wants GGUF blocks laid out (GGUF_LAYOUT in kernels.py)
constexpr int64_t kMaxRows = 16;  // decode (1 row) and verify (k + 1 rows) calls
constexpr int64_t kChunk = 64;    // k elements per packed chunk, in both weight formats

bool has_vnni();                         // whether the int8 kernels use AVX512-VNNI now
bool has_avx2();                         // whether they use the AVX2 paths now (a CPU without AVX512-VNNI, or forced)
void set_isa(const std::string& name);   // "auto" | "avx2" | "portable" (tests force the other paths)
std::string isa_name();
std::vector<std::string> cpu_isas();
double int8_peak_macs(int64_t iters);  // peak.cpp: one core's multiply-accumulates a second (0: portable)

// An fp16 field stored at p (GGUF scales) as float
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// 16 values of x from p (count 8 or 16) as floats
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 load16(const T* p, __mmask16 k) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(k, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Activations of the quantized kernels (activations.cpp): x [..., K] -> int8 rows [M, Kp] (round to nearest,
// max |x| -> 127, zero padding), one scale per row; checks dtype, K against Kp and M <= kMaxRows.
struct QuantizedRows {
  int64_t M = 0;
  std::vector<int8_t> q;      // [M, Kp]
  std::vector<float> scale;   // [M]
};
QuantizedRows quantize_rows(const torch::Tensor& x, int64_t Kp, const char* op);
torch::Tensor fp32_bias(const c10::optional<torch::Tensor>& bias);  // undefined when absent
// The [M, N] result of a quantized matrix product, written straight in x's dtype (a bf16 value rounded to
// nearest even, as .to(bf16) rounds it): no fp32 temporary and no conversion pass.
struct Output {
  torch::Tensor y;  // [M, N]
  float* f = nullptr;
  at::BFloat16* b = nullptr;
  int64_t N;
  Output(const torch::Tensor& x, int64_t M, int64_t N);
  void set(int64_t m, int64_t n, float v) const {
    if (f)
      f[m * N + n] = v;
    else
      b[m * N + n] = at::BFloat16(v);
  }
  // y[m, n .. n + 3] = v + bias[n .. n + 3] (+ 0 without a bias): four set() calls in one, the same bits.
  // (Faster forwards and draft steps: docs/BENCHMARKS.md, "Kernel design choices".)
  void set4(int64_t m, int64_t n, __m128 v, const float* bias) const {
    v = _mm_add_ps(v, bias ? _mm_loadu_ps(bias + n) : _mm_setzero_ps());
    if (f) {
      _mm_storeu_ps(f + m * N + n, v);
      return;
    }
    // as at::BFloat16(float): (u + 0x7FFF + ((u >> 16) & 1)) >> 16, a NaN -> 0x7FC0
    const __m128i u = _mm_castps_si128(v);
    __m128i r = _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1)));
    r = _mm_srli_epi32(r, 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7FFFFFFF)), _mm_set1_epi32(0x7F800000));
    r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7FC0)));
    r = _mm_shufflelo_epi16(r, _MM_SHUFFLE(3, 3, 2, 0));  // the low words of lanes 0, 1 -> words 0, 1
    r = _mm_shufflehi_epi16(r, _MM_SHUFFLE(3, 3, 2, 0));  // of lanes 2, 3 -> words 4, 5
    r = _mm_shuffle_epi32(r, _MM_SHUFFLE(3, 3, 2, 0));    // -> words 0 .. 3
    _mm_storel_epi64(reinterpret_cast<__m128i*>(b + m * N + n), r);
  }
  torch::Tensor finish(const torch::Tensor& x) const;  // [..., N]
};

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& rowsum, const c10::optional<torch::Tensor>& bias, int64_t N);

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& d,
                        const torch::Tensor& mn, const c10::optional<torch::Tensor>& bias, int64_t N);
// GGUF blocks used natively (linear_gguf.cpp): segments stacked along N, meta rows (kind, rows, tiles,
// offset in q, offset in s, K)
int64_t gguf_block(int64_t K);
// Q4_K / Q6_K in tiles of 16 weight rows (linear_kquant.cpp): activations in natural order, per block of 512 (then
// 256) one scale, per group of 16 / 32 the sums the kinds need
struct KActs {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;       // [M][K]
  std::vector<float> sx;       // [M][nb]
  std::vector<int32_t> xs16;   // [M][K / 16]: -32 x the group's sum (Q6_K)
  std::vector<int16_t> xs32;   // [M][K / 32]: the group's sum (Q4_K)
};
bool kquant_tiled(int64_t kind);
int64_t kquant_tile_q(int64_t kind, int64_t K);
int64_t kquant_tile_s(int64_t kind, int64_t K);
KActs kquant_acts(const torch::Tensor& x2);
void kquant_tiles(int64_t kind, const KActs& a, const uint8_t* q, const uint8_t* s, int64_t t0, int64_t t1,
                  int64_t rows, int64_t n0, int64_t m_lo, int64_t m_hi, const Output& out, const float* bias, float* y);
torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias);
std::vector<torch::Tensor> attend_parts(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        int64_t lo, int64_t hi, bool fast);  // test hook (decoder_layer.cpp)
torch::Tensor decoder_layer_quantized(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t window,
                                 const std::vector<c10::optional<torch::Tensor>>& w,
                                 const std::vector<int64_t>& dims, double eps);
torch::Tensor decoder_layer_paged(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                  torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& seqs,
                                  const torch::Tensor& tables, int64_t window,
                                  const std::vector<c10::optional<torch::Tensor>>& w,
                                  const std::vector<int64_t>& dims, double eps);

}  // namespace verispec
