// bfloat16 linear layers on AMX tiles (TDPBF16PS), for steps of every row count on the CPUs that
// have them (Sapphire Rapids and later Xeons), reading the same packed weight as the AVX512-BF16
// kernel (csrc/gemm.cpp): [N/16][K/2][16][2] is, sixteen pairs of k at a time, exactly a tile's
// B operand (16 rows of 64 bytes), so one packing (and one weight snapshot) serves both.
// Weight-only int8 weights (`--quantization int8`, bfloat16 rows) are packed the same way with
// int8 elements and converted to bfloat16 (exactly) before they load: tile by tile into L1 for
// a step of up to 32 rows, a column group at a time for more (`ConvertedTiles`, below). On the
// 2-core Sapphire Rapids Xeon that took a batch of 32 from 520 to 2,122 tok/s.
//
// Why an own kernel and not oneDNN's: oneDNN chooses its blocking by the number of rows, and so
// the order each output sums k in; a request's bits then depend on the batch (issue 37's check:
// 8 of 12 chats changed text on an AMX Xeon). Here every output is one tile element summed over
// k in order, 32 k a tile, whatever the rows (docs/cpu-paths.md).
//
// The walk follows the AVX512-BF16 driver's (gemm.h): threads take contiguous runs of column
// groups (two panels, 32 output columns) from a shared counter, each run small enough to stay in
// L2 while every block of 32 rows multiplies it. A block keeps 2 x 2 tiles of sums (32 rows x 32 columns)
// in tmm0-3, its two row tiles in tmm4-5 and the two panels' weights in tmm6-7.
//
// Not bitwise the AVX512-BF16 kernel's results: measured on an Emerald Rapids Xeon, TDPBF16PS
// matched neither order of VDPBF16PS's two rounded adds per pair, nor one rounding of the pair's
// sum, in 88 % of outputs (K = 1536). So an AMX build multiplies every bfloat16 step on tiles,
// one row or a thousand, and its results depend on the rows beside them no more than the
// AVX512-BF16 kernel's do. A single row on tiles streamed its weights 1.5x faster than a plain
// VDPBF16PS loop on that Xeon (12.8 against 8.4 GB/s on one core; 16 rows 13.0 against 1.4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.h"

#if RANKCAST_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace rankcast {
namespace gemm {

#if RANKCAST_AMX_BF16
namespace {

constexpr int kTileRows = 16;    // rows of a tile (of x, of the sums)
constexpr int kBlockRows = 32;   // rows of x a block multiplies (two row tiles)
constexpr int kGroupPanels = 2;  // panels (16 columns each) a block multiplies

// The tiles for a block of `rows` rows (1..32): the upper row tile (tmm4) and its sums (tmm0-1)
// take the first 16 rows, the lower (tmm5, sums tmm2-3) the rest, the weights (tmm6-7) a
// panel's 16 pairs of k each. A block of fewer rows loads and multiplies only the rows it has,
// so no tile reads past the end of x; the rows' sums are the same whatever their count (each
// output element depends on its own row only: checked bitwise on a Xeon, 1 row against 16).
void configure_tiles(int64_t rows) {
  TileConfig config;
  const int upper = static_cast<int>(std::min<int64_t>(rows, kTileRows));
  const int lower = static_cast<int>(rows - upper);
  for (int t : {0, 1, 4}) config.rows[t] = static_cast<uint8_t>(upper);
  for (int t : {2, 3, 5}) config.rows[t] = static_cast<uint8_t>(lower);
  for (int t : {6, 7}) config.rows[t] = kAmxPairs;
  for (int t = 0; t < 8; ++t) config.colsb[t] = config.rows[t] > 0 ? 64 : 0;
  load_tile_config(config);
}

// Linux hands a process the tiles' 8 KB of register state only when asked (ARCH_REQ_XCOMP_PERM
// for XTILEDATA); without it the first tile instruction is a fatal fault.
bool request_tile_state() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// A decode's weight tiles are read ahead of use: every line of each panel's tile 2 KB (two tiles)
// on, as PREFETCHT0. The tiles alone left the memory system idle between loads: on the Emerald
// Rapids Xeon (2 pinned cores, random-weight SmolLM2 shapes, four builds alternated in one run)
// the read-ahead took a single stream from 94.7 to 104.3 tok/s, the LM head at one row from
// 1,950 to 1,462 us.
constexpr int64_t kAmxAhead = 2048;

inline void prefetch_tile(const bf16* tile) {
  const char* p = reinterpret_cast<const char*>(tile) + kAmxAhead;
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + line * 64, _MM_HINT_T0);
}

// A block's weight tiles, one tile of k (16 pairs) of each of its NP panels at a time: read in
// place from the packed bfloat16 weight, 2 KB ahead in a decode (`Ahead`).
template <bool Ahead>
struct PackedTiles {
  const bf16* b;
  int64_t panel_elems;

  template <int NP>
  void at(int64_t t, const bf16*& w0, const bf16*& w1) const {
    const int64_t e = t * kAmxPairs * kPanel * 2;
    if constexpr (Ahead) {
      prefetch_tile(b + e);
      if constexpr (NP == 2) prefetch_tile(b + panel_elems + e);
    }
    w0 = b + e;
    w1 = b + panel_elems + e;
  }
};

// Weight-only int8 (csrc/gemm.cpp's packing: the bfloat16 layout with int8 elements) converted
// to bfloat16, exactly (every integer up to 256 is one), reading the int8 1 KB (two tiles) ahead.
constexpr int64_t kInt8Ahead = 1024;

void int8_to_bf16(const int8_t* src, int64_t elems, bf16* dst) {
  for (int64_t e = 0; e < elems; e += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(src + e) + kInt8Ahead, _MM_HINT_T0);
    _mm512_storeu_si512(dst + e, reinterpret_cast<__m512i>(int8_as_bf16_pairs(src + e)));
  }
}

// A step of one row block (up to 32 rows) converts each int8 tile just before it loads, into a
// 2 KB buffer that stays in L1; a larger step converts a column group once for all its row
// blocks (csrc/gemm_amx.cpp's driver, below) and reads it as PackedTiles.
struct ConvertedTiles {
  const int8_t* b;
  int64_t panel_elems;
  bf16* buffer;  // two tiles

  template <int NP>
  void at(int64_t t, const bf16*& w0, const bf16*& w1) const {
    constexpr int64_t kTileElems = kAmxPairs * kPanel * 2;
    const int64_t e = t * kTileElems;
    int8_to_bf16(b + e, kTileElems, buffer);
    if constexpr (NP == 2) int8_to_bf16(b + panel_elems + e, kTileElems, buffer + kTileElems);
    w0 = buffer;
    w1 = buffer + kTileElems;
  }
};

// Sums of one block, as configured: its rows of `a` (`a_stride` bytes apart; the lower row tile
// only where `lower`) times `NP` panels of `weights`, over `k_tiles` tiles of k in order, stored
// as float32 to `sums` [32][32].
template <int NP, typename Weights>
inline void block_sums(const bf16* a, int64_t a_stride, bool lower, const Weights& weights,
                       int64_t k_tiles, float* sums) {
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if (lower) {
    _tile_zero(2);
    if constexpr (NP == 2) _tile_zero(3);
  }
  const bf16* a_lower = a + kTileRows * (a_stride / static_cast<int64_t>(sizeof(bf16)));
  for (int64_t t = 0; t < k_tiles; ++t) {
    const int64_t k_elem = t * kAmxPairs * 2;
    const bf16* w0;
    const bf16* w1;
    weights.template at<NP>(t, w0, w1);
    _tile_loadd(6, w0, 64);
    if constexpr (NP == 2) _tile_loadd(7, w1, 64);
    _tile_loadd(4, a + k_elem, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if (lower) {
      _tile_loadd(5, a_lower + k_elem, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t stride = kGroupPanels * kPanel * sizeof(float);
  float* lower_sums = sums + kTileRows * kGroupPanels * kPanel;
  _tile_stored(0, sums, stride);
  if constexpr (NP == 2) _tile_stored(1, sums + kPanel, stride);
  if (lower) {
    _tile_stored(2, lower_sums, stride);
    if constexpr (NP == 2) _tile_stored(3, lower_sums + kPanel, stride);
  }
}

template <typename Weights>
inline void any_block_sums(int np, const bf16* a, int64_t a_stride, bool lower,
                           const Weights& weights, int64_t k_tiles, float* sums) {
  if (np == 2) {
    block_sums<2>(a, a_stride, lower, weights, k_tiles, sums);
  } else {
    block_sums<1>(a, a_stride, lower, weights, k_tiles, sums);
  }
}

template <typename W, typename Epi>
void amx_linear(const bf16* x, int64_t m, int64_t lda, const W* packed, int64_t n, int64_t kpairs,
                int64_t panel_elems, const Epi& epi, bf16* y) {
  TORCH_CHECK(amx_ready(), "amx_bf16_linear: the OS did not grant the AMX tile state");
  TORCH_CHECK(kpairs % kAmxPairs == 0, "amx_bf16_linear: K must be a multiple of ", 2 * kAmxPairs);
  constexpr bool kConverted = !std::is_same_v<W, bf16>;
  const int64_t k_tiles = kpairs / kAmxPairs;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = (panels + kGroupPanels - 1) / kGroupPanels;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  const int64_t group_bytes = kGroupPanels * panel_elems * static_cast<int64_t>(sizeof(W));
  const int64_t fits = std::max<int64_t>(1, kRunBytes / group_bytes);
  // Runs of about a quarter of a thread's share, claimed as threads free, at every row count:
  // unlike the dot-product kernel's decode, one contiguous stretch a thread was slower here
  // (single stream 76.0 against 94.7 tok/s on that Xeon, without the read-ahead).
  const int64_t run = std::clamp<int64_t>(groups / (threads * 4), 1, fits);
  // bfloat16 weights are read in place, ahead of use in a decode (PackedTiles<true>); int8
  // weights are read ahead by their conversion at every row count (int8_to_bf16).
  const bool ahead = m < kOverlapRows;
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(bf16));
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    alignas(64) float sums[kBlockRows * kGroupPanels * kPanel];
    std::vector<bf16> converted;  // a column group, for steps of more than one row block
    if constexpr (kConverted) {
      if (m > kBlockRows) converted.resize(kGroupPanels * panel_elems);
    }
    alignas(64) bf16 tile_buffer[kGroupPanels * kAmxPairs * kPanel * 2];
    int64_t configured = 0;  // the block rows the tiles are configured for (0: none yet)
    auto multiply_block = [&](int64_t r0, int64_t g, const auto& weights, int np) {
      const int64_t rows = std::min<int64_t>(kBlockRows, m - r0);
      if (rows != configured) {
        configure_tiles(rows);
        configured = rows;
      }
      any_block_sums(np, x + r0 * lda, a_stride, rows > kTileRows, weights, k_tiles, sums);
      const int64_t col0 = g * kGroupPanels * kPanel;
      const Epi block_epi = epi.at(r0, col0);
      for (int64_t i = 0; i < rows; ++i)
        for (int j = 0; j < np; ++j) {
          const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - col0 - j * kPanel));
          block_epi.store(y + (r0 + i) * n + col0 + j * kPanel,
                          load16(sums + i * kGroupPanels * kPanel + j * kPanel),
                          static_cast<int>(i), j, cols);
        }
    };
    for (int64_t begin = next.fetch_add(run); begin < groups; begin = next.fetch_add(run)) {
      const int64_t end = std::min(groups, begin + run);
      if constexpr (kConverted) {
        for (int64_t g = begin; g < end; ++g) {
          const int64_t p0 = g * kGroupPanels;
          const int np = static_cast<int>(std::min<int64_t>(kGroupPanels, panels - p0));
          const int8_t* b = packed + p0 * panel_elems;
          if (m <= kBlockRows) {  // one row block: each tile converted as it is used
            multiply_block(0, g, ConvertedTiles{b, panel_elems, tile_buffer}, np);
            continue;
          }
          // Group by group: converted once, multiplied by every row block.
          int8_to_bf16(b, np * panel_elems, converted.data());
          for (int64_t r0 = 0; r0 < m; r0 += kBlockRows)
            multiply_block(r0, g, PackedTiles<false>{converted.data(), panel_elems}, np);
        }
      } else {
        // Row block by row block over the run, which stays in L2 meanwhile.
        for (int64_t r0 = 0; r0 < m; r0 += kBlockRows)
          for (int64_t g = begin; g < end; ++g) {
            const int64_t p0 = g * kGroupPanels;
            const int np = static_cast<int>(std::min<int64_t>(kGroupPanels, panels - p0));
            const bf16* b = packed + p0 * panel_elems;
            if (ahead) {
              multiply_block(r0, g, PackedTiles<true>{b, panel_elems}, np);
            } else {
              multiply_block(r0, g, PackedTiles<false>{b, panel_elems}, np);
            }
          }
      }
    }
    if (configured > 0) _tile_release();
  };
  if (threads == 1) {
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

}  // namespace

bool amx_ready() {
  static const bool ready = request_tile_state();
  return ready;
}

void amx_bf16_linear(const bf16* x, int64_t m, int64_t lda, const bf16* packed, int64_t n,
                     int64_t kpairs, int64_t panel_elems, const BiasEpilogue& epi, bf16* y) {
  amx_linear(x, m, lda, packed, n, kpairs, panel_elems, epi, y);
}

void amx_bf16_linear(const bf16* x, int64_t m, int64_t lda, const int8_t* packed, int64_t n,
                     int64_t kpairs, int64_t panel_elems, const ScaledEpilogue& epi, bf16* y) {
  amx_linear(x, m, lda, packed, n, kpairs, panel_elems, epi, y);
}

#else

bool amx_ready() { return false; }

void amx_bf16_linear(const bf16*, int64_t, int64_t, const bf16*, int64_t, int64_t, int64_t,
                     const BiasEpilogue&, bf16*) {
  TORCH_CHECK(false, "amx_bf16_linear: this kernel build has no AMX-BF16 tiles");
}

void amx_bf16_linear(const bf16*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t,
                     const ScaledEpilogue&, bf16*) {
  TORCH_CHECK(false, "amx_bf16_linear: this kernel build has no AMX-BF16 tiles");
}

#endif

}  // namespace gemm
}  // namespace rankcast
