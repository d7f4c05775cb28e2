// Linear layers with llama.cpp's Q6_K weights, served as they are stored: super-blocks of 256 k,
// each with a float16 scale d, sixteen int8 sub-block scales sc (one per 16 k) and 6-bit values q
// (0..63); a weight is w = d * sc * (q - 32).
//
// Why: llama-quantize keeps a model's LM head (and often its embedding) Q6_K under 4-bit
// layers, and at one token the head is most of what a small or sparse model reads (Qwen3-30B-A3B
// cut to 4 layers: 311M of 539M active parameters). Served as q8_0 the head is 8.5 bits a weight;
// as stored it is 6.5625, what llama.cpp reads: ~23 % fewer of the head's bytes.
//
// The products are integer, as in csrc/gemm_q8.cpp: each row is quantized per token to 15 bits
// (a = round(x * 16383 / max|x|), csrc/quantize_rows.h) and kept as int16; a sub-block's sum of
// (q - 32) * a is exact in int32 (at most 16 x 32 x 16383), then, sub-blocks in order,
// acc += float(sum) * (d * sc) (d * sc is exact in float32), and y = acc * scale_x. A row's
// result never depends on the rows beside it or on the threads (batch-invariant).
//
// Packed per panel of 16 output columns, one record per super-block (kQ6Record bytes):
//   d[16] float16 | sc[16 sub-blocks][16 columns] int8 |
//   16 x ( low[8 k-pairs][16 columns]: 4-bit parts of k and k + 1 in one byte |
//          high[4 pairs of k-pairs][16 columns]: 2-bit parts, k-pair 2j in bits 0-3 )
// the same 6.5625 bits a weight as Q6_K, laid out so that one k-pair of 16 columns widens to one
// VPDPWSSD operand of int16 pairs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "quantize_rows.h"
#include "simd.h"

namespace rankcast {

namespace {
constexpr int64_t kQ6Block = 256;                       // k a super-block
constexpr int64_t kQ6Subs = 16;                         // sub-blocks a super-block
constexpr int64_t kQ6SubBytes = 8 * 16 + 4 * 16;        // low nibbles, then high bits
constexpr int64_t kQ6Head = 2 * 16 + kQ6Subs * 16;      // d, then the sub-block scales
constexpr int64_t kQ6Record = kQ6Head + kQ6Subs * kQ6SubBytes;  // 3,360 bytes, 4,096 weights
}  // namespace

#if RANKCAST_SIMD_BITS == 512
namespace {

// A row as the kernel reads it: a[kp] int16 | scale_x float32 | 32 x (sum of a) per 16 k, int32
// (kp = k, whole super-blocks): the values' offset of 32 is taken off once a sub-block,
// sum((q - 32) a) = sum(q a) - 32 sum(a), instead of from every widened weight.
struct Q6RowLayout {
  int64_t kp;
  int64_t scale() const { return 2 * kp; }
  int64_t sums() const { return scale() + 4; }
  int64_t bytes() const { return (sums() + 4 * (kp / 16) + 63) / 64 * 64; }
};

inline int32_t pair_at(const int8_t* row, int64_t k) {  // a[k], a[k + 1] as one int32
  int32_t v;
  std::memcpy(&v, row + 2 * k, sizeof(v));
  return v;
}

inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
  return dpwssd(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}

// One k-pair of 16 columns as int16 pairs (q of k, q of k + 1; 0..63): `low`'s 16 bytes hold the
// 4-bit parts (k in bits 0-3, k + 1 in 4-7), `high` (16 int32 lanes, a byte each) the 2-bit
// parts, this pair's in bits 0-3 (Half 0) or 4-7 (Half 1). Shifted copies put every part in
// place (k's at bits 0-5, k + 1's at 16-21) and one bit-select merges them.
template <int Half>
inline __m512i widen_pair(const uint8_t* low, __m512i high) {
  const __m512i nibbles =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low)));
  // k's bits 0-3 stay; k + 1's (4-7) land at 16-19 in the copy shifted by 12.
  const __m512i lows = _mm512_or_si512(nibbles, _mm512_slli_epi32(nibbles, 12));
  // Half 0: k's 2-bit part (bits 0-1) to 4-5, k + 1's (2-3) to 20-21; Half 1: 4-5 stay, 6-7 to
  // 20-21.
  const __m512i highs =
      Half == 0 ? _mm512_or_si512(_mm512_slli_epi32(high, 4), _mm512_slli_epi32(high, 18))
                : _mm512_or_si512(high, _mm512_slli_epi32(high, 14));
  // lows where the mask is set (bits 0-3, 16-19), highs where it is not, then only bits 0-5
  // and 16-21 kept.
  const __m512i merged =
      _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x000F000F), lows, highs, 0xCA);
  return _mm512_and_si512(merged, _mm512_set1_epi32(0x003F003F));
}

// R rows (row stride `lda` bytes) x one panel over every super-block: float32 sums per row.
template <int R>
void rows_q6k(const int8_t* a, int64_t lda, const Q6RowLayout& layout, const uint8_t* panel,
              int64_t blocks, __m512 (&acc)[R]) {
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* record = panel + b * kQ6Record;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record)));
    for (int64_t s = 0; s < kQ6Subs; ++s) {
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 32 + 16 * s))));
      const __m512 ds = _mm512_mul_ps(d, sc);
      const uint8_t* sub = record + kQ6Head + s * kQ6SubBytes;
      const int64_t k0 = b * kQ6Block + s * 16;
      // Two integer sums a row (even and odd k-pairs): two dependency chains of four
      // VPDPWSSDs instead of one of eight (exact integers: the order does not matter).
      __m512i sum[R], odd[R];
      for (int i = 0; i < R; ++i) {
        int32_t offset;  // 32 x the sub-block's sum of a
        std::memcpy(&offset, a + i * lda + layout.sums() + 4 * (k0 / 16), sizeof(offset));
        sum[i] = _mm512_set1_epi32(-offset);
        odd[i] = _mm512_setzero_si512();
      }
      for (int pp = 0; pp < 4; ++pp) {
        const __m512i high = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + 128 + 16 * pp)));
        const __m512i w0 = widen_pair<0>(sub + 32 * pp, high);
        const __m512i w1 = widen_pair<1>(sub + 32 * pp + 16, high);
        for (int i = 0; i < R; ++i) {
          const int8_t* row = a + i * lda;
          sum[i] = dot_pairs(sum[i], w0, _mm512_set1_epi32(pair_at(row, k0 + 4 * pp)));
          odd[i] = dot_pairs(odd[i], w1, _mm512_set1_epi32(pair_at(row, k0 + 4 * pp + 2)));
        }
      }
      for (int i = 0; i < R; ++i)
        acc[i] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sum[i], odd[i])), ds, acc[i]);
    }
  }
}

template <typename T>
void store_row(T* out, __m512 v, int cols) {
  alignas(64) float values[16];
  _mm512_store_ps(values, v);
  for (int c = 0; c < cols; ++c) out[c] = static_cast<T>(values[c]);
}

template <typename T>
void q6k_linear_impl(const at::Tensor& x, const uint8_t* packed, int64_t n, int64_t blocks,
                     const float* bias, T* y) {
  const int64_t m = x.size(0), k = x.size(1);
  const Q6RowLayout layout{blocks * kQ6Block};
  std::vector<int8_t> rows(static_cast<size_t>(m * layout.bytes()));
  const T* xs = x.data_ptr<T>();
  for (int64_t i = 0; i < m; ++i) {
    const T* src = xs + i * x.stride(0);
    int8_t* row = rows.data() + i * layout.bytes();
    const auto [inverse, scale] = row_scale_of(src, k, kRow15Max);
    auto* values = reinterpret_cast<int16_t*>(row);
    for (int64_t c = 0; c < layout.kp; c += 16) {
      const Ints16 ints = scaled_ints(row_chunk(src, c, k), inverse, kRow15Max);
      store_ints(values + c, ints);
      const int32_t offset = 32 * lane_sum(ints);
      std::memcpy(row + layout.sums() + 4 * (c / 16), &offset, sizeof(offset));
    }
    std::memcpy(row + layout.scale(), &scale, sizeof(scale));
  }
  const int64_t panels = (n + 15) / 16, lda = layout.bytes();
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = packed + p * blocks * kQ6Record;
      const int cols = static_cast<int>(std::min<int64_t>(16, n - p * 16));
      const __mmask16 lanes = static_cast<__mmask16>((1u << cols) - 1);
      const __m512 b =
          bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, bias + p * 16);
      for (int64_t i = 0; i < m; i += 4) {
        const int8_t* a = rows.data() + i * lda;
        __m512 acc[4];
        const int r = static_cast<int>(std::min<int64_t>(4, m - i));
        const auto run = [&]<int R>() {
          rows_q6k<R>(a, lda, layout, panel, blocks, reinterpret_cast<__m512(&)[R]>(acc));
        };
        switch (r) {
          case 1: run.template operator()<1>(); break;
          case 2: run.template operator()<2>(); break;
          case 3: run.template operator()<3>(); break;
          default: run.template operator()<4>(); break;
        }
        for (int j = 0; j < r; ++j) {
          float scale;
          std::memcpy(&scale, a + j * lda + layout.scale(), sizeof(scale));
          const __m512 v = _mm512_add_ps(_mm512_mul_ps(acc[j], _mm512_set1_ps(scale)), b);
          store_row(y + (i + j) * n + p * 16, v, cols);
        }
      }
    }
  });
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

at::Tensor pack_q6k_weight(const at::Tensor& d, const at::Tensor& sc, const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte,
              "pack_q6k_weight: q must be uint8 [out, in] (the 6-bit values, 0..63)");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % kQ6Block == 0, "pack_q6k_weight: in (", k, ") must be whole blocks of 256");
  const int64_t blocks = k / kQ6Block, panels = (n + 15) / 16;
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.sizes() == at::IntArrayRef({n, blocks}),
              "pack_q6k_weight: d must be float16 [out, in / 256]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.sizes() == at::IntArrayRef({n, k / 16}),
              "pack_q6k_weight: sc must be int8 [out, in / 16]");
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), scc = sc.contiguous();
  // Columns past n get zero scales and values of 32 (weights of zero).
  at::Tensor packed = at::zeros({panels, blocks, kQ6Record}, q.options());
  const uint8_t* qv = qc.data_ptr<uint8_t>();
  const uint16_t* dv = static_cast<const uint16_t*>(dc.data_ptr());
  const int8_t* sv = scc.data_ptr<int8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* record = out + (p * blocks + b) * kQ6Record;
        for (int64_t c = 0; c < 16; ++c) {
          const int64_t row = p * 16 + c;
          const bool real = row < n;
          if (real) std::memcpy(record + 2 * c, dv + row * blocks + b, 2);
          for (int64_t s = 0; s < kQ6Subs; ++s) {
            record[32 + 16 * s + c] =
                real ? static_cast<uint8_t>(sv[row * (k / 16) + b * kQ6Subs + s]) : 0;
            uint8_t* sub = record + kQ6Head + s * kQ6SubBytes;
            const uint8_t* src = qv + row * k + b * kQ6Block + s * 16;
            for (int64_t pair = 0; pair < 8; ++pair) {
              const uint8_t q0 = real ? src[2 * pair] : 32, q1 = real ? src[2 * pair + 1] : 32;
              sub[16 * pair + c] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
              const int shift = 4 * (pair % 2);
              sub[128 + 16 * (pair / 2) + c] |=
                  static_cast<uint8_t>((((q0 >> 4) & 3) | (((q1 >> 4) & 3) << 2)) << shift);
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
  const float* bias_p = gemm::float_data(bias_f);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    q6k_linear_impl<float>(x, w, n, blocks, bias_p, y.data_ptr<float>());
  } else {
    q6k_linear_impl<bf16>(x, w, n, blocks, bias_p, y.data_ptr<bf16>());
  }
  return y;
#else
  TORCH_CHECK(false, "q6k_linear: this CPU build has no Q6_K kernel (AVX-512 builds only)");
#endif
}

}  // namespace rankcast
