// The integer peak of one core, measured: multiply-accumulates a second of the instruction the int8 kernels are built
// on (AVX512-VNNI vpdpbusd: 64 a register; AVX2 vpmaddubsw: 32), 12 independent chains so that latency does not
// bound it. bench/native_matmul.py reports each matrix product against it (docs/BENCHMARKS.md, "Native GGUF kernels").
#include "kernels.h"

#include <chrono>

namespace verispec {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vnni(int64_t iters) {
  __m512i a[12];
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_epi32(j);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // not constants to the compiler: the products stay in the loop
  }
  const double s = seconds_since(t0);
  int32_t sink = 0;
  for (int j = 0; j < 12; ++j) sink += _mm512_reduce_add_epi32(a[j]);
  asm volatile("" : : "r"(sink));
  return 12.0 * 64 * static_cast<double>(iters) / s;
}

__attribute__((target("avx2"))) double avx2(int64_t iters) {
  __m256i a[12];
  __m256i w = _mm256_set1_epi8(3);
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_epi8(static_cast<char>(j));
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_maddubs_epi16(w, a[j]);
    asm volatile("" : "+x"(w));
  }
  const double s = seconds_since(t0);
  int32_t sink = 0;
  for (int j = 0; j < 12; ++j) sink += _mm256_extract_epi32(a[j], 0);
  asm volatile("" : : "r"(sink));
  return 12.0 * 32 * static_cast<double>(iters) / s;
}

}  // namespace

double int8_peak_macs(int64_t iters) {
  TORCH_CHECK(iters > 0, "int8_peak: iters must be > 0");
  if (has_vnni()) return vnni(iters);
  if (has_avx2()) return avx2(iters);
  return 0.0;  // the portable path has no one instruction to measure
}

}  // namespace verispec
