// Each token's own LoRA delta, added to its row of a projection's output.
//
// For token t on adapter slot s and each sub-projection i (q, k, v of a fused QKV, ...):
//   out[t, offset_i : offset_i + n_i] += (x[t] A_i[s]^T) B_i[s]
// with A_i[s] the slot's [rank, in] rows of A and B_i[s] its [rank, n_i] rows of B (transposed,
// scaling folded in), both float32. The torch path multiplies every token by every slot and masks
// the result (two matmuls whatever the mix of adapters, but slots x the work, and a dozen small
// ops per projection); here each token reads only its own adapter's rows, up to four tokens of
// one adapter at a time (kBlock). Rank rows a smaller adapter leaves empty are zero, so they add
// nothing. A bfloat16 output is read, added to in float32 and rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
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
// order): each row of A and B is loaded once for all of them instead of once per token (from
// L2: a slot's A and B for one SmolLM2 layer are ~250 KB at rank 8). Every token's own sums keep
// the one-token order (its dot in 16 lanes then reduced; its delta added rank row by rank row),
// so a token's output is the same bits whichever tokens share its block: adapters stay
// batch-invariant.
constexpr int kBlock = 4;

// shrunk[r * rank + j] = x_r . A[j] for the block's R rows (float32 copies of the inputs).
template <int R>
void shrink(const float* rows, int64_t in, const float* a, int64_t rank, float* shrunk) {
  for (int64_t j = 0; j < rank; ++j) {
    const float* aj = a + j * in;
    Vec16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = zero16();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const Vec16 w = load16(aj + i);
      for (int r = 0; r < R; ++r) acc[r] = fma(load16(rows + r * in + i), w, acc[r]);
    }
    if (i < in) {
      const int m = static_cast<int>(in - i);
      const Vec16 w = load16(aj + i, m);
      for (int r = 0; r < R; ++r) acc[r] = fma(load16(rows + r * in + i, m), w, acc[r]);
    }
    for (int r = 0; r < R; ++r) shrunk[r * rank + j] = reduce_add(acc[r]);
  }
}

// out[r][offset : offset + n] += shrunk_r B for the block's R rows, 16 columns at a time.
template <int R, typename T>
void expand(T* const* out, const float* shrunk, const float* b, int64_t rank,
            const SubProjection& sub) {
  for (int64_t c = 0; c < sub.n; c += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, sub.n - c));
    Vec16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = load16(out[r] + sub.offset + c, m);
    for (int64_t j = 0; j < rank; ++j) {
      const Vec16 w = load16(b + j * sub.n + c, m);
      for (int r = 0; r < R; ++r) acc[r] = fma(splat(shrunk[r * rank + j]), w, acc[r]);
    }
    for (int r = 0; r < R; ++r) store16(out[r] + sub.offset + c, acc[r], m);
  }
}

template <int R, typename T>
void add_block(T* const* out, const float* rows, int64_t in, int64_t slot,
               const std::vector<SubProjection>& subs, int64_t rank, float* shrunk) {
  for (const SubProjection& sub : subs) {
    shrink<R>(rows, in, sub.a + slot * rank * in, rank, shrunk);
    expand<R>(out, shrunk, sub.b + slot * rank * sub.n, rank, sub);
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
    std::vector<float> rows(kBlock * in), shrunk(kBlock * rank);
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
      switch (count) {
        case 1: add_block<1>(dst, rows.data(), in, slot, subs, rank, shrunk.data()); break;
        case 2: add_block<2>(dst, rows.data(), in, slot, subs, rank, shrunk.data()); break;
        case 3: add_block<3>(dst, rows.data(), in, slot, subs, rank, shrunk.data()); break;
        default: add_block<4>(dst, rows.data(), in, slot, subs, rank, shrunk.data()); break;
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
