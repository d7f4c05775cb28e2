// What the paged attention kernels share: the vector kernels (csrc/attention.cpp) and the AMX
// tiles' (csrc/attention_amx.cpp) read the same cache, hide the same keys and make probabilities
// with the same softmax, so that a token's scores and softmax are one definition on every path.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "simd.h"

namespace rankcast {
namespace attention {

struct Geometry {
  int kv_heads;
  int head_dim;
  int block_size;
  int64_t max_blocks;  // block table row stride
};

// Tokens whose products a row sums in one chain before adding that chain to its total: the
// weighted sum of values is the sum, in order, of the sums of 16-token chunks (from position 0),
// each chunk summed in token order. A decode step splits a long context's chunks between
// threads (`attend_split`) and adds their sums in the same order, so a token's output does not
// depend on whether it was decoded alone, in a batch, or in a prompt.
constexpr int kChunk = 16;

// A row's scores [start, reach) (-inf where hidden; start 16-aligned) made its probabilities in
// place: the exact softmax, every path the same way.
inline void softmax_row(float* pr, int start, int reach) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Vec16 mx = splat(neg_inf);
  for (int t = start; t < reach; t += 16)
    mx = max(mx, keep_first(load16(pr + t, std::min(16, reach - t)), reach - t, neg_inf));
  const float row_max = reduce_max(mx);
  Vec16 sum = zero16();
  for (int t = start; t < reach; t += 16) {
    const int n = std::min(16, reach - t);
    const Vec16 e = keep_first(exp16(load16(pr + t, n) - splat(row_max)), n, 0.0f);
    store16(pr + t, e, n);
    sum = sum + e;
  }
  const float inv = 1.0f / reduce_add(sum);
  for (int t = start; t < reach; t += 16) {
    const int n = std::min(16, reach - t);
    store16(pr + t, load16(pr + t, n) * splat(inv), n);
  }
}

// The block where a window's reading starts: the one holding token `lo`, moved back until its
// base is 16-aligned (block sizes are powers of two from 8), so that chunks keep their grid.
inline int first_block_of(int lo, int bs) {
  int j = lo / bs;
  while ((j * bs) % kChunk != 0) --j;
  return j;
}

// Scores of tokens [from, lo) of a row, in the block where reading starts, hidden.
inline void hide_before(float* pr, int from, int lo) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = from; t < lo; ++t) pr[t] = neg_inf;
}

#if defined(__AVX512BF16__)
// Sixteen lanes of pairs: lane i holds lo[i] (low half) and hi[i] (high half), the lanes in
// `lanes` (the rest 0; masked loads, so a partial chunk costs no branch in the loop).
inline __m512i pair_rows(const bf16* lo, const bf16* hi, __mmask16 lanes) {
  // One two-source word permute (VPERMT2W) interleaves them: word 2i from lo[i], 2i+1 from
  // hi[i] (32 + i: the second source). Two widenings, a shift and an OR before: on the 2-core
  // Zen 4, builds alternated, a 512-token chunk's attention 1.03-1.08x (bench/prefill_attention.py,
  // after 2,000 and 8,000 tokens), SmolLM2's q4_1 decode step 1.05x at 2,000 tokens and the same
  // at 8,000, where the step waits on memory (bench/decode_step.py).
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(lanes, lo));
  const __m512i b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(lanes, hi));
  return _mm512_permutex2var_epi16(a, interleave, b);
}
#endif

// One step's attention as the kernels see it: the query and output rows, the caches and each
// sequence's place in the step (csrc/attention.cpp's header says what each means).
struct StepView {
  const bf16* q;
  bf16* out;
  int64_t q_tok, q_head, o_tok, o_head;  // strides, in elements
  const bf16* key_cache;
  const bf16* value_cache;
  const int* seq_lens;
  const int* query_start;
  const int* block_tables;
  int num_seqs;
  int heads;
  Geometry g;
  float scale;
  int window;
};

// A bfloat16 model's step with a bfloat16 cache on AMX tiles (csrc/attention_amx.cpp): true where
// it ran, false where this build or process has no tiles or the heads do not fit them, which
// leaves the step to the vector kernels. Which it is does not change within a process, so every
// step of a model takes the same path and a token's bits do not depend on the step.
bool amx_attention(const StepView& step);

}  // namespace attention
}  // namespace rankcast
