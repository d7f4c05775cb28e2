// Linear layers with 4-bit weights in groups of 32 k, llama.cpp's Q4_1 arithmetic: each weight is
// w = d * q + m with q in 0..15 and a float16 scale d and minimum m per output column and group.
//
// Why: a single stream reads every weight once per token, so its speed is the bytes it reads;
// 4-bit groups are 0.625 bytes a weight (bfloat16: 2, int8: ~1). The embedded SmolLM2 GGUF ships
// in exactly this form, so quantizing its weights this way finds the file's own values again
// (rankcast/model/ops.py `quantize_q4_1_weight`): the model is served as it was published.
//
// Packed per panel of 16 output columns, one record per group of 32 k (kQ4GroupBytes):
//   d[16] float16 | m[16] float16 | 16 pairs of k x 16 columns, one byte each: q[k] | q[k+1] << 4
// so a panel is one contiguous stream the thread reads front to back. Rows are float32 (bfloat16
// rows converted once, exactly); each weight is rebuilt as fma(q, d, m) in registers and the
// products summed in k order, whatever the number of rows: batch-invariant like the float kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "simd.h"

namespace rankcast {

namespace {
constexpr int64_t kQ4Group = 32;
constexpr int64_t kQ4GroupBytes = 2 * 16 * 2 + 16 * 16;  // d and m, then 16 pairs x 16 columns
}  // namespace

#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
namespace {

using namespace gemm;

// 16 float16 values as float32 lanes.
inline Vec16 load_half16(const uint8_t* p) {
#if RANKCAST_SIMD_BITS == 512
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
#else
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
#endif
}

// The 16 columns' weights at k and k + 1 from their 16 bytes: fma(q, d, m).
inline void unpack_pair(const uint8_t* p, Vec16 d, Vec16 m, Vec16& w0, Vec16& w1) {
#if RANKCAST_SIMD_BITS == 512
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
  const __m512i high = _mm512_srli_epi32(bytes, 4);
  w0 = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(low), d.v, m.v)};
  w1 = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(high), d.v, m.v)};
#else
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i fifteen = _mm256_set1_epi32(15);
  w0 = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, fifteen)), d.lo, m.lo),
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, fifteen)), d.hi, m.hi)};
  w1 = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d.lo, m.lo),
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d.hi, m.hi)};
#endif
}

// R rows x NP panels over every group; sums left in `acc`.
template <int R, int NP, bool Next>
inline void q4_block(const float* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                     int64_t groups, Vec16 (&acc)[R][NP], bool prefetch, const NextGroup& next) {
  const int per_step = lines_per_step(next, groups);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = zero16();
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (Next) prefetch_next(next, g, per_step);
    Vec16 d[NP], m[NP];
    for (int j = 0; j < NP; ++j) {
      const uint8_t* record = b + j * panel_elems + g * kQ4GroupBytes;
      if (prefetch)
        for (int64_t line = 0; line < kQ4GroupBytes; line += 64) prefetch_ahead(record + line);
      d[j] = load_half16(record);
      m[j] = load_half16(record + 32);
    }
    const float* x = a + g * kQ4Group;
    for (int kp = 0; kp < 16; ++kp) {
      for (int j = 0; j < NP; ++j) {
        Vec16 w0, w1;
        unpack_pair(b + j * panel_elems + g * kQ4GroupBytes + 64 + kp * 16, d[j], m[j], w0, w1);
        for (int i = 0; i < R; ++i) {
          acc[i][j] = fma(splat(x[i * lda + 2 * kp]), w0, acc[i][j]);
          acc[i][j] = fma(splat(x[i * lda + 2 * kp + 1]), w1, acc[i][j]);
        }
      }
    }
  }
}

#if RANKCAST_SIMD_BITS == 512
template <int MR, int NR, bool Next, typename Out>
inline void tile_q4(const float* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup next) {
  Vec16 acc[MR][NR];
  q4_block<MR, NR, Next>(a, lda, b, panel_elems, groups, acc, prefetch, next);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      epi.store(c + i * ldc + j * kPanel, acc[i][j], i, j, j == NR - 1 ? last_cols : kPanel);
}
#else
// AVX2: a tile is a whole row block; each panel is run by sub-tiles of at most 4 rows (8 ymm
// sums, 4 for the two pairs' weights, 1 broadcast), the panel staying in L1 between them.
template <int R>
__attribute__((noinline)) void q4_rows(const float* a, int64_t lda, const uint8_t* panel,
                                       int64_t groups, Vec16* sums, bool prefetch) {
  Vec16 acc[R][1];
  q4_block<R, 1, false>(a, lda, panel, 0, groups, acc, prefetch, NextGroup{});
  for (int i = 0; i < R; ++i) sums[i] = acc[i][0];
}

template <int MR, int NR, bool Next, typename Out>
inline void tile_q4(const float* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                    int64_t groups, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                    bool prefetch, NextGroup /*next: the AVX2 tile only reads ahead*/) {
  Vec16 sums[MR];
  for (int j = 0; j < NR; ++j) {
    const uint8_t* panel = b + j * panel_elems;
    for (int r = 0; r < MR; r += 4) {
      const float* rows = a + r * lda;
      const bool lead = prefetch && r == 0;
      switch (std::min(4, MR - r)) {
        case 1: q4_rows<1>(rows, lda, panel, groups, sums + r, lead); break;
        case 2: q4_rows<2>(rows, lda, panel, groups, sums + r, lead); break;
        case 3: q4_rows<3>(rows, lda, panel, groups, sums + r, lead); break;
        default: q4_rows<4>(rows, lda, panel, groups, sums + r, lead); break;
      }
    }
    const int cols = j == NR - 1 ? last_cols : kPanel;
    for (int i = 0; i < MR; ++i) epi.store(c + i * ldc + j * kPanel, sums[i], i, j, cols);
  }
}
#endif

template <typename Out_>
struct Q4Tiles {
  using In = float;
  using W = uint8_t;
  using Out = Out_;
  using Epi = BiasEpilogue;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<Q4Tiles, Next>::Fn;
    return Fn{&tile_q4<MR, NR, Next, Out>};
  }
};

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
          for (int64_t kp = 0; kp < 16; ++kp)
            record[64 + kp * 16 + c] =
                static_cast<uint8_t>((src[2 * kp] & 15) | ((src[2 * kp + 1] & 15) << 4));
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
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "q4_linear: bias must have ", n, " elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
#if RANKCAST_SIMD_BITS >= 256 && defined(__F16C__)
  // float32 rows (bfloat16 converted once, exactly), zero-padded to whole groups: the padding's
  // weights are whatever the last group's minimum makes them, times zero.
  at::Tensor a = x.to(at::kFloat);
  if (k % kQ4Group != 0) {
    a = at::zeros({m, groups * kQ4Group}, x.options().dtype(at::kFloat));
    a.narrow(1, 0, k).copy_(x);
  }
  const BiasEpilogue epi{bias.has_value() ? bias_f.data_ptr<float>() : nullptr};
  const int64_t panel_elems = packed.stride(0);
  if (x.scalar_type() == at::kFloat) {
    gemm::packed_linear_impl<Q4Tiles<float>>(a.data_ptr<float>(), m, a.stride(0),
                                             packed.data_ptr<uint8_t>(), n, groups, panel_elems,
                                             epi, y.data_ptr<float>());
  } else {
    gemm::packed_linear_impl<Q4Tiles<bf16>>(a.data_ptr<float>(), m, a.stride(0),
                                            packed.data_ptr<uint8_t>(), n, groups, panel_elems,
                                            epi, y.data_ptr<bf16>());
  }
  return y;
#else
  TORCH_CHECK(false, "q4_linear: this CPU build has no 4-bit kernel");
#endif
}

}  // namespace rankcast
