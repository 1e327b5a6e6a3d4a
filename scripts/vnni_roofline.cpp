// How fast can the GGUF kernel's inner loop go on this CPU? One core, no PyTorch:
//   g++ -O3 -o /tmp/vnni_roofline scripts/vnni_roofline.cpp && /tmp/vnni_roofline [MB]
// (twice at once, `taskset -c 0` and `-c 1`, for both cores). Prints
//   1. the peak rate of 512-bit dpbusd (10 independent accumulators) and of 512-bit FMA;
//   2. the 4-bit inner loop of csrc/linear_gguf.cpp alone (tiles of 4 weight rows x K = 1536 nibbles, blocks
//      of 512, MR activation rows x 4 weight rows, the nibbles split by and/shift), over MB megabytes of
//      weights (default 7: from L3; 200: from DRAM), with and without a software prefetch into L2 two
//      tiles ahead, and with a Q4_K-like epilogue per block (lane sums to float, scale, min term, activation
//      scale). No scales are decoded and nothing is checked: an upper bound for the real kernel, not a test.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define R10(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)

__attribute__((target("avx512f,avx512vnni,avx512bw"))) static void peaks() {
  const long n = 100000000;
#define DI(i) __m512i a##i = _mm512_set1_epi32(i);
  R10(DI)
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#define UI(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
    R10(UI)
    __asm__ volatile("" : "+v"(w));
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i t = _mm512_setzero_si512();
#define SI(i) t = _mm512_add_epi32(t, a##i);
  R10(SI)
  printf("dpbusd zmm: %.2f G/s (%d)\n", n * 10 / s / 1e9, _mm512_reduce_add_epi32(t));
#define DF(i) __m512 f##i = _mm512_set1_ps(i);
  R10(DF)
  __m512 m = _mm512_set1_ps(1.0f), c = _mm512_setzero_ps();
  t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#define UF(i) f##i = _mm512_fmadd_ps(f##i, m, c);
    R10(UF)
    __asm__ volatile("" : "+v"(m));
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 u = _mm512_setzero_ps();
#define SF(i) u = _mm512_add_ps(u, f##i);
  R10(SF)
  printf("fma zmm:    %.2f G/s (%.0f)\n", n * 10 / s / 1e9, _mm512_reduce_add_ps(u));
}

constexpr long K = 1536, TILE = 4 * K / 2;  // bytes per tile of 4 weight rows

template <int MR, bool PF, bool EPI>
__attribute__((target("avx512f,avx512vnni,avx512bw"), noinline)) static float run(const uint8_t* q, long tiles,
                                                                                   const int8_t* x) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  alignas(64) static float sv[3 * 4 * 16], mv[3 * 4 * 16], lsf[MR * 3 * 16], sx[MR * 3];
  __m512i itot = _mm512_setzero_si512();
  float sink = 0.0f;
  for (long t = 0; t < tiles; ++t) {
    const uint8_t* qt = q + t * TILE;
    __m512 facc[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 4; ++j) facc[i][j] = _mm512_setzero_ps();
    for (long b = 0; b < K / 512; ++b) {
      const uint8_t* qb = qt + b * 4 * 256;
      if (PF)
        for (int p = 0; p < 1024; p += 64) _mm_prefetch(reinterpret_cast<const char*>(qb + 2 * TILE + p), _MM_HINT_T1);
      const int8_t* xb = x + b * 512;
      __m512i acc[MR][4];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; c += 2) {
        __m512i w0[4], w1[4];
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(qb + j * 256 + c * 32);
          w0[j] = _mm512_and_si512(v, lo4);
          w1[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
        for (int i = 0; i < MR; ++i) {
          const __m512i x0 = _mm512_loadu_si512(xb + i * K + c * 64), x1 = _mm512_loadu_si512(xb + i * K + c * 64 + 64);
          for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w0[j], x0);
          for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w1[j], x1);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) {
          if (EPI) {
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_load_ps(sv + (b * 4 + j) * 16));
            v = _mm512_fmadd_ps(_mm512_load_ps(mv + (b * 4 + j) * 16), _mm512_load_ps(lsf + (i * 3 + b) * 16), v);
            facc[i][j] = _mm512_fmadd_ps(v, _mm512_set1_ps(sx[i * 3 + b]), facc[i][j]);
          } else {
            itot = _mm512_add_epi32(itot, acc[i][j]);
          }
        }
    }
    if (EPI)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) sink += _mm512_reduce_add_ps(facc[i][j]);
  }
  return sink + static_cast<float>(_mm512_reduce_add_epi32(itot));
}

template <int MR, bool PF, bool EPI>
static void bench(const char* name, const std::vector<uint8_t>& q, long tiles) {
  static int8_t x[16 * K];
  for (auto& v : x) v = static_cast<int8_t>(rand());
  double best = 1e9;
  float sink = 0.0f;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    sink += run<MR, PF, EPI>(q.data(), tiles, x);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  printf("%-22s %6.3f ms per 13.8 MB  %5.2f G dpbusd/s  %5.1f GB/s  (%g)\n", name, best * 1e3 * 13.76e6 / (tiles * TILE),
         tiles * (K / 64.0) * MR * 4 / best / 1e9, tiles * TILE / best / 1e9, sink);
}

int main(int argc, char** argv) {
  // bad input: one line on stderr, exit 2
  char* end = nullptr;
  const long mb = argc > 1 ? strtol(argv[1], &end, 10) : 7;
  if (argc > 2 || (argc > 1 && (*end != '\0' || mb < 1 || mb > 4096))) {
    fprintf(stderr, "vnni_roofline: usage: vnni_roofline [MB], MB an integer in 1..4096 (got %s)\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    fprintf(stderr, "vnni_roofline: this CPU has no AVX512-VNNI; the loop measured here is the AVX512 path's\n");
    return 2;
  }
  peaks();
  const long tiles = mb * 1000000 / TILE;
  std::vector<uint8_t> q(tiles * TILE + 4 * TILE);
  for (auto& v : q) v = static_cast<uint8_t>(rand());
  bench<1, false, false>("M=1", q, tiles);
  bench<1, true, false>("M=1 prefetch", q, tiles);
  bench<1, true, true>("M=1 prefetch epilogue", q, tiles);
  bench<4, false, false>("M=4", q, tiles);
  bench<4, true, false>("M=4 prefetch", q, tiles);
  bench<4, true, true>("M=4 prefetch epilogue", q, tiles);
}
