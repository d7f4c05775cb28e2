// Linear layers y = x W^T (+ bias) through weights packed once for AVX-512 dot products.
//
// Why not oneDNN: at the batch sizes a decode step has (1 to a few dozen rows) the weights are read
// from memory once per step and the time goes into how well that stream is kept busy. Measured on
// a 2-core Zen 5, oneDNN's prepacked bf16 matmul ran each decode step's projections at 40-60 % of
// the speed it reaches on cache-resident weights. This kernel walks each thread through one
// contiguous stretch of packed columns, with every row of the batch reusing a column group while
// it is in cache and the next group prefetched meanwhile.
//
// Packed layouts (N rounded up to whole panels of 16 output columns, zero-filled):
//   bfloat16 with AVX512-BF16: [N/16][K/2][16][2]  pairs of consecutive k for one column, as
//                              VDPBF16PS reads them
//   float32:  [N/16][K][16]
//   bfloat16 without AVX512-BF16: [N/16][K][16]  as float32's, at half the bytes
// The float32 path runs on AVX-512, or on AVX2 with FMA through tiles of two-ymm panels (same
// layout, same driver). bfloat16 runs on AVX512-BF16 through VDPBF16PS; on AVX-512 without it
// (Skylake-SP to Ice Lake) and on AVX2, by widening each weight to float32 in registers (exact)
// and multiplying rows converted to float32 once per call (exact too): float32 FMAs, products
// and sums rounded as float32's are, the output rounded once to bfloat16. Half the weight bytes
// of float32 is what a decode step's memory stream needs; those CPUs have no bfloat16
// arithmetic to do better. On an AMX build bfloat16 runs on tiles instead (csrc/gemm_amx.cpp),
// at every row count, wherever K fills whole tiles. Elsewhere `gemm_supported()` is false and the
// model keeps oneDNN's path. Whatever the path, every output sums k in one order for any number
// of rows, so a row's bits never depend on the rows beside it (batch invariance,
// docs/cpu-paths.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "simd.h"

namespace rankcast {

bool gemm_supported(at::ScalarType dtype) {
#if RANKCAST_SIMD_BITS >= 256
  if (dtype == at::kBFloat16 || dtype == at::kFloat) return true;
#endif
  (void)dtype;
  return false;
}

std::string build_isa() {
#if RANKCAST_AMX_BF16
  // "amx" only where the tiles run: where the OS refuses this process their state, the build
  // multiplies bfloat16 through VDPBF16PS at every row count, and says so.
  return gemm::amx_ready() ? "amx" : "avx512-bf16";
#elif defined(__AVX512BF16__)
  return "avx512-bf16";
#elif RANKCAST_SIMD_BITS == 512
  return "avx512";
#elif RANKCAST_SIMD_BITS == 256
  return "avx2";
#else
  return "other";
#endif
}

#if RANKCAST_SIMD_BITS >= 256
namespace {

using namespace gemm;

#if defined(__AVX512BF16__)
// acc[i][j] over MR rows and NR panels, K/2 pairs of k; bf16 in, fp32 accumulate.
// 32 packed weights (16 columns x a pair of k) as VDPBF16PS's operand: bfloat16 as they are,
// int8 converted exactly (every integer up to 256 is a bfloat16).
inline __m512bh load_pairs(const bf16* src) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(src));
}
inline __m512bh load_pairs(const int8_t* src) { return int8_as_bf16_pairs(src); }

template <int MR, int NR, bool Next, typename Out, typename W, typename Epi>
inline void tile_bf16(const bf16* a, int64_t lda, const W* b, int64_t panel_elems, int64_t kpairs,
                      Out* c, int64_t ldc, const Epi& epi, int last_cols, bool prefetch,
                      NextGroup next) {
  const int per_step = lines_per_step(next, kpairs);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    if constexpr (Next) prefetch_next(next, kp, per_step);
    __m512bh bv[NR];
    for (int j = 0; j < NR; ++j) {
      const W* src = b + j * panel_elems + kp * 32;
      if (prefetch) prefetch_ahead<MR>(src);
      bv[j] = load_pairs(src);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * kp, sizeof(pair));
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const int cols = j == NR - 1 ? last_cols : kPanel;
      epi.store(c + i * ldc + j * kPanel, Vec16{acc[i][j]}, i, j, cols);
    }
}
#endif

#if defined(__AVX512BF16__) && RANKCAST_BF16_PAIRS_ON_FMA
// `tile_bf16`'s arithmetic on float32 FMAs, for the CPUs where VDPBF16PS issues at half the rate
// of two FMAs (Intel's Sapphire and Emerald Rapids: measured there, one VDPBF16PS every ~0.8 ns
// against an FMA every 0.2 ns; set by vendor, rankcast/kernels/__init__.py). The same packed
// pairs; each pair's weights widened exactly (bfloat16 is float32's top half: k even shifted up,
// k odd masked), the rows float32 (converted once, exactly), and per pair of k the odd product
// added first, then the even, each with one rounding: what VDPBF16PS does, so the bits are the
// same (bfloat16 products are exact in float32; VDPBF16PS's flushing of subnormals aside).
template <int MR, int NR, bool Next, typename Out, typename W, typename Epi>
inline void tile_pairs_fma(const float* a, int64_t lda, const W* b, int64_t panel_elems,
                           int64_t kpairs, Out* c, int64_t ldc, const Epi& epi, int last_cols,
                           bool prefetch, NextGroup next) {
  const int per_step = lines_per_step(next, kpairs);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    if constexpr (Next) prefetch_next(next, kp, per_step);
    __m512 even[NR], odd[NR];
    for (int j = 0; j < NR; ++j) {
      const W* src = b + j * panel_elems + kp * 32;
      if (prefetch) prefetch_ahead<MR>(src);
      const __m512i pairs = reinterpret_cast<__m512i>(load_pairs(src));
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    }
    for (int i = 0; i < MR; ++i) {
      const float* row = a + i * lda + 2 * kp;
      const __m512 x_even = _mm512_set1_ps(row[0]), x_odd = _mm512_set1_ps(row[1]);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(x_odd, odd[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(x_even, even[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const int cols = j == NR - 1 ? last_cols : kPanel;
      epi.store(c + i * ldc + j * kPanel, Vec16{acc[i][j]}, i, j, cols);
    }
}

// bfloat16 rows, converted to float32, times weights packed in VDPBF16PS pairs (`tile_pairs_fma`).
template <typename W_, typename Epi_>
struct PairTilesOnFma {
  using In = float;
  using W = W_;
  using Out = bf16;
  using Epi = Epi_;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<PairTilesOnFma, Next>::Fn;
    return Fn{&tile_pairs_fma<MR, NR, Next, Out, W, Epi>};
  }
};
#endif

#if RANKCAST_SIMD_BITS == 512
// 16 consecutive weights of one k as float32 lanes (bfloat16 widened exactly).
inline __m512 load_panel_row(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load_panel_row(const bf16* src) { return load16(src).v; }
inline __m512 load_panel_row(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}

template <int MR, int NR, bool Next, typename Out, typename W, typename Epi>
inline void tile_f32(const float* a, int64_t lda, const W* b, int64_t panel_elems, int64_t k,
                     Out* c, int64_t ldc, const Epi& epi, int last_cols, bool prefetch,
                     NextGroup next) {
  const int per_step = lines_per_step(next, k);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    if constexpr (Next) prefetch_next(next, kk, per_step);
    __m512 bv[NR];
    for (int j = 0; j < NR; ++j) {
      const W* src = b + j * panel_elems + kk * kPanel;
      if (prefetch) prefetch_ahead<MR>(src);
      bv[j] = load_panel_row(src);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + kk]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const int cols = j == NR - 1 ? last_cols : kPanel;
      epi.store(c + i * ldc + j * kPanel, Vec16{acc[i][j]}, i, j, cols);
    }
}

#else
// 16 consecutive weights of one k as two float32 ymm registers.
inline void load_panel_row(const float* src, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(src);
  b1 = _mm256_loadu_ps(src + 8);
}
inline void load_panel_row(const int8_t* src, __m256& b0, __m256& b1) {
  b0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
  b1 = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8))));
}
inline void load_panel_row(const bf16* src, __m256& b0, __m256& b1) {
  b0 = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  b1 = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8)));
}

// AVX2: MR rows (a whole row block) times the group's panels, one panel at a time. The panel is
// taken in chunks of k that stay in L1 (12 KB) while sub-tiles of at most 6 rows (16 ymm
// registers: 6 x 2 accumulators, 2 weight loads, 1 broadcast) run over the chunk one after
// another, their sums parked in `acc` between chunks. Without the chunks each sub-tile streamed
// the whole panel (36-98 KB, more than L1) from L2 again. Every row still sums k in order, so
// its bits do not depend on the rows beside it. Weights W are float32 or bfloat16 (widened as
// they are loaded); rows are always float32.
template <typename W>
constexpr int64_t kChunk = 12288 / (kPanel * static_cast<int64_t>(sizeof(W)));

// Never inlined: inlined into `tile_f32`, GCC merged the registers with `acc` and kept an
// accumulator in memory (a store-to-load chain on every k; single rows ran at half speed).
template <int R, bool Next, typename W, int TileRows>
__attribute__((noinline)) void sub_tile(const float* a, int64_t lda, const W* panel, int64_t k0,
                                        int64_t k1, float* acc, bool first, bool prefetch,
                                        const NextGroup& next, int64_t step_base, int per_step) {
  // Fully unrolled loops over the rows, so that GCC keeps every accumulator in a register
  // (without the pragmas it spilled them all to the stack: a third of the speed).
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    lo[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * kPanel);
    hi[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * kPanel + 8);
  }
  for (int64_t kk = k0; kk < k1; ++kk) {
    if constexpr (Next) prefetch_next(next, step_base + kk, per_step);
    const W* src = panel + kk * kPanel;
    if (prefetch) prefetch_ahead<TileRows>(src);
    __m256 b0, b1;
    load_panel_row(src, b0, b1);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + kk);
      lo[i] = _mm256_fmadd_ps(av, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(av, b1, hi[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(acc + i * kPanel, lo[i]);
    _mm256_storeu_ps(acc + i * kPanel + 8, hi[i]);
  }
}

template <int MR, int NR, bool Next, typename Out, typename W, typename Epi>
inline void tile_f32(const float* a, int64_t lda, const W* b, int64_t panel_elems, int64_t k,
                     Out* c, int64_t ldc, const Epi& epi, int last_cols, bool prefetch,
                     NextGroup next) {
  // The rows shared out evenly between sub-tiles: 32 rows are 6, 6, 5, 5, 5, 5.
  constexpr int subtiles = (MR + 5) / 6;
  constexpr int base = MR / subtiles, wider = MR % subtiles;
  const int per_step = lines_per_step(next, NR * k);
  alignas(32) float acc[MR * kPanel];
  for (int j = 0; j < NR; ++j) {
    const W* panel = b + j * panel_elems;
    for (int64_t k0 = 0; k0 < k; k0 += kChunk<W>) {
      const int64_t k1 = std::min(k, k0 + kChunk<W>);
      const bool first = k0 == 0;
      for (int s = 0; s < subtiles; ++s) {
        const int r = s * base + std::min(s, wider);
        const float* rows = a + r * lda;
        float* sums = acc + r * kPanel;
        // The first sub-tile brings the chunk in (and the next group's share); the others find
        // it in L1. Only sizes that occur are instantiated (no unused 7-row sub-tile).
        const bool lead = s == 0;
        if constexpr (wider > 0) {
          if (s < wider) {
            if (lead) {
              sub_tile<base + 1, Next, W, MR>(rows, lda, panel, k0, k1, sums, first, prefetch,
                                              next, j * k, per_step);
            } else {
              sub_tile<base + 1, false, W, MR>(rows, lda, panel, k0, k1, sums, first, false,
                                               next, 0, 0);
            }
            continue;
          }
        }
        if (lead) {
          sub_tile<base, Next, W, MR>(rows, lda, panel, k0, k1, sums, first, prefetch, next,
                                      j * k, per_step);
        } else {
          sub_tile<base, false, W, MR>(rows, lda, panel, k0, k1, sums, first, false, next, 0, 0);
        }
      }
    }
    const int cols = j == NR - 1 ? last_cols : kPanel;
    for (int i = 0; i < MR; ++i)
      epi.store(c + i * ldc + j * kPanel, load16(acc + i * kPanel), i, j, cols);
  }
}
#endif

// The float families: rows in float32 (tile_f32, weights float32, or bfloat16 or int8 widened)
// or in bfloat16 pairs (tile_bf16, VDPBF16PS; weights bfloat16, or int8 converted), sums plus
// bias stored (BiasEpilogue), scaled first for int8 weights (ScaledEpilogue).
template <typename In_, typename W_, typename Out_, typename Epi_ = BiasEpilogue>
struct FloatTiles {
  using In = In_;
  using W = W_;
  using Out = Out_;
  using Epi = Epi_;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<FloatTiles, Next>::Fn;
    if constexpr (std::is_same_v<In, float>) {
      return Fn{&tile_f32<MR, NR, Next, Out, W, Epi>};
    } else {
#if defined(__AVX512BF16__)
      return Fn{&tile_bf16<MR, NR, Next, Out, W, Epi>};
#else
      return Fn{nullptr};
#endif
    }
  }
};

}  // namespace
#endif

namespace {

using gemm::pack_panel;

// Whether bfloat16 weights are packed in pairs of k, as VDPBF16PS reads them.
#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

}  // namespace


at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out, in]");
  TORCH_CHECK(gemm_supported(weight.scalar_type()),
              "pack_linear_weight: this CPU build has no packed kernel for ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + 15) / 16;
  const at::Tensor w = weight.contiguous();
  // bfloat16 with AVX512-BF16 is read by VDPBF16PS in pairs of k: [panels, k/2, 16, 2];
  // float32, and bfloat16 without it, are [panels, k, 16].
  const bool pairs = weight.scalar_type() == at::kBFloat16 && kBf16Pairs;
  const int pair = pairs ? 2 : 1;
  at::Tensor packed = pairs ? at::empty({panels, (k + 1) / 2, 16, 2}, w.options())
                            : at::empty({panels, k, 16}, w.options());
  const int64_t panel_elems = packed.stride(0);
  // One pass, panels shared between threads: each output page is written (and first touched)
  // once, which is most of the cost of packing a freshly loaded model.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      if (w.element_size() == 2) {
        pack_panel(static_cast<const uint16_t*>(w.data_ptr()), n, k, p, pair,
                   static_cast<uint16_t*>(packed.data_ptr()) + p * panel_elems);
      } else {
        pack_panel(static_cast<const uint32_t*>(w.data_ptr()), n, k, p, pair,
                   static_cast<uint32_t*>(packed.data_ptr()) + p * panel_elems);
      }
    }
  });
  return packed;
}

at::Tensor pack_linear_weight_(at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(),
              "pack_linear_weight_: weight must be a contiguous [out, in]");
  TORCH_CHECK(gemm_supported(weight.scalar_type()),
              "pack_linear_weight_: this CPU build has no packed kernel for ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  // In place, every panel's packed form must take exactly its 16 rows' bytes: whole panels,
  // and whole pairs of k where the layout pairs them.
  TORCH_CHECK(n % 16 == 0 && k % 2 == 0,
              "pack_linear_weight_: in place needs out % 16 == 0 and an even in, got [", n, ", ",
              k, "]");
  const bool pairs = weight.scalar_type() == at::kBFloat16 && kBf16Pairs;
  const int pair = pairs ? 2 : 1;
  const int64_t panels = n / 16, panel_elems = 16 * k;
  const int64_t panel_bytes = panel_elems * weight.element_size();
  char* base = static_cast<char*>(weight.data_ptr());
  // Each panel is copied aside (16 x k elements, in cache) and written back packed over its
  // own rows: no second buffer the size of the weight, and no fresh pages to fault in.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> rows(static_cast<size_t>(panel_bytes));
    for (int64_t p = begin; p < end; ++p) {
      char* panel = base + p * panel_bytes;
      std::memcpy(rows.data(), panel, static_cast<size_t>(panel_bytes));
      if (weight.element_size() == 2) {
        pack_panel(reinterpret_cast<const uint16_t*>(rows.data()), 16, k, 0, pair,
                   reinterpret_cast<uint16_t*>(panel));
      } else {
        pack_panel(reinterpret_cast<const uint32_t*>(rows.data()), 16, k, 0, pair,
                   reinterpret_cast<uint32_t*>(panel));
      }
    }
  });
  return pairs ? weight.view({panels, k / 2, 16, 2}) : weight.view({panels, k, 16});
}

#if RANKCAST_SIMD_BITS >= 256
namespace {

// x [m, k] times a weight packed as W into y, through the float family the rows' dtype and this
// build take: bfloat16 rows as VDPBF16PS pairs where the build has it, float32 rows otherwise
// (bfloat16 rows converted once, exactly).
template <typename W, typename Epi>
void multiply(const at::Tensor& x, const at::Tensor& packed, int64_t n, const Epi& epi,
              at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t panel_elems = packed.stride(0);
  const W* w = static_cast<const W*>(packed.data_ptr());
  if constexpr (std::is_same_v<W, float>) {
    // float32 weights meet float32 rows only (packed_linear checks the dtypes agree).
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k, "packed_linear: weight packed for another K");
    gemm::packed_linear_impl<FloatTiles<float, float, float, Epi>>(
        x.data_ptr<float>(), m, x.stride(0), w, n, k, panel_elems, epi, y.data_ptr<float>());
    return;
  } else if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    const int64_t kp = packed.size(1);
    TORCH_CHECK(packed.dim() == 4 && (k + 1) / 2 == kp, "packed_linear: weight packed for another K");
    at::Tensor a = x;
    if (k % 2 != 0) {  // pairs of k: give the last one a zero partner
      a = at::zeros({m, k + 1}, x.options());
      a.narrow(1, 0, k).copy_(x);
    }
    // bfloat16 weights on an AMX build: tiles for every step, whatever its rows (one kernel, so
    // results do not depend on the batch; csrc/gemm_amx.cpp), where K fills whole tiles.
    // int8 weights likewise, each tile of them converted to bfloat16 (exactly) before it loads.
    if (kp % gemm::kAmxPairs == 0 && gemm::amx_ready()) {
      gemm::amx_bf16_linear(a.data_ptr<bf16>(), m, a.stride(0), w, n, kp, panel_elems, epi,
                            y.data_ptr<bf16>());
      return;
    }
#if RANKCAST_BF16_PAIRS_ON_FMA
    const at::Tensor af = gemm::rows_as_float(a);  // exact; converted once for every tile
    gemm::packed_linear_impl<PairTilesOnFma<W, Epi>>(af.data_ptr<float>(), m, af.stride(0), w, n,
                                                     kp, panel_elems, epi, y.data_ptr<bf16>());
#else
    gemm::packed_linear_impl<FloatTiles<bf16, W, bf16, Epi>>(
        a.data_ptr<bf16>(), m, a.stride(0), w, n, kp, panel_elems, epi, y.data_ptr<bf16>());
#endif
#else
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k, "packed_linear: weight packed for another K");
    const at::Tensor a = gemm::rows_as_float(x);  // exact; converted once for every tile
    gemm::packed_linear_impl<FloatTiles<float, W, bf16, Epi>>(
        a.data_ptr<float>(), m, a.stride(0), w, n, k, panel_elems, epi, y.data_ptr<bf16>());
#endif
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k, "packed_linear: weight packed for another K");
    gemm::packed_linear_impl<FloatTiles<float, W, float, Epi>>(
        x.data_ptr<float>(), m, x.stride(0), w, n, k, panel_elems, epi, y.data_ptr<float>());
  }
}

}  // namespace
#endif

at::Tensor pack_int8_weight(const at::Tensor& values, at::ScalarType activations) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar,
              "pack_int8_weight: weight must be int8 [out, in]");
  TORCH_CHECK(gemm_supported(activations), "pack_int8_weight: this CPU build has no packed kernel for ",
              activations);
  const int64_t n = values.size(0), k = values.size(1);
  const int64_t panels = (n + 15) / 16;
  const at::Tensor w = values.contiguous();
  // Laid out as the rows it will meet read weights: VDPBF16PS pairs for bfloat16 rows where the
  // build has it, one k at a time otherwise.
  const bool pairs = activations == at::kBFloat16 && kBf16Pairs;
  const int pair = pairs ? 2 : 1;
  at::Tensor packed = pairs ? at::empty({panels, (k + 1) / 2, 16, 2}, w.options())
                            : at::empty({panels, k, 16}, w.options());
  const int64_t panel_elems = packed.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      pack_panel(static_cast<const uint8_t*>(w.data_ptr()), n, k, p, pair,
                 static_cast<uint8_t*>(packed.data_ptr()) + p * panel_elems);
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x must be [rows, in], unit stride");
  TORCH_CHECK(packed.is_contiguous(), "packed_linear: packed weight must be contiguous");
  const bool int8 = packed.scalar_type() == at::kChar;
  if (int8) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "packed_linear: int8 weights take float32 or bfloat16 rows");
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat &&
                    scales->numel() == n && scales->is_contiguous(),
                "packed_linear: int8 weights need float32 scales [", n, "]");
  } else {
    TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "packed_linear: x and weight dtypes differ");
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor bias_f = gemm::bias_as_float(bias, n, "packed_linear");
  const float* bias_ptr = gemm::float_data(bias_f);
#if RANKCAST_SIMD_BITS >= 256
  if (int8) {
    multiply<int8_t>(x, packed, n, ScaledEpilogue{scales->data_ptr<float>(), bias_ptr}, y);
  } else if (x.scalar_type() == at::kBFloat16) {
    multiply<bf16>(x, packed, n, BiasEpilogue{bias_ptr}, y);
  } else if (x.scalar_type() == at::kFloat) {
    multiply<float>(x, packed, n, BiasEpilogue{bias_ptr}, y);
  } else {
    TORCH_CHECK(false, "packed_linear: no packed kernel for ", x.scalar_type());
  }
  return y;
#else
  TORCH_CHECK(false, "packed_linear: no packed kernel for ", x.scalar_type(), " in this CPU build");
#endif
}

}  // namespace rankcast
