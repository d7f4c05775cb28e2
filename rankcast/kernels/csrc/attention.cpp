// Attention that reads the paged KV cache where it lies, and the rotary + cache-write step that
// fills it.
//
// Cache layout, per layer (see rankcast/model/attention.py, which documents it for the Python side):
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]   keys transposed within a block
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
// Keys are stored dimension-major so that one vector load gives sixteen tokens' values of one
// dimension: a query row's scores for sixteen tokens are then head_dim fused multiply-adds with no
// horizontal sums. Values stay token-major, so the weighted sum adds whole rows.
//
// A step may mix sequences that decode one token with sequences that prefill a chunk after a
// cached prefix: sequence b has query tokens [query_start[b], query_start[b+1]) at the last
// positions of its seq_lens[b] tokens, and each query sees the keys up to its own position.
//
// A sliding window (`window` > 0: Gemma 3's local layers, Mistral's) hides the keys more than
// window - 1 positions behind a query, as transformers' mask does. Every path then starts at the
// block holding its earliest visible key (a 16-aligned base) instead of at 0, and masks the keys
// before it in that block: the chunks it skips would only have added exact zeros to each row's
// softmax sum and weighted values, so a token's output keeps the bits it has at any chunking, and
// blocks wholly behind the window are never read (the engine may have freed them).
//
// On an AMX build whose tiles the OS granted, a bfloat16 model (any cache: bfloat16 or 8-bit) takes
// csrc/attention_amx.cpp's tiles instead, every step of it (its bits are that build's own); the
// shared pieces (the geometry, the softmax, where a window's reading starts) are in attention.h.
//
// An 8-bit cache (int8, fp8 e4m3 or e5m2: `--kv-cache-dtype`) holds each token's key and value
// of each head as bytes with one float32 scale each (key_scale and value_scale [num_blocks,
// kv_heads, block_size]): amax / the format's largest value, set when the token is written, so a
// token's stored bytes depend on its own values alone (the batch-invariance rule holds). Scores
// are the dot products of the query with the decoded bytes, times each token's key scale; each
// probability is multiplied by its token's value scale once the softmax is done, before the
// weighted sum: every path does both at the same point, so a token's output has the same bits
// on each, as in 16-bit caches. The bytes a token reads are half a bfloat16 cache's, plus 8 of
// scales per head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <limits>
#include <type_traits>
#include <memory>
#include <vector>

#include "attention.h"
#include "kernels.h"
#include "simd.h"

namespace rankcast {
namespace {

using namespace attention;

constexpr int kMaxRows = 6;  // query rows (heads x positions) attended together in registers
constexpr int kAheadBlocks = 3;  // cache blocks prefetched ahead of the one being read

// Scores of 16 tokens (n of them) times their key scales, where the cache is 8-bit.
template <int R>
inline void scale_scores(Vec16* s, const float* key_scale, int64_t offset, int t0, int n, int D) {
  if (key_scale == nullptr) return;
  const Vec16 ks = load16(key_scale + offset / D + t0, n);
  for (int r = 0; r < R; ++r) s[r] = s[r] * ks;
}

inline void prefetch(const void* p, int64_t bytes) {
#if defined(__GNUC__)
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
#endif
}

// Scores of R query rows against up to 16 tokens of a transposed key block (kt[d * bs + t]).
// Each row keeps U partial sums over interleaved dimensions, so R * U independent FMA chains
// hide the FMA latency that a single chain per row would expose. U is the same for every R:
// a row's result must not depend on which rows share its tile, or a token attended in a decode
// step, in a chunk or in a whole prompt (or over a prefix another request cached) would differ
// in its last bits.
constexpr int kPartialSums = 4;

// Cache lines to prefetch while scores are computed, spread over the dimension loop: a burst of
// a whole block's prefetches at once fills the core's miss buffers and stalls the loads that
// need data now (measured: ~25 GB/s with bursts on a machine that streams 45).
struct Prefetches {
  const char* first[2] = {nullptr, nullptr};  // up to two streams (a key block ahead, a value block)
  int lines = 0;                              // lines of each stream to fetch here
};

// Sub-chunk `c` of a block's share of the two streams: the lines of the key block ahead and of
// this block's values (`first` null for a stream not fetched) that its scores' loop fetches.
inline Prefetches chunk_prefetches(const char* key_ahead, const char* values, int c,
                                   int lines_per_chunk, int block_lines) {
  Prefetches pf;
  const int first_line = c * lines_per_chunk;
  pf.lines = std::max(0, std::min(lines_per_chunk, block_lines - first_line));
  pf.first[0] = key_ahead == nullptr ? nullptr : key_ahead + first_line * 64;
  pf.first[1] = values == nullptr ? nullptr : values + first_line * 64;
  return pf;
}

// The next `per_step` lines of each stream of `pf` from `line` on (advanced past them): the
// scores' loops spread a block's prefetches over their steps.
inline void prefetch_step(const Prefetches& pf, int per_step, int& line) {
  for (int j = 0; j < per_step && line < pf.lines; ++j, ++line) {
    for (const char* stream : pf.first)
      if (stream != nullptr) __builtin_prefetch(stream + static_cast<int64_t>(line) * 64);
  }
}

// Keys of a bfloat16 cache are multiplied two dimensions at a time: lane t of a pair vector holds
// token t's dimensions 2i (low half) and 2i + 1 (high), and VDPBF16PS (AVX512-BF16) adds
// q[2i+1] * k[2i+1] and then q[2i] * k[2i] to lane t's sum, each exact product added with one
// rounding: two products an instruction where a float32 FMA does one. The queries stay the
// bfloat16 values the model produced (no rounding of q * scale) and the scale multiplies the
// finished score. Builds without the instruction do the same two FMAs in the same order, so
// each build gives a token the same bits on every path (a float32 or 8-bit cache keeps scaled
// float32 queries). Measured on a 2-core Zen 4 (a 512-token chunk's attention after 2,000 and
// 8,000 cached tokens, SmolLM2's heads; bench/prefill_attention.py): 1.06-1.09x. Of that
// chunk's time the weighted sum of values is about half, the scores a quarter, the softmax a
// tenth (builds leaving one phase out); a context that stays in L2 runs at the same rate, so
// the arithmetic bounds it, not re-reading the cache.
template <typename K>
constexpr bool kPairedKeys = std::is_same_v<K, bf16>;

// Row r's queries as `key_scores` reads them, into qf [rows, D]: the query times `scale` in
// float32, or for paired keys the bfloat16 pairs (q[2i], q[2i+1]) as 32-bit words (AVX512-BF16:
// pair i at qf[r * D + i]) or the unscaled values (other builds). `row(r)` is row r's query.
template <typename T, typename K, typename RowFn>
inline void stage_queries(const RowFn& row, int rows, int D, float scale, float* qf) {
  for (int r = 0; r < rows; ++r) {
    const T* x = row(r);
    float* out = qf + static_cast<int64_t>(r) * D;
    if constexpr (kPairedKeys<K>) {
#if defined(__AVX512BF16__)
      for (int i = 0; i < D / 2; ++i) {
        const uint32_t pair = static_cast<uint32_t>(x[2 * i].x) |
                              (static_cast<uint32_t>(x[2 * i + 1].x) << 16);
        out[i] = std::bit_cast<float>(pair);
      }
#else
      for (int d = 0; d < D; ++d) out[d] = static_cast<float>(x[d]);
#endif
    } else {
      for (int d = 0; d < D; ++d) out[d] = static_cast<float>(x[d]) * scale;
    }
  }
}

#if defined(__AVX512BF16__)
// acc + VDPBF16PS of two vectors of bfloat16 pairs (see kPairedKeys for its order).
inline Vec16 dot_pairs(Vec16 acc, __m512i a, __m512i b) {
  return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b))};
}
#endif

// Paired keys' scores (see kPairedKeys), with the same partial sums as below over pairs; `full`
// as below (only builds without AVX512-BF16 branch on it: the instruction's loads are masked).
template <int R, bool full>
inline void paired_key_scores(const float* qf, int D, const bf16* kt, int bs, int n, Vec16* s,
                              const Prefetches& pf, float scale) {
  constexpr int U = kPartialSums;
  Vec16 part[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) part[r][u] = zero16();
  const int pairs = D / 2;
#if defined(__AVX512BF16__)
  const __mmask16 lanes = tail_mask(n);
#endif
  const int per_step = (pf.lines + pairs / U - 1) / (pairs / U);  // lines per stream per step
  for (int i = 0, line = 0; i < pairs; i += U) {
    prefetch_step(pf, per_step, line);
    for (int u = 0; u < U; ++u) {
      const int d = 2 * (i + u);
#if defined(__AVX512BF16__)
      const __m512i k = pair_rows(kt + d * bs, kt + (d + 1) * bs, lanes);
      for (int r = 0; r < R; ++r) {
        const __m512i qq = _mm512_set1_epi32(std::bit_cast<int32_t>(qf[r * D + i + u]));
        part[r][u] = dot_pairs(part[r][u], qq, k);
      }
#else
      const Vec16 k_even = full ? load16(kt + d * bs) : load16(kt + d * bs, n);
      const Vec16 k_odd = full ? load16(kt + (d + 1) * bs) : load16(kt + (d + 1) * bs, n);
      for (int r = 0; r < R; ++r) {
        part[r][u] = fma(splat(qf[r * D + d + 1]), k_odd, part[r][u]);
        part[r][u] = fma(splat(qf[r * D + d]), k_even, part[r][u]);
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec16 total = part[r][0];
    for (int u = 1; u < U; ++u) total = total + part[r][u];
    s[r] = total * splat(scale);
  }
}

// Scores of R query rows against 16 tokens (`full`) or n < 16 of them: the unpaired caches'
// loop. For the 8-bit caches whether the chunk is full is a template argument, so that the loop
// holds no branch: with `n == 16 ? load : partial load` inside it (a partial load of bytes
// copies them), GCC kept the R * U partial sums in memory, a load and a store around every FMA
// (perf annotate), and an int8 cache's scores took 2.4x a float32 cache's. One 512-token chunk's
// attention (bench/prefill_attention.py, 2-core Zen 4, builds alternated): int8 cache 1.72x
// after 2,000 tokens (24.8 -> 14.4 ms), 1.71x after 8,000 (110.5 -> 64.7 ms); float32 within
// noise (1.03-1.05x); bfloat16 (paired keys) unchanged.
template <typename K, int R, bool full>
inline void unpaired_key_scores(const float* qf, int D, const K* kt, int bs, int n, Vec16* s,
                                const Prefetches& pf) {
  constexpr int U = kPartialSums;
  Vec16 part[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) part[r][u] = zero16();
  const int per_step = (pf.lines + D / U - 1) / (D / U);  // lines per stream per d step
  for (int d = 0, line = 0; d < D; d += U) {
    prefetch_step(pf, per_step, line);
    for (int u = 0; u < U; ++u) {
      const Vec16 k = full ? load16(kt + (d + u) * bs) : load16(kt + (d + u) * bs, n);
      for (int r = 0; r < R; ++r) part[r][u] = fma(splat(qf[r * D + d + u]), k, part[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec16 total = part[r][0];
    for (int u = 1; u < U; ++u) total = total + part[r][u];
    s[r] = total;
  }
}

// Scores of R query rows against up to 16 tokens (see above); `scale` multiplies paired keys'
// scores (the other caches' queries are scaled already).
template <typename K, int R>
inline void key_scores(const float* qf, int D, const K* kt, int bs, int n, Vec16* s,
                       const Prefetches& pf, float scale) {
  if constexpr (kPairedKeys<K>) {
#if defined(__AVX512BF16__)
    paired_key_scores<R, false>(qf, D, kt, bs, n, s, pf, scale);
#else
    if (n == 16)
      paired_key_scores<R, true>(qf, D, kt, bs, n, s, pf, scale);
    else
      paired_key_scores<R, false>(qf, D, kt, bs, n, s, pf, scale);
#endif
  } else if (sizeof(K) > 1) {  // a masked load of floats costs what a whole one does
    unpaired_key_scores<K, R, false>(qf, D, kt, bs, n, s, pf);
  } else if (n == 16) {
    unpaired_key_scores<K, R, true>(qf, D, kt, bs, n, s, pf);
  } else {
    unpaired_key_scores<K, R, false>(qf, D, kt, bs, n, s, pf);
  }
}

// The sum over tokens [t_begin, t_end) (within one chunk) of p[r, t] * v[t, d0 + c*16 ..] for R
// rows and C vectors of dimensions, from zero, in token order.
template <typename K, int R, int C>
inline void chunk_values(Vec16 (&a)[R][C], const float* p, int64_t p_stride, int t_begin,
                         int t_end, const K* value_cache, const int64_t* offsets, int bs, int D,
                         int d0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = zero16();
  for (int t = t_begin; t < t_end;) {
    const int j = t / bs;
    const int stop = std::min(t_end, (j + 1) * bs);
    const K* row = value_cache + offsets[j] + static_cast<int64_t>(t - j * bs) * D + d0;
    for (; t < stop; ++t, row += D) {
      for (int c = 0; c < C; ++c) {
        const Vec16 v = load16(row + c * 16);
        for (int r = 0; r < R; ++r) a[r][c] = fma(splat(p[r * p_stride + t]), v, a[r][c]);
      }
    }
  }
}

// out[r, d0 + c*16 ..] = sum_t p[r, t] * v[t, d0 + c*16 ..] over every visible token: the chunks'
// sums (`chunk_values`) from `start` (16-aligned) added in order into `acc`, R * C of them in
// registers at a time.
template <typename K, int R, int C>
inline void weighted_values(float* acc, int D, const float* p, int64_t p_stride, int start,
                            int reach, const K* value_cache, const int64_t* offsets, int bs,
                            int d0) {
  for (int t0 = start; t0 < reach; t0 += kChunk) {
    Vec16 a[R][C];
    chunk_values<K, R, C>(a, p, p_stride, t0, std::min(reach, t0 + kChunk), value_cache, offsets,
                          bs, D, d0);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        float* out = acc + r * D + d0 + c * 16;
        store16(out, t0 == start ? a[r][c] : load16(out) + a[r][c]);
      }
  }
}

// A row's scores [start, reach) made what its weighted sum reads: the softmax's probabilities,
// times each token's value scale where the cache is 8-bit (`fold_value_scales`). Every path
// finishes a row here, so none can do it differently.
inline void finish_row(float* pr, int start, int reach, const KVScales& scales,
                       const int64_t* offsets, int64_t shift, int bs, int D) {
  softmax_row(pr, start, reach);
  if (scales.value != nullptr)
    fold_value_scales(pr, start, reach, scales.value, offsets, shift, bs, D);
}

// fn.template operator()<C>(d0) over a head's dimensions in groups of C vectors (4 for up to 3
// rows, 2 for more: R * C accumulators fit the registers), then single vectors for the rest.
// How the dimensions are grouped does not change any lane's sum.
template <int R, typename Fn>
inline void for_dim_groups(int D, const Fn& fn) {
  constexpr int C = R <= 3 ? 4 : 2;
  int d0 = 0;
  for (; d0 + C * 16 <= D; d0 += C * 16) fn.template operator()<C>(d0);
  for (; d0 < D; d0 += 16) fn.template operator()<1>(d0);
}

// One tile: R query rows sharing a sequence and a KV head; row r sees keys [begin[r], limit[r]).
// Two passes over the context: every score first (so the softmax is exact and done once per
// row), then the weighted sum of values, chunk by chunk (`weighted_values`).
template <typename T, typename K, int R>
void attend_tile(const T* const* q, T* const* out, const int* begin, const int* limit,
                 const K* key_cache, const K* value_cache, const KVScales& scales,
                 const int* table, int kv_head, const Geometry& g, float scale, float* scratch,
                 int64_t p_stride) {
  const int D = g.head_dim, bs = g.block_size;
  float* qf = scratch;      // [R, D] scaled queries
  float* acc = qf + R * D;  // [R, D] weighted sums
  float* p = acc + R * D;   // [R, p_stride] scores, then probabilities
  int reach = 0, lo = std::numeric_limits<int>::max();
  stage_queries<T, K>([&](int r) { return q[r]; }, R, D, scale, qf);
  for (int r = 0; r < R; ++r) {
    reach = std::max(reach, limit[r]);
    lo = std::min(lo, begin[r]);
  }
  const int first_block = first_block_of(lo, bs), start = first_block * bs;
  const int num_blocks = (reach + bs - 1) / bs;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  int64_t offsets_small[64];
  std::vector<int64_t> offsets_large;
  int64_t* offsets = offsets_small;
  if (num_blocks > 64) {
    offsets_large.resize(num_blocks);
    offsets = offsets_large.data();
  }
  for (int j = first_block; j < num_blocks; ++j) {
    offsets[j] = (static_cast<int64_t>(table[j]) * g.kv_heads + kv_head) * block_elems;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Blocks are scattered, so the hardware cannot guess the next one: keep kAheadBlocks key blocks
  // in flight, and fetch each value block while the scores of its key block are computed.
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(K));
  for (int j = first_block; j < std::min(num_blocks, first_block + kAheadBlocks); ++j)
    prefetch(key_cache + offsets[j], block_bytes);
  const int block_lines = static_cast<int>(block_bytes / 64);
  const int chunks = (bs + 15) / 16;
  const int lines_per_chunk = (block_lines + chunks - 1) / chunks;
  for (int j = first_block, base = start; base < reach; ++j, base += bs) {
    const int ntok = std::min(bs, reach - base);
    const char* key_ahead = j + kAheadBlocks < num_blocks
                                ? reinterpret_cast<const char*>(key_cache + offsets[j + kAheadBlocks])
                                : nullptr;
    const char* values = reinterpret_cast<const char*>(value_cache + offsets[j]);
    const K* kb = key_cache + offsets[j];
    for (int t0 = 0, c = 0; t0 < bs; t0 += 16, ++c) {
      // Every chunk of the block passes, visible or not, so that the prefetches all happen.
      const Prefetches pf = chunk_prefetches(key_ahead, values, c, lines_per_chunk, block_lines);
      if (t0 >= ntok) {
        for (int l = 0; l < pf.lines; ++l)
          for (const char* stream : pf.first)
            if (stream != nullptr) __builtin_prefetch(stream + static_cast<int64_t>(l) * 64);
        continue;
      }
      const int n = std::min(16, ntok - t0);
      Vec16 s[R];
      key_scores<K, R>(qf, D, kb + t0, bs, n, s, pf, scale);
      scale_scores<R>(s, scales.key, offsets[j], t0, n, D);
      for (int r = 0; r < R; ++r) {
        const int visible = std::clamp(limit[r] - base - t0, 0, n);
        store16(p + r * p_stride + base + t0, keep_first(s[r], visible, neg_inf), n);
        hide_before(p + r * p_stride, base + t0, std::min(begin[r], base + t0 + n));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    finish_row(p + r * p_stride, start, reach, scales, offsets, 0, bs, D);
  for_dim_groups<R>(D, [&]<int C>(int d0) {
    weighted_values<K, R, C>(acc, D, p, p_stride, start, reach, value_cache, offsets, bs, d0);
  });
  for (int r = 0; r < R; ++r) {
    for (int d = 0; d < D; d += 16) store16(out[r] + d, load16(acc + r * D + d));
  }
}

// Blocks ahead of the one being scored whose keys `attend_split` prefetches (1, 4 and 8 measured
// within noise of each other).
constexpr int kSplitAheadBlocks = 8;

// Every KV head's R query rows of one token scored against the blocks holding tokens
// [first, last) of a context of `reach`, block after block and head after head within a block
// (the cache's order: a block's heads lie side by side), into p [kv_heads * R, p_stride]; the
// keys kSplitAheadBlocks blocks on are prefetched meanwhile (the values: `stretch_values`). `qf` holds
// the scaled queries, row h * R + r for head h; `offsets` head 0's part of each block.
template <typename K, int R>
void score_stretch(const float* qf, float* p, int64_t p_stride, int first, int last, int reach,
                   const int64_t* offsets, const K* key_cache, const float* key_scale,
                   const Geometry& g, float scale) {
  const int D = g.head_dim, bs = g.block_size;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  const int block_lines =
      std::max(1, static_cast<int>(block_elems * static_cast<int64_t>(sizeof(K)) / 64));
  const int sub_chunks = (bs + 15) / 16;
  const int lines_per_chunk = (block_lines + sub_chunks - 1) / sub_chunks;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int j = first / bs, base = j * bs; base < last; ++j, base += bs) {
    const int ntok = std::min(bs, reach - base);
    const int j_ahead = j + kSplitAheadBlocks;
    const bool ahead = j_ahead * bs < last;
    for (int h = 0; h < g.kv_heads; ++h) {
      const K* kb = key_cache + offsets[j] + h * block_elems;
      const char* key_ahead =
          ahead ? reinterpret_cast<const char*>(key_cache + offsets[j_ahead] + h * block_elems)
                : nullptr;
      for (int t0 = 0, c = 0; t0 < ntok; t0 += 16, ++c) {
        const Prefetches pf = chunk_prefetches(key_ahead, nullptr, c, lines_per_chunk, block_lines);
        const int n = std::min(16, ntok - t0);
        Vec16 sc[R];
        key_scores<K, R>(qf + h * R * D, D, kb + t0, bs, n, sc, pf, scale);
        scale_scores<R>(sc, key_scale, offsets[j] + h * block_elems, t0, n, D);
        for (int r = 0; r < R; ++r)
          store16(p + (h * R + r) * p_stride + base + t0, keep_first(sc[r], n, neg_inf), n);
      }
    }
  }
}

// Blocks ahead of the one being summed whose values `stretch_values` prefetches.
constexpr int kValueAheadBlocks = 8;

// The first kValueAheadBlocks blocks of values from token `first`, every head, prefetched: issued
// once a decode's scores are done, so that they arrive during its softmax, before
// `stretch_values` (which fetches the blocks after them) reads them.
template <typename K>
inline void prefetch_first_values(const K* value_cache, const int64_t* offsets, int first,
                                  int last, const Geometry& g) {
  const int64_t block_bytes = static_cast<int64_t>(g.kv_heads) * g.head_dim * g.block_size *
                              static_cast<int64_t>(sizeof(K));
  for (int j = first / g.block_size; j < first / g.block_size + kValueAheadBlocks; ++j) {
    if (j * g.block_size >= last) break;
    prefetch(value_cache + offsets[j], block_bytes);
  }
}

// The chunks' sums of values for tokens [first, last) (from a 16-aligned `first`), chunk by chunk
// and every KV head of a chunk's block in turn, in the cache's order (a block's heads lie side by
// side), the values kValueAheadBlocks blocks on prefetched meanwhile: each head's R rows' sums of
// chunk t0 over dimensions [d0, d0 + C * 16) go to `take.template operator()<C>(t0, h, d0, a)`.
// `head_offsets` is scratch for kv_heads x the context's blocks.
//
// Decodes read the values head by head before (each head's 2 kB of every 6 kB block in turn),
// and had them prefetched while the keys were scored, long before a long context's values pass
// reached them. SmolLM2's q4_1 decode step alone, a 2-core Emerald Rapids Xeon without AMX,
// builds alternated (bench/decode_step.py, best of 3-4 rounds): one sequence at 8,000 tokens
// 17.93 -> 16.49 ms (1.09x; int8 KV 13.44 -> 12.32 ms), at 2,000 tokens 1.03x; four sequences
// at 8,000 tokens 63.1 -> 49.7 ms (1.27x); 32 at 200 tokens the same (0.99x).
template <typename K, int R, typename Take>
void stretch_values(const float* p, int64_t p_stride, int first, int last, const K* value_cache,
                    const int64_t* offsets, int num_blocks, std::vector<int64_t>& head_offsets,
                    const Geometry& g, const Take& take) {
  const int D = g.head_dim, bs = g.block_size;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  head_offsets.resize(static_cast<size_t>(g.kv_heads) * num_blocks);
  for (int h = 0; h < g.kv_heads; ++h)
    for (int b = 0; b < num_blocks; ++b)
      head_offsets[static_cast<size_t>(h) * num_blocks + b] = offsets[b] + h * block_elems;
  const int64_t head_bytes = block_elems * static_cast<int64_t>(sizeof(K));
  for (int t0 = first; t0 < last; t0 += kChunk) {
    const int t1 = std::min(last, t0 + kChunk);
    // The blocks kValueAheadBlocks on from those starting in this chunk (one, or two of 8 tokens).
    const int ahead_begin = (t0 + bs - 1) / bs + kValueAheadBlocks;
    const int ahead_end = std::min((t1 + bs - 1) / bs + kValueAheadBlocks, (last + bs - 1) / bs);
    for (int h = 0; h < g.kv_heads; ++h) {
      for (int j = ahead_begin; j < ahead_end; ++j)
        prefetch(value_cache + offsets[j] + h * block_elems, head_bytes);
      const float* ph = p + h * R * p_stride;
      const int64_t* ho = head_offsets.data() + static_cast<size_t>(h) * num_blocks;
      for_dim_groups<R>(D, [&]<int C>(int d0) {
        Vec16 a[R][C];
        chunk_values<K, R, C>(a, ph, p_stride, t0, t1, value_cache, ho, bs, D, d0);
        take.template operator()<C>(t0, h, d0, a);
      });
    }
  }
}

// A single-token sequence's working memory on one thread, kept across the sequences it takes.
struct SequenceScratch {
  std::vector<int64_t> offsets, head_offsets;
  std::vector<float> qf, p, acc;
};

// Head 0's part of each of a context's blocks; head h's is h * block_elems further.
inline void block_offsets(std::vector<int64_t>& offsets, const int* table, int num_blocks,
                          const Geometry& g) {
  const int64_t block_elems = static_cast<int64_t>(g.head_dim) * g.block_size;
  offsets.resize(num_blocks);
  for (int j = 0; j < num_blocks; ++j)
    offsets[j] = static_cast<int64_t>(table[j]) * g.kv_heads * block_elems;
}

// One sequence's single query token against every KV head on this thread: the decodes of a
// batch, one sequence per item instead of one (sequence, head) pair, so that its blocks are read
// whole, in the cache's order (`score_stretch`), rather than as each head's 2 kB of a 6 kB
// block. The scores, softmax and chunk sums are `attend_tile`'s, in its order.
template <typename T, typename K, int R>
void attend_sequence(const T* q, int64_t q_head, T* out, int64_t o_head, int seq_len, int lo,
                     const int* table, const K* key_cache, const K* value_cache,
                     const KVScales& scales, const Geometry& g, float scale,
                     SequenceScratch& scratch) {
  const int D = g.head_dim, bs = g.block_size, rows = g.kv_heads * R;
  const int reach = seq_len;
  const int start = first_block_of(lo, bs) * bs;
  const int num_blocks = (reach + bs - 1) / bs;
  const int64_t p_stride = (static_cast<int64_t>(num_blocks) * bs + 15) / 16 * 16;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  block_offsets(scratch.offsets, table, num_blocks, g);
  scratch.qf.resize(static_cast<size_t>(rows) * D);
  scratch.p.resize(static_cast<size_t>(rows) * p_stride);
  scratch.acc.resize(static_cast<size_t>(rows) * D);
  float* qf = scratch.qf.data();
  float* p = scratch.p.data();
  stage_queries<T, K>([&](int r) { return q + r * q_head; }, rows, D, scale, qf);
  score_stretch<K, R>(qf, p, p_stride, start, reach, reach, scratch.offsets.data(), key_cache,
                      scales.key, g, scale);
  prefetch_first_values(value_cache, scratch.offsets.data(), start, reach, g);
  for (int r = 0; r < rows; ++r) {
    hide_before(p + r * p_stride, start, lo);
    finish_row(p + r * p_stride, start, reach, scales, scratch.offsets.data(),
               (r / R) * block_elems, bs, D);
  }
  // Each chunk's sums added in order into the rows' sums, as `weighted_values` adds them.
  float* acc = scratch.acc.data();
  stretch_values<K, R>(p, p_stride, start, reach, value_cache, scratch.offsets.data(), num_blocks,
                       scratch.head_offsets, g,
                       [&]<int C>(int t0, int h, int d0, Vec16 (&a)[R][C]) {
                         for (int r = 0; r < R; ++r)
                           for (int c = 0; c < C; ++c) {
                             float* o = acc + (h * R + r) * D + d0 + c * 16;
                             store16(o, t0 == start ? a[r][c] : load16(o) + a[r][c]);
                           }
                       });
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < D; d += 16) store16(out + r * o_head + d, load16(acc + r * D + d));
}

// One sequence's single query token against every KV head, its context shared out between the
// threads: the decode of a lone stream, which has only kv_heads items for the tiles above (3 on
// SmolLM2: on two threads one of them did two thirds), each reading a head's part of every block
// (2 kB of a 6 kB block), a short stream that starts cold at each block. Here each thread takes a
// contiguous stretch of the context in whole chunks and reads every head of each block in it, in
// the cache's order, for the keys and then for the values (`stretch_values`); the phases meet at
// barriers: scores, then each row's softmax over the whole context, then each chunk's weighted
// values, then the chunks' sums added in order (each thread its rows, chunk after chunk, as the
// sums lie: a row at a time read one 64-byte vector every 2 kB). Every number is the one
// `attend_tile` computes for that token (the same scores, softmax and chunk sums, in the same
// order), so a decode gives the same bits either way.
template <typename T, typename K, int R>
void attend_split(const T* q, int64_t q_head, T* out, int64_t o_head, int seq_len, int lo,
                  const int* table, const K* key_cache, const K* value_cache,
                  const KVScales& scales, const Geometry& g, float scale, int threads) {
  const int D = g.head_dim, bs = g.block_size, rows = g.kv_heads * R;
  const int reach = seq_len;
  const int start = first_block_of(lo, bs) * bs;
  const int num_blocks = (reach + bs - 1) / bs;
  const int chunks = (reach + kChunk - 1) / kChunk;
  const int64_t p_stride = (static_cast<int64_t>(num_blocks) * bs + 15) / 16 * 16;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  std::vector<int64_t> offsets;
  block_offsets(offsets, table, num_blocks, g);
  // Uninitialized: every element read is written first (zeroing them cost more than a
  // short context's whole attention).
  const std::unique_ptr<float[]> p(new float[static_cast<size_t>(rows) * p_stride]);
  const std::unique_ptr<float[]> partials(new float[static_cast<size_t>(chunks) * rows * D]);
  // Stretches in units of whole blocks and whole chunks, so a thread's chunks lie in its blocks.
  const int unit = std::max(bs, kChunk);
  const int units = (reach - start + unit - 1) / unit;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int first = std::min(reach, start + units * tid / nt * unit);
    const int last = std::min(reach, start + units * (tid + 1) / nt * unit);
    std::vector<float> qf(static_cast<size_t>(rows) * D);
    stage_queries<T, K>([&](int r) { return q + r * q_head; }, rows, D, scale, qf.data());
    // Scores of the stretch (every head of each block, in the cache's order).
    score_stretch<K, R>(qf.data(), p.get(), p_stride, first, last, reach, offsets.data(),
                        key_cache, scales.key, g, scale);
    prefetch_first_values(value_cache, offsets.data(), first, last, g);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      hide_before(p.get() + r * p_stride, start, lo);
      finish_row(p.get() + r * p_stride, start, reach, scales, offsets.data(),
                 (r / R) * block_elems, bs, D);
    }
    // (the implicit barrier of the loop: every probability is in place)
    // The stretch's chunks' sums, stored for the adding below.
    std::vector<int64_t> head_offsets;
    stretch_values<K, R>(p.get(), p_stride, first, last, value_cache, offsets.data(), num_blocks,
                         head_offsets, g, [&]<int C>(int t0, int h, int d0, Vec16 (&a)[R][C]) {
                           float* part = partials.get() +
                                         (static_cast<size_t>(t0 / kChunk) * rows + h * R) * D;
                           for (int r = 0; r < R; ++r)
                             for (int c = 0; c < C; ++c)
                               store16(part + r * D + d0 + c * 16, a[r][c]);
                         });
#pragma omp barrier
    // The chunks' sums added in order, as `weighted_values` adds them: each thread its share of
    // the rows, chunk after chunk, reading the sums in the order they lie.
    // The first chunk's sums of the thread's rows take the total (no other thread reads them).
    const int r0 = rows * tid / nt, r1 = rows * (tid + 1) / nt;
    const int c0 = start / kChunk;
    const size_t span = static_cast<size_t>(r1 - r0) * D;
    float* total = partials.get() + (static_cast<size_t>(c0) * rows + r0) * D;
    for (int c = c0 + 1; c < chunks; ++c) {
      const float* part = partials.get() + (static_cast<size_t>(c) * rows + r0) * D;
      for (size_t i = 0; i < span; i += 16) store16(total + i, load16(total + i) + load16(part + i));
    }
    for (int r = r0; r < r1; ++r)
      for (int d = 0; d < D; d += 16)
        store16(out + r * o_head + d, load16(total + static_cast<size_t>(r - r0) * D + d));
  }
}

// fn(std::integral_constant<int, R>{}) for R = `group` (1..kMaxRows): the query rows per KV head
// as a template argument.
template <typename Fn>
void with_group(int group, Fn&& fn) {
  static_assert(kMaxRows == 6, "one case per row count");
  switch (group) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    default: fn(std::integral_constant<int, 6>{}); break;
  }
}

template <typename T, typename K>
using TileFn = void (*)(const T* const*, T* const*, const int*, const int*, const K*, const K*,
                        const KVScales&, const int*, int, const Geometry&, float, float*,
                        int64_t);

template <typename T, typename K, int... Rs>
constexpr auto tile_table(std::integer_sequence<int, Rs...>) {
  return std::array<TileFn<T, K>, sizeof...(Rs)>{&attend_tile<T, K, Rs + 1>...};
}

template <typename T, typename K>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const KVScales& scales,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start, double scale, int window) {
  // The first key position a query at `position` sees.
  auto first_visible = [window](int position) { return attention::first_visible(position, window); };
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  const int heads = static_cast<int>(query.size(1));
  const Geometry g{static_cast<int>(key_cache.size(1)), static_cast<int>(key_cache.size(2)),
                   static_cast<int>(key_cache.size(3)), block_tables.size(1)};
  const int group = heads / g.kv_heads;
  const int* lens = seq_lens.data_ptr<int>();
  const int* starts = query_start.data_ptr<int>();
  const int* tables = block_tables.data_ptr<int>();
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const K* kc = static_cast<const K*>(key_cache.data_ptr());
  const K* vc = static_cast<const K*>(value_cache.data_ptr());
  if constexpr (std::is_same_v<T, bf16>) {
    // On AMX tiles where this build and process have them (csrc/attention_amx.cpp).
    const StepView<K> step{q,      o,     q_tok,  q_head,   o_tok, o_head,
                           kc,     vc,    scales, lens,     starts, tables,
                           num_seqs, heads, g,    static_cast<float>(scale), window};
    if (amx_attention(step)) return;
  }

  // Decodes only: one sequence per item (`attend_sequence`) or a lone one's context split between
  // the threads (`attend_split`); other steps by items of tiles (`share_step`).
  const int available = at::get_num_threads();
  const Sharing sharing =
      share_step(lens, starts, num_seqs, group, kMaxRows, g.kv_heads, window, available);
  if (sharing == Sharing::kSequences) {
    const int threads = std::min(available, num_seqs);
    std::atomic<int> next_seq{0};
#pragma omp parallel num_threads(threads)
    {
      SequenceScratch scratch;
      for (int b = next_seq.fetch_add(1); b < num_seqs; b = next_seq.fetch_add(1)) {
        const T* qb = q + starts[b] * q_tok;
        T* ob = o + starts[b] * o_tok;
        const int* table = tables + b * g.max_blocks;
        const float sc = static_cast<float>(scale);
        with_group(group, [&](auto rows) {
          attend_sequence<T, K, decltype(rows)::value>(qb, q_head, ob, o_head, lens[b],
                                                       first_visible(lens[b] - 1), table, kc, vc,
                                                       scales, g, sc, scratch);
        });
      }
    }
    return;
  }
  if (sharing == Sharing::kSplit) {
    for (int b = 0; b < num_seqs; ++b) {
      const T* qb = q + starts[b] * q_tok;
      T* ob = o + starts[b] * o_tok;
      const int* table = tables + b * g.max_blocks;
      const float sc = static_cast<float>(scale);
      with_group(group, [&](auto rows) {
        attend_split<T, K, decltype(rows)::value>(qb, q_head, ob, o_head, lens[b],
                                                  first_visible(lens[b] - 1), table, kc, vc,
                                                  scales, g, sc, available);
      });
    }
    return;
  }
  // Positions per item: enough rows (positions x heads in the group) to fill kMaxRows.
  const std::vector<WorkItem> items =
      work_items(starts, num_seqs, g.kv_heads, std::max(1, kMaxRows / group));
  static constexpr auto tiles = tile_table<T, K>(std::make_integer_sequence<int, kMaxRows>{});
  int longest = 0;
  for (int b = 0; b < num_seqs; ++b) longest = std::max(longest, lens[b]);
  // Scores for a whole context per row, padded to whole blocks and vectors.
  const int64_t p_stride = (longest + g.block_size + 15) / 16 * 16;
  const int64_t scratch_floats = kMaxRows * (2 * g.head_dim + p_stride);
  const int threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  // The first key blocks of an item's context are read cold: a decode item is only a few blocks
  // long, so that wait is a large part of it. Each thread claims its following item before it
  // works on the current one and prefetches that item's first blocks meanwhile.
  const int64_t block_bytes = static_cast<int64_t>(g.head_dim) * g.block_size * sizeof(K);
  auto prefetch_start = [&](const WorkItem& item) {
    const int* table = tables + item.seq * g.max_blocks;
    const int first_pos = lens[item.seq] - (starts[item.seq + 1] - starts[item.seq]) +
                          (item.first_token - starts[item.seq]);
    const int first = first_block_of(first_visible(first_pos), g.block_size);
    const int blocks =
        std::min(first + kAheadBlocks, (lens[item.seq] + g.block_size - 1) / g.block_size);
    for (int j = first; j < blocks; ++j) {
      const int64_t offset =
          (static_cast<int64_t>(table[j]) * g.kv_heads + item.kv_head) * g.head_dim * g.block_size;
      prefetch(kc + offset, block_bytes);
    }
  };
  const size_t count = items.size();
  std::atomic<size_t> next_item{0};
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(scratch_floats);
    for (size_t i = next_item.fetch_add(1); i < count;) {
      const size_t following = next_item.fetch_add(1);
      if (following < count) prefetch_start(items[following]);
      const WorkItem& item = items[i];
      const int seq_len = lens[item.seq];
      const int first_pos = seq_len - (starts[item.seq + 1] - starts[item.seq]);
      const T* qrow[kMaxRows];
      T* orow[kMaxRows];
      int begin[kMaxRows], limit[kMaxRows];
      int rows = 0;
      auto flush = [&]() {
        if (rows > 0) {
          tiles[rows - 1](qrow, orow, begin, limit, kc, vc, scales,
                          tables + item.seq * g.max_blocks, item.kv_head, g,
                          static_cast<float>(scale), scratch.data(), p_stride);
        }
        rows = 0;
      };
      for (int t = item.first_token; t < item.first_token + item.num_tokens; ++t) {
        const int position = first_pos + (t - starts[item.seq]);
        for (int hh = 0; hh < group; ++hh) {
          const int head = item.kv_head * group + hh;
          qrow[rows] = q + t * q_tok + head * q_head;
          orow[rows] = o + t * o_tok + head * o_head;
          begin[rows] = first_visible(position);
          limit[rows] = position + 1;
          if (++rows == kMaxRows) flush();
        }
      }
      flush();
      i = following;
    }
  }
}

// The largest finite value of an 8-bit cache format: a head's values are scaled so that their
// largest magnitude lands there.
template <typename K>
constexpr float kLargest = std::is_same_v<K, int8_t> ? 127.0f
                           : std::is_same_v<K, fp8e4m3> ? 448.0f
                                                        : 57344.0f;

// `x` [D] stored as K in `dst` (element i at dst[i * stride]) with its scale: a copy where K is
// the activations' type; for an 8-bit cache, amax / kLargest<K> into `scale` and each value
// divided by it, rounded to the nearest (int8: clamped to +-127; fp8: to its largest finite,
// so no rounding past it makes a NaN or an infinity).
template <typename T, typename K>
inline void store_head(const T* x, K* dst, int64_t stride, float* scale, int64_t D) {
  if constexpr (std::is_same_v<K, T>) {
    for (int64_t d = 0; d < D; ++d) dst[d * stride] = x[d];
  } else {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
    const float s = amax / kLargest<K>;
    *scale = s;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      const float v = std::clamp(static_cast<float>(x[d]) * inv, -kLargest<K>, kLargest<K>);
      if constexpr (std::is_same_v<K, int8_t>) {
        dst[d * stride] = static_cast<int8_t>(std::nearbyint(v));
      } else {
        dst[d * stride] = K(v);
      }
    }
  }
}

template <typename T, typename K>
void rotary_cache_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                       const c10::optional<at::Tensor>& key_cache,
                       const c10::optional<at::Tensor>& value_cache,
                       const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads,
                       float* key_scale, float* value_scale) {
  const int64_t tokens = qkv.size(0);
  const int64_t D = cos_sin.size(1), half = D / 2;
  const int64_t row = qkv.stride(0);
  T* x = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const bool cache = key_cache.has_value();
  K* kc = cache ? static_cast<K*>(key_cache->data_ptr()) : nullptr;
  K* vc = cache ? static_cast<K*>(value_cache->data_ptr()) : nullptr;
  const int64_t bs = cache ? key_cache->size(3) : 1;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = table + pos[t] * D;
      const float* s = c + half;
      T* tok = x + t * row;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* v = tok + h * D;
        for (int64_t i = 0; i < half; i += 16) {
          const int n = static_cast<int>(std::min<int64_t>(16, half - i));
          const Vec16 x1 = load16(v + i, n), x2 = load16(v + half + i, n);
          const Vec16 cv = load16(c + i, n), sv = load16(s + i, n);
          store16(v + i, x1 * cv - x2 * sv, n);
          store16(v + half + i, x2 * cv + x1 * sv, n);
        }
      }
      if (!cache || slots[t] < 0) continue;
      const int64_t block = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* k = tok + (heads + h) * D;
        const T* val = tok + (heads + kv_heads + h) * D;
        const int64_t token = (block * kv_heads + h) * bs + offset;  // its scales' index
        store_head<T, K>(k, kc + ((block * kv_heads + h) * D) * bs + offset, bs,
                         key_scale ? key_scale + token : nullptr, D);
        store_head<T, K>(val, vc + token * D, 1, value_scale ? value_scale + token : nullptr, D);
      }
    }
  });
}

// fn(K{}) for the cache's element type: the activations' own (`T`), or an 8-bit format.
template <typename T, typename Fn>
void with_cache_type(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kChar: fn(int8_t{}); break;
    case at::kFloat8_e4m3fn: fn(fp8e4m3{}); break;
    case at::kFloat8_e5m2: fn(fp8e5m2{}); break;
    default: fn(T{}); break;
  }
}

bool is_8bit(at::ScalarType type) {
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// An 8-bit cache's scales: float32 [num_blocks, kv_heads, block_size], both given.
void check_scales(const at::Tensor& key_cache, const c10::optional<at::Tensor>& key_scale,
                  const c10::optional<at::Tensor>& value_scale, const char* what) {
  TORCH_CHECK(key_scale.has_value() && value_scale.has_value(), what,
              ": an 8-bit cache needs its key_scale and value_scale");
  for (const at::Tensor* sc : {&*key_scale, &*value_scale}) {
    TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                    sc->size(0) == key_cache.size(0) && sc->size(1) == key_cache.size(1) &&
                    sc->size(2) == key_cache.size(3),
                what, ": scales must be float32 [num_blocks, kv_heads, block_size]");
  }
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                     int64_t window, const c10::optional<at::Tensor>& key_scale,
                     const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(window >= 0, "paged_attention: the window must be 0 (none) or positive");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.size(2) == query.size(2) && key_cache.size(2) % 16 == 0,
              "head_dim must match the cache and be a multiple of 16");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start must be int32");
  TORCH_CHECK(block_tables.is_contiguous(), "block_tables must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "both caches share a dtype");
  const bool quantized = is_8bit(key_cache.scalar_type());
  TORCH_CHECK(quantized || key_cache.scalar_type() == query.scalar_type(),
              "paged_attention: the cache is the query's dtype, int8 or fp8, not ",
              key_cache.scalar_type());
  KVScales scales;
  if (quantized) {
    check_scales(key_cache, key_scale, value_scale, "paged_attention");
    scales = {key_scale->data_ptr<float>(), value_scale->data_ptr<float>()};
  }
  auto run = [&](auto t) {
    using T = decltype(t);
    with_cache_type<T>(key_cache.scalar_type(), [&](auto k) {
      paged_attention_impl<T, decltype(k)>(out, query, key_cache, value_cache, scales,
                                           block_tables, seq_lens, query_start, scale,
                                           static_cast<int>(window));
    });
  };
  if (query.scalar_type() == at::kFloat) {
    run(float{});
  } else if (query.scalar_type() == at::kBFloat16) {
    run(bf16{});
  } else {
    TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

void rotary_embedding_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                            const c10::optional<at::Tensor>& key_cache,
                            const c10::optional<at::Tensor>& value_cache,
                            const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads,
                            const c10::optional<at::Tensor>& key_scale,
                            const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width] with unit stride");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin: float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "positions and slot_mapping must be int64");
  TORCH_CHECK(qkv.size(1) >= (heads + 2 * kv_heads) * cos_sin.size(1), "qkv is too narrow");
  TORCH_CHECK(key_cache.has_value() == value_cache.has_value(), "both caches or neither");
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  if (key_cache.has_value()) {
    TORCH_CHECK(key_cache->is_contiguous() && value_cache->is_contiguous(), "caches: contiguous");
    TORCH_CHECK(value_cache->scalar_type() == key_cache->scalar_type(), "caches: one dtype");
    const bool quantized = is_8bit(key_cache->scalar_type());
    TORCH_CHECK(quantized || key_cache->scalar_type() == qkv.scalar_type(),
                "cache dtype must match qkv, or be int8 or fp8");
    if (quantized) {
      check_scales(*key_cache, key_scale, value_scale, "rotary_embedding_cache");
      k_scale = key_scale->data_ptr<float>();
      v_scale = value_scale->data_ptr<float>();
    }
  }
  const at::ScalarType cache_type = key_cache.has_value() ? key_cache->scalar_type() : qkv.scalar_type();
  auto run = [&](auto t) {
    using T = decltype(t);
    with_cache_type<T>(cache_type, [&](auto k) {
      rotary_cache_impl<T, decltype(k)>(qkv, positions, cos_sin, key_cache, value_cache,
                                        slot_mapping, heads, kv_heads, k_scale, v_scale);
    });
  };
  if (qkv.scalar_type() == at::kFloat) {
    run(float{});
  } else if (qkv.scalar_type() == at::kBFloat16) {
    run(bf16{});
  } else {
    TORCH_CHECK(false, "rotary_embedding_cache: unsupported dtype ", qkv.scalar_type());
  }
}

}  // namespace rankcast
