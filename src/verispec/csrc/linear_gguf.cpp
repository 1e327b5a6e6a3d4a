// GGUF-quantized matrices used as they are: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in llama.cpp's
// Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K blocks, for any M (decode: 1 row, verify: k + 1 rows, prefill: many).
//
// Every one of those formats is "an unsigned integer q per weight, and per group of 16 or 32 weights a scale
// s and a min m": w = s * q + m. models/gguf_native.py re-lays a tensor's blocks out for this kernel once, at
// load time, without changing a single value (s and m are computed here from the file's own fp16 / 6-bit /
// 8-bit fields, exactly as llama.cpp's dequantization does):
//   type  q bits (stored as)  group  s              m              (symmetric shift c: m = -c * s)
//   Q8_0  8 (byte, q + 128)   32     d              -128 d          c = 128
//   Q4_0  4 (nibble)          32     d              -8 d            c = 8
//   Q5_0  5 (byte)            32     d              -16 d           c = 16
//   Q6_K  6 (byte)            16     d * sc (int8)  -32 s           c = 32
//   Q4_K  4 (nibble)          32     d * sc (6-bit) -dmin * mn (6-bit)
//   Q5_K  5 (byte)            32     d * sc         -dmin * mn
//
// Layout. K is cut into blocks of B = 256 k (128 when K is not a multiple of 256). In a block, the 16
// int32 lanes of a 512-bit register each own B/16 consecutive k: chunk c (64 bytes) holds, in lane l,
// k = (B/16) l + 4c .. 4c + 3. So VNNI's dpbusd, accumulated over the block's B/64 chunks, leaves one
// group's dot product (or a part of one) in each lane: the group scales are applied once per block with one
// multiply per lane vector, not once per 4 products. Activations get the same k order.
//   q: [tiles][blocks][NR][QB] bytes, QB = B/2 (nibbles: low = chunk 2v, high = chunk 2v + 1) or B;
//   s: [tiles][blocks][NR][SB] bytes: Q4_K/Q5_K d, dmin (fp16), sc[8], mn[8]; Q6_K d (fp16), sc[16] (int8);
//      Q8_0/Q4_0/Q5_0 d (fp16) per group of 32.
// A matrix may be several such segments stacked along N (fused q/k/v and gate/up projections whose parts
// came in different types): one call computes them all.
//
// Activations: each row cut into the same blocks of B, each block quantized to int8 with its own scale
// (max |x| -> 127, round to nearest), as llama.cpp does with its Q8_K / Q8_0 activations. Per block and
// (row, weight row): 16 exact int32 lane sums -> float, times the lane scales, plus the min terms, times the
// activation block's scale, accumulated in fp32 lanes; a fixed tree sums the 16 lanes at the end. The order
// of every operation on an output element is fixed: it does not depend on M, on the other rows in the call,
// on the thread split, or on the instruction set (the AVX512 and portable paths agree bitwise).
// Error against float64 on the dequantized weights: activation rounding, at most sum_b (sx_b / 2) sum |w_k|
// over k in block b (sx_b = max |x| / 127 of the block), plus fp32 accumulation (tests/kernels).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace verispec {
namespace {

constexpr int64_t NR = 4;    // weight rows per tile
constexpr int64_t MT = 4;    // activation rows per register tile (4 rows x 2 weight rows, 2 x 4, or 1 x 4)
constexpr int64_t LANES = 16;

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ5_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kKinds = 6 };

struct Format {
  bool nibbles;
  int shift;  // log2 c for the symmetric types, -1: per-group mins (Q4_K, Q5_K)
};
constexpr Format kFormats[kKinds] = {{false, 7}, {true, 3}, {false, 4}, {true, -1}, {false, -1}, {false, 5}};

inline int64_t q_bytes(int64_t kind, int64_t B) { return kFormats[kind].nibbles ? B / 2 : B; }
inline int64_t s_bytes(int64_t kind, int64_t B) {
  switch (kind) {
    case kQ4_K: case kQ5_K: return 20;
    case kQ6_K: return 18;
    default: return B / 32 * 2;
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The activations of one call: rows cut into blocks of B, each quantized with its own scale, in lane order.
struct Acts {
  int64_t M = 0, blocks = 0, B = 0;
  std::vector<int8_t> q;     // [M][blocks][B]
  std::vector<float> sx;     // [M][blocks]
  std::vector<int32_t> ls;   // [M][blocks][16]: each lane's sum of q
  std::vector<float> lsf;    // the same as float
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
__attribute__((always_inline)) inline void quantize_all(const T* x, Acts& a) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t i = m * a.blocks + b;
      quantize_block(x + m * a.blocks * a.B + b * a.B, a.B, a.q.data() + i * a.B, a.sx.data() + i, a.ls.data() + i * LANES);
    }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_f32(const float* x, Acts& a) { quantize_all(x, a); }
__attribute__((target_clones("avx512f", "avx2", "default")))
void quantize_bf16(const at::BFloat16* x, Acts& a) { quantize_all(x, a); }

Acts quantize_acts(const torch::Tensor& x2, int64_t B) {
  Acts a;
  a.M = x2.size(0);
  a.B = B;
  a.blocks = x2.size(1) / B;
  a.q.resize(a.M * a.blocks * B);
  a.sx.resize(a.M * a.blocks);
  a.ls.resize(a.M * a.blocks * LANES);
  if (x2.scalar_type() == at::kFloat)
    quantize_f32(x2.data_ptr<float>(), a);
  else
    quantize_bf16(x2.data_ptr<at::BFloat16>(), a);
  a.lsf.assign(a.ls.begin(), a.ls.end());
  return a;
}

// The 16 lane scales (and mins) of one weight row's block, from its SB scale bytes. Exact: fp16 times an
// integer of at most 8 bits fits a float's 24-bit significand.
inline void lane_scales(int64_t kind, int64_t B, const uint8_t* s, float* sv, float* mv) {
  const int64_t per = B / LANES;
  switch (kind) {
    case kQ4_K: case kQ5_K: {
      const float d = half(s), dmin = half(s + 2);
      for (int64_t l = 0; l < LANES; ++l) {
        sv[l] = d * static_cast<float>(s[4 + l / 2]);
        mv[l] = -(dmin * static_cast<float>(s[12 + l / 2]));
      }
      break;
    }
    case kQ6_K: {
      const float d = half(s);
      for (int64_t l = 0; l < LANES; ++l) sv[l] = d * static_cast<float>(static_cast<int8_t>(s[2 + l]));
      break;
    }
    default:
      for (int64_t l = 0; l < LANES; ++l) sv[l] = half(s + 2 * (l * per / 32));
  }
}

// lane_scales with AVX512: the same exact products, 16 lanes at a time (the scalar version took ~60% of a
// decode step)
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <int KIND>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
static void lane_scales_avx512(int64_t B, const uint8_t* s, float* sv, float* mv) {
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const __m512 d = _mm512_set1_ps(half_f16c(s)), dmin = _mm512_set1_ps(half_f16c(s + 2));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 4));  // sc[8], mn[8]
    const __m128i isc = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m128i imn = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(v, isc)));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(v, imn)));
    _mm512_storeu_ps(sv, _mm512_mul_ps(d, sc));
    _mm512_storeu_ps(mv, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn)));
  } else if constexpr (KIND == kQ6_K) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2));
    _mm512_storeu_ps(sv, _mm512_mul_ps(_mm512_set1_ps(half_f16c(s)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))));
  } else if (B == 256) {  // 8 groups of 32: lane l -> group l / 2
    const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    _mm512_storeu_ps(sv, _mm512_permutexvar_ps(idx, d8));
  } else {  // 4 groups of 32: lane l -> group l / 4
    const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm512_storeu_ps(sv, _mm512_permutexvar_ps(idx, d4));
  }
}

using ScalesFn = void (*)(int64_t, const uint8_t*, float*, float*);
ScalesFn scales_for(int64_t kind) {
  switch (kind) {
    case kQ4_K: case kQ5_K: return lane_scales_avx512<kQ4_K>;
    case kQ6_K: return lane_scales_avx512<kQ6_K>;
    default: return lane_scales_avx512<kQ8_0>;
  }
}

// sum of the 16 lanes, in the one order both paths use
inline float reduce16(const float* p) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = p[l] + p[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// One tile's scale vectors for every block: sv/mv [blocks][NR][16]
struct TileScales {
  std::vector<float> sv, mv;
};

// MR activation rows x NRS weight rows (rows j0 .. j0 + NRS - 1 of the tile) over every block -> out[MR][NR]
// (columns j0 ..). The operations on one (row, weight row) pair are the same whatever MR, NRS and j0 are.
template <int MR, int NRS, int KIND, int BLK>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static void rows_vnni(const Acts& a, int64_t m0, int64_t j0, const uint8_t* q, int64_t QB, const float* sv,
                      const float* mv, const uint8_t* pf, float* out) {
  constexpr bool NIB = kFormats[KIND].nibbles;
  constexpr int SHIFT = kFormats[KIND].shift;
  constexpr int64_t B = BLK, chunks = B / 64;
  __m512 facc[MR][NRS];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRS; ++j) facc[i][j] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = q + b * NR * QB + j0 * QB;
    if (pf)  // the next tile's block b, so that its DRAM reads overlap this tile's arithmetic
      for (int64_t p = 0; p < NR * QB; p += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + b * NR * QB + p), _MM_HINT_T0);
    __m512i acc[MR][NRS];
    for (int i = 0; i < MR; ++i) {
      const int64_t r = (m0 + i) * a.blocks + b;
      __m512i init = _mm512_setzero_si512();
      if constexpr (SHIFT >= 0)  // symmetric: start from -c * (the lane's activation sum)
        init = _mm512_sub_epi32(init, _mm512_slli_epi32(_mm512_loadu_si512(a.ls.data() + r * LANES), SHIFT));
      for (int j = 0; j < NRS; ++j) acc[i][j] = init;
    }
    const int8_t* xb = a.q.data() + (m0 * a.blocks + b) * B;
    const int64_t ldx = a.blocks * B;
#pragma GCC unroll 4
    for (int64_t c = 0; c < chunks; c += (NIB ? 2 : 1)) {
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
        const int8_t* xr = xb + i * ldx + c * 64;
        const __m512i x0 = _mm512_loadu_si512(xr);
        for (int j = 0; j < NRS; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w0[j], x0);
        if constexpr (NIB) {
          const __m512i x1 = _mm512_loadu_si512(xr + 64);
          for (int j = 0; j < NRS; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w1[j], x1);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t r = (m0 + i) * a.blocks + b;
      const __m512 sxb = _mm512_set1_ps(a.sx[r]);
      __m512 lsf;
      if constexpr (SHIFT < 0) lsf = _mm512_loadu_ps(a.lsf.data() + r * LANES);
      for (int j = 0; j < NRS; ++j) {
        const int64_t sj = (b * NR + j0 + j) * LANES;
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_loadu_ps(sv + sj));
        if constexpr (SHIFT < 0) t = _mm512_fmadd_ps(_mm512_loadu_ps(mv + sj), lsf, t);
        facc[i][j] = _mm512_fmadd_ps(t, sxb, facc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRS; ++j) {
      alignas(64) float p[LANES];
      _mm512_store_ps(p, facc[i][j]);
      out[i * NR + j0 + j] = reduce16(p);
    }
}

// The same arithmetic, one lane at a time (machines without AVX512-VNNI; tests force it).
static void rows_portable(int64_t kind, const Acts& a, int64_t m0, int64_t mr, const uint8_t* q, int64_t QB,
                          const float* sv, const float* mv, float* out) {
  const Format f = kFormats[kind];
  const int64_t B = a.B, per = B / LANES;
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < NR; ++j) {
      float facc[LANES] = {};
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int64_t r = (m0 + i) * a.blocks + b;
        const uint8_t* qr = q + (b * NR + j) * QB;
        const int8_t* xr = a.q.data() + r * B;
        for (int64_t l = 0; l < LANES; ++l) {
          int32_t acc = f.shift >= 0 ? -(a.ls[r * LANES + l] * (1 << f.shift)) : 0;
          for (int64_t e = 0; e < per; ++e) {
            const int64_t c = e / 4, byte = c * 64 + l * 4 + e % 4;  // chunk c, lane l
            const int32_t w = f.nibbles ? (qr[(c / 2) * 64 + l * 4 + e % 4] >> (4 * (c % 2))) & 0x0f : qr[byte];
            acc += w * static_cast<int32_t>(xr[byte]);
          }
          float t = static_cast<float>(acc) * sv[(b * NR + j) * LANES + l];
          if (f.shift < 0) t = std::fma(mv[(b * NR + j) * LANES + l], a.lsf[r * LANES + l], t);
          facc[l] = std::fma(t, a.sx[r], facc[l]);
        }
      }
      out[i * NR + j] = reduce16(facc);
    }
}

using RowsFn = void (*)(const Acts&, int64_t, int64_t, const uint8_t*, int64_t, const float*, const float*,
                        const uint8_t*, float*);

template <int MR, int NRS, int BLK>
RowsFn rows_for_b(int64_t kind) {
  switch (kind) {
    case kQ8_0: return rows_vnni<MR, NRS, kQ8_0, BLK>;
    case kQ4_0: return rows_vnni<MR, NRS, kQ4_0, BLK>;
    case kQ5_0: return rows_vnni<MR, NRS, kQ5_0, BLK>;
    case kQ4_K: return rows_vnni<MR, NRS, kQ4_K, 256>;
    case kQ5_K: return rows_vnni<MR, NRS, kQ5_K, 256>;
    default: return rows_vnni<MR, NRS, kQ6_K, 256>;
  }
}

template <int MR, int NRS>
RowsFn rows_for(int64_t kind, int64_t B) {
  return B == 256 ? rows_for_b<MR, NRS, 256>(kind) : rows_for_b<MR, NRS, 128>(kind);
}

struct Segment {
  int64_t kind, rows, tiles, n0;  // n0: first output column
  const uint8_t* q;
  const uint8_t* s;
};

}  // namespace

int64_t gguf_block(int64_t K) { return K % 256 == 0 ? 256 : 128; }

torch::Tensor linear_gguf(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                          const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_gguf: bf16 or fp32 x");
  const int64_t K = x.size(-1), B = gguf_block(K);
  TORCH_CHECK(K % 128 == 0, "linear_gguf: K must be a multiple of 128, got ", K);
  TORCH_CHECK(q.scalar_type() == at::kByte && s.scalar_type() == at::kByte && q.dim() == 1 && s.dim() == 1 &&
                  q.is_contiguous() && s.is_contiguous(), "linear_gguf: q and s must be contiguous uint8 vectors");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(1) == 5 && meta.size(0) > 0 &&
                  meta.is_contiguous(), "linear_gguf: meta must be int64 [segments, 5]");
  const int64_t blocks = K / B;
  const int64_t* md = meta.data_ptr<int64_t>();
  std::vector<Segment> segs;
  int64_t n0 = 0, total_tiles = 0;
  for (int64_t i = 0; i < meta.size(0); ++i) {
    const int64_t kind = md[i * 5], rows = md[i * 5 + 1], tiles = md[i * 5 + 2], qo = md[i * 5 + 3], so = md[i * 5 + 4];
    TORCH_CHECK(kind >= 0 && kind < kKinds, "linear_gguf: unknown kind ", kind);
    TORCH_CHECK((kind != kQ4_K && kind != kQ5_K && kind != kQ6_K) || B == 256, "linear_gguf: K-quants need K % 256 == 0");
    TORCH_CHECK(rows > (tiles - 1) * NR && rows <= tiles * NR, "linear_gguf: segment ", i, " has ", tiles,
                " tiles of ", NR, " rows for ", rows, " rows");
    TORCH_CHECK(qo >= 0 && so >= 0 && qo + tiles * blocks * NR * q_bytes(kind, B) <= q.numel() &&
                    so + tiles * blocks * NR * s_bytes(kind, B) <= s.numel(),
                "linear_gguf: segment ", i, " lies outside q or s (weights packed for another K?)");
    segs.push_back({kind, rows, tiles, n0, q.data_ptr<uint8_t>() + qo, s.data_ptr<uint8_t>() + so});
    n0 += rows;
    total_tiles += tiles;
  }
  auto x2 = x.reshape({-1, K}).contiguous();
  const Acts a = quantize_acts(x2, B);
  const int64_t M = a.M, N = n0;
  const torch::Tensor bt = fp32_bias(bias);
  const float* bp = bt.defined() ? bt.data_ptr<float>() : nullptr;
  auto yf = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = yf.data_ptr<float>();
  const bool vec = has_vnni();
  at::parallel_for(0, total_tiles, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> sv(blocks * NR * LANES), mv(blocks * NR * LANES), dots(MT * NR);
    size_t si = 0;
    int64_t base = 0;  // first global tile of segs[si]
    for (int64_t g = t0; g < t1; ++g) {
      while (g >= base + segs[si].tiles) base += segs[si++].tiles;
      const Segment& sg = segs[si];
      const int64_t t = g - base, QB = q_bytes(sg.kind, B), SB = s_bytes(sg.kind, B);
      const uint8_t* qt = sg.q + t * blocks * NR * QB;
      const uint8_t* st = sg.s + t * blocks * NR * SB;
      const ScalesFn fast = vec ? scales_for(sg.kind) : nullptr;
      for (int64_t r = 0; r < blocks * NR; ++r) {
        if (fast)
          fast(B, st + r * SB, sv.data() + r * LANES, mv.data() + r * LANES);
        else
          lane_scales(sg.kind, B, st + r * SB, sv.data() + r * LANES, mv.data() + r * LANES);
      }
      const uint8_t* next = t + 1 < sg.tiles ? qt + blocks * NR * QB : nullptr;  // prefetched by the first pass
      if (next)
        for (int64_t p = 0; p < blocks * NR * SB; p += 64) _mm_prefetch(reinterpret_cast<const char*>(st + blocks * NR * SB + p), _MM_HINT_T0);
      for (int64_t m = 0; m < M; m += MT) {
        const int64_t mr = std::min(MT, M - m);
        const uint8_t* pf = m == 0 ? next : nullptr;
        if (vec && mr == 4) {
          const RowsFn f = rows_for<4, 2>(sg.kind, B);
          f(a, m, 0, qt, QB, sv.data(), mv.data(), pf, dots.data());
          f(a, m, 2, qt, QB, sv.data(), mv.data(), nullptr, dots.data());
        } else if (vec) {
          for (int64_t i = 0; i < mr; i += 2)
            (mr - i >= 2 ? rows_for<2, 4>(sg.kind, B) : rows_for<1, 4>(sg.kind, B))(a, m + i, 0, qt, QB, sv.data(), mv.data(),
                                                                           i == 0 ? pf : nullptr, dots.data() + i * NR);
        } else
          rows_portable(sg.kind, a, m, mr, qt, QB, sv.data(), mv.data(), dots.data());
        for (int64_t j = 0; j < NR && t * NR + j < sg.rows; ++j) {
          const int64_t n = sg.n0 + t * NR + j;
          for (int64_t i = 0; i < mr; ++i) yp[(m + i) * N + n] = dots[i * NR + j] + (bp ? bp[n] : 0.0f);
        }
      }
    }
  });
  return finish_output(yf, x, N);
}

}  // namespace verispec
