// LoRA deltas of a bfloat16 step on AMX tiles (TDPBF16PS), for the CPUs that have them: the
// slots hold bfloat16 A and B packed as a tile's B operand (rankcast/lora/tile_layout.py), and
// csrc/lora.cpp hands such slots here.
//
// Why: the float32 kernel (csrc/lora.cpp) runs at ~35-45 GFMA/s a core, where the base model's
// matmuls run on tiles at ~600; on the Sapphire Rapids Xeon a 160-token prefill step with two
// adapters spent 7.5 ms of ~50 in it, most of what an adapter's prefill cost beyond the base
// model's (~39 ms). On tiles the shrink (x A^T, K = the layer's input) is a handful of tile
// products per 16 tokens, and the expand (shrunk B, K = the rank) little more than adding a
// panel of sums into the output. Measured there (one core, slots in cache, 30 layers, 160
// tokens on two rank-8 adapters): 9.1-9.6 -> 6.1-6.3 ms; in the engine's prefill step, what two
// adapters add ~10 -> ~8 ms. A block of one to four tokens costs ~1.1 us more a call than in the
// float32 kernel (two tile configurations, a pass over every output panel): the fix for both
// is to fuse the expand into the base linear's tiles (one more tile of k), not done yet.
//
// Precision: bfloat16 operands, float32 sums, as vLLM's and PEFT's bfloat16 paths: A and B
// (scaled) are rounded to bfloat16 once when an adapter is packed, each token's shrunk row once
// before the expand, and its delta added to the output in float32 and rounded once.
//
// Batch invariance: every element of a tile product sums its own row over k in order, whatever
// rows share the tile (csrc/gemm_amx.cpp), and everything else here is per token: a token's
// delta has the same bits alone as in any block of its slot's tokens.
//
// Layouts, with kr = the packed rank (`tile_rank`: the slots' rank made even up to 16, else a
// multiple of 32), w = min(kr, 16) rank rows a panel of A, P = kr / w, K = the input padded to
// 32, np = the output's panels:
//   A of one sub-projection: [slots, P, K/2, w, 2]    element [s, p, k/2, j, k%2] = A_s[wp+j, k]
//   B of one sub-projection: [slots, np, kr/2, 16, 2] element [s, c, j/2, i, j%2] = B_s[j, 16c+i]
// with B_s the slot's [rank, n] B transposed and scaled, zero beyond the adapter's rank.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm.h"
#include "kernels.h"

namespace rankcast {

#if RANKCAST_AMX_BF16
namespace {

using gemm::TileConfig;
using gemm::kAmxPairs;
using gemm::kPanel;

constexpr int kTileRows = 16;
constexpr int kBlockRows = 32;  // a slot's tokens multiplied together (two row tiles)
constexpr int64_t kRunPanels = 8;  // output panels the expand sums before adding them (16 KB)

struct PackedSub {
  const bf16* a;  // [slots, P, K/2, w, 2]
  const bf16* b;  // [slots, np, kr/2, 16, 2]
  int64_t offset, panels;
};

// The tiles for a block of `rows` tokens (1..32), in one of two phases. Both keep sums in
// tmm0-3, two sets of a block's upper and lower 16 rows (tmm0-1, tmm2-3) that take turns, so
// that consecutive products do not depend on each other. (Measured on the Sapphire Rapids Xeon:
// no faster than one set, the time being in the tile loads and each block's setup; kept, as it
// costs nothing and fixes the order a token's sums are added in.)
// - Shrink: tmm4-5 the rows of x (32 k), tmm6-7 tiles of A (16 pairs of k for a panel of rank
//   rows, up to 16).
// - Expand: tmm4-5 the rows' shrunk values (`pairs` pairs of rank), tmm6-7 tiles of B.
enum class Phase { kShrink, kExpand };

// `columns`: the rank rows in a panel of A (the shrink's sums and weight tiles are that wide);
// `pairs`: the pairs of rank in a tile of the expand.
void configure_tiles(int rows, Phase phase, int columns, int pairs) {
  TileConfig config;
  const int upper = std::min(rows, kTileRows);
  const int lower = rows - upper;
  const bool shrink = phase == Phase::kShrink;
  for (int t : {0, 2, 4}) config.rows[t] = static_cast<uint8_t>(upper);
  for (int t : {1, 3, 5}) config.rows[t] = static_cast<uint8_t>(lower);
  for (int t : {6, 7}) config.rows[t] = static_cast<uint8_t>(shrink ? kAmxPairs : pairs);
  const auto bytes = [](int n) { return static_cast<uint16_t>(4 * n); };
  for (int t = 0; t < 8; ++t) {
    if (config.rows[t] == 0) continue;
    const bool x_or_shrunk = t == 4 || t == 5;
    config.colsb[t] = shrink ? (x_or_shrunk ? 64 : bytes(columns)) : (x_or_shrunk ? bytes(pairs) : 64);
  }
  gemm::load_tile_config(config);
}

// The packed shapes of one slot, from the slots' rank and one sub-projection's input.
struct TileShape {
  int64_t kr, a_columns, row_panels, k_padded, pairs, k_tiles;

  TileShape(int64_t rank, int64_t in)
      : kr(rank <= kPanel ? (rank + 1) / 2 * 2 : (rank + 31) / 32 * 32),
        a_columns(std::min<int64_t>(kr, kPanel)),
        row_panels(kr / a_columns),
        k_padded((in + 2 * kAmxPairs - 1) / (2 * kAmxPairs) * (2 * kAmxPairs)),
        pairs(std::min<int64_t>(kr / 2, kAmxPairs)),
        k_tiles(kr / (2 * pairs)) {}
};

// The tile intrinsics take their registers as literals, hence a branch per set of sums.
// multiply<Set>: the block's rows (`upper`, `lower`: into tmm4-5, unless `LoadRows` is false
// and they are there already) times one tile of weights (`w`, into tmm6 or tmm7), summed into
// the set's tiles (tmm0-1 or tmm2-3).
inline void load_rows(const void* upper, const void* lower, int64_t stride, bool has_lower) {
  _tile_loadd(4, upper, stride);
  if (has_lower) _tile_loadd(5, lower, stride);
}

template <int Set, bool LoadRows = true>
inline void multiply(const void* w, int64_t w_stride, const void* upper, const void* lower,
                     int64_t stride, bool has_lower) {
  if constexpr (Set == 0) {
    _tile_loadd(6, w, w_stride);
    if constexpr (LoadRows) _tile_loadd(4, upper, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (has_lower) {
      if constexpr (LoadRows) _tile_loadd(5, lower, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
  } else {
    _tile_loadd(7, w, w_stride);
    if constexpr (LoadRows) _tile_loadd(4, upper, stride);
    _tile_dpbf16ps(2, 4, 7);
    if (has_lower) {
      if constexpr (LoadRows) _tile_loadd(5, lower, stride);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

template <int Set>
inline void zero_sums(bool has_lower) {
  if constexpr (Set == 0) {
    _tile_zero(0);
    if (has_lower) _tile_zero(1);
  } else {
    _tile_zero(2);
    if (has_lower) _tile_zero(3);
  }
}

// The set's sums to `upper` and `lower` (`stride` bytes a row).
template <int Set>
inline void store_sums(float* upper, float* lower, int64_t stride, bool has_lower) {
  if constexpr (Set == 0) {
    _tile_stored(0, upper, stride);
    if (has_lower) _tile_stored(1, lower, stride);
  } else {
    _tile_stored(2, upper, stride);
    if (has_lower) _tile_stored(3, lower, stride);
  }
}

// One panel of the expand through set `Set`: the rows' shrunk values times the panel's B. A
// rank of one tile (up to 16, `k_tiles` 1) finds the rows' shrunk values in tmm4-5 already,
// loaded once for every panel (`block_deltas`).
template <int Set>
inline void expand_panel(const bf16* panel, const bf16* shrunk, const TileShape& shape,
                         float* upper, float* lower, int64_t stride, bool has_lower) {
  zero_sums<Set>(has_lower);
  const int64_t shrunk_stride = shape.kr * static_cast<int64_t>(sizeof(bf16));
  if (shape.k_tiles == 1) {
    multiply<Set, false>(panel, 64, nullptr, nullptr, 0, has_lower);
  } else {
    for (int64_t j = 0; j < shape.kr; j += 2 * shape.pairs)
      multiply<Set>(panel + j * kPanel, 64, shrunk + j, shrunk + kTileRows * shape.kr + j,
                    shrunk_stride, has_lower);
  }
  store_sums<Set>(upper, lower, stride, has_lower);
}

// One block: `rows` tokens of one slot, their inputs in `xs` ([32, K] bfloat16, zero past the
// input), their outputs at `dst`. Every sub-projection's shrink first (`shrunk`: [subs, 32,
// kr]), then every expand, each phase under its own tile configuration.
void block_deltas(const bf16* xs, int rows, bf16* const* dst, const std::vector<PackedSub>& subs,
                  int64_t slot, const TileShape& shape, float* sums, bf16* shrunk,
                  float* run_sums) {
  const bool lower = rows > kTileRows;
  const int64_t x_stride = shape.k_padded * static_cast<int64_t>(sizeof(bf16));
  const bf16* xs_lower = xs + kTileRows * shape.k_padded;
  // sums: [2 (even, odd tiles of k), 32 rows, kr]
  const int64_t sums_stride = shape.kr * static_cast<int64_t>(sizeof(float));
  float* odd_sums = sums + kBlockRows * shape.kr;
  const int64_t columns = shape.a_columns;
  const int64_t a_stride = 2 * columns * static_cast<int64_t>(sizeof(bf16));
  const int64_t a_slot = shape.kr * shape.k_padded;
  configure_tiles(rows, Phase::kShrink, static_cast<int>(columns), static_cast<int>(shape.pairs));
  for (size_t i = 0; i < subs.size(); ++i) {
    // sums[r, j] = x_r . A[j], a panel of A's rank rows (up to 16) at a time: even tiles of k
    // into one set of sums, odd into the other, added at the end (the same order for every
    // token).
    const bf16* a = subs[i].a + slot * a_slot;
    for (int64_t p = 0; p < shape.row_panels; ++p) {
      zero_sums<0>(lower);
      zero_sums<1>(lower);
      const bf16* panel = a + p * shape.k_padded * columns;
      constexpr int64_t kStep = 2 * kAmxPairs;  // k per tile
      for (int64_t k = 0; k < shape.k_padded; k += 2 * kStep) {
        multiply<0>(panel + k * columns, a_stride, xs + k, xs_lower + k, x_stride, lower);
        if (k + kStep < shape.k_padded)
          multiply<1>(panel + (k + kStep) * columns, a_stride, xs + k + kStep,
                      xs_lower + k + kStep, x_stride, lower);
      }
      const int64_t lower_rows = kTileRows * shape.kr;
      float* even_at = sums + p * columns;
      float* odd_at = odd_sums + p * columns;
      store_sums<0>(even_at, even_at + lower_rows, sums_stride, lower);
      store_sums<1>(odd_at, odd_at + lower_rows, sums_stride, lower);
    }
    // Each token's shrunk row rounded to bfloat16 once, the expand's operand.
    bf16* sub_shrunk = shrunk + i * kBlockRows * shape.kr;
    for (int r = 0; r < rows; ++r)
      for (int64_t j = 0; j < shape.kr; j += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, shape.kr - j));
        const int64_t e = r * shape.kr + j;
        store16(sub_shrunk + r * shape.kr + j, load16(sums + e, m) + load16(odd_sums + e, m), m);
      }
  }
  configure_tiles(rows, Phase::kExpand, static_cast<int>(columns), static_cast<int>(shape.pairs));
  const int64_t run_stride = kRunPanels * kPanel * static_cast<int64_t>(sizeof(float));
  for (size_t i = 0; i < subs.size(); ++i) {
    // out[r, 16c ...] += shrunk_r B. A run of kRunPanels panels of 16 output columns goes
    // through the tiles into `run_sums`, the two sets of sums taking turns, before any of it is
    // added to the output: a vector load right after the tile store it reads waited on it.
    const PackedSub& sub = subs[i];
    const bf16* sub_shrunk = shrunk + i * kBlockRows * shape.kr;
    const bf16* b = sub.b + slot * sub.panels * shape.kr * kPanel;
    if (shape.k_tiles == 1)
      load_rows(sub_shrunk, sub_shrunk + kTileRows * shape.kr,
                shape.kr * static_cast<int64_t>(sizeof(bf16)), lower);
    for (int64_t c0 = 0; c0 < sub.panels; c0 += kRunPanels) {
      const int64_t run = std::min<int64_t>(kRunPanels, sub.panels - c0);
      for (int64_t c = c0; c < c0 + run; ++c) {
        const bf16* panel = b + c * shape.kr * kPanel;
        float* upper = run_sums + (c - c0) * kPanel;
        float* below = upper + kTileRows * kRunPanels * kPanel;
        if ((c - c0) % 2 == 0) {
          expand_panel<0>(panel, sub_shrunk, shape, upper, below, run_stride, lower);
        } else {
          expand_panel<1>(panel, sub_shrunk, shape, upper, below, run_stride, lower);
        }
      }
      for (int r = 0; r < rows; ++r) {
        bf16* o = dst[r] + sub.offset + c0 * kPanel;
        const float* s = run_sums + r * kRunPanels * kPanel;
        for (int64_t e = 0; e < run * kPanel; e += kPanel) store16(o + e, load16(o + e) + load16(s + e));
      }
    }
  }
}

}  // namespace

bool lora_tiles_supported() { return gemm::amx_ready(); }

void lora_add_tiles(at::Tensor& out, const at::Tensor& x, const int64_t* slots, at::TensorList a,
                    at::TensorList b, at::IntArrayRef out_offsets, int64_t rank) {
  TORCH_CHECK(gemm::amx_ready(), "lora_add: bfloat16 slots need AMX tiles, which this process lacks");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16,
              "lora_add: slots packed for tiles take bfloat16 steps, not ", x.scalar_type());
  const int64_t in = x.size(1);
  const TileShape shape(rank, in);
  const int64_t slot_count = a[0].size(0);
  std::vector<PackedSub> subs;
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].is_contiguous() && a[i].scalar_type() == at::kBFloat16 &&
                    a[i].sizes() == at::IntArrayRef({slot_count, shape.row_panels,
                                                     shape.k_padded / 2, shape.a_columns, 2}),
                "lora_add: bfloat16 A must be packed for tiles as [slots, ", shape.row_panels,
                ", ", shape.k_padded / 2, ", ", shape.a_columns, ", 2], not ", a[i].sizes());
    TORCH_CHECK(b[i].is_contiguous() && b[i].scalar_type() == at::kBFloat16 && b[i].dim() == 5 &&
                    b[i].size(0) == slot_count && b[i].size(2) == shape.kr / 2 &&
                    b[i].size(3) == kPanel && b[i].size(4) == 2,
                "lora_add: bfloat16 B must be packed for tiles as [slots, panels, ", shape.kr / 2,
                ", 16, 2], not ", b[i].sizes());
    const int64_t panels = b[i].size(1);
    TORCH_CHECK(out_offsets[i] >= 0 && out_offsets[i] + panels * kPanel <= out.size(1),
                "lora_add: a sub-projection's columns must lie inside out");
    subs.push_back({a[i].data_ptr<bf16>(), b[i].data_ptr<bf16>(), out_offsets[i], panels});
  }
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slots[t] < slot_count, "lora_add: token ", t, " uses slot ", slots[t], " of ",
                slot_count);
  }
  bf16* out_data = out.data_ptr<bf16>();
  const bf16* x_data = x.data_ptr<bf16>();
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;  // the chunk's tokens that use a slot, in slot order
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] >= 0) order.push_back(t);
    }
    if (order.empty()) return;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
    // Uninitialized: a block's rows are written, padding included, before the tiles read them.
    const std::unique_ptr<bf16[]> xs(new bf16[kBlockRows * shape.k_padded]);
    const std::unique_ptr<float[]> sums(new float[2 * kBlockRows * shape.kr]);
    const std::unique_ptr<bf16[]> shrunk(new bf16[subs.size() * kBlockRows * shape.kr]);
    const std::unique_ptr<float[]> run_sums(new float[kBlockRows * kRunPanels * kPanel]);
    bf16* dst[kBlockRows];
    for (size_t first = 0; first < order.size();) {
      const int64_t slot = slots[order[first]];
      int count = 0;
      while (count < kBlockRows && first + count < order.size() &&
             slots[order[first + count]] == slot) {
        const int64_t t = order[first + count];
        bf16* row = xs.get() + count * shape.k_padded;
        std::memcpy(row, x_data + t * x_stride, in * sizeof(bf16));
        std::fill(row + in, row + shape.k_padded, bf16(0.0f));  // a tile of k reads zeros there
        dst[count++] = out_data + t * out_stride;
      }
      block_deltas(xs.get(), count, dst, subs, slot, shape, sums.get(), shrunk.get(),
                   run_sums.get());
      first += count;
    }
    _tile_release();
  });
}

#else

bool lora_tiles_supported() { return false; }

void lora_add_tiles(at::Tensor&, const at::Tensor&, const int64_t*, at::TensorList, at::TensorList,
                    at::IntArrayRef, int64_t) {
  TORCH_CHECK(false, "lora_add: bfloat16 slots need AMX tiles, which this kernel build lacks");
}

#endif

}  // namespace rankcast
