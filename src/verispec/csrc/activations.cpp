// Activations of the quantized kernels (linear_int8.cpp, linear_q4.cpp): rows of x to int8 with one scale
// per row, and the result in x's dtype and shape.
#include "kernels.h"

#include <cmath>

namespace verispec {
namespace {

// Inlined into each instruction-set clone below, so the loops vectorize (nearbyint becomes vroundps, with
// the same round-to-nearest-even result as the scalar call: the clones agree bitwise).
template <typename T>
__attribute__((always_inline)) inline void quantize(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* q,
                                                    float* scale) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
    int8_t* qr = q + m * Kp;
    for (int64_t k = 0; k < Kp; ++k) {
      const float v = k < K ? std::nearbyint(static_cast<float>(xr[k]) * inv) : 0.0f;
      qr[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
    scale[m] = s;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_f32(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* scale) {
  quantize(x, M, K, Kp, q, scale);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_bf16(const at::BFloat16* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* scale) {
  quantize(x, M, K, Kp, q, scale);
}

}  // namespace

QuantizedRows quantize_rows(const torch::Tensor& x, int64_t Kp, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": bf16 or fp32 x");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K <= Kp && Kp - K < kChunk, op, ": x has ", K, " features, weight packed for ", Kp);
  auto x2 = x.reshape({-1, K}).contiguous();
  QuantizedRows r;
  r.M = x2.size(0);
  TORCH_CHECK(r.M <= kMaxRows, op, ": at most ", kMaxRows, " rows per call, got ", r.M);
  r.q.resize(r.M * Kp);
  r.scale.resize(r.M);
  if (x2.scalar_type() == at::kFloat)
    quantize_f32(x2.data_ptr<float>(), r.M, K, Kp, r.q.data(), r.scale.data());
  else
    quantize_bf16(x2.data_ptr<at::BFloat16>(), r.M, K, Kp, r.q.data(), r.scale.data());
  return r;
}

torch::Tensor fp32_bias(const c10::optional<torch::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
}

Output::Output(const torch::Tensor& x, int64_t M, int64_t N_) : N(N_) {
  y = torch::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat)
    f = y.data_ptr<float>();
  else
    b = y.data_ptr<at::BFloat16>();
}

torch::Tensor Output::finish(const torch::Tensor& x) const {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.reshape(sizes);
}

}  // namespace verispec
