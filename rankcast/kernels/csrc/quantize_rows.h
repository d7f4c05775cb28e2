// Rows of activations quantized per token to integers, sixteen lanes at a time, for the integer
// kernels (csrc/gemm_w8a8.cpp: int8 rows; csrc/gemm_q4.cpp: 15-bit rows split in two bytes;
// csrc/gemm_q8.cpp: 15-bit rows as int16).
//
// Why vectorized: a scalar loop (fabs, nearbyint, clamp per element) took longer than the matmul
// it feeds once a batch has a few rows: 32 rows of 1,536 cost 21 us before a W8A8 matmul and 90
// us before a 4-bit one (2-core Zen 5), a third of a 4-bit batch step. The lanes do exactly what
// the scalar definition does, so the integers, and every result built on them, are unchanged:
//   amax = max |x| (a NaN element is skipped, as std::max(amax, NaN) skips it),
//   q = clamp(round-half-even(x * (limit / amax)), -limit, limit)
// (float32 product, rounded by the conversion under the default rounding mode, as nearbyint is).
#pragma once

#include <cstdint>

#include "simd.h"

namespace rankcast {

// The largest integer of a row quantized to 15 bits (csrc/gemm_q4.cpp, csrc/gemm_q8.cpp): its
// rounding, max|x| / 32766 per element, is far below what bfloat16 already rounds.
constexpr int32_t kRow15Max = 16383;
// The largest integer of a row, or block of a row, quantized to 8 bits (csrc/gemm_q6k.cpp).
constexpr int32_t kRow8Max = 127;

#if RANKCAST_SIMD_BITS == 512

struct Ints16 {
  __m512i v;
};
inline Ints16 zero_ints() { return {_mm512_setzero_si512()}; }
inline Ints16 operator+(Ints16 a, Ints16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline Vec16 abs16(Vec16 x) { return {_mm512_abs_ps(x.v)}; }
inline Ints16 scaled_ints(Vec16 x, float inverse, int32_t limit) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x.v, _mm512_set1_ps(inverse)));
  return {_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(limit)), _mm512_set1_epi32(-limit))};
}
inline Ints16 shift_right(Ints16 a, int bits) { return {_mm512_srai_epi32(a.v, bits)}; }
inline Ints16 low_bits(Ints16 a, int32_t mask) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(mask))}; }
inline int32_t lane_sum(Ints16 a) { return _mm512_reduce_add_epi32(a.v); }
// Each lane's low byte / low 16 bits (the values fit).
inline void store_ints(int8_t* p, Ints16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v));
}
inline void store_ints(int16_t* p, Ints16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
}
// max(|x|, m) with m kept where x is NaN (MAXPS returns its second operand then).
inline Vec16 abs_max_step(Vec16 x, Vec16 m) { return {_mm512_max_ps(abs16(x).v, m.v)}; }

#elif RANKCAST_SIMD_BITS == 256

struct Ints16 {
  __m256i lo, hi;
};
inline Ints16 zero_ints() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Ints16 operator+(Ints16 a, Ints16 b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
inline __m256i scaled_ints8(__m256 x, __m256 inverse, int32_t limit) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, inverse));
  return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(limit)), _mm256_set1_epi32(-limit));
}
inline Ints16 scaled_ints(Vec16 x, float inverse, int32_t limit) {
  const __m256 inv = _mm256_set1_ps(inverse);
  return {scaled_ints8(x.lo, inv, limit), scaled_ints8(x.hi, inv, limit)};
}
inline Ints16 shift_right(Ints16 a, int bits) {
  return {_mm256_srai_epi32(a.lo, bits), _mm256_srai_epi32(a.hi, bits)};
}
inline Ints16 low_bits(Ints16 a, int32_t mask) {
  const __m256i m = _mm256_set1_epi32(mask);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline int32_t lane_sum(Ints16 a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}
// The low byte of each of 8 lanes, in order.
inline __m128i low_bytes8(__m256i a) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a, pick),
                                                _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  return _mm256_castsi256_si128(b);
}
inline void store_ints(int8_t* p, Ints16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_unpacklo_epi64(low_bytes8(a.lo), low_bytes8(a.hi)));
}
inline void store_ints(int16_t* p, Ints16 a) {
  // PACKSSDW interleaves the 128-bit halves; the permute puts the 16 values back in order.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8));
}
inline Vec16 abs_max_step(Vec16 x, Vec16 m) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_max_ps(_mm256_andnot_ps(sign, x.lo), m.lo),
          _mm256_max_ps(_mm256_andnot_ps(sign, x.hi), m.hi)};
}

#endif

#if RANKCAST_SIMD_BITS >= 256
// 16 elements of a row from `c`, zero past `k` (float32 or bfloat16, widened exactly).
template <typename T>
inline Vec16 row_chunk(const T* row, int64_t c, int64_t k) {
  const int64_t left = k - c;
  if (left >= 16) return load16(row + c);
  if (left <= 0) return zero16();
  return load16(row + c, static_cast<int>(left));
}

// max |x| over a row of k elements.
template <typename T>
inline float row_abs_max(const T* row, int64_t k) {
  Vec16 m = zero16();
  for (int64_t c = 0; c < k; c += 16) m = abs_max_step(row_chunk(row, c, k), m);
  return reduce_max(m);
}

// A row's quantization to integers in [-limit, limit]: x * inverse rounds to them (`scaled_ints`),
// and they times `scale` give the row back (limit / max|x| and max|x| / limit; 0 for a zero row).
struct RowScale {
  float inverse, scale;
};
template <typename T>
inline RowScale row_scale_of(const T* row, int64_t k, int32_t limit) {
  const float amax = row_abs_max(row, k);
  const float top = static_cast<float>(limit);
  return {amax > 0.0f ? top / amax : 0.0f, amax / top};
}
#endif

}  // namespace rankcast
