// Each token's own LoRA delta, added to its row of a projection's output.
//
// For token t on adapter slot s and each sub-projection i (q, k, v of a fused QKV, ...):
//   out[t, offset_i : offset_i + n_i] += (x[t] A_i[s]^T) B_i[s]
// with A_i[s] the slot's [rank, in] rows of A and B_i[s] its [rank, n_i] rows of B (transposed,
// scaling folded in), both float32. The torch path multiplies every token by every slot and masks
// the result (two matmuls whatever the mix of adapters, but slots x the work, and a dozen small
// ops per projection); here each token reads only its own adapter's rows, up to sixteen tokens
// of one adapter at a time (kBlock). Rank rows a smaller adapter leaves empty are zero, so they add
// nothing. A bfloat16 output is read, added to in float32 and rounded once. Slots of bfloat16
// A and B are packed for AMX tiles and go to csrc/lora_amx.cpp instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace rankcast {
namespace {

struct SubProjection {
  const float* a;  // [slots * rank, in]
  const float* b;  // [slots * rank, n]
  int64_t offset, n;
};

// Up to kBlock tokens on the same slot go through together (a step's tokens are taken in slot
// order), kTile of them at a time in registers. A slot's A and B for one SmolLM2 layer are ~250
// KB at rank 8, read from L2 once per block; in a block the rank rows of A (shrink) and the
// column groups of B (expand) go in the outer loop, a few side by side (kWide), so they stay in
// L1 while every tile of tokens passes over them. Against blocks of 4 tokens with one row or
// group at a time, measured on the Sapphire Rapids Xeon (1 thread, SmolLM2's projections at
// rank 8, two slots): 230 tokens through 30 layers 17.5 -> 13.1 ms; in a 160-token prefill step
// with two adapters lora_add 10.3 -> 7.5 ms of ~50. Every token's own sums keep the one-token
// order (its dot in 16 lanes then reduced; its delta added rank row by rank row), so a token's
// output is the same bits whichever tokens share its block or tile: adapters stay
// batch-invariant (and the bits are those of the 4-token blocks before).
constexpr int kBlock = 16;
constexpr int kTile = 4;

// How many rank rows of A or 16-column groups of B one pass keeps in registers beside the
// tile's tokens. An FMA waits ~4 cycles for its accumulator and two issue a cycle, so a pass
// needs ~8 independent sums to keep the units busy, more than a tile's 4. 4 x 4 sums fill half
// of AVX-512's 32 registers; with AVX2 a Vec16 is two of its 16, so there it stays one.
constexpr int kWide = RANKCAST_SIMD_BITS == 512 ? 4 : 1;

// shrunk[r * rank + j0 + k] = x_r . A[j0 + k] for the tile's R rows and J rank rows from j0.
template <int R, int J>
void shrink_tile(const float* rows, int64_t in, const float* a, int64_t rank, int64_t j0,
                 float* shrunk) {
  Vec16 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < J; ++k) acc[r][k] = zero16();
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    Vec16 w[J];
    for (int k = 0; k < J; ++k) w[k] = load16(a + (j0 + k) * in + i);
    for (int r = 0; r < R; ++r) {
      const Vec16 xr = load16(rows + r * in + i);
      for (int k = 0; k < J; ++k) acc[r][k] = fma(xr, w[k], acc[r][k]);
    }
  }
  if (i < in) {
    const int m = static_cast<int>(in - i);
    Vec16 w[J];
    for (int k = 0; k < J; ++k) w[k] = load16(a + (j0 + k) * in + i, m);
    for (int r = 0; r < R; ++r) {
      const Vec16 xr = load16(rows + r * in + i, m);
      for (int k = 0; k < J; ++k) acc[r][k] = fma(xr, w[k], acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < J; ++k) shrunk[r * rank + j0 + k] = reduce_add(acc[r][k]);
}

// The J rank rows from j0 for every tile of the block's `count` rows: those rows of A stay in
// L1 while the tiles pass over them.
template <int J>
void shrink_rows(const float* rows, int count, int64_t in, const float* a, int64_t rank,
                 int64_t j0, float* shrunk) {
  for (int r = 0; r < count; r += kTile) {
    const float* x = rows + r * in;
    float* s = shrunk + r * rank;
    switch (std::min(kTile, count - r)) {
      case 1: shrink_tile<1, J>(x, in, a, rank, j0, s); break;
      case 2: shrink_tile<2, J>(x, in, a, rank, j0, s); break;
      case 3: shrink_tile<3, J>(x, in, a, rank, j0, s); break;
      default: shrink_tile<kTile, J>(x, in, a, rank, j0, s); break;
    }
  }
}

void shrink(const float* rows, int count, int64_t in, const float* a, int64_t rank,
            float* shrunk) {
  int64_t j = 0;
  for (; j + kWide <= rank; j += kWide) shrink_rows<kWide>(rows, count, in, a, rank, j, shrunk);
  for (; j < rank; ++j) shrink_rows<1>(rows, count, in, a, rank, j, shrunk);
}

// out[r][offset + c : + 16 * C] += shrunk_r B for the tile's R rows, C groups of 16 columns
// (the last one `last` wide).
template <int R, int C, typename T>
void expand_tile(T* const* out, const float* shrunk, const float* b, int64_t rank,
                 const SubProjection& sub, int64_t c, int last) {
  Vec16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < C; ++g)
      acc[r][g] = load16(out[r] + sub.offset + c + 16 * g, g + 1 < C ? 16 : last);
  for (int64_t j = 0; j < rank; ++j) {
    Vec16 w[C];
    for (int g = 0; g < C; ++g) w[g] = load16(b + j * sub.n + c + 16 * g, g + 1 < C ? 16 : last);
    for (int r = 0; r < R; ++r) {
      const Vec16 s = splat(shrunk[r * rank + j]);
      for (int g = 0; g < C; ++g) acc[r][g] = fma(s, w[g], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < C; ++g)
      store16(out[r] + sub.offset + c + 16 * g, acc[r][g], g + 1 < C ? 16 : last);
}

// The C column groups from c for every tile of the block's `count` rows.
template <int C, typename T>
void expand_columns(T* const* out, int count, const float* shrunk, const float* b, int64_t rank,
                    const SubProjection& sub, int64_t c, int last) {
  for (int r = 0; r < count; r += kTile) {
    T* const* o = out + r;
    const float* s = shrunk + r * rank;
    switch (std::min(kTile, count - r)) {
      case 1: expand_tile<1, C>(o, s, b, rank, sub, c, last); break;
      case 2: expand_tile<2, C>(o, s, b, rank, sub, c, last); break;
      case 3: expand_tile<3, C>(o, s, b, rank, sub, c, last); break;
      default: expand_tile<kTile, C>(o, s, b, rank, sub, c, last); break;
    }
  }
}

template <typename T>
void expand(T* const* out, int count, const float* shrunk, const float* b, int64_t rank,
            const SubProjection& sub) {
  int64_t c = 0;
  for (; c + 16 * kWide <= sub.n; c += 16 * kWide)
    expand_columns<kWide>(out, count, shrunk, b, rank, sub, c, 16);
  for (; c < sub.n; c += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, sub.n - c));
    expand_columns<1>(out, count, shrunk, b, rank, sub, c, m);
  }
}

template <typename T>
void lora_add_impl(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t in,
                   const int64_t* slots, int64_t tokens, const std::vector<SubProjection>& subs,
                   int64_t rank) {
  // A decode step's 32 tokens in a few chunks: enough to share between cores, few wake-ups.
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;  // the chunk's tokens that use a slot, in slot order
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] >= 0) order.push_back(t);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
    // Uninitialized: every element is written before it is read (a zeroed block of rows was
    // ~100 KB of memset on every call, a decode step's 120 calls included).
    const std::unique_ptr<float[]> rows(new float[kBlock * in]);
    const std::unique_ptr<float[]> shrunk(new float[kBlock * rank]);
    T* dst[kBlock];
    for (size_t first = 0; first < order.size();) {
      const int64_t slot = slots[order[first]];
      int count = 0;
      while (count < kBlock && first + count < order.size() && slots[order[first + count]] == slot) {
        const int64_t t = order[first + count];
        // The inputs in float32 once (exact), not once per rank row of every sub-projection.
        const T* row = x + t * x_stride;
        for (int64_t i = 0; i < in; ++i) rows[count * in + i] = static_cast<float>(row[i]);
        dst[count++] = out + t * out_stride;
      }
      for (const SubProjection& sub : subs) {
        shrink(rows.get(), count, in, sub.a + slot * rank * in, rank, shrunk.get());
        expand(dst, count, shrunk.get(), sub.b + slot * rank * sub.n, rank, sub);
      }
      first += count;
    }
  });
}

}  // namespace

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& token_slots, at::TensorList a,
              at::TensorList b, at::IntArrayRef out_offsets, int64_t rank) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "lora_add: out must be [tokens, width] with unit stride");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) == out.size(0),
              "lora_add: x must be [tokens, in] with unit stride, one row per row of out");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add: x and out must both be float32 or both bfloat16");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.is_contiguous() &&
                  token_slots.scalar_type() == at::kLong && token_slots.size(0) == x.size(0),
              "lora_add: token_slots must be int64, one per token");
  TORCH_CHECK(a.size() == b.size() && a.size() == out_offsets.size(),
              "lora_add: one A, one B and one offset per sub-projection");
  TORCH_CHECK(rank >= 1, "lora_add: rank must be positive");
  if (!a.empty() && a[0].scalar_type() == at::kBFloat16) {  // slots packed for AMX tiles (csrc/lora_amx.cpp)
    lora_add_tiles(out, x, token_slots.data_ptr<int64_t>(), a, b, out_offsets, rank);
    return;
  }
  const int64_t in = x.size(1);
  std::vector<SubProjection> subs;
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].dim() == 2 && a[i].is_contiguous() && a[i].scalar_type() == at::kFloat &&
                    a[i].size(1) == in && a[i].size(0) % rank == 0,
                "lora_add: A must be contiguous float32 [slots * rank, in]");
    TORCH_CHECK(b[i].dim() == 2 && b[i].is_contiguous() && b[i].scalar_type() == at::kFloat &&
                    b[i].size(0) == a[i].size(0),
                "lora_add: B must be contiguous float32 [slots * rank, n], as many rows as A");
    TORCH_CHECK(out_offsets[i] >= 0 && out_offsets[i] + b[i].size(1) <= out.size(1),
                "lora_add: a sub-projection's columns must lie inside out");
    subs.push_back({a[i].data_ptr<float>(), b[i].data_ptr<float>(), out_offsets[i], b[i].size(1)});
  }
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t slot_count = a.empty() ? 0 : a[0].size(0) / rank;
  for (int64_t t = 0; t < token_slots.size(0); ++t) {
    TORCH_CHECK(slots[t] < slot_count, "lora_add: token ", t, " uses slot ", slots[t], " of ",
                slot_count);
  }
  if (subs.empty()) return;
  AT_DISPATCH_SWITCH(x.scalar_type(), "lora_add",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       lora_add_impl<float>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(),
                                            x.stride(0), in, slots, x.size(0), subs, rank);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       lora_add_impl<bf16>(out.data_ptr<bf16>(), out.stride(0), x.data_ptr<bf16>(),
                                           x.stride(0), in, slots, x.size(0), subs, rank);
                     }));
}

}  // namespace rankcast
