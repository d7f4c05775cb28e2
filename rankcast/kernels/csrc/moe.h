// A mixture-of-experts block's experts and router as one C++ object (csrc/moe.cpp), shared by
// the module path (rankcast/model/moe.py calls it) and the decoder stack (a layer holds it).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <tuple>
#include <vector>

#include "projection.h"

namespace rankcast {

class MoeExperts : public torch::CustomClassHolder {
 public:
  // `num_experts` in the model, this rank's from `first` on (added by `add_expert` in order),
  // each token's `top_k`, renormalised or not. `routed`: int64 [num_experts + 1], the block's
  // running count of tokens routed to each of this rank's experts and, last, of the tokens
  // the block ran, added to in place. Projections with oneDNN tiles take them for calls of
  // `tiles_from` rows or more.
  MoeExperts(int64_t num_experts, int64_t first, int64_t top_k, bool norm_topk_prob,
             at::Tensor routed, int64_t tiles_from);

  // The router's packed weight (float: the router is never quantized) and its tiles, if any.
  void set_router(at::Tensor packed, c10::optional<at::Tensor> scales,
                  c10::optional<at::Tensor> tiles);

  void add_expert(at::Tensor gate_up, c10::optional<at::Tensor> gate_up_scales, int64_t gate_up_n,
                  c10::optional<at::Tensor> gate_up_tiles, at::Tensor down,
                  c10::optional<at::Tensor> down_scales, int64_t down_n,
                  c10::optional<at::Tensor> down_tiles);

  int64_t num_held() const { return static_cast<int64_t>(gate_up_.size()); }

  // Each token's experts, most likely first, and their weights in the activations' dtype.
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& hidden) const;

  // The block on `hidden` [tokens, hidden]: route, count, and this rank's experts' weighted
  // outputs summed per token from zero in expert order (un-reduced across ranks).
  at::Tensor forward(const at::Tensor& hidden);

  // The experts alone, on a routing the caller made (`chosen` int64 [tokens, top_k], `weights`
  // in the activations' dtype), counted as `forward` counts.
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& chosen, const at::Tensor& weights);

 private:
  int64_t num_experts_, first_, top_k_;
  bool norm_topk_prob_;
  at::Tensor routed_;
  int64_t tiles_from_;
  c10::optional<Projection> router_;
  std::vector<Projection> gate_up_, down_;
};

}  // namespace rankcast
