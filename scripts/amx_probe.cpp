// Would AMX-INT8 tiles make a GGUF Q4_K matrix over several rows cheaper than the AVX512-VNNI kernel? A probe,
// not a kernel (twenty-first session, docs/BENCHMARKS.md): the default target's largest matrix, Q4_K 17920 x 1536,
// M = 1..15 activation rows, 2 OpenMP threads, random data, weights assumed laid out for the tile unit at load time
// (per 16 weight rows and group of 32: [8 k-quads][16 rows][4 bytes], two groups' nibbles per 64 bytes), or with
// `tr` in verispec's current layout (per row, lanes = groups) and transposed 16 x 16 dwords on the fly.
// Per group: A = the activation rows as x + 128 (u8) plus a row of ones, B = q - 8 (s8), so that
// sum x q = C[m][n] + 8 sum x - 128 C[ones][n] exactly (checked first, with the transpose); then the float operations
// that verispec applies per (row, weight row, group) -- convert, times the scale, plus min x activation sum,
// times the activation scale, accumulated in fp32 -- here vectorized over 16 weight rows, the sums kept in L1.
// "tiles alone" skips those float operations.
//   g++ -O3 -march=native -fopenmp -o /tmp/amx_probe scripts/amx_probe.cpp && /tmp/amx_probe && /tmp/amx_probe tr
// Linux only (arch_prctl for the tile state); exits with a message on a CPU without AMX.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdint>

struct TileCfg { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void config(int M) {
  TileCfg c; memset(&c, 0, sizeof c); c.palette = 1;
  c.rows[0] = M + 1; c.colsb[0] = 64;   // C: (M + 1) x 16 int32
  c.rows[1] = M + 1; c.colsb[1] = 32;   // A: M x 32 u8 (x + 128) + a row of ones
  c.rows[2] = 8; c.colsb[2] = 64;   // B: 8 k-quads x 16 n x 4
  c.rows[3] = M + 1; c.colsb[3] = 64;   // second C
  c.rows[4] = M + 1; c.colsb[4] = 32;
  c.rows[5] = 8; c.colsb[5] = 64;
  _tile_loadconfig(&c);
}

static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    __m512i A0 = r[j], A1 = r[4 + j], A2 = r[8 + j], A3 = r[12 + j];
    __m512i P = _mm512_shuffle_i32x4(A0, A1, 0x44), Q = _mm512_shuffle_i32x4(A0, A1, 0xEE);
    __m512i R = _mm512_shuffle_i32x4(A2, A3, 0x44), S = _mm512_shuffle_i32x4(A2, A3, 0xEE);
    t[j] = _mm512_shuffle_i32x4(P, R, 0x88); t[4 + j] = _mm512_shuffle_i32x4(P, R, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(Q, S, 0x88); t[12 + j] = _mm512_shuffle_i32x4(Q, S, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// the identity above on one tile op with random bytes, and transpose16 on known values
static bool checks_pass() {
  const int M = 5;
  TileCfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  c.rows[0] = M + 1; c.colsb[0] = 64; c.rows[1] = M + 1; c.colsb[1] = 32; c.rows[2] = 8; c.colsb[2] = 64;
  _tile_loadconfig(&c);
  int8_t x[M][32];
  uint8_t q[16][32];
  alignas(64) uint8_t a[M + 1][32];
  alignas(64) int8_t b[8][64];
  alignas(64) int32_t cc[M + 1][16];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < 32; ++k) { x[m][k] = rand() % 255 - 127; a[m][k] = uint8_t(x[m][k] + 128); }
  for (int k = 0; k < 32; ++k) a[M][k] = 1;
  for (int n = 0; n < 16; ++n)
    for (int k = 0; k < 32; ++k) { q[n][k] = rand() % 16; b[k / 4][n * 4 + k % 4] = int8_t(q[n][k] - 8); }
  _tile_zero(0); _tile_loadd(1, a, 32); _tile_loadd(2, b, 64); _tile_dpbusd(0, 1, 2); _tile_stored(0, cc, 64);
  _tile_release();
  bool ok = true;
  for (int m = 0; m < M; ++m) {
    int32_t sx = 0;
    for (int k = 0; k < 32; ++k) sx += x[m][k];
    for (int n = 0; n < 16; ++n) {
      int32_t ref = 0;
      for (int k = 0; k < 32; ++k) ref += int32_t(q[n][k]) * int32_t(x[m][k]);
      ok &= ref == cc[m][n] + 8 * sx - 128 * cc[M][n];
    }
  }
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_add_epi32(_mm512_set1_epi32(16 * i), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  transpose16(r);
  for (int i = 0; i < 16; ++i) {
    alignas(64) int32_t v[16];
    _mm512_store_si512(v, r[i]);
    for (int j = 0; j < 16; ++j) ok &= v[j] == 16 * j + i;
  }
  return ok;
}

int main(int argc, char** argv) {
  const int TR = argc > 1;
  if (!__builtin_cpu_supports("avx512vnni") || syscall(SYS_arch_prctl, 0x1023, 18)) {
    printf("no AMX-INT8 here (or Linux refused the tile state)\n");
    return 1;
  }
  if (!checks_pass()) {
    printf("the tile identity or the transpose is wrong\n");
    return 1;
  }
  const int N = 17920, K = 1536, NB = K / 512;
  const int G = N / 16;
  std::vector<uint8_t> w((size_t)N * K / 2);
  for (auto& x : w) x = rand();
  std::vector<float> sv((size_t)G * NB * 16 * 16, 0.01f), mv((size_t)G * NB * 16 * 16, -0.01f);
  for (int M : {1, 2, 4, 5, 8, 15}) {
    std::vector<uint8_t> x((size_t)(M + 1) * K);
    for (auto& v : x) v = rand() % 255 + 1; for (int k = 0; k < K; ++k) x[(size_t)M * K + k] = 1;
    std::vector<float> lsx((size_t)M * NB * 16, 5.0f);
    std::vector<float> lsf((size_t)M * NB * 16, 3.0f), sx((size_t)M * NB, 0.02f), y((size_t)M * N);
    double best = 1e9, best_raw = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      for (int raw = 1; raw >= 0; --raw) {  // the full run last: y holds its sums
        auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
        {
          config(M);
          alignas(64) uint8_t bbuf[2][8 * 64];
          alignas(64) uint8_t tbuf[16][8 * 64];
          alignas(64) int32_t cbuf[2][16 * 16];
          alignas(64) float facc[16][16][16];  // [m][l][n]
#pragma omp for schedule(static)
          for (int g = 0; g < G; ++g) {
            for (int m = 0; m < M; ++m) for (int l = 0; l < 16; ++l) _mm512_store_ps(facc[m][l], _mm512_setzero_ps());
            for (int b = 0; b < NB; ++b) {
              const uint8_t* wb = w.data() + ((size_t)g * NB + b) * 16 * 256;  // 16 rows x 512 nibbles
              _mm_prefetch((const char*)(wb + 2 * 16 * 256), _MM_HINT_T1);
              if (TR) {  // current layout: row n's unit v = 16 lanes x 4 B, low nibbles chunk 2v, high 2v + 1
                for (int v = 0; v < 4; ++v) {
                  __m512i lo[16], hi[16];
                  for (int n = 0; n < 16; ++n) {
                    const __m512i q = _mm512_loadu_si512(wb + n * 256 + v * 64);
                    lo[n] = _mm512_sub_epi8(_mm512_and_si512(q, _mm512_set1_epi8(15)), _mm512_set1_epi8(8));
                    hi[n] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(15)), _mm512_set1_epi8(8));
                  }
                  transpose16(lo); transpose16(hi);
                  for (int l = 0; l < 16; ++l) {
                    _mm512_store_si512(tbuf[l] + (2 * v) * 64, lo[l]);
                    _mm512_store_si512(tbuf[l] + (2 * v + 1) * 64, hi[l]);
                  }
                }
              }
              for (int l = 0; l < 16; l += 2) {  // groups l, l + 1 share 64-byte units
                if (!TR)
                for (int v = 0; v < 8; ++v) {
                  const __m512i q = _mm512_loadu_si512(wb + (l / 2) * 512 + v * 64);
                  _mm512_store_si512(bbuf[0] + v * 64, _mm512_sub_epi8(_mm512_and_si512(q, _mm512_set1_epi8(15)), _mm512_set1_epi8(8)));
                  _mm512_store_si512(bbuf[1] + v * 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(15)), _mm512_set1_epi8(8)));
                }
                _tile_zero(0); _tile_zero(3);
                _tile_loadd(1, x.data() + b * 512 + 32 * l, K);
                _tile_loadd(2, TR ? tbuf[l] : bbuf[0], 64);
                _tile_loadd(4, x.data() + b * 512 + 32 * (l + 1), K);
                _tile_loadd(5, TR ? tbuf[l + 1] : bbuf[1], 64);
                _tile_dpbusd(0, 1, 2);
                _tile_dpbusd(3, 4, 5);
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(3, cbuf[1], 64);
                if (raw) continue;
                for (int h = 0; h < 2; ++h) {
                  const size_t so = (((size_t)g * NB + b) * 16 + l + h) * 16;
                  const __m512 s = _mm512_loadu_ps(&sv[so]), mn = _mm512_loadu_ps(&mv[so]);
                  const __m512i corr = _mm512_slli_epi32(_mm512_load_si512(cbuf[h] + M * 16), 7);
                  for (int m = 0; m < M; ++m) {
                    __m512i acc = _mm512_sub_epi32(_mm512_load_si512(cbuf[h] + m * 16), corr);
                    acc = _mm512_add_epi32(acc, _mm512_set1_epi32((int32_t)lsx[(m * NB + b) * 16 + l + h] * 8));
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), s);
                    t = _mm512_fmadd_ps(mn, _mm512_set1_ps(lsf[(m * NB + b) * 16 + l + h]), t);
                    _mm512_store_ps(facc[m][l + h], _mm512_fmadd_ps(t, _mm512_set1_ps(sx[m * NB + b]), _mm512_load_ps(facc[m][l + h])));
                  }
                }
              }
            }
            for (int m = 0; m < M; ++m) {  // lanes summed (any order here; the real one is reduce16's)
              __m512 s = _mm512_setzero_ps();
              for (int l = 0; l < 16; ++l) s = _mm512_add_ps(s, _mm512_load_ps(facc[m][l]));
              _mm512_storeu_ps(&y[(size_t)m * N + g * 16], s);
            }
          }
          _tile_release();
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (raw) best_raw = std::min(best_raw, ms); else best = std::min(best, ms);
      }
    }
    printf("%s M=%2d: %.3f ms, tiles alone %.3f ms (%g)\n", TR ? "transposed" : "AMX layout", M, best, best_raw, y[0] + y[N]);
  }
}
