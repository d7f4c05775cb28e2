// A pipeline stage's Llama decoder layers run back to back in C++, every kernel chained without
// returning to Python (prompts, decodes and chunks alike: the paged kernel takes them all).
//
// Why: once the kernels are fused, what is left of a single-stream decode step on a 2-core CPU
// is largely the Python between them: module calls and ~10 operator dispatches per layer, about
// 50 us a layer. Here one call runs every layer of the stage. It holds references to the very
// tensors the Python modules own (packed weights, norms, caches, adapter slots), so nothing is
// copied and the module path stays the reference; the model uses this only where nothing it
// cannot do is needed (one tensor-parallel rank, rankcast's packed linears, adapters through
// csrc/lora.cpp).
//
// The Llama family's switches ride along per layer (`set_attention`): Qwen3's RMSNorm of each q
// and k head before RoPE, by the same rms_norm kernel over the heads gathered into rows, as the
// module path does; SmolLM3's layers without RoPE, whose tokens all read row 0 of the table
// (cos 1, sin 0: q and k left as they are, the cache still written by the same kernel); a
// layer's own RoPE table and KV-cache group (Gemma 3's sliding-window layers: another RoPE base,
// and their caches in a group of their own, addressed by its slots and block tables).
//
// Mixture-of-experts layers (`set_moe`): the block's MoeExperts object (csrc/moe.cpp), the one
// the module path calls, runs in place of the dense MLP's two projections.
//
// Gemma 3's block (`set_block`): four norms, the attention's and the MLP's outputs normalised
// before they join the residual stream, and GeGLU instead of SwiGLU. Its norms' weights are
// float32 (1 + w); the norm kernels scale by them before rounding, as the module path's do.
//
// Adapters: each projection may hold its LoRA slots (`set_lora`), the very tensors the model's
// LoRALinear writes adapters into, and a step that names a slot per token adds each token's delta
// right after the projection, as the module path does. Steps with adapters used to leave the stack
// for the modules; on a 2-core Sapphire Rapids that Python cost a batch-32 step ~3.6 ms of ~25.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>

#include <vector>

#include "kernels.h"
#include "moe.h"
#include "projection.h"

namespace rankcast {
namespace {

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;
  at::Tensor key_cache, value_cache;
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head norms' weights [head_dim], or none
  bool rotates = true;
  int64_t window = 0;  // sliding window (keys this many positions back and nearer), 0: none
  c10::optional<at::Tensor> cos_sin;  // this layer's RoPE table, or none: the stack's
  int64_t kv_group = 0;  // 0: the step's slots and block tables; 1: the window group's
  // Gemma 3's sandwich: the norms before and after the MLP (post_norm then normalises the
  // attention's output alone), or none: Llama's two norms.
  c10::optional<at::Tensor> pre_ff_norm, post_ff_norm;
  bool gelu_tanh = false;  // GeGLU (GELU, tanh approximation) instead of SwiGLU
  // An 8-bit cache's per-token scales (csrc/attention.cpp), or none.
  c10::optional<at::Tensor> key_scale, value_scale;
  // A mixture of experts in place of gate_up and down (csrc/moe.cpp), or none.
  c10::intrusive_ptr<MoeExperts> moe;
};

// In place: RMSNorm of `count` heads of `qkv` [tokens, width] from head `first` on, each over its
// head_dim values. Split by head the rows are not evenly strided, so they are gathered into
// [tokens * count, head_dim] rows (ops.head_rms_norm_ in Python does the same, for equal bits).
void head_rms_norm_(at::Tensor& qkv, int64_t first, int64_t count, int64_t head_dim,
                    const at::Tensor& weight, double eps) {
  at::Tensor part = qkv.narrow(1, first * head_dim, count * head_dim);
  at::Tensor rows = part.reshape({-1, head_dim});
  part.copy_(rms_norm(rows, weight, eps).view({part.size(0), count * head_dim}));
}

}  // namespace

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
               at::Tensor cos_sin)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        cos_sin_(std::move(cos_sin)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv,
                 c10::optional<at::Tensor> qkv_bias, int64_t qkv_n, at::Tensor o,
                 c10::optional<at::Tensor> o_bias, int64_t o_n, at::Tensor gate_up,
                 int64_t gate_up_n, at::Tensor down, int64_t down_n, at::Tensor key_cache,
                 at::Tensor value_cache, c10::optional<at::Tensor> qkv_scales,
                 c10::optional<at::Tensor> o_scales, c10::optional<at::Tensor> gate_up_scales,
                 c10::optional<at::Tensor> down_scales) {
    layers_.push_back({std::move(input_norm), std::move(post_norm),
                       {std::move(qkv), std::move(qkv_scales), std::move(qkv_bias), qkv_n},
                       {std::move(o), std::move(o_scales), std::move(o_bias), o_n},
                       {std::move(gate_up), std::move(gate_up_scales), {}, gate_up_n},
                       {std::move(down), std::move(down_scales), {}, down_n},
                       std::move(key_cache), std::move(value_cache)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Layer `layer`'s attention switches: the weights of its per-head q and k norms (both or
  // neither), whether it rotates q and k, and its sliding window (0: none).
  void set_attention(int64_t layer, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, bool rotates, int64_t window) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_attention: no layer ", layer);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "set_attention: both norms or neither");
    if (q_norm.has_value()) {
      TORCH_CHECK(q_norm->numel() == head_dim_ && k_norm->numel() == head_dim_,
                  "set_attention: the norms' weights are one head wide");
    }
    Layer& l = layers_[layer];
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.rotates = rotates;
    l.window = window;
  }

  // Layer `layer`'s own RoPE table (none: the stack's) and KV-cache group (0, or 1: the
  // sliding-window layers' group, whose slots and block tables `forward` takes apart).
  void set_rope_and_group(int64_t layer, c10::optional<at::Tensor> cos_sin, int64_t kv_group) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_rope_and_group: no layer ", layer);
    TORCH_CHECK(kv_group == 0 || kv_group == 1, "set_rope_and_group: group 0 or 1, not ",
                kv_group);
    Layer& l = layers_[layer];
    l.cos_sin = std::move(cos_sin);
    l.kv_group = kv_group;
  }

  // Layer `layer`'s 8-bit cache scales (`--kv-cache-dtype` int8 / fp8): float32 [num_blocks,
  // kv_heads, block_size] each, the tensors the modules' attention writes and reads.
  void set_kv_scales(int64_t layer, at::Tensor key_scale, at::Tensor value_scale) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_kv_scales: no layer ", layer);
    Layer& l = layers_[layer];
    l.key_scale = std::move(key_scale);
    l.value_scale = std::move(value_scale);
  }

  // Layer `layer`'s block shape: Gemma 3's norms before and after the MLP (both or neither)
  // and its GeGLU activation.
  void set_block(int64_t layer, c10::optional<at::Tensor> pre_ff_norm,
                 c10::optional<at::Tensor> post_ff_norm, bool gelu_tanh) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_block: no layer ", layer);
    TORCH_CHECK(pre_ff_norm.has_value() == post_ff_norm.has_value(),
                "set_block: both MLP norms or neither");
    Layer& l = layers_[layer];
    l.pre_ff_norm = std::move(pre_ff_norm);
    l.post_ff_norm = std::move(post_ff_norm);
    l.gelu_tanh = gelu_tanh;
  }

  // Layer `layer`'s MLP is a mixture of experts: `moe` (the very object the module calls) runs
  // in place of its gate_up and down projections.
  void set_moe(int64_t layer, c10::intrusive_ptr<MoeExperts> moe) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_moe: no layer ", layer);
    layers_[layer].moe = std::move(moe);
  }

  // Adapter slots for projection `projection` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`:
  // views of the tensors adapters are written into, so a slot written later is seen here. The
  // row-parallel projections' bias would go before the delta here and after it in the modules:
  // the model does not hand slots for a projection with a bias that adds after its delta.
  void set_lora(int64_t layer, int64_t projection, std::vector<at::Tensor> a,
                std::vector<at::Tensor> b, std::vector<int64_t> offsets, int64_t rank) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "set_lora: no layer ", layer);
    TORCH_CHECK(projection >= 0 && projection < 4, "set_lora: projection is 0-3, not ", projection);
    TORCH_CHECK(a.size() == b.size() && a.size() == offsets.size() && rank >= 1,
                "set_lora: one A, one B and one offset per sub-projection, a positive rank");
    Layer& l = layers_[layer];
    Projection* target[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    target[projection]->lora = {std::move(a), std::move(b), std::move(offsets), rank};
  }

  // (hidden, residual) in, (hidden, residual) out, as the module path passes them between
  // layers; `residual` is undefined before the first layer of the first stage. `token_slots`:
  // each token's adapter slot (-1 none), or none when no token uses an adapter this step.
  // `window_slot_mapping` and `window_block_tables`: the sliding-window group's, where a layer
  // has its cache there.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, c10::optional<at::Tensor> residual,
                                            at::Tensor positions, at::Tensor slot_mapping,
                                            at::Tensor block_tables, at::Tensor seq_lens,
                                            at::Tensor query_start,
                                            c10::optional<at::Tensor> token_slots,
                                            c10::optional<at::Tensor> window_slot_mapping,
                                            c10::optional<at::Tensor> window_block_tables) {
    const int64_t tokens = hidden.size(0);
    at::Tensor res = residual.has_value() ? *residual : at::Tensor();
    at::Tensor unrotated;  // every token at position 0, for layers without RoPE (made once)
    // Each kernel is a named range for torch.profiler (a thread-local check when not profiling),
    // so a profile of a fused step still shows where its time goes.
    for (Layer& layer : layers_) {
      at::Tensor x;
      {
        RECORD_FUNCTION("rankcast::add_rms_norm", std::vector<c10::IValue>());
        if (!res.defined()) {
          res = hidden;
          x = rms_norm(hidden, layer.input_norm, eps_);
        } else {
          x = add_rms_norm(hidden, res, layer.input_norm, eps_);
        }
      }
      at::Tensor qkv;
      {
        RECORD_FUNCTION("rankcast::packed_linear[qkv]", std::vector<c10::IValue>());
        qkv = layer.qkv(x);
      }
      layer.qkv.lora.add_to(qkv, x, token_slots);
      if (layer.q_norm.has_value()) {
        RECORD_FUNCTION("rankcast::head_rms_norm", std::vector<c10::IValue>());
        head_rms_norm_(qkv, 0, heads_, head_dim_, *layer.q_norm, eps_);
        head_rms_norm_(qkv, heads_, kv_heads_, head_dim_, *layer.k_norm, eps_);
      }
      if (!layer.rotates && !unrotated.defined()) unrotated = at::zeros_like(positions);
      const bool own_group = layer.kv_group != 0;
      TORCH_CHECK(!own_group || (window_slot_mapping.has_value() && window_block_tables.has_value()),
                  "DecoderStack.forward: a layer in the window group needs its slots and tables");
      const at::Tensor& slots = own_group ? *window_slot_mapping : slot_mapping;
      const at::Tensor& tables = own_group ? *window_block_tables : block_tables;
      {
        RECORD_FUNCTION("rankcast::rotary_embedding_cache", std::vector<c10::IValue>());
        rotary_embedding_cache(qkv, layer.rotates ? positions : unrotated,
                               layer.cos_sin.has_value() ? *layer.cos_sin : cos_sin_,
                               layer.key_cache, layer.value_cache, slots, heads_, kv_heads_,
                               layer.key_scale, layer.value_scale);
      }
      at::Tensor attn = at::empty({tokens, heads_, head_dim_}, hidden.options());
      {
        RECORD_FUNCTION("rankcast::paged_attention", std::vector<c10::IValue>());
        at::Tensor q = qkv.narrow(1, 0, heads_ * head_dim_).view({tokens, heads_, head_dim_});
        paged_attention(attn, q, layer.key_cache, layer.value_cache, tables, seq_lens,
                        query_start, scale_, layer.window, layer.key_scale, layer.value_scale);
      }
      at::Tensor h;
      {
        RECORD_FUNCTION("rankcast::packed_linear[o]", std::vector<c10::IValue>());
        at::Tensor flat = attn.view({tokens, heads_ * head_dim_});
        h = layer.o(flat);
        layer.o.lora.add_to(h, flat, token_slots);
      }
      {
        RECORD_FUNCTION("rankcast::add_rms_norm", std::vector<c10::IValue>());
        if (layer.pre_ff_norm.has_value()) {
          x = add_rms_norm(rms_norm(h, layer.post_norm, eps_), res, *layer.pre_ff_norm, eps_);
        } else {
          x = add_rms_norm(h, res, layer.post_norm, eps_);
        }
      }
      if (layer.moe) {
        hidden = layer.moe->forward(x);
      } else {
        at::Tensor gate_up;
        {
          RECORD_FUNCTION("rankcast::packed_linear[gate_up]", std::vector<c10::IValue>());
          gate_up = layer.gate_up(x);
        }
        layer.gate_up.lora.add_to(gate_up, x, token_slots);
        at::Tensor act;
        {
          RECORD_FUNCTION("rankcast::act_and_mul", std::vector<c10::IValue>());
          act = layer.gelu_tanh ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
        }
        {
          RECORD_FUNCTION("rankcast::packed_linear[down]", std::vector<c10::IValue>());
          hidden = layer.down(act);
        }
        layer.down.lora.add_to(hidden, act, token_slots);
      }
      if (layer.post_ff_norm.has_value()) {
        RECORD_FUNCTION("rankcast::rms_norm", std::vector<c10::IValue>());
        hidden = rms_norm(hidden, *layer.post_ff_norm, eps_);
      }
    }
    return {hidden, res};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor cos_sin_;
  std::vector<Layer> layers_;
};

void register_decoder_stack(torch::Library& m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_lora", &DecoderStack::set_lora)
      .def("set_attention", &DecoderStack::set_attention)
      .def("set_rope_and_group", &DecoderStack::set_rope_and_group)
      .def("set_block", &DecoderStack::set_block)
      .def("set_kv_scales", &DecoderStack::set_kv_scales)
      .def("set_moe", &DecoderStack::set_moe)
      .def("forward", &DecoderStack::forward);
}

}  // namespace rankcast
