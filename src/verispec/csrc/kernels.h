// verispec's CPU kernels: shared declarations.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace verispec {

constexpr int64_t kMaxRows = 16;  // decode (1 row) and verify (k + 1 rows) calls
constexpr int64_t kChunk = 64;    // k elements per packed chunk, in both weight formats

bool has_vnni();                         // whether the int8 kernels use AVX512-VNNI now
bool has_avx2();                         // whether they use the AVX2 paths now (a CPU without AVX512-VNNI, or forced)
void set_isa(const std::string& name);   // "auto" | "avx2" | "portable" (tests force the other paths)
std::string isa_name();
std::vector<std::string> cpu_isas();

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
  torch::Tensor finish(const torch::Tensor& x) const;  // [..., N]
};

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& rowsum, const c10::optional<torch::Tensor>& bias, int64_t N);

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& d,
                        const torch::Tensor& mn, const c10::optional<torch::Tensor>& bias, int64_t N);
// GGUF blocks used natively (linear_gguf.cpp): segments stacked along N, meta rows (kind, rows, tiles,
// offset in q, offset in s, K)
int64_t gguf_block(int64_t K);
torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias);
torch::Tensor decoder_layer_quantized(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t window,
                                 const std::vector<c10::optional<torch::Tensor>>& w,
                                 const std::vector<int64_t>& dims, double eps);

}  // namespace verispec
