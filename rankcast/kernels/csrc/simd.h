// Sixteen-lane float32 vectors over float32 or bfloat16 memory, for the CPU kernels.
//
// Every kernel computes in float32 and rounds once when it stores, whatever the tensor dtype, so
// bfloat16 results are as close to the float32 ones as one rounding allows. With AVX-512 each
// Vec16 is one zmm register; with AVX2 and FMA (Zen 2/3, Haswell to Ice Lake clients) a pair of
// ymm registers; elsewhere a plain array the compiler vectorizes as it can, so the same kernel
// source builds (more slowly) on any machine.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// Which Vec16 this build has: 512 (one zmm), 256 (two ymm) or 0 (plain array).
#if defined(__AVX512F__)
#define RANKCAST_SIMD_BITS 512
#elif defined(__AVX2__) && defined(__FMA__)
#define RANKCAST_SIMD_BITS 256
#else
#define RANKCAST_SIMD_BITS 0
#endif

// Whether an AVX512-BF16 build does the bfloat16 dot products of pairs (VDPBF16PS's odd-then-even
// sums) on float32 FMAs instead: set by CPU vendor where the instruction issues at half the rate
// of two FMAs (rankcast/kernels/__init__.py, VENDOR_CFLAGS; csrc/gemm.cpp's `tile_pairs_fma`).
#ifndef RANKCAST_BF16_PAIRS_ON_FMA
#define RANKCAST_BF16_PAIRS_ON_FMA 0
#endif

namespace rankcast {

using bf16 = c10::BFloat16;
using fp8e4m3 = c10::Float8_e4m3fn;
using fp8e5m2 = c10::Float8_e5m2;

// An 8-bit KV cache's bytes as float32 (csrc/attention.cpp): int8 sign-extended; an fp8 byte
// s|e|m placed in a float's bits as s|0..0e|m.. and multiplied by 2^(127 - bias), which gives
// its value exactly, subnormals included (a float subnormal times a power of two is exact).
// NaN and infinity are not decoded: the cache never holds them (writes are scaled to the
// format's largest finite value).
constexpr int kE4m3Shift = 20, kE5m2Shift = 21;  // where the 7 bits below the sign go
constexpr float kE4m3Unbias = 1.329227995784916e+36f;  // 2^120
constexpr float kE5m2Unbias = 5.192296858534828e+33f;  // 2^112
template <typename K>
struct Fp8Decode;
template <>
struct Fp8Decode<fp8e4m3> {
  static constexpr int shift = kE4m3Shift;
  static constexpr float unbias = kE4m3Unbias;
};
template <>
struct Fp8Decode<fp8e5m2> {
  static constexpr int shift = kE5m2Shift;
  static constexpr float unbias = kE5m2Unbias;
};

// Up to 16 bytes from p (n of them; the rest zero), never reading past p + n.
inline void copy_bytes16(uint8_t (&tmp)[16], const void* p, int n) {
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, p, static_cast<size_t>(n < 0 ? 0 : (n > 16 ? 16 : n)));
}

// exp(x) = 2^k * P(r), r = x - k ln2 (ln2 in two parts, so r is exact), for every ISA below:
// inputs clamped to [kExpMin, kExpMax]; P's coefficients from the highest power down, the last
// two terms (r^2/2 + r + 1) added at the end.
constexpr float kExpMin = -104.0f, kExpMax = 88.7f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if RANKCAST_SIMD_BITS == 512

struct Vec16 {
  __m512 v;
};

inline __mmask16 tail_mask(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline Vec16 zero16() { return {_mm512_setzero_ps()}; }
inline Vec16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load16(const float* p, int n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
inline Vec16 widen(__m256i h) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline Vec16 load16(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec16 load16(const bf16* p, int n) {
  return widen(_mm256_maskz_loadu_epi16(tail_mask(n), p));
}
inline __m128i bytes16(const void* p, int n) {
  if (n >= 16) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  uint8_t tmp[16];
  copy_bytes16(tmp, p, n);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline Vec16 load16(const int8_t* p, int n = 16) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(p, n)))};
}
template <typename K>
inline Vec16 decode_fp8(__m128i b) {
  const __m512i x = _mm512_cvtepu8_epi32(b);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i rest = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)),
                                         Fp8Decode<K>::shift);
  return {_mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, rest)),
                        _mm512_set1_ps(Fp8Decode<K>::unbias))};
}
inline Vec16 load16(const fp8e4m3* p, int n = 16) { return decode_fp8<fp8e4m3>(bytes16(p, n)); }
inline Vec16 load16(const fp8e5m2* p, int n = 16) { return decode_fp8<fp8e5m2>(bytes16(p, n)); }

inline __m256i narrow(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  // Round to nearest even, as the hardware instruction and c10::BFloat16 do (NaN stays NaN).
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
inline void store16(float* p, Vec16 x) { _mm512_storeu_ps(p, x.v); }
inline void store16(float* p, Vec16 x, int n) { _mm512_mask_storeu_ps(p, tail_mask(n), x.v); }
inline void store16(bf16* p, Vec16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(x.v));
}
inline void store16(bf16* p, Vec16 x, int n) { _mm256_mask_storeu_epi16(p, tail_mask(n), narrow(x.v)); }

#if defined(__AVX512VNNI__)
// acc + the dot products of VPDPBUSD (unsigned bytes of w times signed bytes of a, four per
// int32 lane) / VPDPWSSD (int16 pairs), the accumulator updated in its own register. Through
// GCC 12's intrinsics the accumulator was not kept in the instruction's destination: each one was
// copied in and out around every instruction, and a register tile of 24 then spilled to the
// stack (the W8A8 tile at batch 32 ran no faster than bfloat16's, which does half the work an
// instruction).
inline __m512i dpbusd(__m512i acc, __m512i w, __m512i a) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
  return acc;
}
inline __m512i dpwssd(__m512i acc, __m512i w, __m512i a) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
  return acc;
}
#endif

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(Vec16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec16 a) { return _mm512_reduce_max_ps(a.v); }
// Lanes at or beyond `n` become `fill`.
inline Vec16 keep_first(Vec16 a, int n, float fill) {
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), tail_mask(n), a.v)};
}

// exp(x) for float32 lanes: 2^k * P(r) after range reduction, ~2 ulp; exp(-inf) is exactly 0,
// which the masked softmax relies on.
inline Vec16 exp16(Vec16 x) {
  __m512 v = _mm512_max_ps(x.v, _mm512_set1_ps(kExpMin));
  v = _mm512_min_ps(v, _mm512_set1_ps(kExpMax));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), v);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 result = _mm512_scalef_ps(p, k);
  __mmask16 under = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  return {_mm512_mask_mov_ps(result, under, _mm512_setzero_ps())};
}

#elif RANKCAST_SIMD_BITS == 256

// Two ymm registers: lanes 0-7 in `lo`, 8-15 in `hi`.
struct Vec16 {
  __m256 lo, hi;
};

// All-ones in the 32-bit lanes below `n` (of 8), as AVX2's masked loads and stores take them.
inline __m256i lane_mask8(int n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
}

inline Vec16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec16 load16(const float* p, int n) {
  if (n >= 16) return load16(p);
  // Masked lanes are not read, so a row's tail never touches memory past its end.
  return {_mm256_maskload_ps(p, lane_mask8(n)), _mm256_maskload_ps(p + 8, lane_mask8(n - 8))};
}
inline __m256 widen8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec16 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen8(_mm256_castsi256_si128(h)), widen8(_mm256_extracti128_si256(h, 1))};
}
inline Vec16 load16(const bf16* p, int n) {
  if (n >= 16) return load16(p);
  uint16_t tmp[16] = {};
  std::memcpy(tmp, p, static_cast<size_t>(n < 0 ? 0 : n) * sizeof(uint16_t));
  return load16(reinterpret_cast<const bf16*>(tmp));
}
inline __m128i bytes16(const void* p, int n) {
  if (n >= 16) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  uint8_t tmp[16];
  copy_bytes16(tmp, p, n);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline Vec16 load16(const int8_t* p, int n = 16) {
  const __m128i b = bytes16(p, n);
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
template <typename K>
inline __m256 decode_fp8_8(__m128i b) {
  const __m256i x = _mm256_cvtepu8_epi32(b);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)),
                                         Fp8Decode<K>::shift);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, rest)),
                       _mm256_set1_ps(Fp8Decode<K>::unbias));
}
template <typename K>
inline Vec16 decode_fp8(__m128i b) {
  return {decode_fp8_8<K>(b), decode_fp8_8<K>(_mm_srli_si128(b, 8))};
}
inline Vec16 load16(const fp8e4m3* p, int n = 16) { return decode_fp8<fp8e4m3>(bytes16(p, n)); }
inline Vec16 load16(const fp8e5m2* p, int n = 16) { return decode_fp8<fp8e5m2>(bytes16(p, n)); }

// float32 -> bfloat16 bits in the low half of each 32-bit lane, rounded to nearest even as
// c10::BFloat16 rounds (NaN stays NaN).
inline __m256i narrow8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_srli_epi32(rounded, 16);
}
inline __m256i narrow(Vec16 x) {
  // packus interleaves the 128-bit halves; the permute puts lanes 0-15 back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(narrow8(x.lo), narrow8(x.hi)), 0xD8);
}
inline void store16(float* p, Vec16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void store16(float* p, Vec16 x, int n) {
  if (n >= 16) return store16(p, x);
  _mm256_maskstore_ps(p, lane_mask8(n), x.lo);
  _mm256_maskstore_ps(p + 8, lane_mask8(n - 8), x.hi);
}
inline void store16(bf16* p, Vec16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(x));
}
inline void store16(bf16* p, Vec16 x, int n) {
  if (n >= 16) return store16(p, x);
  uint16_t tmp[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp), narrow(x));
  std::memcpy(p, tmp, static_cast<size_t>(n < 0 ? 0 : n) * sizeof(uint16_t));
}

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 max(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_add(Vec16 a) { return reduce_add8(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(Vec16 a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Lanes at or beyond `n` become `fill`.
inline Vec16 keep_first(Vec16 a, int n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, _mm256_castsi256_ps(lane_mask8(n))),
          _mm256_blendv_ps(f, a.hi, _mm256_castsi256_ps(lane_mask8(n - 8)))};
}

// exp(x), the same range reduction and polynomial as the AVX-512 version (~2 ulp). AVX2 has no
// scalef: 2^k is built from exponent bits in two halves, each a normal float even where their
// product is subnormal, so the result rounds once, as scalef's does. exp(-inf) is exactly 0.
inline __m256 exp8(__m256 x) {
  __m256 v = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  v = _mm256_min_ps(v, _mm256_set1_ps(kExpMax));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), v);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ki = _mm256_cvtps_epi32(k);  // k is integral, in [-151, 128]
  const __m256i k1 = _mm256_srai_epi32(ki, 1);
  const __m256i k2 = _mm256_sub_epi32(ki, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  const __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, result);
}
inline Vec16 exp16(Vec16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#else  // portable fallback: the same interface over plain arrays

struct Vec16 {
  float v[16];
};

inline Vec16 splat(float x) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline Vec16 zero16() { return splat(0.0f); }
template <typename T>
inline Vec16 load16(const T* p, int n = 16) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  return r;
}
template <typename T>
inline void store16(T* p, Vec16 x, int n = 16) {
  for (int i = 0; i < n && i < 16; ++i) p[i] = static_cast<T>(x.v[i]);
}
#define RANKCAST_LANEWISE(op)                          \
  inline Vec16 operator op(Vec16 a, Vec16 b) {         \
    Vec16 r;                                           \
    for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] op b.v[i]; \
    return r;                                          \
  }
RANKCAST_LANEWISE(+)
RANKCAST_LANEWISE(-)
RANKCAST_LANEWISE(*)
RANKCAST_LANEWISE(/)
#undef RANKCAST_LANEWISE
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline Vec16 max(Vec16 a, Vec16 b) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return r;
}
inline float reduce_add(Vec16 a) {
  float s = 0.0f;
  for (float x : a.v) s += x;
  return s;
}
inline float reduce_max(Vec16 a) {
  float m = a.v[0];
  for (float x : a.v) m = x > m ? x : m;
  return m;
}
inline Vec16 keep_first(Vec16 a, int n, float fill) {
  for (int i = n; i < 16; ++i) a.v[i] = fill;
  return a;
}
inline Vec16 exp16(Vec16 x) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

#endif

}  // namespace rankcast
