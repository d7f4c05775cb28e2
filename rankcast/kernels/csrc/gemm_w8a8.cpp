// Linear layers with int8 weights: y = (x_q W_q^T) * scale_x * scale_w (+ bias), W8A8.
//
// Why: a decode step on a CPU is bound by the bytes of weights it reads; int8 weights are half of
// bfloat16's. And integer dot products do more per instruction than float ones (VPDPBUSD: 64
// multiply-adds per zmm instruction, VDPBF16PS 32, a float32 FMA 16), so batches gain too.
//
// Weights are quantized once (symmetric, one float32 scale per output channel, values in
// [-127, 127]: `quantize_int8_weight` in rankcast/model/quantization.py) and stored offset by 128 as
// unsigned bytes, packed like the float kernels' panels of 16 output columns:
//   with AVX512-VNNI: [N/16][K/4][16][4]  four consecutive k of one column, as VPDPBUSD reads them
//   otherwise:        [N/16][K/2][16][2]  pairs of k, widened to int16 for VPMADDWD (AVX-512 BW
//                                         or AVX2)
// Each row of x is quantized when the call starts, symmetric per row (per token): scale_x =
// max|x| / 127, x_q = round-half-even(x * 127 / max|x|). The products are summed exactly in int32
// (offset weights: sum (w_q + 128) x_q = sum w_q x_q + 128 sum x_q, the second term subtracted
// per row), so every ISA path gives the same sums bit for bit, and a row's result depends on
// that row alone: batch-invariant like the float kernels. The sums are then converted to float32
// and multiplied by the weight's scale, then the row's (in that order, never fused), and rounded
// once to the output dtype; rankcast/model/quantization.py's reference does the same arithmetic in torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "gemm.h"
#include "kernels.h"
#include "quantize_rows.h"
#include "simd.h"

namespace rankcast {

namespace {

// How many consecutive k of one column the packed int8 weight groups together.
#if RANKCAST_SIMD_BITS == 512 && defined(__AVX512VNNI__)
constexpr int kInt8Group = 4;
using QuantRow = int8_t;  // rows as signed bytes, four at a time beside four weights
#else
constexpr int kInt8Group = 2;
using QuantRow = int16_t;  // rows widened to int16, pairs beside pairs of weights
#endif
constexpr uint8_t kWeightOffset = 128;

}  // namespace

std::string w8a8_path() {
#if RANKCAST_SIMD_BITS == 512 && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif RANKCAST_SIMD_BITS == 512
  return "avx512bw";
#elif RANKCAST_SIMD_BITS == 256
  return "avx2";
#else
  return "none";
#endif
}

#if RANKCAST_SIMD_BITS >= 256
namespace {

using namespace gemm;

// What an int8 tile does with a finished row of 16 int32 sums: take out the weights' offset,
// convert, scale by the weight's column scales and the row's scale, add the bias, store.
struct Int8Epilogue {
  const float* col_scale = nullptr;  // [n] the weight's per-column scales
  const float* row_scale = nullptr;  // [m] each row's activation scale
  const int32_t* row_offset = nullptr;  // [m] 128 * sum of the row's quantized values
  const float* bias = nullptr;

  Int8Epilogue at(int64_t row, int64_t col) const {
    return {col_scale + col, row_scale + row, row_offset + row, bias ? bias + col : nullptr};
  }
  template <typename Out>
  void store(Out* c, const int32_t* sums, int i, int j, int cols) const {
    Vec16 v = sums_to_float(sums, row_offset[i]);
    v = v * load16(col_scale + j * kPanel, cols);
    v = v * splat(row_scale[i]);
    store_tile_row(c, v, bias ? bias + j * kPanel : nullptr, cols);
  }

 private:
  static Vec16 sums_to_float(const int32_t* sums, int32_t offset) {
#if RANKCAST_SIMD_BITS == 512
    const __m512i s = _mm512_sub_epi32(_mm512_loadu_si512(sums), _mm512_set1_epi32(offset));
    return {_mm512_cvtepi32_ps(s)};
#else
    const __m256i o = _mm256_set1_epi32(offset);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 8));
    return {_mm256_cvtepi32_ps(_mm256_sub_epi32(lo, o)), _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, o))};
#endif
  }
};

#if RANKCAST_SIMD_BITS == 512
// MR rows x NR panels, one zmm of 16 int32 sums each (8 x 3 accumulators + 3 weights + 1 row
// broadcast fit the 32 registers). A step is kInt8Group consecutive k.
template <int MR, int NR, bool Next, typename Out>
inline void tile_int8(const QuantRow* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                      int64_t steps, Out* c, int64_t ldc, const Int8Epilogue& epi, int last_cols,
                      bool prefetch, NextGroup next) {
  const int per_step = lines_per_step(next, steps);
  // Fully unrolled loops over rows and panels: without the pragmas GCC kept the 24 accumulators
  // on the stack, a load and a store around every VPDPBUSD (batches ran no faster than
  // bfloat16's tile, which does half the multiply-adds an instruction).
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t s = 0; s < steps; ++s) {
    if constexpr (Next) prefetch_next(next, s, per_step);
    __m512i bv[NR];
#pragma GCC unroll 3
    for (int j = 0; j < NR; ++j) {
      const uint8_t* src = b + j * panel_elems + s * kPanel * kInt8Group;
      if (prefetch) prefetch_ahead<MR>(src);
#if defined(__AVX512VNNI__)
      bv[j] = _mm512_loadu_si512(src);
#else
      bv[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#endif
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t group;  // kInt8Group quantized values of row i, 4 bytes either way
      std::memcpy(&group, a + i * lda + s * kInt8Group, sizeof(group));
      const __m512i av = _mm512_set1_epi32(group);
#pragma GCC unroll 3
      for (int j = 0; j < NR; ++j) {
#if defined(__AVX512VNNI__)
        acc[i][j] = dpbusd(acc[i][j], bv[j], av);
#else
        acc[i][j] = _mm512_add_epi32(acc[i][j], _mm512_madd_epi16(bv[j], av));
#endif
      }
    }
  }
  alignas(64) int32_t sums[kPanel];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      _mm512_store_si512(sums, acc[i][j]);
      epi.store(c + i * ldc + j * kPanel, sums, i, j, j == NR - 1 ? last_cols : kPanel);
    }
}

#else
// AVX2: a tile is a whole row block (up to 32 rows). Each panel is run by sub-tiles of at most 6
// rows, 2 ymm of int32 sums per row (12 + 2 weights + 1 broadcast of the 16 registers), over
// every k; the panel (16 x K bytes) stays in L1 between sub-tiles.
template <int R, int TileRows>
__attribute__((noinline)) void sub_tile_int8(const int16_t* a, int64_t lda, const uint8_t* panel,
                                             int64_t steps, int32_t* sums, bool prefetch) {
  __m256i lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* src = panel + s * kPanel * 2;
    if (prefetch) prefetch_ahead<TileRows>(src);
    const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256i b1 =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * s, sizeof(pair));
      const __m256i av = _mm256_set1_epi32(pair);
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(b0, av));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(b1, av));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + i * kPanel), lo[i]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + i * kPanel + 8), hi[i]);
  }
}

template <int MR, int NR, bool Next, typename Out>
inline void tile_int8(const QuantRow* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                      int64_t steps, Out* c, int64_t ldc, const Int8Epilogue& epi, int last_cols,
                      bool prefetch, NextGroup /*next: the AVX2 tile only reads ahead*/) {
  alignas(32) int32_t sums[MR * kPanel];
  for (int j = 0; j < NR; ++j) {
    const uint8_t* panel = b + j * panel_elems;
    for (int r = 0; r < MR; r += 6) {
      const QuantRow* rows = a + r * lda;
      int32_t* out = sums + r * kPanel;
      const bool lead = prefetch && r == 0;
      switch (std::min(6, MR - r)) {
        case 1: sub_tile_int8<1, MR>(rows, lda, panel, steps, out, lead); break;
        case 2: sub_tile_int8<2, MR>(rows, lda, panel, steps, out, lead); break;
        case 3: sub_tile_int8<3, MR>(rows, lda, panel, steps, out, lead); break;
        case 4: sub_tile_int8<4, MR>(rows, lda, panel, steps, out, lead); break;
        case 5: sub_tile_int8<5, MR>(rows, lda, panel, steps, out, lead); break;
        default: sub_tile_int8<6, MR>(rows, lda, panel, steps, out, lead); break;
      }
    }
    const int cols = j == NR - 1 ? last_cols : kPanel;
    for (int i = 0; i < MR; ++i) epi.store(c + i * ldc + j * kPanel, sums + i * kPanel, i, j, cols);
  }
}
#endif

template <typename Out_>
struct Int8Tiles {
  using In = QuantRow;
  using W = uint8_t;
  using Out = Out_;
  using Epi = Int8Epilogue;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<Int8Tiles, Next>::Fn;
    return Fn{&tile_int8<MR, NR, Next, Out>};
  }
};

// Quantize rows [begin, end) of x ([m, k], row stride lda) into q (row stride ldq, k rounded up to
// whole groups, the padding zero), with each row's scale and weight-offset term; sixteen lanes at
// a time (csrc/quantize_rows.h: the same integers as element by element), the last partial
// sixteen one by one, so that a row never writes into the next (rows run on several threads).
template <typename T>
void quantize_rows(const T* x, int64_t lda, int64_t k, int64_t begin, int64_t end, QuantRow* q,
                   int64_t ldq, float* scale, int32_t* offset) {
  for (int64_t i = begin; i < end; ++i) {
    const T* row = x + i * lda;
    const auto [inverse, row_scale] = row_scale_of(row, k, 127);
    scale[i] = row_scale;
    QuantRow* out = q + i * ldq;
    Ints16 lanes = zero_ints();
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
      const Ints16 v = scaled_ints(load16(row + c), inverse, 127);
      store_ints(out + c, v);
      lanes = lanes + v;
    }
    int32_t sum = lane_sum(lanes);
    for (; c < k; ++c) {
      const float v = std::nearbyint(static_cast<float>(row[c]) * inverse);
      const int32_t iv = static_cast<int32_t>(std::clamp(v, -127.0f, 127.0f));
      out[c] = static_cast<QuantRow>(iv);
      sum += iv;
    }
    for (; c < ldq; ++c) out[c] = 0;
    offset[i] = static_cast<int32_t>(kWeightOffset) * sum;
  }
}

}  // namespace
#endif

bool w8a8_supported() { return RANKCAST_SIMD_BITS >= 256; }

int64_t w8a8_group() { return kInt8Group; }

at::Tensor pack_w8a8_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "pack_w8a8_weight: weight must be int8 [out, in]");
  TORCH_CHECK(w8a8_supported(), "pack_w8a8_weight: this CPU build has no int8 kernel");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + 15) / 16, steps = (k + kInt8Group - 1) / kInt8Group;
  // Offset by 128 into unsigned bytes (VPDPBUSD's unsigned operand; VPMADDWD widens them).
  const at::Tensor shifted = (weight.to(at::kShort) + kWeightOffset).to(at::kByte).contiguous();
  at::Tensor packed = at::empty({panels, steps, 16, kInt8Group}, shifted.options());
  const int64_t panel_elems = packed.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      gemm::pack_panel(shifted.data_ptr<uint8_t>(), n, k, p, kInt8Group,
                       packed.data_ptr<uint8_t>() + p * panel_elems, kWeightOffset);
  });
  return packed;
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "w8a8_linear: x must be [rows, in], unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "w8a8_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == kInt8Group,
              "w8a8_linear: weight not packed by this build's pack_w8a8_weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n && scales.is_contiguous(),
              "w8a8_linear: scales must be float32 [", n, "]");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t steps = packed.size(1);
  TORCH_CHECK((k + kInt8Group - 1) / kInt8Group == steps && packed.size(0) == (n + 15) / 16,
              "w8a8_linear: weight packed for another shape");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor bias_f = gemm::bias_as_float(bias, n, "w8a8_linear");
#if RANKCAST_SIMD_BITS >= 256
  const int64_t ldq = steps * kInt8Group;
  at::Tensor q = at::empty({m, ldq}, x.options().dtype(sizeof(QuantRow) == 1 ? at::kChar : at::kShort));
  at::Tensor row_scale = at::empty({m}, x.options().dtype(at::kFloat));
  at::Tensor row_offset = at::empty({m}, x.options().dtype(at::kInt));
  auto* q_ptr = static_cast<QuantRow*>(q.data_ptr());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat) {
      quantize_rows(x.data_ptr<float>(), x.stride(0), k, begin, end, q_ptr, ldq,
                    row_scale.data_ptr<float>(), row_offset.data_ptr<int32_t>());
    } else {
      quantize_rows(x.data_ptr<bf16>(), x.stride(0), k, begin, end, q_ptr, ldq,
                    row_scale.data_ptr<float>(), row_offset.data_ptr<int32_t>());
    }
  });
  const Int8Epilogue epi{scales.data_ptr<float>(), row_scale.data_ptr<float>(),
                         row_offset.data_ptr<int32_t>(),
                         gemm::float_data(bias_f)};
  if (x.scalar_type() == at::kFloat) {
    gemm::packed_linear_impl<Int8Tiles<float>>(q_ptr, m, ldq, packed.data_ptr<uint8_t>(), n,
                                               steps, packed.stride(0), epi, y.data_ptr<float>());
  } else {
    gemm::packed_linear_impl<Int8Tiles<bf16>>(q_ptr, m, ldq, packed.data_ptr<uint8_t>(), n, steps,
                                              packed.stride(0), epi, y.data_ptr<bf16>());
  }
  return y;
#else
  TORCH_CHECK(false, "w8a8_linear: this CPU build has no int8 kernel");
#endif
}

}  // namespace rankcast
