// Fused element-wise steps of a decoder layer: (residual add +) RMSNorm, and SiLU- or
// GELU(tanh)-and-multiply.
//
// Each replaces three to five separate torch ops (and their temporaries) with one pass over the
// rows. Rounding follows the Hugging Face reference in reduced precision: Llama's normalised row
// is rounded to the activation dtype before its weight (of that dtype) multiplies it; Gemma's
// norm weight is float32 (1 + w, formed at load) and scales the row before it is rounded, as
// Gemma's reference does; the activation of the gate is rounded before it multiplies `up`. So
// bfloat16 results match transformers' own bfloat16 model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>

#include "kernels.h"
#include "simd.h"

namespace rankcast {
namespace {

// Rows per parallel chunk: small batches (a decode step) run on one thread, where waking the
// others would cost more than the work.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

template <typename T>
Vec16 round_trip(Vec16 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[16];
    store16(tmp, x);
    return load16(tmp);
  }
}

// W, the weight's type: T (Llama: round the normalised row, then scale) or float with T
// bfloat16 (Gemma: scale in float32, then round once).
template <typename T, typename W = T>
void rms_norm_impl(T* out, T* x, const T* residual_in, T* residual_out, const W* weight,
                   int64_t rows, int64_t width, int64_t x_stride, float eps) {
  constexpr bool kScaleInFloat = std::is_same_v<W, float>;
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * x_stride;
      T* h = residual_out ? residual_out + r * width : nullptr;
      Vec16 squares = zero16();
      for (int64_t i = 0; i < width; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, width - i));
        Vec16 v = load16(src + i, n);
        if (residual_in) {
          // The residual stream is kept in the activation dtype, as the reference keeps it.
          v = round_trip<T>(v + load16(residual_in + r * width + i, n));
          store16(h + i, v, n);
        }
        squares = fma(v, v, squares);
      }
      const float inv = 1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(width) + eps);
      const T* normed_src = residual_in ? h : src;
      T* dst = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, width - i));
        Vec16 normed = load16(normed_src + i, n) * splat(inv);
        if constexpr (!kScaleInFloat) normed = round_trip<T>(normed);
        store16(dst + i, normed * load16(weight + i, n), n);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(T* out, const T* x, int64_t rows, int64_t width, int64_t x_stride) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + width;
      T* dst = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, width - i));
        const Vec16 g = load16(gate + i, n);
        const Vec16 silu = round_trip<T>(g / (splat(1.0f) + exp16(zero16() - g)));
        store16(dst + i, silu * load16(up + i, n), n);
      }
    }
  });
}

// GELU's tanh approximation (transformers' gelu_pytorch_tanh) of the gate, rounded, times
// `up`: Gemma's GeGLU. 0.5 (1 + tanh(u)) is the logistic function of 2u, so
// gelu(g) = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): SiLU's shape, one exp.
template <typename T>
void gelu_tanh_and_mul_impl(T* out, const T* x, int64_t rows, int64_t width, int64_t x_stride) {
  constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + width;
      T* dst = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, width - i));
        const Vec16 g = load16(gate + i, n);
        const Vec16 two_u = splat(kTwoSqrtTwoOverPi) * fma(splat(0.044715f) * g, g * g, g);
        const Vec16 gelu = round_trip<T>(g / (splat(1.0f) + exp16(zero16() - two_u)));
        store16(dst + i, gelu * load16(up + i, n), n);
      }
    }
  });
}

// First index of `target` in row[0, width), or of the first NaN when `target` is NaN.
template <typename T>
int64_t first_index(const T* row, int64_t width, float target) {
  const bool nan = target != target;
  int64_t i = 0;
#if RANKCAST_SIMD_BITS == 512
  const __m512 t = _mm512_set1_ps(target);
  for (; i + 16 <= width; i += 16) {
    const __m512 v = load16(row + i).v;
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif RANKCAST_SIMD_BITS == 256
  const __m256 t = _mm256_set1_ps(target);
  for (; i + 16 <= width; i += 16) {
    const Vec16 v = load16(row + i);
    const __m256 lo = nan ? _mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q) : _mm256_cmp_ps(v.lo, t, _CMP_EQ_OQ);
    const __m256 hi = nan ? _mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q) : _mm256_cmp_ps(v.hi, t, _CMP_EQ_OQ);
    const unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(lo)) |
                         (static_cast<unsigned>(_mm256_movemask_ps(hi)) << 8);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < width; ++i) {
    const float v = static_cast<float>(row[i]);
    if (nan ? v != v : v == target) return i;
  }
  return 0;
}

template <typename T>
void argmax_impl(const T* x, int64_t rows, int64_t width, int64_t stride, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      // One pass finds the largest value (NaN wins, as in torch.argmax); a second its first index.
      float top = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if RANKCAST_SIMD_BITS == 512
      __m512 best = _mm512_set1_ps(top);
      __mmask16 unordered = 0;
      for (; i + 16 <= width; i += 16) {
        const __m512 v = load16(row + i).v;
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
      }
      top = _mm512_reduce_max_ps(best);
      nan = unordered != 0;
#elif RANKCAST_SIMD_BITS == 256
      Vec16 best = splat(top);
      __m256 unordered = _mm256_setzero_ps();
      for (; i + 16 <= width; i += 16) {
        const Vec16 v = load16(row + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v.lo, v.hi, _CMP_UNORD_Q));
        best = max(best, v);
      }
      top = reduce_max(best);
      nan = _mm256_movemask_ps(unordered) != 0;
#endif
      for (; i < width; ++i) {
        const float v = static_cast<float>(row[i]);
        nan |= v != v;
        top = std::max(top, v);
      }
      out[r] = first_index(row, width, nan ? std::numeric_limits<float>::quiet_NaN() : top);
    }
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, " must be [rows, width] with unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only, got ", x.scalar_type());
}

// A norm's weight: [width], contiguous, of the input's dtype or (Gemma's 1 + w) float32.
void check_norm_weight(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              what, ": weight must be contiguous, [width], and of the input's dtype or float32");
}

// A float32 weight on bfloat16 rows scales before rounding (Gemma); on float32 rows the two
// orders are the same arithmetic.
bool scales_in_float(const at::Tensor& x, const at::Tensor& weight) {
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm input");
  check_norm_weight(x, weight, "rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (scales_in_float(x, weight)) {
    rms_norm_impl<bf16, float>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), nullptr, nullptr,
                               weight.data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                               static_cast<float>(eps));
    return out;
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       rms_norm_impl<float>(out.data_ptr<float>(), x.data_ptr<float>(), nullptr,
                                            nullptr, weight.data_ptr<float>(), x.size(0),
                                            x.size(1), x.stride(0), static_cast<float>(eps));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       rms_norm_impl<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), nullptr,
                                           nullptr, weight.data_ptr<bf16>(), x.size(0), x.size(1),
                                           x.stride(0), static_cast<float>(eps));
                     }));
  return out;
}

// residual <- x + residual (in place); returns rms_norm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "add_rms_norm input");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and shaped like the input");
  check_norm_weight(x, weight, "add_rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (scales_in_float(x, weight)) {
    rms_norm_impl<bf16, float>(out.data_ptr<bf16>(), x.data_ptr<bf16>(),
                               residual.data_ptr<bf16>(), residual.data_ptr<bf16>(),
                               weight.data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                               static_cast<float>(eps));
    return out;
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       rms_norm_impl<float>(out.data_ptr<float>(), x.data_ptr<float>(),
                                            residual.data_ptr<float>(), residual.data_ptr<float>(),
                                            weight.data_ptr<float>(), x.size(0), x.size(1),
                                            x.stride(0), static_cast<float>(eps));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       rms_norm_impl<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(),
                                           residual.data_ptr<bf16>(), residual.data_ptr<bf16>(),
                                           weight.data_ptr<bf16>(), x.size(0), x.size(1),
                                           x.stride(0), static_cast<float>(eps));
                     }));
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul input");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the width must be even (gate | up)");
  const int64_t width = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "silu_and_mul",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       silu_and_mul_impl<float>(out.data_ptr<float>(), x.data_ptr<float>(),
                                                x.size(0), width, x.stride(0));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       silu_and_mul_impl<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), x.size(0),
                                               width, x.stride(0));
                     }));
  return out;
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  check_rows(x, "gelu_tanh_and_mul input");
  TORCH_CHECK(x.size(1) % 2 == 0, "gelu_tanh_and_mul: the width must be even (gate | up)");
  const int64_t width = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "gelu_tanh_and_mul",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       gelu_tanh_and_mul_impl<float>(out.data_ptr<float>(), x.data_ptr<float>(),
                                                     x.size(0), width, x.stride(0));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       gelu_tanh_and_mul_impl<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(),
                                                    x.size(0), width, x.stride(0));
                     }));
  return out;
}

// Index of each row's largest value (the first, on ties, as torch.argmax), without first
// converting a bfloat16 row of logits to float32: greedy sampling reads the logits once.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows input");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(width > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* idx = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "argmax_rows", AT_DISPATCH_CASE(at::kFloat, [&] {
    argmax_impl(x.data_ptr<float>(), rows, width, x.stride(0), idx);
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    argmax_impl(x.data_ptr<bf16>(), rows, width, x.stride(0), idx);
  }));
  return out;
}

}  // namespace rankcast
