// A 16-lane float32 vector (f32x16) and the operations the CPU kernels use, implemented once per
// instruction set. The ISA is chosen by the build: -DCONVEYOR_ISA_AVX512BF16, _AVX512, _AVX2 or
// _GENERIC (kernels/cpu_ops.py passes one, with the matching -m flags); without one it follows the
// compiler's target macros.
//
// Contracts every implementation keeps, so the kernels give the same results on every ISA:
// - load16/store16 of bfloat16: bf16 -> f32 is exact (the bits shifted into the high half); f32 -> bf16
//   rounds to nearest even, NaN stays NaN (quieted, sign and high payload kept). The integer rounding
//   equals torch's .to(torch.bfloat16) bit for bit, subnormals included; AVX512-BF16's instruction
//   (avx512bf16 build) flushes subnormal inputs to signed zero and is otherwise identical.
// - fma rounds once; reduce_add sums in one fixed tree order (lanes i + 8, then i + 4, i + 2, i + 1).
// - bf16x32 holds 16 32-bit lanes, each a pair (even, odd) of bfloat16, even in the low half.
//   dot_pairs(acc, pair_x(...), w) adds x[2p + 1] * w.odd and then x[2p] * w.even to acc, each with one
//   rounding (the products of two bf16 are exact in f32), as vdpbf16ps does (which also reads subnormal
//   bf16 as zero); pair_x reads x's bf16 pairs where kNativePairDot, else x's float32 copy.
// - load_n(p, n) reads only p[0, n) and zeroes lanes >= n (0 <= n <= 16).
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(CONVEYOR_ISA_AVX512BF16) && !defined(CONVEYOR_ISA_AVX512) && !defined(CONVEYOR_ISA_AVX2) && \
    !defined(CONVEYOR_ISA_GENERIC)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#if defined(__AVX512BF16__)
#define CONVEYOR_ISA_AVX512BF16
#else
#define CONVEYOR_ISA_AVX512
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_ISA_AVX2
#else
#define CONVEYOR_ISA_GENERIC
#endif
#endif

#if defined(CONVEYOR_ISA_AVX512BF16) || defined(CONVEYOR_ISA_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "CONVEYOR_ISA_AVX512*: compile with -mavx512f -mavx512bw -mavx512vl -mavx512dq"
#endif
#if defined(CONVEYOR_ISA_AVX512BF16) && !defined(__AVX512BF16__)
#error "CONVEYOR_ISA_AVX512BF16: compile with -mavx512bf16"
#endif
#include <immintrin.h>
#elif defined(CONVEYOR_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "CONVEYOR_ISA_AVX2: compile with -mavx2 -mfma -mf16c"
#endif
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;

// Register tiling per ISA: the gemm's tiles per dtype (rows of x per tile; tiles of narrow_from..narrow_to rows,
// none where 0, span one panel of a block instead of both: more rows per weight load where both would not fit
// the registers), and the sub-tiles of paged attention's row group (query rows x 16-key chunks for the scores,
// query rows x 16-dim vectors for P.V, per cache dtype), sized so that the accumulators, the loaded operands and
// a broadcast fit the register file.
struct GemmTiles {
  int rows, narrow_from, narrow_to;
};
struct Tiles {
  GemmTiles gemm_f32, gemm_bf16;
  int score_rows_f32, score_chunks_f32, score_rows_bf16, score_chunks_bf16;
  int value_rows_f32, value_vecs_f32, value_rows_bf16, value_vecs_bf16;
};

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// ------------------------------------------------------------------------------------------------
#if defined(CONVEYOR_ISA_AVX512BF16) || defined(CONVEYOR_ISA_AVX512)
#if defined(CONVEYOR_ISA_AVX512BF16)
constexpr const char* kIsa = "avx512bf16";
#else
constexpr const char* kIsa = "avx512";
#endif
constexpr Tiles kTiles{{8, 0, 0}, {12, 0, 0}, 4, 4, 4, 4, 4, 4, 4, 4};  // 32 zmm registers

using f32x16 = __m512;  // +, -, *, / are the compiler's vector operators
using bf16x32 = __m512i;

inline __mmask16 first_lanes(int64_t n) { return __mmask16((1u << n) - 1u); }
inline f32x16 zero() { return _mm512_setzero_ps(); }
inline f32x16 set1(float x) { return _mm512_set1_ps(x); }
inline f32x16 max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }
inline f32x16 min(f32x16 a, f32x16 b) { return _mm512_min_ps(a, b); }
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c
inline f32x16 fnma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); } // c - a b
inline float reduce_add(f32x16 a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(f32x16 a) { return _mm512_reduce_max_ps(a); }
// Lanes [0, n) of a, the rest fill.
inline f32x16 keep_first(f32x16 a, int64_t n, float fill) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), first_lanes(n), a);
}
inline f32x16 round_even(f32x16 a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// a * 2^n for integral n.
inline f32x16 scale_pow2(f32x16 a, f32x16 n) { return _mm512_scalef_ps(a, n); }

inline f32x16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline f32x16 widen(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }
inline f32x16 load16(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline f32x16 load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline f32x16 load_n(const bf16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(first_lanes(n), p)); }
inline void store16(float* p, f32x16 a) { _mm512_storeu_ps(p, a); }

#if defined(CONVEYOR_ISA_AVX512BF16)
inline __m256i narrow(f32x16 a) {
  __m256bh h = _mm512_cvtneps_pbh(a);
  return reinterpret_cast<__m256i&>(h);
}
#else
// The 32-bit lanes with the bf16 rounding of a in their high half.
inline __m512i rounded_bits(f32x16 a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}
inline __m256i narrow(f32x16 a) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bits(a), 16)); }
#endif
inline void store16(bf16* p, f32x16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(a)); }
inline f32x16 round_bf16(f32x16 a) {
#if defined(CONVEYOR_ISA_AVX512BF16)
  return widen(narrow(a));
#else
  return _mm512_castsi512_ps(_mm512_and_si512(rounded_bits(a), _mm512_set1_epi32(int32_t(0xFFFF0000u))));
#endif
}

inline bf16x32 load_pairs(const bf16* p) { return _mm512_loadu_si512(p); }
#if defined(CONVEYOR_ISA_AVX512BF16)
#define CONVEYOR_NATIVE_PAIR_DOT 1
using PairX = __m512i;  // (x[2p], x[2p + 1]) in every lane
inline PairX pair_x(const bf16* x, const float*, bool whole) {
  if (whole) return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
  return _mm512_set1_epi32(static_cast<int32_t>(reinterpret_cast<const uint16_t*>(x)[0]));
}
inline f32x16 dot_pairs(f32x16 acc, PairX x, bf16x32 w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}
#else
inline f32x16 pair_even(bf16x32 w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline f32x16 pair_odd(bf16x32 w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
#endif

// ------------------------------------------------------------------------------------------------
#elif defined(CONVEYOR_ISA_AVX2)
constexpr const char* kIsa = "avx2";
constexpr Tiles kTiles{{6, 4, 6}, {11, 3, 5}, 3, 2, 4, 1, 1, 4, 4, 1};  // 16 ymm registers; an f32x16 takes two

struct f32x16 {
  __m256 lo, hi;
};
struct bf16x32 {
  __m256i lo, hi;
};

inline __m256i lane_index() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline f32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline f32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline f32x16 operator+(f32x16 a, f32x16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline f32x16 operator-(f32x16 a, f32x16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline f32x16 operator*(f32x16 a, f32x16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline f32x16 operator/(f32x16 a, f32x16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline f32x16 max(f32x16 a, f32x16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline f32x16 min(f32x16 a, f32x16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 fnma(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float reduce_add(f32x16 a) {
  const __m256 s8 = _mm256_add_ps(a.hi, a.lo);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
inline float reduce_max(f32x16 a) {
  const __m256 s8 = _mm256_max_ps(a.hi, a.lo);
  const __m128 s4 = _mm_max_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_max_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(s2), _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1)));
}
// All-ones in the 32-bit lanes [0, n) of lanes lo (offset 0) or hi (offset 8).
inline __m256i lane_mask(int64_t n, int offset) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n) - offset), lane_index());
}
inline f32x16 keep_first(f32x16 a, int64_t n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, _mm256_castsi256_ps(lane_mask(n, 0))),
          _mm256_blendv_ps(f, a.hi, _mm256_castsi256_ps(lane_mask(n, 8)))};
}
inline f32x16 round_even(f32x16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n for integral n in [-252, 254], in two exact power-of-two steps: one rounding, as scalef.
inline __m256 scale_pow2(__m256 a, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, f1), f2);
}
inline f32x16 scale_pow2(f32x16 a, f32x16 n) { return {scale_pow2(a.lo, n.lo), scale_pow2(a.hi, n.hi)}; }

inline f32x16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline f32x16 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen8(_mm256_castsi256_si128(raw)), widen8(_mm256_extracti128_si256(raw, 1))};
}
inline f32x16 load_n(const float* p, int64_t n) {
  if (n >= 16) return load16(p);
  return {_mm256_maskload_ps(p, lane_mask(n, 0)), _mm256_maskload_ps(p + 8, lane_mask(n, 8))};
}
inline f32x16 load_n(const bf16* p, int64_t n) {
  if (n >= 16) return load16(p);
  alignas(32) bf16 part[16] = {};
  std::memcpy(part, p, n * sizeof(bf16));
  return load16(part);
}
inline void store16(float* p, f32x16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline __m256i rounded_bits(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
}
inline void store16(bf16* p, f32x16 a) {
  const __m256i lo = _mm256_srli_epi32(rounded_bits(a.lo), 16), hi = _mm256_srli_epi32(rounded_bits(a.hi), 16);
  // packus interleaves 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> lanes in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
inline f32x16 round_bf16(f32x16 a) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(rounded_bits(a.lo), high)),
          _mm256_castsi256_ps(_mm256_and_si256(rounded_bits(a.hi), high))};
}

inline bf16x32 load_pairs(const bf16* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline f32x16 pair_even(bf16x32 w) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w.lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w.hi, 16))};
}
inline f32x16 pair_odd(bf16x32 w) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(w.lo, high)), _mm256_castsi256_ps(_mm256_and_si256(w.hi, high))};
}

// ------------------------------------------------------------------------------------------------
#else  // generic: GCC/Clang vector extensions, scalar loops where they have no operator
#pragma GCC diagnostic ignored "-Wpsabi"  // every function here is inline: no call crosses an ABI boundary
constexpr const char* kIsa = "generic";
constexpr Tiles kTiles{{4, 0, 0}, {4, 0, 0}, 2, 2, 2, 2, 2, 2, 2, 2};

typedef float f32x16 __attribute__((vector_size(64)));  // +, -, *, / are the compiler's vector operators
typedef uint32_t u32x16 __attribute__((vector_size(64)));
using bf16x32 = u32x16;

inline f32x16 zero() { return f32x16{}; }
inline f32x16 set1(float x) { return f32x16{} + x; }
// As maxps/minps: the second operand where either is NaN.
inline f32x16 max(f32x16 a, f32x16 b) {
  for (int i = 0; i < 16; ++i) a[i] = a[i] > b[i] ? a[i] : b[i];
  return a;
}
inline f32x16 min(f32x16 a, f32x16 b) {
  for (int i = 0; i < 16; ++i) a[i] = a[i] < b[i] ? a[i] : b[i];
  return a;
}
inline f32x16 fma(f32x16 a, f32x16 b, f32x16 c) {
  for (int i = 0; i < 16; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
}
inline f32x16 fnma(f32x16 a, f32x16 b, f32x16 c) {
  for (int i = 0; i < 16; ++i) c[i] = std::fma(-a[i], b[i], c[i]);
  return c;
}
inline float reduce_add(f32x16 a) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = a[i + 8] + a[i];
  for (int i = 0; i < 4; ++i) s[i] = s[i + 4] + s[i];
  for (int i = 0; i < 2; ++i) s[i] = s[i] + s[i + 2];
  return s[0] + s[1];
}
inline float reduce_max(f32x16 a) {
  float m = a[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a[i]);
  return m;
}
inline f32x16 keep_first(f32x16 a, int64_t n, float fill) {
  for (int64_t i = n; i < 16; ++i) a[i] = fill;
  return a;
}
inline f32x16 round_even(f32x16 a) {
  for (int i = 0; i < 16; ++i) a[i] = std::nearbyint(a[i]);  // the default rounding mode: to nearest even
  return a;
}
inline f32x16 scale_pow2(f32x16 a, f32x16 n) {
  for (int i = 0; i < 16; ++i) a[i] = std::ldexp(a[i], int(n[i]));
  return a;
}

inline f32x16 load16(const float* p) {
  f32x16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline f32x16 load16(const bf16* p) {
  u32x16 u;
  for (int i = 0; i < 16; ++i) u[i] = uint32_t(p[i].x) << 16;
  return (f32x16)u;
}
inline f32x16 load_n(const float* p, int64_t n) {
  f32x16 r = zero();
  for (int64_t i = 0; i < n; ++i) r[i] = p[i];
  return r;
}
inline f32x16 load_n(const bf16* p, int64_t n) {
  u32x16 u = {};
  for (int64_t i = 0; i < n; ++i) u[i] = uint32_t(p[i].x) << 16;
  return (f32x16)u;
}
inline void store16(float* p, f32x16 a) { std::memcpy(p, &a, sizeof(a)); }
inline u32x16 rounded_bits(f32x16 a) {
  const u32x16 u = (u32x16)a;
  u32x16 r = u + 0x7FFFu + ((u >> 16) & 1u);
  for (int i = 0; i < 16; ++i)
    if (a[i] != a[i]) r[i] = u[i] | 0x00400000u;
  return r;
}
inline void store16(bf16* p, f32x16 a) {
  const u32x16 r = rounded_bits(a) >> 16;
  for (int i = 0; i < 16; ++i) p[i].x = uint16_t(r[i]);
}
inline f32x16 round_bf16(f32x16 a) { return (f32x16)(rounded_bits(a) & 0xFFFF0000u); }

inline bf16x32 load_pairs(const bf16* p) {
  bf16x32 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline f32x16 pair_even(bf16x32 w) { return (f32x16)(w << 16); }
inline f32x16 pair_odd(bf16x32 w) { return (f32x16)(w & 0xFFFF0000u); }
#endif
// ------------------------------------------------------------------------------------------------

#if !defined(CONVEYOR_NATIVE_PAIR_DOT)
// x[2p] and x[2p + 1] in every lane, read from x's float32 copy xf (0 for x[2p + 1] where !whole).
struct PairX {
  f32x16 even, odd;
};
inline PairX pair_x(const bf16*, const float* xf, bool whole) {
  return {set1(xf[0]), whole ? set1(xf[1]) : zero()};
}
inline f32x16 dot_pairs(f32x16 acc, const PairX& x, bf16x32 w) {
  return fma(x.even, pair_even(w), fma(x.odd, pair_odd(w), acc));
}
#endif
// Whether pair_x reads x's bf16 pairs (AVX512-BF16) or a float32 copy of x.
constexpr bool kNativePairDot =
#if defined(CONVEYOR_NATIVE_PAIR_DOT)
    true;
#else
    false;
#endif

// Rounds a float32 vector to T and back: where torch's eager bf16 ops round.
template <typename T> inline f32x16 rnd(f32x16 v) { return v; }
template <> inline f32x16 rnd<bf16>(f32x16 v) { return round_bf16(v); }

// Cephes expf on 16 lanes (about 1 ulp).
inline f32x16 exp16(f32x16 x) {
  x = max(min(x, set1(88.3762626647949f)), set1(-87.3365478515625f));
  const f32x16 n = round_even(x * set1(1.44269504088896341f));
  f32x16 r = fnma(n, set1(0.693359375f), x);
  r = fnma(n, set1(-2.12194440e-4f), r);
  f32x16 p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, r * r, r + set1(1.0f));
  return scale_pow2(p, n);
}

}  // namespace
