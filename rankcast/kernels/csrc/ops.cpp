// Registers rankcast's CPU kernels as torch operators (torch.ops.rankcast.*), and binds the
// OpenMP threads of a process to cores.
//
// Registering through the dispatcher rather than a Python module keeps the library free of
// pybind11 (faster to build) and lets the operators be called from Python and C++ alike.
#include <ATen/ATen.h>
#include <omp.h>
#include <sched.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace rankcast {

void register_decoder_stack(torch::Library& m);
void register_moe_experts(torch::Library& m);

namespace {

// Pin OpenMP thread i of this process to cpus[i]. Each thread of one parallel region sets its
// own affinity, which is the only way to reach the pool's threads from outside the runtime.
// Returns how many threads were bound.
int64_t bind_threads(at::IntArrayRef cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "bind_threads: no CPUs given");
  std::vector<int> failures(n, 0);
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    failures[i] = sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  int64_t bound = 0;
  for (int f : failures) bound += f == 0;
  return bound;
}

}  // namespace

TORCH_LIBRARY(rankcast, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start, float scale, int window=0, "
      "Tensor? key_scale=None, Tensor? value_scale=None) -> ()");
  m.def(
      "rotary_embedding_cache(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, "
      "Tensor(b!)? key_cache, Tensor(c!)? value_cache, Tensor slot_mapping, int heads, "
      "int kv_heads, Tensor(d!)? key_scale=None, Tensor(e!)? value_scale=None) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
  m.def(
      "lora_add(Tensor(a!) out, Tensor x, Tensor token_slots, Tensor[] a, Tensor[] b, "
      "int[] out_offsets, int rank) -> ()");
  m.def("lora_tiles_supported() -> bool", &lora_tiles_supported);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("pack_linear_weight_(Tensor(a!) weight) -> Tensor(a!)");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, Tensor? scales=None) -> Tensor");
  m.def("pack_int8_weight(Tensor values, ScalarType activations) -> Tensor");
  m.def("packed_linear_supported(ScalarType dtype) -> bool", &gemm_supported);
  m.def("pack_q4_weight(Tensor values, Tensor scales, Tensor minimums) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q4_supported() -> bool", &q4_supported);
  m.def("pack_q8_weight(Tensor values, Tensor scales) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q8_supported() -> bool", &q8_supported);
  m.def("pack_q6k_weight(Tensor raw) -> Tensor");
  m.def("q6k_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q6k_supported() -> bool", &q6k_supported);
  m.def("pack_w8a8_weight(Tensor weight) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, int n, Tensor scales, Tensor? bias) -> Tensor");
  m.def("w8a8_supported() -> bool", &w8a8_supported);
  m.def("w8a8_path() -> str", &w8a8_path);
  m.def("w8a8_group() -> int", &w8a8_group);
  m.def("build_isa() -> str", &build_isa);
  m.def("bind_threads(int[] cpus) -> int", &bind_threads);
  register_moe_experts(m);  // first: the decoder stack's set_moe takes its class
  register_decoder_stack(m);
}

TORCH_LIBRARY_IMPL(rankcast, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rotary_embedding_cache", &rotary_embedding_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("lora_add", &lora_add);
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("pack_linear_weight_", &pack_linear_weight_);
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_int8_weight", &pack_int8_weight);
  m.impl("pack_q4_weight", &pack_q4_weight);
  m.impl("q4_linear", &q4_linear);
  m.impl("pack_q8_weight", &pack_q8_weight);
  m.impl("q8_linear", &q8_linear);
  m.impl("pack_q6k_weight", &pack_q6k_weight);
  m.impl("q6k_linear", &q6k_linear);
  m.impl("pack_w8a8_weight", &pack_w8a8_weight);
  m.impl("w8a8_linear", &w8a8_linear);
}

}  // namespace rankcast
