// The kernels one translation unit offers another (ops.cpp registers them; decoder_stack.cpp
// chains them for a whole decoder stage without returning to Python between them).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace rankcast {

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                     int64_t window = 0, const c10::optional<at::Tensor>& key_scale = {},
                     const c10::optional<at::Tensor>& value_scale = {});
// key_scale / value_scale: an 8-bit cache's per-token scales (csrc/attention.cpp), else none.
void rotary_embedding_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                            const c10::optional<at::Tensor>& key_cache,
                            const c10::optional<at::Tensor>& value_cache,
                            const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads,
                            const c10::optional<at::Tensor>& key_scale = {},
                            const c10::optional<at::Tensor>& value_scale = {});
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& token_slots, at::TensorList a,
              at::TensorList b, at::IntArrayRef out_offsets, int64_t rank);
// The same for slots of bfloat16 A and B packed for AMX tiles (csrc/lora_amx.cpp), which
// `lora_add` hands on; `lora_tiles_supported` says whether this build and process run them.
void lora_add_tiles(at::Tensor& out, const at::Tensor& x, const int64_t* slots, at::TensorList a,
                    at::TensorList b, at::IntArrayRef out_offsets, int64_t rank);
bool lora_tiles_supported();
bool gemm_supported(at::ScalarType dtype);
// The instruction set this build's matmul runs: "amx" (bfloat16 on AMX tiles, csrc/gemm_amx.cpp;
// an AMX build whose tiles the OS refuses says "avx512-bf16"), "avx512-bf16", "avx512", "avx2" or
// "other" (docs/cpu-paths.md).
std::string build_isa();
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor pack_linear_weight_(at::Tensor& weight);
// int8 weights (weight-only: rows stay float32 or bfloat16) packed for the rows' dtype; then
// `packed_linear` takes them with their per-column scales.
at::Tensor pack_int8_weight(const at::Tensor& values, at::ScalarType activations);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& scales);
// 4-bit groups of 32 with a float16 scale and minimum (llama.cpp's Q4_1; csrc/gemm_q4.cpp).
bool q4_supported();
at::Tensor pack_q4_weight(const at::Tensor& values, const at::Tensor& scales,
                          const at::Tensor& minimums);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias);
// 8-bit groups of 32 with a float16 scale (llama.cpp's Q8_0; csrc/gemm_q8.cpp).
bool q8_supported();
at::Tensor pack_q8_weight(const at::Tensor& values, const at::Tensor& scales);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias);
// llama.cpp's Q6_K as stored: 256-k super-blocks, float16 d, int8 scale per 16 k, 6-bit values
// (csrc/gemm_q6k.cpp; AVX-512 builds).
bool q6k_supported();
at::Tensor pack_q6k_weight(const at::Tensor& raw);
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const c10::optional<at::Tensor>& bias);
// W8A8 (csrc/gemm_w8a8.cpp): whether this build has the kernel, which instructions it runs
// ("avx512-vnni", "avx512bw", "avx2" or "none"), and how many k its packing groups.
bool w8a8_supported();
std::string w8a8_path();
int64_t w8a8_group();
at::Tensor pack_w8a8_weight(const at::Tensor& weight);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias);

}  // namespace rankcast
