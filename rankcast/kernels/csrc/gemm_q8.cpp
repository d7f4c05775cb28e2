// Linear layers with 8-bit weights in groups of 32 k, llama.cpp's Q8_0 arithmetic: each weight is
// w = d * q with q in -127..127 and a float16 scale d per output column and group.
//
// Why: Q8_0 is the GGUF type people pick when 4 bits cost too much quality (and often llama.cpp's
// fastest single stream on these CPUs). Served as it is, a Q8_0 file's weights are its own
// values (quantizing the converted weights finds them again: rankcast/model/quantization.py
// `quantize_q8_0_weight`), at 1.06 bytes a weight; a per-channel int8 requantization (`int8`)
// would round them a second time.
//
// The products are integer, as in csrc/gemm_q4.cpp: each row is quantized per token to 15 bits
// (a = round(x * 16383 / max|x|), csrc/quantize_rows.h) and kept as int16; a group's sum of
// q * a is exact in int32 (VPDPWSSD on AVX512-VNNI, VPMADDWD + VPADDD elsewhere: the same sums),
// then y = scale_x * sum over groups of d * that, in float32, groups in order. Every ISA path
// computes the same integers and the same float operations: one answer on every x86 build, and a
// row's result never depends on the rows beside it (batch-invariant).
//
// Packed per panel of 16 output columns, one record per group of 32 k (kQ8GroupBytes):
//   d[16] float16 | 16 steps of [16 columns][2 k] int8
// so that one step, widened to int16, is one VPDPWSSD operand. A panel is one contiguous stream.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "quantize_rows.h"
#include "simd.h"

namespace rankcast {

namespace {
constexpr int64_t kQ8Group = 32;
constexpr int64_t kQ8Steps = kQ8Group / 2;                 // pairs of k per group
constexpr int64_t kQ8GroupBytes = 2 * 16 + 16 * kQ8Group;  // d, then 16 columns x 32 k
}  // namespace

#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
namespace {

using namespace gemm;

// A row as the tiles read it (row stride `lda` bytes, kp = k rounded up to whole groups):
//   a[kp] int16 | scale_x float32
struct Q8RowLayout {
  int64_t kp;
  int64_t scale() const { return 2 * kp; }
  int64_t bytes() const { return (scale() + 4 + 63) / 64 * 64; }
};

inline int32_t pair_at(const int8_t* row, int64_t k) {  // a[k], a[k + 1] as one int32
  int32_t v;
  std::memcpy(&v, row + 2 * k, sizeof(v));
  return v;
}

inline float row_scale(const int8_t* row, const Q8RowLayout& layout) {
  float v;
  std::memcpy(&v, row + layout.scale(), sizeof(v));
  return v;
}

#if RANKCAST_SIMD_BITS == 512
inline __m512i dot2(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
  return dpwssd(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}

// R rows x NR panels over every group: per step the NR panels' weights are widened once and
// each row's pair of k is broadcast once for all of them (a panel at a time broadcast it NR
// times: batches ran ~1.6x slower than bfloat16's tile). Int32 group sums and float32 sums per
// row and panel: 2 x R x NR registers, so R <= 4 (29 of 32 with 3 panels).
template <int R, int NR, int TileRows>
__attribute__((always_inline)) inline void rows_q8(const int8_t* a, int64_t lda, const int8_t* b,
                                                   int64_t panel_elems, int64_t groups,
                                                   __m512 (&acc)[R][NR], bool prefetch,
                                                   const NextGroup& next, int per_step) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (next.count > 0) prefetch_next<TileRows>(next, g, per_step);
    const int8_t* record[NR];
    for (int j = 0; j < NR; ++j) {
      record[j] = b + j * panel_elems + g * kQ8GroupBytes;
      if (prefetch)
        for (int64_t line = 0; line < kQ8GroupBytes; line += 64)
          prefetch_ahead<TileRows, kGroupOverlapRows>(record[j] + line);
    }
    __m512i sum[R][NR];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NR; ++j) sum[i][j] = _mm512_setzero_si512();
    for (int s = 0; s < kQ8Steps; ++s) {
      __m512i w[NR];
      for (int j = 0; j < NR; ++j)
        w[j] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j] + 32 + 32 * s)));
      for (int i = 0; i < R; ++i) {
        const __m512i av = _mm512_set1_epi32(pair_at(a + i * lda, g * kQ8Group + 2 * s));
        for (int j = 0; j < NR; ++j) sum[i][j] = dot2(sum[i][j], w[j], av);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j])));
      for (int i = 0; i < R; ++i)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][j]), d, acc[i][j]);
    }
  }
}

// MR rows x NR panels: `rows_q8` in the group kernels' sub-tiles (gemm.h). Every row sums in
// the same order whichever sub-tile it lands in.
template <int MR, int NR, bool Next, typename Out>
inline void tile_q8(const int8_t* a, int64_t lda, const int8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup next) {
  const Q8RowLayout layout{groups * kQ8Group};
  const int per_step = lines_per_step(next, groups);
  const auto rows = [&]<int R>(const int8_t* rows_a, __m512 (&acc)[R][NR], bool ahead,
                               const NextGroup& lead) {
    rows_q8<R, NR, MR>(rows_a, lda, b, panel_elems, groups, acc, ahead, lead, per_step);
  };
  const auto scale = [&](const int8_t* row) { return row_scale(row, layout); };
  group_sub_tiles<MR, NR>(rows, scale, a, lda, c, ldc, epi, last_cols, prefetch, next);
}

#else
// AVX2: the same arithmetic on 8-column halves of a panel, in sub-tiles of at most 6 rows (an
// int and a float sum per row, a widened step, a broadcast and the scales: 15 ymm registers).
template <int R, int TileRows>
__attribute__((noinline)) void q8_half(const int8_t* a, int64_t lda, const int8_t* panel,
                                       int64_t groups, int half, __m256* out, bool prefetch) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* record = panel + g * kQ8GroupBytes;
    if (prefetch)
      for (int64_t line = 0; line < kQ8GroupBytes; line += 64)
        prefetch_ahead<TileRows, kGroupOverlapRows>(record + line);
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 16 * half)));
    __m256i sum[R];
    for (int i = 0; i < R; ++i) sum[i] = _mm256_setzero_si256();
    for (int s = 0; s < kQ8Steps; ++s) {
      const __m256i w = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 32 + 32 * s + 16 * half)));
      for (int i = 0; i < R; ++i) {
        const __m256i av = _mm256_set1_epi32(pair_at(a + i * lda, g * kQ8Group + 2 * s));
        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(w, av));
      }
    }
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), d, acc[i]);
  }
  for (int i = 0; i < R; ++i) out[i] = acc[i];
}

template <int MR, int NR, bool Next, typename Out>
inline void tile_q8(const int8_t* a, int64_t lda, const int8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup /*next: the AVX2 tile only reads ahead*/) {
  const Q8RowLayout layout{groups * kQ8Group};
  __m256 halves[2][MR];
  for (int j = 0; j < NR; ++j) {
    const int8_t* panel = b + j * panel_elems;
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < MR; r += 6) {
        const int8_t* rows = a + r * lda;
        __m256* out = halves[half] + r;
        const bool lead = prefetch && r == 0 && half == 0;
        switch (std::min(6, MR - r)) {
          case 1: q8_half<1, MR>(rows, lda, panel, groups, half, out, lead); break;
          case 2: q8_half<2, MR>(rows, lda, panel, groups, half, out, lead); break;
          case 3: q8_half<3, MR>(rows, lda, panel, groups, half, out, lead); break;
          case 4: q8_half<4, MR>(rows, lda, panel, groups, half, out, lead); break;
          case 5: q8_half<5, MR>(rows, lda, panel, groups, half, out, lead); break;
          default: q8_half<6, MR>(rows, lda, panel, groups, half, out, lead); break;
        }
      }
    }
    const int cols = j == NR - 1 ? last_cols : kPanel;
    for (int i = 0; i < MR; ++i) {
      const __m256 scale = _mm256_set1_ps(row_scale(a + i * lda, layout));
      const Vec16 v{_mm256_mul_ps(halves[0][i], scale), _mm256_mul_ps(halves[1][i], scale)};
      epi.store(c + i * ldc + j * kPanel, v, i, j, cols);
    }
  }
}
#endif

template <typename Out_>
struct Q8Tiles {
  static constexpr int kOverlapRows = kGroupOverlapRows;
  using In = int8_t;
  using W = int8_t;
  using Out = Out_;
  using Epi = BiasEpilogue;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<Q8Tiles, Next>::Fn;
    return Fn{&tile_q8<MR, NR, Next, Out>};
  }
};

// Rows [begin, end) of x quantized into the Q8RowLayout buffer `out` (row stride
// layout.bytes()): 15-bit integers as int16, zero past k, then the row's scale.
template <typename T>
void quantize_rows_q8(const T* x, int64_t ldx, int64_t k, int64_t begin, int64_t end,
                      const Q8RowLayout& layout, int8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    const T* src = x + i * ldx;
    int8_t* row = out + i * layout.bytes();
    const auto [inverse, scale] = row_scale_of(src, k, kRow15Max);
    auto* values = reinterpret_cast<int16_t*>(row);
    for (int64_t c = 0; c < layout.kp; c += 16)
      store_ints(values + c, scaled_ints(row_chunk(src, c, k), inverse, kRow15Max));
    std::memcpy(row + layout.scale(), &scale, sizeof(scale));
  }
}

}  // namespace
#endif

bool q8_supported() {
#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_q8_weight(const at::Tensor& values, const at::Tensor& scales) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar,
              "pack_q8_weight: values must be int8 [out, in]");
  const int64_t n = values.size(0), k = values.size(1);
  TORCH_CHECK(k % kQ8Group == 0, "pack_q8_weight: in (", k, ") must be whole groups of 32");
  const int64_t groups = k / kQ8Group, panels = (n + 15) / 16;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.sizes() == at::IntArrayRef({n, groups}),
              "pack_q8_weight: scales must be float16 [out, in / 32]");
  const at::Tensor q = values.contiguous(), d = scales.contiguous();
  // Columns past n get zero scales and weights.
  at::Tensor packed = at::zeros({panels, groups, kQ8GroupBytes}, q.options());
  const int8_t* qv = q.data_ptr<int8_t>();
  const uint16_t* dv = static_cast<const uint16_t*>(d.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(16, n - p * 16);
      for (int64_t g = 0; g < groups; ++g) {
        int8_t* record = packed.data_ptr<int8_t>() + (p * groups + g) * kQ8GroupBytes;
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t row = p * 16 + c;
          std::memcpy(record + 2 * c, dv + row * groups + g, 2);
          const int8_t* src = qv + row * k + g * kQ8Group;
          for (int64_t s = 0; s < kQ8Steps; ++s) {
            record[32 + 32 * s + 2 * c] = src[2 * s];
            record[32 + 32 * s + 2 * c + 1] = src[2 * s + 1];
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "q8_linear: x must be [rows, in], unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q8_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kQ8GroupBytes,
              "q8_linear: weight not packed by pack_q8_weight");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(1);
  TORCH_CHECK((k + kQ8Group - 1) / kQ8Group == groups && packed.size(0) == (n + 15) / 16,
              "q8_linear: weight packed for another shape");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor bias_f = gemm::bias_as_float(bias, n, "q8_linear");
#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
  const Q8RowLayout layout{groups * kQ8Group};
  const auto quantize = [&](const auto* src, int64_t begin, int64_t end, int8_t* out) {
    quantize_rows_q8(src, x.stride(0), k, begin, end, layout, out);
  };
  gemm::quantized_rows_linear<Q8Tiles>(x, layout.bytes(), quantize, packed.data_ptr<int8_t>(), n,
                                       groups, packed.stride(0),
                                       BiasEpilogue{gemm::float_data(bias_f)}, y);
  return y;
#else
  TORCH_CHECK(false, "q8_linear: this CPU build has no 8-bit group kernel");
#endif
}

}  // namespace rankcast
