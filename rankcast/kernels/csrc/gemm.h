// The driver every packed linear kernel shares (csrc/gemm.cpp for float32 and bfloat16 weights,
// csrc/gemm_int8.cpp for int8): how the packed weight is walked, shared between threads, and kept
// streaming while each tile of rows multiplies one column group. A kernel family supplies only its
// register tiles and what a tile does with its sums (its epilogue); the walk, and with it the
// order every output sums k in, is the same for all of them (docs/cpu-paths.md). The AMX tiles
// (csrc/gemm_amx.cpp) have a walk of their own, in the same spirit: k in order for every output.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <utility>

#include "simd.h"

namespace rankcast {
namespace gemm {

constexpr int kPanel = 16;  // output columns per packed panel (one zmm, two ymm of float32)
constexpr int kPanels = 3;  // panels per column group (and per AVX-512 register tile)
#if RANKCAST_SIMD_BITS == 512
constexpr int kRows = 8;  // rows of x per register tile: 8 x 3 accumulators + 3 loads + 1 broadcast
#else
// AVX2: a tile is a whole row block, run in sub-tiles of at most 6 rows (see `tile_f32`).
constexpr int kRows = 32;
#endif
constexpr int kRowBlock = 32;  // rows that share one pass over a column group
// A decode tile's read-ahead hint: 0 (non-temporal) unless the build sets it by CPU vendor
// (rankcast/kernels/__init__.py, VENDOR_CFLAGS: 3, PREFETCHT0, on Intel).
#ifndef RANKCAST_DECODE_PREFETCH_LOCALITY
#define RANKCAST_DECODE_PREFETCH_LOCALITY 0
#endif
// And its fetch of the next column group (`prefetch_next`): 1 (PREFETCHT2, into L2) on every CPU.
#ifndef RANKCAST_DECODE_NEXT_LOCALITY
#define RANKCAST_DECODE_NEXT_LOCALITY 1
#endif
// A batch tile's fetch of the next column group: 3 (PREFETCHT0), or 1 (PREFETCHT2) where the
// build sets it by CPU vendor (VENDOR_CFLAGS: on Intel).
#ifndef RANKCAST_BATCH_NEXT_LOCALITY
#define RANKCAST_BATCH_NEXT_LOCALITY 3
#endif
constexpr int kOverlapRows = 4;  // fewer rows than this: no next-group prefetch (see below)
// The same for the 15-bit group kernels (csrc/gemm_q4.cpp, csrc/gemm_q8.cpp): unpacking and
// scaling their groups is enough arithmetic per weight byte that even one row gains from the
// overlap. SmolLM2's decode step alone on the 2-core Zen 4 (bench/decode_step.py, builds
// alternated, best of 4 rounds): q4_1 4.24 -> 3.64 ms, q8_0 6.08 -> 4.93 ms; bfloat16 weights,
// already streamed at the probe's rate, went 8.03 -> 8.77 ms with it and keep kOverlapRows.
constexpr int kGroupOverlapRows = 1;
constexpr int kAhead = 1024;  // bytes a batch tile's panel stream is read ahead of use
constexpr int kStreamAhead = 2048;  // the same for a decode's tile (fewer than kOverlapRows rows)
constexpr int64_t kRunBytes = 512 * 1024;  // packed weight one thread works through per run

// Whether this build multiplies bfloat16 on AMX tiles (csrc/gemm_amx.cpp): -march=native on a
// CPU with AMX-BF16, unless RANKCAST_KERNELS_ISA narrowed the build (rankcast/kernels).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RANKCAST_AMX_BF16 1
#else
#define RANKCAST_AMX_BF16 0
#endif

#if RANKCAST_AMX_BF16
// LDTILECFG's 64-byte operand, palette 1 (csrc/gemm_amx.cpp's linears, csrc/lora_amx.cpp's
// adapter deltas: each configures its own tiles and releases them when done).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG through an operand that is the whole 64-byte config. GCC 12's `_tile_loadconfig`
// names only its first 8 bytes as read, so the compiler may drop the stores to the rest: once
// csrc/gemm_amx.cpp's code moved, a build configured tiles with no column widths and the first tile
// load faulted (SIGSEGV).
inline void load_tile_config(const TileConfig& config) {
  asm volatile("ldtilecfg %0" : : "m"(config));
}
#endif

// A panel stream reading ahead of itself, in a tile of `Rows` rows. A decode's tile (fewer than
// kOverlapRows rows) streams every group it reads: 2 KB ahead, non-temporal, since a weight read
// for a step is not read again until the next step, after the rest of the model has gone
// through the caches, and should not push out what is (the KV blocks attention reads, the
// activations). That and a decode's contiguous stretches (packed_linear_impl) took a 4-bit
// SmolLM2 decode step from 2.8-2.9 to 2.4-2.5 ms on the 2-core Zen 5 (the model's step alone,
// builds alternated, 400 steps each; 1 KB with PREFETCHT0 before). Not on Intel: on an Emerald
// Rapids Xeon the same non-temporal stream left single-row linears 1.4-2.5x slower than
// PREFETCHT0 2 KB ahead, so Intel builds take that (RANKCAST_DECODE_PREFETCH_LOCALITY above).
// A batch's tile reads ahead only at the first group of a run, which its other row tiles then
// read from cache: it keeps PREFETCHT0 1 KB ahead, as it was measured with.
template <int Rows, int OverlapRows = kOverlapRows>
inline void prefetch_ahead(const void* p) {
  if constexpr (Rows < OverlapRows) {
    __builtin_prefetch(static_cast<const char*>(p) + kStreamAhead, 0,
                       RANKCAST_DECODE_PREFETCH_LOCALITY);
  } else {
    __builtin_prefetch(static_cast<const char*>(p) + kAhead);
  }
}

// The rows from which a family's tiles overlap the next group's stream with their arithmetic
// (below): kOverlapRows, or the family's own `kOverlapRows` where its tiles do enough arithmetic
// per weight byte to gain from it at fewer rows (the 15-bit group kernels, csrc/gemm_q4.cpp).
template <typename Family, typename = void>
struct OverlapRows {
  static constexpr int value = kOverlapRows;
};
template <typename Family>
struct OverlapRows<Family, std::void_t<decltype(Family::kOverlapRows)>> {
  static constexpr int value = Family::kOverlapRows;
};

// Weight lines a tile pulls into cache for the column group after its own, spread over its k
// loop: while the row tiles of a group compute on weights already in cache, the memory system
// streams in the next group, so the stream and the FMAs overlap instead of taking turns (they
// took turns before: the first row tile waited on memory, the others on the FMA units). With
// 32 rows this made the step's linears 15-20 % faster on a 2-core Zen 5, in float32 and
// bfloat16; PREFETCHT0 measured a little better than T1/T2 there.
//
// A decode's tile (fewer than kOverlapRows rows: the 15-bit group kernels overlap from one row)
// fetches the next group with PREFETCHT2 instead, into L2 only: its group of a 4-bit projection
// is ~17 kB and the one it computes on is as large, so fetching the next into L1 pushed out the
// lines in use from the 32 kB L1 of a Zen 4. The model's 4-bit decode step alone on the 2-core
// Zen 4 (bench/decode_step.py, builds alternated): 3.72-4.14 -> 3.41-3.51 ms, faster in 4 of 4
// rounds (T1: 3 of 4); `q8_0` 5.08-5.64 -> 4.96-5.23 ms. Batches keep PREFETCHT0 on AMD: at 32
// rows T2 was ~1 % slower in every round (bfloat16, Zen 4). The same on a 2-core Sapphire Rapids
// Xeon, builds alternated: `q8_0` 4.47-4.79 -> 3.81-4.24 ms, q4_1 2.89-2.91 -> 2.80-2.81, at 4
// rows q4_1 5.37 -> 4.75; bfloat16 (one row) 8.71 -> 8.54. There batches gain from T2 as well
// (its L1 is 48 kB; a float32 group of 3 panels is 110 kB at K=576): the model's step at 32 rows,
// builds alternated, best of 2-3 rounds: float32 1.02-1.05x, `w8a8` 1.04x, `q4_1` 1.05x, `q8_0`
// 1.01x, int8 under float32 rows 1.01x; at 8 rows float32 1.13x, `q4_1` 1.05x (bfloat16 runs on
// the AMX tiles there, which do not take this path). So Intel builds set it by vendor.
struct NextGroup {
  const char* lines = nullptr;  // first cache line of this tile's share of the next group
  int64_t count = 0;            // lines in that share
};

inline int lines_per_step(const NextGroup& next, int64_t steps) {
  return static_cast<int>((next.count + steps - 1) / steps);
}

template <int Rows = kOverlapRows>
inline void prefetch_next(const NextGroup& next, int64_t step, int per_step) {
  constexpr int locality =
      Rows < kOverlapRows ? RANKCAST_DECODE_NEXT_LOCALITY : RANKCAST_BATCH_NEXT_LOCALITY;
  for (int i = 0; i < per_step; ++i) {
    const int64_t line = step * per_step + i;
    if (line < next.count) __builtin_prefetch(next.lines + line * 64, 0, locality);
  }
}

template <typename Out>
inline void store_tile_row(Out* c, Vec16 v, const float* bias, int cols) {
  if (bias != nullptr) v = v + load16(bias, cols);
  if (cols == kPanel) {
    store16(c, v);
  } else {
    store16(c, v, cols);
  }
}

// What a float tile does with a finished row of 16 sums: add the bias (if any) and store.
struct BiasEpilogue {
  const float* bias = nullptr;

  BiasEpilogue at(int64_t /*row*/, int64_t col) const { return {bias ? bias + col : nullptr}; }
  template <typename Out>
  void store(Out* c, Vec16 v, int /*i*/, int j, int cols) const {
    store_tile_row(c, v, bias ? bias + j * kPanel : nullptr, cols);
  }
};

// int8 weights' epilogue: the sums (of int8 weights times the rows) scaled by each column's
// scale, then the bias.
struct ScaledEpilogue {
  const float* col_scale = nullptr;
  const float* bias = nullptr;

  ScaledEpilogue at(int64_t /*row*/, int64_t col) const {
    return {col_scale + col, bias ? bias + col : nullptr};
  }
  template <typename Out>
  void store(Out* c, Vec16 v, int /*i*/, int j, int cols) const {
    v = v * load16(col_scale + j * kPanel, cols);
    store_tile_row(c, v, bias ? bias + j * kPanel : nullptr, cols);
  }
};

#if defined(__AVX512BF16__)
// 32 packed int8 weights (16 columns x a pair of k) as bfloat16 pairs, converted exactly (every
// integer up to 256 is a bfloat16): VDPBF16PS's operand (csrc/gemm.cpp) and, stored, an AMX
// tile's (csrc/gemm_amx.cpp).
inline __m512bh int8_as_bf16_pairs(const int8_t* src) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif

#if RANKCAST_SIMD_BITS == 512
// The group kernels' register tile (csrc/gemm_q4.cpp, csrc/gemm_q8.cpp): MR rows in sub-tiles of
// at most 4, each over all NR panels of the column group, so that a row's integers are broadcast
// once for every panel (one float32 sum per row and panel, and one int32 per group: 2 x 4 x 3 of
// the 32 registers). `rows.template operator()<R>(a, acc, read_ahead, next)` fills a sub-tile's
// sums; the first sub-tile reads ahead and prefetches the next column group, the others find the
// weights in cache. Each row's sums are then multiplied by `row_scale(row)` and stored.
template <int MR, int NR, typename Rows, typename RowScale, typename Out>
inline void group_sub_tiles(const Rows& rows, const RowScale& row_scale, const int8_t* a,
                            int64_t lda, Out* c, int64_t ldc, const BiasEpilogue& epi,
                            int last_cols, bool prefetch, NextGroup next) {
  constexpr int kSub = 4;
  for (int r = 0; r < MR; r += kSub) {
    auto run = [&]<int R>() {
      __m512 acc[R][NR];
      rows.template operator()<R>(a + r * lda, acc, prefetch && r == 0,
                                  r == 0 ? next : NextGroup{});
      for (int i = 0; i < R; ++i) {
        const __m512 scale = _mm512_set1_ps(row_scale(a + (r + i) * lda));
        for (int j = 0; j < NR; ++j)
          epi.store(c + (r + i) * ldc + j * kPanel, Vec16{_mm512_mul_ps(acc[i][j], scale)}, r + i,
                    j, j == NR - 1 ? last_cols : kPanel);
      }
    };
    if (r + kSub <= MR) {
      run.template operator()<kSub>();
    } else {
      run.template operator()<(MR % kSub == 0 ? kSub : MR % kSub)>();
    }
  }
}
#endif

// Dispatch a tile of `rows` (1..kRows) x `panels` (1..kPanels) to its fixed-size instance, with
// or without the next group's prefetch compiled in (a memory-bound tile loses to the extra check).
// `Family` names the rows' type (In), the packed weight's (W), the output's (Out), the epilogue
// (Epi) and `template <int MR, int NR, bool Next> static Fn tile()`, its register tile.
template <typename Family, bool Next>
struct Tiles {
  using In = typename Family::In;
  using W = typename Family::W;
  using Out = typename Family::Out;
  using Epi = typename Family::Epi;
  using Fn = void (*)(const In*, int64_t, const W*, int64_t, int64_t, Out*, int64_t, const Epi&,
                      int, bool, NextGroup);
  template <int MR>
  static constexpr std::array<Fn, kPanels> row() {
    return {Family::template tile<MR, 1, Next>(), Family::template tile<MR, 2, Next>(),
            Family::template tile<MR, 3, Next>()};
  }
  template <size_t... I>
  static constexpr std::array<std::array<Fn, kPanels>, kRows> rows(std::index_sequence<I...>) {
    return {row<static_cast<int>(I) + 1>()...};
  }
  static constexpr std::array<std::array<Fn, kPanels>, kRows> table() {
    return rows(std::make_index_sequence<kRows>{});
  }
};

// y [m, n] = the rows of x times the packed weight, through `Family`'s tiles; `k_steps` groups of
// k per panel row, `panel_elems` elements of W per panel, `epi` the family's epilogue for the
// whole output (each tile gets it shifted to its own rows and columns).
template <typename Family>
void packed_linear_impl(const typename Family::In* x, int64_t m, int64_t lda,
                        const typename Family::W* packed, int64_t n, int64_t k_steps,
                        int64_t panel_elems, const typename Family::Epi& epi,
                        typename Family::Out* y) {
  using W = typename Family::W;
  static constexpr auto tiles = Tiles<Family, false>::table();
  static constexpr auto tiles_prefetching = Tiles<Family, true>::table();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  // Threads take contiguous runs of column groups from a shared counter, a few runs each: every
  // run streams its own stretch of the weight, and a thread that the OS preempts (an API server
  // or the engine's I/O wanting the core) leaves its remaining runs to the others instead of
  // holding the whole step at the join. A run is at most what fits in half the L2 cache.
  //
  // Within a run, rows go in blocks of kRowBlock: for each column group every row tile of the
  // block runs while the group is in cache, and those tiles prefetch the next group (the packed
  // panels are contiguous, so it starts where this one ends). For a decode batch that is the whole
  // batch, and reading the weights overlaps the arithmetic. Later row blocks of a prompt find
  // the run's weights in L2 and prefetch nothing.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  const int64_t group_bytes = kPanels * panel_elems * static_cast<int64_t>(sizeof(W));
  const int64_t fits = std::max<int64_t>(1, kRunBytes / group_bytes);
  // A few rows do too little arithmetic per weight to hide anything: there the stream of each
  // panel just reads a little ahead of itself, which keeps more of the bandwidth. And each thread
  // takes one contiguous stretch (up to kRunBytes) instead of a group at a time: a decode step's
  // projections are 0.2-1 MB, so single groups were 17 KB pieces that each started their streams
  // cold, and a stretch streams on from one group into the next.
  const bool overlap = m >= OverlapRows<Family>::value;
  const int64_t run = overlap ? std::clamp<int64_t>(groups / (threads * 4), 1, fits)
                              : std::clamp<int64_t>((groups + threads - 1) / threads, 1, fits);
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    // The thread claims its following run when it starts the last group of this one, so that
    // the following run's first group is prefetched like every other.
    int64_t begin = next.fetch_add(run);
    bool first_fetched = false;  // was this run's first group prefetched by the one before?
    while (begin < groups) {
      const int64_t end = std::min(groups, begin + run);
      int64_t following = -1;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, m - r0);
        const int64_t tiles_in_block = (rows + kRows - 1) / kRows;
        // The block's rows shared out evenly between its tiles (AVX-512, 8-row tiles: 30 rows
        // are 8, 8, 7, 7 rather than three 8s and a 6; on AVX2 a tile is the whole block, split
        // the same way inside): a thin tile has too few accumulators to keep the FMA units
        // busy. Every tile sums k in the same order, so a row's bits do not depend on which
        // tile it lands in.
        const int64_t tile_rows = rows / tiles_in_block, wider = rows % tiles_in_block;
        for (int64_t g = begin; g < end; ++g) {
          const int64_t p0 = g * kPanels;
          const int np = static_cast<int>(std::min<int64_t>(kPanels, panels - p0));
          const int64_t col0 = p0 * kPanel;
          const int last_cols =
              static_cast<int>(std::min<int64_t>(kPanel, n - (p0 + np - 1) * kPanel));
          // Which group comes next for this thread, and its lines shared out between the
          // block's row tiles (only the first row block reads from memory).
          int64_t upcoming = -1;
          if (r0 == 0 && overlap) {
            if (g + 1 < end) {
              upcoming = g + 1;
            } else {
              following = next.fetch_add(run);
              if (following < groups) upcoming = following;
            }
          }
          const char* ahead = nullptr;
          int64_t ahead_lines = 0;
          if (upcoming >= 0) {
            const int64_t q0 = upcoming * kPanels;
            const int64_t q_panels = std::min<int64_t>(kPanels, panels - q0);
            ahead = reinterpret_cast<const char*>(packed + q0 * panel_elems);
            ahead_lines = q_panels * panel_elems * static_cast<int64_t>(sizeof(W)) / 64;
          }
          const int64_t share = (ahead_lines + tiles_in_block - 1) / tiles_in_block;
          for (int64_t t = 0; t < tiles_in_block; ++t) {
            const int64_t r = r0 + t * tile_rows + std::min(t, wider);
            const int mr = static_cast<int>(tile_rows + (t < wider ? 1 : 0));
            NextGroup pf;
            pf.lines = ahead == nullptr ? nullptr : ahead + t * share * 64;
            pf.count = std::max<int64_t>(0, std::min(share, ahead_lines - t * share));
            // A first group nobody prefetched: its first tile reads ahead of itself.
            const bool read_ahead = r0 == 0 && t == 0 && (!overlap || (g == begin && !first_fetched));
            const auto& pick = pf.count > 0 ? tiles_prefetching : tiles;
            pick[mr - 1][np - 1](x + r * lda, lda, packed + p0 * panel_elems, panel_elems,
                                  k_steps, y + r * n + col0, n, epi.at(r, col0),
                                  last_cols, read_ahead, pf);
          }
        }
      }
      first_fetched = overlap;
      begin = overlap ? following : next.fetch_add(run);
    }
  };
  if (threads == 1) {
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

// bfloat16 rows times bfloat16 weights packed in pairs ([N/16][K/2][16][2]) on AMX tiles, for
// any number of rows (csrc/gemm_amx.cpp). `amx_ready()` says whether this build has the tiles
// and the OS granted this process their state; the call needs it, and K a multiple of 32
// (`kpairs` of 16).
// Weight-only int8 weights, packed the same way, take the tiles too: each weight tile converted
// to bfloat16 (exactly: every integer up to 256 is one) before it loads, scaled per column after.
bool amx_ready();
void amx_bf16_linear(const bf16* x, int64_t m, int64_t lda, const bf16* packed, int64_t n,
                     int64_t kpairs, int64_t panel_elems, const BiasEpilogue& epi, bf16* y);
void amx_bf16_linear(const bf16* x, int64_t m, int64_t lda, const int8_t* packed, int64_t n,
                     int64_t kpairs, int64_t panel_elems, const ScaledEpilogue& epi, bf16* y);
constexpr int64_t kAmxPairs = 16;  // pairs of k in one tile: K must be a multiple of 2 x this

// The 15-bit group kernels' call (csrc/gemm_q4.cpp, csrc/gemm_q8.cpp): the rows of x (float32 or
// bfloat16) quantized into a buffer of `row_bytes` a row by `quantize(src, begin, end, out)`, then
// `Family<Out>`'s tiles over them into y, of x's dtype. A decode step's few rows are quantized on
// this thread (waking the pool costs more than they do).
template <template <typename> class Family, typename W, typename Quantize>
void quantized_rows_linear(const at::Tensor& x, int64_t row_bytes, const Quantize& quantize,
                           const W* packed, int64_t n, int64_t k_steps, int64_t panel_elems,
                           const BiasEpilogue& epi, at::Tensor& y) {
  const int64_t m = x.size(0);
  at::Tensor rows = at::empty({m, row_bytes}, x.options().dtype(at::kChar));
  int8_t* rows_ptr = rows.data_ptr<int8_t>();
  const bool f32 = x.scalar_type() == at::kFloat;
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    if (f32) {
      quantize(x.data_ptr<float>(), begin, end, rows_ptr);
    } else {
      quantize(x.data_ptr<bf16>(), begin, end, rows_ptr);
    }
  });
  if (f32) {
    packed_linear_impl<Family<float>>(rows_ptr, m, row_bytes, packed, n, k_steps, panel_elems, epi,
                                      y.data_ptr<float>());
  } else {
    packed_linear_impl<Family<bf16>>(rows_ptr, m, row_bytes, packed, n, k_steps, panel_elems, epi,
                                     y.data_ptr<bf16>());
  }
}

// One panel of 16 output rows of `w` ([n, k], row-major) written in the packed order: for each
// group of `pair` consecutive k (1; 2 for VDPBF16PS and int8 pairs; 4 for VNNI), the 16 rows'
// groups side by side. Rows past n and the last group's missing k are `fill`. Each row is read
// once, in order, and scattered into the panel, which stays in cache meanwhile (16 x k
// elements). Elements are copied as raw bits (`T` is their width).
template <typename T>
void pack_panel(const T* w, int64_t n, int64_t k, int64_t panel, int pair, T* out, T fill = T(0)) {
  const int64_t groups = (k + pair - 1) / pair;
  const int64_t row0 = panel * 16;
  const int64_t rows = std::min<int64_t>(16, n - row0);
  if (rows < 16 || groups * pair != k) std::fill(out, out + groups * 16 * pair, fill);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = w + (row0 + r) * k;
    T* dst = out + r * pair;
    if (pair == 1) {
      for (int64_t c = 0; c < k; ++c) dst[c * 16] = src[c];
    } else if (pair == 2) {
      for (int64_t c = 0; c < k; ++c) dst[(c >> 1) * 32 + (c & 1)] = src[c];
    } else {
      for (int64_t c = 0; c < k; ++c) dst[(c / pair) * 16 * pair + c % pair] = src[c];
    }
  }
}

// A linear's bias as float32, checked to have n elements (undefined without one), and the
// pointer the epilogues take (null without one).
inline at::Tensor bias_as_float(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias must have ", n, " elements");
  return bias->to(at::kFloat).contiguous();
}
inline const float* float_data(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

// x [m, k] (float32 or bfloat16, unit stride) as float32 rows, bfloat16 widened exactly: what
// bfloat16 rows become where the build has no VDPBF16PS. A plain loop on this thread: a decode
// step's few rows are converted in well under the time torch's parallel `to()` takes to wake
// its threads (that fork and join cost a decode ~14 us per call).
inline at::Tensor rows_as_float(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x;
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor a = at::empty({m, k}, x.options().dtype(at::kFloat));
  float* out = a.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    const bf16* src = x.data_ptr<bf16>() + i * x.stride(0);
    for (int64_t c = 0; c < k; ++c) out[i * k + c] = static_cast<float>(src[c]);
  }
  return a;
}

}  // namespace gemm
}  // namespace rankcast
