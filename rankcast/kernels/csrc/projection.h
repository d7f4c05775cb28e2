// One linear layer's packed weight as the C++ callers (csrc/decoder_stack.cpp, csrc/moe.cpp)
// hold it: the very tensors the Python modules own, dispatched to the kernel their layout
// names, so a projection run here gives the bits the module's `ops.packed_linear` gives.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>

#include <string>

#include <vector>

#include "kernels.h"

namespace rankcast {

// A projection's adapter slots as csrc/lora.cpp reads them: one A and one B per sub-projection
// (q, k, v of a fused QKV, ...), each sub's column offset, the slots' rank. Empty: no adapters.
struct LoRASlots {
  std::vector<at::Tensor> a, b;
  std::vector<int64_t> offsets;
  int64_t rank = 0;

  void add_to(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& token_slots) const {
    if (a.empty() || !token_slots.has_value()) return;
    RECORD_FUNCTION("rankcast::lora_add", std::vector<c10::IValue>());
    lora_add(out, x, *token_slots, a, b, offsets, rank);
  }
};

// oneDNN's prepacked matmul, as the modules' `ops.packed_linear` calls it for a weight packed
// for "onednn" (the `rows` path's tiles, rankcast/model/linear_kernels.py). Called boxed: only
// steps of many rows take it, where a few microseconds of dispatch do not show.
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One projection: a weight packed by csrc/gemm.cpp (float, or int8 with its scales), by
// csrc/gemm_w8a8.cpp (bytes [panels, steps, 16, group], with its scales), by csrc/gemm_q4.cpp
// (bytes [panels, groups, record], scales inside) or by csrc/gemm_q8.cpp (int8 [panels, groups,
// record], scales inside).
struct Projection {
  at::Tensor packed;
  c10::optional<at::Tensor> scales;  // int8 weights' per-channel scales
  c10::optional<at::Tensor> bias;
  int64_t n;
  LoRASlots lora;
  // The same weight packed for oneDNN, taken by calls of `tiles_from` rows or more (the `rows`
  // path, as the module's `PackedLinearMixin.matmul` takes it), or none.
  c10::optional<at::Tensor> tiles = {};
  int64_t tiles_from = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (tiles.has_value() && x.size(0) >= tiles_from) return onednn_linear(x, *tiles, bias);
    if (packed.scalar_type() == at::kByte) {
      if (packed.dim() == 3) return q4_linear(x, packed, n, bias);
      return w8a8_linear(x, packed, n, *scales, bias);
    }
    if (packed.scalar_type() == at::kChar && !scales.has_value()) return q8_linear(x, packed, n, bias);
    return packed_linear(x, packed, n, bias, scales);
  }
};

}  // namespace rankcast
