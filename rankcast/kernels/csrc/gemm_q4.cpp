// Linear layers with 4-bit weights in groups of 32 k, llama.cpp's Q4_1 arithmetic: each weight is
// w = d * q + m with q in 0..15 and a float16 scale d and minimum m per output column and group.
//
// Why: a single stream reads every weight once per token, so its speed is the bytes it reads;
// 4-bit groups are 0.625 bytes a weight (bfloat16: 2, int8: ~1). The embedded SmolLM2 GGUF ships
// in exactly this form, so quantizing its weights this way finds the file's own values again
// (rankcast/model/quantization.py `quantize_q4_1_weight`): the model is served as it was published.
//
// The products are integer. Each row is quantized per token to 15 bits (a = round(x * 16383 /
// max|x|), an error of at most max|x| / 32766 per element, far below bfloat16's rounding) and
// split a = 128 * hi + lo (hi signed, lo in 0..127), so that unsigned 4-bit weights meet signed
// bytes in VPDPBUSD (AVX512-VNNI; elsewhere VPMADDUBSW + VPMADDWD, the same sums: no pair of
// products reaches the int16 limit). A group's sum is 128 * sum(q * hi) + sum(q * lo), exact in
// int32; then y = scale_x * sum over groups of (d * that + m * sum(a)), in float32, groups in
// order. Every ISA path computes the same integers and the same float operations: one answer on
// every x86 build, and a row's result never depends on the rows beside it (batch-invariant).
// Rebuilding each weight in float32 registers instead (fma(q, d, m)) took ~4x the instructions
// per weight and kept a single stream compute-bound.
//
// Packed per panel of 16 output columns, one record per group of 32 k (kQ4GroupBytes):
//   d[16] float16 | m[16] float16 | 4 chunks of 64 bytes
// chunk t's byte 4c + j holds column c's q at k = 8t + j (low nibble) and 8t + 4 + j (high), so
// one chunk is two VPDPBUSD operands of 16 columns x 4 k. A panel is one contiguous stream.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "quantize_rows.h"
#include "simd.h"

namespace rankcast {

namespace {
constexpr int64_t kQ4Group = 32;
constexpr int64_t kQ4GroupBytes = 2 * 16 * 2 + 4 * 64;  // d and m, then 4 chunks
constexpr int kActivationMax = kRow15Max;  // rows quantized to 15 bits: 128 * hi + lo
}  // namespace

#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
namespace {

using namespace gemm;

// A row as the tiles read it (row stride `lda` bytes, kp = k rounded up to whole groups):
//   hi[kp] int8 | lo[kp] int8 | group sums of a [groups] float32 | scale_x float32
struct RowLayout {
  int64_t kp, groups;
  int64_t hi() const { return 0; }
  int64_t lo() const { return kp; }
  int64_t sums() const { return 2 * kp; }
  int64_t scale() const { return 2 * kp + 4 * groups; }
  int64_t bytes() const { return (scale() + 4 + 63) / 64 * 64; }
};

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float row_float(const int8_t* row, int64_t offset) {
  float v;
  std::memcpy(&v, row + offset, sizeof(v));
  return v;
}

#if RANKCAST_SIMD_BITS == 512
// acc + the four-byte dot products of unsigned w and signed a, per int32 lane.
inline __m512i dot4(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
  return dpbusd(acc, w, a);
#else
  const __m512i pairs = _mm512_maddubs_epi16(w, a);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

// Quad `q` (0..7: k 4q..4q+3) of a group's 4-bit weights for NR panels, one byte per weight:
// chunk q / 2's low nibbles for even q, its high ones for odd.
template <int NR>
__attribute__((always_inline)) inline void unpack_quad(const uint8_t* const* record, int q,
                                                        __m512i (&w)[NR]) {
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int j = 0; j < NR; ++j) {
    const __m512i v = _mm512_loadu_si512(record[j] + 64 + 64 * (q / 2));
    w[j] = _mm512_and_si512(q % 2 == 0 ? v : _mm512_srli_epi16(v, 4), nibble);
  }
}

// R rows x NR panels over every group: per quad of k, the NR panels' 4-bit weights are unpacked
// once and each row's four bytes broadcast once for all of them (a panel at a time broadcast
// them NR times, and batches paid for it). Per group a row runs its hi pass, a shift, its lo
// pass (one or two rows: both in one pass, below), then the group's float terms: the same
// integers and float operations in the same order as ever. Registers: R x NR int and float sums,
// NR weights, a broadcast, the nibble mask: R <= 4.
template <int R, int NR, int TileRows>
__attribute__((always_inline)) inline void rows_q4(const int8_t* a, int64_t lda, const uint8_t* b,
                                                   int64_t panel_elems, int64_t groups,
                                                   __m512 (&acc)[R][NR], bool prefetch,
                                                   const NextGroup& next, int per_step) {
  const RowLayout layout{groups * kQ4Group, groups};
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (next.count > 0) prefetch_next<TileRows>(next, g, per_step);
    const uint8_t* record[NR];
    for (int j = 0; j < NR; ++j) {
      record[j] = b + j * panel_elems + g * kQ4GroupBytes;
      if (prefetch)
        for (int64_t line = 0; line < kQ4GroupBytes; line += 64)
          prefetch_ahead<TileRows, kGroupOverlapRows>(record[j] + line);
    }
    __m512i sum[R][NR];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NR; ++j) sum[i][j] = _mm512_setzero_si512();
    if constexpr (R <= 2) {
      // One or two rows (a decode): the hi and lo passes share each unpacked weight quad, the
      // lo sums kept apart and added to the shifted hi sums at the end (the same int32 as the
      // two passes). Half the weight loads and unpacks; on the 2-core Zen 4 the q4_1 decode
      // step went 3.97 -> 3.82 ms (best of 6 rounds, builds alternated; faster in 8 of 10
      // paired rounds over two runs). More rows have no registers for the second sums.
      const int64_t hi_bytes = layout.hi() + g * kQ4Group, lo_bytes = layout.lo() + g * kQ4Group;
      __m512i low[R][NR];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NR; ++j) low[i][j] = _mm512_setzero_si512();
      for (int q = 0; q < 8; ++q) {
        __m512i w[NR];
        unpack_quad(record, q, w);
        for (int i = 0; i < R; ++i) {
          const __m512i ah = _mm512_set1_epi32(four_bytes(a + i * lda + hi_bytes + 4 * q));
          const __m512i al = _mm512_set1_epi32(four_bytes(a + i * lda + lo_bytes + 4 * q));
          for (int j = 0; j < NR; ++j) {
            sum[i][j] = dot4(sum[i][j], w[j], ah);
            low[i][j] = dot4(low[i][j], w[j], al);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < NR; ++j)
          sum[i][j] = _mm512_add_epi32(_mm512_slli_epi32(sum[i][j], 7), low[i][j]);
    } else {
      for (int pass = 0; pass < 2; ++pass) {  // the rows' high bytes, then their low bytes
        if (pass == 1)
          for (int i = 0; i < R; ++i)
            for (int j = 0; j < NR; ++j) sum[i][j] = _mm512_slli_epi32(sum[i][j], 7);
        const int64_t bytes = (pass == 0 ? layout.hi() : layout.lo()) + g * kQ4Group;
        for (int q = 0; q < 8; ++q) {
          __m512i w[NR];
          unpack_quad(record, q, w);
          for (int i = 0; i < R; ++i) {
            const __m512i av = _mm512_set1_epi32(four_bytes(a + i * lda + bytes + 4 * q));
            for (int j = 0; j < NR; ++j) sum[i][j] = dot4(sum[i][j], w[j], av);
          }
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j])));
      const __m512 m =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j] + 32)));
      for (int i = 0; i < R; ++i) {
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][j]), d, acc[i][j]);
        const float group_sum = row_float(a + i * lda, layout.sums() + 4 * g);
        acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(group_sum), m, acc[i][j]);
      }
    }
  }
}

// MR rows x NR panels: `rows_q4` in the group kernels' sub-tiles (gemm.h).
template <int MR, int NR, bool Next, typename Out>
inline void tile_q4(const int8_t* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup next) {
  const RowLayout layout{groups * kQ4Group, groups};
  const int per_step = lines_per_step(next, groups);
  const auto rows = [&]<int R>(const int8_t* rows_a, __m512 (&acc)[R][NR], bool ahead,
                               const NextGroup& lead) {
    rows_q4<R, NR, MR>(rows_a, lda, b, panel_elems, groups, acc, ahead, lead, per_step);
  };
  const auto scale = [&](const int8_t* row) { return row_float(row, layout.scale()); };
  group_sub_tiles<MR, NR>(rows, scale, a, lda, c, ldc, epi, last_cols, prefetch, next);
}

#else
// AVX2: the same arithmetic on 8-column halves of a panel, in sub-tiles of at most 3 rows (an
// int and a float sum per row, 8 unpacked weight quads, 1 broadcast: 15 ymm registers).
inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
  const __m256i pairs = _mm256_maddubs_epi16(w, a);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int R, int TileRows>
__attribute__((noinline)) void q4_half(const int8_t* a, int64_t lda, const uint8_t* panel,
                                       int64_t groups, int half, __m256* out, bool prefetch) {
  const RowLayout layout{groups * kQ4Group, groups};
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = panel + g * kQ4GroupBytes;
    if (prefetch)
      for (int64_t line = 0; line < kQ4GroupBytes; line += 64)
        prefetch_ahead<TileRows, kGroupOverlapRows>(record + line);
    __m256i w[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 64 + 64 * t + 32 * half));
      w[2 * t] = _mm256_and_si256(v, nibble);
      w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 16 * half)));
    const __m256 m =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 32 + 16 * half)));
    for (int i = 0; i < R; ++i) {
      const int8_t* row = a + i * lda;
      const int8_t* hi = row + layout.hi() + g * kQ4Group;
      const int8_t* lo = row + layout.lo() + g * kQ4Group;
      __m256i sum = _mm256_setzero_si256();
      for (int q = 0; q < 8; ++q) sum = dot4(sum, w[q], _mm256_set1_epi32(four_bytes(hi + 4 * q)));
      sum = _mm256_slli_epi32(sum, 7);
      for (int q = 0; q < 8; ++q) sum = dot4(sum, w[q], _mm256_set1_epi32(four_bytes(lo + 4 * q)));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc[i]);
      const float group_sum = row_float(row, layout.sums() + 4 * g);
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(group_sum), m, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = acc[i];
}

template <int MR, int NR, bool Next, typename Out>
inline void tile_q4(const int8_t* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup /*next: the AVX2 tile only reads ahead*/) {
  const RowLayout layout{groups * kQ4Group, groups};
  __m256 halves[2][MR];
  for (int j = 0; j < NR; ++j) {
    const uint8_t* panel = b + j * panel_elems;
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < MR; r += 3) {
        const int8_t* rows = a + r * lda;
        __m256* out = halves[half] + r;
        const bool lead = prefetch && r == 0 && half == 0;
        switch (std::min(3, MR - r)) {
          case 1: q4_half<1, MR>(rows, lda, panel, groups, half, out, lead); break;
          case 2: q4_half<2, MR>(rows, lda, panel, groups, half, out, lead); break;
          default: q4_half<3, MR>(rows, lda, panel, groups, half, out, lead); break;
        }
      }
    }
    const int cols = j == NR - 1 ? last_cols : kPanel;
    for (int i = 0; i < MR; ++i) {
      const __m256 scale = _mm256_set1_ps(row_float(a + i * lda, layout.scale()));
      const Vec16 v{_mm256_mul_ps(halves[0][i], scale), _mm256_mul_ps(halves[1][i], scale)};
      epi.store(c + i * ldc + j * kPanel, v, i, j, cols);
    }
  }
}
#endif

template <typename Out_>
struct Q4Tiles {
  static constexpr int kOverlapRows = kGroupOverlapRows;
  using In = int8_t;
  using W = uint8_t;
  using Out = Out_;
  using Epi = BiasEpilogue;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<Q4Tiles, Next>::Fn;
    return Fn{&tile_q4<MR, NR, Next, Out>};
  }
};

// Rows [begin, end) of x quantized into the RowLayout buffer `out` (row stride layout.bytes()),
// sixteen lanes at a time (csrc/quantize_rows.h: the same integers as element by element).
template <typename T>
void quantize_rows_q4(const T* x, int64_t ldx, int64_t k, int64_t begin, int64_t end,
                      const RowLayout& layout, int8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    const T* src = x + i * ldx;
    int8_t* row = out + i * layout.bytes();
    const auto [inverse, scale] = row_scale_of(src, k, kActivationMax);
    for (int64_t g = 0; g < layout.groups; ++g) {
      Ints16 sum = zero_ints();
      for (int64_t c = g * kQ4Group; c < (g + 1) * kQ4Group; c += 16) {
        const Ints16 v = scaled_ints(row_chunk(src, c, k), inverse, kActivationMax);
        store_ints(row + layout.hi() + c, shift_right(v, 7));  // floor(v / 128)
        store_ints(row + layout.lo() + c, low_bits(v, 127));
        sum = sum + v;
      }
      const float group_sum = static_cast<float>(lane_sum(sum));  // exact: |sum| <= 32 * 16383
      std::memcpy(row + layout.sums() + 4 * g, &group_sum, sizeof(group_sum));
    }
    std::memcpy(row + layout.scale(), &scale, sizeof(scale));
  }
}

}  // namespace
#endif

bool q4_supported() {
#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_q4_weight(const at::Tensor& values, const at::Tensor& scales,
                          const at::Tensor& minimums) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte,
              "pack_q4_weight: values must be uint8 [out, in] in 0..15");
  const int64_t n = values.size(0), k = values.size(1);
  TORCH_CHECK(k % kQ4Group == 0, "pack_q4_weight: in (", k, ") must be whole groups of 32");
  const int64_t groups = k / kQ4Group, panels = (n + 15) / 16;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && minimums.scalar_type() == at::kHalf &&
                  scales.sizes() == at::IntArrayRef({n, groups}) &&
                  minimums.sizes() == at::IntArrayRef({n, groups}),
              "pack_q4_weight: scales and minimums must be float16 [out, in / 32]");
  const at::Tensor q = values.contiguous(), d = scales.contiguous(), m = minimums.contiguous();
  // Columns past n get zero scale and minimum: their weights are 0.
  at::Tensor packed = at::zeros({panels, groups, kQ4GroupBytes}, q.options());
  const uint8_t* qv = q.data_ptr<uint8_t>();
  const uint16_t* dv = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* mv = static_cast<const uint16_t*>(m.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(16, n - p * 16);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* record = packed.data_ptr<uint8_t>() + (p * groups + g) * kQ4GroupBytes;
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t row = p * 16 + c;
          std::memcpy(record + 2 * c, dv + row * groups + g, 2);
          std::memcpy(record + 32 + 2 * c, mv + row * groups + g, 2);
          const uint8_t* src = qv + row * k + g * kQ4Group;
          for (int64_t t = 0; t < 4; ++t)
            for (int64_t j = 0; j < 4; ++j)
              record[64 + 64 * t + 4 * c + j] = static_cast<uint8_t>(
                  (src[8 * t + j] & 15) | ((src[8 * t + 4 + j] & 15) << 4));
        }
      }
    }
  });
  return packed;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "q4_linear: x must be [rows, in], unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q4_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kQ4GroupBytes,
              "q4_linear: weight not packed by pack_q4_weight");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(1);
  TORCH_CHECK((k + kQ4Group - 1) / kQ4Group == groups && packed.size(0) == (n + 15) / 16,
              "q4_linear: weight packed for another shape");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor bias_f = gemm::bias_as_float(bias, n, "q4_linear");
#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
  const RowLayout layout{groups * kQ4Group, groups};
  const auto quantize = [&](const auto* src, int64_t begin, int64_t end, int8_t* out) {
    quantize_rows_q4(src, x.stride(0), k, begin, end, layout, out);
  };
  gemm::quantized_rows_linear<Q4Tiles>(x, layout.bytes(), quantize, packed.data_ptr<uint8_t>(), n,
                                       groups, packed.stride(0),
                                       BiasEpilogue{gemm::float_data(bias_f)}, y);
  return y;
#else
  TORCH_CHECK(false, "q4_linear: this CPU build has no 4-bit kernel");
#endif
}

}  // namespace rankcast
