// Structured outputs' token masks applied to the logits in place: bit t of a row's mask (32-bit
// little-endian words, llguidance's layout) keeps token t; every other token's logit becomes
// -inf. Only the constrained rows are named and touched.
//
// The plain-torch equivalent unpacks every bit into a tensor first (~2 ms for 32 rows of a
// 49,152-token vocabulary on two cores); read word by word, a mask is mostly whole words of
// zeros (a JSON position allows few tokens), each a run of 32 stores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace rankcast {
namespace {

// Logits are written as raw bits (T is uint32_t for float32, uint16_t for bfloat16, `blocked`
// their -inf): plain integer stores, which the compiler vectorises where BFloat16's
// converting assignment would not (0.25 ms against 0.06 ms for 32 rows).
template <typename T>
void mask_rows(T* logits, int64_t stride, const int64_t* rows, int64_t count,
               const uint32_t* bits, int64_t words, int64_t vocab, T blocked) {
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = logits + rows[r] * stride;
      const uint32_t* mask = bits + r * words;
      for (int64_t start = 0; start < vocab; start += 32) {
        const int64_t w = start / 32;
        const uint32_t word = w < words ? mask[w] : 0u;  // ids beyond the mask never fit
        if (word == 0xffffffffu) continue;
        const int64_t limit = std::min<int64_t>(32, vocab - start);
        if (word == 0u) {
          std::fill(row + start, row + start + limit, blocked);
          continue;
        }
        for (int64_t b = 0; b < limit; ++b) {
          if (!((word >> b) & 1u)) row[start + b] = blocked;
        }
      }
    }
  });
}

}  // namespace

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_token_bitmask: logits must be "
              "2-D with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask: rows must be a contiguous int64 vector");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous int32 matrix");
  TORCH_CHECK(bitmask.size(0) == rows.size(0), "apply_token_bitmask: one mask row per row");
  const int64_t count = rows.size(0), vocab = logits.size(1), words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < logits.size(0), "apply_token_bitmask: row ",
                row_ids[r], " out of range");
  }
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  if (logits.scalar_type() == at::kFloat) {
    mask_rows(reinterpret_cast<uint32_t*>(logits.data_ptr<float>()), logits.stride(0), row_ids,
              count, bits, words, vocab, uint32_t{0xff800000u});
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16,
                "apply_token_bitmask: logits must be float32 or bfloat16");
    mask_rows(reinterpret_cast<uint16_t*>(logits.data_ptr<at::BFloat16>()), logits.stride(0),
              row_ids, count, bits, words, vocab, uint16_t{0xff80u});
  }
}

}  // namespace rankcast
