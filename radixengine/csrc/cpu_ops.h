// Native CPU ops of radixengine (declarations; bindings in cpu_bindings.cpp).
//
// The KV cache is a paged pool: per layer, K and V buffers [num_slots, num_kv_heads, head_dim]
// and req_to_token [max_reqs, max_context_len] (int32) mapping (request row, position) -> slot.
// The attention ops read K/V through req_to_token in place.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace radixengine::cpu {

// q [bs, H, D]; each request b attends over positions 0..seq_lens[b]-1 of row
// req_pool_indices[b]. num_kv_splits: 0 picks a split of long sequences across threads
// automatically; n > 0 forces n splits (for tests). Returns [bs, H, D] in q's dtype.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_buffer,
                               const torch::Tensor& v_buffer, const torch::Tensor& req_to_token,
                               const torch::Tensor& req_pool_indices,
                               const torch::Tensor& seq_lens, double scale,
                               int64_t num_kv_splits);

// q [T, H, D] holds the new tokens of each request (request b: rows extend_start_loc[b] ..
// + extend_seq_lens[b]); token j of request b is at absolute position prefix_b + j, with
// prefix_b = seq_lens[b] - extend_seq_lens[b], and attends causally over positions
// 0..prefix_b + j. Returns [T, H, D] in q's dtype.
torch::Tensor extend_attention(const torch::Tensor& q, const torch::Tensor& k_buffer,
                               const torch::Tensor& v_buffer, const torch::Tensor& req_to_token,
                               const torch::Tensor& req_pool_indices,
                               const torch::Tensor& seq_lens,
                               const torch::Tensor& extend_seq_lens,
                               const torch::Tensor& extend_start_loc, double scale);

// k_buffer[loc[t]] = k[t], v_buffer[loc[t]] = v[t] (in place).
void set_kv_buffer(torch::Tensor& k_buffer, torch::Tensor& v_buffer, const torch::Tensor& loc,
                   const torch::Tensor& k, const torch::Tensor& v);

// Row-wise RMSNorm of x [tokens, hidden]: x * rsqrt(mean(x^2) + eps) * weight (bf16: the
// normalised row is rounded to bf16 before the weight multiply, as the torch module does).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                        double eps);

// In place, neox style: for each token t and head h, the first rotary_dim features of
// x[t, h] = (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) with cos | sin read from
// cos_sin_cache [max_position, rotary_dim] at positions[t].
void rotary_embedding(const torch::Tensor& positions, torch::Tensor& x,
                      const torch::Tensor& cos_sin_cache, int64_t rotary_dim);

// out [T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d] (rows with unit stride).
torch::Tensor silu_and_mul(const torch::Tensor& x);

// out [M, N] = x [M, K] (float32, contiguous) times the transpose of a GGUF block-quantized
// weight [N, K] given as its raw blocks: qweight uint8 [N, K / 32 * block bytes], qtype the
// GGML type id (Q4_1 = 3, Q8_0 = 8). Dequantized exactly as gguf-py does; no bias.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype);

// The instruction set the extension was compiled for: "avx512", "avx2" or "scalar".
std::string isa();

}  // namespace radixengine::cpu
