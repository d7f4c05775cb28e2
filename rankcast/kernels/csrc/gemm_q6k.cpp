// Linear layers with llama.cpp's Q6_K weights, served as they are stored: super-blocks of 256 k,
// each with a float16 scale d, sixteen int8 sub-block scales sc (one per 16 k) and 6-bit values q
// (0..63); a weight is w = d * sc * (q - 32).
//
// Why: llama-quantize keeps a model's LM head (and often its embedding) Q6_K under 4-bit
// layers, and at one token the head is most of what a small or sparse model reads (Qwen3-30B-A3B
// cut to 4 layers: 311M of 539M active parameters). Served as q8_0 the head is 8.5 bits a weight;
// as stored it is 6.5625, what llama.cpp reads: ~23 % fewer of the head's bytes.
//
// The products are integer and the activations 8-bit, as llama.cpp multiplies Q6_K (its Q8_K
// rows): each row is quantized per block of 256 k to int8 (a = round(x * 127 / max|x| of the
// block), one float32 scale s_b a block, csrc/quantize_rows.h), so that the unsigned 6-bit
// values meet signed bytes in VPDPBUSD (AVX512-VNNI; elsewhere VPMADDUBSW + VPMADDWD, the same
// sums: a pair of products is at most 2 x 63 x 127). A sub-block's sum of (q - 32) * a is exact in
// int32 (it starts at -32 x the sub-block's sum of a), then, sub-blocks in order,
// block += float(sum) * (d * sc) (d * sc is exact in float32), and blocks in order,
// acc += s_b * block. A row's result never depends on the rows beside it or on the threads
// (batch-invariant).
//
// Why 8 bits and not the 15 of the 4- and 8-bit group kernels: Q6_K's scale every 16 k costs a
// float multiply-add a row every 16 k, and 15-bit rows (split into two bytes) doubled the dot
// products; 32 rows took 1.7x q8_0's time on the Qwen3-30B-A3B head. On SmolLM2 (its own
// weights, float32) rounding only the head's input to 8 bits per 256 leaves perplexity where it
// was (21.287 -> 21.260 on bench/text/perplexity.txt; 8 bits per row 21.336; 15 bits 21.287).
//
// Packed per panel of 16 output columns, one record per super-block (kQ6Record bytes, whole
// cache lines, so that no 64-byte load straddles two):
//   sc[16 sub-blocks][16 columns] int8 |
//   16 sub-blocks x ( low[2][64]: column c's 4-bit parts of k = 4j..4j+3 at bytes 4c..4c+3 of
//                     low[j / 2], quad j = 0, 2 in the low nibbles, 1, 3 in the high ones |
//                     high[64]: their 2-bit parts, quad j's at bits 2j..2j+1 ) |
//   d[16] float16 | 32 bytes unused
// 6.625 bits a weight (Q6_K's 6.5625 and the padding), laid out so that a quad of k of 16
// columns (64 weights) unpacks to one VPDPBUSD operand of bytes in two to four operations.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "quantize_rows.h"
#include "simd.h"

namespace rankcast {

namespace {
constexpr int64_t kQ6Block = 256;                       // k a super-block
constexpr int64_t kQ6Subs = 16;                         // sub-blocks a super-block
constexpr int64_t kQ6SubBytes = 8 * 16 + 4 * 16;        // low nibbles, then high bits
constexpr int64_t kQ6Scales = 0;                         // sc[16 sub-blocks][16 columns]
constexpr int64_t kQ6Subs0 = kQ6Subs * 16;                // the sub-blocks, from a cache line
constexpr int64_t kQ6D = kQ6Subs0 + kQ6Subs * kQ6SubBytes;  // d[16] float16
constexpr int64_t kQ6Record = kQ6D + 64;  // 3,392 bytes (53 cache lines), 4,096 weights
}  // namespace

#if RANKCAST_SIMD_BITS == 512
namespace {

using namespace gemm;

// A row as the kernel reads it (kp = k, whole super-blocks):
//   a[kp] int8 | s_b per block [kp / 256] float32 | -32 x (sum of a) per 16 k [kp / 16] int32
// The values' offset of 32 is taken off once a sub-block, sum((q - 32) a) = sum(q a) - 32 sum(a),
// instead of from every weight.
struct Q6RowLayout {
  int64_t kp;
  int64_t values() const { return 0; }
  int64_t scales() const { return kp; }
  int64_t offsets() const { return scales() + 4 * (kp / kQ6Block); }
  int64_t bytes() const { return (offsets() + 4 * (kp / 16) + 63) / 64 * 64; }
};

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc + the four-byte dot products of unsigned w and signed a, per int32 lane.
inline __m512i dot4(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
  return dpbusd(acc, w, a);
#else
  const __m512i pairs = _mm512_maddubs_epi16(w, a);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

// Bits 0-3 of `low`, bits 4-5 of `high`, 0 above: one quad's 6-bit values (VPTERNLOGD picks
// low where the mask has a 1, high elsewhere; the AND clears bits 6-7).
inline __m512i merge_quad(__m512i low, __m512i high) {
  const __m512i merged = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), low, high, 0xCA);
  return _mm512_and_si512(merged, _mm512_set1_epi8(0x3F));
}

// The four quads of one sub-block of 16 columns, each 64 bytes of 6-bit values (0..63).
inline void unpack_sub(const uint8_t* sub, __m512i (&w)[4]) {
  const __m512i low0 = _mm512_loadu_si512(sub);
  const __m512i low1 = _mm512_loadu_si512(sub + 64);
  const __m512i high = _mm512_loadu_si512(sub + 128);
  // Shifts in 16-bit lanes move bits across a byte's edge only into the bits merge_quad drops
  // or takes from the other operand.
  w[0] = merge_quad(low0, _mm512_slli_epi16(high, 4));
  w[1] = merge_quad(_mm512_srli_epi16(low0, 4), _mm512_slli_epi16(high, 2));
  w[2] = merge_quad(low1, high);
  w[3] = merge_quad(_mm512_srli_epi16(low1, 4), _mm512_srli_epi16(high, 2));
}

inline float row_float(const int8_t* row, int64_t offset) {
  float v;
  std::memcpy(&v, row + offset, sizeof(v));
  return v;
}

// Sub-block s of one panel's block record for R rows: block[i * stride] += float(sum) * (d * sc),
// sum = sum over the sub-block of (q - 32) * a, exact in int32.
template <int R, int TileRows>
__attribute__((always_inline)) inline void sub_block_q6k(const int8_t* a, int64_t lda,
                                                         const Q6RowLayout& layout,
                                                         const uint8_t* record, int64_t blk,
                                                         int64_t s, __m512 d, bool prefetch,
                                                         __m512* block, int stride) {
  const uint8_t* sub = record + kQ6Subs0 + s * kQ6SubBytes;
  if (prefetch)
    for (int64_t line = 0; line < kQ6SubBytes; line += 64) prefetch_ahead<TileRows>(sub + line);
  __m512i w[4];
  unpack_sub(sub, w);
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + kQ6Scales + 16 * s))));
  const __m512 ds = _mm512_mul_ps(d, sc);
  const int64_t k0 = blk * kQ6Block + s * 16;
  for (int i = 0; i < R; ++i) {
    const int8_t* row = a + i * lda;
    int32_t offset;  // -32 x the sub-block's sum of a
    std::memcpy(&offset, row + layout.offsets() + 4 * (k0 / 16), sizeof(offset));
    __m512i sum = _mm512_set1_epi32(offset);
    for (int q = 0; q < 4; ++q)
      sum = dot4(sum, w[q], _mm512_set1_epi32(four_bytes(row + layout.values() + k0 + 4 * q)));
    block[i * stride] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, block[i * stride]);
  }
}

// R rows x NR panels over every super-block, in the group kernels' tiles (gemm.h): per
// sub-block each panel's four quads are unpacked once and every row's bytes meet them. How the
// stream reads ahead: Q6KTiles, below.
template <int R, int NR, int TileRows>
__attribute__((always_inline)) inline void rows_q6k(const int8_t* a, int64_t lda,
                                                    const uint8_t* b, int64_t panel_elems,
                                                    int64_t blocks, __m512 (&acc)[R][NR],
                                                    bool prefetch, const NextGroup& next,
                                                    int per_step) {
  const Q6RowLayout layout{blocks * kQ6Block};
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* record[NR];
    for (int j = 0; j < NR; ++j) {
      record[j] = b + j * panel_elems + blk * kQ6Record;
      if (prefetch) {
        for (int64_t line = 0; line < kQ6Subs0; line += 64)
          prefetch_ahead<TileRows>(record[j] + line);
        prefetch_ahead<TileRows>(record[j] + kQ6D);
      }
    }
    // Each row and panel sums a block's sub-blocks apart from the row's block scale (one
    // multiply-add a block and row, not one every 16 k): block += float(sum) * (d * sc), then
    // acc += s_b * block. A few rows take the panels' sub-blocks in turn, so that their streams
    // advance together (one row on the Qwen3-30B-A3B head: 0.75x q8_0's time this way, 0.84x a
    // panel's block at a time); more rows take a panel's whole block at a time, which needs a
    // block sum per row only (32 rows: 1.04x q8_0's time; 1.22x with the block scale multiplied
    // every 16 k). Every row's and panel's float operations are the same in either order.
    if constexpr (R <= 2) {
      __m512 d[NR], block[R][NR];
      for (int j = 0; j < NR; ++j) {
        d[j] = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j] + kQ6D)));
        for (int i = 0; i < R; ++i) block[i][j] = _mm512_setzero_ps();
      }
      for (int64_t s = 0; s < kQ6Subs; ++s) {
        if (next.count > 0) prefetch_next<TileRows>(next, blk * kQ6Subs + s, per_step);
        for (int j = 0; j < NR; ++j)
          sub_block_q6k<R, TileRows>(a, lda, layout, record[j], blk, s, d[j], prefetch,
                                     &block[0][j], NR);
      }
      for (int i = 0; i < R; ++i) {
        const __m512 scale = _mm512_set1_ps(row_float(a + i * lda, layout.scales() + 4 * blk));
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(block[i][j], scale, acc[i][j]);
      }
    } else {
      for (int j = 0; j < NR; ++j) {
        const __m512 d = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record[j] + kQ6D)));
        __m512 block[R];
        for (int i = 0; i < R; ++i) block[i] = _mm512_setzero_ps();
        for (int64_t s = 0; s < kQ6Subs; ++s) {
          if (j == 0 && next.count > 0)
            prefetch_next<TileRows>(next, blk * kQ6Subs + s, per_step);
          sub_block_q6k<R, TileRows>(a, lda, layout, record[j], blk, s, d, prefetch, block, 1);
        }
        for (int i = 0; i < R; ++i) {
          const __m512 scale = _mm512_set1_ps(row_float(a + i * lda, layout.scales() + 4 * blk));
          acc[i][j] = _mm512_fmadd_ps(block[i], scale, acc[i][j]);
        }
      }
    }
  }
}

template <int MR, int NR, bool Next, typename Out>
inline void tile_q6k(const int8_t* a, int64_t lda, const uint8_t* b, int64_t panel_elems,
                     int64_t blocks, Out* c, int64_t ldc, const BiasEpilogue& epi, int last_cols,
                     bool prefetch, NextGroup next) {
  const Q6RowLayout layout{blocks * kQ6Block};
  const int per_step = lines_per_step(next, blocks * kQ6Subs);  // spread over the sub-blocks
  const auto rows = [&]<int R>(const int8_t* rows_a, __m512 (&acc)[R][NR], bool ahead,
                               const NextGroup& lead) {
    rows_q6k<R, NR, MR>(rows_a, lda, b, panel_elems, blocks, acc, ahead, lead, per_step);
  };
  const auto scale = [](const int8_t*) { return 1.0f; };  // the block scales are in the sums
  group_sub_tiles<MR, NR>(rows, scale, a, lda, c, ldc, epi, last_cols, prefetch, next);
}

// Unlike the 4- and 8-bit group kernels, a decode's few rows (under gemm.h's kOverlapRows) stream
// each panel 2 KB ahead of themselves rather than fetching the next column group (a batch's tile
// does that, spread over the sub-blocks): the one-row head of Qwen3-30B-A3B (151,936 x 2,048)
// read 18 GB/s the other way, 14.3 ms against q8_0's 15.0, where the same kernel runs at 66 GB/s
// from cache; this way it reads the 258 MB in 11.1 ms (2-core Xeon with AMX).
template <typename Out_>
struct Q6KTiles {
  using In = int8_t;
  using W = uint8_t;
  using Out = Out_;
  using Epi = BiasEpilogue;
  template <int MR, int NR, bool Next>
  static constexpr auto tile() {
    using Fn = typename Tiles<Q6KTiles, Next>::Fn;
    return Fn{&tile_q6k<MR, NR, Next, Out>};
  }
};

// Rows [begin, end) of x quantized into the Q6RowLayout buffer `out` (row stride layout.bytes()).
template <typename T>
void quantize_rows_q6k(const T* x, int64_t ldx, int64_t k, int64_t begin, int64_t end,
                       const Q6RowLayout& layout, int8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    const T* src = x + i * ldx;
    int8_t* row = out + i * layout.bytes();
    for (int64_t blk = 0; blk < layout.kp / kQ6Block; ++blk) {
      const T* block = src + blk * kQ6Block;
      const auto [inverse, scale] = row_scale_of(block, kQ6Block, kRow8Max);
      std::memcpy(row + layout.scales() + 4 * blk, &scale, sizeof(scale));
      for (int64_t c = 0; c < kQ6Block; c += 16) {
        const Ints16 ints = scaled_ints(row_chunk(block, c, kQ6Block), inverse, kRow8Max);
        store_ints(row + layout.values() + blk * kQ6Block + c, ints);
        const int32_t offset = -32 * lane_sum(ints);
        std::memcpy(row + layout.offsets() + 4 * ((blk * kQ6Block + c) / 16), &offset,
                    sizeof(offset));
      }
    }
  }
}

}  // namespace
#endif

bool q6k_supported() {
#if RANKCAST_SIMD_BITS == 512
  return true;
#else
  return false;
#endif
}

namespace {
constexpr int64_t kQ6BlockBytes = 210;  // a GGUF block: ql[128] | qh[64] | sc[16] int8 | d float16

// Value i (0..255) of a block as stored (ggml's dequantize_row_q6_K): in half h = i / 128, for
// l = i % 32 and quarter t = i % 128 / 32, the low (t = 0, 1) or high (t = 2, 3) nibble of
// ql[64h + 32 (t % 2) + l] and bits 2t..2t+1 of qh[32h + l].
inline uint8_t q6k_value(const uint8_t* block, int64_t i) {
  const int64_t h = i / 128, t = i % 128 / 32, l = i % 32;
  const uint8_t low = block[64 * h + 32 * (t % 2) + l];
  const uint8_t high = block[128 + 32 * h + l];
  return static_cast<uint8_t>(((t < 2 ? low : low >> 4) & 0xF) | (((high >> (2 * t)) & 3) << 4));
}
}  // namespace

at::Tensor pack_q6k_weight(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte &&
                  raw.size(1) % kQ6BlockBytes == 0,
              "pack_q6k_weight: raw must be uint8 [out, in / 256 * 210], Q6_K blocks as a GGUF "
              "file stores them");
  const int64_t n = raw.size(0), blocks = raw.size(1) / kQ6BlockBytes, panels = (n + 15) / 16;
  const at::Tensor rc = raw.contiguous();
  // Columns past n get zero scales and values of 32 (weights of zero).
  at::Tensor packed = at::zeros({panels, blocks, kQ6Record}, raw.options());
  const uint8_t* rv = rc.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* record = out + (p * blocks + b) * kQ6Record;
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t row = p * 16 + c;
          const bool real = row < n;
          const uint8_t* block = rv + (row * blocks + b) * kQ6BlockBytes;
          if (real) std::memcpy(record + kQ6D + 2 * c, block + 208, 2);
          for (int64_t s = 0; s < kQ6Subs; ++s) {
            record[kQ6Scales + 16 * s + c] = real ? block[192 + s] : 0;
            uint8_t* sub = record + kQ6Subs0 + s * kQ6SubBytes;
            for (int64_t kk = 0; kk < 16; ++kk) {
              const uint8_t q = real ? q6k_value(block, 16 * s + kk) : 32;
              const int64_t quad = kk / 4, byte = 4 * c + kk % 4;
              sub[64 * (quad / 2) + byte] |= static_cast<uint8_t>((q & 0xF) << (4 * (quad % 2)));
              sub[128 + byte] |= static_cast<uint8_t>(((q >> 4) & 3) << (2 * quad));
            }
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "q6k_linear: x must be [rows, in], unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q6k_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kQ6Record,
              "q6k_linear: weight not packed by pack_q6k_weight");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(1);
  TORCH_CHECK(k == blocks * kQ6Block && packed.size(0) == (n + 15) / 16,
              "q6k_linear: weight packed for another shape");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor bias_f = gemm::bias_as_float(bias, n, "q6k_linear");
#if RANKCAST_SIMD_BITS == 512
  const Q6RowLayout layout{blocks * kQ6Block};
  const auto quantize = [&](const auto* src, int64_t begin, int64_t end, int8_t* out) {
    quantize_rows_q6k(src, x.stride(0), k, begin, end, layout, out);
  };
  gemm::quantized_rows_linear<Q6KTiles>(x, layout.bytes(), quantize, packed.data_ptr<uint8_t>(),
                                        n, blocks, packed.stride(0),
                                        BiasEpilogue{gemm::float_data(bias_f)}, y);
  return y;
#else
  TORCH_CHECK(false, "q6k_linear: this CPU build has no Q6_K kernel (AVX-512 builds only)");
#endif
}

}  // namespace rankcast
