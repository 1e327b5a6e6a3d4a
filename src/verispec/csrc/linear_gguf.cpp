// GGUF-quantized matrices used as they are: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in llama.cpp's
// Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K blocks, for any M (decode: 1 row, verify: k + 1 rows, prefill: many).
// Q4_K and Q6_K segments (the default target's) run in linear_kquant.cpp's tiles of 16 weight rows with their group
// scales applied in integers; this file runs the other types, and is the entry point for all.
//
// Every one of those formats is "an unsigned integer q per weight, and per group of 16 or 32 weights a scale
// s and a min m": w = s * q + m. models/gguf_native.py re-lays a tensor's blocks out for this kernel once, at
// load time, without changing a single value (s and m are computed here from the file's own fp16 / 6-bit /
// 8-bit fields, exactly as llama.cpp's dequantization does):
//   type  q bits (stored as)  group  s              m                    scale bytes per row
//   Q8_0  8 (byte, q + 128)   32     d              -128 s               d (fp16) per group
//   Q4_0  4 (nibble)          32     d              -8 s                 d per group
//   Q5_0  5 (byte)            32     d              -16 s                d per group
//   Q5_K  5 (byte)            32     d * sc (6-bit) -dmin * mn (6-bit)   per 256: d, dmin, sc[8], mn[8]
// (Q4_K and Q6_K: linear_kquant.cpp.)
//
// Layout. K is cut into blocks of 512 k (then one of 256 and one of 128 for what is left). In a block of
// B, the 16 int32 lanes of a 512-bit register each own B/16 consecutive k: chunk c (64 bytes) holds, in
// lane l, k = (B/16) l + 4c .. 4c + 3. VNNI's dpbusd, accumulated over the block's B/64 chunks, leaves in
// each lane the dot product of one group of 32 (or a part of one): the scales are applied once per block,
// one multiply per 16 lanes, not once per 4 products.
// Activations get the same k order.
//   q: per tile of NR rows, block after block: [NR][B or B/2] bytes (nibbles: low = chunk 2v, high = 2v + 1);
//   s: per tile [NR][the row's scale bytes, in k order, as in the table].
// A matrix may be several such segments stacked along N (fused q/k/v and gate/up projections whose parts
// came in different types): one call computes them all. meta rows: kind, rows, tiles, q offset, s offset, K.
//
// Activations: each row cut into the same blocks, each block quantized to int8 with its own scale (max |x|
// -> 127, round to nearest), as llama.cpp does with its Q8_K / Q8_0 activations. Per block and (row, weight
// row): 16 exact int32 lane sums -> float, times the lane scales, plus the min terms, times the activation
// block's scale, accumulated in fp32 lanes; a fixed tree sums the 16 lanes at the end. The order of every
// operation on an output element is fixed: it does not depend on M, on the other rows in the call, on the
// thread split, or on the instruction set (the AVX512, AVX2 and portable paths agree bitwise).
// Error against float64 on the dequantized weights: activation rounding, at most sum_b (sx_b / 2) sum |w_k|
// over k in block b (sx_b = max |x| / 127 of the block), plus fp32 accumulation (tests/models/test_gguf_native.py).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace verispec {
namespace {

constexpr int64_t NR = 4;    // weight rows per tile
constexpr int64_t MT = 4;    // activation rows per register tile (4 rows x 4 weight rows, 5 x 4, 3 x 2, 2 x 4 or 1 x 4)
constexpr int64_t LANES = 16;
constexpr int64_t META = 6;  // meta columns
constexpr int64_t PF_TILES = 2;  // software prefetch distance, in tiles

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ5_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kKinds = 6 };

struct Format {
  bool nibbles;  // q in 4 bits: chunks 2v and 2v + 1 in the low and high nibbles of one 64-byte chunk
  int shift;     // log2 c for the symmetric types, -1: per-group mins (Q5_K)
};
// Q4_K and Q6_K run in linear_kquant.cpp: their rows here are not used
constexpr Format kFormats[kKinds] = {{false, 7}, {true, 3}, {false, 4}, {true, -1}, {false, -1}, {false, 5}};

inline bool k_quant(int64_t kind) { return kind == kQ4_K || kind == kQ5_K || kind == kQ6_K; }
// q bytes of one weight row's block of B
constexpr int64_t q_bytes(int64_t kind, int64_t B) { return kFormats[kind].nibbles ? B / 2 : B; }
inline int64_t row_scale_bytes(int64_t kind, int64_t K) {  // per row, in k order
  switch (kind) {
    case kQ5_K: return K / 256 * 20;
    default: return K / 32 * 2;
  }
}

// The blocks of a row: 512s, then 256 and 128 for the rest.
struct Blocks {
  int64_t n512 = 0, tail256 = 0, tail128 = 0, count = 0;
  std::vector<int64_t> k0, size;
  explicit Blocks(int64_t K) {
    n512 = K / 512;
    tail256 = (K % 512) / 256;
    tail128 = (K % 256) / 128;
    for (int64_t k = 0; k < K;) {
      const int64_t b = K - k >= 512 ? 512 : (K - k >= 256 ? 256 : 128);
      k0.push_back(k);
      size.push_back(b);
      k += b;
    }
    count = static_cast<int64_t>(k0.size());
  }
};

// The activations of one call: rows cut into blocks, each quantized with its own scale, in lane order.
struct Acts {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;     // [M][K], block after block, in lane order
  std::vector<float> sx;     // [M][nb]
  std::vector<int32_t> ls;   // [M][nb][16]: each lane's sum of q over the block
  std::vector<float> lsf;    // [M][nb][16]: the block sums as float
};

template <typename T>
__attribute__((always_inline)) inline void quantize_block(const T* x, int64_t B, int8_t* q, float* sx, int32_t* ls) {
  float amax = 0.0f;
  for (int64_t k = 0; k < B; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
  const int64_t per = B / LANES;  // k per lane
  for (int64_t l = 0; l < LANES; ++l) {
    int32_t sum = 0;
    for (int64_t i = 0; i < per; ++i) {
      const float v = std::nearbyint(static_cast<float>(x[l * per + i]) * inv);
      const int8_t qi = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
      q[(i / 4) * 64 + l * 4 + (i % 4)] = qi;  // chunk i / 4, lane l, byte i % 4
      sum += qi;
    }
    ls[l] = sum;
  }
  *sx = s;
}

template <typename T>
__attribute__((always_inline)) inline void quantize_all(const T* x, const Blocks& bl, Acts& a) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t i = m * a.nb + b, k0 = bl.k0[b];
      quantize_block(x + m * a.K + k0, bl.size[b], a.q.data() + m * a.K + k0, a.sx.data() + i,
                     a.ls.data() + i * LANES);
    }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_f32(const float* x, const Blocks& bl, Acts& a) { quantize_all(x, bl, a); }
__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_bf16(const at::BFloat16* x, const Blocks& bl, Acts& a) { quantize_all(x, bl, a); }

// quantize_block with AVX512: the same float operations on each value (max is exact in any order; the
// rounding is round-to-nearest-even as nearbyint's), so the same bytes, scales and sums
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_avx512(const T* x, const Blocks& bl, Acts& a) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = 0; b < a.nb; ++b) {
      const int64_t i = m * a.nb + b, k0 = bl.k0[b], B = bl.size[b], per = B / LANES;
      const T* xb = x + m * a.K + k0;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < B; k += 16) mx = _mm512_max_ps(_mm512_abs_ps(load16(xb + k, 0xffff)), mx);
      const float amax = _mm512_reduce_max_ps(mx);
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
      const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      int8_t* q = a.q.data() + m * a.K + k0;
      int32_t* ls = a.ls.data() + i * LANES;
      const __mmask16 k16 = per >= 16 ? 0xffff : 0x00ff;
      for (int64_t l = 0; l < LANES; ++l) {
        int32_t part[2] = {0, 0};
        for (int64_t i0 = 0; i0 < per; i0 += 16) {  // the lane's values i0 .. i0 + 15 (or 7): chunks i0 / 4 ..
          __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16(xb + l * per + i0, k16), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
          const __m512i vi = _mm512_maskz_cvtps_epi32(k16, v);
          part[i0 / 16] = _mm512_reduce_add_epi32(vi);
          alignas(16) int32_t w[4];
          _mm_store_si128(reinterpret_cast<__m128i*>(w), _mm512_cvtepi32_epi8(vi));
          for (int64_t c = 0; c < (per >= 16 ? 4 : 2); ++c) std::memcpy(q + (i0 / 4 + c) * 64 + l * 4, w + c, 4);
        }
        ls[l] = part[0] + part[1];
      }
      a.sx[i] = s;
    }
}

Acts quantize_acts(const torch::Tensor& x2, const Blocks& bl) {
  Acts a;
  a.M = x2.size(0);
  a.K = x2.size(1);
  a.nb = bl.count;
  a.q.resize(a.M * a.K);
  a.sx.resize(a.M * a.nb);
  a.ls.resize(a.M * a.nb * LANES);
  const bool fp32 = x2.scalar_type() == at::kFloat;
  if (has_vnni())
    fp32 ? quantize_avx512(x2.data_ptr<float>(), bl, a) : quantize_avx512(x2.data_ptr<at::BFloat16>(), bl, a);
  else
    fp32 ? quantize_f32(x2.data_ptr<float>(), bl, a) : quantize_bf16(x2.data_ptr<at::BFloat16>(), bl, a);
  a.lsf.resize(a.M * a.nb * LANES);
  for (int64_t i = 0; i < a.M * a.nb; ++i)
    for (int64_t l = 0; l < LANES; ++l) a.lsf[i * LANES + l] = static_cast<float>(a.ls[i * LANES + l]);
  return a;
}

// The 16 lane scales (sv) and mins (mv) of one weight row's block of B at k0, from the row's scale bytes s. Exact:
// fp16 times an integer of at most 8 bits fits a float's 24-bit significand.
inline void lane_scales(int64_t kind, int64_t B, int64_t k0, const uint8_t* s, float* sv, float* mv) {
  switch (kind) {
    case kQ5_K:
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t g = k0 / 32 + l * (B / 16) / 32;  // the lane's group of 32
        const uint8_t* r = s + (g / 8) * 20;
        sv[l] = half(r) * static_cast<float>(r[4 + g % 8]);
        mv[l] = -(half(r + 2) * static_cast<float>(r[12 + g % 8]));
      }
      break;
    default:
      for (int64_t l = 0; l < LANES; ++l) sv[l] = half(s + 2 * (k0 / 32 + l * (B / 16) / 32));
  }
}

__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// lane_scales with AVX512: the same exact products, 16 lanes at a time, into registers
template <int KIND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
__attribute__((always_inline)) inline void lane_scales_zmm(int64_t B, int64_t k0, const uint8_t* s, __m512& sv, __m512& mv) {
  if constexpr (KIND == kQ5_K) {
    const uint8_t* r = s + (k0 / 256) * 20;
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 4));  // sc[8], mn[8]
    __m128i sc, mn;
    __m512 d, dmin;
    if (B == 512) {  // lane l: record l / 8, group l % 8
      const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 24));
      sc = _mm_unpacklo_epi64(v0, v1);
      mn = _mm_unpackhi_epi64(v0, v1);
      int32_t h0, h1;  // (d, dmin) of the block's two records, converted together
      std::memcpy(&h0, r, 4);
      std::memcpy(&h1, r + 20, 4);
      const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1)));
      d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), f);
      dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), f);
    } else {  // lane l: group l / 2
      sc = _mm_shuffle_epi8(v0, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
      mn = _mm_shuffle_epi8(v0, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
      d = _mm512_set1_ps(half_f16c(r));
      dmin = _mm512_set1_ps(half_f16c(r + 2));
    }
    sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    mv = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
  } else {
    const uint8_t* r = s + (k0 / 32) * 2;
    if (B == 512) {  // lane l: group l
      sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
    } else if (B == 256) {  // lane l: group l / 2
      const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r))));
      sv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), d8);
    } else {  // lane l: group l / 4
      const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r))));
      sv = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), d4);
    }
    mv = sv;  // unused
  }
}

// Every lane scale and min of one tile: [nb][NR][16] each. rsb: scale bytes per weight row.
template <int KIND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
static void tile_scales_avx512(const Blocks& bl, const uint8_t* st, int64_t rsb, float* sv, float* mv) {
  for (int64_t b = 0; b < bl.count; ++b)
    for (int64_t j = 0; j < NR; ++j) {
      __m512 s, m;
      lane_scales_zmm<KIND>(bl.size[b], bl.k0[b], st + j * rsb, s, m);
      _mm512_storeu_ps(sv + (b * NR + j) * LANES, s);
      _mm512_storeu_ps(mv + (b * NR + j) * LANES, m);
    }
}

using ScalesFn = void (*)(const Blocks&, const uint8_t*, int64_t, float*, float*);
ScalesFn scales_for(int64_t kind) {
  switch (kind) {
    case kQ5_K: return tile_scales_avx512<kQ5_K>;
    default: return tile_scales_avx512<kQ8_0>;
  }
}

// lane_scales with AVX2, eight lanes at a time: the same exact products (and the same -(dmin * mn))
template <int KIND>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void lane_scales_avx2(int64_t B, int64_t k0, const uint8_t* s, float* sv, float* mv) {
  for (int hf = 0; hf < 2; ++hf) {  // lanes 8 hf .. 8 hf + 7
    if constexpr (KIND == kQ5_K) {
      const uint8_t* r = s + (k0 / 256) * 20;
      __m128i sc, mn;
      const uint8_t* rd = r;
      if (B == 512) {  // lane l: record l / 8, group l % 8
        rd = r + 20 * hf;
        sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rd + 4));
        mn = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rd + 12));
      } else {  // lane l: group l / 2
        const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
        int32_t s4, m4;
        std::memcpy(&s4, r + 4 + 4 * hf, 4);
        std::memcpy(&m4, r + 12 + 4 * hf, 4);
        sc = _mm_shuffle_epi8(_mm_cvtsi32_si128(s4), dup);
        mn = _mm_shuffle_epi8(_mm_cvtsi32_si128(m4), dup);
      }
      const __m256 d = _mm256_set1_ps(half_f16c(rd)), dmin = _mm256_set1_ps(half_f16c(rd + 2));
      _mm256_storeu_ps(sv + 8 * hf, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
      _mm256_storeu_ps(mv + 8 * hf, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)))));
    } else {
      const uint8_t* r = s + (k0 / 32) * 2;
      __m256 v;
      if (B == 512) {  // lane l: group l
        v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * hf)));
      } else if (B == 256) {  // lane l: group l / 2
        const __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 8 * hf))));
        v = _mm256_permutevar8x32_ps(d4, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      } else {  // lane l: group l / 4
        int32_t h2;
        std::memcpy(&h2, r + 4 * hf, 4);
        const __m256 d2 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(h2)));
        v = _mm256_permutevar8x32_ps(d2, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
      }
      _mm256_storeu_ps(sv + 8 * hf, v);
    }
  }
}

// sum of the 16 lanes, in the one order both paths use
inline float reduce16(const float* p) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = p[l] + p[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Where things are for one tile: its q bytes, its lane scales [nb][NR][16] and mins, the activations.
struct TileArgs {
  const Acts* a;
  const Blocks* bl;
  const uint8_t* q;    // the tile's q bytes
  const int64_t* qo;   // [nb] offset of block b in the tile's q
  const float* sv;
  const float* mv;
  const uint8_t* pf;   // a later tile's q (prefetched while this one is computed), or null
  const uint8_t* st;   // the tile's scale bytes, rsb per weight row (for lane scales made as they are used)
  int64_t rsb;
};

// reduce16 of four registers at once -> [4]: the same additions in the same order for each (float addition
// commutes bitwise), done on the four side by side: 14 instructions instead of 4 x 8 one register at a time
__attribute__((target("avx512f,avx512dq,sse3"), always_inline))
inline __m128 reduce16x4_avx512(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  // s8[l] = p[l] + p[l + 8]: [v0.s8, v1.s8] and [v2.s8, v3.s8]
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xee));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xee));
  // s4[l] = s8[l] + s8[l + 4]: 128-bit lane r holds v_r's s4
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  // (s4[0] + s4[2]) + (s4[1] + s4[3]) in element 0 of each 128-bit lane
  const __m512 t = _mm512_add_ps(s4, _mm512_shuffle_ps(s4, s4, 0xee));
  const __m512 r = _mm512_add_ps(t, _mm512_movehdup_ps(t));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), r));
}

// One (row, weight row) pair's block result, from its exact int32 lane sums, into its fp32 lanes facc
template <int SHIFT>
__attribute__((target("avx512f"), always_inline))
inline void epilogue(const Acts& a, int64_t r, __m512i acc, __m512 scale, __m512 mv, __m512& facc) {
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), scale);
  if constexpr (SHIFT < 0) v = _mm512_fmadd_ps(mv, _mm512_loadu_ps(a.lsf.data() + r * LANES), v);
  facc = _mm512_fmadd_ps(v, _mm512_set1_ps(a.sx[r]), facc);
}

// One block of BK for MR activation rows x NRS weight rows (rows j0 .. of the tile), into facc.
// INL: the lane scales made here from the scale bytes, as used (one pass over the tile: M <= 5), not read
// back from the tile's [nb][NR][16] arrays; the same values either way.
template <int MR, int NRS, int KIND, int BK, bool INL>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c"), always_inline))
inline void block_vnni(const TileArgs& t, int64_t m0, int64_t j0, int64_t b, __m512 (&facc)[MR][NRS]) {
  constexpr bool NIB = kFormats[KIND].nibbles;
  constexpr int SHIFT = kFormats[KIND].shift;
  constexpr int64_t CH = BK / 64, QB = q_bytes(KIND, BK);
  const Acts& a = *t.a;
  const uint8_t* qb = t.q + t.qo[b] + j0 * QB;
  if (t.pf)
    for (int64_t p = 0; p < NR * QB; p += 64) _mm_prefetch(reinterpret_cast<const char*>(t.pf + t.qo[b] + p), _MM_HINT_T1);
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const int8_t* xb = a.q.data() + m0 * a.K + t.bl->k0[b];
  // one row: a second set of integer accumulators for odd chunks hides dpbusd's latency (exact: same sums)
  constexpr int U = (MR == 1 && !NIB) ? 2 : 1;
  __m512 keep[NRS];  // INL: each weight row's mins
  {
    __m512i acc[MR][NRS], acc2[MR][NRS];
    for (int i = 0; i < MR; ++i) {
      const int32_t* ls = a.ls.data() + ((m0 + i) * a.nb + b) * LANES;
      __m512i init = _mm512_setzero_si512();
      if constexpr (SHIFT >= 0)  // symmetric: start from -c * (the lane's activation sum)
        init = _mm512_sub_epi32(init, _mm512_slli_epi32(_mm512_loadu_si512(ls), SHIFT));
      for (int j = 0; j < NRS; ++j) {
        acc[i][j] = init;
        acc2[i][j] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < CH; c += (NIB ? 2 : U)) {
      if constexpr (U == 2) {
        for (int j = 0; j < NRS; ++j) {
          acc[0][j] = _mm512_dpbusd_epi32(acc[0][j], _mm512_loadu_si512(qb + j * QB + c * 64), _mm512_loadu_si512(xb + c * 64));
          acc2[0][j] = _mm512_dpbusd_epi32(acc2[0][j], _mm512_loadu_si512(qb + j * QB + c * 64 + 64), _mm512_loadu_si512(xb + c * 64 + 64));
        }
        continue;
      }
      __m512i w0[NRS], w1[NRS];
      for (int j = 0; j < NRS; ++j) {
        if constexpr (NIB) {
          const __m512i v = _mm512_loadu_si512(qb + j * QB + c * 32);
          w0[j] = _mm512_and_si512(v, lo4);
          w1[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        } else {
          w0[j] = _mm512_loadu_si512(qb + j * QB + c * 64);
        }
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xr = xb + i * a.K + c * 64;
        const __m512i x0 = _mm512_loadu_si512(xr);
        for (int j = 0; j < NRS; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w0[j], x0);
        if constexpr (NIB) {
          const __m512i x1 = _mm512_loadu_si512(xr + 64);
          for (int j = 0; j < NRS; ++j) (MR == 1 ? acc2 : acc)[i][j] = _mm512_dpbusd_epi32((MR == 1 ? acc2 : acc)[i][j], w1[j], x1);
        }
      }
    }
    if constexpr (U == 2 || (MR == 1 && NIB))
      for (int j = 0; j < NRS; ++j) acc[0][j] = _mm512_add_epi32(acc[0][j], acc2[0][j]);
    if constexpr (INL) {  // one pass: each weight row's scales made once, for its MR rows
      for (int j = 0; j < NRS; ++j) {
        __m512 sv;
        lane_scales_zmm<KIND>(BK, t.bl->k0[b], t.st + (j0 + j) * t.rsb, sv, keep[j]);
        for (int i = 0; i < MR; ++i) epilogue<SHIFT>(a, (m0 + i) * a.nb + b, acc[i][j], sv, keep[j], facc[i][j]);
      }
    } else {
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NRS; ++j) {
          const int64_t sj = (b * NR + j0 + j) * LANES;
          epilogue<SHIFT>(a, (m0 + i) * a.nb + b, acc[i][j], _mm512_loadu_ps(t.sv + sj), _mm512_loadu_ps(t.mv + sj), facc[i][j]);
        }
    }
  }
}

// MR activation rows x NRS weight rows (rows j0 .. j0 + NRS - 1 of the tile) over every block -> out[MR][NR]
// (columns j0 ..). The operations on one (row, weight row) pair are the same whatever MR, NRS and j0 are.
template <int MR, int NRS, int KIND, bool INL = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,sse3,f16c")))
static void rows_vnni(const TileArgs& t, int64_t m0, int64_t j0, float* out) {
  __m512 facc[MR][NRS];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRS; ++j) facc[i][j] = _mm512_setzero_ps();
  const Blocks& bl = *t.bl;
  int64_t b = 0;
  for (; b < bl.n512; ++b) block_vnni<MR, NRS, KIND, 512, INL>(t, m0, j0, b, facc);
  if (bl.tail256) block_vnni<MR, NRS, KIND, 256, INL>(t, m0, j0, b++, facc);
  if constexpr (KIND != kQ5_K)
    if (bl.tail128) block_vnni<MR, NRS, KIND, 128, INL>(t, m0, j0, b++, facc);
  static_assert(NRS == 4 || NRS == 2, "tiles of 4 or 2 weight rows");
  for (int i = 0; i < MR; ++i)
    if constexpr (NRS == 4)
      _mm_storeu_ps(out + i * NR + j0, reduce16x4_avx512(facc[i][0], facc[i][1], facc[i][2], facc[i][3]));
    else  // the two sums, twice
      _mm_storel_pi(reinterpret_cast<__m64*>(out + i * NR + j0), reduce16x4_avx512(facc[i][0], facc[i][1], facc[i][0], facc[i][1]));
}

// One block of BK for MR activation rows x the tile's NR weight rows with AVX2 (no VNNI): the 16 lanes as two
// halves of 8 (bytes 0-31 and 32-63 of each chunk). The lane sums are the same exact integers as dpbusd's:
// maddubs (unsigned q x signed x, pairs summed in int16) added in int16 over G chunks, few enough that no sum
// can leave int16 (|pair| <= 2 * max q * 127: 8 chunks of 4-bit, 4 of 5-bit), then widened by
// madd. Q8_0's q + 128 would overflow: it runs as signed q (q ^ 0x80) times x with maddubs' sign trick
// (|q| x sign(x, q), |pair| <= 2 * 128 * 127), the same sum as VNNI's (q + 128) x - 128 sum x. Integer sums
// are exact in any order; the float operations per lane are those of block_vnni, in the same order.
// Registers (16 ymm): one weight row at a time, its decoded chunk shared by the MR rows, each row's int16 and
// int32 sums in registers (2 MR + 4 <= 14 for MR <= 5), the activations read from L1 as maddubs operands. The
// weight row's lane scales are made here from its scale bytes, as used (no pass over the tile before).
template <int MR, int KIND, int BK>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void block_avx2(const TileArgs& t, int64_t m0, int64_t b, __m256 (&facc)[MR][NR][2]) {
  constexpr bool NIB = kFormats[KIND].nibbles;
  constexpr int SHIFT = kFormats[KIND].shift;
  constexpr int64_t CH = BK / 64, QB = q_bytes(KIND, BK);
  constexpr int64_t G16 = KIND == kQ8_0 ? 1 : (NIB ? 8 : 4);
  constexpr int64_t G = G16 < CH ? G16 : CH;                    // chunks summed in int16
  const Acts& a = *t.a;
  const int64_t k0 = t.bl->k0[b];
  const uint8_t* qb = t.q + t.qo[b];
  if (t.pf)
    for (int64_t p = 0; p < NR * QB; p += 64) _mm_prefetch(reinterpret_cast<const char*>(t.pf + t.qo[b] + p), _MM_HINT_T1);
  const __m256i lo4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sign = _mm256_set1_epi8(-128);
  const int8_t* xb = a.q.data() + m0 * a.K + k0;
  for (int64_t j = 0; j < NR; ++j) {
    alignas(32) float sv[LANES], mv[LANES];
    lane_scales_avx2<KIND>(BK, k0, t.st + j * t.rsb, sv, mv);
    const uint8_t* qj = qb + j * QB;
    for (int hf = 0; hf < 2; ++hf) {
        __m256i acc[MR];
#pragma GCC unroll 8
        for (int64_t c0 = 0; c0 < CH; c0 += G) {
          __m256i p[MR];
#pragma GCC unroll 8
          for (int64_t c = c0; c < c0 + G; c += (NIB ? 2 : 1)) {
            __m256i w0, w1;
            if constexpr (NIB) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj + c * 32 + 32 * hf));
              w0 = _mm256_and_si256(v, lo4);
              w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            } else {
              w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj + c * 64 + 32 * hf));
              if constexpr (KIND == kQ8_0) {
                w0 = _mm256_xor_si256(w0, sign);
                w1 = _mm256_abs_epi8(w0);
              }
            }
            for (int i = 0; i < MR; ++i) {
              const int8_t* xr = xb + i * a.K + c * 64 + 32 * hf;
              const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
              __m256i d;
              if constexpr (KIND == kQ8_0) d = _mm256_maddubs_epi16(w1, _mm256_sign_epi8(x0, w0));
              else d = _mm256_maddubs_epi16(w0, x0);
              if constexpr (NIB)
                d = _mm256_add_epi16(d, _mm256_maddubs_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 64))));
              p[i] = c == c0 ? d : _mm256_add_epi16(p[i], d);
              asm("" : "+x"(p[i]));  // one sum after the other: no tree of them for the registers to hold
            }
          }
          for (int i = 0; i < MR; ++i) {
            const __m256i s = _mm256_madd_epi16(p[i], ones);
            acc[i] = c0 == 0 ? s : _mm256_add_epi32(acc[i], s);
          }
        }
        const __m256 scale = _mm256_load_ps(sv + 8 * hf);
        for (int i = 0; i < MR; ++i) {
          const int64_t r = (m0 + i) * a.nb + b;
          if constexpr (SHIFT >= 0 && KIND != kQ8_0) {  // symmetric: minus c * (the lane's activation sum)
            const int32_t* ls = a.ls.data() + r * LANES + 8 * hf;
            acc[i] = _mm256_sub_epi32(acc[i], _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ls)), SHIFT));
          }
          __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i]), scale);
          if constexpr (SHIFT < 0) v = _mm256_fmadd_ps(_mm256_load_ps(mv + 8 * hf), _mm256_loadu_ps(a.lsf.data() + r * LANES + 8 * hf), v);
          facc[i][j][hf] = _mm256_fmadd_ps(v, _mm256_set1_ps(a.sx[r]), facc[i][j][hf]);
        }
      }
  }
}

// rows_vnni with AVX2, for all NR weight rows of the tile -> out[MR][NR]
template <int MR, int KIND>
__attribute__((target("avx2,fma,f16c")))
static void rows_avx2(const TileArgs& t, int64_t m0, int64_t, float* out) {
  __m256 facc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) facc[i][j][0] = facc[i][j][1] = _mm256_setzero_ps();
  const Blocks& bl = *t.bl;
  int64_t b = 0;
  for (; b < bl.n512; ++b) block_avx2<MR, KIND, 512>(t, m0, b, facc);
  if (bl.tail256) block_avx2<MR, KIND, 256>(t, m0, b++, facc);
  if constexpr (KIND != kQ5_K)
    if (bl.tail128) block_avx2<MR, KIND, 128>(t, m0, b++, facc);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {  // reduce16's order: lanes l + (l + 8), then + 4, then (0 + 2) + (1 + 3)
      const __m256 s8 = _mm256_add_ps(facc[i][j][0], facc[i][j][1]);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      out[i * NR + j] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

// The same arithmetic, one lane at a time (machines without AVX512-VNNI; tests force it).
static void rows_portable(int64_t kind, const TileArgs& t, int64_t m0, int64_t mr, float* out) {
  const Format f = kFormats[kind];
  const Acts& a = *t.a;
  const Blocks& bl = *t.bl;
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < NR; ++j) {
      float facc[LANES] = {};
      for (int64_t b = 0; b < bl.count; ++b) {
        const int64_t B = bl.size[b], QB = q_bytes(kind, B), r = (m0 + i) * a.nb + b;
        const uint8_t* qr = t.q + t.qo[b] + j * QB;
        const int8_t* xr = a.q.data() + (m0 + i) * a.K + bl.k0[b];
        {
          const float* scale = t.sv;
          for (int64_t l = 0; l < LANES; ++l) {
            const int32_t ls = a.ls[r * LANES + l];
            int32_t acc = f.shift >= 0 ? -(ls * (1 << f.shift)) : 0;
            for (int64_t c = 0; c < B / 64; ++c)
              for (int64_t e = 0; e < 4; ++e) {
                const int64_t byte = c * 64 + l * 4 + e;  // chunk c, lane l
                const int32_t lo = (qr[(c / 2) * 64 + l * 4 + e] >> (4 * (c % 2))) & 0x0f;
                const int32_t w = f.nibbles ? lo : qr[byte];
                acc += w * static_cast<int32_t>(xr[byte]);
              }
            const int64_t sj = (b * NR + j) * LANES + l;
            float v = static_cast<float>(acc) * scale[sj];
            if (f.shift < 0) v = std::fma(t.mv[sj], a.lsf[r * LANES + l], v);
            facc[l] = std::fma(v, a.sx[r], facc[l]);
          }
        }
      }
      out[i * NR + j] = reduce16(facc);
    }
}

using RowsFn = void (*)(const TileArgs&, int64_t, int64_t, float*);

// the AVX512-VNNI function for MR x NRS tiles of one GGUF kind
template <int MR, int NRS, bool INL = false>
RowsFn rows_for(int64_t kind) {
  switch (kind) {
    case kQ8_0: return rows_vnni<MR, NRS, kQ8_0, INL>;
    case kQ4_0: return rows_vnni<MR, NRS, kQ4_0, INL>;
    case kQ5_0: return rows_vnni<MR, NRS, kQ5_0, INL>;
    default: return rows_vnni<MR, NRS, kQ5_K, INL>;  // Q4_K and Q6_K: linear_kquant.cpp
  }
}

// the AVX2 function for MR (1-5) rows x a whole tile of one GGUF kind
template <int MR>
RowsFn rows_avx2_kind(int64_t kind) {
  switch (kind) {
    case kQ8_0: return rows_avx2<MR, kQ8_0>;
    case kQ4_0: return rows_avx2<MR, kQ4_0>;
    case kQ5_0: return rows_avx2<MR, kQ5_0>;
    default: return rows_avx2<MR, kQ5_K>;  // Q4_K and Q6_K: linear_kquant.cpp
  }
}

RowsFn rows_for_avx2(int64_t mr, int64_t kind) {
  switch (mr) {
    case 1: return rows_avx2_kind<1>(kind);
    case 2: return rows_avx2_kind<2>(kind);
    case 3: return rows_avx2_kind<3>(kind);
    case 4: return rows_avx2_kind<4>(kind);
    default: return rows_avx2_kind<5>(kind);
  }
}

struct Segment {
  int64_t kind, rows, tiles, n0;  // n0: first output column
  const uint8_t* q;
  const uint8_t* s;
  std::vector<int64_t> qo;  // per block: offset in a tile's q
  int64_t tile_q = 0, tile_s = 0;  // bytes per tile
};

}  // namespace

torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_gguf: bf16 or fp32 x");
  const int64_t K = x.size(-1);
  TORCH_CHECK(q.scalar_type() == at::kByte && s.scalar_type() == at::kByte && q.dim() == 1 && s.dim() == 1 &&
                  q.is_contiguous() && s.is_contiguous(), "linear_gguf: q and s must be contiguous uint8 vectors");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == META && meta.size(0) > 0 &&
                  meta.is_contiguous(), "linear_gguf: meta must be int64 [segments, ", META, "]");
  const int64_t* md = meta.data_ptr<int64_t>();
  TORCH_CHECK(md[5] == K, "linear_gguf: x has ", K, " features, the weight ", md[5]);
  TORCH_CHECK(K % 128 == 0, "linear_gguf: K must be a multiple of 128, got ", K);
  const Blocks bl(K);
  std::vector<Segment> segs, segs16;  // tiles of NR rows (this file) and of 16 (Q4_K, Q6_K: linear_kquant.cpp)
  int64_t n0 = 0, total_tiles = 0, total16 = 0;
  for (int64_t i = 0; i < meta.size(0); ++i) {
    const int64_t* r = md + i * META;
    const int64_t kind = r[0], rows = r[1], tiles = r[2], qoff = r[3], soff = r[4];
    TORCH_CHECK(r[5] == K, "linear_gguf: segment ", i, " has another K");
    TORCH_CHECK(kind >= 0 && kind < kKinds, "linear_gguf: unknown kind ", kind);
    TORCH_CHECK(!k_quant(kind) || K % 256 == 0, "linear_gguf: K-quants need K % 256 == 0");
    const int64_t tr = kquant_tiled(kind) ? 16 : NR;  // rows per tile
    TORCH_CHECK(rows > (tiles - 1) * tr && rows <= tiles * tr, "linear_gguf: segment ", i, " has ", tiles,
                " tiles of ", tr, " rows for ", rows, " rows");
    Segment sg{kind, rows, tiles, n0, nullptr, nullptr, {}, 0, 0};
    if (kquant_tiled(kind)) {
      sg.tile_q = kquant_tile_q(kind, K);
      sg.tile_s = kquant_tile_s(kind, K);
    } else {
      for (int64_t b = 0; b < bl.count; ++b) {
        sg.qo.push_back(sg.tile_q);
        sg.tile_q += NR * q_bytes(kind, bl.size[b]);
      }
      sg.tile_s = NR * row_scale_bytes(kind, K);
    }
    TORCH_CHECK(qoff >= 0 && soff >= 0 && qoff + tiles * sg.tile_q <= q.numel() && soff + tiles * sg.tile_s <= s.numel(),
                "linear_gguf: segment ", i, " lies outside q or s");
    sg.q = q.data_ptr<uint8_t>() + qoff;
    sg.s = s.data_ptr<uint8_t>() + soff;
    n0 += rows;
    (kquant_tiled(kind) ? total16 : total_tiles) += tiles;
    (kquant_tiled(kind) ? segs16 : segs).push_back(std::move(sg));
  }
  const int64_t N = n0;
  const torch::Tensor bt = fp32_bias(bias);
  TORCH_CHECK(!bt.defined() || bt.numel() == N, "linear_gguf: bias has ", bt.defined() ? bt.numel() : 0,
              " values for ", N, " outputs");
  auto x2 = x.reshape({-1, K}).contiguous();
  const Acts a = total_tiles ? quantize_acts(x2, bl) : Acts{};
  const KActs ka = total16 ? kquant_acts(x2) : KActs{};
  const int64_t M = x2.size(0);
  const float* bp = bt.defined() ? bt.data_ptr<float>() : nullptr;
  const Output out(x, M, N);
  const bool vec = has_vnni(), avx2 = has_avx2();
  // Long inputs (prefill) in blocks of rows whose int8 activations fit in L2 (~256 KB), each block passing
  // over every tile: otherwise each 4-row weight tile re-reads all M rows from L3 (measured: docs/BENCHMARKS.md,
  // "Kernel design choices").
  // A row's arithmetic is the same in any block.
  const int64_t rows_per_block = std::max<int64_t>(16, (262144 / K) / MT * MT);
  for (int64_t m_lo = 0; m_lo < M; m_lo += rows_per_block) {
    const int64_t m_hi = std::min(M, m_lo + rows_per_block);
    if (total16)
      at::parallel_for(0, total16, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> y((m_hi - m_lo) * 64);
        int64_t base = 0;  // first global tile of the segment
        for (const Segment& sg : segs16) {
          const int64_t lo = std::max(t0, base), hi = std::min(t1, base + sg.tiles);
          if (lo < hi)
            kquant_tiles(sg.kind, ka, sg.q + (lo - base) * sg.tile_q, sg.s + (lo - base) * sg.tile_s, lo - base, hi - base,
                         sg.rows, sg.n0, m_lo, m_hi, out, bp, y.data());
          base += sg.tiles;
        }
      });
    if (total_tiles)
    at::parallel_for(0, total_tiles, 4, [&](int64_t t0, int64_t t1) {
      std::vector<float> sv(bl.count * NR * LANES), mv(bl.count * NR * LANES), dots((MT + 1) * NR);
      size_t si = 0;
      int64_t base = 0;  // first global tile of segs[si]
      for (int64_t g = t0; g < t1; ++g) {
        while (g >= base + segs[si].tiles) base += segs[si++].tiles;
        const Segment& sg = segs[si];
        const int64_t t = g - base, rsb = sg.tile_s / NR;
        const uint8_t* qt = sg.q + t * sg.tile_q;
        const uint8_t* st = sg.s + t * sg.tile_s;
        // With VNNI and at most 5 rows, one pass over the tile: its rows function makes each block's lane scales
        // as it uses them instead of this loop storing them all for several passes to read back. For M = 6..16, two or more passes making them each time gained nothing.
        // The AVX2 rows functions always make their lane scales as they use them: the pass that stored them all
        // here took a measurable share of a one-token forward. Measured: docs/BENCHMARKS.md, "Kernel design choices"
        // and "What did not help".
        const bool inl = vec && m_hi - m_lo <= 5;
        if (vec && !inl)
          scales_for(sg.kind)(bl, st, rsb, sv.data(), mv.data());
        else if (!vec && !avx2)
          for (int64_t b = 0; b < bl.count; ++b)
            for (int64_t j = 0; j < NR; ++j)
              lane_scales(sg.kind, bl.size[b], bl.k0[b], st + j * rsb, sv.data() + (b * NR + j) * LANES,
                          mv.data() + (b * NR + j) * LANES);
        // The tile PF_TILES ahead is prefetched (by the first pass) into L2, not the next into L1, which was
        // slower (measured: docs/BENCHMARKS.md, "Kernel design choices").
        const uint8_t* next = t + PF_TILES < sg.tiles ? qt + PF_TILES * sg.tile_q : nullptr;
        if (next)
          for (int64_t p = 0; p < sg.tile_s; p += 64)
            _mm_prefetch(reinterpret_cast<const char*>(st + PF_TILES * sg.tile_s + p), _MM_HINT_T1);
        const TileArgs ta{&a, &bl, qt, sg.qo.data(), sv.data(), mv.data(), next, st, rsb};
        const TileArgs tn{&a, &bl, qt, sg.qo.data(), sv.data(), mv.data(), nullptr, st, rsb};
        // Rows in 4s, except that M = 4a + 5b with b = M mod 4 (M = 5, 9, 10, 13, 14, 15) takes its last rows 5
        // at a time (5 x 4 tiles) instead of ending in a pass of 1-3 rows that decodes every weight again: a
        // cheaper verify pass over 5 tokens, K = 4 (measured: docs/BENCHMARKS.md, "Kernel design choices").
        int64_t fives = (m_hi - m_lo) % MT;
        if (5 * fives > m_hi - m_lo) fives = 0;
        for (int64_t m = m_lo; m < m_hi;) {
          const int64_t mr = fives > 0 && m_hi - m == 5 * fives ? 5 : std::min(MT, m_hi - m);
          fives -= mr == 5;
          const TileArgs& tm = m == m_lo ? ta : tn;
          if (inl && mr == 3) {
            const RowsFn f = rows_for<3, 2, true>(sg.kind);
            f(tm, m, 0, dots.data());
            f(tn, m, 2, dots.data());
          } else if (inl) {
            (mr == 5 ? rows_for<5, 4, true>(sg.kind) : mr == 4 ? rows_for<4, 4, true>(sg.kind)
             : mr == 2 ? rows_for<2, 4, true>(sg.kind) : rows_for<1, 4, true>(sg.kind))(tm, m, 0, dots.data());
          } else if (vec && mr == 4) {  // 4 x 4, not two 4 x 2 passes (docs/BENCHMARKS.md, "Kernel design choices")
            rows_for<4, 4>(sg.kind)(tm, m, 0, dots.data());
          } else if (vec && mr == 5) {
            rows_for<5, 4>(sg.kind)(tm, m, 0, dots.data());
          } else if (vec && mr == 3) {
            const RowsFn f = rows_for<3, 2>(sg.kind);
            f(tm, m, 0, dots.data());
            f(tn, m, 2, dots.data());
          } else if (vec) {
            for (int64_t i = 0; i < mr; i += 2)
              (mr - i >= 2 ? rows_for<2, 4>(sg.kind) : rows_for<1, 4>(sg.kind))(i == 0 ? tm : tn, m + i, 0, dots.data() + i * NR);
          } else if (avx2) {
            rows_for_avx2(mr, sg.kind)(tm, m, 0, dots.data());
          } else {
            rows_portable(sg.kind, ta, m, mr, dots.data());
          }
          if ((t + 1) * NR <= sg.rows)
            for (int64_t i = 0; i < mr; ++i) out.set4(m + i, sg.n0 + t * NR, _mm_loadu_ps(dots.data() + i * NR), bp);
          else
            for (int64_t j = 0; j < NR && t * NR + j < sg.rows; ++j) {
              const int64_t n = sg.n0 + t * NR + j;
              for (int64_t i = 0; i < mr; ++i) out.set(m + i, n, dots[i * NR + j] + (bp ? bp[n] : 0.0f));
            }
          m += mr;
        }
      }
    });
  }
  return out.finish(x);
}

}  // namespace verispec
