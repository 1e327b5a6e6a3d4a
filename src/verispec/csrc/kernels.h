// verispec's CPU kernels: shared declarations.
#pragma once
#include <torch/extension.h>

namespace verispec {

constexpr int64_t kMaxRows = 16;  // decode (1 row) and verify (k + 1 rows) calls

bool has_vnni();                         // whether the int8 kernels use AVX512-VNNI now
void set_isa(const std::string& name);   // "auto" | "portable" (tests force the portable path)
std::string isa_name();

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const torch::Tensor& rowsum, const c10::optional<torch::Tensor>& bias, int64_t N);

torch::Tensor linear_q4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& d,
                        const torch::Tensor& mn, const c10::optional<torch::Tensor>& bias, int64_t N);
torch::Tensor decoder_layer_quantized(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t window,
                                 const std::vector<c10::optional<torch::Tensor>>& w,
                                 const std::vector<int64_t>& dims, double eps);

}  // namespace verispec
