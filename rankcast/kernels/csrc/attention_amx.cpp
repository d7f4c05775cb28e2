// Paged attention on AMX tiles (TDPBF16PS): a bfloat16 model with a bfloat16 or 8-bit cache (int8,
// fp8 e4m3, e5m2: its bytes converted to bfloat16 exactly as they are paired), on an AMX build
// whose tiles the OS granted. It reads the cache csrc/attention.cpp documents, where it
// lies, and gives every query row the vector kernels' softmax; what the tiles change is how the
// two products are summed:
//
// - Scores: up to 32 query rows (positions x the heads of a KV group, two row tiles) times 16
//   tokens' keys, the head's dimensions 32 at a time in order. A key block is dimension-major, so the
//   tile's operand (16 rows of 64 bytes, row i the pair of dimensions 2i and 2i + 1 of 16
//   tokens) is built with one word permute per row (`pair_rows`), into L1, and loaded from there.
//   The score is that sum times the scale, as the vector kernel's paired keys give it.
// - Weighted values: the probabilities rounded to bfloat16 (what the tiles multiply; vLLM's and
//   SGLang's CPU kernels do the same), times the values paired two tokens at a time, summed on the
//   tiles in token order within 256-token segments of the absolute positions (`kSegment`), the
//   segments' sums then added in order in float32.
//
// So an AMX build's tokens have bits of their own (not the vector kernels'), and every step of
// that build gives them: a row's sums depend on its own query, keys and probabilities only, never
// on the rows beside it in a tile (each tile element is its own row's), and a lone decode's split
// of the context between threads falls on segment boundaries, whose sums are added in the same
// order (`attend_split`). Tokens a row does not see add exact zeros: a zero probability times
// a value the model wrote, or, outside the blocks a set of rows reads (before its first block,
// past its context), times a zero row, never a block the engine may have freed.
//
// Tried and left: pairing a chunk's keys (and a step's values) while the one before is multiplied,
// so that no tile load follows the stores that built it: 0.97-1.13x, within the noise.
//
// Why: on long prompts attention is most of the prefill (SmolLM2 at 8,000 tokens: more arithmetic
// than its linears), and the vector kernel's float32 multiply-adds did a 512-token chunk's
// weighted sum at one product per lane and cycle; a tile does 16 x 16 x 32 in one instruction.
// On the 2-core Xeon with AMX (family 6 model 167; bench/prefill_attention.py, builds
// alternated), one 512-token chunk's attention at SmolLM2's heads: 14.8-15.0 -> 5.7-5.9 ms after
// 2,000 tokens, 85-112 -> 25-28 ms after 8,000 (16-row tiles: 6.2 and 33.8); an int8 cache's
// 13.6 -> 7.5 ms and 70.7 -> 26.8 ms, its decode steps (SmolLM2, bench/decode_step.py) 4-5 %
// longer on tiles (1 sequence at 2,000 and 8,000 tokens, 4 at 2,000, 32 at 200): converting the
// bytes costs a decode more than the products save. Tried and left: the
// softmax's normalizing moved past the weighted sum (one pass over a row fewer) measured 1.04x
// and 0.95x, within noise; what a row's softmax costs is its exponentials.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention.h"
#include "gemm.h"

namespace rankcast {
namespace attention {

#if RANKCAST_AMX_BF16
namespace {

constexpr int kTileRows = 32;     // query rows a set of tiles holds: two row tiles of 16
constexpr int kStep = 32;         // tokens one multiply of the weighted values takes (64 bytes of bf16)
constexpr int kSegment = 256;     // tokens the tiles sum in one chain (a multiple of kStep)
constexpr int kMaxHeadDim = 256;  // the widest head a zero value row covers
constexpr int kPairTile = 16 * 32;  // bfloat16 elements of one operand tile (16 rows of 64 bytes)
constexpr int kAheadBlocks = 2;  // key blocks on whose lines a block's scores fetch

alignas(64) const bf16 kZeroRow[kMaxHeadDim] = {};  // zero in bfloat16 and in 8-bit formats

// An 8-bit cache's bytes are multiplied as bfloat16, converted exactly (every int8, fp8 e4m3 and
// fp8 e5m2 value is a bfloat16): the scores times each token's key scale, the probabilities times
// each token's value scale before they are rounded, as csrc/attention.cpp's header says.
template <typename K>
constexpr bool kEightBit = !std::is_same_v<K, bf16>;

// Sixteen tokens' pairs of dimensions (row `lo`, row `hi` of a transposed key block; n tokens,
// the rest zero) as bfloat16 pairs: a tile row of the keys' operand.
template <typename K>
inline __m512i key_pair_row(const K* lo, const K* hi, int n) {
  if constexpr (!kEightBit<K>) {
    return pair_rows(lo, hi, tail_mask(n));
  } else {
    const __m512i a = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(load16(lo, n).v)));
    const __m512i b = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(load16(hi, n).v)));
    return interleave_words(a, b, false);
  }
}

// 32 dimensions of a value row as bfloat16.
template <typename K>
inline __m512i value_words(const K* row) {
  if constexpr (!kEightBit<K>) {
    return _mm512_loadu_si512(row);
  } else {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(load16(row + 16).v, load16(row).v));
  }
}

// Tiles for up to 32 rows, the first 16 (`upper`) and the rest (`lower`, none for 16 or fewer):
// sums tmm0 (upper) and tmm1 (lower) for the scores and for 16 of a pass's 32 dimensions of
// weighted values, tmm2 and tmm3 for the other 16; the rows' operands (queries or probabilities,
// 32 bfloat16 a row) tmm4 (upper) and tmm5 (lower); the cache's operands (16 pairs x 16
// columns) tmm6 and tmm7. Both row tiles multiply every cache tile loaded, so building it
// (the pairing, in L1) is paid once for 32 rows; each row's sums are its own, whatever the rows
// beside it (each tile element depends on its own row alone).
void configure_tiles(int rows) {
  gemm::TileConfig config;
  const int upper = std::min(rows, 16), lower = rows - upper;
  for (int t : {0, 2, 4}) config.rows[t] = static_cast<uint8_t>(upper);
  for (int t : {1, 3, 5}) config.rows[t] = static_cast<uint8_t>(lower);
  for (int t : {6, 7}) config.rows[t] = 16;
  for (int t = 0; t < 8; ++t) config.colsb[t] = config.rows[t] > 0 ? 64 : 0;
  gemm::load_tile_config(config);
}

// Scores of the configured rows (their queries `q16` [rows, D] bfloat16) against tokens
// [t0, t0 + n) of the transposed key block `kt` (kt[d * bs + t]), unscaled, into `sums`
// [rows, 16]: for each 32 dimensions in order, the 16 pairs of each token built into `pairs`
// (one tile per 32 dimensions, D / 32 of them, so a load never waits on the next tile's stores).
// The same tokens of `ahead` (a block to come, or null) are fetched a row at a time meanwhile:
// a whole block's lines at once stalled the loop on the core's miss buffers (perf annotate).
template <typename K>
inline void tile_scores(const bf16* q16, int D, bool lower, const K* kt, int bs, int t0, int n,
                        const K* ahead, bf16* pairs, float* sums) {
  const int q_stride = D * static_cast<int>(sizeof(bf16));
  _tile_zero(0);
  if (lower) _tile_zero(1);
  for (int d0 = 0; d0 < D; d0 += 32) {
    bf16* tile = pairs + (d0 / 32) * kPairTile;
    for (int i = 0; i < 16; ++i) {
      const int d = d0 + 2 * i;
      if (ahead != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + d * bs + t0), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (d + 1) * bs + t0), _MM_HINT_T0);
      }
      _mm512_store_si512(tile + 32 * i, key_pair_row(kt + d * bs + t0, kt + (d + 1) * bs + t0, n));
    }
    _tile_loadd(4, q16 + d0, q_stride);
    if (lower) _tile_loadd(5, q16 + 16 * D + d0, q_stride);
    if ((d0 / 32) % 2 == 0) {  // alternate the cache's tiles so a load need not wait on a multiply
      _tile_loadd(6, tile, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (lower) _tile_dpbf16ps(1, 5, 6);
    } else {
      _tile_loadd(7, tile, 64);
      _tile_dpbf16ps(0, 4, 7);
      if (lower) _tile_dpbf16ps(1, 5, 7);
    }
  }
  _tile_stored(0, sums, 16 * static_cast<int>(sizeof(float)));
  if (lower) _tile_stored(1, sums + 16 * 16, 16 * static_cast<int>(sizeof(float)));
}

// The cache's operands for the weighted values of 32 tokens (`rows32`: each token's value row,
// or a zero row where hidden) over dimensions [d0, d0 + 32): tile c's row k holds tokens 2k and
// 2k + 1's dimensions d0 + 16c .. + 16, interleaved (one word permute per tile row). The next
// step's rows (`next32`) are fetched meanwhile, a pair of rows at a time.
template <typename K>
inline void value_pairs(const K* const* rows32, const K* const* next32, int d0, bf16* pairs) {
  for (int k = 0; k < 16; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(next32[2 * k] + d0), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next32[2 * k + 1] + d0), _MM_HINT_T0);
    const __m512i a = value_words(rows32[2 * k] + d0);
    const __m512i b = value_words(rows32[2 * k + 1] + d0);
    _mm512_store_si512(pairs + 32 * k, interleave_words(a, b, false));
    _mm512_store_si512(pairs + kPairTile + 32 * k, interleave_words(a, b, true));
  }
}

// Where a context's value rows lie: token u's row, or the zero row outside [start, reach).
// Block sizes are powers of two (`amx_attention` checks), so a token's block and its place in
// it are a shift and a mask.
template <typename K>
struct ValueRows {
  const K* cache;
  const int64_t* offsets;  // the head's part of each block (valid from the first block read)
  int bs, D, start, reach;
  int shift = std::countr_zero(static_cast<unsigned>(bs));

  const K* operator()(int u) const {
    if (u < start || u >= reach) return reinterpret_cast<const K*>(kZeroRow);
    return cache + offsets[u >> shift] + static_cast<int64_t>(u & (bs - 1)) * D;
  }
};

// One segment's weighted values for the configured rows: sum over tokens [lo, hi) (kStep-aligned,
// inside one segment) of p16[r, u] * v[u, d], on the tiles from zero in token order, stored as
// float32 into `sums` [rows, D]. The dimensions go 32 at a time (two sums tiles per row tile),
// each pass over the segment's tokens pairing only its own 32 of each value row; the segment's
// rows stay in L1 from one pass to the next (256 tokens of 128 dimensions: 64 KB).
template <typename K>
void segment_values(const bf16* p16, int64_t p16_stride, bool lower, int lo, int hi,
                    const ValueRows<K>& values, bf16* pairs, float* sums) {
  const int D = values.D;
  const int p_stride = static_cast<int>(p16_stride * sizeof(bf16));
  const int s_stride = D * static_cast<int>(sizeof(float));
  // The segment's rows, and the next step's past it (to fetch meanwhile), found once for every
  // pass over the dimensions (1.03-1.05x a 512-token chunk's attention against finding them in
  // each pass).
  const K* rows[kSegment + kStep];
  for (int i = 0; i < hi - lo + kStep; ++i) rows[i] = values(lo + i);
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_zero(0);
    _tile_zero(2);
    if (lower) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int t = lo, which = 0; t < hi; t += kStep, which ^= 1) {
      const K* const* step_rows = rows + (t - lo);
      bf16* tile = pairs + which * 2 * kPairTile;  // alternate buffers: no store waits on a load
      value_pairs(step_rows, step_rows + kStep, d0, tile);
      _tile_loadd(4, p16 + t, p_stride);
      if (lower) _tile_loadd(5, p16 + 16 * p16_stride + t, p_stride);
      _tile_loadd(6, tile, 64);
      _tile_loadd(7, tile + kPairTile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      if (lower) {
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums + d0, s_stride);
    _tile_stored(2, sums + d0 + 16, s_stride);
    if (lower) {
      _tile_stored(1, sums + 16 * D + d0, s_stride);
      _tile_stored(3, sums + 16 * D + d0 + 16, s_stride);
    }
  }
}

// Tokens [lo, hi) of segment s of a context read over [start, reach): the segment's part,
// widened to kStep (the tokens added have zero probabilities and zero rows).
inline void segment_span(int s, int start, int reach, int& lo, int& hi) {
  lo = std::max(s * kSegment, start / kStep * kStep);
  hi = std::min((s + 1) * kSegment, (reach + kStep - 1) / kStep * kStep);
}

// Where an 8-bit cache's value scales lie for a row's head (`fold_value_scales`'s arguments), or
// none (`scale` null: a bfloat16 cache).
struct ValueScales {
  const float* scale = nullptr;
  const int64_t* offsets = nullptr;
  int64_t shift = 0;
  int bs = 0, D = 0;
};

// Row r's scores [start, reach) of `p` made its probabilities as the tiles read them, in p16
// (both indexed by position), zero over the rest of the kStep grid around them: softmax_row's
// numbers (the row's largest score `row_max`, its exponentials summed in the same order, each times
// the inverse of the sum) rounded to bfloat16. Two passes over the row instead of softmax_row's
// three and a rounding pass: a tile's 16 rows of 8,000 tokens spent more on them than on the
// tiles' products (perf annotate), so the tile path finds the largest score as it places the
// scores and rounds as it normalizes.
inline void probabilities(float* p, bf16* p16, int start, int reach, float row_max,
                          const ValueScales& folded) {
  const Vec16 inv = splat(1.0f / exponentiate(p, start, reach, row_max));
  const int lo = start / kStep * kStep, hi = (reach + kStep - 1) / kStep * kStep;
  for (int t = lo; t < start; ++t) p16[t] = bf16(0.0f);
  if (folded.scale != nullptr) {  // an 8-bit cache: the probabilities times the value scales
    for (int t = start; t < reach; t += 16) {
      const int n = std::min(16, reach - t);
      store16(p + t, load16(p + t, n) * inv, n);
    }
    fold_value_scales(p, start, reach, folded.scale, folded.offsets, folded.shift, folded.bs,
                      folded.D);
    for (int t = start; t < reach; t += 16) {
      const int n = std::min(16, reach - t);
      store16(p16 + t, load16(p + t, n), n);
    }
  } else {
    for (int t = start; t < reach; t += 16) {
      const int n = std::min(16, reach - t);
      store16(p16 + t, load16(p + t, n) * inv, n);
    }
  }
  for (int t = reach; t < hi; ++t) p16[t] = bf16(0.0f);
}

// Scores [rows, 16] of a tile made row r's part of p (p + r * p_stride, positions [base, base +
// n)): times the scale (and each token's key scale, `key_scales`, where the cache is 8-bit),
// -inf before begin[r] and from limit[r]; maxes[r] (unless null: a split decode finds each
// row's largest once every thread's scores are in) keeps the row's largest so far.
inline void place_scores(const float* sums, int rows, float scale, const float* key_scales,
                         float* p, int64_t p_stride, int base, int n, const int* begin,
                         const int* limit, Vec16* maxes) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const Vec16 ks = key_scales != nullptr ? load16(key_scales, n) : splat(1.0f);
  for (int r = 0; r < rows; ++r) {
    Vec16 s = load16(sums + r * 16) * splat(scale);
    if (key_scales != nullptr) s = s * ks;
    const __mmask16 visible = tail_mask(std::clamp(limit[r] - base, 0, n)) &
                              static_cast<__mmask16>(~tail_mask(std::clamp(begin[r] - base, 0, 16)));
    const Vec16 kept{_mm512_mask_mov_ps(neg_inf, visible, s.v)};
    store16(p + r * p_stride + base, kept, n);
    if (maxes != nullptr) maxes[r] = max(maxes[r], kept);
  }
}

// The weighted values of the configured rows (their weights `p16`, rows `p16_stride` apart, over
// [start, reach)) into acc [rows, D]: each segment's sums on the tiles, added in order.
template <typename K>
void weighted_sum(const bf16* p16, int64_t p16_stride, int rows, int start, int reach,
                  const ValueRows<K>& values, bf16* pairs, float* sums, float* acc) {
  const int D = values.D;
  const int first_segment = start / kSegment, last_segment = (reach - 1) / kSegment;
  for (int s = first_segment; s <= last_segment; ++s) {
    int seg_lo, seg_hi;
    segment_span(s, start, reach, seg_lo, seg_hi);
    segment_values(p16, p16_stride, rows > 16, seg_lo, seg_hi, values, pairs, sums);
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < D; d += 16) {
        float* a = acc + r * D + d;
        const Vec16 part = load16(sums + r * D + d);
        store16(a, s == first_segment ? part : load16(a) + part);
      }
  }
}

// A thread's working memory for tiles of rows, kept across its items.
struct TileScratch {
  std::vector<int64_t> offsets;
  std::vector<float> p;   // [rows, p_stride] scores, then probabilities
  std::vector<bf16> p16;  // [rows, p_stride] probabilities rounded, the tiles' operand
  std::vector<float> acc;  // [rows, D]
  std::vector<bf16> q16;   // [rows, D] the queries, the tiles' operand
  std::vector<Vec16> maxes;  // each row's largest score so far, lane by lane
  alignas(64) bf16 pairs[8 * kPairTile];  // a key chunk's D / 32 tiles, or 4 value tiles
  alignas(64) float sums[kTileRows * kMaxHeadDim];  // a tile's scores [rows, 16] or sums [rows, D]
};

// An 8-bit cache's key scales for tokens t0.. of the block-head at cache offset `offset`, or
// null (a bfloat16 cache).
template <typename K>
inline const float* key_scales(const StepView<K>& step, int64_t offset, int t0) {
  if (step.scales.key == nullptr) return nullptr;
  return step.scales.key + offset / step.g.head_dim + t0;
}

// Up to 32 query rows of one sequence against one KV head: row r sees keys [begin[r], limit[r]).
// Every score first (so the softmax is exact and done once per row), then the weighted values
// segment by segment.
template <typename K>
void attend_rows(const bf16* const* q, bf16* const* out, const int* begin, const int* limit,
                 int rows, const StepView<K>& step, const int* table, int kv_head, int64_t p_stride,
                 TileScratch& scratch) {
  const Geometry& g = step.g;
  const int D = g.head_dim, bs = g.block_size;
  int reach = 0, lo = std::numeric_limits<int>::max();
  scratch.q16.resize(static_cast<size_t>(rows) * D);
  scratch.maxes.resize(rows);
  for (int r = 0; r < rows; ++r) {
    reach = std::max(reach, limit[r]);
    lo = std::min(lo, begin[r]);
    std::memcpy(scratch.q16.data() + r * D, q[r], D * sizeof(bf16));
  }
  const int first_block = first_block_of(lo, bs), start = first_block * bs;
  const int num_blocks = (reach + bs - 1) / bs;
  const int64_t block_elems = static_cast<int64_t>(D) * bs;
  scratch.offsets.resize(num_blocks);
  for (int j = first_block; j < num_blocks; ++j)
    scratch.offsets[j] = (static_cast<int64_t>(table[j]) * g.kv_heads + kv_head) * block_elems;
  float* p = scratch.p.data();
  for (int r = 0; r < rows; ++r) scratch.maxes[r] = splat(-std::numeric_limits<float>::infinity());
  configure_tiles(rows);
  for (int j = first_block, base = start; base < reach; ++j, base += bs) {
    const int ntok = std::min(bs, reach - base);
    const K* kb = step.key_cache + scratch.offsets[j];
    const K* ahead =
        j + kAheadBlocks < num_blocks ? step.key_cache + scratch.offsets[j + kAheadBlocks] : nullptr;
    for (int t0 = 0; t0 < ntok; t0 += 16) {
      const int n = std::min(16, ntok - t0);
      tile_scores(scratch.q16.data(), D, rows > 16, kb, bs, t0, n, ahead, scratch.pairs, scratch.sums);
      place_scores(scratch.sums, rows, step.scale, key_scales(step, scratch.offsets[j], t0), p,
                   p_stride, base + t0, n, begin, limit, scratch.maxes.data());
    }
  }
  bf16* p16 = scratch.p16.data();
  const ValueScales folded{step.scales.value, scratch.offsets.data(), 0, bs, D};
  for (int r = 0; r < rows; ++r) {
    probabilities(p + r * p_stride, p16 + r * p_stride, start, reach, reduce_max(scratch.maxes[r]),
                  folded);
  }
  const ValueRows<K> values{step.value_cache, scratch.offsets.data(), bs, D, start, reach};
  float* acc = scratch.acc.data();
  weighted_sum(p16, p_stride, rows, start, reach, values, scratch.pairs, scratch.sums, acc);
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < D; d += 16) store16(out[r] + d, load16(acc + r * D + d));
}

// Where a decoding sequence's rows and context lie: its heads' rows (`group` per KV head), the
// keys its token sees [lo, reach) and the block-aligned `start` reading begins at, its blocks,
// its query and output rows, and the stride of rows of scores by position.
struct DecodeLayout {
  int group, rows, reach, lo, start, num_blocks;
  int64_t block_elems;
  const int* table;
  const bf16* q;
  bf16* o;
  int64_t p_stride;
};

template <typename K>
DecodeLayout decode_layout(const StepView<K>& step, int b) {
  const Geometry& g = step.g;
  const int bs = g.block_size, reach = step.seq_lens[b];
  const int lo = first_visible(reach - 1, step.window);
  const int num_blocks = (reach + bs - 1) / bs;
  return {step.heads / g.kv_heads,
          step.heads,
          reach,
          lo,
          first_block_of(lo, bs) * bs,
          num_blocks,
          static_cast<int64_t>(g.head_dim) * bs,
          step.block_tables + b * g.max_blocks,
          step.q + step.query_start[b] * step.q_tok,
          step.out + step.query_start[b] * step.o_tok,
          (static_cast<int64_t>(num_blocks) * bs + kStep + 31) / 32 * 32};
}

// One sequence's single query token against every KV head, the context shared out between the
// threads in whole segments: scores, then each row's softmax, then each segment's weighted
// values, then the segments' sums added in order: `attend_rows`'s numbers, in its order.
template <typename K>
void attend_split(const StepView<K>& step, int b, int threads) {
  const auto [group, rows, reach, lo, start, num_blocks, block_elems, table, q, o, p_stride] =
      decode_layout(step, b);
  const int D = step.g.head_dim, bs = step.g.block_size;
  const Geometry& g = step.g;
  std::vector<int64_t> offsets(num_blocks);
  for (int j = 0; j < num_blocks; ++j)
    offsets[j] = static_cast<int64_t>(table[j]) * g.kv_heads * block_elems;
  const std::unique_ptr<float[]> p(new float[static_cast<size_t>(rows) * p_stride]);
  const std::unique_ptr<bf16[]> p16(new bf16[static_cast<size_t>(rows) * p_stride]);
  const int first_segment = start / kSegment, last_segment = (reach - 1) / kSegment;
  const int segments = last_segment - first_segment + 1;
  const std::unique_ptr<float[]> partials(new float[static_cast<size_t>(segments) * rows * D]);
  // Stretches of whole segments and whole blocks, on the absolute grid.
  const int unit = std::max(bs, kSegment);
  const int grid_start = start / unit * unit;
  const int units = (reach - grid_start + unit - 1) / unit;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int first = std::max(start, std::min(reach, grid_start + units * tid / nt * unit));
    const int last = std::min(reach, grid_start + units * (tid + 1) / nt * unit);
    const std::unique_ptr<TileScratch> scratch(new TileScratch);
    std::vector<int64_t> head_offsets(num_blocks);
    int begins[kTileRows], limits[kTileRows];
    for (int r = 0; r < group; ++r) {
      begins[r] = lo;
      limits[r] = reach;
    }
    scratch->q16.resize(static_cast<size_t>(group) * D);
    for (int h = 0; h < g.kv_heads && first < last; ++h) {
      for (int r = 0; r < group; ++r)
        std::memcpy(scratch->q16.data() + r * D, q + (h * group + r) * step.q_head,
                    D * sizeof(bf16));
      configure_tiles(group);
      for (int j = first / bs, base = j * bs; base < last; ++j, base += bs) {
        const int ntok = std::min(bs, reach - base);
        const K* kb = step.key_cache + offsets[j] + h * block_elems;
        const K* ahead = (j + kAheadBlocks) * bs < last
                                ? step.key_cache + offsets[j + kAheadBlocks] + h * block_elems
                                : nullptr;
        for (int t0 = 0; t0 < ntok; t0 += 16) {
          const int n = std::min(16, ntok - t0);
          tile_scores(scratch->q16.data(), D, group > 16, kb, bs, t0, n, ahead, scratch->pairs,
                      scratch->sums);
          place_scores(scratch->sums, group, step.scale,
                       key_scales(step, offsets[j] + h * block_elems, t0),
                       p.get() + h * group * p_stride, p_stride, base + t0, n, begins, limits,
                       nullptr);
        }
      }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      float* pr = p.get() + r * p_stride;
      const ValueScales folded{step.scales.value, offsets.data(), (r / group) * block_elems, bs, D};
      probabilities(pr, p16.get() + r * p_stride, start, reach, largest_score(pr, start, reach), folded);
    }
    // (the implicit barrier of the loop: every probability is in place)
    for (int h = 0; h < g.kv_heads && first < last; ++h) {
      for (int j = 0; j < num_blocks; ++j) head_offsets[j] = offsets[j] + h * block_elems;
      const ValueRows<K> values{step.value_cache, head_offsets.data(), bs, D, start, reach};
      const bf16* ph = p16.get() + h * group * p_stride;
      configure_tiles(group);
      for (int s = first / kSegment; s * kSegment < last; ++s) {
        int seg_lo, seg_hi;
        segment_span(s, start, reach, seg_lo, seg_hi);
        segment_values(ph, p_stride, group > 16, seg_lo, seg_hi, values, scratch->pairs,
                       scratch->sums);
        float* part =
            partials.get() + (static_cast<size_t>(s - first_segment) * rows + h * group) * D;
        std::memcpy(part, scratch->sums, static_cast<size_t>(group) * D * sizeof(float));
      }
    }
    _tile_release();
#pragma omp barrier
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < D; d += 16) {
        Vec16 total = load16(partials.get() + static_cast<size_t>(r) * D + d);
        for (int s = 1; s < segments; ++s)
          total = total + load16(partials.get() + (static_cast<size_t>(s) * rows + r) * D + d);
        store16(o + r * step.o_head + d, total);
      }
    }
  }
}

// One sequence's single query token against every KV head on this thread: a step of decodes
// only, one sequence per item (csrc/attention.cpp's attend_sequence), so that its blocks are read
// whole, every head of a block in turn (the cache's order), rather than one head's part of each
// block per item: on the 2-core Xeon, 4 decodes at 2,000 tokens took 0.85x the vector kernel's
// step time with an item per (sequence, KV head). The numbers are `attend_rows`'s, in its order.
template <typename K>
void attend_sequence(const StepView<K>& step, int b, TileScratch& scratch) {
  const auto [group, rows, reach, lo, start, num_blocks, block_elems, table, q, o, p_stride] =
      decode_layout(step, b);
  const int D = step.g.head_dim, bs = step.g.block_size;
  const Geometry& g = step.g;
  scratch.offsets.resize(num_blocks);
  scratch.p.resize(static_cast<size_t>(rows) * p_stride);
  scratch.p16.resize(static_cast<size_t>(rows) * p_stride);
  scratch.acc.resize(static_cast<size_t>(group) * D);
  scratch.q16.resize(static_cast<size_t>(rows) * D);
  scratch.maxes.assign(rows, splat(-std::numeric_limits<float>::infinity()));
  for (int j = 0; j < num_blocks; ++j)
    scratch.offsets[j] = static_cast<int64_t>(table[j]) * g.kv_heads * block_elems;
  for (int r = 0; r < rows; ++r)
    std::memcpy(scratch.q16.data() + r * D, q + r * step.q_head, D * sizeof(bf16));
  int begins[kTileRows], limits[kTileRows];
  for (int r = 0; r < group; ++r) {
    begins[r] = lo;
    limits[r] = reach;
  }
  float* p = scratch.p.data();
  bf16* p16 = scratch.p16.data();
  configure_tiles(group);
  for (int j = start / bs, base = start; base < reach; ++j, base += bs) {
    const int ntok = std::min(bs, reach - base);
    for (int h = 0; h < g.kv_heads; ++h) {
      const K* kb = step.key_cache + scratch.offsets[j] + h * block_elems;
      const K* ahead = j + kAheadBlocks < num_blocks
                              ? step.key_cache + scratch.offsets[j + kAheadBlocks] + h * block_elems
                              : nullptr;
      for (int t0 = 0; t0 < ntok; t0 += 16) {
        const int n = std::min(16, ntok - t0);
        tile_scores(scratch.q16.data() + h * group * D, D, group > 16, kb, bs, t0, n, ahead,
                    scratch.pairs, scratch.sums);
        place_scores(scratch.sums, group, step.scale,
                     key_scales(step, scratch.offsets[j] + h * block_elems, t0),
                     p + h * group * p_stride, p_stride, base + t0, n, begins, limits,
                     scratch.maxes.data() + h * group);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const ValueScales folded{step.scales.value, scratch.offsets.data(), (r / group) * block_elems,
                             bs, D};
    probabilities(p + r * p_stride, p16 + r * p_stride, start, reach, reduce_max(scratch.maxes[r]),
                  folded);
  }
  std::vector<int64_t> head_offsets(num_blocks);
  float* acc = scratch.acc.data();
  for (int h = 0; h < g.kv_heads; ++h) {
    for (int j = 0; j < num_blocks; ++j) head_offsets[j] = scratch.offsets[j] + h * block_elems;
    const ValueRows<K> values{step.value_cache, head_offsets.data(), bs, D, start, reach};
    weighted_sum(p16 + h * group * p_stride, p_stride, group, start, reach, values,
                 scratch.pairs, scratch.sums, acc);
    for (int r = 0; r < group; ++r)
      for (int d = 0; d < D; d += 16)
        store16(o + (h * group + r) * step.o_head + d, load16(acc + r * D + d));
  }
}

}  // namespace

template <typename K>
bool amx_attention(const StepView<K>& step) {
  const Geometry& g = step.g;
  if (!gemm::amx_ready() || g.head_dim % 32 != 0 || g.head_dim > kMaxHeadDim ||
      !std::has_single_bit(static_cast<unsigned>(g.block_size)))
    return false;
  const int group = step.heads / g.kv_heads;
  const int* lens = step.seq_lens;
  const int* starts = step.query_start;
  const int available = at::get_num_threads();
  // Shared out as the vector kernels share a step (`share_step`), with up to 32 rows a tile.
  const Sharing sharing = share_step(lens, starts, step.num_seqs, group, kTileRows, g.kv_heads,
                                     step.window, available);
  if (sharing == Sharing::kSequences) {
    std::atomic<int> next_seq{0};
#pragma omp parallel num_threads(std::min(available, step.num_seqs))
    {
      TileScratch scratch;
      for (int b = next_seq.fetch_add(1); b < step.num_seqs; b = next_seq.fetch_add(1))
        attend_sequence(step, b, scratch);
      _tile_release();
    }
    return true;
  }
  if (sharing == Sharing::kSplit) {
    for (int b = 0; b < step.num_seqs; ++b) attend_split(step, b, available);
    return true;
  }
  // Positions per item: as many as fill the tiles' 32 rows with whole groups.
  const std::vector<WorkItem> items =
      work_items(starts, step.num_seqs, g.kv_heads, std::max(1, kTileRows / group));
  int longest = 0;
  for (int b = 0; b < step.num_seqs; ++b) longest = std::max(longest, lens[b]);
  // Scores and probabilities per row, by position, padded to whole blocks and whole steps.
  const int64_t p_stride = (longest + g.block_size + kStep + 31) / 32 * 32;
  const int threads = std::min<int64_t>(available, static_cast<int64_t>(items.size()));
  std::atomic<size_t> next_item{0};
  const size_t count = items.size();
#pragma omp parallel num_threads(threads)
  {
    std::unique_ptr<TileScratch> scratch(new TileScratch);
    scratch->p.resize(static_cast<size_t>(kTileRows) * p_stride);
    scratch->p16.resize(static_cast<size_t>(kTileRows) * p_stride);
    scratch->acc.resize(static_cast<size_t>(kTileRows) * g.head_dim);
    for (size_t i = next_item.fetch_add(1); i < count; i = next_item.fetch_add(1)) {
      const WorkItem& item = items[i];
      const int first_pos = lens[item.seq] - (starts[item.seq + 1] - starts[item.seq]);
      const int* table = step.block_tables + item.seq * g.max_blocks;
      const bf16* qrow[kTileRows];
      bf16* orow[kTileRows];
      int begin[kTileRows], limit[kTileRows];
      int rows = 0;
      auto flush = [&]() {
        if (rows > 0)
          attend_rows(qrow, orow, begin, limit, rows, step, table, item.kv_head, p_stride,
                      *scratch);
        rows = 0;
      };
      for (int t = item.first_token; t < item.first_token + item.num_tokens; ++t) {
        const int position = first_pos + (t - starts[item.seq]);
        for (int hh = 0; hh < group; ++hh) {
          const int head = item.kv_head * group + hh;
          qrow[rows] = step.q + t * step.q_tok + head * step.q_head;
          orow[rows] = step.out + t * step.o_tok + head * step.o_head;
          begin[rows] = first_visible(position, step.window);
          limit[rows] = position + 1;
          if (++rows == kTileRows) flush();
        }
      }
      flush();
    }
    _tile_release();
  }
  return true;
}

#else

template <typename K>
bool amx_attention(const StepView<K>&) {
  return false;
}

#endif

template bool amx_attention(const StepView<bf16>&);
template bool amx_attention(const StepView<int8_t>&);
template bool amx_attention(const StepView<fp8e4m3>&);
template bool amx_attention(const StepView<fp8e5m2>&);

}  // namespace attention
}  // namespace rankcast
