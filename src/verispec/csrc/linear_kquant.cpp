// Q4_K and Q6_K matrices in row-interleaved tiles: 16 weight rows per 512-bit register, the group scales folded in
// integer arithmetic, one float epilogue per 256 weights. linear_gguf.cpp calls this for those kinds.
//
// Why this layout. llama.cpp's K-quants scale each group of 32 (Q4_K) or 16 (Q6_K) weights by a small integer
// (sc, 6 or 8 bits) times one fp16 d per 256 weights ("super-block"). With one weight row's groups across the 16
// lanes (the layout linear_gguf.cpp keeps for the other types), every 8 vpdpbusd of a (row, weight row) pair pay
// ~4 float operations of per-group epilogue: at 8 rows that work, not the integer products, bounds the kernel
// (docs/BENCHMARKS.md, "Native GGUF kernels"). Here the 16 lanes are 16 weight rows (llama.cpp's repacked GEMM
// layouts and oneDNN's do the same), the activation's 4 bytes are broadcast, and a group's integer sum is multiplied
// by its scale in the integer unit:
//   Q4_K: a half group's sum (16 weights: |sum| <= 16 * 15 * 127 < 2^15) times sc with vpdpwssd (the int32 lane's low
//         16 bits times sc, its high 16 bits times 0), summed over the super-block in int32 (<= 256 * 15 * 127 * 63
//         < 2^31): S1 = sum_g sc_g * isum_g, exactly. The min term S2 = sum_g mn_g * xsum_g (xsum_g: the activation's
//         sum over group g, |.| <= 4064) by vpdpwssd on (mn_2p, mn_2p+1) and (xsum_2p, xsum_2p+1), exactly. Per
//         super-block:
//           u = d * float(S1);  u = u - dmin * float(S2) (one fma);  y = fma(u, sx, y)
//   Q6_K: a group's sum of (q - 32) x (the -32 x sum put in first, |.| <= 16 * 32 * 127) converted to float and
//         scaled by d * sc (an exact product), summed over the super-block's 16 groups in float, then y = fma(f, sx, y).
// sx: the activation block's scale (blocks of 512, as linear_gguf.cpp quantizes them). The float operations on an
// output element are these, in this order, on every path (AVX512-VNNI, AVX2, portable) and for any M, thread split
// or tile grouping: bitwise batch-invariant.
//
// Layout (models/gguf_native.py writes it), per tile of 16 weight rows, super-block after super-block:
//   q: "quad" j of a super-block = its weights 4j .. 4j + 3; a 64-byte "packed" p holds, in lane n (bytes 4n .. 4n + 3),
//      quad 2p of row n in the low nibbles and quad 2p + 1 in the high ones: 32 packed = 2048 bytes (the q's low 4
//      bits for Q6_K, then 16 x 64 bytes of its top 2 bits: quad 4u + i's in bits 2i, 2i + 1 of the u-th 64 bytes).
//   s: Q4_K 320 bytes: d[16] (fp16), dmin[16], sc[8 groups][16 rows], then for each pair of groups (2p, 2p + 1)
//      [16 rows][mn_2p, mn_2p+1]; Q6_K 288 bytes: d[16], sc[16 groups][16 rows] (int8).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

namespace verispec {
namespace {

constexpr int64_t NT = 16;   // weight rows per tile
constexpr int64_t SB = 256;  // weights per super-block
constexpr int64_t MG = 8;    // activation rows per pass over a tile
// Weights prefetched this far ahead of the group in use, into L2, a group's lines at a time: from DRAM (two cores
// streaming) Q4_K 17920 x 1536 at M = 1 / 8 / 16 0.72 / 1.03 / 1.80 ms against 0.71 / 1.55 / 2.06 without; 8 KB, 2 KB
// or the super-block's lines in one burst were slower (docs/BENCHMARKS.md, "Kernel design choices").
constexpr int64_t PF_DIST = 4096;

// One tile group's work: NB consecutive tiles (tile_q / tile_s bytes apart), rows m0 .. of the activations.
struct Work {
  const KActs* a;
  const uint8_t* q;
  const uint8_t* s;
  int64_t tile_q, tile_s, nsb;
  float* y;       // [rows][ys]: this group's 16 NB outputs of each row, accumulated over the super-blocks
  int64_t ys;     // y's row stride
  bool pf;        // prefetch the weights ahead (the first pass over the tiles; later ones find them in the caches)
};

// ---- AVX512-VNNI -------------------------------------------------------------------------------------------------

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c")))

VNNI_TARGET inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int MR, int NB>
VNNI_TARGET void q4k_vnni(const Work& w, int64_t m0) {
  const KActs& a = *w.a;
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const int8_t* xr[MR];
    for (int i = 0; i < MR; ++i) xr[i] = a.q.data() + (m0 + i) * a.K + sb * SB;
    const uint8_t* qs[NB];
    const uint8_t* ss[NB];
    for (int t = 0; t < NB; ++t) {
      qs[t] = w.q + t * w.tile_q + sb * 2048;
      ss[t] = w.s + t * w.tile_s + sb * 320;
      _mm_prefetch(reinterpret_cast<const char*>(ss[t] + 320), _MM_HINT_T0);

    }
    __m512i S1[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int t = 0; t < NB; ++t) S1[i][t] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      if (w.pf)  // group g's 256 bytes, PF_DIST ahead: spread over the super-block, not in one burst
        for (int t = 0; t < NB; ++t)
          for (int64_t o = 0; o < 256; o += 64) _mm_prefetch(reinterpret_cast<const char*>(qs[t] + PF_DIST + 256 * g + o), _MM_HINT_T1);
      __m512i sc[NB];
      for (int t = 0; t < NB; ++t) sc[t] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss[t] + 64 + 16 * g)));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i acc[MR][NB];
        for (int i = 0; i < MR; ++i)
          for (int t = 0; t < NB; ++t) acc[i][t] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int pp = 0; pp < 2; ++pp) {
          const int64_t p = 4 * g + 2 * h + pp;
          __m512i w0[NB], w1[NB];
          for (int t = 0; t < NB; ++t) {
            const __m512i v = _mm512_loadu_si512(qs[t] + p * 64);
            w0[t] = _mm512_and_si512(v, lo4);
            w1[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
          }
          for (int i = 0; i < MR; ++i) {
            const __m512i x0 = bcast32(xr[i] + 8 * p), x1 = bcast32(xr[i] + 8 * p + 4);
            for (int t = 0; t < NB; ++t) {
              acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], w0[t], x0);
              acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], w1[t], x1);
            }
          }
        }
        for (int i = 0; i < MR; ++i)
          for (int t = 0; t < NB; ++t) S1[i][t] = _mm512_dpwssd_epi32(S1[i][t], acc[i][t], sc[t]);
      }
    }
    const int64_t b = sb >> 1;
    for (int t = 0; t < NB; ++t) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss[t])));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss[t] + 32)));
      __m512i mn[4];
      for (int p = 0; p < 4; ++p) mn[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss[t] + 192 + 32 * p)));
      for (int i = 0; i < MR; ++i) {
        const int16_t* xs = a.xs32.data() + (m0 + i) * (a.K / 32) + sb * 8;
        __m512i S2 = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) S2 = _mm512_dpwssd_epi32(S2, mn[p], bcast32(xs + 2 * p));
        __m512 u = _mm512_mul_ps(d, _mm512_cvtepi32_ps(S1[i][t]));
        u = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(S2), u);
        float* y = w.y + i * w.ys + t * NT;
        _mm512_storeu_ps(y, _mm512_fmadd_ps(u, _mm512_set1_ps(a.sx[(m0 + i) * a.nb + b]), _mm512_loadu_ps(y)));
      }
    }
  }
}

// A quad (4 weights of each of the 16 rows) of Q6_K as bytes: its low 4 bits from the packed nibbles, its top 2
// from the top-bits register (quad i of that register: bits 2i, 2i + 1)
template <int I>
VNNI_TARGET inline __m512i q6_quad(__m512i nib, __m512i top) {
  const __m512i lo = _mm512_and_si512(I % 2 ? _mm512_srli_epi16(nib, 4) : nib, _mm512_set1_epi8(0x0f));
  const __m512i hi = I == 0 ? _mm512_slli_epi16(top, 4) : I == 1 ? _mm512_slli_epi16(top, 2) : I == 2 ? top : _mm512_srli_epi16(top, 2);
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x30), 0xF8);  // lo | (hi & 0x30)
}

template <int MR, int NB>
VNNI_TARGET void q6k_vnni(const Work& w, int64_t m0) {
  const KActs& a = *w.a;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const int8_t* xr[MR];
    for (int i = 0; i < MR; ++i) xr[i] = a.q.data() + (m0 + i) * a.K + sb * SB;
    const uint8_t* qs[NB];
    const uint8_t* ss[NB];
    __m512 d[NB];
    for (int t = 0; t < NB; ++t) {
      qs[t] = w.q + t * w.tile_q + sb * 3072;
      ss[t] = w.s + t * w.tile_s + sb * 288;
      _mm_prefetch(reinterpret_cast<const char*>(ss[t] + 288), _MM_HINT_T0);

      d[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss[t])));
    }
    __m512 f[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int t = 0; t < NB; ++t) f[i][t] = _mm512_setzero_ps();
    for (int g = 0; g < 16; ++g) {
      if (w.pf)  // 192 of the super-block's 3072 bytes a group, PF_DIST ahead
        for (int t = 0; t < NB; ++t)
          for (int64_t o = 0; o < 192; o += 64) _mm_prefetch(reinterpret_cast<const char*>(qs[t] + PF_DIST + 192 * g + o), _MM_HINT_T1);
      __m512i acc[MR][NB];
      for (int i = 0; i < MR; ++i) {
        const __m512i init = _mm512_set1_epi32(a.xs16[(m0 + i) * (a.K / 16) + sb * 16 + g]);  // -32 x sum
        for (int t = 0; t < NB; ++t) acc[i][t] = init;
      }
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512i wa[NB], wb[NB];
        for (int t = 0; t < NB; ++t) {
          const __m512i nib = _mm512_loadu_si512(qs[t] + (2 * g + half) * 64);
          const __m512i top = _mm512_loadu_si512(qs[t] + 2048 + g * 64);
          wa[t] = half ? q6_quad<2>(nib, top) : q6_quad<0>(nib, top);
          wb[t] = half ? q6_quad<3>(nib, top) : q6_quad<1>(nib, top);
        }
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xr[i] + 16 * g + 8 * half;
          const __m512i x0 = bcast32(x), x1 = bcast32(x + 4);
          for (int t = 0; t < NB; ++t) {
            acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], wa[t], x0);
            acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], wb[t], x1);
          }
        }
      }
      for (int t = 0; t < NB; ++t) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss[t] + 32 + 16 * g)));
        const __m512 scd = _mm512_mul_ps(d[t], _mm512_cvtepi32_ps(sc));
        for (int i = 0; i < MR; ++i) f[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][t]), scd, f[i][t]);
      }
    }
    const int64_t b = sb >> 1;
    for (int i = 0; i < MR; ++i)
      for (int t = 0; t < NB; ++t) {
        float* y = w.y + i * w.ys + t * NT;
        _mm512_storeu_ps(y, _mm512_fmadd_ps(f[i][t], _mm512_set1_ps(a.sx[(m0 + i) * a.nb + b]), _mm512_loadu_ps(y)));
      }
  }
}

using KFn = void (*)(const Work&, int64_t);

template <int MR>
KFn vnni_for(bool q6, int nb) {
  if (q6) return nb == 4 ? q6k_vnni<MR, 4> : nb == 2 ? q6k_vnni<MR, 2> : q6k_vnni<MR, 1>;
  return nb == 4 ? q4k_vnni<MR, 4> : nb == 2 ? q4k_vnni<MR, 2> : q4k_vnni<MR, 1>;
}

KFn vnni_fn(bool q6, int mr, int nb) {
  switch (mr) {
    case 1: return vnni_for<1>(q6, nb);
    case 2: return vnni_for<2>(q6, nb);
    case 3: return vnni_for<3>(q6, nb);
    case 4: return vnni_for<4>(q6, nb);
    case 5: return vnni_for<5>(q6, nb);
    case 6: return vnni_for<6>(q6, nb);
    case 7: return vnni_for<7>(q6, nb);
    default: return vnni_for<8>(q6, nb);
  }
}

// ---- AVX2: the same integers and float operations, 8 rows of the tile per register. vpmaddubsw's pairs (<= 2 x 63 x
// 127) are added in int16 over as many quads as cannot overflow (Q4_K: a half group's 4, |.| <= 8 x 15 x 127; Q6_K: 2,
// <= 4 x 63 x 127), then widened by vpmaddwd: for Q4_K against (sc, sc) pairs, which puts in the group scale too.

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline __m256i bcast32_avx2(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

template <int MR>
AVX2_TARGET void q4k_avx2(const Work& w, int64_t m0) {
  const KActs& a = *w.a;
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* qs = w.q + sb * 2048;
    const uint8_t* ss = w.s + sb * 320;
    const int64_t b = sb >> 1;
    for (int hf = 0; hf < 2; ++hf) {  // rows 8 hf .. 8 hf + 7 of the tile
      __m256i S1[MR];
      for (int i = 0; i < MR; ++i) S1[i] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        if (w.pf && hf == 0)
          for (int64_t o = 0; o < 256; o += 64) _mm_prefetch(reinterpret_cast<const char*>(qs + PF_DIST + 256 * g + o), _MM_HINT_T1);
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ss + 64 + 16 * g + 8 * hf)));
        const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));  // (sc, sc): the row's two int16 pairs
        for (int h = 0; h < 2; ++h) {
          __m256i p16[MR];
          for (int pp = 0; pp < 2; ++pp) {
            const int64_t p = 4 * g + 2 * h + pp;
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 64 + 32 * hf));
            const __m256i w0 = _mm256_and_si256(v, lo4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            for (int i = 0; i < MR; ++i) {
              const int8_t* x = a.q.data() + (m0 + i) * a.K + sb * SB + 8 * p;
              const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast32_avx2(x)), _mm256_maddubs_epi16(w1, bcast32_avx2(x + 4)));
              p16[i] = pp ? _mm256_add_epi16(p16[i], d) : d;
            }
          }
          for (int i = 0; i < MR; ++i) S1[i] = _mm256_add_epi32(S1[i], _mm256_madd_epi16(p16[i], sc2));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss + 16 * hf)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss + 32 + 16 * hf)));
      for (int i = 0; i < MR; ++i) {
        const int16_t* xs = a.xs32.data() + (m0 + i) * (a.K / 32) + sb * 8;
        __m256i S2 = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss + 192 + 32 * p + 16 * hf)));
          int32_t v;
          std::memcpy(&v, xs + 2 * p, 4);
          S2 = _mm256_add_epi32(S2, _mm256_madd_epi16(mn, _mm256_set1_epi32(v)));
        }
        __m256 u = _mm256_mul_ps(d, _mm256_cvtepi32_ps(S1[i]));
        u = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(S2), u);
        float* y = w.y + i * w.ys + 8 * hf;
        _mm256_storeu_ps(y, _mm256_fmadd_ps(u, _mm256_set1_ps(a.sx[(m0 + i) * a.nb + b]), _mm256_loadu_ps(y)));
      }
    }
  }
}

template <int MR>
AVX2_TARGET void q6k_avx2(const Work& w, int64_t m0) {
  const KActs& a = *w.a;
  const __m256i lo4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* qs = w.q + sb * 3072;
    const uint8_t* ss = w.s + sb * 288;
    const int64_t b = sb >> 1;
    for (int hf = 0; hf < 2; ++hf) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ss + 16 * hf)));
      __m256 f[MR];
      for (int i = 0; i < MR; ++i) f[i] = _mm256_setzero_ps();
      for (int g = 0; g < 16; ++g) {
        if (w.pf && hf == 0)
          for (int64_t o = 0; o < 192; o += 64) _mm_prefetch(reinterpret_cast<const char*>(qs + PF_DIST + 192 * g + o), _MM_HINT_T1);
        __m256i acc[MR];
        for (int i = 0; i < MR; ++i) acc[i] = _mm256_set1_epi32(a.xs16[(m0 + i) * (a.K / 16) + sb * 16 + g]);
        const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 2048 + g * 64 + 32 * hf));
        for (int half = 0; half < 2; ++half) {  // quads 2 half, 2 half + 1: one packed register
          const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (2 * g + half) * 64 + 32 * hf));
          const __m256i ta = half ? top : _mm256_slli_epi16(top, 4), tb = half ? _mm256_srli_epi16(top, 2) : _mm256_slli_epi16(top, 2);
          const __m256i wa = _mm256_or_si256(_mm256_and_si256(nib, lo4), _mm256_and_si256(ta, top2));
          const __m256i wb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), lo4), _mm256_and_si256(tb, top2));
          for (int i = 0; i < MR; ++i) {
            const int8_t* x = a.q.data() + (m0 + i) * a.K + sb * SB + 16 * g + 8 * half;
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(wa, bcast32_avx2(x)), _mm256_maddubs_epi16(wb, bcast32_avx2(x + 4)));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p16, ones));
          }
        }
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ss + 32 + 16 * g + 8 * hf)));
        const __m256 scd = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        for (int i = 0; i < MR; ++i) f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), scd, f[i]);
      }
      for (int i = 0; i < MR; ++i) {
        float* y = w.y + i * w.ys + 8 * hf;
        _mm256_storeu_ps(y, _mm256_fmadd_ps(f[i], _mm256_set1_ps(a.sx[(m0 + i) * a.nb + b]), _mm256_loadu_ps(y)));
      }
    }
  }
}

KFn avx2_fn(bool q6, int mr) {
  switch (mr) {
    case 1: return q6 ? q6k_avx2<1> : q4k_avx2<1>;
    case 2: return q6 ? q6k_avx2<2> : q4k_avx2<2>;
    case 3: return q6 ? q6k_avx2<3> : q4k_avx2<3>;
    default: return q6 ? q6k_avx2<4> : q4k_avx2<4>;
  }
}

// ---- portable: one output at a time, the same integers and the same float operations (std::fma where the vector
// paths fuse) ------------------------------------------------------------------------------------------------------

int32_t q_at(bool q6, const uint8_t* qs, int64_t n, int64_t k) {  // q of row n, weight k of a super-block
  const int64_t j = k / 4, e = k % 4;
  const int32_t lo = (qs[(j / 2) * 64 + 4 * n + e] >> (4 * (j % 2))) & 0x0f;
  if (!q6) return lo;
  return lo | (((qs[2048 + (j / 4) * 64 + 4 * n + e] >> (2 * (j % 4))) & 3) << 4);
}

void kquant_portable(bool q6, const Work& w, int64_t m0, int64_t mr) {
  const KActs& a = *w.a;
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t n = 0; n < NT; ++n) {
      float y = w.y[i * w.ys + n];
      for (int64_t sb = 0; sb < w.nsb; ++sb) {
        const int8_t* x = a.q.data() + (m0 + i) * a.K + sb * SB;
        const float sx = a.sx[(m0 + i) * a.nb + (sb >> 1)];
        if (!q6) {
          const uint8_t* qs = w.q + sb * 2048;
          const uint8_t* ss = w.s + sb * 320;
          int32_t S1 = 0, S2 = 0;
          for (int64_t g = 0; g < 8; ++g) {
            for (int64_t h = 0; h < 2; ++h) {
              int32_t acc = 0;
              for (int64_t k = 32 * g + 16 * h; k < 32 * g + 16 * h + 16; ++k) acc += q_at(false, qs, n, k) * x[k];
              S1 += acc * ss[64 + 16 * g + n];
            }
            S2 += ss[192 + 32 * (g / 2) + 2 * n + g % 2] * a.xs32[(m0 + i) * (a.K / 32) + sb * 8 + g];
          }
          float u = half(ss + 2 * n) * static_cast<float>(S1);
          u = std::fma(-half(ss + 32 + 2 * n), static_cast<float>(S2), u);
          y = std::fma(u, sx, y);
        } else {
          const uint8_t* qs = w.q + sb * 3072;
          const uint8_t* ss = w.s + sb * 288;
          const float d = half(ss + 2 * n);
          float f = 0.0f;
          for (int64_t g = 0; g < 16; ++g) {
            int32_t acc = a.xs16[(m0 + i) * (a.K / 16) + sb * 16 + g];
            for (int64_t k = 16 * g; k < 16 * g + 16; ++k) acc += q_at(true, qs, n, k) * x[k];
            const float scd = d * static_cast<float>(static_cast<int8_t>(ss[32 + 16 * g + n]));
            f = std::fma(static_cast<float>(acc), scd, f);
          }
          y = std::fma(f, sx, y);
        }
      }
      w.y[i * w.ys + n] = y;
    }
}

// The activations in natural order: the same rounding as linear_gguf.cpp's (blocks of 512, then 256; max |x| -> 127,
// nearest-even), plus the group sums the two kinds need.
template <typename T>
void quantize_natural(const T* x, int64_t M, int64_t K, KActs& a) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0, b = 0; k0 < K; ++b) {
      const int64_t B = K - k0 >= 512 ? 512 : 256;
      const T* xb = x + m * K + k0;
      float amax = 0.0f;
      for (int64_t k = 0; k < B; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xb[k])));
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
      int8_t* q = a.q.data() + m * K + k0;
      for (int64_t k = 0; k < B; ++k)
        q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(static_cast<float>(xb[k]) * inv))));
      a.sx[m * a.nb + b] = s;
      k0 += B;
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0, prev = 0; g < K / 16; ++g) {
      int32_t s16 = 0;
      for (int64_t k = 0; k < 16; ++k) s16 += a.q[m * K + 16 * g + k];
      a.xs16[m * (K / 16) + g] = -32 * s16;  // Q6_K's -32 x sum over the group of 16
      if (g % 2) a.xs32[m * (K / 32) + g / 2] = static_cast<int16_t>(prev + s16);  // Q4_K's sum over 32, |.| <= 4064
      prev = s16;
    }
}

// quantize_natural with AVX512: the same float operations on each value (max is exact in any order; the rounding is
// round-to-nearest-even as nearbyint's), so the same bytes, scales and sums
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_natural_avx512(const T* x, int64_t M, int64_t K, KActs& a) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0, b = 0; k0 < K; ++b) {
      const int64_t B = K - k0 >= 512 ? 512 : 256;
      const T* xb = x + m * K + k0;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < B; k += 16) mx = _mm512_max_ps(_mm512_abs_ps(load16(xb + k, 0xffff)), mx);
      const float amax = _mm512_reduce_max_ps(mx);
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
      const __m512 vinv = _mm512_set1_ps(inv);
      int8_t* q = a.q.data() + m * K + k0;
      int32_t* xs16 = a.xs16.data() + m * (K / 16) + k0 / 16;
      int16_t* xs32 = a.xs32.data() + m * (K / 32) + k0 / 32;
      for (int64_t k = 0; k < B; k += 32) {
        __m512i v[2];
        for (int h = 0; h < 2; ++h) {
          const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(xb + k + 16 * h, 0xffff), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k + 16 * h), _mm512_cvtepi32_epi8(v[h]));
        }
        const int32_t s0 = _mm512_reduce_add_epi32(v[0]), s1 = _mm512_reduce_add_epi32(v[1]);
        xs16[k / 16] = -32 * s0;
        xs16[k / 16 + 1] = -32 * s1;
        xs32[k / 32] = static_cast<int16_t>(s0 + s1);
      }
      a.sx[m * a.nb + b] = s;
      k0 += B;
    }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_natural_f32(const float* x, int64_t M, int64_t K, KActs& a) { quantize_natural(x, M, K, a); }
__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_natural_bf16(const at::BFloat16* x, int64_t M, int64_t K, KActs& a) { quantize_natural(x, M, K, a); }

}  // namespace

bool kquant_tiled(int64_t kind) { return kind == 3 || kind == 5; }  // Q4_K, Q6_K (linear_gguf.cpp's kinds)
int64_t kquant_tile_q(int64_t kind, int64_t K) { return K / SB * (kind == 5 ? 3072 : 2048); }
int64_t kquant_tile_s(int64_t kind, int64_t K) { return K / SB * (kind == 5 ? 288 : 320); }

KActs kquant_acts(const torch::Tensor& x2) {
  KActs a;
  a.M = x2.size(0);
  a.K = x2.size(1);
  a.nb = (a.K + 511) / 512;
  a.q.resize(a.M * a.K);
  a.sx.resize(a.M * a.nb);
  a.xs16.resize(a.M * (a.K / 16));
  a.xs32.resize(a.M * (a.K / 32));
  const bool fp32 = x2.scalar_type() == at::kFloat;
  if (has_vnni())
    fp32 ? quantize_natural_avx512(x2.data_ptr<float>(), a.M, a.K, a) : quantize_natural_avx512(x2.data_ptr<at::BFloat16>(), a.M, a.K, a);
  else
    fp32 ? quantize_natural_f32(x2.data_ptr<float>(), a.M, a.K, a) : quantize_natural_bf16(x2.data_ptr<at::BFloat16>(), a.M, a.K, a);
  return a;
}

// Tiles t0 .. t1 - 1 of one segment (16 rows each, q / s of tile t0 given), rows m_lo .. m_hi - 1 -> out columns
// n0 + 16 t0 .., rows of the segment past `rows` dropped. y: scratch of (m_hi - m_lo) x 64 floats.
void kquant_tiles(int64_t kind, const KActs& a, const uint8_t* q, const uint8_t* s, int64_t t0, int64_t t1,
                  int64_t rows, int64_t n0, int64_t m_lo, int64_t m_hi, const Output& out, const float* bias, float* y) {
  const bool q6 = kind == 5, vec = has_vnni(), avx2 = has_avx2();
  const int64_t tq = kquant_tile_q(kind, a.K), ts = kquant_tile_s(kind, a.K), ys = 4 * NT;
  for (int64_t t = t0; t < t1; t += 4) {
    const int64_t nt = std::min<int64_t>(4, t1 - t);
    std::fill(y, y + (m_hi - m_lo) * ys, 0.0f);
    for (int64_t m = m_lo; m < m_hi; m += MG) {
      const int64_t rg = std::min(MG, m_hi - m);
      for (int64_t j = 0; j < nt;) {
        Work w{&a, q + (t - t0 + j) * tq, s + (t - t0 + j) * ts, tq, ts, a.K / SB, y + (m - m_lo) * ys + j * NT, ys, m == m_lo};
        if (vec) {  // as many tiles at once as the registers hold: rows x tiles <= 8, Q6_K <= 12 (from DRAM, 5 / 6 rows
                    // over 2 tiles: Q6_K 0.85x / 0.85x the time over 1, Q4_K 1.02x / 1.08x)
          const int64_t want = rg <= 2 ? 4 : rg <= (q6 ? 6 : 4) ? 2 : 1;
          const int nb = static_cast<int>(nt - j >= want ? want : nt - j >= 2 && want >= 2 ? 2 : 1);
          vnni_fn(q6, static_cast<int>(rg), nb)(w, m);
          j += nb;
        } else {
          for (int64_t i = 0; i < rg; i += 4) {
            Work wi = w;
            wi.y = w.y + i * ys;
            if (avx2)
              avx2_fn(q6, static_cast<int>(std::min<int64_t>(4, rg - i)))(wi, m + i);
            else
              kquant_portable(q6, wi, m + i, std::min<int64_t>(4, rg - i));
          }
          j += 1;
        }
      }
    }
    for (int64_t m = m_lo; m < m_hi; ++m)
      for (int64_t c = 0; c < nt * NT; c += 4) {
        const int64_t r = t * NT + c;  // row of the segment
        const float* v = y + (m - m_lo) * ys + c;
        if (r + 4 <= rows)
          out.set4(m, n0 + r, _mm_loadu_ps(v), bias);
        else
          for (int64_t e = 0; e < 4 && r + e < rows; ++e) out.set(m, n0 + r + e, v[e] + (bias ? bias[n0 + r + e] : 0.0f));
      }
  }
}

}  // namespace verispec
