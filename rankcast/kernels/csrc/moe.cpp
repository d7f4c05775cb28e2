// A mixture-of-experts block in one call: route each token, gather each chosen expert's tokens,
// run its packed gate_up and down projections on them (whatever format they are stored in:
// csrc/projection.h), and add its weighted rows into their tokens' outputs.
//
// Why: the module path looped over the chosen experts in Python, ~8 operator calls an expert;
// at one token with top-8 routing that is ~64 dispatches a layer from Python, more time than the
// experts' matmuls on a 2-core CPU. Here the loop, the grouping and the combine are C++, and the
// decoder stack (csrc/decoder_stack.cpp) runs MoE layers without returning to Python at all.
//
// Batch invariance, as the module path keeps it: a token's router logits and each expert's rows
// for it come from the row-invariant kernels; its output starts from zero and adds its experts'
// weighted rows in expert index order, each product rounded to the activations' dtype before the
// add, as `rows = y * w; out.index_add_(tokens, rows)` did. Which other tokens chose an expert
// changes nothing in a token's row. At one token per expert only that expert's weights are read:
// the bytes a token costs are its active experts', not the model's.
#include "moe.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cstring>

namespace rankcast {
namespace {

// out[t] += rows[i] * weights[i] for each entry i (token t = tokens[i]), in entry order, each
// product rounded to scalar_t before its add. No FMA contraction: the module path multiplied
// and added in two operators, so a fused multiply-add would change float32's last bits.
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"), noinline)) void add_weighted_rows(
    scalar_t* out, const scalar_t* rows, const scalar_t* weights, const int64_t* tokens,
    int64_t count, int64_t width) {
  for (int64_t i = 0; i < count; ++i) {
    scalar_t* o = out + tokens[i] * width;
    const scalar_t* r = rows + i * width;
    const scalar_t w = weights[i];
    for (int64_t c = 0; c < width; ++c) {
      const scalar_t product = r[c] * w;
      o[c] = o[c] + product;
    }
  }
}

}  // namespace

MoeExperts::MoeExperts(int64_t num_experts, int64_t first, int64_t top_k, bool norm_topk_prob,
                       at::Tensor routed, int64_t tiles_from)
    : num_experts_(num_experts), first_(first), top_k_(top_k), norm_topk_prob_(norm_topk_prob),
      routed_(std::move(routed)), tiles_from_(tiles_from) {
  TORCH_CHECK(num_experts > 0 && top_k > 0 && top_k <= num_experts,
              "MoeExperts: top_k must be 1..num_experts");
  TORCH_CHECK(first >= 0 && first < num_experts, "MoeExperts: first expert out of range");
  TORCH_CHECK(routed_.scalar_type() == at::kLong && routed_.numel() == num_experts + 1 &&
                  routed_.is_contiguous(),
              "MoeExperts: routed is a contiguous int64 count per expert, then the tokens'");
}

void MoeExperts::set_router(at::Tensor packed, c10::optional<at::Tensor> scales,
                            c10::optional<at::Tensor> tiles) {
  router_ = Projection{std::move(packed), std::move(scales), {}, num_experts_, {}, std::move(tiles),
                       tiles_from_};
}

void MoeExperts::add_expert(at::Tensor gate_up, c10::optional<at::Tensor> gate_up_scales,
                            int64_t gate_up_n, c10::optional<at::Tensor> gate_up_tiles,
                            at::Tensor down, c10::optional<at::Tensor> down_scales,
                            int64_t down_n, c10::optional<at::Tensor> down_tiles) {
  TORCH_CHECK(first_ + num_held() < num_experts_, "MoeExperts.add_expert: every expert is held");
  gate_up_.push_back({std::move(gate_up), std::move(gate_up_scales), {}, gate_up_n, {},
                      std::move(gate_up_tiles), tiles_from_});
  down_.push_back({std::move(down), std::move(down_scales), {}, down_n, {}, std::move(down_tiles),
                   tiles_from_});
}

std::tuple<at::Tensor, at::Tensor> MoeExperts::route(const at::Tensor& hidden) const {
  RECORD_FUNCTION("rankcast::moe_route", std::vector<c10::IValue>());
  // As the module path's `route`: the softmax in float32, its top k, renormalised.
  TORCH_CHECK(router_.has_value(), "MoeExperts.route: no router set");
  at::Tensor logits = (*router_)(hidden);
  at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, chosen] = at::topk(probs, top_k_, -1);
  if (norm_topk_prob_) weights = weights / weights.sum(-1, true);
  return {chosen, weights.to(logits.scalar_type())};
}

at::Tensor MoeExperts::forward(const at::Tensor& hidden) {
  auto [chosen, weights] = route(hidden);
  return run(hidden, chosen, weights);
}

at::Tensor MoeExperts::run(const at::Tensor& hidden_in, const at::Tensor& chosen_in,
                           const at::Tensor& weights_in) {
  RECORD_FUNCTION("rankcast::moe_experts", std::vector<c10::IValue>());
  const at::Tensor hidden = hidden_in.contiguous();
  const at::Tensor chosen = chosen_in.contiguous();
  const at::Tensor weights = weights_in.contiguous();
  TORCH_CHECK(hidden.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == hidden.size(0) &&
                  chosen.size(1) == top_k_ && chosen.scalar_type() == at::kLong,
              "MoeExperts.run: hidden [tokens, hidden], chosen int64 [tokens, top_k]");
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == hidden.scalar_type(),
              "MoeExperts.run: weights like chosen, in the activations' dtype");
  const int64_t tokens = hidden.size(0), width = hidden.size(1), held = num_held();
  // Each held expert's entries in token order: token t's choice s is entry t * top_k + s.
  std::vector<std::vector<int64_t>> entries(held);
  const int64_t* picks = chosen.data_ptr<int64_t>();
  for (int64_t e = 0; e < tokens * top_k_; ++e) {
    const int64_t local = picks[e] - first_;
    TORCH_CHECK(picks[e] >= 0 && picks[e] < num_experts_, "MoeExperts.run: no expert ", picks[e]);
    if (local >= 0 && local < held) entries[local].push_back(e);
  }
  int64_t* routed = routed_.data_ptr<int64_t>();
  for (int64_t local = 0; local < held; ++local) {
    routed[first_ + local] += static_cast<int64_t>(entries[local].size());
  }
  routed[num_experts_] += tokens;
  at::Tensor out = at::zeros_like(hidden);
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  for (int64_t local = 0; local < held; ++local) {
    const std::vector<int64_t>& mine = entries[local];
    const int64_t count = static_cast<int64_t>(mine.size());
    if (count == 0) continue;
    at::Tensor token_index = at::empty({count}, long_options);
    int64_t* token_of = token_index.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) token_of[i] = mine[i] / top_k_;
    // Every token chose it: the rows are `hidden` itself, in order (a token takes an expert
    // at most once, and the entries are in token order).
    at::Tensor x = count == tokens ? hidden : hidden.index_select(0, token_index);
    at::Tensor rows = down_[local](silu_and_mul(gate_up_[local](x))).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "moe_combine",
                                    [&] {
                                      std::vector<scalar_t> w(count);
                                      const scalar_t* all = weights.data_ptr<scalar_t>();
                                      for (int64_t i = 0; i < count; ++i) w[i] = all[mine[i]];
                                      add_weighted_rows<scalar_t>(
                                          out.data_ptr<scalar_t>(), rows.data_ptr<scalar_t>(),
                                          w.data(), token_of, count, width);
                                    });
  }
  return out;
}

void register_moe_experts(torch::Library& m) {
  m.class_<MoeExperts>("MoeExperts")
      .def(torch::init<int64_t, int64_t, int64_t, bool, at::Tensor, int64_t>())
      .def("set_router", &MoeExperts::set_router)
      .def("add_expert", &MoeExperts::add_expert)
      .def("num_held", &MoeExperts::num_held)
      .def("route", &MoeExperts::route)
      .def("forward", &MoeExperts::forward)
      .def("run", &MoeExperts::run);
}

}  // namespace rankcast
