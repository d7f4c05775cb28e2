// What the paged attention kernels share: the vector kernels (csrc/attention.cpp) and the AMX
// tiles' (csrc/attention_amx.cpp) read the same cache, hide the same keys and make probabilities
// with the same softmax, so that a token's scores and softmax are one definition on every path.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <vector>

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

// Contexts from which a lone decode is split between threads. SmolLM2's q4_1 decode step alone,
// 2-core Zen 4, builds alternated (bench/decode_step.py): at 150 tokens the split changed nothing,
// at 600 it was 1.03-1.09x faster, at 2,000 1.24x (6.70 -> 5.39 ms); its barriers cost about
// what it saves on a short context.
constexpr int kSplitMinTokens = 256;
// Decode steps with at least this many sequences per thread take one sequence per item
// (`attend_sequence`). SmolLM2's decode step alone on the 2-core Zen 4, builds alternated
// (bench/decode_step.py, bfloat16 weights unless named): 32 sequences at 200 tokens 36.4 -> 30.8
// ms (q4_1 40.4 -> 31.1), 32 at 40 tokens 1.03x, 4 at 200 1.03x, 8 at 1,000 21.4 -> 17.7 ms.
constexpr int kSequenceItemsPerThread = 2;

// The first key position a query at `position` sees (`window` 0: none hidden).
inline int first_visible(int position, int window) {
  return window > 0 ? std::max(0, position + 1 - window) : 0;
}

// How a step's attention is shared out between the threads, the same way in both kernels:
// steps of decodes only (every sequence one query token, its heads' rows at most `max_group`
// per KV head) read each sequence's blocks whole, every head of a block in turn; with enough
// sequences, one sequence per item (`kSequences`); with too few (sequence, KV head) items to keep
// every thread busy and long contexts, each sequence's context split between the threads
// (`kSplit`); any other step by (sequence, KV head, some positions) items (`kItems`).
enum class Sharing { kSequences, kSplit, kItems };

inline Sharing share_step(const int* seq_lens, const int* query_start, int num_seqs, int group,
                          int max_group, int kv_heads, int window, int threads) {
  bool decodes = group <= max_group;
  bool long_contexts = true;
  for (int b = 0; b < num_seqs && decodes; ++b) {
    decodes = query_start[b + 1] - query_start[b] == 1;
    const int visible = seq_lens[b] - first_visible(seq_lens[b] - 1, window);
    long_contexts = long_contexts && visible >= kSplitMinTokens;
  }
  if (decodes && num_seqs >= kSequenceItemsPerThread * threads) return Sharing::kSequences;
  if (decodes && long_contexts && threads > 1 && num_seqs * kv_heads < 2 * threads)
    return Sharing::kSplit;
  return Sharing::kItems;
}

// A unit of parallel work: some query positions of one sequence against one KV head.
struct WorkItem {
  int seq;
  int kv_head;
  int first_token;  // index into the step's tokens
  int num_tokens;
};

// A step's items: each sequence's query tokens `positions` at a time, against each KV head.
inline std::vector<WorkItem> work_items(const int* query_start, int num_seqs, int kv_heads,
                                        int positions) {
  std::vector<WorkItem> items;
  for (int b = 0; b < num_seqs; ++b) {
    for (int t = query_start[b]; t < query_start[b + 1]; t += positions) {
      const int n = std::min(positions, query_start[b + 1] - t);
      for (int h = 0; h < kv_heads; ++h) items.push_back({b, h, t, n});
    }
  }
  return items;
}

// The largest of a row's scores [start, reach) (-inf where hidden).
inline float largest_score(const float* pr, int start, int reach) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Vec16 mx = splat(neg_inf);
  for (int t = start; t < reach; t += 16)
    mx = max(mx, keep_first(load16(pr + t, std::min(16, reach - t)), reach - t, neg_inf));
  return reduce_max(mx);
}

// A row's scores [start, reach) (start 16-aligned) made exp(score - row_max) in place (0 where
// hidden), returning their sum: sixteen lanes summed in order from `start`, then across the lanes.
inline float exponentiate(float* pr, int start, int reach, float row_max) {
  Vec16 sum = zero16();
  for (int t = start; t < reach; t += 16) {
    const int n = std::min(16, reach - t);
    const Vec16 e = keep_first(exp16(load16(pr + t, n) - splat(row_max)), n, 0.0f);
    store16(pr + t, e, n);
    sum = sum + e;
  }
  return reduce_add(sum);
}

// A row's scores [start, reach) (-inf where hidden; start 16-aligned) made its probabilities in
// place: the exact softmax, every path the same way.
inline void softmax_row(float* pr, int start, int reach) {
  const float inv = 1.0f / exponentiate(pr, start, reach, largest_score(pr, start, reach));
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
// Word i of `a` and of `b` at words 2i and 2i + 1 (i < 16; `high`: i + 16).
inline __m512i interleave_words(__m512i a, __m512i b, bool high) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                       8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(a, high ? _mm512_add_epi16(low, _mm512_set1_epi16(16)) : low, b);
}

// Sixteen lanes of pairs: lane i holds lo[i] (low half) and hi[i] (high half), the lanes in
// `lanes` (the rest 0; masked loads, so a partial chunk costs no branch in the loop).
inline __m512i pair_rows(const bf16* lo, const bf16* hi, __mmask16 lanes) {
  // One two-source word permute (VPERMT2W) interleaves them: word 2i from lo[i], 2i+1 from
  // hi[i] (32 + i: the second source). Two widenings, a shift and an OR before: on the 2-core
  // Zen 4, builds alternated, a 512-token chunk's attention 1.03-1.08x (bench/prefill_attention.py,
  // after 2,000 and 8,000 tokens), SmolLM2's q4_1 decode step 1.05x at 2,000 tokens and the same
  // at 8,000, where the step waits on memory (bench/decode_step.py).
  const __m512i a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(lanes, lo));
  const __m512i b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(lanes, hi));
  return interleave_words(a, b, false);
}
#endif

// An 8-bit cache's per-token scales ([num_blocks, kv_heads, block_size] float32), or none. A
// block-head's scales start at its cache offset / head_dim.
struct KVScales {
  const float* key = nullptr;
  const float* value = nullptr;
};

// Tokens [start, reach)'s probabilities in `pr` times their value scales (an 8-bit cache), the
// blocks' cache offsets `offsets` plus `shift` elements (another head of the same blocks).
inline void fold_value_scales(float* pr, int start, int reach, const float* value_scale,
                              const int64_t* offsets, int64_t shift, int bs, int D) {
  for (int t = start; t < reach;) {
    const int j = t / bs;
    const int stop = std::min(reach, (j + 1) * bs);
    const float* sc = value_scale + (offsets[j] + shift) / D + (t - j * bs);
    while (t < stop) {  // a block's tokens lie side by side in both
      const int n = std::min(16, stop - t);
      store16(pr + t, load16(pr + t, n) * load16(sc, n), n);
      t += n;
      sc += n;
    }
  }
}

// One step's attention as the kernels see it: the query and output rows, the caches (`K`: the
// activations' bfloat16 or an 8-bit format, with its scales) and each sequence's place in the
// step (csrc/attention.cpp's header says what each means).
template <typename K>
struct StepView {
  const bf16* q;
  bf16* out;
  int64_t q_tok, q_head, o_tok, o_head;  // strides, in elements
  const K* key_cache;
  const K* value_cache;
  KVScales scales;
  const int* seq_lens;
  const int* query_start;
  const int* block_tables;
  int num_seqs;
  int heads;
  Geometry g;
  float scale;
  int window;
};

// A bfloat16 model's step on AMX tiles (csrc/attention_amx.cpp), over a bfloat16 cache or an
// 8-bit one (bf16, int8_t, fp8e4m3, fp8e5m2): true where it ran, false where this build or
// process has no tiles or the heads or blocks do not fit them, which leaves the step to the
// vector kernels. Which it is does not change within a process, so every step of a model takes
// the same path and a token's bits do not depend on the step.
template <typename K>
bool amx_attention(const StepView<K>& step);

}  // namespace attention
}  // namespace rankcast
